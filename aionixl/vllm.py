"""vLLM's NixlConnector (pull mode), both ways: reading from a vLLM prefill, serving vLLM decoders.

    peer = await aionixl.vllm.connect(engine, "tcp://prefill-host:5600")
    await engine.transfer_blocks(peer, local_ids, remote_ids, op="read",
                                 notify=aionixl.vllm.read_notification(remote_request_id))

    # beyond loopback only with EngineConfig(allow_unauthenticated=True): vLLM's protocol is unsigned
    address = await aionixl.vllm.serve(engine, "tcp://0.0.0.0:5600", engine_id="prefill-0",
                                       compat_hash=..., block_size=16, kv_cache_layout="LBHNC",
                                       attn_backend_name="FLASH_ATTN")
    lease = engine.lease(request_id, block_ids)        # a vLLM decoder's notification ends it
    params = aionixl.vllm.transfer_params(request_id, block_ids, num_tokens=prompt_tokens,
                                          engine_id="prefill-0", host="prefill-host", port=5600)

``connect`` speaks vLLM's side-channel handshake from the event loop (a REQ socket driven
through its FD, no threads, one deadline), decodes vLLM's metadata, checks the geometry
against the engine's regions, and admits the prefill's NIXL agent as a :class:`~aionixl.Peer`.
Needs only msgspec and pyzmq (the ``vllm-interop`` extra), not vLLM.

Layout: vLLM registers one NIXL region per attention layer (with its default layer-major
layouts, K and V of a block share one page), all with the same block count; block ``b`` of
every region is vLLM's block id ``b``. An aionixl engine that reads from it needs the same
number of regions, in vLLM's region order (layer 0 first), for example one
``[num_blocks, page_bytes]`` uint8 view per layer; with the same bytes per block it moves
whole blocks, otherwise parts of blocks (:class:`~aionixl.BlockPart`; refused instead with
``EngineConfig.require_equal_geometry``). Block counts may differ.

Foreign peers get no aionixl housekeeping notifications: a vLLM prefill would read the
liveness probe or the goodbye as a request notification (and fail to parse it), so the
engine sends neither to peers admitted here. A vLLM prefill that dies while idle is
therefore noticed at the next transfer (``PeerDisconnectedError``), not by the probe.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from ._checks import check_int, check_text
from ._vllm_connect import MAX_REPLY_BYTES, fetch_metadata
from ._vllm_serve import announced_id
from ._vllm_wire import (
    AionixlRoute,
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
    "AionixlRoute",
    "VllmAgentMetadata",
    "VllmHandshake",
    "connect",
    "engine_id",
    "fetch_metadata",
    "heartbeat",
    "read_notification",
    "serve",
    "transfer_params",
]


async def connect(engine: Engine, address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                  expect_compat_hash: str | None = None, expect_engine_id: str | None = None,
                  timeout: float = 10.0, prefer_aionixl: bool = False) -> Peer:
    """Handshake with a vLLM NixlConnector prefill worker and admit its agent as a peer of
    ``engine``.

    Idempotent for a live peer at the same address, unless ``expect_engine_id`` (the
    ``remote_engine_id`` a request names) differs from its engine id: then it asks again.
    ``IncompatiblePeerError`` (``.field`` says what) when the region count differs from the
    engine's (or the bytes per block, with ``EngineConfig.require_equal_geometry``), when
    vLLM's layout has no one-id-per-block form, when ``expect_compat_hash`` is given and
    differs from vLLM's compatibility hash, or when ``expect_engine_id`` is given and the
    engine there announces another (``field="engine_id"``; a vLLM decode refuses it too);
    ``HandshakeError`` for no answer or a bad reply (docs/vllm.md). A prefill at another TP
    or block size is admitted: block parts move between the two (:mod:`aionixl.layouts`).
    Calls for one address and rank while a handshake with it is under way wait for that one
    and, expecting the same engine id and hash, share its failure.

    ``prefer_aionixl=True``: when the side channel is served by an aionixl engine that also
    listens for aionixl's own handshake (:func:`serve` names it in its reply), connect to
    that engine by aionixl's handshake instead, within half of the time left, and fall
    back to vLLM's wire when that fails. The peer is then an aionixl peer: reads take
    ``EngineConfig.read_mode`` (push over UCX TCP, so a reader dying mid-read cannot abort
    the server), probes and goodbyes flow, and the read-done notification and heartbeats
    release and extend the server's leases as they do over vLLM's wire.
    """
    return await engine._connect_vllm(address, pp_rank=pp_rank, tp_rank=tp_rank,
                                      expect_compat_hash=expect_compat_hash,
                                      expect_engine_id=expect_engine_id, timeout=timeout,
                                      prefer_aionixl=prefer_aionixl)


async def heartbeat(engine: Engine, peer: Peer, request_ids: Iterable[str]) -> None:
    """Extend ``peer``'s leases on ``request_ids`` (vLLM's ``"HB:id1,id2"`` notification; an
    aionixl prefill and a vLLM prefill both understand it).

    vLLM moves each lease to at least now + 2/3 of its ``kv_lease_duration`` (30 s by
    default); an aionixl prefill to at least now + the lease's ``duration``. Ids it does
    not hold are ignored (counted by an aionixl prefill:
    ``metrics().heartbeat_ids_unknown``).
    """
    await engine.send_notification(peer, heartbeat_message(request_ids))


async def serve(engine: Engine, listen: str = "tcp://127.0.0.1:0", *, engine_id: str, compat_hash: str,
                block_size: int, kv_cache_layout: str, attn_backend_name: str, tp_rank: int = 0,
                pp_rank: int = 0, layer_names: Sequence[str] | None = None, isolate: bool = False,
                exact_engine_id: bool = False, progress_thread: bool = True) -> str:
    """Answer vLLM NixlConnector decode workers' handshakes on ``listen`` for ``engine``;
    returns the bound endpoint (``tcp://host:port``).

    A vLLM decode (``kv_role="kv_consumer"``) told the engine id served (:func:`engine_id`)
    and this host and port (:func:`transfer_params`) fetches the serving agent's metadata
    here and then reads the blocks itself; its completion notification releases the engine's
    :meth:`~aionixl.Engine.lease` of that request id, and its heartbeats extend it. What
    the decode checks against its own configuration: ``compat_hash`` (vLLM's
    compatibility hash of the deployment: same vLLM version, model, dtype, attention
    backend), ``block_size`` (tokens per block), ``kv_cache_layout`` (e.g. ``"LBHNC"``),
    ``attn_backend_name`` (e.g. ``"CPU_ATTN"``, ``"FLASH_ATTN"``), the number of regions
    (one per attention layer, in layer order) and their bytes per block; ``layer_names``
    (optional) must then equal its layer names. Served: rank (``pp_rank``, ``tp_rank``);
    a request for another rank gets a refusal. The listener is a task of the engine's
    task group and stops when the engine closes; one per engine (``RuntimeError`` for a
    second call). ``ValueError`` for a bad argument, ``ListenError`` when ``listen``
    cannot be bound (docs/vllm.md).

    vLLM decoders read from a NIXL agent of their own, never the engine's (docs/vllm.md).
    When the engine listens for aionixl's handshake (``Engine(listen=...)``), every reply
    also names that address and the engine's agent name (:class:`AionixlRoute`, a key
    vLLM's decoder skips): an aionixl decode given ``prefer_aionixl=True`` in
    :func:`connect` reads from the engine itself, as any aionixl peer does.
    ``isolate=True`` puts that agent in a child process that maps the regions (they must
    lie in :func:`aionixl.shared_dram` buffers): over UCX TCP a decode dying mid-read can
    make UCX abort the process that serves its read, and then only that child dies. The
    engine replaces it (``metrics().vllm_serving_restarts``).

    Each serving agent (each call, each serving child) announces an engine id of its own,
    ``"<engine_id>~<8 hex digits>"``: a vLLM decode keeps a remote agent by engine id, and
    one that replaced another under the same id (a restarted prefill, a replaced child)
    would never be read. :func:`engine_id` says which is served now, and
    :func:`transfer_params` given ``engine_id`` names it. ``exact_engine_id=True``
    announces ``engine_id`` as given (the first agent; a replaced child still gets a
    suffix): for ids already new at each start, as vLLM's own.

    The serving agent runs NIXL's progress thread (an OS thread, waiting on the UCX
    worker's events): over UCX TCP a decode's read waits for its target to progress, and
    this serves it as it arrives. ``progress_thread=False`` saves that thread: reads then
    wait for the engine's drainer (every ``Tuning.notification_poll_interval`` at most
    while a lease is live, ``idle_poll_interval`` otherwise). A serving child
    (``isolate=True``) always runs one.
    ``AionixlError`` when the first child does not start.

    vLLM's side channel has no authentication, so ``listen`` must be loopback (or ``ipc://``)
    unless the engine's ``EngineConfig(allow_unauthenticated=True)`` says the network is
    trusted: ``ValueError`` otherwise (protected mode; a handshake secret does not cover it).
    """
    return await engine._serve_vllm(listen, engine_id=engine_id, compat_hash=compat_hash,
                                    block_size=block_size, kv_cache_layout=kv_cache_layout,
                                    attn_backend_name=attn_backend_name, tp_rank=tp_rank,
                                    pp_rank=pp_rank, layer_names=layer_names, isolate=isolate,
                                    exact_engine_id=exact_engine_id, progress_thread=progress_thread)


def engine_id(engine: Engine) -> str | None:
    """The engine id vLLM decoders must be told now (:func:`transfer_params`): the one
    the serving agent announces, ``"<engine_id>~<8 hex digits>"`` (:func:`serve`; a
    replaced serving child's differs); None when not serving (or while a replacement
    starts)."""
    return engine._vllm_server.engine_id


def transfer_params(request_id: str, block_ids: Iterable[int], *, num_tokens: int, engine_id: str,
                    host: str, port: int, tp_size: int = 1) -> dict[str, Any]:
    """What a vLLM decode needs to read a request's blocks from an engine serving vLLM:
    the ``kv_transfer_params`` a vLLM prefill returns with its response (the proxy hands
    them to the decode's request). ``request_id`` is the lease's (the decode's notification
    names it); ``num_tokens``: the prompt tokens whose KV the blocks hold (vLLM's decode
    scheduler loads that many, less what it has cached); ``engine_id``: the id given to
    :func:`serve`, or the one it announces (:func:`engine_id`): given the former, the
    params name the latter when an engine of this process serves under it (``ValueError``
    when two do); ``host``/``port``: where :func:`serve` listens, as the decode reaches
    it; ``tp_size``: the TP size of the prefill (1 for one aionixl engine)."""
    read_notification(request_id)  # the same checks: it must be usable as vLLM's notification
    ids = [int(b) for b in block_ids]
    if not ids or min(ids) < 0:
        raise ValueError("block_ids must be one or more ids >= 0")
    for value, what in ((num_tokens, "num_tokens"), (port, "port"), (tp_size, "tp_size")):
        check_int(value, what, 1)
    if port > 65535:
        raise ValueError("port must be at most 65535")
    check_text(engine_id, "engine_id")
    check_text(host, "host")
    return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": announced_id(engine_id),
            "remote_request_id": request_id, "remote_block_ids": [ids], "remote_host": host,
            "remote_port": port, "remote_num_tokens": num_tokens, "tp_size": tp_size,
            "dcp_size": 1, "pp_size": 1}
