"""The handshake wire format, sans I/O.

One request (``Hello``) and one reply (``Welcome`` or ``Reject``), msgpack-encoded with
msgspec, strictly decoded. Every message starts with the protocol version so that a peer
speaking another version gets a clear ``Reject`` instead of a decode error. New fields must
come with defaults (msgspec then accepts messages without them), which is how the format
evolves without a version bump.
"""

from __future__ import annotations

import hashlib
import hmac
import math
import secrets
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import msgspec

from ._regions import Region

PROTOCOL_VERSION = 1

#: The codes this version sends. ``Reject.code`` decodes as any string, so that a newer
#: peer's new codes reach older clients as plain refusals instead of decode errors.
RejectCode = Literal["incompatible", "version", "bad-request", "self", "internal", "draining",
                     "unauthorized"]


class RegionInfo(msgspec.Struct, frozen=True, array_like=True):
    """A region as the peer sees it: enough to build descriptors for its blocks."""

    base: int
    stride: int
    block_bytes: int
    num_blocks: int
    mem_type: Literal["DRAM", "VRAM"]
    device: int

    @classmethod
    def of(cls, r: Region) -> RegionInfo:
        mem: Literal["DRAM", "VRAM"] = "VRAM" if r.mem_type == "VRAM" else "DRAM"
        return cls(r.base, r.stride, r.block_bytes, r.num_blocks, mem, r.device)

    def to_region(self) -> Region:
        return Region(self.base, self.stride, self.block_bytes, self.num_blocks, self.mem_type,
                      self.device)


class _EngineInfo(msgspec.Struct, frozen=True):
    """What each side tells the other about itself."""

    version: int
    name: str
    agent_metadata: bytes
    regions: list[RegionInfo]
    compat: dict[str, str]
    compat_hash: str
    #: Freshness, checked when engines share a secret: a random value the Welcome must echo,
    #: and the sender's clock (a replayed Hello is either stale or a nonce seen before).
    nonce: bytes = b""
    sent_at: float = 0.0
    #: What the sender's engine can do beyond protocol v1 (see ``aionixl._peers.FEATURES``);
    #: an engine that predates a feature sends none, and is never asked to use it.
    features: list[str] = msgspec.field(default_factory=list)
    #: Facts about where the sender runs, for choices that depend on the path between two
    #: engines (for example the read mode): opaque strings, compared for equality only.
    host: dict[str, str] = msgspec.field(default_factory=dict)
    #: The sender refuses peers whose bytes per block differ from its own
    #: (``EngineConfig.require_equal_geometry``): the receiver then refuses such a peer
    #: too, so that no listener keeps a peer whose client refused its Welcome.
    equal_geometry: bool = False
    #: The sender's staging slots for push reads (``aionixl._staging``): one region per
    #: block region, same bytes per block, DRAM; empty when it has none.
    staging: list[RegionInfo] = msgspec.field(default_factory=list)


class Hello(_EngineInfo, frozen=True, tag="hello"):
    """Sent by the connecting engine."""


class Welcome(_EngineInfo, frozen=True, tag="welcome"):
    """The listener accepted: here is how to reach its memory."""


class Reject(msgspec.Struct, frozen=True, tag="reject"):
    """The listener refused, and says why."""

    version: int
    code: str
    reason: str
    field: str | None = None


class _VersionOnly(msgspec.Struct):
    version: int


def clip(text: str, limit: int = 300) -> str:
    """Peer-supplied text goes into logs and replies only this long."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} chars)"


def clip_host(host: dict[str, str], entries: int = 16, limit: int = 200) -> dict[str, str]:
    """A peer's ``host`` facts, bounded: at most ``entries`` of at most ``limit`` chars each."""
    return {clip(k, limit): clip(v, limit) for k, v in list(host.items())[:entries]}


class ProtocolError(Exception):
    """A message did not decode or validate. ``code`` says how to reject it."""

    def __init__(self, message: str, code: RejectCode = "bad-request") -> None:
        super().__init__(clip(message))
        self.code = code


class Incompatible(Exception):
    """Two engines cannot exchange blocks; ``field`` names the first difference."""

    def __init__(self, message: str, field: str) -> None:
        super().__init__(clip(message))
        self.field = clip(field, 100)


_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(Hello)
_reply_decoder = msgspec.msgpack.Decoder(Welcome | Reject)
_version_decoder = msgspec.msgpack.Decoder(_VersionOnly)


def encode(message: Hello | Welcome | Reject) -> bytes:
    return _encoder.encode(message)


