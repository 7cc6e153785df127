"""Peer-driven ("push") reads, the read-mode choice, and the fence after an aborted read.

Why: over UCX TCP a one-sided GET is emulated, and the *target* sends the data back from
inside UCX; when the reader dies or disconnects mid-read, that reply path aborts the
serving process (SIGABRT in UCX 1.23). A PUT has no such path: its initiator handles a
dead target as an ordinary error, and its target survives a dying writer. So where GET is
not native, a read becomes a request that the serving engine answers with WRITEs.

The exchange, all over reserved NIXL notifications (their formats are in
:mod:`aionixl._wire`; never delivered to callers):

- reader → server ``PUSH`` + request (id, destination and source block ids, deadline,
  the caller's ``notify``; for parts of blocks both parts, sent only to a server that
  announces ``PARTS_FEATURE``). The server accepts it only from an admitted peer,
  validates every id (and plans parts against both geometries itself, with part lists
  from the peer table's cache, as a reader's are), bounds the requests one peer may have
  open, and writes the blocks into the reader's memory (its staging slots when the request
  says ``staged``: :mod:`aionixl._staging`) in chunks of ``push_chunk_bytes``,
  one NIXL WRITE at a time, each tracked in the engine's in-flight table (so close,
  eviction and drops release it like any transfer) under the push's deadline.
- The last chunk carries ``PDONE`` + id. NIXL sends a transfer's notification only once
  the transfer completed, which includes a UCX flush of the endpoint, so the data of this
  and every earlier chunk is in the reader's memory when the reader sees it. The caller's
  ``notify`` is delivered into the *server's* own mailbox at that same moment (the write
  is DONE: remote completion), so it reaches the server after the data landed without a
  further hop, and also when the reader dies right after.
- ``PERR`` + (id, reason): the server refused or gave up, with none of that request's
  writes outstanding.
- ``PLOST`` + (id, reason): the read failed with a chunk that ended without completing
  (NIXL reported it failed, or its handle was released while it moved: the reader was
  dropped, or it was stuck past ``STUCK_CHUNK_WAIT``). UCX may still deliver that chunk's
  bytes, so the reader fails the read and keeps what it was landing in out of use. The
  server remembers such reads (:class:`LostReads`) and answers a later ``PCANCEL`` for
  one with ``PLOST`` again, never ``PGONE``.

``PUSH`` and ``PCANCEL`` carry the reader's incarnation (a digest of its NIXL metadata:
:func:`aionixl._wire.incarnation`). NIXL names a notification's sender by name only, and a
reader killed while its link was cut can have a request delivered after a new process of
its name was admitted: the server ignores a request or cancel from another incarnation
than the one it knows by that name, which would otherwise write into, or free, the new
process's staging slots.
- reader → server ``PCANCEL`` + id, when the caller timed out or was cancelled. The server
  stops before the next chunk, waits for the chunk under way (UCX cannot abort a PUT, and
  NIXL's release does not either), then answers ``PGONE`` + id: nothing more of it will
  land. A reader that hears none of ``PGONE``, ``PDONE``, ``PERR`` or ``PLOST`` within
  ``push_cancel_timeout`` evicts the peer (``remove_remote_agent``). That does not stop a
  chunk already under way over UCX tcp: UCX keeps the socket it arrives on open for
  receiving, so against a server stopped or cut off mid-chunk the rest of that one chunk can
  land once it runs or is reachable again. Hence staging: it lands in slots the reader
  keeps out of use until the server's late ``PGONE`` (sent once a stuck chunk ended) says
  nothing more will (docs/read-modes.md).

Where a one-sided GET is native the engine reads with it instead; the choice is
:func:`aionixl._hostfacts.choose_read_mode`, the GET fence is in :mod:`aionixl._post`.
"""

from __future__ import annotations

import enum
import itertools
import logging
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable

import anyio
import anyio.abc
import numpy as np

from ._agent import DONE, NO_HANDLE, PROC, Indices
from ._config import EngineConfig, Tuning
from ._errors import (
    AionixlError,
    PeerDisconnectedError,
    TransferError,
    TransferTimeoutError,
)
from ._inflight import InFlight, InFlightTable
from ._lifecycle import Lifecycle, LocalSide
from ._notifications import Notification
from ._parts import BlockPart, PartLists
from ._peer import Peer
from ._peers import PeerTable
from ._ratelimit import RateLimitedLog, Refusals
from ._regions import IndexArray, descriptor_indices
from ._results import TransferResult
from ._staging import Ids, Staging
from ._wire import (
    MAX_PUSH_NOTIFY,
    PCANCEL,
    PDONE,
    PERR,
    PGONE,
    PLOST,
    PUSH,
    PUSH_FAMILY,
    RESERVED,
    STAGED_FEATURE,
    PushRequest,
    WireError,
    decode_push_error,
    decode_push_request,
    incarnation,
    push_error,
    push_request,
    rid_bytes,
    rid_payload,
)

