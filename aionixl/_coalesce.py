"""Coalescing: concurrent callers to one peer ride in one NIXL request.

When a call finds the engine busy with other callers (another task called just before it,
or a merged request to that peer is still being gathered), it gathers: it yields once,
and the calls to the same peer with the same op that arrive meanwhile join it. Then one
NIXL request carries all their blocks, and all their notifications (packed into one
reserved notification the peer unpacks: it arrives after the data, like any NIXL
notification). Each caller keeps its own ids (validated before it joins), deadline,
result and error. A lone caller never gathers (``EngineConfig.coalesce``).
"""

from __future__ import annotations

import itertools
import math
import operator
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio
import numpy as np

from ._agent import DONE, ERR, NO_HANDLE, PROC, Indices, Status
from ._config import EngineConfig, Tuning
from ._errors import (
    AionixlError,
    EngineClosedError,
    PeerDisconnectedError,
    TransferError,
    TransferTimeoutError,
)
from ._inflight import InFlight, InFlightTable, failed_in_nixl
from ._lifecycle import CLOSED, CLOSING, Lifecycle, LocalSide
from ._metrics import TransferMetrics
from ._parking import ALL, LoopTools, Unpark, no_recancel, no_task
from ._peer import Peer
from ._peers import PeerTable
from ._post import DirectPath, LoopTurns
from ._regions import IndexArray, descriptor_indices
from ._results import Op, TransferResult
from ._wire import RESERVED, TAGGED_NOTIFY, pack_tagged

#: (local indices, remote indices, blocks, notification, deadline)
_Entry = tuple[Indices, Indices, int, bytes, float]


class Batch(InFlight):
    """One NIXL request carrying the blocks of several callers (its members).

    Members sleep on ``waiters`` (the loop's cheapest parking, :class:`LoopTools`); each
    keeps its own entry (indices, destination blocks, notification) so that one that
    leaves before the post takes its blocks along.
    """

    __slots__ = ("op", "entries", "blocks", "dests", "dups", "live", "handle", "posted",
                 "posted_at", "finished_at", "waiters", "tag", "_wake", "_unpark_all")

    def __init__(self, peer: Peer, op: Op, wake: Callable[[list[object]], None],
                 unpark_all: Unpark) -> None:
        self.peer = peer
        self.status = PROC
        self.error = None
        self.finished_ns = 0
        self.deadline = math.inf
        self.op = op
        self.entries: list[_Entry] = []
        self.blocks = 0
        #: Destination block -> its source block (-1: not one block's, never the same pair).
        self.dests: dict[int, int] = {}
        #: Members that joined with the very block pair of another (both reads of remote
        #: block r into local block b, say): the pair is posted once (``_merged_indices``).
        self.dups = 0
        self.live = 0  # members still waiting for it
        self.handle = NO_HANDLE
        self.posted = False
        self.posted_at = self.finished_at = 0.0  # perf_counter(): post returned, end seen
        self.waiters: list[object] = []
        #: Its notifications' tag (``pack_tagged``), given at the first post that packs them
        #: and kept by every later one; 0 until then.
        self.tag = 0
        self._wake = wake  # wakes the members at the end (Coalescer._wake_members)
        self._unpark_all = unpark_all

    def finish(self, status: Status, error: AionixlError | None = None) -> None:
        self.status = status
        self.error = error
        self.finished_at = time.perf_counter()
        self._wake(self.waiters)

    def add(self, entry: _Entry, dests: Sequence[int], source: int = -1) -> None:
        """Add a member; ``source`` is its one source block, where it moves one."""
        self.entries.append(entry)
        self.blocks += entry[2]
        if len(dests) == 1:
            if dests[0] in self.dests:
                self.dups += 1  # the same pair as another member's (callers check)
            else:
                self.dests[dests[0]] = source
        else:
            self.dests.update(dict.fromkeys(dests, -1))
        self.live += 1
        if entry[4] < self.deadline:
            self.deadline = entry[4]

    def remove(self, entry: _Entry) -> None:
        """Take a member's blocks out (it left; ``dests`` keeps its blocks, which only
        turns away a joiner that could have come in). Found by identity: ``list.remove``
        compares entries with ``==``, which numpy index arrays refuse (ValueError)."""
        for i, member in enumerate(self.entries):
            if member is entry:
                del self.entries[i]
                self.blocks -= entry[2]
                return

    def expire(self, now: float) -> None:
        """Some member's deadline passed: wake everyone to look (the rest wait again)."""
        self.deadline = min((e[4] for e in self.entries if e[4] > now), default=math.inf)
        self._unpark_all(self.waiters)

    @property
    def callers(self) -> int:
        return self.live


