"""Every reserved notification engines send each other, and the features they announce.

Sans-I/O: encoders, decoders and constants only. Reserved notifications start with
:data:`RESERVED` and are never delivered to callers: the liveness probe, the goodbye of a
closing engine, packed notifications of a merged request, and the push-read messages
(see :mod:`aionixl._push` for that exchange).
"""

from __future__ import annotations

import hashlib

import msgspec

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
#: Longest push request the server decodes (ids are 4 bytes each, two lists).
MAX_PUSH_REQUEST = 64 << 20


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
    return (PLOST if lost else PERR) + _encoder.encode(PushError(rid, reason))


def decode_push_request(payload: bytes) -> PushRequest:
    """Raises ``msgspec.DecodeError`` or ``msgspec.ValidationError`` for a malformed one."""
    return _request_decoder.decode(payload)


def decode_push_error(payload: bytes) -> PushError:
    return _error_decoder.decode(payload)


# ---- packed notifications of merged requests ----------------------------------------------


def pack_notifications(messages: list[bytes]) -> bytes:
    return MULTI + msgspec.msgpack.encode(messages)


def unpack_notifications(message: bytes) -> list[bytes]:
    """The messages packed by :func:`pack_notifications`; [] for anything malformed."""
    try:
        messages = _decode_messages(memoryview(message)[len(MULTI):])
    except msgspec.DecodeError:
        return []
    return [m for m in messages if not m.startswith(RESERVED)]


_decode_messages = msgspec.msgpack.Decoder(list[bytes]).decode


def pack_tagged(tag: int, messages: list[bytes]) -> bytes:
    return TAGGED + _encode_tagged((tag, messages))


def unpack_tagged(message: bytes) -> tuple[int, list[bytes]] | None:
    """The tag and messages packed by :func:`pack_tagged`; None for anything malformed."""
    try:
        tag, messages = _decode_tagged(memoryview(message)[len(TAGGED):])
    except msgspec.DecodeError:
        return None
    return tag, [m for m in messages if not m.startswith(RESERVED)]


_encode_tagged = msgspec.msgpack.encode
_decode_tagged = msgspec.msgpack.Decoder(tuple[int, list[bytes]]).decode


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


def user_message(value: object, what: str) -> bytes:
    """A caller's notification as bytes; the engine's own reserved prefix is refused."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what} must be bytes")
    message = bytes(value)
    if message.startswith(RESERVED):
        raise ValueError(f"{what}: messages starting with b'\\x00aionixl-' are reserved for the engine")
    return message
