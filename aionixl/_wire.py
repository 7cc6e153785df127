"""Every reserved notification engines send each other, and the features they announce.

Sans-I/O: encoders, decoders and constants only. Reserved notifications start with
:data:`RESERVED` and are never delivered to callers: the liveness probe, the goodbye of a
closing engine, packed notifications of a merged request, and the push-read messages
(see :mod:`aionixl._push` for that exchange).
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from ._config import MAX_COALESCE_BLOCKS

RESERVED = b"\x00aionixl-"
PROBE = RESERVED + b"probe\x00"
GOODBYE = RESERVED + b"goodbye\x00"

#: One notification carrying several callers' messages (a coalesced transfer's): the
#: receiving engine unpacks it and delivers each. Engines before "tagged-notify" sent these;
#: this one still unpacks them, and sends only tagged ones (``pack_tagged``).
MULTI_NOTIFY = "multi-notify"
MULTI = RESERVED + b"multi\x00"

#: The messages of a merged request that may be posted again (a member left while it ran),
#: with the request's tag: the receiver delivers a tag once. A re-post carries the first
#: post's tag and a subset of its messages, so a tag seen before means every message in it
#: arrived already (NIXL may have delivered the aborted post's notification). Only sent to
#: peers announcing "tagged-notify".
TAGGED_NOTIFY = "tagged-notify"
TAGGED = RESERVED + b"tagged\x00"

#: The feature a peer announces in its handshake when it serves push requests.
PUSH_FEATURE = "push-read"

#: The feature a peer announces when it serves push requests for parts of blocks
#: (``PushRequest.dst_part``/``src_part``). An engine without it would ignore those fields
#: and push whole blocks, so such reads are never sent to it.
PARTS_FEATURE = "push-parts"

#: The feature a peer announces when it serves push requests into the reader's staging
#: slots (``PushRequest.staged``; the slots' geometry comes in the reader's handshake).
STAGED_FEATURE = "push-staged"

#: Features this engine speaks, announced in the handshake. A peer uses one only when the
#: other side announced it too.
FEATURES: frozenset[str] = frozenset({MULTI_NOTIFY, PUSH_FEATURE, TAGGED_NOTIFY, PARTS_FEATURE,
                                      STAGED_FEATURE})

# ---- push reads: reader -> server PUSH and PCANCEL; server -> reader PDONE, PERR, PGONE, PLOST ----

PUSH = RESERVED + b"push\x00"
PCANCEL = RESERVED + b"pcancel\x00"
PDONE = RESERVED + b"pdone\x00"
PERR = RESERVED + b"perr\x00"
PGONE = RESERVED + b"pgone\x00"
#: The read failed and bytes of it may still land (a chunk ended without completing):
#: unlike PERR, not a word that the reader may reuse what it was landing in.
PLOST = RESERVED + b"plost\x00"
PUSH_FAMILY = (PUSH, PCANCEL, PDONE, PERR, PGONE, PLOST)
#: The longest ``notify`` a push request may carry (the reader checks it before asking).
MAX_PUSH_NOTIFY = 1 << 20
#: The longest PERR/PLOST payload decoded (a request id and a reason clipped to
#: ``MAX_REASON`` characters, each up to 4 bytes of UTF-8).
MAX_REASON = 1000
MAX_PUSH_ERROR = 4 * MAX_REASON + 64
#: The most messages one packed notification may carry: a merged request has at most
#: ``EngineConfig.coalesce_max_blocks`` members, which the config bounds by this.
MAX_PACKED_MESSAGES = MAX_COALESCE_BLOCKS

# ---- what a peer sends us, decoded totally ------------------------------------------------

#: The kinds of reserved message, by prefix: ``metrics().messages_refused`` counts refused
#: ones by these names ("reserved": a reserved prefix of no known kind).
KINDS: dict[bytes, str] = {PROBE: "probe", GOODBYE: "goodbye", MULTI: "multi", TAGGED: "tagged",
                           PUSH: "push", PCANCEL: "pcancel", PDONE: "pdone", PERR: "perr",
                           PGONE: "pgone", PLOST: "plost"}


#: Every kind ``metrics().messages_refused`` counts: the reserved kinds, "reserved" (a
#: reserved prefix of no known kind), "relayed" (a reserved message at the agent that
#: serves vLLM decoders, where peers have no business) and "heartbeat" (vLLM's lease
#: heartbeat, over its bound).
REFUSAL_KINDS: tuple[str, ...] = (*KINDS.values(), "reserved", "relayed", "heartbeat")


class WireError(ValueError):
    """A peer's message that does not decode or validate: refused, never raised to callers."""


