"""Transfers: posting NIXL requests, the in-flight table, the poller, fairness.

A ``transfer_blocks`` call validates its ids, posts one NIXL request and polls it a few
times inline. A request still in flight after that goes into the in-flight table, and
the caller sleeps on its record's event; the poller task checks every record once per
loop turn and sets the event of each one that finished. Whatever happens to the caller
(done, timeout, cancelled, peer lost, engine closed), the handle is released exactly
once, by whoever takes its record out of the table; a handle NIXL will not release yet
is parked and retried by the poller. Close releases the rest (:meth:`Transfers.close`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal, NamedTuple

import anyio
import anyio.lowlevel

from ._config import EngineConfig
from ._errors import AionixlError, PeerDisconnectedError, TransferError, TransferTimeoutError
from ._nixl import DONE, ERR, NO_HANDLE, PROC, Agent, Indices, Status
from ._peers import Peer, PeerTable, progress_quietly, user_message
from ._regions import (
    IndexArray,
    Region,
    block_ids,
    check_distinct,
    descriptor_indices,
    has_duplicates,
    region_offsets,
    small_indices,
)
from ._util import OPEN, check_timeout, deadline

if TYPE_CHECKING:
    from ._engine import Engine
    from ._push import Pusher

Op = Literal["read", "write"]


class TransferResult(NamedTuple):
    """What one ``transfer_blocks`` call moved."""

    blocks: int
    nbytes: int
    seconds: float


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


#: How long transfer_blocks may finish transfers inline before it yields to the loop: long
#: while the loop has nothing else to run, short once a yield shows others were waiting
#: (a yield that takes longer than _CROWDED).
_SLICE_LONG = 0.002
_SLICE_SHORT = 0.0001
_CROWDED = 0.0002

_ONE_BLOCK_CACHE = 4096
#: Builds a TransferResult without NamedTuple.__new__'s argument handling (half its cost).
_new_tuple = tuple.__new__


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
            self._peers.live(peer)  # raises the right error
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
        message = b"" if notify is None else user_message(notify, "notify")
        if timeout is not None:
            check_timeout(timeout, "timeout")
        if peer._push and op == "read":  # the peer writes the blocks into ours (_push.py)
            assert self.push is not None and local_idx is not None and remote_idx is not None
            return await self.push.read(peer, local_idx, remote_idx, nblocks, message, timeout)
        agent = self.agent
        assert agent is not None and local_idx is not None and remote_idx is not None
        started = time.perf_counter()
        try:
            handle, status = agent.start_xfer(op, self.local_dlist, local_idx, peer._dlist,
                                              remote_idx, message, self._inline_polls)
        except PeerDisconnectedError as exc:
            raise self._peers.evict(peer, exc) from exc
        if status is not DONE or handle != NO_HANDLE:
            limit = self._config.transfer_timeout if timeout is None else timeout
            try:
                await self._finish(peer, handle, status, limit)
            except BaseException:
                if op == "read" and peer._connected and self.push is not None:
                    # No late bytes: an aborted GET may still be writing (_push.fence_get).
                    await self.push.fence_get(peer, local_idx, remote_idx)
                raise
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

    # ---- waiting ------------------------------------------------------------------------

    async def _finish(self, peer: Peer, handle: int, status: Status, limit: float) -> None:
        """Wait for a posted transfer through the poller; always release its handle."""
        agent = self.agent
        assert agent is not None
        rec: _InFlight | None = None
        try:
            if status == PROC:
                rec = _InFlight(peer)
                self.inflight[handle] = rec
                self._poller_wakeup.set()
                status = await self._wait(rec, limit)
                if self.wake_trace is not None:
                    self.wake_trace.append(time.perf_counter_ns() - rec.finished_ns)
            if status != DONE:
                raise self._peers.evict(peer, TransferError("NIXL reported the transfer failed (ERR)"))
        finally:
            # Whoever took the record out of the table (eviction, close) released the handle,
            # and NIXL may since have given the same value to another transfer: release only
            # what is still ours.
            owned = rec is None or self.inflight.get(handle) is rec
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
                rec.finish(ERR, error)
                self._release(agent, handle)

    def busy_with(self, peer: Peer) -> bool:
        return any(rec.peer is peer for rec in self.inflight.values())

    # ---- the poller task ----------------------------------------------------------------

    async def poll(self) -> None:
        """Check every transfer in flight once per loop turn; sleep while there are none."""
        agent = self.agent
        assert agent is not None
        engine = self._engine
        while True:
            if not self.inflight and not self.parked:
                self._poller_wakeup = anyio.Event()
                await self._poller_wakeup.wait()
                engine._wake_drainer()
                continue
            for handle, rec in list(self.inflight.items()):
                if rec.event.is_set():
                    continue
                try:
                    status = agent.check(handle)
                except PeerDisconnectedError as exc:
                    self._peers.evict(rec.peer, exc)  # fails every transfer to that peer
                    continue
                except TransferError as exc:
                    rec.finish(ERR, exc)  # this transfer failed; the peer may be fine
                    continue
                if status == ERR:
                    self._peers.evict(rec.peer, TransferError("NIXL reported the transfer failed (ERR)"))
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
            rec.finish(ERR, error)
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


def _remember(cache: dict[int, list[int]], block: int, indices: list[int]) -> None:
    """Keep a validated block's descriptor indices for the one-block fast path (bounded)."""
    if len(cache) >= _ONE_BLOCK_CACHE:
        cache.clear()
    cache[block] = indices
