"""Transfers: posting NIXL requests, the in-flight table, the poller, fairness.

A ``transfer_blocks`` call validates its ids, posts one NIXL request and polls it a few
times inline. A request still in flight after that goes into the in-flight table, and
the caller sleeps on its record's event; the poller task checks every record once per
loop turn and sets the event of each one that finished. Whatever happens to the caller
(done, timeout, cancelled, peer lost, engine closed), the handle is released exactly
once, by whoever takes its record out of the table; a handle NIXL will not release yet
is parked and retried by the poller. Close releases the rest (:meth:`Transfers.close`).

Coalescing (``EngineConfig.coalesce``): when a call finds the engine busy with other
callers (another task called just before it, or a merged request to that peer is still
being gathered), it gathers: it yields once, and the calls to the same peer with the same
op that arrive meanwhile join it. Then one NIXL request carries all their blocks, and all
their notifications (packed into one reserved notification the peer unpacks: it arrives
after the data, like any NIXL notification). Each caller keeps its own ids (validated
before it joins), deadline, result and error. A lone caller never gathers. The common
member (one block, joining) waits inline in ``transfer_blocks``: no second coroutine.
"""

from __future__ import annotations

import itertools
import math
import operator
import secrets
import time
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

import anyio
import anyio.lowlevel
import numpy as np

from ._config import EngineConfig
from ._errors import (
    AionixlError,
    EngineClosedError,
    PeerDisconnectedError,
    TransferError,
    TransferTimeoutError,
)
from ._metrics import TransferMetrics
from ._nixl import DONE, ERR, NO_HANDLE, PROC, Agent, Indices, Status
from ._peers import (
    RESERVED,
    TAGGED_NOTIFY,
    Peer,
    PeerTable,
    pack_tagged,
    progress_quietly,
    user_message,
)
from ._regions import (
    IndexArray,
    Region,
    block_ids,
    check_distinct,
    descriptor_indices,
    has_duplicates,
    plain_ids,
    plain_int,
    region_offsets,
    small_indices,
)
from ._util import (
    ALL,
    CLOSED,
    CLOSING,
    OPEN,
    NativeEvent,
    Unpark,
    check_timeout,
    deadline,
    loop_tools,
    no_recancel,
)

if TYPE_CHECKING:
    from ._engine import Engine
    from ._push import Pusher

Op = Literal["read", "write"]


class TransferResult(NamedTuple):
    """What one ``transfer_blocks`` call moved."""

    blocks: int
    nbytes: int
    seconds: float
    #: Creating and posting the NIXL request (NIXL's telemetry with ``nixl_telemetry``).
    post_seconds: float = 0.0
    #: From the post until completion was seen (NIXL's telemetry with ``nixl_telemetry``).
    transfer_seconds: float = 0.0
    #: NIXL descriptors (after NIXL merged contiguous ones, with ``nixl_telemetry``;
    #: blocks x regions otherwise).
    descriptors: int = 0


class _InFlight:
    """A posted NIXL request and whoever waits for it.

    ``event`` is the engine loop's own event class (asyncio's or trio's: cheaper than
    anyio's portable wrapper; waiting on it is an ordinary cancellable checkpoint).
    """

    __slots__ = ("peer", "event", "status", "error", "finished_ns", "deadline", "_new_event")

    def __init__(self, peer: Peer, new_event: Callable[[], NativeEvent]) -> None:
        self.peer = peer
        self._new_event = new_event
        self.event = new_event()
        self.status: Status = PROC
        self.error: AionixlError | None = None
        self.finished_ns = 0
        #: perf_counter() time at which the poller wakes the waiters to check their
        #: deadlines (merged requests; a lone transfer's caller keeps its own timer).
        self.deadline = math.inf

    def expire(self, now: float) -> None:
        """The poller found ``deadline`` passed (see :class:`_Batch`)."""
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


class _Batch(_InFlight):
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
        self._wake = wake  # wakes the members at the end (Transfers._wake_members)
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
        turns away a joiner that could have come in)."""
        self.entries.remove(entry)
        self.blocks -= entry[2]

    def expire(self, now: float) -> None:
        """Some member's deadline passed: wake everyone to look (the rest wait again)."""
        self.deadline = min((e[4] for e in self.entries if e[4] > now), default=math.inf)
        self._unpark_all(self.waiters)


