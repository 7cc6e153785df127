"""vLLM NixlConnector's side channel and notifications, sans I/O.

Written from the observed wire of vLLM 0.32.0 (``NIXL_CONNECTOR_VERSION`` 14), not from its
code. The decode side sends one msgpack frame ``[b"get_meta_msg", pp_rank, tp_rank]`` from a
REQ socket to the prefill's ROUTER; the reply is two frames: a msgpack map
``{compatibility_hash, agent_metadata_bytes}`` and a msgpack float (the prefill's
``perf_counter``, for clock-offset estimates). ``agent_metadata_bytes`` is itself a msgpack
map (vLLM's ``NixlAgentMetadata``): the NIXL agent metadata plus one entry per registered
region (base address, bytes per block, block stride, blocks, memory type).

Requests are freed on the prefill by a notification ``"<request_id>:<consumers>"`` (sent
with the last read of the request); ``"HB:id1,id2"`` extends their leases. Everything here
is pure: it turns bytes into checked values and back, and raises ``VllmWireError`` or
``proto.Incompatible`` for what cannot be used.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from . import _protocol as proto
from ._checks import check_int, check_text
from ._regions import Region

#: The request vLLM's listener answers.
GET_META = b"get_meta_msg"
#: vLLM's heartbeat notification prefix.
HEARTBEAT_PREFIX = b"HB:"


class VllmWireError(Exception):
    """A reply that is not a usable vLLM NixlConnector handshake."""


class VllmRefused(VllmWireError):
    """The listener answered with a refusal (an aionixl listener asked for a rank it does
    not serve, or for something that is not a metadata request)."""


class VllmAgentMetadata(msgspec.Struct, frozen=True):
    """What a vLLM prefill worker says about its KV cache (fields aionixl uses; others ignored).

    Lists are per registered region, in vLLM's region order.
    """

    engine_id: str
    agent_metadata: bytes
    kv_caches_base_addr: list[int]
    device_id: int
    num_blocks: int
    block_lens: list[int]
    block_strides: list[int] | None = None
    kv_cache_layout: str = ""
    block_size: int = 0
    attn_backend_name: str = ""
    physical_blocks_per_logical_kv_block: int = 1
    ssm_sizes: tuple[int, int] = (0, 0)
    region_num_blocks: list[int] | None = None
    region_names: list[str] | None = None
    region_mem_types: list[str] | None = None
    dcp_size: int = 1
    pcp_size: int = 1


class AionixlRoute(msgspec.Struct, frozen=True):
    """An aionixl engine that serves vLLM decoders and also answers aionixl's own handshake:
    where (``address``) and under which agent name (``name``). An aionixl decode connects
    there instead (push reads over UCX TCP, probes, goodbyes); vLLM's decode ignores it."""

    address: str
    name: str


class _Payload(msgspec.Struct, frozen=True, omit_defaults=True):
    compatibility_hash: str
    agent_metadata_bytes: bytes
    #: aionixl's addition to vLLM's payload, absent unless the serving engine listens (an
    #: extra key of a map, which vLLM's decoder skips; a NixlConnector prefill sends none).
    aionixl: AionixlRoute | None = None


