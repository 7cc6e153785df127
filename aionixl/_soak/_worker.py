"""The soak worker: random reads and writes with random deadlines, inside one engine's process.

``await main(engine, args)`` (``args``: the msgpack of a :class:`WorkerSpec`) runs until it
is cancelled. Every engine of the fleet has the same block layout:

- ``[0, S)``: SOURCE blocks (``S = source_blocks``), never written by anyone; engine ``i``'s
  hold ``make_caches(seeds[i], ...)``'s bytes, so any engine can check what it read;
- ``[S, S + n * slot_blocks)``: WRITE INBOX slots, slot ``j`` (``slot_blocks`` blocks)
  written by engine ``j`` only (``n = len(names)``);
- the rest: this engine's DESTINATION pool, where reads and read-backs land.

``concurrency`` loops each start operations at Poisson times (``rate`` per second in all)
against a random peer registered in discovery:

- **read**: ``k`` random source blocks of the peer into ``k`` free destination blocks
  (filled with a canary first); on success every byte is checked against the peer's seed.
  On an error the destination blocks are copied at the moment the call returned and held
  in quarantine for ``quarantine_s``: any byte that changes meanwhile is a late byte.
- **write**: ``k`` random source blocks of ours into the first ``k`` blocks of our slot in
  the peer's inbox (one write per target at a time), then a **readback** of those blocks
  into destination blocks, checked against our own seed.
- **connect**: a peer not connected (or dropped after an error) is connected by name
  (``engine.connect_to``), bounded by ``connect_timeout``.

Each operation appends one JSON line to ``events_path`` (the keys are :data:`RECORD_KEYS`);
the first line of an incarnation is ``{"event": "start", ...}``, the last (when it was
cancelled, not killed) ``{"event": "end", ...}``. A violation is an error that is not an
:class:`aionixl.AionixlError` (``"untyped_error"``), an error or a result later than its
deadline + 1 s (``"late_error"``, ``"late_result"``), bytes that do not verify
(``"bad_bytes"``), bytes that changed after an error (``"late_bytes"``), and our own source
blocks changing (``"source_changed"``). An operation during which this process did not run
(SIGSTOP: a tick of :class:`PauseClock` came more than 0.5 s late) is ``"self_paused"``
and is not judged on time; its bytes are judged as any other's.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import time
import traceback
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import numpy as np

import aionixl
from aionixl import AionixlError, Region
from aionixl._regions import block_view, describe_regions
from aionixl.testing import block_bytes

#: Seconds past its deadline an operation may take to fail (issue 31's invariant).
LATE_SLACK = 1.0
#: A tick of the pause clock this much later than the last is a pause of this process.
PAUSE_THRESHOLD = 0.5
#: How often the pause clock ticks.
TICK_S = 0.05
#: How often the list of registered engines is read from discovery.
REFRESH_S = 1.0
#: How often our own source blocks are checked.
SOURCE_CHECK_S = 5.0
#: Seconds a peer whose connect failed is left alone.
CONNECT_BACKOFF = 1.0
#: The byte destination blocks are filled with before a read.
CANARY = 0xA5
#: The keys of every operation record, in order.
RECORD_KEYS = ("t", "op", "peer", "blocks", "bytes", "deadline", "elapsed", "ok", "error", "typed",
               "verified_bytes", "violation", "detail", "self_paused")

#: What an operation record's ``"op"`` may be; the worker's checks write records too, with
#: ``"op"`` ``"quarantine"`` (late bytes), ``"source"`` (our source blocks changed) or
#: ``"discover"`` (an untyped error from discovery), each with its violation.
OPERATIONS = ("read", "write", "readback", "connect")

ByteView = np.ndarray[Any, np.dtype[np.uint8]]


class WorkerSpec(msgspec.Struct, frozen=True):
    """What one engine's worker does (msgpack-encoded as ``main``'s ``args``)."""

    #: This engine's index in the fleet, ``0 .. len(names) - 1``.
    index: int
    #: Every engine's name, by index.
    names: list[str]
    #: Engine ``i``'s cache is ``make_caches(seeds[i], num_blocks, block_shape, dtypes)``.
    seeds: list[int]
    num_blocks: int
    block_shape: list[int]
    dtypes: list[str]
    #: Blocks ``[0, source_blocks)`` are source blocks.
    source_blocks: int
    #: Blocks per inbox slot (one slot per engine, after the source blocks).
    slot_blocks: int
    #: Operations started per second by this engine, in all its loops.
    rate: float
    #: Loops, each with at most one operation under way.
    concurrency: int
    #: Each transfer's ``timeout`` is uniform in ``[deadline_min, deadline_max]`` seconds.
    deadline_min: float
    deadline_max: float
    #: At most this many blocks per transfer (and at most ``source_blocks``, ``slot_blocks``).
    max_blocks: int
    #: The JSON-lines file this worker appends to.
    events_path: str
    #: Seconds a failed read's destination blocks stay in quarantine (the late-bytes check).
    quarantine_s: float = 2.0
    rng_seed: int = 0
    #: The share of operations that are writes (each followed by its readback).
    write_fraction: float = 0.3
    #: ``connect_to``'s timeout, seconds.
    connect_timeout: float = 5.0

    def encode(self) -> bytes:
        return msgspec.msgpack.encode(self)

    @classmethod
    def decode(cls, data: bytes) -> WorkerSpec:
        return msgspec.msgpack.decode(data, type=cls)

    def check(self) -> None:
        """``ValueError`` naming the first field that cannot work."""
        n = len(self.names)
        if n < 1 or len(set(self.names)) != n or len(self.seeds) != n:
            raise ValueError("names must be distinct, one seed per name")
        if not 0 <= self.index < n:
            raise ValueError(f"index {self.index} out of range for {n} engines")
        if self.source_blocks < 1 or self.slot_blocks < 1 or self.max_blocks < 1:
            raise ValueError("source_blocks, slot_blocks and max_blocks must be >= 1")
        pool = self.num_blocks - self.source_blocks - n * self.slot_blocks
        if pool < self.max_blocks:
            raise ValueError(f"{self.num_blocks} blocks leave a destination pool of {pool} after "
                             f"{self.source_blocks} source blocks and {n} slots of {self.slot_blocks}; "
                             f"at least max_blocks={self.max_blocks} are needed")
        if not (math.isfinite(self.rate) and self.rate > 0) or self.concurrency < 1:
            raise ValueError("rate must be > 0 and concurrency >= 1")
        if not (0 < self.deadline_min <= self.deadline_max < math.inf):
            raise ValueError("need 0 < deadline_min <= deadline_max")
        if not (0 <= self.quarantine_s < math.inf) or not (0 < self.connect_timeout < math.inf):
            raise ValueError("quarantine_s must be >= 0 and connect_timeout > 0")
        if not 0 <= self.write_fraction <= 1:
            raise ValueError("write_fraction must be in [0, 1]")


# ---- bytes ------------------------------------------------------------------------------------


def region_views(regions: Sequence[Region]) -> list[ByteView]:
    """One writable ``(num_blocks, block_bytes)`` uint8 array per region, over the region's
    own host memory (the memory must stay alive while the arrays are used)."""
    views: list[ByteView] = []
    for region in regions:
        if region.mem_type != "DRAM":
            raise ValueError("the soak worker checks bytes in host memory (DRAM regions) only")
        views.append(block_view(region))
    return views


def byte_views(caches: Sequence[Any]) -> list[ByteView]:
    """:func:`region_views` of KV caches (CPU tensors or numpy arrays; kept alive by the caller)."""
    return region_views(describe_regions(caches))


def _digest(data: ByteView) -> bytes:
    return hashlib.blake2b(data.data, digest_size=16).digest()


class Truth:
    """What every engine's source blocks hold: digests per seed, computed on first use."""

    def __init__(self, sizes: Sequence[int], source_blocks: int) -> None:
        self.sizes = tuple(sizes)
        self.source_blocks = source_blocks
        self._digests: dict[int, list[list[bytes]]] = {}

    def expected(self, seed: int, region: int, block: int) -> ByteView:
        return block_bytes(seed, region, block, self.sizes[region])

    def digests(self, seed: int) -> list[list[bytes]]:
        """``[region][block]`` digests of seed ``seed``'s source blocks."""
        found = self._digests.get(seed)
        if found is None:
            found = self._digests[seed] = [
                [_digest(self.expected(seed, r, b)) for b in range(self.source_blocks)]
                for r in range(len(self.sizes))]
        return found

    def check(self, views: Sequence[ByteView], local: Sequence[int], seed: int,
              remote: Sequence[int]) -> list[tuple[int, int, int, int]]:
        """Compare our ``local`` blocks with seed ``seed``'s source blocks ``remote``: the
        ``(local, remote, region, bytes differing)`` of every block that differs."""
        digests = self.digests(seed)
        bad: list[tuple[int, int, int, int]] = []
        for r, view in enumerate(views):
            for lb, rb in zip(local, remote, strict=True):
                if _digest(view[lb]) != digests[r][rb]:
                    differ = int(np.count_nonzero(view[lb] != self.expected(seed, r, rb)))
                    bad.append((lb, rb, r, differ))
        return bad

    def identify(self, seeds: Sequence[int], region: int, data: ByteView) -> str:
        """What a block that did not verify holds, for a violation's detail: the canary
        (nothing landed), a source block of one of ``seeds`` (which), or neither."""
        canary = int(np.count_nonzero(data == CANARY))
        if canary == data.size:
            return "canary"
        digest = _digest(data)
        for seed in seeds:
            blocks = self.digests(seed)[region]
            if digest in blocks:
                return f"seed {seed} block {blocks.index(digest)}"
        return f"neither ({canary} canary bytes)"