#: (local indices, remote indices, blocks, notification, deadline)
_Entry = tuple[Indices, Indices, int, bytes, float]

#: ``_last_caller`` after a call joined a merged request: any task calling next is another.
_JOINED = object()

#: How long transfer_blocks may finish transfers inline before it yields to the loop: long
#: while the loop has nothing else to run, short once a yield shows others were waiting
#: (a yield that takes longer than _CROWDED).
_SLICE_LONG = 0.002
_SLICE_SHORT = 0.0001
_CROWDED = 0.0002

_ONE_BLOCK_CACHE = 4096
#: A caller tries at most this many of the newest merged requests gathering before it opens
#: one more (callers that all write one block would otherwise each try every one).
_GATHERING_TRIED = 16
_perf = time.perf_counter
_INF = math.inf

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


class Transfers:
    """Every transfer of one engine, from post to release."""

    def __init__(self, engine: Engine, regions: Sequence[Region], config: EngineConfig,
                 peers: PeerTable) -> None:
        self._engine = engine
        self._peers = peers
        self._config = config
        self._num_blocks = regions[0].num_blocks
        self._offsets = region_offsets(len(regions), self._num_blocks)
        self._offset_list: list[int] = self._offsets.ravel().tolist()
        self._bytes_per_block = sum(r.block_bytes for r in regions)
        self._one_block: dict[int, list[int]] = {}  # block id -> its descriptor indices
        self._inline_polls = config.inline_polls
        self._coalesce = config.coalesce
        self._max_merged = config.coalesce_max_blocks
        self._window = config.coalesce_window
        #: Merged requests still gathering members, by (peer, op), oldest first. A caller
        #: whose destination block one of them already writes opens another (never the
        #: same block twice in one request), and the callers after it join whichever has
        #: room (``_with_room``): callers that share blocks still fill few requests.
        self._gathering: dict[tuple[Peer, Op], list[_Batch]] = {}
        #: Who called last, and when: a call from another task right after it means
        #: callers are arriving together, and this one gathers.
        self._current_task: Callable[[], object] = _no_task
        self._new_event: Callable[[], NativeEvent] = anyio.Event
        self._park: Callable[[list[object]], Awaitable[None]] = _unbound_park
        self._unpark_all: Unpark = _unbound_unpark_all
        self._yield_now: Callable[[], Awaitable[None]] = anyio.lowlevel.checkpoint
        self._wake_chunk = ALL  # until bind_loop: chunks only where cancels are redelivered
        self._redelivers_cancel = False
        self._recancel: Callable[[BaseException], None] = no_recancel
        #: Tasks that kept a result after a cancellation (``_keep_result``) and still owe it:
        #: their next call takes a checkpoint first. Without it a member cancelled while its
        #: request gathered, which ran again only after the request finished, could keep one
        #: result after another and never see its cancellation. ``_owing``: any listed.
        self._owed: weakref.WeakSet[Any] = weakref.WeakSet()
        self._owing = False
        self._last_caller: object = None
        self._last_call = 0.0
        #: Members woken by the end of their merged request that have not run again yet
        #: (about: a cancelled one may be counted), and when the last were woken. While
        #: there are any, a call comes "together" with theirs.
        self._returning = 0
        self._woke_at = -math.inf
        #: Members of ended merged requests still to wake, a chunk per poller turn; only
        #: while the poller runs (``_polling``), which wakes them all when it stops.
        self._waking: list[list[object]] = []
        self._polling = False
        self.merged_requests = 0  # NIXL requests that carried more than one caller
        self.merged_calls = 0  # calls that rode in one of them
        self.reposts = 0  # merged requests posted again after a member left
        #: Tags of merged requests' notifications: unique per engine, and (random start, from
        #: the OS: an application's random.seed() must not repeat it) unlike those of an
        #: engine of the same name before it, whose tags its peers may still remember.
        self._tags = itertools.count(secrets.randbits(62) + 1)
        self.agent: Agent | None = None  # set once the engine's agent exists
        self.local_dlist = -1
        self.inflight: dict[int, _InFlight] = {}
        self.parked: set[int] = set()  # handles NIXL would not release yet
        self._poller_wakeup = anyio.Event()
        self._last_yield = 0.0  # perf_counter() when transfer_blocks last went through the loop
        self._slice = _SLICE_LONG
        #: Benchmarks set a list here to collect, per transfer finished by the poller, the
        #: nanoseconds from the poller seeing its final state to the caller running again.
        self.wake_trace: list[int] | None = None
        self.metrics = TransferMetrics(TransferResult, self._bytes_per_block, len(regions), peers.noisy)
        self._done_one = self.metrics.done_one
        self.push: Pusher | None = None  # push reads and the GET fence (_push.py); set by the engine

    # ---- the call -----------------------------------------------------------------------

    async def transfer_blocks(self, peer: Peer, local_blocks: Sequence[int] | IndexArray,
                              remote_blocks: Sequence[int] | IndexArray, op: Op = "read",
                              notify: bytes | None = None,
                              timeout: float | None = None) -> TransferResult:
        engine = self._engine
        if engine._state is not OPEN or engine._failure is not None:
            engine._check_open()
        if type(peer) is not Peer or peer._engine is not engine or not peer._connected:
            if type(peer) is Peer and peer._engine is engine and peer._revive and peer.address:
                # Evicted only to fence a cancelled read: reconnect and go on with it.
                limit = self._config.transfer_timeout if timeout is None else timeout
                await engine._handshakes.connect(peer.address, min(limit, 30.0))
            self._peers.live(peer)  # raises the right error
        if op != "read" and op != "write":
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        local_idx: Indices | None
        remote_idx: Indices | None
        gathering: _Batch | None
        local_idx = remote_idx = None
        nblocks = 1
        if type(local_blocks) is list and type(remote_blocks) is list \
                and len(local_blocks) == 1 == len(remote_blocks):
            # One block each way, the commonest call: indices already validated and built.
            lb, rb = local_blocks[0], remote_blocks[0]
            if type(lb) is not int or type(rb) is not int:
                if isinstance(lb, np.integer) or isinstance(rb, np.integer):
                    # Ids taken one by one from an array: the same call with plain ints.
                    return await self.transfer_blocks(peer, [plain_int(lb)], [plain_int(rb)], op,
                                                      notify, timeout)
            else:
                local_idx = self._one_block.get(lb)
                remote_idx = peer._one_block.get(rb)
                if local_idx is None:  # not seen lately (a cache larger than the memo)
                    local_idx = _one_block_indices(self._one_block, lb, self._num_blocks,
                                                   self._offset_list)
                if remote_idx is None:
                    remote_idx = _one_block_indices(peer._one_block, rb, peer.num_blocks,
                                                    peer._offset_list)
                batches = self._gathering.get((peer, op)) if self._gathering else None
                gathering = None
                if batches is not None and not self._owing \
                        and (notify is None or (type(notify) is bytes and not notify.startswith(RESERVED)
                                                and TAGGED_NOTIFY in peer.features)) \
                        and (timeout is None or ((type(timeout) is float or type(timeout) is int)
                             and 0 < timeout < _INF)):
                    if op == "read":
                        block, source = lb, rb
                    else:
                        block, source = rb, lb
                    gathering = batches[-1]
                    # Room, and its block not written by another member from elsewhere.
                    if gathering.blocks >= self._max_merged \
                            or gathering.dests.get(block, source) != source:
                        gathering = _with_room(batches, (block,), source, 1, self._max_merged)
                if gathering is not None and local_idx is not None and remote_idx is not None:
                    # The commonest call under load, joining a merged request that is
                    # gathering: _Batch.add and _member, inline (no frame of their own).
                    started = _perf()
                    self._last_caller = _JOINED  # whoever calls next is "another task"
                    self._last_call = started
                    limit = self._config.transfer_timeout if timeout is None else timeout
                    expires = started + limit
                    message = b"" if notify is None else notify
                    entry: _Entry = (local_idx, remote_idx, 1, message, expires)
                    gathering.entries.append(entry)
                    gathering.blocks += 1
                    if block in gathering.dests:
                        gathering.dups += 1  # the same pair as another member's
                    else:
                        gathering.dests[block] = source
                    gathering.live += 1
                    if expires < gathering.deadline:
                        gathering.deadline = expires
                    try:
                        await self._park(gathering.waiters)
                    except BaseException as exc:
                        if not await self._interrupted(gathering, entry, exc):
                            self.metrics.failed(exc, peer, op, 1, started)
                            raise
                    status = gathering.status
                    if status != PROC:
                        self._returning -= 1
                    if status == DONE and gathering.error is None:
                        if gathering.handle != NO_HANDLE:
                            self._retire(gathering)
                        now = self._last_yield = _perf()
                        return self._done_one(op, started, gathering.posted_at,
                                              gathering.finished_at, now)
                    return await self._member(gathering, entry, started, limit, True)
        elif type(local_blocks) is not list or type(remote_blocks) is not list:
            mine, theirs = plain_ids(local_blocks), plain_ids(remote_blocks)
            if type(mine) is list and type(theirs) is list:
                # A tuple, a range or a short integer array: the same call with the list it
                # stands for (lists take the fast paths).
                return await self.transfer_blocks(peer, mine, theirs, op, notify, timeout)
        if local_idx is None or remote_idx is None:
            local_idx = small_indices(local_blocks, self._num_blocks, self._offset_list)
            remote_idx = small_indices(remote_blocks, peer.num_blocks, peer._offset_list)
            if (local_idx is None or remote_idx is None or len(local_blocks) != len(remote_blocks)
                    or has_duplicates(local_blocks if op == "read" else remote_blocks)):  # type: ignore[arg-type]
                nblocks, local_idx, remote_idx = self._checked_indices(peer, local_blocks,
                                                                       remote_blocks, op)
            else:
                nblocks = len(local_blocks)
        message = b"" if notify is None else user_message(notify, "notify")
        if timeout is not None:
            check_timeout(timeout, "timeout")
        if peer._push and op == "read":  # the peer writes the blocks into ours (_push.py)
            assert self.push is not None and local_idx is not None and remote_idx is not None
            t0 = time.perf_counter()
            try:
                await self.push.read(peer, local_idx, remote_idx, nblocks, message, timeout)
            except BaseException as exc:
                self.metrics.failed(exc, peer, op, nblocks, t0)
                raise
            end = time.perf_counter()
            return self.metrics.done(op, nblocks, t0, t0, end, end, None)
        assert local_idx is not None and remote_idx is not None
        if self._owing:
            await self._pay_owed_cancel()
        started = time.perf_counter()
        if self._coalesce:
            batches = self._gathering.get((peer, op)) if self._gathering else None
            if batches is None:
                caller = self._current_task()
                together = (caller is not self._last_caller and started - self._last_call < self._window) \
                    or (self._returning > 0 and started - self._woke_at < _RETURNING)
                self._last_caller = caller
            else:
                # Joining needs no task lookup; whoever calls next is "another task".
                together = True
                self._last_caller = _JOINED
            self._last_call = started
            # Notifications ride along only to peers that drop a repeated tag: a re-post
            # (``_leave``) must not notify anyone twice.
            if together and (not message or TAGGED_NOTIFY in peer.features):
                limit = self._config.transfer_timeout if timeout is None else timeout
                expires = started + limit
                entry = (local_idx, remote_idx, nblocks, message, expires)
                dest, src = (local_blocks, remote_blocks) if op == "read" else (remote_blocks, local_blocks)
                source = -1
                dests: Sequence[int]
                if nblocks == 1 and type(dest) is list and type(dest[0]) is int:
                    dests = dest  # a one-block list is read at once, never kept
                    if type(src) is list and type(src[0]) is int:
                        source = src[0]
                else:
                    dests = _destinations(dest)
                if batches is not None:
                    gathering = _with_room(batches, dests, source, nblocks, self._max_merged)
                    if gathering is not None:
                        gathering.add(entry, dests, source)
                        return await self._member(gathering, entry, started, limit)
                return await self._gather(peer, op, entry, dests, source, started, limit)
        agent = self.agent
        assert agent is not None
        try:
            handle, status = agent.start_xfer(op, self.local_dlist, local_idx, peer._dlist,
                                              remote_idx, message, self._inline_polls)
        except PeerDisconnectedError as exc:
            raise self.metrics.failed(self._peers.evict(peer, exc), peer, op, nblocks, started) from exc
        except AionixlError as exc:
            self.metrics.failed(exc, peer, op, nblocks, started)
            raise
        posted, tel = agent.posted, agent.telemetry
        if status is not DONE or handle != NO_HANDLE:
            limit = self._config.transfer_timeout if timeout is None else timeout
            try:
                await self._finish(peer, handle, status, limit)
            except BaseException as exc:
                self.metrics.failed(exc, peer, op, nblocks, started)
                if op == "read" and peer._connected and self.push is not None:
                    # No late bytes: an aborted GET may still be writing (_push.fence_get).
                    await self.push.fence_get(peer, local_idx, remote_idx)
                raise
            tel = agent.telemetry
            seen = now = self._last_yield = time.perf_counter()
        else:
            # Finished inline, without a trip through the event loop. A caller looping on
            # short transfers must still let other tasks run (and be cancellable): yield
            # once the engine has gone one slice without doing so. The slice adapts: long
            # while yielding finds the loop idle (a lone caller pays little), short once
            # other tasks were waiting (64 busy callers each get a short turn, not 2 ms).
            seen = now = time.perf_counter()
            if now - self._last_yield > self._slice:
                # Shielded: the transfer is done; a cancel must not turn it into a failure
                # (a caller that retried would write, and notify, twice).
                await anyio.lowlevel.cancel_shielded_checkpoint()
                after = time.perf_counter()
                self._slice = _SLICE_SHORT if after - now > _CROWDED else _SLICE_LONG
                now = self._last_yield = after
        return self.metrics.done(op, nblocks, started, posted, seen, now, tel)

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

    # ---- coalescing ---------------------------------------------------------------------

    async def _gather(self, peer: Peer, op: Op, entry: _Entry, dests: Sequence[int], source: int,
                      started: float, limit: float) -> TransferResult:
        """Open a merged request, let the callers arriving with us join, post it."""
        batch = _Batch(peer, op, self._wake_members, self._unpark_all)
        batch.add(entry, dests, source)
        key = (peer, op)
        batches = self._gathering.get(key)
        if batches is None:
            self._gathering[key] = [batch]
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
        return await self._member(batch, entry, started, limit)

    def _wake_members(self, waiters: list[object]) -> None:
        """A merged request ended: wake its members, counted as returning (see ``_returning``)."""
        now = time.perf_counter()
        if self._returning < 0 or now - self._woke_at > _RETURNING:
            self._returning = 0  # whatever was miscounted is forgotten
        if not self._polling:
            self._returning += self._unpark_all(waiters)
        else:
            self._returning += self._unpark_all(waiters, self._wake_chunk)
            if waiters:
                self._waking.append(waiters)
                self._poller_wakeup.set()
        self._woke_at = now

    def _wake_more(self) -> None:
        """Wake the next chunk of each ended merged request's members (see _WAKE_CHUNK)."""
        waking, self._waking = self._waking, []
        for waiters in waking:
            self._wake_members(waiters)

    def _stop_gathering(self, key: tuple[Peer, Op], batch: _Batch) -> None:
        batches = self._gathering.get(key)
        if batches is not None and batch in batches:
            batches.remove(batch)  # mostly the oldest: they post in the order they opened
            if not batches:
                del self._gathering[key]

    def _post(self, batch: _Batch) -> None:
        """Post a gathered request (or fail it, if its peer or the engine went away); also
        what is left of one after a member left it (``_leave``)."""
        first = not batch.posted
        batch.posted = True
        peer = batch.peer
        engine = self._engine
        agent = self.agent
        if not batch.entries:
            batch.finish(DONE)
            return
        if agent is None or engine._state in (CLOSING, CLOSED):
            batch.finish(ERR, EngineClosedError(f"engine {engine.name!r} closed"))
            return
        if not peer._connected:
            lost = peer._lost
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
                local, remote = _merged_indices(entries, batch.blocks, self._offsets, peer._offsets,
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
            handle, status = agent.start_xfer(batch.op, self.local_dlist, local, peer._dlist, remote,
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
        self.inflight[handle] = batch
        if status == PROC:
            self._poller_wakeup.set()
        elif status == DONE:
            batch.finish(DONE)
        else:
            self._peers.evict(peer, _failed_in_nixl())

    async def _member(self, batch: _Batch, entry: _Entry, started: float, limit: float,
                      woken: bool = False) -> TransferResult:
        """Wait for a merged request as one of its callers; report this caller's part.

        No timer of its own (a cancel scope per member costs more than the transfer): the
        poller wakes the members when the earliest deadline among them passes. ``woken``:
        the caller parked once already (inline) and was woken, so look at the clock first.
        """
        try:
            while batch.status == PROC:
                if woken and time.perf_counter() >= entry[4]:
                    if await self._leave(batch, entry):
                        raise TransferTimeoutError(
                            f"transfer to {batch.peer.name!r} did not finish within {limit} s; "
                            "it was aborted")
                    continue  # found ended on the way out
                try:
                    await self._park(batch.waiters)
                except BaseException as exc:
                    if not await self._interrupted(batch, entry, exc):
                        raise
                woken = True
                if batch.status != PROC:
                    self._returning -= 1
            self._retire(batch)
            error = batch.error
            if error is not None or batch.status != DONE:
                await self._fence_failed(batch, entry)
            if error is not None:
                # A fresh error per caller: several callers share one failure.
                raise type(error)(str(error)) from error.__cause__
            if batch.status != DONE:
                raise _failed_in_nixl()
        except BaseException as exc:
            self.metrics.failed(exc, batch.peer, batch.op, entry[2], started)
            raise
        now = self._last_yield = time.perf_counter()
        return self.metrics.done(batch.op, entry[2], started, batch.posted_at, batch.finished_at, now,
                                 None)

    def _keep_result(self, batch: _Batch, exc: BaseException) -> bool:
        """A member cancelled while it waited for its wake, after its request had already
        moved its blocks (or found so on its way out): report the transfer done (a caller
        told it failed would retry, and write and notify twice). The cancellation is not
        lost: it is raised at the caller's next checkpoint (trio does that by itself; on
        asyncio the task's cancellation is requested again, ``LoopTools.recancel``)."""
        if self._redelivers_cancel and batch.status == DONE and batch.error is None \
                and isinstance(exc, anyio.get_cancelled_exc_class()):
            self._recancel(exc)
            self._owed.add(self._current_task())
            self._owing = True
            return True
        return False

    async def _pay_owed_cancel(self) -> None:
        """A task that kept a result after a cancellation calls again: a checkpoint first,
        which raises that cancellation if it is still pending (see ``_owed``)."""
        task = self._current_task()
        owes = task in self._owed
        self._owed.discard(task)
        self._owing = len(self._owed) > 0  # also once the listed tasks are gone
        if owes:
            await self._yield_now()

    async def _interrupted(self, batch: _Batch, entry: _Entry, exc: BaseException) -> bool:
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

    async def _fence_failed(self, batch: _Batch, entry: _Entry) -> None:
        """A merged read NIXL failed while its peer stays connected may still be writing,
        as a lone read that failed may: fence the member's blocks before it returns."""
        if batch.op == "read" and batch.status == ERR and batch.peer._connected \
                and self.push is not None:
            await self.push.fence_get(batch.peer, entry[0], entry[1])

    async def _leave(self, batch: _Batch, entry: _Entry) -> bool:
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
        agent = self.agent
        handle = batch.handle
        # ``first``: the request is still in the table, and this member aborts it and posts
        # it again for the rest. Otherwise it is running, yet out of the table: another
        # member is leaving and fences the aborted read before posting again. This one
        # leaves the same way: takes its blocks out of that new request and fences them too
        # (a fence completes after every earlier operation to the peer).
        first = agent is not None and self.inflight.get(handle) is batch
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
                self._peers.evict(batch.peer, _failed_in_nixl())
                return False
        batch.live -= 1
        batch.remove(entry)
        if first:
            self._retire(batch)  # abort
        try:
            if batch.op == "read" and self.push is not None:
                # An aborted GET may still be writing: fence it (or evict the peer) before
                # this caller returns and before the others' blocks are read again.
                await self.push.fence_get(batch.peer, entry[0], entry[1])
        finally:
            # Also when a cancellation cut the fence short (the peer was evicted then, and
            # this fails the others at once): they must not wait on a request nobody posts.
            if first and batch.live > 0:
                self.reposts += 1
                self._post(batch)
        return True

    def _retire(self, batch: _Batch) -> None:
        """Release a merged request's handle, once, if the table still says it is ours.

        The first member back does it; it forgets the handle, so that the others (who
        check ``batch.handle`` before calling this) skip the call."""
        handle = batch.handle
        batch.handle = NO_HANDLE
        if handle != NO_HANDLE and self.inflight.get(handle) is batch:
            del self.inflight[handle]
            assert self.agent is not None
            self._release(self.agent, handle)

    def bind_loop(self) -> None:
        """Called in the engine's event loop: learn its cheap task and event tools."""
        tools = loop_tools()
        self._current_task = tools.current_task
        self._new_event = tools.event
        self._park = tools.park
        self._unpark_all = tools.unpark_all
        self._yield_now = tools.yield_now
        self._redelivers_cancel = tools.redelivers_cancel
        self._recancel = tools.recancel
        self._wake_chunk = _WAKE_CHUNK if tools.redelivers_cancel else ALL

    # ---- waiting ------------------------------------------------------------------------

    async def _finish(self, peer: Peer, handle: int, status: Status, limit: float,
                      ended: list[Status] | None = None) -> None:
        """Wait for a posted transfer through the poller; always release its handle.
        ``ended`` gets the state the poller last saw, however the wait ended (a wait cut
        short by a cancellation may have seen the transfer finish)."""
        agent = self.agent
        assert agent is not None
        rec: _InFlight | None = None
        try:
            if status == PROC:
                rec = _InFlight(peer, self._new_event)
                self.inflight[handle] = rec
                self._poller_wakeup.set()
                status = await self._wait(rec, limit)
                if self.inflight.get(handle) is rec:
                    agent.completed(handle, status)
                else:  # an eviction or close released it after it ended: NIXL's record is gone
                    agent.telemetry = None
                if self.wake_trace is not None:
                    self.wake_trace.append(time.perf_counter_ns() - rec.finished_ns)
            if status != DONE:
                raise self._peers.evict(peer, _failed_in_nixl())
        finally:
            # Whoever took the record out of the table (eviction, close) released the handle,
            # and NIXL may since have given the same value to another transfer: release only
            # what is still ours.
            owned = rec is None or self.inflight.get(handle) is rec
            if ended is not None:
                ended.append(status if rec is None else rec.status)
            if rec is not None and owned:
                del self.inflight[handle]
            if owned:
                self._release(agent, handle)

    @staticmethod
    async def _wait(rec: _InFlight, limit: float) -> Status:
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

    def _release(self, agent: Agent, handle: int) -> None:
        if not agent.release_xfer(handle):
            self.parked.add(handle)
            self._poller_wakeup.set()

    def fail_peer(self, peer: Peer, error: AionixlError) -> None:
        """The peer is gone: its transfers fail with ``error``, their handles released."""
        agent = self.agent
        assert agent is not None
        for handle, rec in list(self.inflight.items()):
            if rec.peer is peer:
                del self.inflight[handle]
                rec.fail(error)
                self._release(agent, handle)

    def calls_in_flight(self) -> int:
        """Callers waiting on posted NIXL requests (a merged request counts its members) and
        on push reads."""
        pushes = 0 if self.push is None else len(self.push.reads)
        return pushes + sum(rec.live if isinstance(rec, _Batch) else 1 for rec in self.inflight.values()
                            if rec.status == PROC)

    def busy_with(self, peer: Peer) -> bool:
        return any(rec.peer is peer for rec in self.inflight.values())

    # ---- the poller task ----------------------------------------------------------------

    async def poll(self) -> None:
        """Check every transfer in flight once per loop turn; sleep while there are none."""
        agent = self.agent
        assert agent is not None
        self._polling = True
        try:
            await self._poll(agent)
        finally:
            # No one will wake the rest a chunk at a time: wake them all now.
            self._polling = False
            self._wake_more()

    async def _poll(self, agent: Agent) -> None:
        engine = self._engine
        while True:
            if self._waking:
                self._wake_more()
            if not self.inflight and not self.parked and not self._waking:
                self._poller_wakeup = anyio.Event()
                await self._poller_wakeup.wait()
                if self.inflight or self.parked:
                    # The drainer polls every turn while requests are in flight: end its
                    # back-off. Not when woken only to wake members: at 1024 in flight a
                    # merged request often finishes inside its post, and each such wake
                    # restarted its back-off from 20 us (5% of a read, A/B).
                    engine._wake_drainer()
                continue
            now = time.perf_counter()
            for handle, rec in list(self.inflight.items()):
                if rec.status != PROC:
                    continue
                if now >= rec.deadline:
                    rec.expire(now)
                try:
                    status = agent.check(handle)
                except PeerDisconnectedError as exc:
                    self._peers.evict(rec.peer, exc)  # fails every transfer to that peer
                    continue
                except TransferError as exc:
                    rec.finish(ERR, exc)  # this transfer failed; the peer may be fine
                    continue
                if status == ERR:
                    self._peers.evict(rec.peer, _failed_in_nixl())
                elif status != PROC:
                    rec.finish(status)
            if self.parked:
                self.parked = {h for h in self.parked if not agent.release_xfer(h)}
            await anyio.sleep(0)

    # ---- close --------------------------------------------------------------------------

    def fail_all(self, error: AionixlError) -> list[int]:
        """Closing: every waiting caller gets ``error``; returns the handles to release."""
        inflight, self.inflight = self.inflight, {}
        for rec in inflight.values():
            rec.fail(error)
        return list(inflight)

    async def close(self, handles: list[int], deadline_at: float, grace: float) -> list[str]:
        """Release every transfer handle the agent still holds; returns what could not be."""
        agent = self.agent
        assert agent is not None
        pending = set(handles) | self.parked | set(agent.xfers)
        self.parked = set()
        # Let transfers under way finish first (bounded by close_grace): cancelling a UCX
        # transfer that is moving data leaves requests UCX complains about at teardown.
        grace_end = min(deadline_at, anyio.current_time() + grace)
        moving = set(pending)
        while moving and anyio.current_time() < grace_end:
            moving = {h for h in moving if _still_moving(agent, h)}
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


def _still_moving(agent: Agent, handle: int) -> bool:
    try:
        return agent.check(handle) == PROC
    except AionixlError:
        return False


def _no_task() -> object:
    return None


def _unbound_park(waiters: list[object]) -> Awaitable[None]:
    raise RuntimeError("Transfers.bind_loop was not called")


def _unbound_unpark_all(waiters: list[object], limit: int = 0, /) -> int:
    raise RuntimeError("Transfers.bind_loop was not called")


def _failed_in_nixl() -> TransferError:
    """A fresh error for a request whose state NIXL reported as ERR."""
    return TransferError("NIXL reported the transfer failed (ERR)")


def _with_room(batches: list[_Batch], dests: Sequence[int], source: int, nblocks: int,
               most: int) -> _Batch | None:
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


def _one_block_indices(cache: dict[int, list[int]], block: int, num_blocks: int,
                       offsets: list[int]) -> list[int] | None:
    """A valid block id's descriptor indices, remembered for the one-block fast path (the
    last _ONE_BLOCK_CACHE ids); None for an invalid one (the general path then says what
    is wrong)."""
    if not 0 <= block < num_blocks:
        return None
    if len(cache) >= _ONE_BLOCK_CACHE:
        cache.clear()
    indices = cache[block] = [o + block for o in offsets]
    return indices
