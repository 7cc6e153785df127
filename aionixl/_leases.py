"""Leases on offered blocks: a prefill holds a request's blocks until its readers are done.

A reader says it is done with vLLM's notification ``"<request_id>:<readers>"`` (sent as
``notify=`` with its last read, :func:`read_done`) and keeps a lease alive with vLLM's
heartbeat ``"HB:<id>,<id>"``; the same bytes release an aionixl lease and a vLLM prefill's
blocks. A read-done announcing more readers than the lease was made for raises its count,
as a vLLM prefill counts them: a vLLM decode at a higher TP than the prefill's reads with
each of its ranks, and each sends ``"<id>:<ranks per prefill rank>"``.

No I/O here: the drainer hands every incoming notification to
:meth:`LeaseTable.consume` first, and what a lease takes is not delivered to
``wait_notification``.

Times are ``time.monotonic()`` seconds. A lease expires once ``duration`` passes without a
heartbeat while readers are still missing; it is found expired by whoever looks next (its
waiters, a notification, :meth:`LeaseTable.sweep`), so no task runs per lease.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import anyio

from ._checks import MAX_SECONDS, check_int
from ._errors import AionixlError, EngineClosedError
from ._notifications import Notification
from ._ratelimit import Refusals
from ._vllm_wire import HEARTBEAT_PREFIX, read_notification
from ._wire import RESERVED

_clock = time.monotonic

#: The longest heartbeat taken (its ids are looked up one by one): a decode heartbeating a
#: thousand requests of 60-character ids sends 60 KiB; a longer one is refused.
MAX_HEARTBEAT_BYTES = 1 << 20


class LeaseExpiredError(AionixlError):
    """A lease's duration passed without a heartbeat before all its readers were done."""


class LeaseCancelledError(AionixlError):
    """The lease was cancelled (``Lease.cancel``) before all its readers were done."""


def read_done(request_id: str, readers: int = 1) -> bytes:
    """The notification a reader passes as ``notify=`` with its last read of a request:
    ``"<request_id>:<readers>"``, vLLM's own (``readers``: how many readers the prefill
    waits for, as vLLM counts them)."""
    return read_notification(request_id, readers)


class Lease:
    """Blocks held for a request until ``readers`` readers are done (see module docs).

    Made by :meth:`Engine.lease`. ``wait()`` returns once the readers are done; it raises
    :class:`LeaseExpiredError` when ``expires_at`` passes first, :class:`LeaseCancelledError`
    after :meth:`cancel`, ``EngineClosedError`` when the engine closes.
    """

    __slots__ = ("request_id", "block_ids", "readers", "duration", "readers_done", "expires_at",
                 "_table", "_end", "_changed")

    def __init__(self, table: LeaseTable, request_id: str, block_ids: tuple[int, ...], readers: int,
                 duration: float, now: float) -> None:
        self.request_id = request_id
        self.block_ids = block_ids
        self.readers = readers
        self.duration = duration
        self.readers_done = 0
        #: ``time.monotonic()`` after which the lease expires unless a heartbeat moves it.
        self.expires_at = now + duration
        self._table = table
        self._end: AionixlError | None = None  # why it ended without its readers
        self._changed = anyio.Event()

    @property
    def done(self) -> bool:
        """Whether the lease has ended: its readers done, expired, cancelled or closed."""
        return self.readers_done >= self.readers or self._end is not None

    def __repr__(self) -> str:
        return (f"<Lease {self.request_id!r} blocks={len(self.block_ids)} "
                f"readers={self.readers_done}/{self.readers} done={self.done}>")

    async def wait(self) -> None:
        """Until every reader is done (see the class docs for how else it ends)."""
        while True:
            self._table.sweep()
            if self._end is not None:
                raise type(self._end)(str(self._end))
            if self.readers_done >= self.readers:
                return
            changed = self._changed
            with anyio.move_on_after(max(0.0, self.expires_at - _clock())):
                await changed.wait()

    def cancel(self) -> None:
        """End the lease now (idempotent): its blocks are the application's again."""
        if not self.done:
            self._table.end(self, LeaseCancelledError(f"lease {self.request_id!r} was cancelled"))

    def _touch(self) -> None:
        """Wake the waiters: something about the lease changed."""
        changed, self._changed = self._changed, anyio.Event()
        changed.set()