#: How a late-bytes record says whether every changed byte is the peer's own (the read's
#: data, landing late) or not.
THEIRS = "every changed byte now holds the peer's source bytes of blocks"
NOT_THEIRS = "some changed bytes are not the peer's source bytes of blocks"


def fill_canary(views: Sequence[ByteView], blocks: Sequence[int]) -> None:
    for view in views:
        view[list(blocks)] = CANARY


def snapshot(views: Sequence[ByteView], blocks: Sequence[int]) -> list[ByteView]:
    """A copy of ``blocks`` of every region (``[region][i]``)."""
    return [view[list(blocks)].copy() for view in views]


def changed_to(views: Sequence[ByteView], block: int, snap: Sequence[ByteView], i: int,
               expected: Sequence[ByteView]) -> bool:
    """Whether every byte of ``block`` that changed since ``snap[..][i]`` now holds what
    ``expected[region]`` has at its place (late bytes of the read, perhaps only some)."""
    for view, old, want in zip(views, snap, expected, strict=True):
        moved = view[block] != old[i]
        if np.any(moved) and not np.array_equal(view[block][moved], want[moved]):
            return False
    return True


def changed_blocks(views: Sequence[ByteView], blocks: Sequence[int],
                   snap: Sequence[ByteView]) -> list[tuple[int, int]]:
    """``(block, bytes that differ in all regions)`` of each of ``blocks`` that changed
    since ``snap`` (from :func:`snapshot` of the same blocks)."""
    changed: list[tuple[int, int]] = []
    for i, block in enumerate(blocks):
        differ = sum(int(np.count_nonzero(view[block] != old[i]))
                     for view, old in zip(views, snap, strict=True))
        if differ:
            changed.append((block, differ))
    return changed


