"""Transfers of block parts: ``transfer_blocks(..., local_part=, remote_part=)``.

A component of its own, reached from ``Transfers.transfer_blocks`` by one early branch
taken only when a part is given or the peer's blocks differ in size from ours (then whole
blocks cannot move, and the plan says why). The whole-block paths are untouched by it.

The call checks everything before anything is sent: the ids (as for whole blocks), then
the parts against both geometries (:func:`aionixl._parts.plan_parts`: a size that does not
divide, selections of different sizes, named by region and sizes). It moves the data on
the paths whole blocks use, with their deadlines, cancellation and fences:

- **GET or WRITE**: posted alone by :class:`aionixl._post.DirectPath` on descriptor lists
  at part granularity (prepared once per peer and pair of parts by the peer table, and
  released with the peer), so an aborted read is fenced on those lists. Part transfers do
  not ride in merged requests; concurrent ones simply post side by side.
- **push** (peers read by push, :mod:`aionixl._push`): the request carries both parts; the
  serving engine plans the same split from its side and writes the parts.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from ._agent import DONE, NO_HANDLE, Indices
from ._checks import check_timeout
from ._coalesce import Coalescer
from ._errors import TransferError
from ._lifecycle import LocalSide
from ._metrics import TransferMetrics
from ._parts import BlockPart, PartPlan, plan_parts
from ._peer import Peer
from ._peers import PeerTable
from ._post import DirectPath, LoopTurns
from ._push import Pusher
from ._regions import IndexArray, paired_ids, small_pair
from ._results import Op, TransferResult
from ._wire import PARTS_FEATURE, user_message

_perf = time.perf_counter


class PartPath:
    """Moves parts of blocks for one engine (see the module docstring)."""

    def __init__(self, local: LocalSide, peers: PeerTable, coalescer: Coalescer, direct: DirectPath,
                 push: Pusher, metrics: TransferMetrics[TransferResult], turns: LoopTurns) -> None:
        self._local = local
        self._peers = peers
        self._coalescer = coalescer
        self._direct = direct
        self._push = push
        self._metrics = metrics
        self._turns = turns

    async def transfer(self, peer: Peer, local_blocks: Sequence[int] | IndexArray,
                       remote_blocks: Sequence[int] | IndexArray, op: Op, notify: bytes | None,
                       timeout: float | None, local_part: BlockPart | None,
                       remote_part: BlockPart | None) -> TransferResult:
        """``transfer_blocks`` with parts (the engine and the peer are checked already)."""
        _check_part(local_part, "local_part")
        _check_part(remote_part, "remote_part")
        local_ids: Indices
        remote_ids: Indices
        small = small_pair(local_blocks, remote_blocks, self._local.num_blocks, peer.num_blocks, op)
        if small is not None:  # short lists of valid plain ints, checked without numpy
            local_ids, remote_ids = small
            nblocks = len(local_ids)
        else:  # anything else: checked (and explained) as given
            local_ids, remote_ids = paired_ids(local_blocks, remote_blocks, self._local.num_blocks,
                                               peer.num_blocks, op)
            nblocks = int(local_ids.size)
        message = b"" if notify is None else user_message(notify, "notify")
        if timeout is not None:
            check_timeout(timeout, "timeout")
        if peer.link.push and op == "read":  # the peer writes the parts into ours
            plan = plan_parts([r.block_bytes for r in self._local.regions], local_part,
                              list(peer.bytes_per_block), remote_part)
            if PARTS_FEATURE not in peer.features:
                raise TransferError(f"peer {peer.name!r} reads by push but its engine does not "
                                    "push parts of blocks (an older aionixl)")
            return await self._push_read(peer, local_ids, remote_ids, nblocks, message, timeout,
                                         local_part, remote_part, plan)
        if self._coalescer.owing:
            await self._coalescer.pay_owed_cancel()
            self._peers.still_usable(peer)  # it yielded: the engine may be closing, the peer gone
        parts = self._peers.part_lists(peer, local_part, remote_part)  # checks them first
        local_idx, remote_idx = parts.indices(local_ids, remote_ids)
        started = _perf()
        posted = self._direct.post(peer, op, local_idx, remote_idx, nblocks, message, started, parts)
        if posted[1] is not DONE or posted[0] != NO_HANDLE:
            return await self._direct.wait(peer, op, posted, local_idx, remote_idx, nblocks, timeout,
                                           started, parts)
        seen = _perf()  # finished inside the post: its caller yields as its next call starts
        self._turns.finished_inline(seen)
        return self._metrics.done_part(op, nblocks, nblocks * parts.nbytes, nblocks * parts.per_block,
                                       started, posted[2], seen, seen, posted[3])

    async def _push_read(self, peer: Peer, local_ids: Indices, remote_ids: Indices, nblocks: int,
                         message: bytes, timeout: float | None, local_part: BlockPart | None,
                         remote_part: BlockPart | None, plan: PartPlan) -> TransferResult:
        self._push.check_notify(message)
        started = _perf()
        try:
            await self._push.read(peer, local_ids, remote_ids, nblocks, message, timeout,
                                  (local_part, remote_part))
        except BaseException as exc:
            self._metrics.failed(exc, peer, "read", nblocks, started)
            raise
        end = _perf()
        return self._metrics.done_part("read", nblocks, nblocks * plan.nbytes, nblocks * plan.per_block,
                                       started, started, end, end, None)


def _check_part(part: object, what: str) -> None:
    if part is not None and type(part) is not BlockPart:
        raise ValueError(f"{what} must be an aionixl.BlockPart or None, got {type(part).__name__}")
