"""Reading KV blocks from a vLLM NixlConnector prefill worker (vLLM's pull mode).

    peer = await engine.connect_vllm("tcp://prefill-host:5600")
    await engine.transfer_blocks(peer, local_ids, remote_ids, op="read",
                                 notify=aionixl.vllm.read_notification(remote_request_id))

``connect`` speaks vLLM's side-channel handshake from the event loop (a REQ socket driven
through its FD, no threads, one deadline), decodes vLLM's metadata, checks the geometry
against the engine's regions, and admits the prefill's NIXL agent as a :class:`~aionixl.Peer`.
Needs only msgspec and pyzmq (the ``vllm-interop`` extra), not vLLM.

Layout: vLLM registers one NIXL region per attention layer (with its default layer-major
layouts, K and V of a block share one page), all with the same block count; block ``b`` of
every region is vLLM's block id ``b``. An aionixl engine that reads from it needs the same
number of regions with the same bytes per block, in vLLM's region order (layer 0 first), for
example one ``[num_blocks, page_bytes]`` uint8 view per layer. Block counts may differ.

Foreign peers get no aionixl housekeeping notifications: a vLLM prefill would read the
liveness probe or the goodbye as a request notification (and fail to parse it), so the
engine sends neither to peers admitted here. A vLLM prefill that dies while idle is
therefore noticed at the next transfer (``PeerDisconnectedError``), not by the probe.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import zmq

from . import _zmq
from ._errors import HandshakeError, IncompatiblePeerError
from ._nixl import metadata_agent_name
from ._protocol import Incompatible
from ._vllm_wire import (
    VllmAgentMetadata,
    VllmHandshake,
    VllmWireError,
    check_geometry,
    decode_reply,
    encode_request,
    heartbeat_message,
    read_notification,
    regions,
)

if TYPE_CHECKING:
    from ._engine import Engine
    from ._peers import Peer

__all__ = [
    "VllmAgentMetadata",
    "VllmHandshake",
    "connect",
    "fetch_metadata",
    "heartbeat",
    "read_notification",
]

#: Replies larger than this are refused (vLLM's are ~1-2 KiB plus ~100 bytes per region).
MAX_REPLY_BYTES = 16 << 20


def _endpoint(address: str) -> str:
    if not isinstance(address, str) or not address:
        raise ValueError("address must be 'tcp://host:port' or 'host:port'")
    return address if "://" in address else f"tcp://{address}"


async def fetch_metadata(address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                         timeout: float = 10.0) -> VllmHandshake:
    """Ask the vLLM side channel at ``address`` for rank (pp, tp)'s metadata.

    ``HandshakeError`` when nobody answers within ``timeout`` or the reply does not decode.
    """
    endpoint = _endpoint(address)
    request = encode_request(pp_rank, tp_rank)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock: zmq.Socket[bytes] = ctx.socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)
            try:
                sock.connect(endpoint)
            except zmq.ZMQError as exc:
                raise ValueError(f"bad vLLM side-channel address {address!r}: {exc}") from exc
            with anyio.move_on_after(timeout) as scope:
                await _zmq.send_multipart(sock, [request])
                frames = await _zmq.recv_multipart(sock)
            if scope.cancelled_caught:
                raise HandshakeError(f"the vLLM side channel at {endpoint} did not answer "
                                     f"within {timeout} s")
        finally:
            sock.close(linger=0)
    finally:
        ctx.term()
    try:
        return decode_reply(frames, MAX_REPLY_BYTES)
    except VllmWireError as exc:
        raise HandshakeError(f"unusable reply from the vLLM side channel at {endpoint}: {exc}") from exc


async def connect(engine: Engine, address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                  expect_compat_hash: str | None = None, timeout: float = 10.0) -> Peer:
    """Handshake with a vLLM NixlConnector prefill and admit its agent as a peer of ``engine``.

    Idempotent for a live peer at the same address. ``IncompatiblePeerError`` (``.field``
    says what) when the region count or bytes per block differ from the engine's, when
    vLLM's layout has no one-id-per-block form, or when ``expect_compat_hash`` is given and
    differs from vLLM's compatibility hash; ``HandshakeError`` for no answer or a bad reply.
    """
    endpoint = _endpoint(address)
    for peer in engine.peers.values():
        if peer.address == endpoint and peer.connected:
            await anyio.lowlevel.checkpoint()
            return peer
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError("timeout must be a number > 0")
    deadline = time.monotonic() + timeout
    reply = await fetch_metadata(endpoint, pp_rank=pp_rank, tp_rank=tp_rank, timeout=timeout)
    md = reply.metadata
    where = f"vLLM engine {md.engine_id!r} at {endpoint}"
    if expect_compat_hash is not None and reply.compatibility_hash != expect_compat_hash:
        raise IncompatiblePeerError(
            f"{where}: compatibility hash {reply.compatibility_hash[:16]}... is not the expected "
            f"{expect_compat_hash[:16]}...", field="compat_hash")
    ours = engine.regions
    try:
        theirs = regions(md, ours[0].mem_type)
        check_geometry(ours, theirs)
    except Incompatible as exc:
        raise IncompatiblePeerError(f"{where}: {exc}", field=exc.field) from None
    except VllmWireError as exc:
        raise HandshakeError(f"{where}: {exc}") from exc
    name = metadata_agent_name(md.agent_metadata)
    if name is None:
        raise HandshakeError(f"{where}: its NIXL metadata names no readable agent")
    if time.monotonic() > deadline:
        raise HandshakeError(f"{where}: the handshake ran past its {timeout} s deadline")
    return await engine._admit_foreign(name, md.agent_metadata, theirs, endpoint)


async def heartbeat(engine: Engine, peer: Peer, request_ids: Iterable[str]) -> None:
    """Extend the prefill's lease on ``request_ids`` (vLLM's ``"HB:id1,id2"`` notification).

    vLLM moves each lease to at least now + 2/3 of its ``kv_lease_duration`` (30 s by
    default); ids it does not hold are ignored.
    """
    await engine.send_notification(peer, heartbeat_message(request_ids))