# ---- judging ----------------------------------------------------------------------------------


def judge(error: BaseException | None, elapsed: float, deadline: float, paused: bool) -> str | None:
    """The timing and typing verdict of one operation (bytes are judged elsewhere)."""
    if error is not None and not isinstance(error, AionixlError):
        return "untyped_error"
    if not paused and elapsed > deadline + LATE_SLACK:
        return "late_error" if error is not None else "late_result"
    return None


class PauseClock:
    """Notices when this process did not run: a tick ``threshold`` seconds later than the
    one before (SIGSTOP, or an event loop blocked that long) is a pause.

    A task ticks every ``period`` (:meth:`run`); every operation ticks too, when it starts
    and when it returns, so a pause is placed before, inside or after an operation exactly,
    even when the ticker has not run since.
    """

    def __init__(self, threshold: float = PAUSE_THRESHOLD, period: float = TICK_S, keep: int = 4096,
                 on_pause: Callable[[float, float, float], None] | None = None) -> None:
        self.threshold = threshold
        self.period = period
        #: ``on_pause(start, end, cpu seconds this process used meanwhile)`` for each pause.
        self.on_pause = on_pause
        self.pauses: deque[tuple[float, float]] = deque(maxlen=keep)
        self.last: float | None = None
        self._cpu = time.process_time()

    def tick(self, now: float) -> tuple[float, float] | None:
        """A moment ``now`` (anyio's clock) at which this process ran; the pause it ends, if
        it ends one."""
        last = self.last
        if last is not None and now <= last:
            return None
        self.last = now
        cpu = time.process_time()
        used, self._cpu = cpu - self._cpu, cpu
        if last is not None and now - last > self.threshold:
            self.pauses.append((last, now))
            if self.on_pause is not None:
                self.on_pause(last, now, used)
            return last, now
        return None

    def overlaps(self, start: float, end: float) -> bool:
        """Whether ``[start, end]`` overlaps a pause seen so far."""
        return any(ps < end and pe > start for ps, pe in reversed(self.pauses))

    def paused_during(self, start: float, end: float) -> bool:
        """Tick at ``end`` (the operation's return), then :meth:`overlaps`."""
        self.tick(end)
        return self.overlaps(start, end)

    async def run(self) -> None:
        """Tick forever."""
        while True:
            self.tick(anyio.current_time())
            await anyio.sleep(self.period)