log = logging.getLogger("aionixl")


def _part(wire: tuple[int, int, int] | None) -> BlockPart | None:
    """A part as a push request carries it (``ValueError`` for a bad one)."""
    return None if wire is None else BlockPart(*wire)


# ---- the component ----------------------------------------------------------------------

class ReadState(enum.Enum):
    """Where a push read this engine asked for stands. It starts ``OPEN`` and moves once
    (``_Read.settle``) to how the server said it ended: ``DONE`` (PDONE: every byte landed),
    ``GONE`` (PGONE: stopped, nothing of it moving), or ``FAILED`` (PERR: refused or given up
    with nothing outstanding; PLOST: bytes of it may still land; or its peer was dropped).
    A close that cannot tell a server finds it ``GONE`` when its connection is gone."""

    OPEN = "open"
    DONE = "done"
    GONE = "gone"
    FAILED = "failed"



#: How long a push chunk still moving after its read's deadline is waited for, so that
#: its end can be confirmed to the reader (which reuses its staging slots then).
STUCK_CHUNK_WAIT = 60.0



class _Lost:
    __slots__ = ("ids", "order", "below")

    def __init__(self) -> None:
        self.ids: set[int] = set()
        self.order: deque[int] = deque()
        self.below = 0  # every id up to this one counts as lost


class LostReads:
    """The reads a server lost (a chunk of theirs may still land), by reader name and
    incarnation, so that a later cancel of one is never answered "gone".

    Past ``per_reader`` ids a reader's oldest are folded into a watermark (every id at or
    below it then counts as lost; a reader's ids only grow). :meth:`keep_only` drops the
    entries of a name's other processes (their cancels are ignored once another process
    of that name is admitted). Past ``readers`` entries, the one lost from longest ago is
    dropped; a cancel of one of its reads would then be answered "gone" (it takes that
    many readers losing reads since).
    """

    def __init__(self, per_reader: int = 4096, readers: int = 256) -> None:
        self._per_reader = per_reader
        self._max_readers = readers
        self._readers: OrderedDict[tuple[str, bytes], _Lost] = OrderedDict()

    def add(self, name: str, reader: bytes, rid: int) -> None:
        key = (name, reader)
        lost = self._readers.get(key)
        if lost is None:
            lost = self._readers[key] = _Lost()
            if len(self._readers) > self._max_readers:
                self._readers.popitem(last=False)
        else:
            self._readers.move_to_end(key)
        if rid in lost.ids or rid <= lost.below:
            return
        lost.ids.add(rid)
        lost.order.append(rid)
        if len(lost.order) > self._per_reader:
            oldest = lost.order.popleft()
            lost.ids.discard(oldest)
            lost.below = max(lost.below, oldest)

    def holds(self, name: str, reader: bytes, rid: int) -> bool:
        lost = self._readers.get((name, reader))
        return lost is not None and (rid in lost.ids or rid <= lost.below)

    def keep_only(self, name: str, reader: bytes) -> None:
        """``reader`` is the process admitted under ``name`` now: forget the others'."""
        for key in [k for k in self._readers if k[0] == name and k[1] != reader]:
            del self._readers[key]


class _Read:
    """One push read this engine asked for, until the server says nothing more will land."""

    __slots__ = ("peer", "server", "rid", "staged", "sent", "state", "confirmed", "error", "event")

    def __init__(self, peer: Peer, rid: int, staged: bool = False) -> None:
        self.peer = peer
        #: The server's process when asked (a revived Peer object may be its successor's).
        self.server = peer.link.incarnation
        self.rid = rid
        self.staged = staged  # into our staging slots, not our blocks
        self.sent = False  # the request left: the server may write
        self.state = ReadState.OPEN
        #: The server said nothing more of it will land (PDONE, PGONE or PERR).
        self.confirmed = False
        self.error: AionixlError | None = None
        self.event = anyio.Event()

    def settle(self, state: ReadState, error: AionixlError | None = None) -> None:
        if self.state == ReadState.OPEN:
            self.state = state
            if error is not None and self.error is None:
                self.error = error
        self.event.set()