def kind_of(message: bytes) -> str:
    """The kind of a reserved message (``KINDS``), for counting refusals."""
    for prefix, kind in KINDS.items():
        if message.startswith(prefix):
            return kind
    return "reserved"


def _decode(decoder: msgspec.msgpack.Decoder[Any], payload: bytes | memoryview, limit: int,
            what: str) -> Any:
    """Total decoding: the size is checked first, and whatever decoding raises (msgspec's
    errors, ``RecursionError`` for values nested past the interpreter's recursion limit,
    ``MemoryError``) becomes a :class:`WireError`."""
    if len(payload) > limit:
        raise WireError(f"{what} of {len(payload)} bytes is over its {limit}-byte limit")
    try:
        return decoder.decode(payload)
    except Exception as exc:
        raise WireError(f"malformed {what}: {type(exc).__name__}: {str(exc)[:200]}") from None


def _array_length(payload: bytes | memoryview, what: str) -> int:
    """The length a msgpack array's header announces, read before anything is decoded."""
    if not payload:
        raise WireError(f"malformed {what}: empty")
    head = payload[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    size = {0xDC: 2, 0xDD: 4}.get(head)
    if size is None or len(payload) < 1 + size:
        raise WireError(f"malformed {what}: not an array")
    return int.from_bytes(payload[1:1 + size], "big")


class PushRequest(msgspec.Struct, frozen=True, array_like=True):
    """What a reader asks of the server: block ids as little-endian int32 arrays."""

    rid: int
    dst: bytes  # the reader's destination block ids
    src: bytes  # the server's source block ids
    timeout: float  # the reader's deadline for the whole read, in seconds
    notify: bytes = b""  # delivered to the server's mailbox once the data landed
    #: Parts of blocks, as ``BlockPart`` (index, count, groups); None for whole blocks.
    #: Absent from the requests of engines before ``PARTS_FEATURE`` (whole blocks).
    dst_part: tuple[int, int, int] | None = None  # of the reader's blocks
    src_part: tuple[int, int, int] | None = None  # of the server's blocks
    #: ``dst`` names the reader's staging slots, not its blocks (``STAGED_FEATURE``).
    staged: bool = False
    #: The reader's :func:`incarnation` (empty from older readers): a request an earlier
    #: process of that name sent, delivered late, is not taken for its successor's.
    reader: bytes = b""


class PushError(msgspec.Struct, frozen=True, array_like=True):
    rid: int
    reason: str


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(PushRequest)
_error_decoder = msgspec.msgpack.Decoder(PushError)
#: Bytes of a push request besides its id lists and ``notify``: the array header, id,
#: timeout, parts, flags and the reader's incarnation take about 100; the rest is room for
#: fields later versions may add (decoders skip unknown trailing fields).
_PUSH_REQUEST_FRAME = 1024


def rid_bytes(rid: int) -> bytes:
    return rid.to_bytes(8, "little")


def incarnation(metadata: bytes) -> bytes:
    """Which process of a name an agent is: 8 bytes of a digest of its NIXL metadata
    (each process has its own). A PCANCEL carries it after the request id."""
    return hashlib.blake2b(metadata, digest_size=8).digest()


def rid_of(payload: bytes) -> int:
    """The request id at the start of a PDONE/PGONE/PCANCEL payload."""
    return int.from_bytes(payload[:8], "little")


def push_request(request: PushRequest) -> bytes:
    return PUSH + _encoder.encode(request)


def push_error(rid: int, reason: str, *, lost: bool = False) -> bytes:
    """PERR (nothing of the read is outstanding), or PLOST with ``lost``."""
    return (PLOST if lost else PERR) + _encoder.encode(PushError(rid, reason[:MAX_REASON]))


def max_push_request(ids: int) -> int:
    """The longest push request a reader naming at most ``ids`` blocks (or staging slots)
    may send: two int32 lists of that many ids and a ``notify`` of ``MAX_PUSH_NOTIFY``."""
    return 2 * 4 * ids + MAX_PUSH_NOTIFY + _PUSH_REQUEST_FRAME


def decode_push_request(payload: bytes | memoryview, ids: int) -> PushRequest:
    """A push request from a reader of at most ``ids`` destination blocks; ``WireError``
    for one too long for that or malformed."""
    request: PushRequest = _decode(_request_decoder, payload, max_push_request(ids), "push request")
    return request


def decode_push_error(payload: bytes | memoryview) -> PushError:
    """A PERR/PLOST payload; ``WireError`` for one too long or malformed."""
    error: PushError = _decode(_error_decoder, payload, MAX_PUSH_ERROR, "push error")
    return error


def rid_payload(payload: bytes, what: str, incarnation: bool = False) -> int:
    """The request id a PDONE/PGONE (8 bytes) or, with ``incarnation``, a PCANCEL (8, or
    16 with the reader's incarnation) payload carries; ``WireError`` for another length."""
    if len(payload) != 8 and not (incarnation and len(payload) == 16):
        raise WireError(f"malformed {what}: {len(payload)} bytes")
    return rid_of(payload)


# ---- packed notifications of merged requests ----------------------------------------------


def pack_notifications(messages: list[bytes]) -> bytes:
    return MULTI + msgspec.msgpack.encode(messages)


def unpack_notifications(message: bytes) -> list[bytes]:
    """The messages packed by :func:`pack_notifications`; ``WireError`` for a malformed
    one, or one announcing more than ``MAX_PACKED_MESSAGES`` (checked before decoding)."""
    return _messages(memoryview(message)[len(MULTI):])


def _messages(packed: memoryview) -> list[bytes]:
    count = _array_length(packed, "packed notification")
    if count > MAX_PACKED_MESSAGES:
        raise WireError(f"packed notification of {count} messages (at most {MAX_PACKED_MESSAGES})")
    messages: list[bytes] = _decode(_messages_decoder, packed, len(packed), "packed notification")
    return [m for m in messages if not m.startswith(RESERVED)]


_messages_decoder = msgspec.msgpack.Decoder(list[bytes])


def pack_tagged(tag: int, messages: list[bytes]) -> bytes:
    return TAGGED + _encode_tagged((tag, messages))


def unpack_tagged(message: bytes) -> tuple[int, list[bytes]]:
    """The tag and messages packed by :func:`pack_tagged`; ``WireError`` as
    :func:`unpack_notifications`. The messages stay undecoded until the tag is read."""
    packed = memoryview(message)[len(TAGGED):]
    tag, raw = _decode(_tagged_decoder, packed, len(packed), "tagged notification")
    return tag, _messages(memoryview(raw))


_encode_tagged = msgspec.msgpack.encode
_tagged_decoder = msgspec.msgpack.Decoder(tuple[int, msgspec.Raw])


class SeenTags:
    """The tags of the tagged notifications delivered lately, per sender (bounded: a re-post
    follows its first post within the leaver's fence, seconds at most)."""

    __slots__ = ("_seen", "_limit")

    def __init__(self, limit: int = 1 << 14) -> None:
        self._seen: dict[tuple[str, int], None] = {}
        self._limit = limit

    def first(self, sender: str, tag: int) -> bool:
        """Whether ``tag`` from ``sender`` is new (then it is remembered)."""
        key = (sender, tag)
        if key in self._seen:
            return False
        if len(self._seen) >= self._limit:
            del self._seen[next(iter(self._seen))]  # the oldest
        self._seen[key] = None
        return True


def goodbye(metadata: bytes) -> bytes:
    """The goodbye of the engine whose NIXL metadata this is (tagged with its digest)."""
    return GOODBYE + hashlib.sha256(metadata).digest()[:16]


GOODBYE_BYTES = len(GOODBYE) + 16


def user_message(value: object, what: str) -> bytes:
    """A caller's notification as bytes; the engine's own reserved prefix is refused."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what} must be bytes")
    message = bytes(value)
    if message.startswith(RESERVED):
        raise ValueError(f"{what}: messages starting with b'\\x00aionixl-' are reserved for the engine")
    return message
