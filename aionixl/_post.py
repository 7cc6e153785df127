"""The direct path: one caller's NIXL request, posted and awaited, and the GET fence.

A lone ``transfer_blocks`` call posts its request and polls it a few times inline (most
short transfers finish there); one still in flight goes to the in-flight table and the
caller sleeps until the poller sees it end. A read that ends early (timeout, cancel,
failure) while its peer stays connected is fenced: over UCX an aborted GET may still be
writing, so one more small READ from the same peer follows it. NIXL ends every transfer
with a flush of the UCX endpoint, which completes only after every earlier operation on
that endpoint did, so once the fence is DONE the aborted GET can no longer write; a fence
that does not finish within ``push_cancel_timeout`` evicts the peer instead (it can
reconnect: ``Peer._revive``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

import anyio
import anyio.lowlevel

from ._agent import DONE, NO_HANDLE, Indices, Status
from ._config import EngineConfig, Tuning
from ._errors import AionixlError, PeerDisconnectedError, TransferTimeoutError
from ._inflight import InFlightTable
from ._lifecycle import CLOSED, CLOSING, Lifecycle, LocalSide
from ._metrics import TransferMetrics
from ._parking import LoopTools, no_task
from ._parts import PartLists
from ._peer import Peer
from ._peers import PeerTable
from ._results import Op, TransferResult

#: A posted request: its handle, its state, when the post returned, NIXL's telemetry.
Posted = tuple[int, Status, float, "tuple[float, float, int] | None"]

#: How long transfer_blocks may finish transfers inline before it yields to the loop: long
#: while the loop has nothing else to run, short once a yield shows others were waiting
#: (a yield that takes longer than _CROWDED).
_SLICE_LONG = 0.002
_SLICE_SHORT = 0.0001
_CROWDED = 0.0002


class LoopTurns:
    """When the transfer path last went through the event loop, and how long it may go
    without (the slice adapts: long while yielding finds the loop idle, so a lone caller
    pays little; short once other tasks were waiting, so 64 busy callers each get a short
    turn, not 2 ms).

    A call whose transfer finishes inside its post with the slice used up returns at once
    (its caller sees it done without waiting for other tasks) and names its task
    ``holder``. The next call goes through the loop as it starts, a plain checkpoint: a
    loop of such calls lets other tasks run, and a cancellation reaches it there, before
    anything is posted. Unless it comes from another task after the loop has made a pass
    since: then it starts a fresh slice without a yield, so callers queued behind a long
    post keep their order. (A task switch alone does not prove a pass: asyncio's eager
    tasks run their first step inside ``create_task``; a callback scheduled when the slice
    ran out does.) Yielding after the transfer instead delayed its caller by whatever ran
    meanwhile, and had to be shielded, as the data had moved: a loop of such calls could
    not be cancelled.
    """

    __slots__ = ("last_yield", "slice", "holder", "cancel_point", "_passed", "_marking",
                 "_current_task", "_checkpoint", "_call_soon")

    def __init__(self) -> None:
        self.last_yield = 0.0  # perf_counter()
        self.slice = _SLICE_LONG
        #: The task whose call used up the slice, or None.
        self.holder: object = None
        #: What a call that needs no turn awaits as it starts (``LoopTools.cancel_point``):
        #: on trio every call is then a cancellation point; None on asyncio.
        self.cancel_point: Callable[[], Awaitable[None]] | None = None
        #: Whether the loop has made a pass since the slice ran out (always, where every
        #: task switch is one); whether a callback that says so is scheduled.
        self._passed = True
        self._marking = False
        self._current_task: Callable[[], object] = no_task
        self._checkpoint: Callable[[], Awaitable[None]] = anyio.lowlevel.checkpoint
        self._call_soon: Callable[[Callable[[], None]], object] | None = None

    def bind_loop(self, tools: LoopTools) -> None:
        """Called in the engine's event loop: its task lookup, cheapest checkpoint and,
        where tasks can run without a pass of the loop, its call_soon."""
        self._current_task = tools.current_task
        self._checkpoint = tools.yield_now
        self._call_soon = tools.call_soon
        self.cancel_point = tools.cancel_point

    def finished_inline(self, now: float) -> None:
        """A transfer finished inside its post at ``now``: note the caller if the slice is
        used up."""
        if now - self.last_yield > self.slice:
            self.holder = self._current_task()
            if self._call_soon is not None:
                self._passed = False
                if not self._marking:  # one already scheduled runs after now all the same
                    self._marking = True
                    self._call_soon(self._loop_passed)

    def _loop_passed(self) -> None:
        self._passed = True
        self._marking = False

    async def take_turn(self) -> None:
        """A call starts while ``holder`` is set: it goes through the loop first
        (cancellable), unless another task calls after a pass of the loop."""
        holder, self.holder = self.holder, None
        before = time.perf_counter()
        if self._passed and self._current_task() is not holder:
            self.last_yield = before  # the loop has passed since the slice ran out
            return
        await self._checkpoint()
        after = self.last_yield = time.perf_counter()
        self.slice = _SLICE_SHORT if after - before > _CROWDED else _SLICE_LONG


class DirectPath:
    """Posts one caller's request and waits for it; fences aborted reads."""

    def __init__(self, local: LocalSide, life: Lifecycle, config: EngineConfig, tuning: Tuning,
                 peers: PeerTable,
                 table: InFlightTable, metrics: TransferMetrics[TransferResult], turns: LoopTurns) -> None:
        self._local = local
        self._life = life
        self._config = config
        self._tuning = tuning
        self._peers = peers
        self._table = table
        self._metrics = metrics
        self._turns = turns
        self._inline_polls = tuning.inline_polls

    def post(self, peer: Peer, op: Op, local_idx: Indices, remote_idx: Indices, nblocks: int,
             message: bytes, started: float, parts: PartLists | None = None) -> Posted:
        """Post one request for one caller, polled a few times inline. A request that
        finished inside the post comes back DONE with ``NO_HANDLE``; any other is
        ``wait``-ed for. A failed post is counted, and its peer evicted if it is gone.
        The indices are into the whole-block lists, or into ``parts``' lists."""
        agent = self._local.agent
        assert agent is not None
        try:
            handle, status = agent.start_xfer(
                op, self._local.dlist if parts is None else parts.local, local_idx,
                peer.link.dlist if parts is None else parts.remote, remote_idx, message,
                self._inline_polls)
        except AionixlError as exc:
            self.post_failed(exc, peer, op, nblocks, started)
        return handle, status, agent.posted, agent.telemetry

    def post_failed(self, exc: AionixlError, peer: Peer, op: Op, nblocks: int,
                    started: float) -> NoReturn:
        """A post raised ``exc``: count it, evict its peer if it is gone, and raise."""
        if isinstance(exc, PeerDisconnectedError):
            raise self._metrics.failed(self._peers.evict(peer, exc), peer, op, nblocks, started) from exc
        raise self._metrics.failed(exc, peer, op, nblocks, started)

    async def wait(self, peer: Peer, op: Op, posted: Posted, local_idx: Indices, remote_idx: Indices,
                   nblocks: int, timeout: float | None, started: float,
                   parts: PartLists | None = None) -> TransferResult:
        """Wait for a posted request through the poller; a read that ends early is fenced."""
        handle, status, posted_at, _ = posted
        limit = self._config.transfer_timeout if timeout is None else timeout
        try:
            await self._table.finish(peer, handle, status, limit)
        except BaseException as exc:
            self._metrics.failed(exc, peer, op, nblocks, started)
            if op == "read" and peer.link.connected:
                await self.fence(peer, local_idx, remote_idx, parts)  # no late bytes
            raise
        agent = self._local.agent
        telemetry = None if agent is None else agent.telemetry
        seen = self._turns.last_yield = time.perf_counter()
        if parts is None:
            return self._metrics.done(op, nblocks, started, posted_at, seen, seen, telemetry)
        return self._metrics.done_part(op, nblocks, nblocks * parts.nbytes, nblocks * parts.per_block,
                                       started, posted_at, seen, seen, telemetry)

    async def fence(self, peer: Peer, local_idx: Indices, remote_idx: Indices,
                    parts: PartLists | None = None) -> None:
        """After an aborted GET: one more small READ from the same peer, or evict it.

        It reads the first descriptor of the aborted read again (bytes that read was
        allowed to write; from ``parts``' lists for a read of block parts). Skipped for a
        lost peer; for a closing engine, it waits until the close dropped the peers.
        """
        if self._life.state in (CLOSING, CLOSED):
            await self._life.until_closed(self._config.close_timeout)
            return
        agent = self._local.agent
        if agent is None or not peer.connected:
            return
        limit = self._tuning.push_cancel_timeout
        ended: list[Status] = []
        with anyio.CancelScope(shield=True):
            try:
                handle, status = agent.start_xfer(
                    "read", self._local.dlist if parts is None else parts.local, [int(local_idx[0])],
                    peer.link.dlist if parts is None else parts.remote, [int(remote_idx[0])], b"", 1)
                if status is not DONE or handle != NO_HANDLE:
                    await self._table.finish(peer, handle, status, limit, ended)
            except TransferTimeoutError:
                self._peers.evict_unfenced(peer, f"an aborted read was not fenced within {limit} s")
            except AionixlError:
                # The fence failed. Mostly its peer was evicted with it (its connection is
                # closed); where not (NIXL failed this one transfer), nothing confirmed the
                # aborted read: evict, as for a fence that timed out.
                self._peers.evict_unfenced(peer, "an aborted read's fence failed")
            except BaseException:
                # A cancellation the shield does not hold back (asyncio's own Task.cancel(),
                # which asyncio.timeout and TaskGroup use) cut the fence short: unconfirmed,
                # like one that timed out. Unless the poller had seen the fence finish (the
                # cancel landed between that and the task running again): then it confirmed.
                if ended != [DONE]:
                    self._peers.evict_unfenced(peer, "an aborted read's fence was cancelled")
                raise