class _Job:
    """One push this engine serves: the chunks still to write into a peer's blocks."""

    __slots__ = ("peer", "reader", "rid", "chunks", "parts", "dlist", "deadline", "notify", "cancelled",
                 "wake")

    def __init__(self, peer: Peer, rid: int, chunks: list[tuple[IndexArray, IndexArray]],
                 parts: PartLists | None, dlist: int, deadline: float, notify: bytes) -> None:
        self.peer = peer
        #: The reader's incarnation: a revived Peer object may be another process's.
        self.reader = peer.link.incarnation
        self.rid = rid
        self.chunks = chunks
        self.parts = parts  # the lists the chunks index, for parts of blocks; else whole blocks
        self.dlist = dlist  # for whole blocks: the reader's blocks, or its staging slots
        self.deadline = deadline
        self.notify = notify
        self.cancelled = False
        self.wake = anyio.Event()


class Pusher:
    """Both sides of push reads for one engine; see the module docstring."""

    def __init__(self, local: LocalSide, life: Lifecycle, config: EngineConfig, tuning: Tuning,
                 peers: PeerTable,
                 table: InFlightTable, deliver: Callable[[Notification], None], noisy: RateLimitedLog,
                 refusals: Refusals,
                 wake_drainer: Callable[[], None]) -> None:
        self._local = local
        self._life = life
        self._config = config
        self._tuning = tuning
        self._peers = peers
        self._table = table
        self._deliver = deliver  # an incoming notification, to a lease or the mailbox
        self._noisy = noisy
        self._refusals = refusals
        self._wake_drainer = wake_drainer
        self._ids = itertools.count(1)
        self.reads: dict[int, _Read] = {}  # ours, by request id
        self.jobs: dict[tuple[str, int], _Job] = {}  # served, by (peer name, request id)
        #: Served reads whose bytes may still land.
        self._lost = LostReads()
        self._own = b""  # our incarnation, once the agent is up
        self._per_peer: dict[str, int] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._closing = False
        self.served = 0  # pushes completed for peers (stats)
        self.refused = 0  # push requests refused (stats)
        self.lost = 0  # pushes that ended with a chunk whose bytes may still land (stats)
        self.exhausted = 0  # push reads refused: every staging slot was stranded

    @property
    def active(self) -> bool:
        """Whether the drainer should poll every loop turn for us."""
        return bool(self.reads or self.jobs)

    def busy_with(self, peer: Peer) -> bool:
        return any(r.peer is peer for r in self.reads.values()) or \
            any(j.peer is peer for j in self.jobs.values())

    async def run(self) -> None:
        """Holds the task group that serves pushes; runs until the engine stops."""
        async with anyio.create_task_group() as tg:
            self._tg = tg
            try:
                await anyio.sleep_forever()
            finally:
                self._tg = None

    # ---- the reader's side --------------------------------------------------------------

    async def read(self, peer: Peer, local_idx: Indices, remote_idx: Indices, nblocks: int,
                   notify: bytes, timeout: float | None,
                   parts: tuple[BlockPart | None, BlockPart | None] | None = None) -> TransferResult:
        """Ask ``peer`` to write its blocks into ours; return once they landed. ``parts``
        (our part, the peer's part) asks for parts of blocks; the peer must announce
        ``PARTS_FEATURE`` (the caller checks).

        With staging slots (``aionixl._staging``) and a peer that writes into them, the
        blocks land there first, in rounds of at most half the usable slots, and are copied
        into ours as each round completes."""
        limit = self._config.transfer_timeout if timeout is None else timeout
        started = time.perf_counter()
        end = anyio.current_time() + limit
        # Region 0 comes first in region-major descriptor indices: its entries are the ids.
        dst = np.asarray(local_idx[:nblocks], dtype=np.int64)
        src = np.asarray(remote_idx[:nblocks], dtype=np.int64)
        dst_part, src_part = (None, None) if parts is None else parts
        staging = self._local.staging if STAGED_FEATURE in peer.features else None
        done = 0
        while done < nblocks:
            self._peers.still_usable(peer)  # between rounds the engine may close, the peer go
            if staging is None:  # the rest in one round
                rec = _Read(peer, next(self._ids))
                await self._round(rec, dst[done:], src[done:], notify, end, limit, dst_part, src_part)
                break
            n, slots = await self._slots(staging, peer, nblocks - done, end, limit)
            rec = _Read(peer, next(self._ids), staged=True)
            try:
                await self._round(rec, slots, src[done:done + n], notify if done + n == nblocks else b"",
                                  end, limit, dst_part, src_part)
                staging.copy_out(slots, dst[done:done + n], dst_part)
            finally:
                # Free again unless the server may still write into them: it was asked and
                # has not said it ended.
                staging.settle(slots, rec.confirmed or not rec.sent, peer.name, rec.rid, rec.server)
            done += n
        nbytes = nblocks * self._local.bytes_per_block
        return TransferResult(nblocks, nbytes, time.perf_counter() - started)

    @staticmethod
    def check_notify(notify: bytes) -> None:
        """Before a push read is counted as a transfer: ``ValueError`` for a ``notify``
        longer than a server takes (``MAX_PUSH_NOTIFY``)."""
        if len(notify) > MAX_PUSH_NOTIFY:
            raise ValueError(f"notify of {len(notify)} bytes is too long for a push read (at most "
                             f"{MAX_PUSH_NOTIFY}; Peer.read_mode is 'push')")

    async def _slots(self, staging: Staging, peer: Peer, wanted: int, end: float,
                     limit: float) -> tuple[int, Ids]:
        """Staging slots for the next round, by ``end``: at most half of those usable, so
        that one round stuck at a stopped server never strands them all, and no more than
        the server may still strand (``Staging.room_for``): a server at its share waits for
        its own late confirmations, and is refused at ``end``."""
        while True:
            staging.expire(self._gone)
            if not staging.usable:
                raise self._no_slots(staging, peer, f"all {staging.slots} are stranded")
            room = staging.room_for(peer.name)
            n = min(wanted, max(1, staging.usable // 2), room)
            slots = None
            with anyio.move_on_after(max(0.0, end - anyio.current_time())):
                if n:
                    slots = await staging.acquire(n)
                else:
                    await staging.changed()  # the server's late word gives it room again
            if slots is not None:
                return n, slots
            if anyio.current_time() >= end:
                if not n:
                    raise self._no_slots(staging, peer, f"it stranded its share, {staging.server_share} "
                                                        f"of the {staging.slots}")
                raise self._timed_out(peer, limit)
            self._peers.still_usable(peer)  # closing; else slots were stranded meanwhile: fewer a round

    def _gone(self, server: str) -> bool:
        """Whether ``server`` is no longer a connected peer (``Staging.expire``)."""
        peer = self._peers.by_name.get(server)
        return peer is None or not peer.connected

    def _no_slots(self, staging: Staging, peer: Peer, why: str) -> TransferError:
        self.exhausted += 1
        return TransferError(
            f"no staging slot is usable for a push read from {peer.name!r}: {why}, waiting for "
            "their servers to confirm reads that ended without their word "
            "(metrics().staging_stranded); they come back as the servers confirm, restart, or "
            "Tuning.stranded_slot_ttl after they left")

    def _incarnation(self) -> bytes:
        """Ours, as our requests and cancels carry it."""
        if not self._own:
            self._own = incarnation(self._local.metadata)
        return self._own

    def _cancel_message(self, rid: int) -> bytes:
        return PCANCEL + rid_bytes(rid) + self._incarnation()

    @staticmethod
    def _timed_out(peer: Peer, limit: float) -> TransferTimeoutError:
        return TransferTimeoutError(f"transfer to {peer.name!r} did not finish within {limit} s; "
                                    "it was aborted")

    async def _round(self, rec: _Read, dst: Ids, src: Ids, notify: bytes, end: float,
                     limit: float, dst_part: BlockPart | None, src_part: BlockPart | None) -> None:
        """One push request: ``dst`` are our block ids, or staging slot ids when ``rec``
        reads into staging (``rec.staged``); returns once it all landed, by ``end``."""
        peer, rid = rec.peer, rec.rid
        # After the wait for slots: the peer may have gone meanwhile, and a request sent by
        # name would reach whatever process now has that name.
        self._peers.still_usable(peer)
        agent = self._local.agent
        assert agent is not None  # (an engine that closes is no longer usable: still_usable)
        left = end - anyio.current_time()
        if left <= 0:
            raise self._timed_out(peer, limit)
        request = push_request(PushRequest(rid, dst.astype("<i4").tobytes(), src.astype("<i4").tobytes(),
                                           float(left), notify,
                                           None if dst_part is None else dst_part.as_tuple(),
                                           None if src_part is None else src_part.as_tuple(),
                                           rec.staged, self._incarnation()))
        self.reads[rid] = rec
        try:
            agent.send_notif(peer.name, request)
            rec.sent = True
        except PeerDisconnectedError as exc:
            del self.reads[rid]
            raise self._peers.evict(peer, exc) from exc
        except BaseException:
            del self.reads[rid]
            raise
        self._wake_drainer()
        try:
            with anyio.fail_after(left if math.isfinite(left) else None):
                await rec.event.wait()
        except BaseException as exc:
            if rec.state == ReadState.OPEN and not self._closing:
                with anyio.CancelScope(shield=True):
                    await self._fence(rec)
            await self._until_nothing_lands(rec)
            if not isinstance(exc, TimeoutError):
                raise
            if rec.state != ReadState.DONE:  # (data that landed just as time ran out still counts)
                raise self._timed_out(peer, limit) from None
        finally:
            if not self._closing:  # a closing engine fences what is left in close()
                self.reads.pop(rid, None)
        if rec.state != ReadState.DONE:
            await self._until_nothing_lands(rec)
            error = rec.error or TransferError(f"push read from {peer.name!r} ended without data")
            raise type(error)(str(error)) from error.__cause__

    async def _until_nothing_lands(self, rec: _Read) -> None:
        """A read into our blocks that its server has not confirmed stopped, in a closing
        engine: its bytes may land until the close drops the peer, so wait for that (a
        read into staging slots lands nothing of the caller's)."""
        if self._closing and not rec.confirmed and not rec.staged:
            await self._life.until_closed(self._config.close_timeout)

    async def _fence(self, rec: _Read) -> None:
        """The caller left early: make sure no more of this read lands, or evict the peer."""
        peer = rec.peer
        if not peer.connected:
            return  # dropped: its connection is closed
        agent = self._local.agent
        assert agent is not None
        try:
            agent.send_notif(peer.name, self._cancel_message(rec.rid))
        except AionixlError as exc:
            self._peers.evict(peer, exc)
            return
        self._wake_drainer()
        limit = self._tuning.push_cancel_timeout
        try:
            with anyio.move_on_after(limit):
                while rec.state == ReadState.OPEN and not self._closing:
                    await rec.event.wait()
                    if rec.state == ReadState.OPEN:
                        rec.event = anyio.Event()
        except BaseException:
            # A cancellation the shield does not hold back (asyncio's own Task.cancel())
            # cut the wait short: unconfirmed, like one that timed out.
            if rec.state == ReadState.OPEN and peer.connected and not self._closing:
                self._peers.evict_unfenced(peer, "a cancelled read's wait for the server to confirm "
                                                 "it stopped was cancelled")
            raise
        if rec.state == ReadState.OPEN and peer.connected and not self._closing:
            self._peers.evict_unfenced(peer, f"a cancelled read was not confirmed stopped within {limit} s")

    async def stop_peer(self, peer: Peer) -> None:
        """Before disconnecting: cancel our reads from ``peer`` and stop serving it (bounded)."""
        ours = [r for r in self.reads.values() if r.peer is peer and r.state == ReadState.OPEN]
        for rec in ours:  # what their callers get once the server confirmed
            rec.error = PeerDisconnectedError(f"peer {peer.name!r} was disconnected")
        served = [j for j in self.jobs.values() if j.peer is peer]
        for job in served:
            job.cancelled = True
        with anyio.CancelScope(shield=True):
            if ours:
                async with anyio.create_task_group() as tg:
                    for rec in ours:
                        tg.start_soon(self._fence, rec)
            with anyio.move_on_after(self._tuning.push_cancel_timeout):
                while any(j.peer is peer for j in self.jobs.values()):
                    await anyio.sleep(0.001)

    # ---- the server's side --------------------------------------------------------------

    def heard(self, name: str, message: bytes) -> bool:
        """A reserved notification: True if it was one of ours (and has been handled).
        ``WireError`` for a malformed one (the drainer counts it), checked before any work."""
        if not message.startswith(PUSH_FAMILY):
            return False
        if message.startswith(PDONE):
            self._settle(name, rid_payload(message[len(PDONE):], "PDONE"), ReadState.DONE)
        elif message.startswith(PGONE):
            self._settle(name, rid_payload(message[len(PGONE):], "PGONE"), ReadState.GONE)
        elif message.startswith((PERR, PLOST)):
            lost = message.startswith(PLOST)
            err = decode_push_error(memoryview(message)[len(PLOST if lost else PERR):])
            rec = self.reads.get(err.rid)
            if rec is not None and rec.peer.name == name:
                rec.confirmed = not lost  # lost: what it was landing in stays out of use
                rec.settle(ReadState.FAILED, TransferError(
                    f"peer {name!r} lost the read, and bytes of it may still land: {err.reason[:300]}"
                    if lost else f"peer {name!r} refused or stopped the read: {err.reason[:300]}"))
            elif not lost and self._local.staging is not None:
                self._local.staging.confirmed_late(name, err.rid)
        elif message.startswith(PCANCEL):
            self._cancel(name, message[len(PCANCEL):])
        else:
            self._serve(name, memoryview(message)[len(PUSH):])
        return True

    def _settle(self, name: str, rid: int, state: ReadState) -> None:
        rec = self.reads.get(rid)
        if rec is not None and rec.peer.name == name:
            rec.confirmed = True
            rec.settle(state)
        elif self._local.staging is not None:
            self._local.staging.confirmed_late(name, rid)

    def _cancel(self, name: str, payload: bytes) -> None:
        rid = rid_payload(payload, "PCANCEL", incarnation=True)
        sender = payload[8:]  # the reader's incarnation (absent from older readers)
        job = self.jobs.get((name, rid))
        if job is not None and (not sender or sender == job.reader):
            job.cancelled = True
            job.wake.set()
            return
        peer = self._peers.by_name.get(name)
        if peer is None or (sender and sender != peer.link.incarnation):
            return  # not from the process we know by that name: nothing of ours to tell it
        if self._lost.holds(name, peer.link.incarnation, rid):  # its bytes may still land: never "gone"
            self._send(peer, push_error(rid, "a chunk of it ended without completing", lost=True))
        else:  # nothing of it is under way: say so at once
            self._send(peer, PGONE + rid_bytes(rid))

    def _refuse(self, peer: Peer, rid: int, reason: str, *, malformed: bool = False) -> None:
        """Tell the reader we will not serve request ``rid``; ``malformed``: the request
        itself was at fault (counted among the messages refused), not our state."""
        self.refused += 1
        if malformed:
            self._refusals.refuse("push", peer.name, reason)
        else:
            self._noisy.log(logging.WARNING, "push-refused", "refused a push read from %r: %s",
                            peer.name, reason)
        self._send(peer, push_error(rid, reason))

    def _send(self, peer: Peer, message: bytes) -> None:
        agent = self._local.agent
        if agent is None or not peer.connected:
            return
        try:
            agent.send_notif(peer.name, message)
        except PeerDisconnectedError as exc:
            self._peers.evict(peer, exc)
        except AionixlError as exc:
            self._noisy.log(logging.INFO, "push-send", "telling %r about a push: %s", peer.name, exc)

    def _serve(self, name: str, payload: memoryview) -> None:
        """A push request: checked (sender, size, every field) before any work; whatever it
        asks that we cannot do is refused with a PERR (and counted)."""
        peer = self._peers.by_name.get(name)
        if peer is None:
            raise WireError("a push request from an agent that is not an admitted peer")
        # The reader names at most its blocks (or staging slots), each once.
        ids = max(peer.num_blocks, peer.link.staging.num_blocks if peer.link.staging is not None else 0)
        try:
            req = decode_push_request(payload, ids)
        except WireError as exc:
            return self._refuse(peer, 0, str(exc), malformed=True)
        if req.reader and req.reader != peer.link.incarnation:
            # From an earlier process of that name, delivered late: serving it would write
            # into the new one's staging slots, refusing it would fail the new one's read of
            # that id.
            self._noisy.log(logging.WARNING, "push-stale", "push request from an earlier process "
                            "of %r: ignored", name[:80])
            return
        try:
            chunks, parts, dlist = self._chunks(peer, req)
        except (ValueError, AionixlError) as exc:
            return self._refuse(peer, req.rid, str(exc), malformed=isinstance(exc, ValueError))
        except MemoryError:
            return self._refuse(peer, req.rid, "out of memory preparing the request", malformed=True)
        key = (name, req.rid)
        if key in self.jobs:
            return self._refuse(peer, req.rid, "request id already in use")
        if self._per_peer.get(name, 0) >= self._tuning.max_pushes_per_peer:
            return self._refuse(peer, req.rid, f"busy: {self._tuning.max_pushes_per_peer} reads "
                                "of this peer are already under way")
        if self._tg is None or self._closing:
            return self._refuse(peer, req.rid, "the engine is closing")
        limit = min(req.timeout, self._config.transfer_timeout) + self._tuning.push_cancel_timeout
        job = _Job(peer, req.rid, chunks, parts, dlist, anyio.current_time() + limit, req.notify)
        self.jobs[key] = job
        self._per_peer[name] = self._per_peer.get(name, 0) + 1
        self._tg.start_soon(self._push, job)

    def _chunks(self, peer: Peer, req: PushRequest
                ) -> tuple[list[tuple[IndexArray, IndexArray]], PartLists | None, int]:
        """Validate every id and part of a request; the (source, destination) indices per
        chunk, the part lists they index (None: whole blocks), and for whole blocks the
        reader's list they index (its blocks', or its staging slots')."""
        if req.rid < 0 or req.rid >= 2**63:
            raise ValueError("bad request id")
        if not req.timeout > 0:  # also refuses NaN
            raise ValueError("bad timeout")
        if req.notify.startswith(RESERVED):
            raise ValueError("notify uses the reserved prefix")
        if len(req.dst) != len(req.src) or not req.dst or len(req.dst) % 4:
            raise ValueError("block id lists are empty, unequal or not int32")
        dst = np.frombuffer(req.dst, dtype="<i4").astype(np.int32)
        src = np.frombuffer(req.src, dtype="<i4").astype(np.int32)
        own_blocks = self._local.num_blocks
        slots = peer.link.staging
        if req.staged and slots is None:
            raise ValueError("a read into staging slots, but the reader announced none")
        dst_blocks, dst_offsets, dst_dlist = (slots.num_blocks, slots.offsets, slots.dlist) \
            if req.staged and slots is not None else (peer.num_blocks, peer.link.offsets, peer.link.dlist)
        if dst.min() < 0 or dst.max() >= dst_blocks:
            raise ValueError(f"destination block id out of range [0, {dst_blocks})")
        if src.min() < 0 or src.max() >= own_blocks:
            raise ValueError(f"source block id out of range [0, {own_blocks})")
        if dst.size > 1 and np.unique(dst).size != dst.size:
            raise ValueError("destination names the same block more than once")
        if req.dst_part is not None or req.src_part is not None:
            # Our blocks are the source: our part is the "local" one of the pair.
            parts = self._peers.part_lists(peer, _part(req.src_part), _part(req.dst_part), req.staged)
            per_chunk = max(1, self._tuning.push_chunk_bytes // parts.nbytes)
            return [parts.indices(src[i:i + per_chunk], dst[i:i + per_chunk])
                    for i in range(0, dst.size, per_chunk)], parts, -1
        if peer.link.unequal:
            raise ValueError(f"whole blocks cannot be pushed: block sizes differ (ours "
                             f"{[r.block_bytes for r in self._local.regions]}, the reader's "
                             f"{list(peer.bytes_per_block)})")
        per_chunk = max(1, self._tuning.push_chunk_bytes // self._local.bytes_per_block)
        return [(descriptor_indices(self._local.offsets, src[i:i + per_chunk]),
                 descriptor_indices(dst_offsets, dst[i:i + per_chunk]))
                for i in range(0, dst.size, per_chunk)], None, dst_dlist

    async def _push(self, job: _Job) -> None:
        """Write a job's chunks one at a time; confirm how it ended."""
        table = self._table
        agent = self._local.agent
        assert agent is not None
        peer, rid = job.peer, job.rid
        try:
            for n, (src, dst) in enumerate(job.chunks):
                if job.cancelled or not peer.connected:  # stopped between chunks: none moving
                    self._tell(job, PGONE + rid_bytes(rid))
                    return
                last = n == len(job.chunks) - 1
                parts = job.parts
                try:
                    handle, status = agent.start_xfer(
                        "write", self._local.dlist if parts is None else parts.local, src,
                        job.dlist if parts is None else parts.remote, dst,
                        PDONE + rid_bytes(rid) if last else b"", self._tuning.inline_polls)
                except AionixlError as exc:
                    # NIXL posts a WRITE per descriptor: one that failed part-way may have
                    # sent some, and those may still land.
                    if isinstance(exc, PeerDisconnectedError):
                        self._peers.evict(peer, exc)
                    self._lose(job, f"posting a write failed: {exc}")
                    return
                if status == DONE and handle == NO_HANDLE:
                    continue
                rec = InFlight(peer, table.new_event)
                if status != PROC:
                    rec.finish(status, TransferError("NIXL reported the write failed (ERR)"))
                table.add(handle, rec, status == PROC)
                timed_out = given_up = False
                try:
                    with anyio.move_on_after(max(0.0, job.deadline - anyio.current_time())):
                        await rec.event.wait()
                    if not rec.event.is_set():
                        # A chunk stuck past the deadline (a cut link, or we were stopped):
                        # the reader has given up, and evicts us if need be. UCX cannot abort
                        # the chunk; once it ends, saying so lets the reader reuse the
                        # staging slots it was landing in.
                        timed_out = True
                        with anyio.move_on_after(STUCK_CHUNK_WAIT):
                            await rec.event.wait()
                        given_up = True
                finally:
                    # Cancelled (the engine is closing): leave the record to close(), which
                    # lets moving transfers finish before it releases them.
                    if rec.event.is_set() or given_up:
                        table.take(handle, rec)
                if timed_out:
                    self._noisy.log(logging.WARNING, "push-timeout", "push to %r timed out", peer.name)
                if rec.status != DONE:
                    # Only NIXL's DONE says a chunk's bytes are all in place: failed, released
                    # with its reader dropped, or still moving, the rest may yet land.
                    self._lose(job, str(rec.error) if rec.error is not None
                               else f"a chunk still moving {STUCK_CHUNK_WAIT} s past the deadline")
                    return
                if timed_out:  # the reader gave up on it, and it has now ended
                    self._tell(job, PGONE + rid_bytes(rid))
                    return
            self.served += 1
            if job.notify:
                self._deliver(Notification(peer.name, job.notify))
                self._wake_drainer()
        finally:
            self.jobs.pop((peer.name, rid), None)
            left = self._per_peer.get(peer.name, 1) - 1
            if left > 0:
                self._per_peer[peer.name] = left
            else:
                self._per_peer.pop(peer.name, None)

    def _tell(self, job: _Job, message: bytes) -> None:
        """Tell the reader of ``job`` how its read ended: through the job's peer, or the one
        admitted since under that name if it is the same process; not to another process
        (a revived Peer object may be one)."""
        peer = job.peer if job.peer.connected else self._peers.by_name.get(job.peer.name)
        if peer is not None and peer.link.incarnation == job.reader:
            self._send(peer, message)

    def _lose(self, job: _Job, reason: str) -> None:
        """``job`` ended with a chunk whose bytes may still land: say so (``PLOST``), now and
        whenever its reader asks us to stop it."""
        self.lost += 1
        name = job.peer.name
        current = self._peers.by_name.get(name)
        if current is None or current.link.incarnation == job.reader:  # else its cancels are ignored
            self._lost.add(name, job.reader, job.rid)
        if current is not None:
            self._lost.keep_only(name, current.link.incarnation)
        self._tell(job, push_error(job.rid, reason, lost=True))

    # ---- peers lost, engine closing -----------------------------------------------------

    def fail_peer(self, peer: Peer, error: AionixlError) -> None:
        """The peer was dropped: our reads from it fail; pushes to it stop."""
        for rec in self.reads.values():
            if rec.peer is peer:
                rec.settle(ReadState.FAILED, error)
        for job in self.jobs.values():
            if job.peer is peer:
                job.cancelled = True

    def closing(self, error: AionixlError) -> None:
        """The engine closes: readers waiting for slots give up, and each read under way
        will fail with ``error``. Its caller hears through :meth:`fail_all`, once
        :meth:`close` fenced the read and its peer is removed: a server that did not
        confirm may still write (into our blocks, where there are no staging slots)."""
        self._closing = True
        if self._local.staging is not None:
            self._local.staging.close()
        for rec in self.reads.values():
            if rec.state == ReadState.OPEN:
                rec.error = error

    def fail_all(self) -> None:
        """Closing, the peers removed: every reader still waiting hears (:meth:`closing`)."""
        for rec in self.reads.values():
            rec.event.set()
        self.reads.clear()

    async def close(self, deadline_at: float) -> None:
        """Ask every server still pushing into us to stop, and wait (bounded) until it did.

        The drainer is gone by now, so this reads notifications itself.
        """
        agent = self._local.agent
        if agent is None:
            return
        open_reads = [r for r in self.reads.values() if r.state == ReadState.OPEN and r.peer.connected]
        for rec in open_reads:
            try:
                agent.send_notif(rec.peer.name, self._cancel_message(rec.rid))
            except AionixlError:
                rec.state = ReadState.GONE  # its connection is gone: nothing can land
        end = min(deadline_at, anyio.current_time() + self._tuning.push_cancel_timeout)
        while any(r.state == ReadState.OPEN for r in open_reads) and anyio.current_time() < end:
            try:
                notifs = agent.get_notifs()
            except AionixlError:
                break
            for name, messages in notifs.items():
                for message in messages:
                    if message.startswith((PDONE, PGONE, PERR, PLOST)):
                        self.heard(name, message)
            await anyio.sleep(0.0005)
