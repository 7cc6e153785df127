"""aionixl as vLLM's KV connector: ``AionixlConnector``, loaded by module path.

    --kv-transfer-config '{"kv_connector": "AionixlConnector",
                           "kv_connector_module_path": "aionixl.vllm_connector",
                           "kv_role": "kv_producer"}'      # or "kv_consumer", "kv_both"

Wire-compatible with vLLM's ``NixlConnector`` in pull mode (the decode READs the prefill's
blocks): the same ``kv_transfer_params``, side-channel handshake, notifications and
heartbeats, so either side may be vLLM's connector and vLLM's disaggregation proxies work
unchanged. Between two AionixlConnectors the prefill's side channel also names its
engine's own handshake, and the decode reads as an aionixl peer (push reads over UCX TCP:
a decode dying mid-read cannot abort the prefill), falling back to vLLM's wire when that
handshake fails. The scheduler side is vLLM's own pull scheduler (its bookkeeping is the wire
contract), minus its side-channel listener thread. The worker side is one aionixl
:class:`~aionixl.Engine` on one event loop, in the one thread this connector starts (vLLM
calls connectors synchronously, and nothing calls them while the engine is idle, so
transfers and notifications need a loop of their own): it serves the side channel
(:func:`aionixl.vllm.serve`), holds a prefill's blocks under leases that the decode's
read-done releases and its heartbeats extend, and posts a decode's reads as soon as their
handshake completes. NIXL's progress thread stays off, the serving agent's too (one OS
thread fewer per worker; a decode's read then waits for the engine's next poll, at most
``Tuning.notification_poll_interval`` while the prefill holds leases); nothing spins; the
compute thread's CPU mask is left alone, and the loop thread runs on any CPU (not on the one
core vLLM's CPU backend binds the compute thread to).

Only this module imports vLLM (``import aionixl`` does not). Supported: TP 1 and PP 1, CPU
or GPU memory that one aionixl engine registers, block sizes with one kernel block per
logical block. ``kv_connector_extra_config`` keys read here: ``kv_lease_duration`` (vLLM's,
30 s), ``aionixl_allow_unauthenticated`` (serve the side channel beyond loopback: vLLM's
protocol has no authentication), ``aionixl_transfer_timeout`` (a read's deadline, 60 s).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections import deque
from collections.abc import Iterable
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import anyio.from_thread
import vllm.envs as vllm_envs
from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorHandshakeMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import NixlBaseConnector
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import (
    NixlConnectorMetadata,
    compute_nixl_compatibility_hash,
)
from vllm.distributed.kv_transfer.kv_connector.v1.nixl.pull_scheduler import NixlPullConnectorScheduler

import aionixl
import aionixl.vllm

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["AionixlConnector"]

#: Under vLLM's logger, so that its lines go where vLLM's go (vLLM configures "vllm" only).
log = logging.getLogger("vllm.aionixl_connector")


class AionixlConnector(NixlBaseConnector):  # type: ignore[misc]  # vLLM is untyped here
    """vLLM's KV connector interface over one aionixl engine per worker (see the module).

    Scheduler role: vLLM's pull scheduler, whose side-channel listener is not started
    (the worker's engine serves the side channel). Worker role: :class:`_Worker`.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise NotImplementedError("AionixlConnector serves tensor and pipeline parallel size 1 only")
        self._worker: _Worker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = NixlPullConnectorScheduler(vllm_config, self.engine_id,
                                                                  kv_cache_config)
        else:
            self._worker = _Worker(vllm_config, self.engine_id)

    # ---- scheduler role: vLLM's bookkeeping (inherited), without its listener --------------

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        """Nothing: the worker's engine serves the side channel itself (vLLM calls this even
        when the workers announced nothing)."""

    # ---- worker role -----------------------------------------------------------------------

    def _own_worker(self) -> _Worker:
        if self._worker is None:
            raise RuntimeError("a worker-role call on the scheduler-role AionixlConnector")
        return self._worker

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._own_worker().start(kv_caches)

    def set_host_xfer_buffer_ops(self, copy_operation: Any) -> None:
        """Nothing: blocks move between the caches themselves, never through a host buffer."""

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._connector_metadata
        assert isinstance(meta, NixlConnectorMetadata)
        self._own_worker().step(meta)

    def wait_for_save(self) -> None:
        """Nothing: in pull mode the decode reads; the prefill only holds its blocks."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        results = self._own_worker().results()
        return results.finished_sending, results.finished_recving

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        return self._own_worker().results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._own_worker().load_errors()

    def get_kv_connector_stats(self) -> None:
        return None

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return None  # the side channel is the worker's own

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.stop()
        if self.connector_scheduler is not None:
            self.connector_scheduler.shutdown()


def _layer_order(name: str) -> list[Any]:
    """vLLM orders its regions by layer name with numbers compared as numbers
    (``layers.2`` before ``layers.10``)."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


class _Worker:
    """The worker role: an aionixl engine on a loop of its own (one thread), fed each step
    with vLLM's connector metadata; what ended comes back through thread-safe deques
    (appends and pops of a deque are atomic), drained by vLLM's calls."""

    def __init__(self, vllm_config: VllmConfig, engine_id: str) -> None:
        self._vllm_config = vllm_config
        self._engine_id = engine_id
        transfer = vllm_config.kv_transfer_config
        assert transfer is not None
        self._role = transfer.kv_role
        extra = dict(transfer.kv_connector_extra_config or {})
        self._lease_duration = float(extra.get("kv_lease_duration", 30))
        self._transfer_timeout = float(extra.get("aionixl_transfer_timeout", 60.0))
        self._trusted_network = bool(extra.get("aionixl_allow_unauthenticated", False))
        host = vllm_envs.VLLM_NIXL_SIDE_CHANNEL_HOST
        port = vllm_envs.VLLM_NIXL_SIDE_CHANNEL_PORT + vllm_config.parallel_config.data_parallel_index
        self._listen = f"tcp://{'127.0.0.1' if host == 'localhost' else host}:{port}"
        self._portal_cm: AbstractContextManager[anyio.from_thread.BlockingPortal] | None = None
        self._portal: anyio.from_thread.BlockingPortal | None = None
        self._finished_sending: deque[str] = deque()
        self._finished_recving: deque[str] = deque()
        self._failed_recving: deque[str] = deque()
        self._load_errors: deque[int] = deque()
        # The rest is the loop's alone.
        self._engine: aionixl.Engine | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self._stopping: anyio.Event | None = None
        self._leases: dict[str, aionixl.Lease] = {}
        self._delayed: set[str] = set()  # requests whose blocks the scheduler holds for us
        self._released_early: set[str] = set()  # read before the scheduler said so
        self._handshake_timeout = 10.0
        self._reading_from: set[str] = set()  # prefill agents whose path was logged

    # ---- the worker's thread ---------------------------------------------------------------

    def start(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Start the loop thread, open the engine on vLLM's caches and, on a producer,
        serve the side channel; returns once it serves."""
        names = sorted(kv_caches, key=_layer_order)
        regions = [kv_caches[name] for name in names]
        backend = get_current_attn_backends(self._vllm_config)[0].get_name()
        compat_hash = compute_nixl_compatibility_hash(self._vllm_config, backend, "pull")
        block_size = self._vllm_config.cache_config.block_size
        self._portal_cm = anyio.from_thread.start_blocking_portal("asyncio", name="aionixl-vllm-loop")
        self._portal = self._portal_cm.__enter__()
        try:
            self._portal.start_task(self._run, regions, names, backend, compat_hash, block_size,
                                    name="aionixl-vllm-worker")
        except BaseException:
            self._close_portal()
            raise

    def step(self, meta: NixlConnectorMetadata) -> None:
        """Hand this step's new work to the loop (never waits for it)."""
        if not (meta.reqs_to_recv or meta.reqs_to_send or meta.reqs_in_batch
                or meta.reqs_not_processed or meta.heartbeat_by_engine):
            return
        assert self._portal is not None, "start_load_kv before register_kv_caches"
        self._portal.start_task_soon(self._apply_logged, meta)

    def results(self) -> KVConnectorTransferResults:
        return KVConnectorTransferResults(finished_sending=_drain(self._finished_sending),
                                          finished_recving=_drain(self._finished_recving),
                                          failed_recving=_drain(self._failed_recving))

    def load_errors(self) -> set[int]:
        return _drain(self._load_errors)

    def stop(self) -> None:
        """Close the engine (cancel-scope cancellation, then awaited NIXL releases) and
        join the loop thread. Idempotent."""
        if self._portal is None:
            return
        try:
            if self._stopping is not None:
                self._portal.call(self._stopping.set)
        finally:
            self._close_portal()

    def _close_portal(self) -> None:
        cm, self._portal_cm, self._portal = self._portal_cm, None, None
        if cm is not None:
            cm.__exit__(None, None, None)

    # ---- the loop --------------------------------------------------------------------------

    async def _run(self, regions: list[Any], names: list[str], backend: str, compat_hash: str,
                   block_size: int, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        _run_anywhere()
        config = aionixl.EngineConfig(allow_unauthenticated=self._trusted_network,
                                      transfer_timeout=self._transfer_timeout,
                                      compat={"vllm": compat_hash})
        name = f"aionixl-vllm-{self._engine_id}"
        serving = self._role in ("kv_producer", "kv_both")
        # A prefill also answers aionixl's own handshake, on the side channel's host: the side
        # channel names it to aionixl decodes, which then read as aionixl peers (push reads
        # over UCX TCP: a decode dying mid-read cannot abort this process).
        listen = f"{self._listen.rpartition(':')[0]}:0" if serving else None
        try:
            opened = aionixl.Engine(name, regions, listen=listen, config=config)
        except aionixl.UnprotectedListenerError as exc:
            raise _for_connector(exc) from exc
        async with opened as engine, anyio.create_task_group() as tg:
            if serving:
                try:
                    await aionixl.vllm.serve(engine, self._listen, engine_id=self._engine_id,
                                             compat_hash=compat_hash, block_size=block_size,
                                             kv_cache_layout="LBHNC", attn_backend_name=backend,
                                             layer_names=names, exact_engine_id=True,
                                             progress_thread=False)
                except aionixl.UnprotectedListenerError as exc:
                    raise _for_connector(exc) from exc
            self._engine, self._tg, self._stopping = engine, tg, anyio.Event()
            task_status.started()
            await self._stopping.wait()
            tg.cancel_scope.cancel()

    async def _apply_logged(self, meta: NixlConnectorMetadata) -> None:
        try:
            await self._apply(meta)
        except Exception:  # nobody awaits this step's future: say it here
            log.exception("AionixlConnector could not take a step's work")

    async def _apply(self, meta: NixlConnectorMetadata) -> None:
        engine, tg = self._engine, self._tg
        assert engine is not None and tg is not None
        for req_id in meta.reqs_in_batch:  # a prefill to be read: hold it from now on (a read-
            self._hold(engine, tg, req_id)  # done may come before the scheduler's word below)
        for req_id in meta.reqs_to_send:
            if req_id in self._released_early:  # read already: free now, hold nothing
                self._released_early.discard(req_id)
                self._finished_sending.append(req_id)
            else:
                self._hold(engine, tg, req_id)
                self._delayed.add(req_id)
        for req_id in meta.reqs_not_processed:  # aborted: the scheduler frees the blocks
            self._delayed.discard(req_id)
            self._released_early.discard(req_id)
            lease = self._leases.pop(req_id, None)
            if lease is not None:
                lease.cancel()
        for req_id, req in meta.reqs_to_recv.items():
            tg.start_soon(self._read, engine, req_id, req)
        for remote_engine, beat in meta.heartbeat_by_engine.items():
            tg.start_soon(self._heartbeat, engine, remote_engine, beat.host, beat.port, set(beat.req_ids))

    def _hold(self, engine: aionixl.Engine, tg: anyio.abc.TaskGroup, req_id: str) -> None:
        if req_id in self._leases:
            return
        lease = engine.lease(req_id, (), duration=self._lease_duration)
        self._leases[req_id] = lease
        tg.start_soon(self._until_released, lease)

    async def _until_released(self, lease: aionixl.Lease) -> None:
        """A lease's end: read (the decode's read-done) or expired frees the blocks, if the
        scheduler holds them for us; a cancelled one (an aborted request) is not reported."""
        try:
            await lease.wait()
        except aionixl.LeaseCancelledError:
            return
        except aionixl.LeaseExpiredError:
            log.warning("request %s: no decode read its blocks within %g s; freeing them",
                        lease.request_id, self._lease_duration)
        except aionixl.EngineClosedError:
            return
        req_id = lease.request_id
        self._leases.pop(req_id, None)
        if req_id in self._delayed:
            self._delayed.discard(req_id)
            self._finished_sending.append(req_id)
        else:
            self._released_early.add(req_id)

    async def _peer(self, engine: aionixl.Engine, engine_id: str, host: str, port: int) -> aionixl.Peer:
        """The prefill ``engine_id`` at ``host:port`` (vLLM's side channel). ``aionixl.vllm.connect``
        returns a live peer it admitted at once, asks again if another engine answers there
        now, and refuses one that is not ``engine_id`` (as vLLM's decode does: the block ids
        were that engine's); requests that arrive together wait for one handshake, and share
        its failure. An AionixlConnector prefill is connected by aionixl's own handshake
        (``prefer_aionixl``), vLLM's by its side channel."""
        peer = await aionixl.vllm.connect(engine, f"tcp://{host}:{port}", expect_engine_id=engine_id,
                                          timeout=self._handshake_timeout, prefer_aionixl=True)
        if peer.name not in self._reading_from:
            self._reading_from.add(peer.name)
            how = f"aionixl's handshake ({peer.read_mode} reads)" if peer.features else "vLLM's side channel"
            log.info("AionixlConnector reads from prefill %s at %s:%s by %s", engine_id, host, port, how)
        return peer

    async def _read(self, engine: aionixl.Engine, req_id: str, req: Any) -> None:
        """Read one request's blocks from its prefill, the read-done riding on the read;
        a failure is vLLM's failed receive (its ``kv_load_failure_policy`` decides)."""
        remote = req.remote
        local = [int(b) for b in req.local_block_ids[0]] if req.local_block_ids else []
        remote_ids = [int(b) for b in remote.block_ids[0]] if remote.block_ids else []
        if len(local) < len(remote_ids):  # a partial local prefix hit: only the rest moves
            remote_ids = remote_ids[len(remote_ids) - len(local):]
        reported = req.awaiting_kvs or bool(local)
        done = aionixl.vllm.read_notification(remote.request_id)
        try:
            peer = await self._peer(engine, remote.engine_id, remote.host, int(remote.port))
            if local:
                await engine.transfer_blocks(peer, local, remote_ids, notify=done)
            else:  # nothing to read (all cached here, or aborted): the prefill may free
                await engine.send_notification(peer, done)
        except aionixl.AionixlError as exc:
            log.warning("request %s: reading its KV from %s:%s failed: %s", req_id, remote.host,
                        remote.port, exc)
            if reported:
                self._load_errors.extend(local)
                self._failed_recving.append(req_id)
                self._finished_recving.append(req_id)
            return
        if reported:
            self._finished_recving.append(req_id)

    async def _heartbeat(self, engine: aionixl.Engine, remote_engine: str, host: str, port: int,
                         req_ids: Iterable[str]) -> None:
        try:
            peer = await self._peer(engine, remote_engine, host, int(port))
            await aionixl.vllm.heartbeat(engine, peer, sorted(req_ids))
        except aionixl.AionixlError as exc:
            log.warning("heartbeat to %s at %s:%s failed: %s", remote_engine, host, port, exc)


def _for_connector(exc: aionixl.UnprotectedListenerError) -> aionixl.UnprotectedListenerError:
    """The engine's refusal to listen beyond loopback, with the connector's way out."""
    return aionixl.UnprotectedListenerError(
        f"{exc}. For AionixlConnector: serve on loopback, or on a trusted network set "
        '"aionixl_allow_unauthenticated": true in kv_connector_extra_config')


def _run_anywhere() -> None:
    """Let the calling thread (the loop's) run on every CPU this process may use. It was
    started from vLLM's compute thread, whose OpenMP binding (one core on CPU) it would
    inherit: there it queued behind whatever else was bound to that core (in a test, a
    NixlConnector decode's spinning progress thread) and its side channel went unanswered
    for seconds. The compute thread's own mask is left alone."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux, or no such CPUs: as it was
        os.sched_setaffinity(0, range(os.cpu_count() or 1))


def _drain(items: deque[Any]) -> set[Any]:
    out = set()
    while items:
        out.add(items.popleft())
    return out