class LeaseTable:
    """The live leases of one engine, by request id, and their counters."""

    def __init__(self, refusals: Refusals) -> None:
        self._refusals = refusals
        self._live: dict[str, Lease] = {}
        self.view: Mapping[str, Lease] = MappingProxyType(self._live)
        #: No live lease expires before this (heartbeats only move expiries later, so it may
        #: be early, never late): a sweep before it has nothing to look at.
        self._next_expiry = math.inf
        self.released = 0  # all readers done
        self.expired = 0
        self.unknown = 0  # heartbeat ids with no live lease

    def add(self, request_id: str, block_ids: Iterable[int], num_blocks: int, readers: int,
            duration: float) -> Lease:
        """A new lease; ``ValueError`` for bad input (nothing is registered then)."""
        self.sweep()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty str")
        if request_id.startswith("HB:") or "," in request_id:
            raise ValueError(f"request_id {request_id!r} must not start with 'HB:' or contain ',' "
                             "(vLLM's heartbeat would not name it)")
        if request_id.encode("utf-8", "surrogatepass").startswith(RESERVED):
            raise ValueError(f"request_id {request_id!r} starts with aionixl's reserved prefix: "
                             "no reader could send its read-done")
        if request_id in self._live:
            raise ValueError(f"a lease for request {request_id!r} is already live")
        if isinstance(block_ids, (str, bytes)) or not isinstance(block_ids, Iterable):
            raise ValueError("block_ids must be an iterable of ints")
        ids = tuple(block_ids)
        for b in ids:
            if type(b) is not int:
                raise ValueError(f"block_ids must hold ints, got {b!r}")
            if not 0 <= b < num_blocks:
                raise ValueError(f"block id {b} is outside the cache (0..{num_blocks - 1})")
        check_int(readers, "readers", 1)
        if isinstance(duration, bool) or not isinstance(duration, (int, float)) \
                or not 0 < duration <= MAX_SECONDS:
            raise ValueError(f"duration must be a finite number of seconds > 0, got {duration!r}")
        lease = self._live[request_id] = Lease(self, request_id, ids, readers, float(duration), _clock())
        self._next_expiry = min(self._next_expiry, lease.expires_at)
        return lease

    @property
    def waiting(self) -> bool:
        """Whether any lease is live (the drainer then polls at its busy cadence)."""
        return bool(self._live)

    def consume(self, note: Notification) -> bool:
        """Take ``note`` if it is a heartbeat or a live lease's read-done; whether it did."""
        message = note.message
        if message.startswith(HEARTBEAT_PREFIX):
            if len(message) > MAX_HEARTBEAT_BYTES:
                self._refusals.refuse("heartbeat", note.peer, f"a heartbeat of {len(message)} bytes "
                                      f"(at most {MAX_HEARTBEAT_BYTES})")
                return True
            now = _clock()
            self.sweep(now)
            for rid in message[len(HEARTBEAT_PREFIX):].decode("utf-8", "replace").split(","):
                lease = self._live.get(rid)
                if lease is None:
                    self.unknown += 1
                else:
                    lease.expires_at = max(lease.expires_at, now + lease.duration)
                    lease._touch()
            return True
        if not self._live:
            return False  # nothing to release: no parsing on the notification path
        rid, sep, count = message.decode("utf-8", "replace").rpartition(":")
        if not sep or not count.isdecimal() or len(count) > 9:
            return False
        self.sweep()
        lease = self._live.get(rid)
        if lease is None:
            return False  # not ours: an application's own message, delivered as usual
        lease.readers = max(lease.readers, int(count))  # the readers it says there are
        lease.readers_done += 1
        if lease.readers_done >= lease.readers:
            del self._live[rid]
            self.released += 1
        lease._touch()
        return True

    def sweep(self, now: float | None = None) -> None:
        """End the leases whose time is up (a walk over them only once one may be)."""
        now = _clock() if now is None else now
        if now < self._next_expiry:
            return
        self._next_expiry = min((lease.expires_at for lease in self._live.values()
                                 if lease.expires_at > now), default=math.inf)
        for lease in [lease for lease in self._live.values() if lease.expires_at <= now]:
            self.expired += 1
            self.end(lease, LeaseExpiredError(
                f"lease {lease.request_id!r} expired: {lease.readers_done} of {lease.readers} "
                f"reader(s) done and no heartbeat within {lease.duration:g} s"))

    def end(self, lease: Lease, why: AionixlError) -> None:
        if self._live.get(lease.request_id) is lease:
            del self._live[lease.request_id]
        lease._end = why
        lease._touch()

    def close(self) -> None:
        """The engine closes: every live lease ends with ``EngineClosedError``."""
        for lease in list(self._live.values()):
            self.end(lease, EngineClosedError("the engine closed"))

    def active(self, now: float | None = None) -> int:
        """Live leases not yet past their time (read-only: safe from any thread)."""
        now = _clock() if now is None else now
        return sum(1 for lease in list(self._live.values()) if lease.expires_at > now)
