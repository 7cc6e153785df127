"""Engine metrics: counters kept on the transfer path, and the snapshot users read.

The transfer path only appends each finished transfer's numbers to a list (no other object
is created per transfer); every :data:`_RING` transfers the engine's event loop folds those
into counters and histograms with numpy in bulk. :meth:`TransferMetrics.snapshot` copies
the counters and the lists and folds the copies, which is where the cost of reading metrics
goes (whoever calls :meth:`Engine.metrics` pays it); it never changes the engine's own, so
it is safe from any thread (see :meth:`TransferMetrics.snapshot`). Failed transfers are
counted by outcome and logged, one structured record each, through the engine's rate
limiter.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Generic, TypeVar

import anyio
import numpy as np
import numpy.typing as npt

from ._errors import EngineClosedError, PeerDisconnectedError, TransferError, TransferTimeoutError
from ._ratelimit import RateLimitedLog

OPS = ("read", "write")
#: How a ``transfer_blocks`` call that reached NIXL ended.
OUTCOMES = ("ok", "timeout", "cancelled", "peer_disconnected", "error", "closed")
#: Why a peer was evicted: NIXL reported it disconnected (on a transfer or a notification),
#: a transfer to it ended in NIXL's ERR state, or a liveness probe to it failed.
EVICTION_CAUSES = ("disconnected", "transfer_error", "probe")
#: Histogram upper bounds in seconds (1-2-5 steps from 1 us to 10 s; +Inf is implied).
LATENCY_BOUNDS: tuple[float, ...] = (
    1e-6, 2e-6, 5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3,
    0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)

_BUCKETS = len(LATENCY_BOUNDS) + 1
_BOUNDS_ARRAY = np.array(LATENCY_BOUNDS)
#: Finished transfers recorded before they are folded into the histograms.
_RING = 4096
_RING_NUMBERS = 3 * _RING
_RING_PAIRS = 2 * _RING
_TIMEOUT, _CANCELLED, _DISCONNECTED, _ERROR, _CLOSED = 1, 2, 3, 4, 5
_LOUD = {_TIMEOUT: logging.WARNING, _DISCONNECTED: logging.WARNING, _ERROR: logging.WARNING,
         _CANCELLED: logging.INFO, _CLOSED: logging.INFO}
#: Builds a TransferResult without NamedTuple.__new__'s argument handling (half its cost).
_new_tuple = tuple.__new__
Result = TypeVar("Result", bound=tuple[Any, ...])
Exc = TypeVar("Exc", bound=BaseException)
_perf = time.perf_counter


class _Counters:
    """Per-op counters and histograms of finished transfers (index 0 read, 1 write)."""

    __slots__ = ("outcomes", "bytes", "seconds", "seconds_sum", "post", "post_sum")

    def __init__(self) -> None:
        self.outcomes = [[0] * len(OUTCOMES) for _ in OPS]
        self.bytes = [0, 0]
        self.seconds = [[0] * _BUCKETS for _ in OPS]  # call to return, finished transfers
        self.seconds_sum = [0.0, 0.0]
        self.post = [[0] * _BUCKETS for _ in OPS]  # creating and posting the NIXL request
        self.post_sum = [0.0, 0.0]

    def copy(self) -> _Counters:
        """A copy, list by list (each slice is one step for any other thread)."""
        c = _Counters.__new__(_Counters)
        c.outcomes = [row[:] for row in self.outcomes]
        c.bytes = self.bytes[:]
        c.seconds = [row[:] for row in self.seconds]
        c.seconds_sum = self.seconds_sum[:]
        c.post = [row[:] for row in self.post]
        c.post_sum = self.post_sum[:]
        return c

    def fold(self, rings: Sequence[list[float]], bytes_per_block: int) -> None:
        """Count the finished transfers kept in ``rings`` (reads, writes: blocks, seconds,
        post seconds each; reads and writes of one block: seconds, post seconds each; reads
        and writes of block parts: bytes, seconds, post seconds each)."""
        for w in (0, 1):
            if ring := rings[w]:
                table = np.array(ring, np.float64).reshape(-1, 3)
                blocks = int(table[:, 0].astype(np.int64).sum())
                self._fold(w, len(table), blocks * bytes_per_block, table[:, 1], table[:, 2])
            if ring := rings[2 + w]:
                table = np.array(ring, np.float64).reshape(-1, 2)
                self._fold(w, len(table), len(table) * bytes_per_block, table[:, 0], table[:, 1])
            if ring := rings[4 + w]:
                table = np.array(ring, np.float64).reshape(-1, 3)
                # Summed as the ints they are: exact however many bytes.
                self._fold(w, len(table), int(sum(ring[0::3])), table[:, 1], table[:, 2])

    def _fold(self, w: int, transfers: int, nbytes: int, seconds: npt.NDArray[np.float64],
              post: npt.NDArray[np.float64]) -> None:
        self.outcomes[w][0] += transfers
        self.bytes[w] += nbytes
        for hist, sums, values in ((self.seconds[w], self.seconds_sum, seconds),
                                   (self.post[w], self.post_sum, post)):
            # side="left": a value equal to a bound counts in that bound's bucket (le).
            found = np.bincount(np.searchsorted(_BOUNDS_ARRAY, values, side="left"),
                                minlength=_BUCKETS)
            for b in np.flatnonzero(found).tolist():
                hist[b] += int(found[b])
            sums[w] += float(values.sum())


class TransferMetrics(_Counters, Generic[Result]):
    """Per-op counters and histograms of one engine's transfers (index 0 read, 1 write).

    ``done`` is the per-transfer hook: a closure (cell variables are cheaper to reach than
    attributes) that builds the ``TransferResult`` and keeps its numbers in its op's list
    (a ring); every :data:`_RING` transfers of an op, ``flush`` folds the rings into the
    counters with numpy. Per transfer that is one append, not a bisect into each histogram.
    ``done_one`` (one whole block) and ``done_part`` (block parts: bytes, not blocks) are
    the same with rings of their own. Failures are counted directly by :meth:`failed`.

    ``done``, ``done_one``, ``done_part``, ``failed`` and ``flush`` run in the engine's event loop only;
    :meth:`snapshot` runs anywhere (a seqlock: ``flush`` makes ``version`` odd while it
    folds, and a snapshot that saw it odd or changed reads again).
    """

    __slots__ = ("done", "done_one", "done_part", "flush", "version", "_rings", "_bytes_per_block",
                 "_noisy")

    def __init__(self, result: type[Result], bytes_per_block: int, regions: int,
                 noisy: RateLimitedLog) -> None:
        super().__init__()
        #: Folds so far, times two; odd while ``flush`` folds (see :meth:`snapshot`).
        self.version = 0
        self._bytes_per_block = bytes_per_block
        self._noisy = noisy
        self.done, self.done_one, self.done_part, self.flush = self._recorder(result, bytes_per_block,
                                                                              regions)

    def _recorder(self, result: type[Result], bytes_per_block: int, regions: int
                  ) -> tuple[Callable[[str, int, float, float, float, float,
                                       tuple[float, float, int] | None], Result],
                             Callable[[str, float, float, float, float], Result],
                             Callable[[str, int, int, int, float, float, float, float,
                                       tuple[float, float, int] | None], Result],
                             Callable[[], None]]:
        # Finished transfers not yet folded into the counters: blocks, seconds and post
        # seconds of each, flat. Plain numbers, not the results: the garbage collector
        # does not track them, so thousands kept here cost no collections.
        reads: list[float] = []
        writes: list[float] = []
        # One-block transfers (``done_one``): seconds and post seconds only, two appends.
        reads_one: list[float] = []
        writes_one: list[float] = []
        read_one, write_one = reads_one.append, writes_one.append
        # Transfers of block parts (``done_part``): bytes (not blocks), seconds, post seconds.
        reads_part: list[float] = []
        writes_part: list[float] = []
        # Never replaced, only appended to and cleared: snapshots read the same lists.
        rings = self._rings = (reads, writes, reads_one, writes_one, reads_part, writes_part)

        def done(op: str, nblocks: int, started: float, posted: float, seen: float, now: float,
                 telemetry: tuple[float, float, int] | None) -> Result:
            """Count a finished transfer; returns its ``TransferResult``.

            Times are ``perf_counter()`` readings: the call's post began at ``started``, the
            post returned at ``posted``, completion was seen at ``seen``, the call returns at
            ``now``. ``telemetry`` (NIXL's post seconds, transfer seconds, descriptors)
            replaces the engine's own clock where the agent captures it.
            """
            seconds = now - started
            if telemetry is None:
                post = posted - started
                res = _new_tuple(result, (nblocks, nblocks * bytes_per_block, seconds, post,
                                          seen - started, nblocks * regions))
            else:
                post = telemetry[0]
                res = _new_tuple(result, (nblocks, nblocks * bytes_per_block, seconds, *telemetry))
            ring = reads if op == "read" else writes
            ring += (nblocks, seconds, post)  # one step for another thread: whole entries
            if len(ring) >= _RING_NUMBERS:
                flush()
            return res

        def done_one(op: str, started: float, posted: float, seen: float, now: float) -> Result:
            """``done`` for one block without telemetry (a merged request's member): the
            commonest call, with less to pass and nothing to choose."""
            seconds = now - started
            post = posted - started
            if op == "read":
                read_one(seconds)
                read_one(post)
                if len(reads_one) >= _RING_PAIRS:
                    flush()
            else:
                write_one(seconds)
                write_one(post)
                if len(writes_one) >= _RING_PAIRS:
                    flush()
            return _new_tuple(result, (1, bytes_per_block, seconds, post, seen - started, regions))

        def done_part(op: str, nblocks: int, nbytes: int, descriptors: int, started: float,
                      posted: float, seen: float, now: float,
                      telemetry: tuple[float, float, int] | None) -> Result:
            """``done`` for a transfer of block parts (``aionixl._parts``): it moved ``nbytes``
            (not ``nblocks`` whole blocks) with ``descriptors`` descriptors, which its ring
            keeps in place of the blocks."""
            seconds = now - started
            if telemetry is None:
                post = posted - started
                res = _new_tuple(result, (nblocks, nbytes, seconds, post, seen - started, descriptors))
            else:
                post = telemetry[0]
                res = _new_tuple(result, (nblocks, nbytes, seconds, *telemetry))
            ring = reads_part if op == "read" else writes_part
            ring += (nbytes, seconds, post)  # one step for another thread: whole entries
            if len(ring) >= _RING_NUMBERS:
                flush()
            return res

        def flush() -> None:
            """Fold the recorded transfers into the counters and histograms (in the event
            loop only: the one writer). ``version`` is odd meanwhile."""
            self.version += 1
            try:
                self.fold(rings, bytes_per_block)
                for ring in rings:
                    ring.clear()
            finally:
                self.version += 1

        return done, done_one, done_part, flush

    def failed(self, exc: Exc, peer: Any, op: str, nblocks: int, started: float) -> Exc:
        """Count a transfer that ended with ``exc`` and log it (rate-limited, structured)."""
        outcome = outcome_of(exc)
        self.outcomes[op == "write"][outcome] += 1
        name = OUTCOMES[outcome]
        elapsed = _perf() - started
        nbytes = nblocks * self._bytes_per_block
        self._noisy.log(_LOUD[outcome], "transfer-" + name,
                        "%s of %d block(s) (%d bytes) with peer %r ended after %.6f s: %s: %s",
                        op, nblocks, nbytes, peer.name, elapsed, name, str(exc) or type(exc).__name__,
                        extra={"peer": peer.name, "op": op, "blocks": nblocks, "bytes": nbytes,
                               "elapsed": elapsed, "cause": name})
        return exc

    def snapshot(self) -> dict[str, Any]:
        """The transfer fields of an :class:`EngineMetrics`, copied now.

        Safe from any thread (a Prometheus server scrapes from its own), and it changes
        nothing: it copies the counters and the rings and folds the copies. Under the GIL
        each list copy is one step, and only the event loop writes: appends to a ring
        (``done`` and ``done_part`` append a whole entry in one step, ``done_one`` in two,
        so a copy may end in half an entry, left out until the next snapshot) and, in
        ``flush``, the fold
        that moves the rings into the counters. That fold is bracketed by ``version``: a
        copy taken while it was odd, or that saw it change, is taken again, so no
        transfer is counted twice or missed, and each snapshot counts at least what the
        one before it did.
        """
        rings = self._rings
        while True:
            version = self.version
            if version & 1:  # the loop is folding: wait for it (the GIL hands over)
                continue
            counts = self.copy()
            # Whole entries only: a prefix of what the loop appended (rings only grow
            # between folds, and a fold meanwhile changes the version).
            copies = [_whole_entries(ring, width)
                      for ring, width in zip(rings, (3, 3, 2, 2, 3, 3), strict=True)]
            if self.version == version:
                break
        counts.fold(copies, self._bytes_per_block)
        return {
            "transfers": {op: dict(zip(OUTCOMES, counts.outcomes[i], strict=True))
                          for i, op in enumerate(OPS)},
            "transferred_bytes": dict(zip(OPS, counts.bytes, strict=True)),
            "transfer_seconds": {op: _histogram(counts.seconds[i], counts.seconds_sum[i])
                                 for i, op in enumerate(OPS)},
            "post_seconds": {op: _histogram(counts.post[i], counts.post_sum[i])
                             for i, op in enumerate(OPS)},
        }


def _whole_entries(ring: list[float], width: int) -> list[float]:
    """A copy of the whole entries at the front of ``ring`` (its length read once: the loop
    may append meanwhile)."""
    n = len(ring)
    return ring[:n - n % width]


def outcome_of(exc: BaseException) -> int:
    """The index in :data:`OUTCOMES` of a transfer that raised ``exc``."""
    if isinstance(exc, TransferTimeoutError):
        return _TIMEOUT
    if isinstance(exc, PeerDisconnectedError):
        return _DISCONNECTED
    if isinstance(exc, EngineClosedError):
        return _CLOSED
    if isinstance(exc, Exception):
        return _ERROR
    try:
        cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
    except RuntimeError:  # no async library running (never on a real transfer path)
        cancelled = False
    return _CANCELLED if cancelled else _ERROR


def eviction_cause(cause: BaseException) -> str:
    """Which :data:`EVICTION_CAUSES` entry an eviction for ``cause`` counts under."""
    if isinstance(cause, TransferError) and not isinstance(cause, PeerDisconnectedError):
        return "transfer_error"
    return "disconnected"


# ---- the snapshot ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Histogram:
    """Observations in buckets: ``counts[i]`` fell in ``(bounds[i-1], bounds[i]]``; the last
    count is above every bound (+Inf). Not cumulative; :meth:`cumulative` gives Prometheus'
    ``le`` form."""

    bounds: tuple[float, ...]
    counts: tuple[int, ...]
    sum: float

    @property
    def count(self) -> int:
        return sum(self.counts)

    def cumulative(self) -> list[tuple[float, int]]:
        """``(le, observations <= le)`` for every bound, then ``(inf, count)``."""
        out: list[tuple[float, int]] = []
        running = 0
        for bound, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


@dataclass(frozen=True, slots=True)
class EngineMetrics:
    """One engine's counters and gauges at one moment (:meth:`Engine.metrics`).

    Transfers are counted per ``transfer_blocks`` call that reached NIXL (calls refused by
    argument checks are not); a call on the engine's side only (the peer's engine counts
    nothing for it). Counters never go down while the engine lives.
    """

    engine: str
    #: op -> outcome -> calls; every op and outcome is present.
    transfers: Mapping[str, Mapping[str, int]]
    #: op -> bytes moved by finished (ok) transfers.
    transferred_bytes: Mapping[str, int]
    #: op -> seconds from call to return, finished transfers.
    transfer_seconds: Mapping[str, Histogram]
    #: op -> seconds to create and post the NIXL request, finished transfers.
    post_seconds: Mapping[str, Histogram]
    in_flight: int
    peers: int
    handshakes_accepted: int
    handshakes_rejected: int
    peers_evicted: int
    #: cause -> evictions (see EVICTION_CAUSES); sums to ``peers_evicted``.
    evictions: Mapping[str, int]
    #: Notifications handed to ``wait_notification`` callers / dropped from a full mailbox.
    notifications_delivered: int
    notifications_dropped: int
    notifications_kept: int
    #: Coalescing: NIXL requests that carried more than one caller (merged), and the
    #: ``transfer_blocks`` calls that rode in them.
    merged_requests: int
    merged_calls: int
    #: Peers evicted because a read aborted against them was not confirmed stopped in time
    #: (counted in ``peers_evicted`` too; docs/read-modes.md).
    fence_evictions: int = 0
    #: ``wait_notification`` calls waiting now.
    notification_waiters: int = 0
    #: Merged requests posted again after a member left (docs/coalescing.md).
    reposts: int = 0
    #: Push reads this engine served for peers: completed; refused (malformed, busy,
    #: closing); ended with a chunk whose bytes may still land.
    pushes_served: int = 0
    pushes_refused: int = 0
    pushes_lost: int = 0
    #: Staging slots for push reads (docs/read-modes.md): all of them; kept out of use
    #: because a read into them ended without the server's word; taken back since; push
    #: reads refused because every slot was stranded.
    staging_slots: int = 0
    staging_stranded: int = 0
    staging_reclaimed: int = 0
    staging_exhausted: int = 0
    #: Leases (``Engine.lease``): live and not past their time; ended with every reader
    #: done; expired (no heartbeat within their duration); ids in heartbeats that named no
    #: live lease.
    leases_active: int = 0
    leases_released: int = 0
    leases_expired: int = 0
    heartbeat_ids_unknown: int = 0
    #: Serving vLLM decoders (``aionixl.vllm.serve``): side-channel requests answered and
    #: refused; serving children replaced after they ended (``isolate=True``), and of those
    #: the ones killed for not answering a liveness ping in time (stopped, or stuck).
    vllm_requests_answered: int = 0
    vllm_requests_refused: int = 0
    vllm_serving_restarts: int = 0
    vllm_serving_unresponsive: int = 0
    #: Messages from peers refused (malformed, over their bound, or from a sender not
    #: entitled to them), by kind: ``probe``, ``goodbye``, ``multi``, ``tagged``, ``push``,
    #: ``pcancel``, ``pdone``, ``perr``, ``pgone``, ``plost``, ``reserved`` (a reserved prefix
    #: of no known kind), ``relayed`` (a reserved message sent to the agent serving vLLM
    #: decoders), ``heartbeat`` (vLLM's heartbeat, over 1 MiB). Every kind is present.
    messages_refused: Mapping[str, int] = field(default_factory=dict)
    #: NIXL resources the last close could not release (0 while open and after a clean close).
    leaked_on_close: int = 0
    #: Discovery (``Engine(discovery=)``): whether this engine's key is believed to be in
    #: etcd now; leases granted and keys put (1 after a clean start, more after etcd lost
    #: one); keep-alive or re-registration attempts that failed (etcd out of reach).
    discovery_registered: bool = False
    discovery_registrations: int = 0
    discovery_keepalive_failures: int = 0

    def as_dict(self) -> dict[str, Any]:
        """Plain dicts, lists and numbers (JSON-ready)."""
        return asdict(self)


#: The keys of the deprecated ``Engine.stats()``: each is an ``EngineMetrics`` field now.
STATS_KEYS = ("notifications_kept", "notifications_dropped", "notification_waiters", "leaked_on_close",
              "handshakes_accepted", "handshakes_rejected", "peers_evicted", "merged_requests",
              "merged_calls", "reposts", "pushes_served", "pushes_refused", "pushes_lost",
              "fence_evictions", "staging_slots", "staging_stranded", "staging_reclaimed",
              "staging_exhausted", "vllm_requests_answered", "vllm_requests_refused",
              "vllm_serving_restarts", "discovery_registrations", "discovery_keepalive_failures")


def _histogram(counts: list[int], total: float) -> Histogram:
    return Histogram(LATENCY_BOUNDS, tuple(counts), total)
