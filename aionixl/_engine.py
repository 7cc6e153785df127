"""The engine: one NIXL agent, its registered KV cache, its peers, and the tasks that drive them.

Shape: ``async with Engine(...)`` opens a task group in the owner's task. Inside it, one
background task holds a cancel scope of its own (so ``aclose()`` from any task stops the
engine without cancelling the owner's body) and, under it, the handshake listener, the
transfer poller and the notification drainer. Shutdown is: cancel that scope, wake every
waiting caller with ``EngineClosedError``, then release NIXL resources in order, each step
bounded by ``EngineConfig.close_timeout``. The engine starts no threads.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager as ContextManager
from contextlib import contextmanager, suppress
from types import TracebackType
from typing import Any, Literal, NamedTuple

import anyio
import anyio.abc
import anyio.lowlevel
import zmq

from . import _protocol as proto
from . import _zmq
from ._config import EngineConfig
from ._errors import (
    AionixlError,
    EngineClosedError,
    HandshakeError,
    IncompatiblePeerError,
    ListenError,
    PeerDisconnectedError,
    TransferError,
    TransferTimeoutError,
)
from ._nixl import DONE, ERR, NO_HANDLE, PROC, Agent, Indices, Status, metadata_agent_name
from ._notifications import Mailbox, Notification
from ._ratelimit import RateLimitedLog
from ._regions import (
    IndexArray,
    Region,
    block_descriptors,
    block_ids,
    check_distinct,
    describe_regions,
    descriptor_indices,
    has_duplicates,
    region_offsets,
    registration_spans,
    small_indices,
)

log = logging.getLogger("aionixl")

Op = Literal["read", "write"]


class TransferResult(NamedTuple):
    """What one ``transfer_blocks`` call moved."""

    blocks: int
    nbytes: int
    seconds: float


class Peer:
    """A remote engine this engine can move blocks to and from.

    Returned by :meth:`Engine.connect`; peers that connected to us appear in
    :attr:`Engine.peers` too (with ``address`` None). A peer object stays valid until
    :meth:`Engine.disconnect` or the engine closes; ``connected`` then turns False. A peer
    whose transfers fail (it died, the link broke) is evicted the same way: its transfers
    then raise ``PeerDisconnectedError`` until ``connect()`` makes a new one.
    """

    __slots__ = ("name", "address", "regions", "num_blocks", "_dlist", "_offsets", "_offset_list",
                 "_metadata", "_engine", "_connected", "_lost", "_one_block", "_foreign")

    def __init__(self, engine: Engine, name: str, address: str | None,
                 regions: list[Region], dlist: int, metadata: bytes) -> None:
        self.name = name
        self.address = address
        self.regions = tuple(regions)
        self.num_blocks = regions[0].num_blocks
        self._dlist = dlist
        self._offsets = region_offsets(len(regions), self.num_blocks)
        self._offset_list: list[int] = self._offsets.ravel().tolist()
        self._metadata = metadata
        self._engine = engine
        self._connected = True
        self._lost: BaseException | None = None  # why it was evicted, if it was
        self._one_block: dict[int, list[int]] = {}  # block id -> its descriptor indices
        #: Not an aionixl engine (a vLLM prefill): it gets no probe and no goodbye.
        self._foreign = False

    @property
    def connected(self) -> bool:
        return self._connected

    def __repr__(self) -> str:
        state = "connected" if self._connected else "disconnected"
        return f"<Peer {self.name!r} at {self.address or '(inbound)'} {state}>"


class _InFlight:
    __slots__ = ("peer", "event", "status", "error", "finished_ns")

    def __init__(self, peer: Peer) -> None:
        self.peer = peer
        self.event = anyio.Event()
        self.status: Status = PROC
        self.error: AionixlError | None = None
        self.finished_ns = 0

    def finish(self, status: Status, error: AionixlError | None = None) -> None:
        self.status = status
        self.error = error
        self.finished_ns = time.perf_counter_ns()
        self.event.set()


#: Notifications engines send each other, never delivered to callers: the liveness probe,
#: and the goodbye of a closing engine (tagged with a digest of its NIXL metadata).
_RESERVED = b"\x00aionixl-"
_PROBE = _RESERVED + b"probe\x00"
_GOODBYE = _RESERVED + b"goodbye\x00"


def _goodbye(metadata: bytes) -> bytes:
    return _GOODBYE + hashlib.sha256(metadata).digest()[:16]


#: How long transfer_blocks may finish transfers inline before it yields to the loop: long
#: while the loop has nothing else to run, short once a yield shows others were waiting
#: (a yield that takes longer than _CROWDED).
_SLICE_LONG = 0.002
_SLICE_SHORT = 0.0001
_CROWDED = 0.0002

_NEW, _OPEN, _DRAINING, _CLOSING, _CLOSED = "new", "open", "draining", "closing", "closed"


class _RefusedError(HandshakeError):
    """The peer refused us for a reason another attempt will not change."""


#: Reject codes that a later attempt may not get: the peer is busy or shutting down.
_RETRYABLE_REJECTS = frozenset({"internal", "draining"})


class Engine:
    """Moves KV-cache blocks between this process and peer engines over NIXL.

    ``kv_caches`` is a sequence of regions (torch tensors on CPU or CUDA, or numpy
    arrays); see the README for the layout rules. ``listen`` is the zmq endpoint peers
    connect to (port 0 picks a free port); ``None`` runs without a listener, for engines
    that only connect out.
    """

    def __init__(self, name: str, kv_caches: Sequence[Any], listen: str | None = "tcp://127.0.0.1:0",
                 config: EngineConfig | None = None) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError("name must be a non-empty str")
        if listen is not None and (not isinstance(listen, str) or not listen):
            raise ValueError("listen must be a zmq endpoint string such as 'tcp://127.0.0.1:0', or None")
        if config is None:
            config = EngineConfig()
        elif not isinstance(config, EngineConfig):
            raise TypeError("config must be an aionixl.EngineConfig")
        self._regions = describe_regions(kv_caches)
        self._kv_caches = tuple(kv_caches)  # keep the memory alive while registered
        self._name = name
        self._listen = listen
        self._config = config
        self._num_blocks = self._regions[0].num_blocks
        self._offsets = region_offsets(len(self._regions), self._num_blocks)
        self._offset_list: list[int] = self._offsets.ravel().tolist()
        self._one_block: dict[int, list[int]] = {}  # block id -> its descriptor indices
        self._inline_polls = config.inline_polls
        self._secret = config.handshake_secret
        self._own_metadata = b""  # this agent's NIXL metadata, once registered
        self._replay_guard = proto.ReplayGuard()
        self._mem_type = self._regions[0].mem_type
        self._bytes_per_block = sum(r.block_bytes for r in self._regions)
        self._compat = dict(config.compat)
        self._compat_hash = proto.compat_hash(self._regions, self._compat)

        self._state = _NEW
        self._failure: BaseException | None = None
        self._address: str | None = None
        self._agent: Agent | None = None
        self._zctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._local_dlist = -1
        self._tg: anyio.abc.TaskGroup | None = None
        self._bg_scope = anyio.CancelScope()
        self._bg_started = False
        self._bg_done = anyio.Event()
        self._close_done = anyio.Event()
        self._op_scopes: set[anyio.CancelScope] = set()

        self._peers: dict[str, Peer] = {}
        self._peers_by_address: dict[str, Peer] = {}
        self._connecting: dict[str, anyio.Event] = {}
        self._connect_errors: dict[str, BaseException] = {}

        self._inflight: dict[int, _InFlight] = {}
        self._parked: set[int] = set()  # handles NIXL would not release yet
        self._poller_wakeup = anyio.Event()
        self._drainer_wakeup = anyio.Event()
        self._mailbox = Mailbox(config.max_pending_notifications)
        self._final_resources: dict[str, int] = {}
        self._leaked_on_close = 0
        #: Warnings that peers can trigger at will (bad handshakes, failures) go through here.
        self._noisy = RateLimitedLog(log)
        self._handshakes_accepted = self._handshakes_rejected = self._peers_evicted = 0
        self._last_yield = 0.0  # perf_counter() when transfer_blocks last went through the loop
        self._slice = _SLICE_LONG
        #: Benchmarks set a list here to collect, per transfer finished by the poller, the
        #: nanoseconds from the poller seeing its final state to the caller running again.
        self._wake_trace: list[int] | None = None

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
        return dict(self._peers)

    @property
    def closed(self) -> bool:
        return self._state == _CLOSED

    def live_resources(self) -> dict[str, int]:
        """NIXL resources this engine holds right now (all zero once closed cleanly)."""
        if self._agent is None:
            return dict(self._final_resources)
        counts = self._agent.live()
        counts["in_flight"] = len(self._inflight)
        counts["parked_handles"] = len(self._parked)
        return counts

    def stats(self) -> dict[str, int]:
        return {
            "notifications_kept": self._mailbox.kept,
            "notifications_dropped": self._mailbox.dropped,
            "notification_waiters": self._mailbox.waiting,
            "leaked_on_close": self._leaked_on_close,
            "handshakes_accepted": self._handshakes_accepted,
            "handshakes_rejected": self._handshakes_rejected,
            "peers_evicted": self._peers_evicted,
        }

    # ---- lifecycle ----------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self._state != _NEW:
            raise RuntimeError("an Engine can be entered once")
        self._state = _OPEN
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        try:
            self._open_nixl()
            self._zctx = zmq.Context()
            self._bg_started = True
            await self._tg.start(self._run_background)
        except BaseException as exc:
            with anyio.CancelScope(shield=True):
                await self._close()
            self._bg_scope.cancel()
            await self._tg.__aexit__(None, None, None)
            raise _single_leaf(exc) from None
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> bool | None:
        assert self._tg is not None
        result: bool | None = None
        try:
            await self.aclose()
        finally:
            if self._failure is not None:
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
            _check_timeout(drain_timeout, "drain_timeout")
            if self._state in (_OPEN, _DRAINING) and self._failure is None:
                try:
                    with suppress(EngineClosedError):
                        await self.drain(drain_timeout)
                finally:
                    await self.aclose()  # closes even when the drain was cancelled
                return
        if self._state == _NEW:
            self._state = _CLOSED
            self._close_done.set()
            return
        if self._state in (_CLOSING, _CLOSED):
            await self._close_done.wait()
            return
        self._state = _CLOSING
        with anyio.CancelScope(shield=True):
            await self._close()

    async def drain(self, timeout: float, expect: Sequence[bytes] = ()) -> bool:
        """Stop taking new work, then wait until the work already under way is done.

        From the first call on, ``transfer_blocks`` and ``connect`` raise
        ``EngineClosedError`` and the listener turns new peers away ("draining"), while
        notifications keep flowing. Then it waits, at most ``timeout`` seconds, until this
        engine's own transfers have finished, every pending ``wait_notification`` call has
        been answered, and a notification equal to each message in ``expect`` has arrived
        (those are consumed here): how a prefill engine waits out the decoders still
        reading from it. Returns True when all of that happened in time, False (and logs
        what was left) otherwise. The engine stays draining until :meth:`aclose`.
        """
        self._check_open(draining_ok=True)
        _check_timeout(timeout, "timeout")
        if isinstance(expect, (bytes, bytearray, memoryview)) or \
                not all(isinstance(m, (bytes, bytearray, memoryview)) for m in expect):
            raise ValueError("expect must be a sequence of bytes messages")
        expected = [bytes(m) for m in expect]
        self._state = _DRAINING
        self._wake_drainer()

        def settled() -> bool:
            expected[:] = [m for m in expected if self._mailbox.take(m, None) is None]
            return not self._inflight and not self._mailbox.waiting and not expected

        with self._operation(), anyio.move_on_after(timeout if math.isfinite(timeout) else None):
            while not settled():
                await anyio.sleep(self._config.notification_poll_interval)
        if settled():
            return True
        log.warning("engine %r drain timed out after %s s: %d transfer(s) in flight, %d "
                    "notification waiter(s), %d expected notification(s) not seen", self._name,
                    timeout, len(self._inflight), self._mailbox.waiting, len(expected))
        return False

    def _open_nixl(self) -> None:
        cfg = self._config
        self._agent = Agent(self._name, cfg.backends, cfg.nixl_progress_thread)
        self._agent.register(registration_spans(self._regions), self._mem_type)
        self._local_dlist = self._agent.prep_dlist(None, block_descriptors(self._regions),
                                                   self._mem_type)
        self._own_metadata = self._agent.metadata()

    async def _run_background(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        try:
            with self._bg_scope:
                async with anyio.create_task_group() as tg:
                    if self._listen is not None:
                        self._address = await tg.start(self._listener)
                    tg.start_soon(self._poll_transfers)
                    tg.start_soon(self._drain_notifications)
                    task_status.started()
        except BaseException as exc:
            if self._state in (_OPEN, _DRAINING) and not isinstance(exc, anyio.get_cancelled_exc_class()):
                self._failure = exc  # refuse new calls; the owner's exit closes the engine
            raise
        finally:
            self._bg_done.set()

    async def _close(self) -> None:
        """Ordered teardown; runs shielded, each stage bounded by close_timeout."""
        deadline = anyio.current_time() + self._config.close_timeout
        try:
            self._bg_scope.cancel()
            if self._bg_started:
                with anyio.move_on_after(self._config.close_timeout):
                    await self._bg_done.wait()
            # Waiting callers learn that the engine closed.
            for scope in list(self._op_scopes):
                scope.cancel()
            closed = EngineClosedError(f"engine {self._name!r} closed")
            for waiter in self._mailbox.all_waiters():
                self._mailbox.remove_waiter(waiter)
                waiter.event.set()
            inflight, self._inflight = self._inflight, {}
            for rec in inflight.values():
                rec.finish(ERR, closed)
            if self._agent is not None:
                await self._release_nixl(list(inflight), deadline)
        finally:
            if self._zctx is not None:
                self._zctx.destroy(linger=0)
                self._zctx = None
            self._state = _CLOSED
            self._close_done.set()

    async def _release_nixl(self, handles: list[int], deadline: float) -> None:
        agent = self._agent
        assert agent is not None
        pending = set(handles) | self._parked | set(agent.xfers)
        self._parked = set()
        # Let transfers under way finish first (bounded by close_grace): cancelling a UCX
        # transfer that is moving data leaves requests UCX complains about at teardown.
        grace_end = min(deadline, anyio.current_time() + self._config.close_grace)
        moving = set(pending)
        while moving and anyio.current_time() < grace_end:
            moving = {h for h in moving if self._still_moving(agent, h)}
            if moving:
                await anyio.sleep(0.001)
        cancelled_any = bool(moving)
        while True:
            pending = {h for h in pending if not agent.release_xfer(h)}
            if not pending or anyio.current_time() >= deadline:
                break
            self._progress_quietly(agent)
            await anyio.sleep(0.001)
        if cancelled_any:
            # Let UCX retire the cancelled operations before the worker goes away.
            for _ in range(20):
                self._progress_quietly(agent)
                await anyio.sleep(0)
        problems: list[str] = []
        if pending:
            problems.append(f"{len(pending)} transfer handle(s) NIXL would not release")
        await self._say_goodbye(agent, deadline)
        for peer in list(self._peers.values()):
            self._drop_peer(peer, problems)
        if self._local_dlist >= 0:
            self._attempt(agent.release_dlist, self._local_dlist, problems)
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
        agent.destroy()
        self._agent = None

    async def _say_goodbye(self, agent: Agent, deadline: float) -> None:
        """Tell every peer we are going, so it drops us now instead of finding out later."""
        if not self._peers:
            return
        goodbye = _goodbye(self._own_metadata)
        for peer in self._peers.values():
            if peer._foreign:
                continue
            with suppress(AionixlError):
                agent.send_notif(peer.name, goodbye)
        for _ in range(5):  # let the messages leave before the connections close
            if anyio.current_time() >= deadline:
                break
            self._progress_quietly(agent)
            await anyio.sleep(0.0005)

    def _peer_left(self, name: str, message: bytes) -> None:
        peer = self._peers.get(name)
        # Only for the incarnation that said it: a restarted peer of the same name may
        # have been admitted before the old one's goodbye was read.
        if peer is not None and _goodbye(peer._metadata) == message:
            log.info("peer %r closed", name)
            self._drop_peer(peer, None, PeerDisconnectedError(f"peer {name!r} closed its engine"))

    @staticmethod
    def _still_moving(agent: Agent, handle: int) -> bool:
        try:
            return agent.check(handle) == PROC
        except AionixlError:
            return False

    @staticmethod
    def _progress_quietly(agent: Agent) -> None:
        with suppress(AionixlError):
            agent.get_notifs()

    @staticmethod
    def _attempt(fn: Any, arg: Any, problems: list[str]) -> None:
        try:
            fn(arg)
        except AionixlError as exc:
            problems.append(str(exc))

    def _check_open(self, *, draining_ok: bool = False) -> None:
        if self._failure is None and (self._state == _OPEN or (draining_ok and self._state == _DRAINING)):
            return
        if self._failure is not None:
            raise EngineClosedError(f"engine {self._name!r} stopped after an internal error") \
                from self._failure
        if self._state == _NEW:
            raise EngineClosedError("engine not started: use 'async with Engine(...)'")
        if self._state == _DRAINING:
            raise EngineClosedError(f"engine {self._name!r} is draining: it takes no new work")
        raise EngineClosedError(f"engine {self._name!r} is closed")

    @contextmanager
    def _operation(self) -> Iterator[None]:
        """Run a waiting call so that closing the engine ends it with EngineClosedError."""
        scope = anyio.CancelScope()
        self._op_scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._op_scopes.discard(scope)
        if scope.cancel_called:
            raise EngineClosedError(f"engine {self._name!r} closed")

    # ---- peers --------------------------------------------------------------------------

    async def connect(self, address: str, timeout: float = 10.0) -> Peer:
        """Handshake with the engine listening at ``address`` and return its :class:`Peer`.

        Idempotent: a live peer at that address is returned as is, and concurrent calls
        for one address share one handshake. Raises ``HandshakeError`` when nobody answers
        within ``timeout`` or the answer is unusable, ``IncompatiblePeerError`` when the
        geometry or compat keys differ.
        """
        self._check_open()
        if not isinstance(address, str) or not address:
            raise ValueError("address must be a zmq endpoint string")
        _check_timeout(timeout, "timeout")
        failed_attempts: list[BaseException] = []
        try:
            with _deadline(timeout):
                while True:
                    peer = self._peers_by_address.get(address)
                    if peer is not None and peer.connected:
                        await anyio.lowlevel.checkpoint()
                        return peer
                    pending = self._connecting.get(address)
                    if pending is None:
                        break
                    with self._operation():
                        await pending.wait()
                    self._check_open()
                    error = self._connect_errors.get(address)
                    if error is not None:
                        if self._config.connect_retries and _retryable(error):
                            continue  # the shared attempt gave up; this caller has time left
                        raise _same_kind(error, f"connecting to {address}: {error}") from error
                done = anyio.Event()
                self._connecting[address] = done
                self._connect_errors.pop(address, None)
                try:
                    return await self._handshake_with_retries(address, failed_attempts)
                except Exception as exc:
                    self._connect_errors[address] = exc
                    raise
                finally:
                    del self._connecting[address]
                    done.set()
        except TimeoutError:
            if failed_attempts:
                last = failed_attempts[-1]
                raise HandshakeError(f"no usable handshake with {address} within {timeout} s after "
                                     f"{len(failed_attempts)} failed attempt(s); last: {last}") from last
            raise HandshakeError(
                f"no handshake answer from {address} within {timeout} s") from None

    async def _handshake_with_retries(self, address: str, failed: list[BaseException]) -> Peer:
        """Up to ``1 + connect_retries`` handshakes, pausing with doubling backoff between.

        The caller's deadline bounds them all. Without retries the one attempt may use the
        whole deadline; with retries an unanswered attempt is abandoned after
        ``connect_attempt_timeout`` so that the next one can go out on a fresh socket (a
        peer that restarted mid-handshake never answers the first).
        """
        retries = self._config.connect_retries
        pause = self._config.connect_backoff
        for attempt in range(retries + 1):
            last = attempt == retries
            self._check_open()  # closed or draining during the last backoff: stop here
            try:
                if last:
                    return await self._handshake(address)
                with anyio.fail_after(self._config.connect_attempt_timeout):
                    return await self._handshake(address)
            except TimeoutError as exc:
                if last:
                    raise
                failed.append(HandshakeError(f"no answer within {self._config.connect_attempt_timeout} s"))
                failed[-1].__cause__ = exc
                self._noisy.log(logging.INFO, "connect-retry", "no handshake answer from %s yet; retrying",
                          address)
            except (_RefusedError, IncompatiblePeerError, ValueError, EngineClosedError):
                raise
            except AionixlError as exc:
                if last:
                    raise
                failed.append(exc)
                self._noisy.log(logging.INFO, "connect-retry", "handshake with %s failed (%s); retrying",
                          address, exc)
            with self._operation():  # closing the engine ends the pause with EngineClosedError
                await anyio.sleep(pause)
            pause = min(pause * 2.0, 1.0)
        raise AssertionError("unreachable")

    async def _handshake(self, address: str) -> Peer:
        agent, ctx = self._agent, self._zctx
        assert agent is not None and ctx is not None
        nonce = proto.new_nonce() if self._secret is not None else b""
        hello = proto.Hello(proto.PROTOCOL_VERSION, self._name, self._own_metadata,
                            [proto.RegionInfo.of(r) for r in self._regions], self._compat,
                            self._compat_hash, nonce, time.time())
        limit = self._config.max_handshake_bytes
        with self._operation():
            sock: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
            try:
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.MAXMSGSIZE, limit)
                try:
                    sock.connect(address)
                except zmq.ZMQError as exc:
                    raise ValueError(f"bad peer address {address!r}: {exc}") from exc
                await _zmq.send_multipart(sock, proto.seal(proto.encode(hello), self._secret))
                frames = await _zmq.recv_multipart(sock)
            finally:
                sock.close(linger=0)
        self._check_open()
        try:
            reply = proto.decode_reply(proto.unseal(frames, self._secret, tag_optional=True), limit)
        except proto.ProtocolError as exc:
            if exc.code == "unauthorized":
                raise _RefusedError(f"{address} answered without this engine's secret"
                                    f"{_unsigned_refusal(frames, limit)}") from exc
            raise _RefusedError(f"unusable handshake reply from {address}: {exc}") from exc
        if isinstance(reply, proto.Reject):
            reason, code = proto.clip(reply.reason), proto.clip(reply.code, 40)
            if reply.code == "incompatible":
                field = None if reply.field is None else proto.clip(reply.field, 100)
                raise IncompatiblePeerError(f"{address} refused us: {reason}", field=field)
            kind = HandshakeError if reply.code in _RETRYABLE_REJECTS else _RefusedError
            raise kind(f"{address} refused the handshake ({code}): {reason}")
        if self._secret is not None and reply.nonce != nonce:
            raise _RefusedError(f"{address} sent a signed reply to another handshake (replayed?)")
        if reply.name == self._name:
            raise _RefusedError(f"{address} is this engine ({self._name!r}) itself")
        try:
            proto.check_compatible(self._regions, self._compat, reply.regions, reply.compat)
            proto.check_hash(self._compat_hash, reply.compat_hash)
        except proto.Incompatible as exc:
            raise IncompatiblePeerError(f"peer {reply.name!r} at {address}: {exc}",
                                        field=exc.field) from None
        try:
            peer = self._admit(reply.name, reply.agent_metadata, reply.regions, address)
        except proto.ProtocolError as exc:
            raise _RefusedError(f"unusable handshake reply from {address}: {exc}") from exc
        try:
            agent.make_connection(peer.name)
        except AionixlError:
            self._drop_peer(peer, None)
            raise
        return peer

    async def connect_vllm(self, address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                           expect_compat_hash: str | None = None, timeout: float = 10.0) -> Peer:
        """Connect to a vLLM NixlConnector prefill worker; see :func:`aionixl.vllm.connect`."""
        from . import vllm

        self._check_open()
        return await vllm.connect(self, address, pp_rank=pp_rank, tp_rank=tp_rank,
                                  expect_compat_hash=expect_compat_hash, timeout=timeout)

    async def _admit_foreign(self, name: str, metadata: bytes, regions: Sequence[proto.RegionInfo],
                             address: str) -> Peer:
        """Admit a peer that is not an aionixl engine (checked by the caller); see aionixl.vllm."""
        self._check_open()
        try:
            peer = self._admit(name, metadata, regions, address)
        except proto.ProtocolError as exc:
            raise HandshakeError(f"unusable peer metadata from {address}: {exc}") from exc
        peer._foreign = True
        assert self._agent is not None
        try:
            self._agent.make_connection(peer.name)
        except AionixlError:
            self._drop_peer(peer, None)
            raise
        await anyio.lowlevel.checkpoint()
        return peer

    def _admit(self, name: str, metadata: bytes, regions: Sequence[proto.RegionInfo],
               address: str | None) -> Peer:
        """Load a peer's metadata (or reuse what is loaded) and prepare its descriptors."""
        agent = self._agent
        assert agent is not None
        existing = self._peers.get(name)
        if existing is not None and existing._metadata == metadata:
            if address is not None and existing.address is None:
                existing.address = address
                self._peers_by_address[address] = existing
            return existing
        # Checked before NIXL sees the metadata: loading another agent's metadata would
        # replace that agent's state under our feet.
        embedded = metadata_agent_name(metadata)
        if embedded != name:
            raise proto.ProtocolError(
                f"the NIXL metadata of {proto.clip(name, 80)!r} is not an agent of that name "
                f"(it names {proto.clip(embedded, 80) if embedded else 'no readable agent'})")
        if existing is not None:  # same name, new incarnation
            self._drop_peer(existing, None,
                            PeerDisconnectedError(f"peer {name!r} restarted; connect() again"))
        agent.add_remote(metadata, name)
        remote = [r.to_region() for r in regions]
        try:
            dlist = agent.prep_dlist(name, block_descriptors(remote), regions[0].mem_type)
        except AionixlError:
            self._attempt(agent.remove_remote, name, [])
            raise
        peer = Peer(self, name, address, remote, dlist, metadata)
        self._peers[name] = peer
        if address is not None:
            self._peers_by_address[address] = peer
        self._wake_drainer()
        return peer

    def _evict(self, peer: Peer, cause: BaseException) -> PeerDisconnectedError:
        """Forget a peer NIXL reported failing; returns the error its callers get."""
        error = PeerDisconnectedError(f"peer {peer.name!r} is unreachable and was evicted: {cause}")
        error.__cause__ = cause
        if peer._connected:
            self._noisy.log(logging.WARNING, "evict", "evicting peer %r: %s", peer.name, cause)
            peer._lost = cause
            self._peers_evicted += 1
            self._drop_peer(peer, None, error)
        return error

    def _drop_peer(self, peer: Peer, problems: list[str] | None,
                   error: AionixlError | None = None) -> None:
        """Fail the peer's transfers, release its descriptors, disconnect in NIXL.

        With ``error`` the peer was lost (not disconnected on purpose): its transfers fail
        with it, and later calls with this Peer raise PeerDisconnectedError.
        """
        peer._connected = False
        if error is not None and peer._lost is None:
            peer._lost = error
        if self._peers.get(peer.name) is peer:
            del self._peers[peer.name]
        if peer.address is not None and self._peers_by_address.get(peer.address) is peer:
            del self._peers_by_address[peer.address]
        agent = self._agent
        if agent is None:
            return
        gone = error or PeerDisconnectedError(f"peer {peer.name!r} was disconnected")
        for handle, rec in list(self._inflight.items()):
            if rec.peer is peer:
                del self._inflight[handle]
                rec.finish(ERR, gone)
                if not agent.release_xfer(handle):
                    self._parked.add(handle)
                    self._poller_wakeup.set()
        sink: list[str] = [] if problems is None else problems
        self._attempt(agent.release_dlist, peer._dlist, sink)
        self._attempt(agent.remove_remote, peer.name, sink)
        if problems is None and sink:
            self._noisy.log(logging.WARNING, "drop", "dropping peer %r: %s", peer.name, "; ".join(sink))

    async def disconnect(self, peer: Peer) -> None:
        """Forget ``peer`` and release its NIXL state.

        Its transfers under way get up to ``close_grace`` to finish; those still running
        then fail with ``PeerDisconnectedError``. (Closing the connection under a UCX-TCP
        transfer that is moving data made the serving process abort inside UCX.)
        """
        self._check_open(draining_ok=True)
        self._own_peer(peer)
        with anyio.move_on_after(self._config.close_grace):
            while peer.connected and any(rec.peer is peer for rec in self._inflight.values()):
                await anyio.sleep(0.001)
        if peer.connected:
            self._drop_peer(peer, None)
        await anyio.lowlevel.checkpoint()

    def _own_peer(self, peer: object) -> Peer:
        if not isinstance(peer, Peer) or peer._engine is not self:
            raise ValueError(f"unknown peer {peer!r}: not a Peer of this engine")
        return peer

    def _live_peer(self, peer: object) -> Peer:
        p = self._own_peer(peer)
        if p._lost is not None:
            raise PeerDisconnectedError(f"peer {p.name!r} was evicted after a failure ({p._lost}); "
                                        "connect() to it again") from p._lost
        if not p.connected:
            raise ValueError(f"unknown peer {p.name!r}: it was disconnected")
        return p

    # ---- the listener -------------------------------------------------------------------

    async def _listener(self, *, task_status: anyio.abc.TaskStatus[str]) -> None:
        assert self._zctx is not None and self._listen is not None
        sock: zmq.Socket[bytes] = self._zctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, self._config.max_handshake_bytes + 4096)
            # A flooding client gets its messages dropped by zmq, not buffered by the 1000.
            sock.setsockopt(zmq.RCVHWM, 16)
            try:
                sock.bind(self._listen)
            except zmq.ZMQError as exc:
                raise ListenError(f"cannot listen on {self._listen!r}: {exc}") from exc
            task_status.started(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            while True:
                frames = await _zmq.recv_multipart(sock)
                reply = self._serve(frames[1:])  # frames[0] is the client's routing id
                if isinstance(reply, proto.Reject):
                    self._handshakes_rejected += 1
                else:
                    self._handshakes_accepted += 1
                if not _zmq.try_send_multipart(sock, [frames[0], *proto.seal(proto.encode(reply),
                                                                              self._secret)]):
                    log.debug("handshake reply dropped: the client is gone or not reading")
                self._wake_drainer()
                await anyio.lowlevel.checkpoint()
        finally:
            sock.close(linger=0)

    def _serve(self, frames: list[bytes]) -> proto.Welcome | proto.Reject:
        """Answer one handshake request. Never raises for bad input: it rejects."""
        version = proto.PROTOCOL_VERSION
        try:
            hello = proto.decode_hello(proto.unseal(frames, self._secret),
                                       self._config.max_handshake_bytes)
            if self._secret is not None:
                self._replay_guard.check(hello, time.time())
            if self._state != _OPEN:
                return proto.Reject(version, "draining", f"engine {self._name!r} takes no new peers")
            if hello.name == self._name:
                return proto.Reject(version, "self", f"{proto.clip(hello.name)!r} is this engine's own name")
            proto.check_compatible(self._regions, self._compat, hello.regions, hello.compat)
            proto.check_hash(self._compat_hash, hello.compat_hash)
            self._admit(hello.name, hello.agent_metadata, hello.regions, None)
        except proto.ProtocolError as exc:
            self._noisy.log(logging.WARNING, "bad-hello", "rejected a handshake: %s", exc)
            return proto.Reject(version, exc.code, str(exc))
        except proto.Incompatible as exc:
            self._noisy.log(logging.WARNING, "incompatible", "rejected an incompatible peer: %s", exc)
            return proto.Reject(version, "incompatible", str(exc), exc.field)
        except Exception as exc:
            self._noisy.log(logging.WARNING, "admit", "handshake failed on our side: %s",
                            proto.clip(repr(exc)))
            return proto.Reject(version, "internal", proto.clip(str(exc)))
        assert self._agent is not None
        return proto.Welcome(version, self._name, self._own_metadata,
                             [proto.RegionInfo.of(r) for r in self._regions], self._compat,
                             self._compat_hash, hello.nonce)

    # ---- transfers ----------------------------------------------------------------------

    async def transfer_blocks(self, peer: Peer, local_blocks: Sequence[int] | IndexArray,
                              remote_blocks: Sequence[int] | IndexArray, op: Op = "read",
                              notify: bytes | None = None,
                              timeout: float | None = None) -> TransferResult:
        """Move blocks between this engine and ``peer``, in every region.

        ``op="read"`` copies the peer's block ``remote_blocks[i]`` into our block
        ``local_blocks[i]``; ``"write"`` copies the other way. Returns once the data is in
        place. ``notify`` is delivered to the peer after the data landed. ``timeout``
        defaults to ``EngineConfig.transfer_timeout``; on expiry, or on cancellation, the
        NIXL transfer is aborted and released.
        """
        if self._state is not _OPEN or self._failure is not None:
            self._check_open()
        if type(peer) is not Peer or peer._engine is not self or not peer._connected:
            self._live_peer(peer)  # raises the right ValueError
        if op != "read" and op != "write":
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        local_idx: Indices | None = None
        remote_idx: Indices | None = None
        nblocks = 1
        if type(local_blocks) is list and type(remote_blocks) is list \
                and len(local_blocks) == 1 == len(remote_blocks):
            # One block each way, the commonest call: indices already validated and built.
            lb, rb = local_blocks[0], remote_blocks[0]
            if type(lb) is int and type(rb) is int:
                local_idx = self._one_block.get(lb)
                remote_idx = peer._one_block.get(rb)
        if local_idx is None or remote_idx is None:
            local_idx = small_indices(local_blocks, self._num_blocks, self._offset_list)
            remote_idx = small_indices(remote_blocks, peer.num_blocks, peer._offset_list)
            if (local_idx is None or remote_idx is None or len(local_blocks) != len(remote_blocks)
                    or has_duplicates(local_blocks if op == "read" else remote_blocks)):  # type: ignore[arg-type]
                nblocks, local_idx, remote_idx = self._checked_indices(peer, local_blocks,
                                                                       remote_blocks, op)
            else:
                nblocks = len(local_blocks)
                if nblocks == 1:
                    _remember(self._one_block, local_blocks[0], local_idx)
                    _remember(peer._one_block, remote_blocks[0], remote_idx)
        message = b"" if notify is None else _user_message(notify, "notify")
        if timeout is not None:
            _check_timeout(timeout, "timeout")
        agent = self._agent
        assert agent is not None and local_idx is not None and remote_idx is not None
        started = time.perf_counter()
        try:
            handle, status = agent.start_xfer(op, self._local_dlist, local_idx, peer._dlist,
                                              remote_idx, message, self._inline_polls)
        except PeerDisconnectedError as exc:
            raise self._evict(peer, exc) from exc
        if status is not DONE or handle != NO_HANDLE:
            limit = self._config.transfer_timeout if timeout is None else timeout
            await self._finish_transfer(peer, handle, status, limit)
            now = self._last_yield = time.perf_counter()
        else:
            # Finished inline, without a trip through the event loop. A caller looping on
            # short transfers must still let other tasks run (and be cancellable): yield
            # once the engine has gone one slice without doing so. The slice adapts: long
            # while yielding finds the loop idle (a lone caller pays little), short once
            # other tasks were waiting (64 busy callers each get a short turn, not 2 ms).
            now = time.perf_counter()
            if now - self._last_yield > self._slice:
                # Shielded: the transfer is done; a cancel must not turn it into a failure
                # (a caller that retried would write, and notify, twice).
                await anyio.lowlevel.cancel_shielded_checkpoint()
                after = time.perf_counter()
                self._slice = _SLICE_SHORT if after - now > _CROWDED else _SLICE_LONG
                now = self._last_yield = after
        return _new_tuple(TransferResult, (nblocks, nblocks * self._bytes_per_block, now - started))

    def _checked_indices(self, peer: Peer, local_blocks: object, remote_blocks: object,
                         op: Op) -> tuple[int, IndexArray, IndexArray]:
        """The thorough path: validate with clear errors, build numpy indices."""
        local_ids = block_ids(local_blocks, self._num_blocks, "local_blocks")
        remote_ids = block_ids(remote_blocks, peer.num_blocks, "remote_blocks")
        if local_ids.size != remote_ids.size:
            raise ValueError(f"local_blocks has {local_ids.size} ids but remote_blocks has "
                             f"{remote_ids.size}")
        if op == "read":
            check_distinct(local_ids, "local_blocks (the destination of a read)")
        else:
            check_distinct(remote_ids, "remote_blocks (the destination of a write)")
        return (int(local_ids.size), descriptor_indices(self._offsets, local_ids),
                descriptor_indices(peer._offsets, remote_ids))

    async def _finish_transfer(self, peer: Peer, handle: int, status: Status, limit: float) -> None:
        """Wait for a posted transfer through the poller; always release its handle."""
        agent = self._agent
        assert agent is not None
        rec: _InFlight | None = None
        try:
            if status == PROC:
                rec = _InFlight(peer)
                self._inflight[handle] = rec
                self._poller_wakeup.set()
                status = await self._wait_transfer(rec, limit)
                if self._wake_trace is not None:
                    self._wake_trace.append(time.perf_counter_ns() - rec.finished_ns)
            if status != DONE:
                raise self._evict(peer, TransferError("NIXL reported the transfer failed (ERR)"))
        finally:
            # Whoever took the record out of _inflight (eviction, close) released the handle,
            # and NIXL may since have given the same value to another transfer: release only
            # what is still ours.
            owned = rec is None or self._inflight.get(handle) is rec
            if rec is not None and owned:
                del self._inflight[handle]
            if owned and not agent.release_xfer(handle):
                self._parked.add(handle)
                self._poller_wakeup.set()

    async def _wait_transfer(self, rec: _InFlight, limit: float) -> Status:
        try:
            with _deadline(limit):
                await rec.event.wait()
        except TimeoutError:
            if rec.status != DONE:
                raise TransferTimeoutError(
                    f"transfer to {rec.peer.name!r} did not finish within {limit} s; "
                    "it was aborted") from None
        if rec.error is not None:
            # A fresh error per caller: several callers may share one failure.
            raise type(rec.error)(str(rec.error)) from rec.error.__cause__
        return rec.status

    async def _poll_transfers(self) -> None:
        agent = self._agent
        assert agent is not None
        while True:
            if not self._inflight and not self._parked:
                self._poller_wakeup = anyio.Event()
                await self._poller_wakeup.wait()
                self._wake_drainer()
                continue
            for handle, rec in list(self._inflight.items()):
                if rec.event.is_set():
                    continue
                try:
                    status = agent.check(handle)
                except PeerDisconnectedError as exc:
                    self._evict(rec.peer, exc)  # fails every transfer to that peer
                    continue
                except TransferError as exc:
                    rec.finish(ERR, exc)  # this transfer failed; the peer may be fine
                    continue
                if status == ERR:
                    self._evict(rec.peer, TransferError("NIXL reported the transfer failed (ERR)"))
                elif status != PROC:
                    rec.finish(status)
            if self._parked:
                self._parked = {h for h in self._parked if not agent.release_xfer(h)}
            await anyio.sleep(0)

    # ---- notifications ------------------------------------------------------------------

    def _wake_drainer(self) -> None:
        self._drainer_wakeup.set()

    async def _drain_notifications(self) -> None:
        """Take notifications from NIXL and hand them out; also keeps NIXL progressing.

        Cadence: every loop turn while transfers are in flight or notifications arrive,
        then backing off (doubling) to ``notification_poll_interval`` while someone waits,
        or to ``idle_poll_interval`` when nobody does; with no peers and no waiters it
        sleeps until woken. Any activity (a transfer, a handshake, a new waiter) resets it.
        """
        agent = self._agent
        assert agent is not None
        mailbox = self._mailbox
        busy_cap = self._config.notification_poll_interval
        idle_cap = self._config.idle_poll_interval
        probe_every = self._config.peer_probe_interval
        next_probe = anyio.current_time() + probe_every
        interval = 0.0
        while True:
            try:
                notifs = agent.get_notifs()
            except AionixlError as exc:
                self._noisy.log(logging.WARNING, "notifs", "reading notifications failed: %s", exc)
                notifs = {}
            delivered = False
            for peer_name, messages in notifs.items():
                for message in messages:
                    if message.startswith(_RESERVED):
                        if message.startswith(_GOODBYE):
                            self._peer_left(peer_name, message)
                        continue
                    mailbox.deliver(Notification(peer_name, message))
                    delivered = True
            if self._peers and anyio.current_time() >= next_probe:
                self._probe_peers()
                next_probe = anyio.current_time() + probe_every
            if delivered or self._inflight:
                interval = 0.0
            elif not self._peers and not mailbox.waiting:
                interval = math.inf  # nobody to hear from: sleep until something happens
            else:
                cap = busy_cap if mailbox.waiting else idle_cap
                interval = min(cap, max(interval * 2.0, 20e-6))
            if interval == 0.0:
                await anyio.sleep(0)
                continue
            wakeup = self._drainer_wakeup = anyio.Event()
            with anyio.move_on_after(interval):
                await wakeup.wait()
            if wakeup.is_set():
                interval = 0.0

    def _probe_peers(self) -> None:
        """Find peers that died while idle: NIXL fails a notification to a peer that is gone."""
        agent = self._agent
        assert agent is not None
        for peer in list(self._peers.values()):
            if peer._foreign:
                continue
            try:
                agent.send_notif(peer.name, _PROBE)
            except PeerDisconnectedError as exc:
                self._evict(peer, exc)
            except AionixlError as exc:
                self._noisy.log(logging.INFO, "probe", "probing peer %r: %s", peer.name, exc)

    async def send_notification(self, peer: Peer, message: bytes) -> None:
        """Send ``message`` to ``peer`` on its own, not tied to a transfer."""
        self._check_open(draining_ok=True)
        p = self._live_peer(peer)
        message = _user_message(message, "message")
        assert self._agent is not None
        try:
            self._agent.send_notif(p.name, message)
        except PeerDisconnectedError as exc:
            raise self._evict(p, exc) from exc
        self._wake_drainer()
        await anyio.lowlevel.checkpoint()

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
        peer_name = peer if peer is None or isinstance(peer, str) else self._own_peer(peer).name
        if timeout is not None:
            _check_timeout(timeout, "timeout")
        kept = self._mailbox.take(message, peer_name)
        if kept is not None:
            return kept
        waiter = self._mailbox.add_waiter(message, peer_name)
        self._wake_drainer()
        try:
            with self._operation():
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


_ONE_BLOCK_CACHE = 4096
#: Builds a TransferResult without NamedTuple.__new__'s argument handling (half its cost).
_new_tuple = tuple.__new__


def _remember(cache: dict[int, list[int]], block: int, indices: list[int]) -> None:
    """Keep a validated block's descriptor indices for the one-block fast path (bounded)."""
    if len(cache) >= _ONE_BLOCK_CACHE:
        cache.clear()
    cache[block] = indices


def _user_message(value: object, what: str) -> bytes:
    """A caller's notification as bytes; the engine's own reserved prefix is refused."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what} must be bytes")
    message = bytes(value)
    if message.startswith(_RESERVED):
        raise ValueError(f"{what}: messages starting with b'\\x00aionixl-' are reserved for the engine")
    return message


def _retryable(error: BaseException) -> bool:
    return isinstance(error, HandshakeError) and not isinstance(error, (_RefusedError,
                                                                         IncompatiblePeerError))


def _unsigned_refusal(frames: list[bytes], limit: int) -> str:
    """What an unauthenticated refusal says, for the error message only (never trusted)."""
    try:
        reply = proto.decode_reply(frames[0], limit)
    except proto.ProtocolError:
        return ""
    if isinstance(reply, proto.Reject):
        return f"; it says: {proto.clip(reply.code, 40)}: {proto.clip(reply.reason)}"
    return ""


def _single_leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _same_kind(error: BaseException, message: str) -> Exception:
    """A fresh error of the same public kind, for callers that shared a failed handshake."""
    if isinstance(error, IncompatiblePeerError):
        return IncompatiblePeerError(message, field=error.field)
    if isinstance(error, ValueError):
        return ValueError(message)
    if isinstance(error, EngineClosedError):
        return EngineClosedError(message)
    return HandshakeError(message)


def _deadline(seconds: float) -> ContextManager[anyio.CancelScope]:
    """``fail_after`` for a validated positive limit, where ``math.inf`` means none."""
    return anyio.fail_after(seconds if math.isfinite(seconds) else None)


def _check_timeout(value: object, what: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) \
            or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")


__all__ = ["Engine", "Peer", "TransferResult"]
