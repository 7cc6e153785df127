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

from collections.abc import Iterable
from typing import TYPE_CHECKING

from ._vllm_connect import MAX_REPLY_BYTES, fetch_metadata
from ._vllm_wire import (
    VllmAgentMetadata,
    VllmHandshake,
    heartbeat_message,
    read_notification,
)

if TYPE_CHECKING:
    from ._engine import Engine
    from ._peer import Peer

__all__ = [
    "MAX_REPLY_BYTES",
    "VllmAgentMetadata",
    "VllmHandshake",
    "connect",
    "fetch_metadata",
    "heartbeat",
    "read_notification",
]


async def connect(engine: Engine, address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                  expect_compat_hash: str | None = None, timeout: float = 10.0) -> Peer:
    """Handshake with a vLLM NixlConnector prefill and admit its agent as a peer of ``engine``.

    The same as :meth:`Engine.connect_vllm`: idempotent for a live peer at the same address;
    ``IncompatiblePeerError`` (``.field`` says what) when the region count or bytes per
    block differ from the engine's, when vLLM's layout has no one-id-per-block form, or
    when ``expect_compat_hash`` is given and differs from vLLM's compatibility hash;
    ``HandshakeError`` for no answer or a bad reply.
    """
    return await engine.connect_vllm(address, pp_rank=pp_rank, tp_rank=tp_rank,
                                     expect_compat_hash=expect_compat_hash, timeout=timeout)


async def heartbeat(engine: Engine, peer: Peer, request_ids: Iterable[str]) -> None:
    """Extend the prefill's lease on ``request_ids`` (vLLM's ``"HB:id1,id2"`` notification).

    vLLM moves each lease to at least now + 2/3 of its ``kv_lease_duration`` (30 s by
    default); ids it does not hold are ignored.
    """
    await engine.send_notification(peer, heartbeat_message(request_ids))