#: ``_last_caller`` after a call joined a merged request: any task calling next is another.
_JOINED = object()

#: A caller tries at most this many of the newest merged requests gathering before it opens
#: one more (callers that all write one block would otherwise each try every one).
_GATHERING_TRIED = 16
_perf = time.perf_counter

#: How long after a merged request ended its members still count as arriving together
#: (a bound, in case one of them never runs again).
_RETURNING = 0.05
#: At most this many more trips through the loop while gathering for returning members.
_GATHER_MORE = 2
#: Bytes from which a merged request gets a loop turn of its own before it is posted
#: (NIXL copies the data inside the post on this path: ~0.1 ms per MiB).
_LONG_POST = 1 << 20
#: Members woken at once when a merged request ends; the poller wakes the rest, this many
#: per loop turn. Waking a task allocates an object that lives until the task runs, so
#: waking 1024 at once sets off a young-generation collection (threshold 700) while every
#: parked caller's objects are young: they all get traversed and promoted, and gen-2
#: collections (the whole heap, torch's included) follow. In chunks, each woken member
#: frees about what the next call allocates, and the collections all but stop. A member
#: still waiting for its wake can be cancelled after its blocks landed: it keeps its result
#: and meets the cancellation at its next checkpoint (``_keep_result``). Where a loop could
#: not raise it again (``LoopTools.redelivers_cancel`` false) everyone is woken at once.
_WAKE_CHUNK = 128