def _decode(data: bytes, decoder: msgspec.msgpack.Decoder[Any], limit: int) -> object:
    if len(data) > limit:
        raise ProtocolError(f"message of {len(data)} bytes exceeds the {limit}-byte limit")
    try:
        message = decoder.decode(data)
    except RecursionError as exc:  # msgspec recurses into nested containers
        raise ProtocolError("malformed handshake message: nested too deeply") from exc
    except MemoryError as exc:
        raise ProtocolError("malformed handshake message: too large to decode") from exc
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        version = _peek_version(data)
        if version is not None and version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"peer speaks handshake protocol v{version}, we speak v{PROTOCOL_VERSION}",
                "version",
            ) from exc
        raise ProtocolError(f"malformed handshake message: {exc}") from exc
    version = getattr(message, "version", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"peer speaks handshake protocol v{version}, we speak v{PROTOCOL_VERSION}", "version"
        )
    return message


def _peek_version(data: bytes) -> int | None:
    try:
        return _version_decoder.decode(data).version
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        return None


def decode_hello(data: bytes, limit: int) -> Hello:
    message = _decode(data, _request_decoder, limit)
    assert isinstance(message, Hello)
    _validate_regions(message.regions)
    if not message.name:
        raise ProtocolError("engine name is empty")
    return message


def decode_reply(data: bytes, limit: int) -> Welcome | Reject:
    message = _decode(data, _reply_decoder, limit)
    assert isinstance(message, (Welcome, Reject))
    if isinstance(message, Welcome):
        _validate_regions(message.regions)
    return message


def _validate_regions(regions: Sequence[RegionInfo]) -> None:
    if not regions:
        raise ProtocolError("peer describes no regions")
    counts = {r.num_blocks for r in regions}
    if len(counts) != 1:
        raise ProtocolError("peer regions disagree on the number of blocks")
    for i, r in enumerate(regions):
        if min(r.base, r.stride, r.device) < 0 or r.block_bytes < 1 or r.num_blocks < 1:
            raise ProtocolError(f"peer region {i} has an impossible geometry: {r}")
        if r.num_blocks > 1 and r.stride < r.block_bytes:
            raise ProtocolError(f"peer region {i} has overlapping blocks")
    if len(regions) * regions[0].num_blocks > 2**31 - 1:
        raise ProtocolError("peer has more blocks than fit in int32 indices")


#: How far a signed Hello's clock may be from ours, and how long its nonce is remembered.
FRESHNESS_WINDOW = 120.0


def _tag(payload: bytes, secret: bytes) -> bytes:
    return hmac.new(secret, payload, hashlib.sha256).digest()


def seal(payload: bytes, secret: bytes | None) -> list[bytes]:
    """The frames to send: the payload, then its HMAC-SHA256 tag when there is a secret.

    The tag covers the bytes as sent (not a re-encoding of what we decoded), so a newer
    peer's extra fields do not break it.
    """
    return [payload] if secret is None else [payload, _tag(payload, secret)]


def unseal(frames: Sequence[bytes], secret: bytes | None, *, tag_optional: bool = False) -> bytes:
    """The payload of received frames; with a secret, only if its tag is right.

    Without a secret a tag frame is refused unless ``tag_optional``: a listener must not
    admit a peer that signs (it would refuse our unsigned Welcome and leave us holding it),
    while a client still wants to read a signed refusal.
    """
    if not 1 <= len(frames) <= 2:
        raise ProtocolError(f"expected a payload frame and at most a tag, got {len(frames)} frames")
    if secret is None and len(frames) == 2 and not tag_optional:
        raise ProtocolError("the handshake is signed, but this engine has no handshake_secret",
                            "unauthorized")
    if secret is not None and (len(frames) != 2
                               or not hmac.compare_digest(frames[1], _tag(frames[0], secret))):
        raise ProtocolError("the handshake is not signed with this engine's secret", "unauthorized")
    return frames[0]


def new_nonce() -> bytes:
    return secrets.token_bytes(16)


class ReplayGuard:
    """Refuses signed Hellos that are stale, future-dated, or carry a nonce seen before."""

    def __init__(self, window: float = FRESHNESS_WINDOW) -> None:
        self._window = window
        self._seen: dict[bytes, float] = {}

    def check(self, hello: Hello, now: float) -> None:
        if not math.isfinite(hello.sent_at) or abs(now - hello.sent_at) > self._window:
            raise ProtocolError("the signed handshake is stale or future-dated", "unauthorized")
        if len(hello.nonce) < 16 or hello.nonce in self._seen:
            raise ProtocolError("the signed handshake was replayed", "unauthorized")
        for nonce in [n for n, t in self._seen.items() if now - t > 2 * self._window]:
            del self._seen[nonce]
        self._seen[hello.nonce] = now


