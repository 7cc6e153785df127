"""Shared state: the in-flight table, the poller task that drives it, wait and release.

Every posted NIXL request that did not finish inline has a record here, whoever posted it
(a lone caller, a merged request, a push the engine serves, a fence). The poller task
checks every record once per loop turn and finishes each one NIXL reports ended. Whoever
takes a record out of the table releases its handle, exactly once; a handle NIXL will not
release yet is parked and retried by the poller. Close releases the rest
(:meth:`InFlightTable.close`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import suppress

import anyio

from ._agent import DONE, ERR, PROC, Agent, Status
from ._checks import deadline
from ._errors import AionixlError, PeerDisconnectedError, TransferError, TransferTimeoutError
from ._lifecycle import LocalSide
from ._parking import LoopTools, NativeEvent
from ._peer import Peer

#: Evicts a peer NIXL reported failing; returns the error its callers get.
Evict = Callable[[Peer, BaseException], PeerDisconnectedError]


def failed_in_nixl() -> TransferError:
    """A fresh error for a request whose state NIXL reported as ERR."""
    return TransferError("NIXL reported the transfer failed (ERR)")


def progress_quietly(agent: Agent) -> None:
    """One NIXL progress call whose errors (peers already gone) do not matter here."""
    with suppress(AionixlError):
        agent.get_notifs()


class InFlight:
    """A posted NIXL request and whoever waits for it.

    ``event`` is the engine loop's own event class (asyncio's or trio's: cheaper than
    anyio's portable wrapper; waiting on it is an ordinary cancellable checkpoint).
    """

    __slots__ = ("peer", "event", "status", "error", "finished_ns", "deadline")

    def __init__(self, peer: Peer, new_event: Callable[[], NativeEvent]) -> None:
        self.peer = peer
        self.event = new_event()
        self.status: Status = PROC
        self.error: AionixlError | None = None
        self.finished_ns = 0
        #: perf_counter() time at which the poller wakes the waiters to check their
        #: deadlines (merged requests; a lone transfer's caller keeps its own timer).
        self.deadline = math.inf

    @property
    def callers(self) -> int:
        """Callers waiting on it (a merged request counts its members)."""
        return 1

    def expire(self, now: float) -> None:
        """The poller found ``deadline`` passed (see ``_coalesce.Batch``)."""
        self.deadline = math.inf

    def finish(self, status: Status, error: AionixlError | None = None) -> None:
        self.status = status
        self.error = error
        self.finished_ns = time.perf_counter_ns()
        self.event.set()

    def fail(self, error: AionixlError) -> None:
        """Fail it (its peer went, the engine closed), unless it ended already: its waiters,
        woken but not yet run, keep that end."""
        if self.status == PROC:
            self.finish(ERR, error)


class InFlightTable:
    """The records of one engine's posted requests, by NIXL handle, and their poller."""

    def __init__(self, local: LocalSide, evict: Evict, wake_drainer: Callable[[], None]) -> None:
        self._local = local
        self._evict = evict
        self._wake_drainer = wake_drainer
        self.records: dict[int, InFlight] = {}
        self.parked: set[int] = set()  # handles NIXL would not release yet
        #: Closing: the records :meth:`close` took out, until :meth:`fail_all`.
        self._closing: dict[int, InFlight] = {}
        #: Calls the poller makes on its next turn (``defer``), while it runs (``polling``).
        self.deferred: list[Callable[[], None]] = []
        self.polling = False
        self.new_event: Callable[[], NativeEvent] = anyio.Event
        self._wakeup = anyio.Event()
        #: Benchmarks set a list here to collect, per transfer finished by the poller, the
        #: nanoseconds from the poller seeing its final state to the caller running again.
        self.wake_trace: list[int] | None = None

    def bind_loop(self, tools: LoopTools) -> None:
        """Called in the engine's event loop: records wait on its own event class."""
        self.new_event = tools.event

    # ---- adding and waiting -------------------------------------------------------------

    def add(self, handle: int, rec: InFlight, running: bool) -> None:
        """Track a posted request; the poller checks it from its next turn on (woken for it
        when it is ``running``: one that ended in its post is only released later)."""
        self.records[handle] = rec
        if running:
            self._wakeup.set()

    def defer(self, call: Callable[[], None]) -> None:
        """Have the poller make ``call`` on its next turn."""
        self.deferred.append(call)
        self._wakeup.set()

    async def finish(self, peer: Peer, handle: int, status: Status, limit: float,
                     ended: list[Status] | None = None) -> None:
        """Wait for a posted transfer through the poller; always release its handle.
        ``ended`` gets the state the poller last saw, however the wait ended (a wait cut
        short by a cancellation may have seen the transfer finish)."""
        agent = self._local.agent
        assert agent is not None
        rec: InFlight | None = None
        try:
            if status == PROC:
                rec = InFlight(peer, self.new_event)
                self.records[handle] = rec
                self._wakeup.set()
                status = await _wait(rec, limit)
                if self.records.get(handle) is rec:
                    agent.completed(handle, status)
                else:  # an eviction or close released it after it ended: NIXL's record is gone
                    agent.telemetry = None
                if self.wake_trace is not None:
                    self.wake_trace.append(time.perf_counter_ns() - rec.finished_ns)
            if status != DONE:
                raise self._evict(peer, failed_in_nixl())
        finally:
            # Whoever took the record out of the table (eviction, close) released the handle,
            # and NIXL may since have given the same value to another transfer: release only
            # what is still ours.
            owned = rec is None or self.records.get(handle) is rec
            if ended is not None:
                ended.append(status if rec is None else rec.status)
            if rec is not None and owned:
                del self.records[handle]
            if owned:
                self.release(agent, handle)

    def release(self, agent: Agent, handle: int) -> None:
        if not agent.release_xfer(handle):
            self.parked.add(handle)
            self._wakeup.set()

    def take(self, handle: int, rec: InFlight) -> bool:
        """Take ``rec`` out of the table and release its handle, if the table still says it
        is ours (an eviction or close may have done so already); whether it did."""
        if self.records.get(handle) is not rec:
            return False
        del self.records[handle]
        agent = self._local.agent
        assert agent is not None
        self.release(agent, handle)
        return True

    # ---- who is busy --------------------------------------------------------------------

    def busy_with(self, peer: Peer) -> bool:
        return any(rec.peer is peer for rec in self.records.values())

    @property
    def held(self) -> int:
        """Posted requests not yet ended for their callers: the table's, and during a close
        those the close took over."""
        return len(self.records) + len(self._closing)

    def callers(self) -> int:
        """Callers waiting on posted requests (a merged request counts its members), those
        a close took over included.

        Safe from any thread (``Engine.metrics``): it counts over copies of the tables,
        each taken in one step, never over a dict the event loop changes."""
        records = [*self.records.values(), *self._closing.values()]
        return sum(rec.callers for rec in records if rec.status == PROC)

    def fail_peer(self, peer: Peer, error: AionixlError) -> None:
        """The peer is gone: its transfers fail with ``error``, their handles released."""
        agent = self._local.agent
        assert agent is not None
        for handle, rec in list(self.records.items()):
            if rec.peer is peer:
                del self.records[handle]
                rec.fail(error)
                self.release(agent, handle)

    # ---- the poller task ----------------------------------------------------------------

    async def run(self) -> None:
        """Check every transfer in flight once per loop turn; sleep while there are none."""
        agent = self._local.agent
        assert agent is not None
        self.polling = True
        try:
            await self._poll(agent)
        finally:
            # No one will make the deferred calls a turn at a time: make them now.
            self.polling = False
            self._run_deferred()

    def _run_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for call in deferred:
            call()

    async def _poll(self, agent: Agent) -> None:
        while True:
            if self.deferred:
                self._run_deferred()
            if not self.records and not self.parked and not self.deferred:
                self._wakeup = anyio.Event()
                await self._wakeup.wait()
                if self.records or self.parked:
                    # The drainer polls every turn while requests are in flight: end its
                    # back-off. Not when woken only for deferred calls: at 1024 in flight a
                    # merged request often finishes inside its post, and each such wake
                    # restarted its back-off from 20 us (5% of a read, A/B).
                    self._wake_drainer()
                continue
            now = time.perf_counter()
            for handle, rec in list(self.records.items()):
                if rec.status != PROC:
                    continue
                if now >= rec.deadline:
                    rec.expire(now)
                try:
                    status = agent.check(handle)
                except PeerDisconnectedError as exc:
                    self._evict(rec.peer, exc)  # fails every transfer to that peer
                    continue
                except TransferError as exc:
                    rec.finish(ERR, exc)  # this transfer failed; the peer may be fine
                    continue
                if status == ERR:
                    self._evict(rec.peer, failed_in_nixl())
                elif status != PROC:
                    rec.finish(status)
            if self.parked:
                self.parked = {h for h in self.parked if not agent.release_xfer(h)}
            await anyio.sleep(0)

    # ---- close --------------------------------------------------------------------------

    def fail_all(self, error: AionixlError) -> None:
        """Closing, once :meth:`close` released the handles: every caller still waiting
        gets ``error``."""
        records, self.records = {**self._closing, **self.records}, {}
        self._closing = {}
        for rec in records.values():
            rec.fail(error)

    async def close(self, deadline_at: float, grace: float) -> list[str]:
        """Release every transfer handle the agent still holds; returns what could not be.

        The records leave the table first (the poller is stopped), so that only this
        releases their handles; those that finish within ``close_grace`` end DONE, and
        :meth:`fail_all` tells the callers of the rest once the peers are dropped."""
        agent = self._local.agent
        assert agent is not None
        records, self.records = self.records, {}
        self._closing = records
        pending = set(records) | self.parked | set(agent.xfers)
        self.parked = set()
        # Let transfers under way finish first (bounded by close_grace): cancelling a UCX
        # transfer that is moving data leaves requests UCX complains about at teardown.
        grace_end = min(deadline_at, anyio.current_time() + grace)
        moving = set(pending)
        while moving and anyio.current_time() < grace_end:
            still: set[int] = set()
            for handle in moving:
                state = _state_at_close(agent, handle)
                if state == PROC:
                    still.add(handle)
                elif state == DONE and (rec := records.get(handle)) is not None:
                    rec.finish(DONE)  # its callers get their result
            moving = still
            if moving:
                await anyio.sleep(0.001)
        cancelled_any = bool(moving)
        while True:
            pending = {h for h in pending if not agent.release_xfer(h)}
            if not pending or anyio.current_time() >= deadline_at:
                break
            progress_quietly(agent)
            await anyio.sleep(0.001)
        if cancelled_any:
            # Let UCX retire the cancelled operations before the worker goes away.
            for _ in range(20):
                progress_quietly(agent)
                await anyio.sleep(0)
        if pending:
            return [f"{len(pending)} transfer handle(s) NIXL would not release"]
        return []


async def _wait(rec: InFlight, limit: float) -> Status:
    try:
        with deadline(limit):
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


def _state_at_close(agent: Agent, handle: int) -> Status:
    """A handle's state, ERR for one that failed or that the agent no longer holds (its
    owner released it: NIXL must not be asked about it again)."""
    if handle not in agent.xfers:
        return ERR
    try:
        return agent.check(handle)
    except AionixlError:
        return ERR