class Coalescer:
    """The merged requests of one engine: gathering, posting, members waiting and leaving."""

    def __init__(self, local: LocalSide, life: Lifecycle, config: EngineConfig, tuning: Tuning,
                 peers: PeerTable,
                 table: InFlightTable, direct: DirectPath, metrics: TransferMetrics[TransferResult],
                 turns: LoopTurns) -> None:
        self._local = local
        self._life = life
        self._peers = peers
        self._table = table
        self._direct = direct
        self._turns = turns
        self.metrics = metrics
        self._config = config
        self._tuning = tuning
        self._inline_polls = tuning.inline_polls
        self._bytes_per_block = local.bytes_per_block
        self._offsets = local.offsets
        self.max_blocks = tuning.coalesce_max_blocks
        self._window = tuning.coalesce_window
        #: Merged requests still gathering members, by (peer, op), oldest first. A caller
        #: whose destination block one of them already writes opens another (never the
        #: same block twice in one request), and the callers after it join whichever has
        #: room (``with_room``): callers that share blocks still fill few requests.
        self.gathering: dict[tuple[Peer, Op], list[Batch]] = {}
        #: Who called last, and when: a call from another task right after it means
        #: callers are arriving together, and this one gathers.
        self._current_task: Callable[[], object] = no_task
        #: ``await park(batch.waiters)``: a member sleeps until its request ends (or a
        #: deadline among its members passes); the loop's cheapest parking, no frame.
        self.park: Callable[[list[object]], Awaitable[None]] = _unbound_park
        self._unpark_all: Unpark = _unbound_unpark_all
        self._yield_now: Callable[[], Awaitable[None]] = anyio.lowlevel.checkpoint
        self._wake_chunk = ALL  # until bind_loop: chunks only where cancels are redelivered
        self._redelivers_cancel = False
        self._recancel: Callable[[BaseException], None] = no_recancel
        #: Tasks that kept a result after a cancellation (``_keep_result``) and still owe it:
        #: their next call takes a checkpoint first. Without it a member cancelled while its
        #: request gathered, which ran again only after the request finished, could keep one
        #: result after another and never see its cancellation. ``owing``: any listed.
        self._owed: weakref.WeakSet[Any] = weakref.WeakSet()
        self.owing = False
        self._last_caller: object = None
        self._last_call = 0.0
        #: Members woken by the end of their merged request that have not run again yet
        #: (about: a cancelled one may be counted), and when the last were woken. While
        #: there are any, a call comes "together" with theirs.
        self._returning = 0
        self._woke_at = -math.inf
        self.merged_requests = 0  # NIXL requests that carried more than one caller
        self.merged_calls = 0  # calls that rode in one of them
        self.reposts = 0  # merged requests posted again after a member left
        #: Tags of merged requests' notifications: unique per engine, and (random start, from
        #: the OS: an application's random.seed() must not repeat it) unlike those of an
        #: engine of the same name before it, whose tags its peers may still remember.
        self._tags = itertools.count(secrets.randbits(62) + 1)

    def bind_loop(self, tools: LoopTools) -> None:
        """Called in the engine's event loop: learn its cheap task and parking tools."""
        self._current_task = tools.current_task
        self.park = tools.park
        self._unpark_all = tools.unpark_all
        self._yield_now = tools.yield_now
        self._redelivers_cancel = tools.redelivers_cancel
        self._recancel = tools.recancel
        self._wake_chunk = _WAKE_CHUNK if tools.redelivers_cancel else ALL

    # ---- who rides together -------------------------------------------------------------

    def together(self, peer: Peer, op: Op, started: float, message: bytes) -> bool:
        """Whether a call at ``started`` arrives together with others (then it rides in a
        merged request); notifications ride only to peers that drop a repeated tag (a
        re-post, ``_leave``, must not notify anyone twice)."""
        if not self.gathering or (peer, op) not in self.gathering:
            caller = self._current_task()
            together = (caller is not self._last_caller and started - self._last_call < self._window) \
                or (self._returning > 0 and started - self._woke_at < _RETURNING)
            self._last_caller = caller
        else:
            # Joining needs no task lookup; whoever calls next is "another task".
            together = True
            self._last_caller = _JOINED
        self._last_call = started
        return together and (not message or TAGGED_NOTIFY in peer.features)

    def may_notify(self, peer: Peer, notify: object) -> bool:
        """Whether a joining caller's ``notify`` may ride in a merged request as it is: bytes
        outside the reserved prefix, to a peer that drops repeated tags (the general path
        checks anything else)."""
        return type(notify) is bytes and not notify.startswith(RESERVED) and TAGGED_NOTIFY in peer.features

    def arrived(self) -> float:
        """A call joins a merged request now: whoever calls next is "another task"."""
        self._last_caller = _JOINED
        started = self._last_call = _perf()
        return started

    async def ride(self, peer: Peer, op: Op, local_idx: Indices, remote_idx: Indices, nblocks: int,
                   message: bytes, dest: object, src: object, started: float,
                   timeout: float | None) -> TransferResult:
        """Ride in a merged request: join one gathering with room, or open one."""
        limit = self._config.transfer_timeout if timeout is None else timeout
        entry: _Entry = (local_idx, remote_idx, nblocks, message, started + limit)
        source = -1
        dests: Sequence[int]
        if nblocks == 1 and type(dest) is list and type(dest[0]) is int:
            dests = dest  # a one-block list is read at once, never kept
            if type(src) is list and type(src[0]) is int:
                source = src[0]
        else:
            dests = _destinations(dest)  # type: ignore[arg-type]
        batches = self.gathering.get((peer, op))
        if batches is not None:
            batch = with_room(batches, dests, source, nblocks, self.max_blocks)
            if batch is not None:
                batch.add(entry, dests, source)
                return await self.member(batch, entry, started, limit)
        return await self._gather(peer, op, entry, dests, source, started, limit)

    async def _gather(self, peer: Peer, op: Op, entry: _Entry, dests: Sequence[int], source: int,
                      started: float, limit: float) -> TransferResult:
        """Open a merged request, let the callers arriving with us join, post it."""
        batch = Batch(peer, op, self._wake_members, self._unpark_all)
        batch.add(entry, dests, source)
        key = (peer, op)
        batches = self.gathering.get(key)
        if batches is None:
            self.gathering[key] = [batch]
        else:
            batches.append(batch)
        try:
            # One trip through the loop: the callers already scheduled run now and join.
            await self._yield_now()
            # Members of a merged request that just ended may still be due to run (trio
            # runs a turn's tasks in either order): let them call and join too.
            for _ in range(_GATHER_MORE):
                if self._returning <= 0:
                    break
                await self._yield_now()
            if batch.blocks * self._bytes_per_block >= _LONG_POST:
                # A post this big copies for a while: give the loop a turn between the
                # joiners and the copy, so that a timer or another task due meanwhile
                # waits for one of them, not for both.
                await self._yield_now()
        except BaseException as exc:
            # Cancelled while gathering: the others go out all the same, without us.
            self._stop_gathering(key, batch)
            batch.live -= 1
            batch.remove(entry)
            self._post(batch)
            self.metrics.failed(exc, peer, op, entry[2], started)
            raise
        self._stop_gathering(key, batch)
        self._post(batch)
        return await self.member(batch, entry, started, limit)

    def _wake_members(self, waiters: list[object]) -> None:
        """A merged request ended: wake its members, counted as returning (see ``_returning``)."""
        now = time.perf_counter()
        if self._returning < 0 or now - self._woke_at > _RETURNING:
            self._returning = 0  # whatever was miscounted is forgotten
        if not self._table.polling:
            self._returning += self._unpark_all(waiters)
        else:
            # The rest a chunk per poller turn (see _WAKE_CHUNK); all at once once it stops.
            self._returning += self._unpark_all(waiters, self._wake_chunk)
            if waiters:
                self._table.defer(lambda: self._wake_members(waiters))
        self._woke_at = now

    def _stop_gathering(self, key: tuple[Peer, Op], batch: Batch) -> None:
        batches = self.gathering.get(key)
        if batches is not None and batch in batches:
            batches.remove(batch)  # mostly the oldest: they post in the order they opened
            if not batches:
                del self.gathering[key]

    def _post(self, batch: Batch) -> None:
        """Post a gathered request (or fail it, if its peer or the engine went away); also
        what is left of one after a member left it (``_leave``)."""
        first = not batch.posted
        batch.posted = True
        peer = batch.peer
        agent = self._local.agent
        if not batch.entries:
            batch.finish(DONE)
            return
        if agent is None or self._life.state in (CLOSING, CLOSED):
            batch.finish(ERR, EngineClosedError(f"engine {self._life.name!r} closed"))
            return
        if not peer.link.connected:
            lost = peer.link.lost
            error = PeerDisconnectedError(f"peer {peer.name!r} was disconnected" if lost is None else
                                          f"peer {peer.name!r} is unreachable and was evicted: {lost}")
            error.__cause__ = lost
            batch.finish(ERR, error)
            return
        entries = batch.entries
        if len(entries) == 1 and not batch.tag:
            local, remote, _, message, _ = entries[0]
        else:
            if len(entries) == 1:
                local, remote = entries[0][0], entries[0][1]
            else:
                local, remote = _merged_indices(entries, batch.blocks, self._offsets, peer.link.offsets,
                                                batch.dups > 0)
                if first:
                    self.merged_requests += 1
                    self.merged_calls += len(entries)
            messages = [e[3] for e in entries if e[3]]
            if not messages:
                message = b""
            else:
                # Tagged (calls with notify join only where the peer drops a repeated tag),
                # so that a re-post after a member left (this request aborted, its
                # notification perhaps delivered all the same) notifies no one twice.
                if not batch.tag:
                    batch.tag = next(self._tags)
                message = pack_tagged(batch.tag, messages)
        try:
            handle, status = agent.start_xfer(batch.op, self._local.dlist, local, peer.link.dlist, remote,
                                              message, self._inline_polls)
        except PeerDisconnectedError as exc:
            batch.finish(ERR, self._peers.evict(peer, exc))
            return
        except AionixlError as exc:
            batch.finish(ERR, exc)
            return
        finally:
            batch.posted_at = time.perf_counter()
        if status == DONE and handle == NO_HANDLE:
            batch.finish(DONE)
            return
        batch.handle = handle
        self._table.add(handle, batch, status == PROC)
        if status == DONE:
            batch.finish(DONE)
        elif status != PROC:
            self._peers.evict(peer, failed_in_nixl())

    async def member(self, batch: Batch, entry: _Entry, started: float, limit: float,
                     woken: bool = False, interrupted: BaseException | None = None) -> TransferResult:
        """Wait for a merged request as one of its callers; report this caller's part.

        No timer of its own (a cancel scope per member costs more than the transfer): the
        poller wakes the members when the earliest deadline among them passes. A caller
        that parked once already (``transfer_blocks``' joining path) passes how that ended:
        ``woken`` (and :meth:`woke` said wait on) or ``interrupted`` (the park raised it).
        """
        try:
            back = interrupted is not None  # back from a park that woke() has not seen
            while True:
                if back:
                    if interrupted is not None:
                        exc, interrupted = interrupted, None
                        if not await self._interrupted(batch, entry, exc):
                            raise exc
                    woken, back = True, False
                    result = self.woke(batch, entry, started)
                    if result is not None:
                        return result
                if batch.status != PROC:
                    break
                if woken and time.perf_counter() >= entry[4]:
                    if await self._leave(batch, entry):
                        raise TransferTimeoutError(
                            f"transfer to {batch.peer.name!r} did not finish within {limit} s; "
                            "it was aborted")
                    continue  # found ended on the way out
                try:
                    await self.park(batch.waiters)
                except BaseException as exc:
                    interrupted = exc
                back = True
            self._retire(batch)
            error = batch.error
            if error is not None or batch.status != DONE:
                await self._fence_failed(batch, entry)
            if error is not None:
                # A fresh error per caller: several callers share one failure.
                raise type(error)(str(error)) from error.__cause__
            if batch.status != DONE:
                raise failed_in_nixl()
        except BaseException as exc:
            self.metrics.failed(exc, batch.peer, batch.op, entry[2], started)
            raise
        result = self.woke(batch, entry, started, False)
        assert result is not None  # DONE, no error
        return result

    def woke(self, batch: Batch, entry: _Entry, started: float, parked: bool = True
             ) -> TransferResult | None:
        """A member's result once its request moved its blocks; None while it waits on, or
        when the request failed. ``parked``: it is back from a park, and is counted off the
        returning members once the request ended."""
        status = batch.status
        if status == PROC:
            return None
        if parked:
            self._returning -= 1
        if status != DONE or batch.error is not None:
            return None
        if batch.handle != NO_HANDLE:
            self._retire(batch)
        now = self._turns.last_yield = time.perf_counter()
        if entry[2] == 1:  # the commonest member: the cheaper recorder, same result
            return self.metrics.done_one(batch.op, started, batch.posted_at, batch.finished_at, now)
        return self.metrics.done(batch.op, entry[2], started, batch.posted_at, batch.finished_at, now,
                                 None)

    def _keep_result(self, batch: Batch, exc: BaseException) -> bool:
        """A member cancelled while it waited for its wake, after its request had already
        moved its blocks (or found so on its way out): report the transfer done (a caller
        told it failed would retry, and write and notify twice). The cancellation is not
        lost: it is raised at the caller's next checkpoint (trio does that by itself; on
        asyncio the task's cancellation is requested again, ``LoopTools.recancel``)."""
        if self._redelivers_cancel and batch.status == DONE and batch.error is None \
                and isinstance(exc, anyio.get_cancelled_exc_class()):
            self._recancel(exc)
            self._owed.add(self._current_task())
            self.owing = True
            return True
        return False

    async def pay_owed_cancel(self) -> None:
        """A task that kept a result after a cancellation calls again: a checkpoint first,
        which raises that cancellation if it is still pending (see ``_owed``)."""
        task = self._current_task()
        owes = task in self._owed
        self._owed.discard(task)
        self.owing = len(self._owed) > 0  # also once the listed tasks are gone
        if owes:
            await self._yield_now()

    async def _interrupted(self, batch: Batch, entry: _Entry, exc: BaseException) -> bool:
        """A parked member was cancelled (or interrupted): whether it keeps its result
        (``_keep_result``: its blocks landed, before it ran again or as it left); if not, its
        part is taken out and the caller raises ``exc``."""
        if self._keep_result(batch, exc):
            return True
        if batch.status == PROC and await self._leave(batch, entry):
            # It left: whatever the request does now (posted again for the others, it
            # may finish before we look) carries none of its blocks.
            return False
        # Ended, before it ran or as it left: release the request if no member has yet (a
        # lone member found it failed: no one else would, and the poller skips ended ones).
        self._retire(batch)
        if self._keep_result(batch, exc):
            return True
        await self._fence_failed(batch, entry)
        return False

    async def _fence_failed(self, batch: Batch, entry: _Entry) -> None:
        """A merged read NIXL failed while its peer stays connected may still be writing,
        as a lone read that failed may: fence the member's blocks before it returns."""
        if batch.op == "read" and batch.status == ERR and batch.posted_at and batch.peer.link.connected:
            await self._direct.fence(batch.peer, entry[0], entry[1])  # (posted_at: it reached NIXL)

    async def _leave(self, batch: Batch, entry: _Entry) -> bool:
        """A member gives up (timeout, cancelled) before its merged request finished.

        Not posted yet: its blocks are taken out. Posted: the request is aborted (as a
        lone transfer would be) and, if other members remain, posted again for them alone,
        so that the leaver's blocks are not moved after it returned and the others are
        not failed. A request found ended on the way out (done, or failed as the poller
        would report it) is reported so: returns False, and the member stays (a caller
        told its transfer timed out when its blocks had landed would write, and notify,
        twice).
        """
        if not batch.posted:
            batch.live -= 1
            batch.remove(entry)  # its blocks never go out
            return True
        if batch.status != PROC:
            return False
        agent = self._local.agent
        handle = batch.handle
        # ``first``: the request is still in the table, and this member aborts it and posts
        # it again for the rest. Otherwise it is running, yet out of the table: another
        # member is leaving and fences the aborted read before posting again. This one
        # leaves the same way: takes its blocks out of that new request and fences them too
        # (a fence completes after every earlier operation to the peer).
        first = agent is not None and self._table.records.get(handle) is batch
        if first:
            assert agent is not None
            # Found ended: reported as the poller would (a request NIXL gave up on is not
            # posted again); the leaver then returns that end, or its cancellation.
            try:
                state = agent.check(handle)
            except PeerDisconnectedError as exc:
                self._peers.evict(batch.peer, exc)  # fails this request and the peer's others
                return False
            except TransferError as exc:
                batch.finish(ERR, exc)  # this request failed; the peer may be fine
                return False
            if state == DONE:
                batch.finish(DONE)  # everyone's blocks, the leaver's too, are in place
                return False
            if state == ERR:
                self._peers.evict(batch.peer, failed_in_nixl())
                return False
        batch.live -= 1
        batch.remove(entry)
        if first:
            self._retire(batch)  # abort
        try:
            if batch.op == "read":
                # An aborted GET may still be writing: fence it (or evict the peer) before
                # this caller returns and before the others' blocks are read again.
                await self._direct.fence(batch.peer, entry[0], entry[1])
        finally:
            # Also when a cancellation cut the fence short (the peer was evicted then, and
            # this fails the others at once): they must not wait on a request nobody posts.
            if first and batch.live > 0:
                self.reposts += 1
                self._post(batch)
        return True

    def _retire(self, batch: Batch) -> None:
        """Release a merged request's handle, once, if the table still says it is ours.

        The first member back does it; it forgets the handle, so that the others (who
        check ``batch.handle`` before calling this) skip the call."""
        handle = batch.handle
        batch.handle = NO_HANDLE
        if handle != NO_HANDLE:
            self._table.take(handle, batch)


