"""The transfer call: validate, then choose how the blocks move.

``transfer_blocks`` checks its arguments (one block each way, the commonest call, from a
small memo of descriptor indices; anything else through :mod:`aionixl._regions`' checks),
then chooses one path:

- **join** a merged request still gathering to that peer (:mod:`aionixl._coalesce`);
- **push**: the peer's engine writes the blocks into ours (:mod:`aionixl._push`; reads from
  peers where a one-sided GET is not native);
- **ride** in a merged request when callers arrive together;
- **post alone** (:mod:`aionixl._post`), polled inline, then by the poller.

A call with ``local_part`` or ``remote_part``, or with a peer whose blocks differ in size
from ours, branches off first to :mod:`aionixl._partial` (parts of blocks).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import numpy as np

from ._agent import DONE, NO_HANDLE, Indices
from ._checks import check_timeout
from ._coalesce import Coalescer, with_room
from ._config import EngineConfig, Tuning
from ._errors import AionixlError, PeerDisconnectedError, TransferTimeoutError
from ._lifecycle import Lifecycle, LocalSide
from ._metrics import TransferMetrics
from ._partial import PartPath
from ._parts import BlockPart
from ._peer import Peer
from ._peers import PeerTable
from ._post import DirectPath, LoopTurns
from ._push import Pusher
from ._regions import (
    IndexArray,
    descriptor_indices,
    has_duplicates,
    paired_ids,
    plain_ids,
    plain_int,
    small_indices,
)
from ._results import Op, TransferResult
from ._wire import user_message

#: Block ids whose descriptor indices are remembered for the one-block path.
_ONE_BLOCK_CACHE = 4096
#: The most descriptors (ids x regions) a call's ids may stand for and still be checked in
#: plain Python and given to NIXL as lists; past that numpy checks them, and NIXL builds the
#: request from an int32 array in about half the time. The crossovers measured (NOTES.md,
#: "Ids as lists or as arrays"): ~64 descriptors for ids given as an array, ~160 as a list.
_LIST_FROM_ARRAY = 64
_LIST_FROM_LIST = 160
_perf = time.perf_counter

#: Reconnects to an address (``Handshakes.connect``), for a peer evicted only to fence a read.
Reconnect = Callable[[str, float], Awaitable[Peer]]


class Transfers:
    """``transfer_blocks`` for one engine; the paths it chooses are components of their own."""

    def __init__(self, local: LocalSide, life: Lifecycle, config: EngineConfig, tuning: Tuning,
                 peers: PeerTable,
                 coalescer: Coalescer, direct: DirectPath, push: Pusher,
                 metrics: TransferMetrics[TransferResult], turns: LoopTurns, reconnect: Reconnect) -> None:
        self._local = local
        self._life = life
        self._config = config
        self._tuning = tuning
        self._peers = peers
        self._coalescer = coalescer
        self._direct = direct
        self._push = push
        self._metrics = metrics
        self._turns = turns
        self._reconnect = reconnect
        self._inline_polls = tuning.inline_polls
        #: The most blocks a call may move and still ride in a merged request.
        self._ride_blocks = tuning.coalesce_max_call_bytes // local.bytes_per_block
        self._coalesce = config.coalesce and self._ride_blocks > 0
        self._num_blocks = local.num_blocks
        self._offset_list = local.offset_list
        #: The most ids an array or a list may hold and still take the plain-Python path.
        self._list_from_array = max(1, _LIST_FROM_ARRAY // len(local.offset_list))
        self._list_from_list = max(1, _LIST_FROM_LIST // len(local.offset_list))
        self._one_block: dict[int, IndexArray] = {}  # block id -> its descriptor indices
        #: Parts of blocks: a component of its own, built here from the same components.
        self._parts = PartPath(local, peers, coalescer, direct, push, metrics, turns)

    async def transfer_blocks(self, peer: Peer, local_blocks: Sequence[int] | IndexArray,
                              remote_blocks: Sequence[int] | IndexArray, op: Op = "read",
                              notify: bytes | None = None, timeout: float | None = None, *,
                              local_part: BlockPart | None = None,
                              remote_part: BlockPart | None = None) -> TransferResult:
        """See :meth:`Engine.transfer_blocks`."""
        turns = self._turns
        if turns.holder is not None:  # a call used up the slice: maybe this task's
            await turns.take_turn()  # before any check: the peer may change meanwhile
        elif turns.cancel_point is not None:  # trio: every call is a cancellation point
            await turns.cancel_point()
        if not self._life.usable:
            self._life.check_open()
        if type(peer) is not Peer or peer.link.owner is not self._peers or not peer.link.connected:
            peer, timeout = await self._revive(peer, timeout)
        if op != "read" and op != "write":
            raise ValueError(f"op must be 'read' or 'write', got {op!r}")
        if local_part is not None or remote_part is not None or peer.link.unequal:
            return await self._parts.transfer(peer, local_blocks, remote_blocks, op, notify, timeout,
                                              local_part, remote_part)
        one = self._one_block_indices(peer, local_blocks, remote_blocks)
        if one is None:  # a tuple, a range, numpy ids...: the lists they stand for, if cheap
            local_blocks, remote_blocks = _as_lists(local_blocks, remote_blocks, self._list_from_array)
            one = self._one_block_indices(peer, local_blocks, remote_blocks)
        coalescer = self._coalescer
        batches = coalescer.gathering.get((peer, op)) if coalescer.gathering else None
        if one is not None and batches is not None and not coalescer.owing \
                and (notify is None or coalescer.may_notify(peer, notify)) \
                and (timeout is None or _plain_limit(timeout)):
            # The commonest call under load: one block, joining a merged request still
            # gathering, waited for in this frame (a coroutine of its own, or two more calls,
            # cost 10-20% of a read at 64 in flight, measured); Coalescer.member does the rest.
            lb, rb = local_blocks[0], remote_blocks[0]
            block, source = (lb, rb) if op == "read" else (rb, lb)
            # The newest request if it has room and no other member writes the block from
            # elsewhere; else another with room, if any.
            newest, most = batches[-1], coalescer.max_blocks
            batch = newest if newest.blocks < most and newest.dests.get(block, source) == source \
                else with_room(batches, (block,), source, 1, most)
            if batch is not None:
                started = coalescer.arrived()
                limit = self._config.transfer_timeout if timeout is None else timeout
                entry = (one[0], one[1], 1, b"" if notify is None else notify, started + limit)
                batch.add(entry, (block,), source)
                try:
                    await coalescer.park(batch.waiters)
                except BaseException as exc:
                    return await coalescer.member(batch, entry, started, limit, interrupted=exc)
                result = coalescer.woke(batch, entry, started)
                return result if result is not None else \
                    await coalescer.member(batch, entry, started, limit, woken=True)
        local_idx: Indices
        remote_idx: Indices
        if one is not None:
            nblocks, (local_idx, remote_idx) = 1, one
        else:
            nblocks, local_idx, remote_idx = self._checked_indices(peer, local_blocks, remote_blocks, op)
        message = b"" if notify is None else user_message(notify, "notify")
        if timeout is not None:
            check_timeout(timeout, "timeout")
        if peer.link.push and op == "read":  # the peer writes the blocks into ours
            return await self._push_read(peer, local_idx, remote_idx, nblocks, message, timeout)
        if coalescer.owing:
            await coalescer.pay_owed_cancel()
            self._peers.still_usable(peer)  # it yielded: the engine may be closing, the peer gone
        started = _perf()
        if self._coalesce and nblocks <= self._ride_blocks and coalescer.together(peer, op, started, message):
            dest, src = (local_blocks, remote_blocks) if op == "read" else (remote_blocks, local_blocks)
            return await coalescer.ride(peer, op, local_idx, remote_idx, nblocks, message, dest, src,
                                        started, timeout)
        # Posted here, not through DirectPath.post (as parts of blocks are): one frame less
        # is ~1.5% of a one-block read in one process (benchmarks/NOTES.md, "The lone
        # one-block read").
        agent = self._local.agent
        assert agent is not None
        try:
            handle, status = agent.start_xfer(op, self._local.dlist, local_idx, peer.link.dlist,
                                              remote_idx, message, self._inline_polls)
        except AionixlError as exc:
            self._direct.post_failed(exc, peer, op, nblocks, started)
        if status is not DONE or handle != NO_HANDLE:
            return await self._direct.wait(peer, op, (handle, status, agent.posted, agent.telemetry),
                                           local_idx, remote_idx, nblocks, timeout, started)
        # Finished inside the post (the commonest call in one process): its result is made
        # here, as one more coroutine frame costs ~4% of a one-block read (measured). A
        # caller looping on such transfers yields as its next call starts (LoopTurns).
        seen = _perf()
        self._turns.finished_inline(seen)
        if nblocks == 1 and agent.telemetry is None:  # the commonest result, with less to record
            return self._metrics.done_one(op, started, agent.posted, seen, seen)
        return self._metrics.done(op, nblocks, started, agent.posted, seen, seen, agent.telemetry)

    async def _revive(self, peer: object, timeout: float | None) -> tuple[Peer, float | None]:
        """A peer not usable as it is: one evicted only to fence a cancelled read reconnects,
        and the call goes on with the peer that came back (the same object, or the one the
        peer's own connect to us admitted meanwhile) and with what the reconnect left of its
        deadline, if it is the same process; any other raises the error its caller should
        see."""
        if type(peer) is Peer and peer.link.owner is self._peers and peer.link.revive and peer.address:
            if timeout is not None:
                check_timeout(timeout, "timeout")
            limit = self._config.transfer_timeout if timeout is None else timeout
            started = _perf()
            revived = await self._reconnect(peer.address, min(limit, 30.0))
            left = limit - (_perf() - started)
            if left <= 0:
                raise TransferTimeoutError(f"reconnecting to peer {peer.name!r} took the whole "
                                           f"{limit} s deadline; nothing was transferred")
            if revived.name != peer.name or revived.link.incarnation != peer.link.incarnation:
                peer.link.revive = False  # its process is gone: later calls fail at once
                what = "another process of that engine (it restarted)" if revived.name == peer.name \
                    else repr(revived.name)
                raise PeerDisconnectedError(f"peer {peer.name!r} was evicted, and the engine now at "
                                            f"{peer.address} is {what}; connect() to it again")
            # Never the old object unless it was revived: its descriptor lists are released.
            return self._peers.live(revived), left
        return self._peers.live(peer), timeout

    def _one_block_indices(self, peer: Peer, local_blocks: object,
                           remote_blocks: object) -> tuple[IndexArray, IndexArray] | None:
        """Descriptor indices of a valid one-block call (plain int ids), from the memo; None
        for any other call."""
        if type(local_blocks) is not list or type(remote_blocks) is not list \
                or len(local_blocks) != 1 or len(remote_blocks) != 1:
            return None
        lb, rb = local_blocks[0], remote_blocks[0]
        if type(lb) is not int or type(rb) is not int:
            return None
        local_idx = self._one_block.get(lb)
        if local_idx is None:  # not seen lately (a cache larger than the memo)
            local_idx = _remember(self._one_block, lb, self._num_blocks, self._local.offsets)
        remote_idx = peer.link.one_block.get(rb)
        if remote_idx is None:
            remote_idx = _remember(peer.link.one_block, rb, peer.num_blocks, peer.link.offsets)
        if local_idx is None or remote_idx is None:
            return None  # an id out of range: the general check says which
        return local_idx, remote_idx

    def _checked_indices(self, peer: Peer, local_blocks: object, remote_blocks: object,
                         op: Op) -> tuple[int, Indices, Indices]:
        """Validate ids with clear errors; plain-Python indices for short lists, numpy
        ones otherwise."""
        if type(local_blocks) is list and type(remote_blocks) is list \
                and len(local_blocks) <= self._list_from_list:
            local_idx = small_indices(local_blocks, self._num_blocks, self._offset_list)
            remote_idx = small_indices(remote_blocks, peer.num_blocks, peer.link.offset_list)
            if local_idx is not None and remote_idx is not None \
                    and len(local_blocks) == len(remote_blocks) \
                    and not has_duplicates(local_blocks if op == "read" else remote_blocks):
                return len(local_blocks), local_idx, remote_idx
        local_ids, remote_ids = paired_ids(local_blocks, remote_blocks, self._num_blocks,
                                           peer.num_blocks, op)
        return (int(local_ids.size), descriptor_indices(self._local.offsets, local_ids),
                descriptor_indices(peer.link.offsets, remote_ids))

    async def _push_read(self, peer: Peer, local_idx: Indices, remote_idx: Indices, nblocks: int,
                         message: bytes, timeout: float | None) -> TransferResult:
        self._push.check_notify(message)
        t0 = _perf()
        try:
            await self._push.read(peer, local_idx, remote_idx, nblocks, message, timeout)
        except BaseException as exc:
            self._metrics.failed(exc, peer, "read", nblocks, t0)
            raise
        end = _perf()
        return self._metrics.done("read", nblocks, t0, t0, end, end, None)


def _plain_limit(timeout: object) -> bool:
    """A timeout the joining path takes as it is (a finite positive number of seconds)."""
    return (type(timeout) is float or type(timeout) is int) and 0 < timeout < math.inf


def _as_lists(local_blocks: Any, remote_blocks: Any, most: int) -> tuple[Any, Any]:
    """Ids as the plain lists they stand for where that is cheap (a tuple, a range or an
    integer array of at most ``most`` ids, a one-block list of numpy integers), so that they
    take the list paths; anything else unchanged (the general check takes it)."""
    if type(local_blocks) is list and type(remote_blocks) is list:
        if len(local_blocks) == 1 == len(remote_blocks):
            return [plain_int(local_blocks[0])], [plain_int(remote_blocks[0])]
        return local_blocks, remote_blocks
    mine, theirs = plain_ids(local_blocks, most), plain_ids(remote_blocks, most)
    if type(mine) is list and type(theirs) is list:
        return _as_lists(mine, theirs, most)
    return local_blocks, remote_blocks


def _remember(cache: dict[int, IndexArray], block: int, num_blocks: int,
              offsets: IndexArray) -> IndexArray | None:
    """A valid block id's descriptor indices, remembered (the last _ONE_BLOCK_CACHE ids);
    None for an invalid one. An int32 array, read-only as it is shared: NIXL builds a
    request from one faster than from a list (NOTES.md, "The one-block memo's arrays")."""
    if not 0 <= block < num_blocks:
        return None
    if len(cache) >= _ONE_BLOCK_CACHE:
        cache.clear()
    indices = cache[block] = descriptor_indices(offsets, np.array([block], np.int32))
    indices.flags.writeable = False
    return indices