class _Refusal(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """aionixl's answer to a request it does not serve (vLLM's own listener has none)."""

    error: str


class VllmHandshake(msgspec.Struct, frozen=True):
    """A decoded reply: the compat hash, the metadata, and the prefill's clock (or None)."""

    compatibility_hash: str
    metadata: VllmAgentMetadata
    remote_clock: float | None
    #: Where the serving engine answers aionixl's handshake, when it is an aionixl engine
    #: that listens for it; None from vLLM's own connector.
    aionixl: AionixlRoute | None = None


_payload_decoder = msgspec.msgpack.Decoder(_Payload)
_metadata_decoder = msgspec.msgpack.Decoder(VllmAgentMetadata)
_clock_decoder = msgspec.msgpack.Decoder(float)
_refusal_decoder = msgspec.msgpack.Decoder(_Refusal)


def encode_request(pp_rank: int = 0, tp_rank: int = 0) -> bytes:
    """The one frame that asks a vLLM listener for the metadata of rank (pp, tp)."""
    check_int(pp_rank, "pp_rank", 0)
    check_int(tp_rank, "tp_rank", 0)
    return msgspec.msgpack.encode([GET_META, pp_rank, tp_rank])


def decode_reply(frames: Sequence[bytes], limit: int) -> VllmHandshake:
    """Decode the listener's reply (the frames after the REQ envelope)."""
    if not 1 <= len(frames) <= 2:
        raise VllmWireError(f"expected 1 or 2 reply frames, got {len(frames)}")
    if sum(len(f) for f in frames) > limit:
        raise VllmWireError(f"reply larger than {limit} bytes")
    if len(frames) == 1:
        try:
            refusal = _refusal_decoder.decode(frames[0])
        except Exception:  # not a refusal (decoding is total: RecursionError too)
            pass
        else:
            raise VllmRefused(refusal.error)
    try:
        payload = _payload_decoder.decode(frames[0])
        metadata = _metadata_decoder.decode(payload.agent_metadata_bytes)
        clock = _clock_decoder.decode(frames[1]) if len(frames) == 2 else None
    except Exception as exc:  # msgspec's errors, RecursionError for nesting, MemoryError
        raise VllmWireError(f"not a vLLM NixlConnector handshake reply: {type(exc).__name__}: "
                            f"{exc}") from None
    if clock is not None and not math.isfinite(clock):
        clock = None
    return VllmHandshake(payload.compatibility_hash, metadata, clock, payload.aionixl)


def regions(md: VllmAgentMetadata, default_mem_type: str) -> list[proto.RegionInfo]:
    """The prefill's regions as aionixl sees peers: one per vLLM region.

    ``default_mem_type`` is used when the metadata does not say (vLLM before connector
    version 11). Raises ``proto.Incompatible`` for layouts aionixl cannot address with one
    block id per block (vLLM's hybrid SSM caches, kernel-split blocks, per-region block
    counts that differ) and ``VllmWireError`` for metadata that contradicts itself.
    """
    n = len(md.kv_caches_base_addr)
    if n == 0:
        raise VllmWireError("the vLLM peer registered no regions")
    strides = md.block_strides if md.block_strides else md.block_lens
    counts = md.region_num_blocks if md.region_num_blocks else [md.num_blocks] * n
    mems = md.region_mem_types if md.region_mem_types else [default_mem_type] * n
    for name, values in (("block_lens", md.block_lens), ("block_strides", strides),
                         ("region_num_blocks", counts), ("region_mem_types", mems)):
        if len(values) != n:
            raise VllmWireError(f"{name} has {len(values)} entries for {n} regions")
    if md.ssm_sizes and any(md.ssm_sizes):
        raise proto.Incompatible("the vLLM peer has SSM (mamba) state regions; aionixl moves "
                                 "attention KV blocks only", "ssm_sizes")
    if md.physical_blocks_per_logical_kv_block != 1:
        raise proto.Incompatible(
            f"the vLLM peer splits each block into {md.physical_blocks_per_logical_kv_block} "
            "kernel blocks", "physical_blocks_per_logical_kv_block")
    if len(set(counts)) != 1:
        raise proto.Incompatible(f"the vLLM peer's regions hold different block counts {sorted(set(counts))}",
                                 "region_num_blocks")
    out = []
    for i in range(n):
        mem = mems[i]
        if mem not in ("DRAM", "VRAM"):
            raise proto.Incompatible(f"region {i} is in {mem!r} memory", f"region_mem_types[{i}]")
        kind: Literal["DRAM", "VRAM"] = "VRAM" if mem == "VRAM" else "DRAM"
        out.append(proto.RegionInfo(md.kv_caches_base_addr[i], strides[i], md.block_lens[i], counts[i],
                                    kind, md.device_id))
    for i, r in enumerate(out):
        if min(r.base, r.stride, r.device) < 0 or r.block_bytes < 1 or r.num_blocks < 1:
            raise VllmWireError(f"region {i} has an impossible geometry: {r}")
        if r.num_blocks > 1 and r.stride < r.block_bytes:
            raise VllmWireError(f"region {i} has overlapping blocks")
    if n * out[0].num_blocks > 2**31 - 1:
        raise VllmWireError("the vLLM peer has more blocks than fit in int32 indices")
    return out


def check_geometry(ours: Sequence[Region], theirs: Sequence[proto.RegionInfo], *,
                   equal_geometry: bool = False, max_descriptors: int | None = None) -> None:
    """The region count must match, and with ``equal_geometry`` the bytes per block of each
    region (a prefill at another TP or block size has other block sizes; parts of blocks
    move between such engines); at most ``max_descriptors`` of the prefill's blocks x
    regions; ``proto.Incompatible`` names the field."""
    proto.check_compatible(ours, {}, theirs, {}, equal_geometry=equal_geometry,
                           max_descriptors=max_descriptors)


def read_notification(request_id: str, consumers: int = 1) -> bytes:
    """The notification that tells a vLLM prefill one of ``consumers`` readers is done.

    vLLM frees the request's blocks when it has seen ``consumers`` of these (one per decode
    worker that reads the request: 1 unless decode runs more TP ranks than prefill).
    """
    check_text(request_id, "request_id")
    check_int(consumers, "consumers", 1)
    if request_id.startswith("HB:"):
        raise ValueError("a request id starting with 'HB:' would read as a heartbeat")
    return f"{request_id}:{consumers}".encode()


def heartbeat_message(request_ids: Iterable[str]) -> bytes:
    """vLLM's lease heartbeat for these (prefill-side) request ids."""
    if isinstance(request_ids, (str, bytes)) or not isinstance(request_ids, Iterable):
        raise ValueError("request_ids must be an iterable of str")
    ids = list(request_ids)
    if not ids:
        raise ValueError("request_ids is empty")
    for rid in ids:
        if not isinstance(rid, str) or not rid or "," in rid:
            raise ValueError(f"request id {rid!r} must be a non-empty str without ','")
    return HEARTBEAT_PREFIX + ",".join(ids).encode()


def parse_notification(message: bytes) -> tuple[str, int] | list[str]:
    """What a vLLM prefill reads from ``message``: (request id, consumers), or heartbeat ids.

    The inverse of the two builders above, for tests and for serving vLLM decoders.
    """
    text = message.decode("utf-8")
    if text.startswith("HB:"):
        return text[3:].split(",")
    rid, sep, count = text.rpartition(":")
    if not sep or not rid:
        raise VllmWireError(f"not a vLLM notification: {message[:80]!r}")
    try:
        return rid, int(count)
    except ValueError:
        raise VllmWireError(f"not a vLLM notification: {message[:80]!r}") from None


# ---- the serving side: answering vLLM decode workers ------------------------------------

#: A metadata request is ~20 bytes; anything much larger is not one.
MAX_REQUEST_BYTES = 1024

_request_decoder = msgspec.msgpack.Decoder(tuple[bytes, int, int])
_encoder = msgspec.msgpack.Encoder()


def decode_request(frames: Sequence[bytes]) -> tuple[int, int]:
    """The (pp_rank, tp_rank) a decode worker asks for (the frames after the envelope)."""
    if len(frames) != 1:
        raise VllmWireError(f"expected one request frame, got {len(frames)}")
    if len(frames[0]) > MAX_REQUEST_BYTES:
        raise VllmWireError(f"request larger than {MAX_REQUEST_BYTES} bytes")
    try:
        tag, pp_rank, tp_rank = _request_decoder.decode(frames[0])
    except Exception as exc:  # msgspec's errors, or RecursionError for nesting: never raised on
        raise VllmWireError(f"{type(exc).__name__}: {exc}") from None
    if tag != GET_META:
        raise VllmWireError(f"unknown request {tag[:32]!r}")
    if pp_rank < 0 or tp_rank < 0:
        raise VllmWireError(f"negative rank ({pp_rank}, {tp_rank})")
    return pp_rank, tp_rank


def serving_metadata(engine_id: str, agent_metadata: bytes, ours: Sequence[proto.RegionInfo], *,
                     block_size: int, kv_cache_layout: str, attn_backend_name: str,
                     layer_names: Sequence[str] | None = None) -> VllmAgentMetadata:
    """This engine's regions as a vLLM decode worker expects a prefill to describe them.

    One vLLM region per aionixl region, in order; every region in one memory kind with one
    block count (what aionixl engines have). ``layer_names``: vLLM's layer name of each
    region (a decode that is told them checks they equal its own; None says nothing).
    ``ValueError`` for a bad argument.
    """
    for value, what in ((engine_id, "engine_id"), (kv_cache_layout, "kv_cache_layout"),
                        (attn_backend_name, "attn_backend_name")):
        check_text(value, what)
    check_int(block_size, "block_size (tokens per block)", 1)
    names = None
    if layer_names is not None:
        names = list(layer_names)
        if isinstance(layer_names, str) or len(names) != len(ours) or \
                not all(isinstance(x, str) and x for x in names):
            raise ValueError(f"layer_names must be {len(ours)} non-empty str, one per region")
    return VllmAgentMetadata(
        engine_id=engine_id, agent_metadata=agent_metadata,
        kv_caches_base_addr=[r.base for r in ours], device_id=ours[0].device,
        num_blocks=ours[0].num_blocks, block_lens=[r.block_bytes for r in ours],
        block_strides=[r.stride for r in ours], kv_cache_layout=kv_cache_layout,
        block_size=block_size, attn_backend_name=attn_backend_name,
        region_num_blocks=[r.num_blocks for r in ours],
        region_names=names,
        region_mem_types=[r.mem_type for r in ours])


def encode_payload(compatibility_hash: str, md: VllmAgentMetadata,
                   aionixl: AionixlRoute | None = None) -> bytes:
    """The first reply frame (it does not change while an engine serves); ``aionixl``: the
    serving engine's own handshake, when it listens for one."""
    if not isinstance(compatibility_hash, str) or not compatibility_hash:
        raise ValueError("compat_hash must be a non-empty str (vLLM's compatibility hash)")
    return _encoder.encode(_Payload(compatibility_hash, _encoder.encode(md), aionixl))


def encode_reply(payload: bytes, clock: float) -> list[bytes]:
    """The reply frames: the payload and this process's ``perf_counter`` (vLLM's decode
    estimates the clock offset to its prefill from it)."""
    return [payload, _encoder.encode(clock)]


def encode_refusal(reason: str) -> list[bytes]:
    """One frame saying why a request is not served (vLLM's decode fails on it at once,
    instead of waiting out its receive timeout; :func:`decode_reply` raises VllmRefused)."""
    return [_encoder.encode(_Refusal(reason))]