def _unbound_park(waiters: list[object]) -> Awaitable[None]:
    raise RuntimeError("Coalescer.bind_loop was not called")


def _unbound_unpark_all(waiters: list[object], limit: int = 0, /) -> int:
    raise RuntimeError("Coalescer.bind_loop was not called")


def with_room(batches: list[Batch], dests: Sequence[int], source: int, nblocks: int,
               most: int) -> Batch | None:
    """The newest of the last few merged requests gathering with room for ``nblocks`` more
    blocks where a caller writing ``dests`` may join: a one-block caller (``source`` >= 0)
    where no other member writes its block from another source, any other where no member
    writes any of its blocks."""
    for batch in reversed(batches[-_GATHERING_TRIED:]):
        if batch.blocks + nblocks <= most \
                and (batch.dests.get(dests[0], source) == source if source >= 0
                     else batch.dests.keys().isdisjoint(dests)):
            return batch
    return None


def _destinations(blocks: Sequence[int] | IndexArray) -> Sequence[int]:
    """Validated ids as plain ints (keys that equal and hash as the same blocks do)."""
    if isinstance(blocks, np.ndarray):
        return blocks.ravel().tolist()
    return [b if type(b) is int else operator.index(b) for b in blocks]


def _merged_indices(entries: list[_Entry], blocks: int, local_offsets: IndexArray,
                    remote_offsets: IndexArray, dups: bool = False) -> tuple[IndexArray, IndexArray]:
    """The members' descriptor indices as one request, ordered by local descriptor.

    Each caller's own indices are region-major, but side by side the callers interleave
    regions; in local order, blocks that are adjacent on both sides become neighbours,
    and NIXL merges such runs into one descriptor (64 one-block reads of adjacent blocks
    cost about a third as much to post). The order within one request changes nothing
    else: no two members write one destination block from different sources.

    ``dups``: some members move the very block pair of another; each pair goes in once
    (what lands is the same bytes either way).

    ``blocks`` is the members' total: when it equals their number, every member moves one
    block, whose id is its first descriptor index (region 0 starts at 0), and the request
    is built from the ids with numpy: 210 instead of 290 ns per member of 1024-member
    requests, measured inside a loop run.
    """
    if blocks == len(entries):
        local_ids = np.array([e[0][0] for e in entries], np.int32)
        remote_ids = np.array([e[1][0] for e in entries], np.int32)
        if dups:
            local_ids, remote_ids = _distinct_pairs(local_ids, remote_ids)
        else:
            order = np.argsort(local_ids, kind="stable")
            local_ids, remote_ids = local_ids[order], remote_ids[order]
        return (descriptor_indices(local_offsets, local_ids),
                descriptor_indices(remote_offsets, remote_ids))
    local: list[int] = []
    remote: list[int] = []
    for entry in entries:
        mine, theirs = entry[0], entry[1]
        if type(mine) is not list or type(theirs) is not list:  # some caller passed arrays
            local_array = np.concatenate([np.asarray(e[0], dtype=np.int32) for e in entries])
            remote_array = np.concatenate([np.asarray(e[1], dtype=np.int32) for e in entries])
            break
        local += mine
        remote += theirs
    else:
        local_array = np.array(local, dtype=np.int32)
        remote_array = np.array(remote, dtype=np.int32)
    if dups:
        return _distinct_pairs(local_array, remote_array)
    order = np.argsort(local_array, kind="stable")
    return local_array[order], remote_array[order]


def _distinct_pairs(local: IndexArray, remote: IndexArray) -> tuple[IndexArray, IndexArray]:
    """Each (local, remote) pair once, ordered by local, then remote."""
    order = np.lexsort((remote, local))
    local, remote = local[order], remote[order]
    keep = np.ones(local.size, bool)
    keep[1:] = (local[1:] != local[:-1]) | (remote[1:] != remote[:-1])
    return local[keep], remote[keep]

