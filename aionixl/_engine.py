"""The engine: the public facade over one NIXL agent and the components that drive it.

Shape: ``async with Engine(...)`` opens a task group in the owner's task. Inside it, one
background task holds a cancel scope of its own (so ``aclose()`` from any task stops the
engine without cancelling the owner's body) and, under it, the handshake listener
(:mod:`._handshake`), the in-flight poller (:mod:`._inflight`), the notification drainer
(:mod:`._drainer`) and the push server (:mod:`._push`). This module builds the components,
bottom up, each with what it needs (docs/architecture.md), and owns the lifecycle and the
ordered close: cancel that scope, wake every waiting caller with ``EngineClosedError``, then
release NIXL resources in order (push reads, transfer handles, goodbyes, peers, the local
descriptor list, registrations, the agent), each step bounded by
``EngineConfig.close_timeout``. The engine starts no threads.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections.abc import Coroutine, Iterable, Mapping, Sequence
from contextlib import suppress
from types import TracebackType
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import zmq

from . import _zmq
from ._checks import check_timeout, single_leaf
from ._coalesce import Coalescer
from ._config import EngineConfig, Tuning, effective_tuning
from ._discovery import Discovery, EngineRecord
from ._drainer import NotificationDrainer
from ._errors import AionixlError, EngineClosedError, PeerDisconnectedError, UnprotectedListenerError
from ._handshake import Handshakes
from ._hostfacts import host_facts
from ._inflight import InFlightTable
from ._leases import Lease, LeaseTable
from ._lifecycle import CLOSED, CLOSING, DRAINING, NEW, OPEN, Lifecycle, LocalSide
from ._metrics import STATS_KEYS, EngineMetrics, TransferMetrics
from ._nixl import NixlAgent
from ._notifications import Mailbox, Notification
from ._parking import loop_tools
from ._parts import BlockPart
from ._peer import Peer
from ._peers import PeerTable
from ._post import DirectPath, LoopTurns
from ._push import Pusher
from ._ratelimit import RateLimitedLog, Refusals
from ._regions import IndexArray, Region, block_descriptors, describe_regions, registration_spans
from ._results import Op, TransferResult
from ._staging import Staging
from ._transfers import Transfers
from ._vllm_connect import VllmConnector
from ._vllm_serve import VllmServer
from ._vllm_wire import AionixlRoute, heartbeat_message
from ._wire import FEATURES, REFUSAL_KINDS, user_message

log = logging.getLogger("aionixl")


class Engine:
    """Moves KV-cache blocks between this process and peer engines over NIXL.

    ``kv_caches`` is a sequence of regions (torch tensors on CPU or CUDA, or numpy
    arrays); see the README's "The contract" for the layout rules. ``listen`` is the zmq endpoint peers
    connect to (port 0 picks a free port); ``None`` runs without a listener, for engines
    that only connect out. ``discovery`` (an :class:`aionixl.Discovery`, such as
    :class:`aionixl.EtcdDiscovery`) registers the
    engine by name while it is open (when it listens) and lets :meth:`connect_to` resolve
    names (the README's "Discovery through etcd").
    """

    def __init__(self, name: str, kv_caches: Sequence[Any], listen: str | None = "tcp://127.0.0.1:0",
                 config: EngineConfig | None = None, *, discovery: Discovery | None = None,
                 tuning: Tuning | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty str")
        if listen is not None and (not isinstance(listen, str) or not listen):
            raise ValueError("listen must be a zmq endpoint string such as 'tcp://127.0.0.1:0', or None")
        if listen is not None:
            _zmq.check_tcp_port(listen, "listen")
        if config is None:
            config = EngineConfig()
        elif not isinstance(config, EngineConfig):
            raise TypeError("config must be an aionixl.EngineConfig")
        if listen is not None and _zmq.exposed(listen) and config.handshake_secret is None \
                and not config.allow_unauthenticated:
            raise UnprotectedListenerError(
                f"engine {name!r} would listen on {listen}, which other hosts can reach, without a "
                "handshake_secret: whoever completes a handshake can read and write every registered "
                "block, and crafted NIXL metadata can crash the process. Give the engines that "
                "connect to each other one secret, EngineConfig(handshake_secret=<16+ bytes>), or, "
                "on a trusted network only, EngineConfig(allow_unauthenticated=True)")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError("tuning must be an aionixl.lowlevel.Tuning")
        tuning = effective_tuning(config, tuning)
        self._regions = describe_regions(kv_caches)
        self._kv_caches = tuple(kv_caches)  # keep the memory alive while registered
        self._name = name
        self._listen = listen
        self._config = config
        self._tuning = tuning
        if discovery is not None and not isinstance(discovery, Discovery):
            raise TypeError("discovery must be an aionixl.Discovery (an aionixl.EtcdDiscovery, say) "
                            "or None")
        self._discovery = discovery
        self._discovery_open = False  # we opened it, so we close it
        self._num_blocks = self._regions[0].num_blocks
        self._address: str | None = None

        # Shared state every component is built with.
        life = self._life = Lifecycle(name)
        local = self._local = LocalSide(name, self._regions)
        self._tg: anyio.abc.TaskGroup | None = None
        self._bg_scope = anyio.CancelScope()
        #: The background task group (listeners, poller, drainer, push server) once open.
        self._bg_tg: anyio.abc.TaskGroup | None = None
        self._bg_started = False
        self._bg_done = anyio.Event()
        self._final_resources: dict[str, int] = {}
        self._leaked_on_close = 0

        # The components, bottom up, each given what it needs (see docs/architecture.md).
        #: Warnings that peers can trigger at will (bad handshakes, failures) go through here.
        noisy = self._noisy = RateLimitedLog(log)
        refusals = self._refusals = Refusals(noisy)

        def mailbox_full(dropped: int) -> None:
            noisy.log(logging.WARNING, "mailbox-full", "notification buffer full (%d messages, %d "
                      "bytes): dropped the oldest, %d so far", tuning.max_pending_notifications,
                      config.max_pending_notification_bytes, dropped)

        mailbox = self._mailbox = Mailbox(tuning.max_pending_notifications,
                                          config.max_pending_notification_bytes, mailbox_full)
        host = host_facts()
        peers = self._peers = PeerTable(local, life, noisy, read_mode=config.read_mode, host=host,
                                        max_descriptors=tuning.max_peer_descriptors,
                                        on_admit=self._wake_drainer, on_drop=self._peer_dropped)
        table = self._inflight = InFlightTable(local, peers.evict, self._wake_drainer)
        metrics = self._transfer_metrics = TransferMetrics(TransferResult, local.bytes_per_block,
                                                           len(self._regions), noisy)
        turns = self._turns = LoopTurns()
        direct = self._direct = DirectPath(local, life, config, tuning, peers, table, metrics, turns)
        self._coalescer = Coalescer(local, life, config, tuning, peers, table, direct, metrics, turns)
        leases = self._leases = LeaseTable(refusals)

        def deliver(note: Notification) -> None:
            """An incoming notification: a lease takes its read-dones and heartbeats."""
            if not leases.consume(note):
                mailbox.deliver(note)

        self._deliver = deliver

        self._push = Pusher(local, life, config, tuning, peers, table, deliver, noisy, refusals,
                            self._wake_drainer)
        self._handshakes = Handshakes(local, life, config, tuning, peers, noisy, host, self._wake_drainer)
        self._vllm = VllmConnector(local, life, peers, config, tuning.max_peer_descriptors,
                                   self._handshakes.connect)
        self._vllm_server = VllmServer(local, config, tuning, noisy, self._wake_drainer, self._relayed, host)
        self._transfers = Transfers(local, life, config, tuning, peers, self._coalescer, direct, self._push,
                                    metrics, turns, self._handshakes.connect)
        # The hot path: a call goes straight to the component's coroutine function (the
        # method below documents it and does the same; this skips one Python call).
        self.transfer_blocks = self._transfers.transfer_blocks  # type: ignore[method-assign]
        self._drainer = NotificationDrainer(local, tuning, deliver, mailbox, leases, peers, table,
                                            self._push, self._vllm_server, noisy, refusals)

    # ---- properties ---------------------------------------------------------------------

    @property
    def name(self) -> str:
        return self._name

    @property
    def address(self) -> str | None:
        """The endpoint actually bound, e.g. ``tcp://127.0.0.1:41877``; None without a listener."""
        return self._address

    @property
    def config(self) -> EngineConfig:
        return self._config

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def regions(self) -> tuple[Region, ...]:
        return tuple(self._regions)

    @property
    def peers(self) -> Mapping[str, Peer]:
        """Live peers by name: those we connected to and those that connected to us."""
        return dict(self._peers.by_name)

    @property
    def discovery(self) -> Discovery | None:
        """The registry this engine registers in and resolves names through (``discovery=``)."""
        return self._discovery

    @property
    def closed(self) -> bool:
        return self._life.state == CLOSED

    def live_resources(self) -> dict[str, int]:
        """NIXL resources this engine holds right now (all zero once closed cleanly)."""
        agent = self._local.agent
        if agent is None:
            return dict(self._final_resources)
        counts = agent.live()
        for key, n in self._vllm_server.live().items():  # the agent serving vLLM decoders
            counts[key] += n
        counts["in_flight"] = self._inflight.held + len(self._push.reads)
        counts["parked_handles"] = len(self._inflight.parked)
        return counts

    def metrics(self) -> EngineMetrics:
        """Counters, gauges and latency histograms, copied now (docs/metrics.md).

        Safe from any thread, e.g. a Prometheus server's: it only reads (the transfer
        counters through a seqlock, see ``TransferMetrics.snapshot``; the in-flight table
        through a copy), so it never counts a transfer twice. Fields are read one after
        another: each is exact, two of them may be a few transfers apart."""
        peers, mailbox, coalescer, push, server = (self._peers, self._mailbox, self._coalescer,
                                                   self._push, self._vllm_server)
        staging = self._local.staging
        return EngineMetrics(
            engine=self._name,
            **self._transfer_metrics.snapshot(),
            in_flight=self._inflight.callers() + len(push.reads),
            peers=len(peers.by_name),
            handshakes_accepted=self._handshakes.accepted,
            handshakes_rejected=self._handshakes.rejected,
            peers_evicted=peers.evicted,
            evictions=dict(peers.evictions),
            fence_evictions=peers.fenced_evictions,
            notifications_delivered=mailbox.delivered,
            notifications_dropped=mailbox.dropped,
            notifications_kept=mailbox.kept,
            notification_waiters=mailbox.waiting,
            merged_requests=coalescer.merged_requests,
            merged_calls=coalescer.merged_calls,
            reposts=coalescer.reposts,
            pushes_served=push.served,
            pushes_refused=push.refused,
            pushes_lost=push.lost,
            staging_slots=staging.slots if staging else 0,
            staging_stranded=staging.stranded if staging else 0,
            staging_reclaimed=staging.reclaimed if staging else 0,
            staging_exhausted=push.exhausted,
            leases_active=self._leases.active(),
            leases_released=self._leases.released,
            leases_expired=self._leases.expired,
            heartbeat_ids_unknown=self._leases.unknown,
            vllm_requests_answered=server.answered,
            vllm_requests_refused=server.refused,
            vllm_serving_restarts=sidecar.restarts if (sidecar := server.sidecar) else 0,
            vllm_serving_unresponsive=sidecar.unresponsive if sidecar else 0,
            messages_refused={kind: self._refusals.counts.get(kind, 0) for kind in REFUSAL_KINDS},
            leaked_on_close=self._leaked_on_close,
            **self._discovery_metrics(),
        )

    def stats(self) -> dict[str, int]:
        """Deprecated: :meth:`metrics` has every count it had, under the same names."""
        _deprecated("Engine.stats()", "Engine.metrics(), whose fields have the same names")
        snapshot = self.metrics()
        return {key: int(getattr(snapshot, key)) for key in STATS_KEYS}

    def _discovery_metrics(self) -> dict[str, Any]:
        d = self._discovery
        if d is None:
            return {}
        return {"discovery_registered": d.registered, "discovery_registrations": d.registrations,
                "discovery_keepalive_failures": d.keepalive_failures}

    # ---- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self._life.state != NEW:
            raise RuntimeError("an Engine can be entered once")
        self._life.state = OPEN
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            self._open_nixl()
            tools = loop_tools()
            self._inflight.bind_loop(tools)
            self._coalescer.bind_loop(tools)
            self._turns.bind_loop(tools)
            self._local.zctx = zmq.Context()
            self._bg_started = True
            await self._tg.start(self._run_background)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._close()
            self._bg_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise single_leaf(exc) from None
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        assert self._tg is not None
        result: bool | None = None
        try:
            await self.aclose()
        finally:
            if self._life.failure is not None:
                # A background task crashed: the task group reports it to the owner.
                result = await self._tg.__aexit__(exc_type, exc, tb)
            else:
                # Nothing is left running; let the body's own exception through unwrapped.
                await self._tg.__aexit__(None, None, None)
        return result

    async def aclose(self, drain_timeout: float | None = None) -> None:
        """Close the engine: idempotent, safe from any task and from several at once.

        With ``drain_timeout``, first :meth:`drain` for at most that long. Then waiting
        callers get ``EngineClosedError`` and every NIXL resource is released (bounded by
        ``close_timeout``; what could not be released is logged and counted).
        """
        if drain_timeout is not None:
            check_timeout(drain_timeout, "drain_timeout")
            if self._life.state in (OPEN, DRAINING) and self._life.failure is None:
                try:
                    with suppress(EngineClosedError):
                        await self.drain(drain_timeout)
                finally:
                    await self.aclose()  # closes even when the drain was cancelled
                return
        life = self._life
        if life.state == NEW:
            life.state = CLOSED
            self._life.closed.set()
            return
        if life.state in (CLOSING, CLOSED):
            await self._life.closed.wait()
            return
        life.state = CLOSING
        with anyio.CancelScope(shield=True):
            await self._close()

    async def drain(self, timeout: float, expect: Sequence[bytes] = ()) -> bool:
        """Stop taking new work, then wait until the work already under way is done.

        From the first call on, ``transfer_blocks`` and ``connect`` raise
        ``EngineClosedError`` and the listener turns new peers away ("draining"), while
        notifications keep flowing. Then it waits, at most ``timeout`` seconds, until this
        engine's own transfers have finished (merged requests still gathering included),
        every pending ``wait_notification`` call has been answered, every lease has ended
        (its readers done, or expired) and a notification equal to each message in
        ``expect`` has arrived (those are consumed here): how a prefill engine waits out
        the decoders still reading from it. Returns True when all of that happened in time,
        False (and logs what was left) otherwise. The engine stays draining until
        :meth:`aclose`.
        """
        self._check_open(draining_ok=True)
        check_timeout(timeout, "timeout")
        messages = None if isinstance(expect, (bytes, bytearray, memoryview)) or \
            not isinstance(expect, Iterable) else list(expect)  # walked once: a generator too
        if messages is None or not all(isinstance(m, (bytes, bytearray, memoryview)) for m in messages):
            raise ValueError("expect must be a sequence of bytes messages")
        expected = [bytes(m) for m in messages]
        self._life.state = DRAINING
        self._wake_drainer()
        leases = self._leases

        def settled() -> bool:
            expected[:] = [m for m in expected if self._mailbox.take(m, None) is None]
            leases.sweep()
            return not self._inflight.records and not self._coalescer.gathering \
                and not self._push.active and not self._mailbox.waiting and not leases.waiting \
                and not expected

        with self._life.operation(), anyio.move_on_after(timeout if math.isfinite(timeout) else None):
            while not settled():
                await anyio.sleep(self._tuning.notification_poll_interval)
        if settled():
            return True
        log.warning("engine %r drain timed out after %s s: %d transfer(s) in flight, %d "
                    "notification waiter(s), %d lease(s) live, %d expected notification(s) not "
                    "seen", self._name, timeout, len(self._inflight.records), self._mailbox.waiting,
                    len(leases.view), len(expected))
        return False

    def _open_nixl(self) -> None:
        cfg, tuning, local = self._config, self._tuning, self._local
        make = tuning.agent_factory or NixlAgent
        agent = local.agent = make(self._name, cfg.backends, tuning.nixl_progress_thread,
                                   tuning.nixl_telemetry)
        agent.register(registration_spans(self._regions), local.mem_type)
        local.dlist = agent.prep_dlist(None, block_descriptors(self._regions), local.mem_type)
        if cfg.push_staging_bytes and local.mem_type == "DRAM":
            local.staging = Staging(self._regions, cfg.push_staging_bytes, tuning.stranded_slot_ttl)
            agent.register(registration_spans(local.staging.regions), "DRAM")
        local.metadata = agent.metadata()

    async def _run_background(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            with self._bg_scope:
                async with anyio.create_task_group() as tg:
                    self._bg_tg = tg
                    if self._listen is not None:
                        self._address = await tg.start(self._handshakes.listen, self._listen)
                    tg.start_soon(self._inflight.run)
                    tg.start_soon(self._drainer.run)
                    tg.start_soon(self._push.run)
                    if self._discovery is not None:
                        await self._register(tg)
                    task_status.started()
        except BaseException as exc:
            if self._life.state in (OPEN, DRAINING) and not isinstance(exc, anyio.get_cancelled_exc_class()):
                self._life.failure = exc  # refuse new calls; the owner's exit closes the engine
            raise
        finally:
            self._bg_done.set()

    async def _register(self, tg: anyio.abc.TaskGroup) -> None:
        """Open the discovery; with a listener, register this engine (``DiscoveryError``
        when etcd does not answer or the name is taken) and keep the lease alive in ``tg``.
        An engine without a listener registers nothing (nobody could connect to it) but
        resolves names and watches."""
        discovery = self._discovery
        assert discovery is not None
        discovery.open(self._name, tg)
        self._discovery_open = True
        if self._address is None:
            return
        local = self._local
        await discovery.register(EngineRecord(
            self._name, self._address, local.num_blocks,
            tuple(r.block_bytes for r in self._regions),
            local.mem_type, tuple(sorted(FEATURES))))
        tg.start_soon(discovery.keep_alive)

    async def _close(self) -> None:
        """Ordered teardown; runs shielded, each stage bounded by close_timeout."""
        deadline = anyio.current_time() + self._config.close_timeout
        try:
            self._bg_scope.cancel()
            self._vllm_server.stop()  # a serving child still starting is not in _bg_scope yet
            if self._bg_started:
                with anyio.move_on_after(self._config.close_timeout):
                    await self._bg_done.wait()
            if self._discovery is not None and self._discovery_open:
                # Peers stop finding us first: the lease is revoked (our key goes at once)
                # and watches end, before anything else is released.
                self._discovery_open = False
                await self._discovery.close(deadline)
            # Waiting callers learn that the engine closed.
            self._life.end_operations()
            for waiter in self._mailbox.all_waiters():
                self._mailbox.remove_waiter(waiter)
                waiter.event.set()
            self._leases.close()
            self._push.closing(EngineClosedError(f"engine {self._name!r} closed"))
            if self._local.agent is not None:
                await self._release_nixl(deadline)
        finally:
            self._tell_callers_closed()  # any still waiting (no agent, or the release stopped early)
            if self._local.zctx is not None:
                self._local.zctx.destroy(linger=0)
                self._local.zctx = None
            self._life.state = CLOSED
            self._life.closed.set()

    async def _release_nixl(self, deadline: float) -> None:
        """Transfer handles, goodbyes, peers, local descriptors, registrations, agent."""
        local = self._local
        agent = local.agent
        assert agent is not None
        await self._push.close(deadline)  # servers pushing into us stop first (bounded)
        problems = await self._inflight.close(deadline, self._tuning.close_grace)
        await self._peers.say_goodbye(deadline)
        # Callers of transfers under way are told now and run only after the peers are
        # dropped below (no await between): a read's bytes may land until then, since UCX
        # does not stop a GET under way and a server that did not confirm may still push.
        self._tell_callers_closed()
        self._peers.drop_all(problems)
        self._vllm_server.release(problems)  # the agent vLLM decoders read from, if in this process
        if local.dlist >= 0:
            try:
                agent.release_dlist(local.dlist)
            except AionixlError as exc:
                problems.append(str(exc))
        try:
            agent.deregister_all()
        except AionixlError as exc:
            problems.append(str(exc))
        counts = agent.live()
        counts["in_flight"] = 0
        counts["parked_handles"] = 0
        self._final_resources = counts
        self._leaked_on_close = sum(counts.values())
        if problems:
            log.error("engine %r closed with leaks: %s", self._name, "; ".join(problems))
        local.agent = None
        if not agent.destroy():
            self._leaked_on_close += 1  # the agent outlived the close (logged by destroy)

    def _tell_callers_closed(self) -> None:
        """Closing: the callers of transfers under way get ``EngineClosedError`` (those of
        push reads, the one ``Pusher.closing`` gave them); a second call finds none."""
        self._inflight.fail_all(EngineClosedError(f"engine {self._name!r} closed"))
        self._push.fail_all()

    def _check_open(self, *, draining_ok: bool = False) -> None:
        self._life.check_open(draining_ok=draining_ok)

    def _wake_drainer(self) -> None:
        self._drainer.wake()

    def _relayed(self, note: Notification) -> None:
        """A notification our vLLM serving process received: delivered as the drainer's own,
        except the engine's reserved messages, which are refused (``NotificationDrainer.sort``)."""
        notes: list[Notification] = []
        self._drainer.sort(note.peer, note.message, notes, relayed=True)
        for each in notes:
            self._deliver(each)

    def _peer_dropped(self, peer: Peer, error: AionixlError) -> None:
        """The peer table dropped ``peer``: its transfers and push reads fail with ``error``."""
        self._inflight.fail_peer(peer, error)
        self._push.fail_peer(peer, error)

    # ---- for aionixl.lowlevel: tools that drive NIXL beside the engine -----------------------

    def _nixl_metadata(self) -> bytes:
        return self._local.metadata if self._local.agent is not None else b""

    def _poll_nixl(self) -> list[Notification]:
        self._check_open(draining_ok=True)
        return [note for note in self._drainer.poll_once() if not self._leases.consume(note)]

    def _trace_wakeups(self, trace: list[int] | None) -> None:
        self._inflight.wake_trace = trace

    # ---- peers --------------------------------------------------------------------------

    async def connect(self, address: str, timeout: float = 10.0) -> Peer:
        """Handshake with the engine listening at ``address`` and return its :class:`Peer`.

        Idempotent: a live peer at that address is returned as is, and concurrent calls
        for one address share one handshake. Raises ``HandshakeError`` when nobody answers
        within ``timeout`` or the answer is unusable, ``IncompatiblePeerError`` when the
        geometry or compat keys differ.
        """
        return await self._handshakes.connect(address, timeout)

    async def connect_to(self, name: str, timeout: float = 10.0) -> Peer:
        """Resolve ``name`` through the engine's discovery and :meth:`connect` to it.

        Waits up to ``timeout`` seconds in all: for the name to be registered (an engine
        starting up registers within moments), then for the handshake. ``DiscoveryError``
        when no engine of that name registered in time or etcd did not answer;
        ``HandshakeError`` (or ``IncompatiblePeerError``) from the handshake itself, as
        :meth:`connect`. ``RuntimeError`` for an engine built without ``discovery=``.
        """
        self._check_open()
        check_timeout(timeout, "timeout")
        if self._discovery is None:
            raise RuntimeError(f"engine {self._name!r} has no discovery: pass "
                               "Engine(..., discovery=aionixl.EtcdDiscovery([...]))")
        if name == self._name:
            raise ValueError(f"connect_to({name!r}): that is this engine's own name")
        deadline = anyio.current_time() + timeout
        with self._life.operation():
            record = await self._discovery.lookup(name, timeout)
        return await self.connect(record.address, max(0.001, deadline - anyio.current_time()))

    async def _connect_vllm(self, address: str, *, pp_rank: int, tp_rank: int,
                            expect_compat_hash: str | None, timeout: float,
                            expect_engine_id: str | None = None, prefer_aionixl: bool = False) -> Peer:
        """:func:`aionixl.vllm.connect`."""
        return await self._vllm.connect(address, pp_rank=pp_rank, tp_rank=tp_rank,
                                        expect_compat_hash=expect_compat_hash,
                                        expect_engine_id=expect_engine_id, timeout=timeout,
                                        prefer_aionixl=prefer_aionixl)

    async def _serve_vllm(self, listen: str, *, engine_id: str, compat_hash: str, block_size: int,
                          kv_cache_layout: str, attn_backend_name: str, tp_rank: int, pp_rank: int,
                          layer_names: Sequence[str] | None, isolate: bool,
                          exact_engine_id: bool = False, progress_thread: bool = True) -> str:
        """:func:`aionixl.vllm.serve`."""
        self._check_open()
        if not isinstance(listen, str) or not listen:
            raise ValueError("listen must be a zmq endpoint string such as 'tcp://0.0.0.0:5600'")
        _zmq.check_tcp_port(listen, "listen")
        if _zmq.exposed(listen) and not self._config.allow_unauthenticated:
            raise UnprotectedListenerError(
                f"serving vLLM decoders on {listen}, which other hosts can reach: vLLM's side "
                "channel has no authentication (a handshake_secret cannot cover it), so whoever "
                "asks can read every registered block. Serve on loopback (decoders on this host), "
                "or, on a trusted network only, set EngineConfig(allow_unauthenticated=True)")
        server = self._vllm_server
        server.configure(engine_id=engine_id, compat_hash=compat_hash, block_size=block_size,
                         kv_cache_layout=kv_cache_layout, attn_backend_name=attn_backend_name,
                         pp_rank=pp_rank, tp_rank=tp_rank, layer_names=layer_names, isolate=isolate,
                         exact_engine_id=exact_engine_id, progress_thread=progress_thread,
                         route=None if self._address is None else AionixlRoute(self._address, self._name))
        assert self._bg_tg is not None
        try:
            with self._life.operation():
                if server.sidecar is not None:
                    await self._bg_tg.start(server.sidecar.run)
                    self._check_open()
                address: str = await self._bg_tg.start(server.listen, listen)
        except BaseException:
            server.reset()  # a later call may try another endpoint
            self._check_open()  # the engine closing meanwhile ended the start
            raise
        self._wake_drainer()
        return address

    async def disconnect(self, peer: Peer) -> None:
        """Forget ``peer`` and release its NIXL state.

        Its transfers under way get up to ``close_grace`` to finish; those still running
        then fail with ``PeerDisconnectedError``. (Closing the connection under a UCX-TCP
        transfer that is moving data made the serving process abort inside UCX.)
        """
        self._check_open(draining_ok=True)
        self._peers.own(peer)
        with anyio.move_on_after(self._tuning.close_grace):
            while peer.connected and (self._inflight.busy_with(peer) or self._push.busy_with(peer)):
                await anyio.sleep(0.001)
        if peer.connected:
            await self._push.stop_peer(peer)  # cancel and confirm what is left (bounded)
        if peer.connected:
            self._peers.drop(peer, None)
        await anyio.lowlevel.checkpoint()

    # ---- transfers ----------------------------------------------------------------------

    def transfer_blocks(self, peer: Peer, local_blocks: Sequence[int] | IndexArray,
                        remote_blocks: Sequence[int] | IndexArray, op: Op = "read",
                        notify: bytes | None = None, timeout: float | None = None, *,
                        local_part: BlockPart | None = None,
                        remote_part: BlockPart | None = None) -> Coroutine[Any, Any, TransferResult]:
        """Move blocks between this engine and ``peer``, in every region (await it).

        ``op="read"`` copies the peer's block ``remote_blocks[i]`` into our block
        ``local_blocks[i]``; ``"write"`` copies the other way. Returns once the data is in
        place. ``notify`` is delivered to the peer after the data landed. ``timeout``
        defaults to ``EngineConfig.transfer_timeout``; on expiry, or on cancellation, the
        NIXL transfer is released. A read is fenced first (nothing more of it lands in our
        blocks); a write is not: UCX cannot abort a posted WRITE, so its bytes may still
        land in the peer's blocks after the call raised.

        ``local_part`` and ``remote_part`` (:class:`aionixl.BlockPart`; None is the whole
        block) move parts of blocks, for peers whose layout differs from ours (another
        tensor parallelism: head slices; another block size: token ranges): the selected
        bytes of each source block, in increasing offset, land in the selected bytes of
        the matching destination block, in increasing offset. Both must select as many
        bytes of every region; a part that does not divide a block, or selections of
        different sizes (whole blocks of different sizes too), raise ``ValueError`` naming
        the region and sizes before anything is sent.
        """
        # Shadowed per instance by the component's own method (see __init__); kept for
        # documentation and for anyone calling it through the class.
        return self._transfers.transfer_blocks(peer, local_blocks, remote_blocks, op, notify, timeout,
                                               local_part=local_part, remote_part=remote_part)

    # ---- notifications ------------------------------------------------------------------

    async def send_notification(self, peer: Peer, message: bytes) -> None:
        """Send ``message`` to ``peer`` on its own, not tied to a transfer."""
        self._check_open(draining_ok=True)
        p = self._peers.live(peer)
        message = user_message(message, "message")
        agent = self._local.agent
        assert agent is not None
        try:
            agent.send_notif(p.name, message)
        except PeerDisconnectedError as exc:
            raise self._peers.evict(p, exc) from exc
        self._wake_drainer()
        await anyio.lowlevel.checkpoint()

    # ---- leases -------------------------------------------------------------------------

    def lease(self, request_id: str, block_ids: Iterable[int], *, readers: int = 1,
              duration: float = 30.0) -> Lease:
        """Hold ``block_ids`` for ``request_id`` until ``readers`` readers are done.

        A reader is done when its :func:`aionixl.read_done` notification arrives (vLLM's
        ``"<request_id>:<readers>"``; a vLLM decode worker sends the same); heartbeats
        (:meth:`heartbeat`, vLLM's ``"HB:..."``) move ``expires_at`` to at least now +
        ``duration``. ``await lease.wait()``; see :class:`aionixl.Lease`. ``ValueError`` for
        an empty or already leased request id, ids outside the cache, ``readers < 1`` or
        ``duration <= 0``. The engine's clock is ``time.monotonic()``.
        """
        self._check_open()
        lease = self._leases.add(request_id, block_ids, self._local.num_blocks, readers, duration)
        self._wake_drainer()  # it polls at its busy cadence while leases are live
        return lease

    @property
    def leases(self) -> Mapping[str, Lease]:
        """The live leases by request id (a read-only view)."""
        self._leases.sweep()
        return self._leases.view

    async def wait_notification(self, message: bytes, peer: Peer | str | None = None,
                                timeout: float | None = None) -> Notification:
        """Wait for one notification equal to ``message`` (from ``peer`` if given).

        A matching notification that arrived earlier is returned at once. Each
        notification satisfies exactly one waiter. Raises ``TimeoutError`` after
        ``timeout`` seconds (None waits until the engine closes).
        """
        self._check_open(draining_ok=True)
        if not isinstance(message, (bytes, bytearray, memoryview)):
            raise ValueError("message must be bytes")
        message = bytes(message)
        peer_name = peer if peer is None or isinstance(peer, str) else self._peers.own(peer).name
        if timeout is not None:
            check_timeout(timeout, "timeout")
        kept = self._mailbox.take(message, peer_name)
        if kept is not None:
            return kept
        waiter = self._mailbox.add_waiter(message, peer_name)
        self._wake_drainer()
        try:
            with self._life.operation():
                with anyio.fail_after(timeout):
                    await waiter.event.wait()
        except BaseException as exc:
            self._mailbox.remove_waiter(waiter)
            if waiter.result is not None:
                if isinstance(exc, (TimeoutError, EngineClosedError)):
                    return waiter.result  # it arrived just as the wait ended: keep it
                self._mailbox.redeliver(waiter.result)  # cancelled: the next waiter gets it
            raise
        if waiter.result is None:
            self._check_open(draining_ok=True)
            raise EngineClosedError(f"engine {self._name!r} closed")
        return waiter.result

    # ---- deprecated: moved in 0.2, gone in 0.3 -------------------------------------------

    def nixl_metadata(self) -> bytes:
        """Deprecated: :func:`aionixl.lowlevel.nixl_metadata`."""
        _deprecated("Engine.nixl_metadata()", "aionixl.lowlevel.nixl_metadata(engine)")
        return self._nixl_metadata()

    def poll_nixl(self) -> list[Notification]:
        """Deprecated: :func:`aionixl.lowlevel.poll_nixl`."""
        _deprecated("Engine.poll_nixl()", "aionixl.lowlevel.poll_nixl(engine)")
        return self._poll_nixl()

    def trace_wakeups(self, trace: list[int] | None) -> None:
        """Deprecated: :func:`aionixl.lowlevel.trace_wakeups`."""
        _deprecated("Engine.trace_wakeups()", "aionixl.lowlevel.trace_wakeups(engine, trace)")
        self._trace_wakeups(trace)

    async def connect_vllm(self, address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                           expect_compat_hash: str | None = None, timeout: float = 10.0) -> Peer:
        """Deprecated: :func:`aionixl.vllm.connect`."""
        _deprecated("Engine.connect_vllm()", "aionixl.vllm.connect(engine, address, ...)")
        return await self._connect_vllm(address, pp_rank=pp_rank, tp_rank=tp_rank,
                                        expect_compat_hash=expect_compat_hash, timeout=timeout)

    async def serve_vllm(self, listen: str = "tcp://127.0.0.1:0", *, engine_id: str, compat_hash: str,
                         block_size: int, kv_cache_layout: str, attn_backend_name: str,
                         tp_rank: int = 0, pp_rank: int = 0,
                         layer_names: Sequence[str] | None = None, isolate: bool = False) -> str:
        """Deprecated: :func:`aionixl.vllm.serve`."""
        _deprecated("Engine.serve_vllm()", "aionixl.vllm.serve(engine, listen, ...)")
        return await self._serve_vllm(listen, engine_id=engine_id, compat_hash=compat_hash,
                                      block_size=block_size, kv_cache_layout=kv_cache_layout,
                                      attn_backend_name=attn_backend_name, tp_rank=tp_rank,
                                      pp_rank=pp_rank, layer_names=layer_names, isolate=isolate)

    async def heartbeat(self, peer: Peer, request_ids: Iterable[str]) -> None:
        """Deprecated: :func:`aionixl.vllm.heartbeat`."""
        _deprecated("Engine.heartbeat()", "aionixl.vllm.heartbeat(engine, peer, request_ids)")
        await self.send_notification(peer, heartbeat_message(request_ids))

    @property
    def vllm_engine_id(self) -> str | None:
        """Deprecated: :func:`aionixl.vllm.engine_id`."""
        _deprecated("Engine.vllm_engine_id", "aionixl.vllm.engine_id(engine)")
        return self._vllm_server.engine_id


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated: use {new} (the old name goes in 0.3)", DeprecationWarning,
                  stacklevel=3)


__all__ = ["Engine", "Peer", "TransferResult"]