def compat_hash(regions: Sequence[Region], compat: Mapping[str, str]) -> str:
    """A digest of what two engines must agree on: region count, block sizes, compat keys.

    Addresses, block counts and memory kinds may differ between peers; they are not hashed.
    """
    h = hashlib.sha256(b"aionixl-compat-v1")
    h.update(len(regions).to_bytes(8, "little"))
    for r in regions:
        h.update(r.block_bytes.to_bytes(8, "little"))
    h.update(msgspec.msgpack.encode(sorted(compat.items())))
    return h.hexdigest()[:32]


def check_compatible(
    ours: Sequence[Region],
    our_compat: Mapping[str, str],
    theirs: Sequence[RegionInfo],
    their_compat: Mapping[str, str],
    *,
    equal_geometry: bool = False,
    max_descriptors: int | None = None,
) -> None:
    """Raise ``Incompatible`` naming the first field that differs: the region count, the
    compat keys, and with ``equal_geometry`` the bytes per block of each region (peers
    whose blocks differ in size move parts of blocks, ``aionixl.BlockPart``); or a peer
    whose blocks would take more than ``max_descriptors`` descriptors (regions x blocks)
    to describe, checked before anything is allocated for it."""
    if len(ours) != len(theirs):
        raise Incompatible(
            f"region count differs: we have {len(ours)}, the peer has {len(theirs)}",
            "region_count",
        )
    if max_descriptors is not None:
        check_descriptors(theirs, max_descriptors, "num_blocks", "its blocks")
    for i, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        if equal_geometry and a.block_bytes != b.block_bytes:
            raise Incompatible(
                f"bytes per block of region {i} differ: ours {a.block_bytes}, "
                f"the peer's {b.block_bytes}",
                f"bytes_per_block[{i}]",
            )
    for key in sorted(set(our_compat) | set(their_compat)):
        if our_compat.get(key) != their_compat.get(key):
            raise Incompatible(
                f"compat[{key!r}] differs: ours {our_compat.get(key)!r}, "
                f"the peer's {their_compat.get(key)!r}",
                f"compat[{key}]",
            )


def check_hash(expected: str, got: str) -> None:
    """Geometry matched field by field yet the digests differ: different hashing rules."""
    if expected != got:
        raise Incompatible("compatibility hash differs", "compat_hash")


def check_descriptors(regions: Sequence[RegionInfo], limit: int, field: str, what: str) -> None:
    """``Incompatible`` naming ``field`` when ``regions`` take more than ``limit``
    descriptors (one per region and block) to describe."""
    if regions and len(regions) * regions[0].num_blocks > limit:
        raise Incompatible(
            f"{what} would take {len(regions)} x {regions[0].num_blocks} descriptors, more than "
            f"the {limit} this engine prepares for a peer (Tuning.max_peer_descriptors)", field)


def check_peer(ours: Sequence[Region], our_compat: Mapping[str, str], our_hash: str,
               peer: _EngineInfo, *, equal_geometry: bool, max_descriptors: int) -> None:
    """Everything a handshake checks of a peer's ``Hello`` or ``Welcome``
    (:func:`check_compatible`, the descriptors its staging slots take too), and its compat
    hash where the hash covers the same inputs: it hashes block sizes, so it differs for a
    peer whose blocks differ, which is admitted unless ``equal_geometry`` (ours or the
    peer's) asks for equal ones."""
    check_compatible(ours, our_compat, peer.regions, peer.compat,
                     equal_geometry=equal_geometry or peer.equal_geometry, max_descriptors=max_descriptors)
    check_descriptors(peer.staging, max_descriptors, "staging", "its staging slots")
    if [r.block_bytes for r in ours] == [r.block_bytes for r in peer.regions]:
        check_hash(our_hash, peer.compat_hash)


#: The most staging slots a peer may announce (a bound on the descriptors we prepare).
MAX_STAGING_SLOTS = 1 << 16


def check_staging(regions: Sequence[RegionInfo], staging: Sequence[RegionInfo]) -> None:
    """A peer's staging slots mirror its regions: ``ProtocolError`` otherwise."""
    if not staging:
        return
    if len(staging) != len(regions):
        raise ProtocolError(f"{len(staging)} staging regions for {len(regions)} regions")
    slots = staging[0].num_blocks
    if not 1 <= slots <= MAX_STAGING_SLOTS:
        raise ProtocolError(f"staging slots out of range: {slots}")
    for i, (s, r) in enumerate(zip(staging, regions, strict=True)):
        if s.block_bytes != r.block_bytes or s.num_blocks != slots or s.mem_type != "DRAM" \
                or s.stride < s.block_bytes or s.device != 0 or s.base <= 0 \
                or s.base + slots * s.stride >= 2**64:
            raise ProtocolError(f"staging region {i} does not mirror region {i} in DRAM")