# ---- records ----------------------------------------------------------------------------------


class Events:
    """The JSON-lines events file: appended to, a line flushed at a time."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._file: Any = None

    def open(self, first: dict[str, Any]) -> None:
        # A killed incarnation may have left half a line: end it, so ours start on a line.
        torn = False
        try:
            with open(self.path, "rb") as f:
                f.seek(0, os.SEEK_END)
                if f.tell():
                    f.seek(-1, os.SEEK_END)
                    torn = f.read(1) != b"\n"
        except FileNotFoundError:
            pass
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 - closed in close()
        if torn:
            self._file.write("\n")
        self.write(first)

    def write(self, record: dict[str, Any]) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(record, separators=(",", ":")) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def record(op: str, peer: str, blocks: int, nbytes: int, deadline: float, t: float, elapsed: float,
           error: BaseException | None, verified: int = 0, violation: str | None = None,
           detail: str = "", paused: bool = False, error_name: str | None = None) -> dict[str, Any]:
    """One operation record (the keys of :data:`RECORD_KEYS`)."""
    return {"t": t, "op": op, "peer": peer, "blocks": blocks, "bytes": nbytes, "deadline": deadline,
            "elapsed": elapsed, "ok": error is None and error_name is None,
            "error": error_name if error is None else type(error).__name__,
            "typed": isinstance(error, AionixlError), "verified_bytes": verified, "violation": violation,
            "detail": detail, "self_paused": paused}


# ---- the destination pool and the quarantine --------------------------------------------------


class BlockPool:
    """The free destination blocks."""

    def __init__(self, blocks: Sequence[int]) -> None:
        self._free = list(blocks)
        self._changed = anyio.Event()

    async def take(self, k: int, rng: random.Random) -> list[int]:
        while len(self._free) < k:
            await self._changed.wait()
        picked = sorted(rng.sample(range(len(self._free)), k), reverse=True)
        return [self._free.pop(i) for i in picked]

    def give(self, blocks: Sequence[int]) -> None:
        self._free.extend(blocks)
        self._changed.set()
        self._changed = anyio.Event()


@dataclass(slots=True)
class Held:
    due: float
    returned: float
    blocks: list[int]
    snap: list[ByteView]
    op: str
    peer: str
    seed: int
    #: The source blocks of ``seed`` that were to land in ``blocks``.
    expect: list[int]
    deadline: float
    error: str


class Quarantine:
    """Destination blocks of failed reads, copied when the call returned and compared again
    after ``hold_s``: a byte that changed landed late."""

    def __init__(self, views: Sequence[ByteView], truth: Truth, hold_s: float,
                 release: Callable[[list[int]], None], report: Callable[[dict[str, Any]], None]) -> None:
        self.views = views
        self.truth = truth
        self.hold_s = hold_s
        self._release = release
        self._report = report
        self.held: deque[Held] = deque()
        self.checked = 0
        self.late = 0

    def hold(self, blocks: list[int], *, op: str, peer: str, seed: int, expect: list[int],
             deadline: float, error: str) -> None:
        """Copy ``blocks`` now (synchronously: call it right when the transfer returned);
        ``expect``: the source blocks of ``seed`` that were to land there."""
        now = anyio.current_time()
        self.held.append(Held(now + self.hold_s, now, blocks, snapshot(self.views, blocks), op, peer, seed,
                              expect, deadline, error))

    def check_due(self, now: float) -> None:
        while self.held and self.held[0].due <= now:
            self._check(self.held.popleft(), now)

    def check_all(self, now: float) -> None:
        """Check everything held now, due or not (the final check; releases nothing)."""
        while self.held:
            self._check(self.held.popleft(), now, release=False)

    def _check(self, held: Held, now: float, release: bool = True) -> None:
        self.checked += 1
        changed = changed_blocks(self.views, held.blocks, held.snap)
        if changed:
            self.late += 1
            where = dict(zip(held.blocks, held.expect, strict=True))
            regions = range(len(self.views))
            theirs = all(changed_to(self.views, b, held.snap, held.blocks.index(b),
                                    [self.truth.expected(held.seed, r, where[b]) for r in regions])
                         for b, _ in changed)
            nbytes = sum(n for _, n in changed)
            detail = (f"{held.op} from {held.peer} failed with {held.error}; "
                      f"{now - held.returned:.3f} s later {nbytes} bytes had changed in destination blocks "
                      f"{[b for b, _ in changed]} (of {held.blocks}; per block {[n for _, n in changed]}); "
                      f"{THEIRS if theirs else NOT_THEIRS} {[where[b] for b, _ in changed]}")
            self._report(record("quarantine", held.peer, len(changed), nbytes, held.deadline, time.time(),
                                now - held.returned, None, error_name=held.error, violation="late_bytes",
                                detail=detail))
        if release:
            self._release(held.blocks)


# ---- the worker -------------------------------------------------------------------------------


class Worker:
    """One engine's soak worker (:func:`main` builds and runs it; tests drive it directly).
    ``ValueError`` for a spec that cannot work or does not fit the engine."""

    def __init__(self, engine: aionixl.Engine, spec: WorkerSpec) -> None:
        spec.check()
        name = engine.name
        if engine.discovery is None:
            raise ValueError(f"engine {name!r} has no discovery: the soak worker finds peers through it")
        if name != spec.names[spec.index]:
            raise ValueError(f"engine {name!r} is not names[{spec.index}] ({spec.names[spec.index]!r})")
        if engine.num_blocks != spec.num_blocks:
            raise ValueError(f"engine {name!r} has {engine.num_blocks} blocks, the spec {spec.num_blocks}")
        self.engine = engine
        self.spec = spec
        self.me = engine.name
        self.seed = spec.seeds[spec.index]
        self.seed_of = dict(zip(spec.names, spec.seeds, strict=True))
        self.views = region_views(engine.regions)
        self.block_total = sum(r.block_bytes for r in engine.regions)
        self.truth = Truth([r.block_bytes for r in engine.regions], spec.source_blocks)
        self.slot = spec.source_blocks + spec.index * spec.slot_blocks
        self.events = Events(spec.events_path)
        self.clock = PauseClock(on_pause=self.on_pause)
        self.registered: list[str] = []
        self.peers: dict[str, aionixl.Peer] = {}
        self.locks: dict[str, anyio.Lock] = {}
        self.connecting: set[str] = set()
        self.retry_at: dict[str, float] = {}  # name -> when a failed connect may be tried again
        self.slot_failed: dict[str, str] = {}  # target -> how our last write to its slot failed
        self.source_reported: set[tuple[int, int]] = set()
        self.counts = {"ops": 0, "ok": 0, "violations": 0, "pauses": 0, "self_paused": 0}
        self.pool: BlockPool
        self.quarantine: Quarantine
        self._names_changed: anyio.Event

    # ---- records ----

    def write(self, rec: dict[str, Any]) -> None:
        if rec.get("op") in OPERATIONS:
            self.counts["ops"] += 1
            self.counts["ok"] += bool(rec["ok"])
            self.counts["self_paused"] += bool(rec["self_paused"])
        if rec.get("violation") is not None:
            self.counts["violations"] += 1
        self.events.write(rec)

    def op_done(self, op: str, peer: str, blocks: int, deadline: float, t: float, start: float,
                error: BaseException | None, verified: int = 0, violation: str | None = None,
                detail: str = "", end: float | None = None) -> None:
        """Judge and record one operation that started at ``start`` and returned at ``end``
        (anyio's clock; default now), ``t`` its start in wall-clock time."""
        if end is None:
            end = anyio.current_time()
        elapsed = end - start
        paused = self.clock.paused_during(start, end)
        verdict = judge(error, elapsed, deadline, paused)
        if verdict is not None and violation is None:
            violation = verdict
        if error is not None and not detail:
            detail = str(error)[:500]
        if verdict == "untyped_error":
            detail = "".join(traceback.format_exception(error))[-2000:]
        self.write(record(op, peer, blocks, blocks * self.block_total, deadline, t, elapsed, error,
                          verified, violation, detail, paused))

    def begin(self) -> tuple[float, float]:
        """An operation starts: its wall-clock time, and anyio's clock (ticked)."""
        start = anyio.current_time()
        self.clock.tick(start)
        return time.time(), start

    def on_pause(self, start: float, end: float, cpu: float) -> None:
        self.counts["pauses"] += 1
        self.events.write({"event": "pause", "t": time.time() - (anyio.current_time() - start),
                           "duration": end - start, "cpu": cpu})

    # ---- running ----

    async def run(self) -> None:
        spec = self.spec
        self.pool = BlockPool(range(spec.source_blocks + len(spec.names) * spec.slot_blocks, spec.num_blocks))
        self.quarantine = Quarantine(self.views, self.truth, spec.quarantine_s, self.pool.give, self.write)
        self._names_changed = anyio.Event()
        self.events.open({"event": "start", "index": spec.index, "name": self.me, "pid": os.getpid(),
                          "t": time.time()})
        try:
            sources = range(spec.source_blocks)
            bad = self.truth.check(self.views, sources, self.seed, sources)
            if bad:
                raise ValueError(f"engine {self.me!r}'s source blocks are not make_caches(seed={self.seed}) "
                                 f"(block, region, bytes differing: {[(b[0], b[2], b[3]) for b in bad[:8]]})")
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.clock.run)
                tg.start_soon(self._refresh)
                tg.start_soon(self._checker)
                for i in range(spec.concurrency):
                    tg.start_soon(self._loop, i)
        except Exception as exc:
            self.events.write({"event": "crash", "t": time.time(), "error": type(exc).__name__,
                               "detail": "".join(traceback.format_exception(exc))[-4000:]})
            raise
        finally:
            # Synchronous: the task may be cancelled, and nothing here may wait.
            now = anyio.current_time()
            self.quarantine.check_all(now)
            self._check_sources()
            self.events.write({"event": "end", "t": time.time(), **self.counts,
                               "quarantine_checked": self.quarantine.checked,
                               "late_bytes": self.quarantine.late})
            self.events.close()

    async def _refresh(self) -> None:
        """Keep :attr:`registered` fresh (the last list stands while etcd does not answer)."""
        discovery = self.engine.discovery
        assert discovery is not None
        while True:
            try:
                records = await discovery.records()
            except AionixlError:
                pass
            except Exception as exc:
                self.write(record("discover", "", 0, 0, 0.0, time.time(), 0.0, exc, violation="untyped_error",
                                  detail="".join(traceback.format_exception(exc))[-2000:]))
            else:
                self.registered = sorted(n for n in records if n != self.me and n in self.seed_of)
            self._names_changed.set()
            self._names_changed = anyio.Event()
            await anyio.sleep(REFRESH_S)

    async def _checker(self) -> None:
        """Release quarantined blocks that are due; check our source blocks now and then."""
        next_sources = anyio.current_time() + SOURCE_CHECK_S
        while True:
            now = anyio.current_time()
            self.quarantine.check_due(now)
            if now >= next_sources:
                self._check_sources()
                next_sources = now + SOURCE_CHECK_S
            await anyio.sleep(0.1)

    def _check_sources(self) -> None:
        s = self.spec.source_blocks
        for local, _, region, differ in self.truth.check(self.views, range(s), self.seed, range(s)):
            if (local, region) not in self.source_reported:
                self.source_reported.add((local, region))
                self.write(record("source", self.me, 1, differ, 0.0, time.time(), 0.0, None,
                                  error_name="changed", violation="source_changed",
                                  detail=f"our source block {local} (region {region}), which nobody writes, "
                                         f"has {differ} bytes changed"))

    async def _loop(self, i: int) -> None:
        spec = self.spec
        rng = random.Random(f"{spec.rng_seed}:{spec.index}:{i}")
        rate = spec.rate / spec.concurrency
        next_start = anyio.current_time()
        while True:
            next_start += rng.expovariate(rate)
            now = anyio.current_time()
            if next_start > now:
                await anyio.sleep(next_start - now)
            else:  # behind (slow operations, a pause): start now, and owe at most a second
                next_start = max(next_start, now - 1.0)
                await anyio.lowlevel.checkpoint()
            if self.engine.closed:
                await anyio.sleep_forever()
            name = await self._pick(rng)
            peer = await self._peer(name)
            if peer is None:
                continue
            if rng.random() < spec.write_fraction:
                await self._write(peer, name, rng)
            else:
                await self._read(peer, name, rng)

    async def _pick(self, rng: random.Random) -> str:
        """A registered peer, not one being connected by another loop nor one whose connect
        failed within :data:`CONNECT_BACKOFF` (so a dead peer holds one loop, not all)."""
        while True:
            now = anyio.current_time()
            names = [n for n in self.registered
                     if n not in self.connecting and self.retry_at.get(n, 0.0) <= now]
            if names:
                return rng.choice(names)
            if not self.registered:
                await self._names_changed.wait()
            else:
                await anyio.sleep(0.05)

    def _drop(self, name: str, peer: aionixl.Peer) -> None:
        if self.peers.get(name) is peer:
            del self.peers[name]

    async def _peer(self, name: str) -> aionixl.Peer | None:
        peer = self.peers.get(name)
        if peer is not None and peer.connected:
            return peer
        self.peers.pop(name, None)
        timeout = self.spec.connect_timeout
        self.connecting.add(name)
        try:
            t, start = self.begin()
            try:
                peer = await self.engine.connect_to(name, timeout=timeout)
            except Exception as exc:
                self.op_done("connect", name, 0, timeout, t, start, exc)
                self.retry_at[name] = anyio.current_time() + CONNECT_BACKOFF
                return None
        finally:
            self.connecting.discard(name)
        self.op_done("connect", name, 0, timeout, t, start, None)
        self.peers[name] = peer
        return peer

    def _deadline(self, rng: random.Random) -> float:
        return rng.uniform(self.spec.deadline_min, self.spec.deadline_max)

    async def _read(self, peer: aionixl.Peer, name: str, rng: random.Random) -> None:
        spec = self.spec
        k = rng.randint(1, min(spec.max_blocks, spec.source_blocks))
        remote = rng.sample(range(spec.source_blocks), k)
        local = await self.pool.take(k, rng)
        await self._read_into(peer, name, local, remote, self.seed_of[name], remote, "read", rng)

    async def _read_into(self, peer: aionixl.Peer, name: str, local: list[int], remote: list[int], seed: int,
                         expect: list[int], op: str, rng: random.Random, note: str = "",
                         fresh: tuple[int, list[int]] | None = None) -> bool:
        """Read ``remote`` blocks of ``peer`` into ``local`` (taken from the pool, given back
        or quarantined here) and check them against ``seed``'s source blocks ``expect``
        (True when they verified). ``fresh``: a readback's (peer seed, inbox blocks), to say
        in a mismatch whether the blocks hold what the peer started with."""
        deadline = self._deadline(rng)
        fill_canary(self.views, local)
        t, start = self.begin()
        try:
            await self.engine.transfer_blocks(peer, local, remote, "read", timeout=deadline)
        except Exception as exc:
            end = anyio.current_time()
            self.quarantine.hold(local, op=op, peer=name, seed=seed, expect=expect, deadline=deadline,
                                 error=type(exc).__name__)
            self.op_done(op, name, len(local), deadline, t, start, exc, end=end)
            self._drop(name, peer)
            return False
        except BaseException:  # cancelled: the final check still looks at these blocks
            self.quarantine.hold(local, op=op, peer=name, seed=seed, expect=expect, deadline=deadline,
                                 error="cancelled")
            raise
        return self._verified(op, name, local, seed, expect, deadline, t, start, anyio.current_time(), note,
                              fresh)

    def _verified(self, op: str, name: str, local: list[int], seed: int, remote: list[int], deadline: float,
                  t: float, start: float, end: float, note: str, fresh: tuple[int, list[int]] | None) -> bool:
        bad = self.truth.check(self.views, local, seed, remote)
        if bad and fresh is not None:
            peer_seed, inbox = fresh
            initial = all(np.array_equal(view[lb], self.truth.expected(peer_seed, r, ib))
                          for lb, ib in zip(local, inbox, strict=True) for r, view in enumerate(self.views))
            note += "; they hold what the peer started with there (restarted?)" if initial else ""
        self.pool.give(local)
        if not bad:
            self.op_done(op, name, len(local), deadline, t, start, None,
                         verified=len(local) * self.block_total, end=end)
            return True
        local_of = {(lb, rb) for lb, rb, _, _ in bad}
        holds = [(lb, rb, r, n, self.truth.identify(self.spec.seeds, r, self.views[r][lb]))
                 for lb, rb, r, n in bad[:16]]
        detail = (f"{op} from {name} returned at {end - start:.3f} s but {len(local_of)} of "
                  f"{len(local)} blocks differ from source blocks of seed {seed}: "
                  f"(local, remote, region, bytes differing, what it holds) {holds}{note}")
        ok_blocks = len(local) - len({lb for lb, _ in local_of})
        self.op_done(op, name, len(local), deadline, t, start, None, verified=ok_blocks * self.block_total,
                     violation="bad_bytes", detail=detail, end=end)
        return False

    async def _write(self, peer: aionixl.Peer, name: str, rng: random.Random) -> None:
        spec = self.spec
        k = rng.randint(1, min(spec.max_blocks, spec.source_blocks, spec.slot_blocks))
        source = rng.sample(range(spec.source_blocks), k)
        inbox = list(range(self.slot, self.slot + k))
        local = await self.pool.take(k, rng)  # for the readback
        lock = self.locks.setdefault(name, anyio.Lock())
        try:
            async with lock:
                deadline = self._deadline(rng)
                t, start = self.begin()
                try:
                    await self.engine.transfer_blocks(peer, source, inbox, "write", timeout=deadline)
                except Exception as exc:
                    self.op_done("write", name, k, deadline, t, start, exc)
                    self.slot_failed[name] = f"{type(exc).__name__} at t={t:.3f}"
                    self._drop(name, peer)
                    return
                self.op_done("write", name, k, deadline, t, start, None)
                failed = self.slot_failed.get(name)
                note = f"; written to {name}'s inbox blocks {inbox}" + (
                    "" if failed is None else f"; an earlier write to this slot failed ({failed})")
                taken, local = local, []
                if await self._read_into(peer, name, taken, inbox, self.seed, source, "readback", rng,
                                         note=note, fresh=(self.seed_of[name], inbox)):
                    self.slot_failed.pop(name, None)
        finally:
            if local:
                self.pool.give(local)


async def main(engine: aionixl.Engine, args: bytes) -> None:
    """Run the soak worker of ``engine`` (``args``: a :class:`WorkerSpec`'s msgpack) until cancelled."""
    await Worker(engine, WorkerSpec.decode(args)).run()
