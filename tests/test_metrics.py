"""Engine metrics and per-transfer numbers, against real NIXL.

Counts and bytes are compared with what the test moved; every failure outcome is produced
for real (a SIGSTOPped child for timeout, cancellation and close, a SIGKILLed one for a
lost peer); snapshots are read from another thread while the engine moves blocks. The
Prometheus exposition is in test_prometheus.py.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import sys
import threading
from bisect import bisect_left
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, Literal

import anyio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

import aionixl
import aionixl.lowlevel
from aionixl._metrics import _RING, LATENCY_BOUNDS, OPS, OUTCOMES, EngineMetrics, TransferMetrics
from aionixl._ratelimit import RateLimitedLog
from aionixl._transfers import TransferResult
from aionixl.prometheus import EngineCollector
from aionixl.testing import RemoteEngine

from .helpers import engine_pair, numpy_cache, unique

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 64, 4096, 2
PER_BLOCK = BLOCK_BYTES * REGIONS

async def test_counts_bytes_and_histograms_equal_what_was_moved() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=5)
    async with engine_pair(src_cache, numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)) as (src, dst, peer):
        results = [await dst.transfer_blocks(peer, [i], [i]) for i in range(3)]
        results.append(await dst.transfer_blocks(peer, [3, 4, 9], [3, 4, 9], op="write"))
        for r, blocks in zip(results, [1, 1, 1, 3], strict=True):
            nblocks, nbytes, seconds = r[:3]  # the first three stay where they were
            assert (nblocks, nbytes) == (blocks, blocks * PER_BLOCK)
            assert r.descriptors == blocks * REGIONS  # no NIXL telemetry: blocks x regions
            assert 0 < r.post_seconds <= r.transfer_seconds <= seconds
        with pytest.raises(ValueError):
            await dst.transfer_blocks(peer, [BLOCKS], [0])  # refused before NIXL: not counted
        # Past the 1024 transfers recorded between folds into the histograms.
        for i in range(1100):
            await dst.transfer_blocks(peer, [i % BLOCKS], [i % BLOCKS])
        m = dst.metrics()
        assert m.engine == dst.name
        assert m.transfers["read"] == {o: (1103 if o == "ok" else 0) for o in OUTCOMES}
        assert m.transfers["write"] == {o: (1 if o == "ok" else 0) for o in OUTCOMES}
        assert m.transferred_bytes == {"read": 1103 * PER_BLOCK, "write": 3 * PER_BLOCK}
        assert m.transfer_seconds["read"].count == 1103 and m.post_seconds["read"].count == 1103
        assert m.transfer_seconds["write"].count == 1 and m.post_seconds["write"].count == 1
        assert m.transfer_seconds["write"].sum == pytest.approx(results[3].seconds)
        assert m.post_seconds["write"].sum == pytest.approx(results[3].post_seconds)
        assert m.transfer_seconds["read"].sum >= sum(r.seconds for r in results[:3])
        assert (m.in_flight, m.peers, m.peers_evicted) == (0, 1, 0)
        # The source only served: it counts the handshake, no transfers.
        s = src.metrics()
        assert sum(sum(by.values()) for by in s.transfers.values()) == 0
        assert (s.handshakes_accepted, s.handshakes_rejected, s.peers) == (1, 0, 1)
        assert s.transferred_bytes == {"read": 0, "write": 0}
    assert np.array_equal(dst._kv_caches[0][:3], src_cache[0][:3])
    after = dst.metrics()  # still readable once closed
    assert after.transfers["read"]["ok"] == 1103 and after.peers == 0


async def test_nixl_telemetry_reports_merged_descriptors() -> None:
    tuning = aionixl.lowlevel.Tuning(nixl_telemetry=True)
    async with engine_pair(numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=1),
                           numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), tuning=tuning) as (_, dst, peer):
        await dst.transfer_blocks(peer, [0], [0])
        r = await dst.transfer_blocks(peer, list(range(8, 16)), list(range(8, 16)))
        assert (r.blocks, r.nbytes) == (8, 8 * PER_BLOCK)
        # NIXL merged each region's contiguous run: fewer descriptors than blocks x regions.
        assert 1 <= r.descriptors < 8 * REGIONS
        assert 0 < r.post_seconds <= r.transfer_seconds
        assert dst.metrics().transfers["read"]["ok"] == 2


def test_histogram_folding_puts_each_value_where_bisect_does() -> None:
    m = TransferMetrics(tuple, 10, 2, RateLimitedLog(logging.getLogger("test")))
    values = [*LATENCY_BOUNDS, 0.0, 3e-7, 1.5e-6, 7e-4, 0.3, 11.0, math.nextafter(1e-5, 1)]
    for i, v in enumerate(values):
        # started 0, posted at v/2, seen at v, returns at v
        m.done("write" if i % 3 == 0 else "read", i + 1, 0.0, v / 2, v, v, None)
    m.flush()
    for w, op in enumerate(("read", "write")):
        mine = [(i, v) for i, v in enumerate(values) if (i % 3 == 0) == (op == "write")]
        want = [0] * (len(LATENCY_BOUNDS) + 1)
        for _, v in mine:
            want[bisect_left(LATENCY_BOUNDS, v)] += 1
        assert m.seconds[w] == want
        assert m.outcomes[w][0] == len(mine)
        assert m.bytes[w] == sum(i + 1 for i, _ in mine) * 10
        assert m.seconds_sum[w] == pytest.approx(sum(v for _, v in mine))
        assert m.post_sum[w] == pytest.approx(sum(v / 2 for _, v in mine))


def test_done_one_records_exactly_what_done_records_for_one_block() -> None:
    noisy = RateLimitedLog(logging.getLogger("test"))
    general = TransferMetrics(TransferResult, 10, 3, noisy)
    lean = TransferMetrics(TransferResult, 10, 3, noisy)
    for i, v in enumerate([*LATENCY_BOUNDS, 0.0, 4e-6, 0.03]):
        op = "write" if i % 4 == 0 else "read"
        started = 100.0 + i  # posted v/3 later, seen at 2v/3, returned at v
        times = (started, started + v / 3, started + 2 * v / 3, started + v)
        assert lean.done_one(op, *times) == general.done(op, 1, *times, None)
    # Past the transfers kept between folds, so that done_one folds by itself too.
    for i in range(2 * _RING + 7):
        op = "read" if i % 5 else "write"
        times = (1.0, 1.0 + i * 1e-7, 1.0 + i * 2e-7, 1.0 + i * 3e-7)
        assert lean.done_one(op, *times) == general.done(op, 1, *times, None)
    general.flush()
    lean.flush()
    for field in ("outcomes", "bytes", "seconds", "post"):
        assert getattr(lean, field) == getattr(general, field), field
    for field in ("seconds_sum", "post_sum"):  # summed in other chunks: rounding may differ
        assert getattr(lean, field) == pytest.approx(getattr(general, field)), field
    assert lean.outcomes[0][0] > 2 * _RING * 3 // 5 and lean.outcomes[1][0] > 0


def test_done_part_records_what_done_records_with_bytes_of_its_own() -> None:
    """``done_part`` keeps a ring of its own (bytes, not blocks): what it counts equals what
    ``done`` counts for the same transfers moving as many bytes, past several folds, and
    its results carry the bytes and descriptors given (or NIXL's telemetry)."""
    noisy = RateLimitedLog(logging.getLogger("test"))
    general = TransferMetrics(TransferResult, 10, 3, noisy)
    parts = TransferMetrics(TransferResult, 10, 3, noisy)
    for i in range(2 * _RING + 11):
        op = "read" if i % 3 else "write"
        nblocks = 1 + i % 4
        v = (*LATENCY_BOUNDS, 0.0, 4e-6)[i % (len(LATENCY_BOUNDS) + 2)]
        times = (7.0, 7.0 + v / 3, 7.0 + 2 * v / 3, 7.0 + v)
        whole = general.done(op, nblocks, *times, None)
        got = parts.done_part(op, nblocks, nblocks * 10, nblocks * 5, *times, None)
        assert got == (*whole[:5], nblocks * 5)
        if i % 1000 == 0:
            assert parts.snapshot() == general.snapshot()
    assert parts.version >= 2  # its ring folded by itself
    assert parts.snapshot() == general.snapshot()
    general.flush()
    parts.flush()
    for field in ("outcomes", "bytes", "seconds", "post"):
        assert getattr(parts, field) == getattr(general, field), field
    for field in ("seconds_sum", "post_sum"):
        assert getattr(parts, field) == pytest.approx(getattr(general, field)), field
    # NIXL's telemetry replaces the engine's post, transfer seconds and descriptors.
    got = parts.done_part("write", 2, 6, 4, 1.0, 1.5, 2.0, 3.0, (0.25, 0.5, 3))
    assert got == (2, 6, 2.0, 0.25, 0.5, 3)
    snap = parts.snapshot()
    assert snap["transferred_bytes"]["write"] == parts.bytes[1] + 6
    assert snap["post_seconds"]["write"].sum == pytest.approx(parts.post_sum[1] + 0.25)
    # Exact however many bytes (summed as ints, never as floats).
    huge = TransferMetrics(TransferResult, 10, 3, noisy)
    for _ in range(_RING):
        huge.done_part("read", 1, 2**53 + 1, 1, 0.0, 0.0, 0.0, 0.0, None)
    assert huge.snapshot()["transferred_bytes"]["read"] == _RING * (2**53 + 1)
    assert huge.bytes[0] == _RING * (2**53 + 1)  # folded by then


async def test_merged_one_block_reads_are_each_counted_with_their_own_seconds() -> None:
    async with engine_pair(numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=3),
                           numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)) as (_, dst, peer):
        results: list[TransferResult] = []

        async def read(block: int) -> None:
            results.append(await dst.transfer_blocks(peer, [block], [block]))

        async with anyio.create_task_group() as tg:
            for block in range(BLOCKS):
                tg.start_soon(read, block)
        assert dst._coalescer.merged_calls > 0  # most rode in merged requests
        m = dst.metrics()
        assert m.transfers["read"]["ok"] == BLOCKS
        assert m.transferred_bytes["read"] == BLOCKS * PER_BLOCK
        assert m.transfer_seconds["read"].count == m.post_seconds["read"].count == BLOCKS
        assert sum(m.transfer_seconds["read"].counts) == BLOCKS
        assert m.transfer_seconds["read"].sum == pytest.approx(sum(r.seconds for r in results))
        assert m.post_seconds["read"].sum == pytest.approx(sum(r.post_seconds for r in results))


# ---- failures, produced for real -------------------------------------------------------------


@pytest.fixture
async def stopped_tcp_peer(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Any]:
    """A TCP-only child engine (a stopped one leaves transfers in flight) and a freezer."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    async with RemoteEngine(seed=1, num_blocks=8, block_shape=(1 << 20,), dtypes=("uint8",),
                            env={"UCX_TLS": "tcp"}) as child:

        class Freezer:
            def __enter__(self) -> None:
                os.kill(child.pid, signal.SIGSTOP)

            def __exit__(self, *exc: object) -> None:
                os.kill(child.pid, signal.SIGCONT)

        yield child, Freezer
        os.kill(child.pid, signal.SIGCONT)


def _records(caplog: pytest.LogCaptureFixture, cause: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "cause", None) == cause]


async def test_timeout_cancelled_and_closed_are_counted_and_logged(
        stopped_tcp_peer: Any, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aionixl")
    child, frozen = stopped_tcp_peer
    eng = aionixl.Engine(unique("dec"), numpy_cache(8, 1 << 20, 1), listen=None)
    closed: list[BaseException] = []
    async with eng:
        peer = await eng.connect(child.address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0], timeout=30)
        with frozen():
            with anyio.move_on_after(0.2) as scope:
                await eng.transfer_blocks(peer, [3], [3], op="write")
            assert scope.cancelled_caught
            with pytest.raises(aionixl.TransferTimeoutError):
                await eng.transfer_blocks(peer, [1, 2], [1, 2], timeout=0.3)
            m = eng.metrics()
            assert m.transfers["read"] == {**dict.fromkeys(OUTCOMES, 0), "ok": 1, "timeout": 1}
            assert m.transfers["write"] == {**dict.fromkeys(OUTCOMES, 0), "cancelled": 1}
            assert m.transferred_bytes == {"read": 1 << 20, "write": 0}  # failures move nothing
            assert m.transfer_seconds["read"].count == 1 and m.transfer_seconds["write"].count == 0

        # The stopped peer could not confirm the timed-out read: it was evicted to fence it,
        # and the same Peer reconnects on its next use.
        await eng.transfer_blocks(peer, [6], [6], timeout=30)
        with frozen():
            async def doomed(i: int) -> None:
                try:
                    await eng.transfer_blocks(peer, [i], [i], timeout=60)
                except aionixl.EngineClosedError as exc:
                    closed.append(exc)

            async with anyio.create_task_group() as tg:
                for i in (4, 5):
                    tg.start_soon(doomed, i)
                while eng.metrics().in_flight < 2:
                    await anyio.sleep(0.01)
                await eng.aclose()
    assert len(closed) == 2
    m = eng.metrics()
    assert m.transfers["read"] == {**dict.fromkeys(OUTCOMES, 0), "ok": 2, "timeout": 1, "closed": 2}
    assert m.in_flight == 0
    (timeout,) = _records(caplog, "timeout")
    assert timeout.levelno == logging.WARNING
    assert (timeout.peer, timeout.op, timeout.blocks, timeout.bytes) == (peer.name, "read", 2, 2 << 20)
    # At least the timeout, give or take the loop's clock: uvloop reads a time cached at the
    # start of its loop iteration (1 ms steps), so a deadline set later fires up to that early.
    assert timeout.elapsed >= 0.3 - 0.005
    (cancelled,) = _records(caplog, "cancelled")
    assert (cancelled.op, cancelled.blocks, cancelled.bytes) == ("write", 1, 1 << 20)
    # Two closed transfers, one record: the second is held back by the rate limit.
    (closing,) = _records(caplog, "closed")
    assert closing.peer == peer.name and closing.blocks == 1


async def test_a_killed_peer_counts_peer_disconnected_and_one_eviction(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="aionixl")
    async with RemoteEngine(seed=2, num_blocks=32, block_shape=(1 << 16,), dtypes=("uint8", "uint8")
                            ) as child, \
            aionixl.Engine(unique("dec"), numpy_cache(32, 1 << 16, 2), listen=None) as eng:
        peer = await eng.connect(child.address, timeout=30)
        assert eng.metrics().peers == 1
        failed: list[BaseException] = []
        reads = [0]

        async def keep_reading(worker: int) -> None:
            ids = list(range(worker * 8, worker * 8 + 8))
            try:
                while True:
                    await eng.transfer_blocks(peer, ids, ids, timeout=10)
                    reads[0] += 1
            except Exception as exc:
                failed.append(exc)

        async with anyio.create_task_group() as tg:
            for worker in range(4):
                tg.start_soon(keep_reading, worker)
            await anyio.sleep(0.3)
            await child.kill()
        assert all(isinstance(e, aionixl.PeerDisconnectedError) for e in failed) and len(failed) == 4, failed
        with pytest.raises(aionixl.PeerDisconnectedError):
            await eng.transfer_blocks(peer, [0], [0])  # refused before NIXL: not counted
        m = eng.metrics()
        # Workers whose transfer was posted when the peer went count as peer_disconnected;
        # those that only called afterwards were refused before NIXL (not counted).
        assert 1 <= m.transfers["read"]["peer_disconnected"] <= 4
        assert m.transfers["read"]["ok"] == reads[0] > 0
        assert m.transferred_bytes["read"] == reads[0] * 8 * 2 * (1 << 16)
        assert m.peers_evicted == 1 == sum(m.evictions.values())
        assert m.peers == 0
    (evicted,) = [r for r in caplog.records if r.getMessage().startswith("evicting peer")]
    assert evicted.peer == peer.name and evicted.cause in m.evictions
    assert _records(caplog, "peer_disconnected")[0].peer == peer.name


async def test_notifications_delivered_and_dropped_and_handshakes_rejected() -> None:
    tuning = aionixl.lowlevel.Tuning(max_pending_notifications=2)
    async with engine_pair(numpy_cache(4, 4096, 1), numpy_cache(4, 4096, 1),
                           tuning=tuning) as (src, dst, peer):
        for message in (b"a", b"b", b"c"):
            await dst.send_notification(peer, message)
        with anyio.fail_after(10):
            while src.metrics().notifications_dropped < 1:
                await anyio.sleep(0.005)
        assert (await src.wait_notification(b"c", timeout=10)).message == b"c"
        assert (await src.wait_notification(b"b", timeout=10)).message == b"b"
        with pytest.raises(TimeoutError):
            await src.wait_notification(b"a", timeout=0.05)  # the oldest one was dropped
        m = src.metrics()
        assert (m.notifications_delivered, m.notifications_dropped, m.notifications_kept) == (2, 1, 0)
        # An engine of another geometry (region count) is refused by the listener.
        async with aionixl.Engine(unique("odd"), numpy_cache(4, 4096, 2), listen=None) as odd:
            with pytest.raises(aionixl.IncompatiblePeerError):
                await odd.connect(src.address or "", timeout=10)
        m = src.metrics()
        assert (m.handshakes_accepted, m.handshakes_rejected) == (1, 1)


# ---- snapshots from another thread -----------------------------------------------------------
#
# prometheus_client's start_http_server scrapes from a thread of its own while the engine runs
# in its event loop. The tests below read from a plain thread (the package itself runs none)
# with the interpreter switching threads every microsecond, so reads land between any two
# steps of the recording and of the folds.


@pytest.fixture
def switch_often() -> Iterator[None]:
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(before)


#: What one read shows of one op: calls ok, bytes, then the counts of both histograms.
Reading = tuple[int, int, int, int]


def _reading(fields: dict[str, Any] | EngineMetrics, op: str) -> Reading:
    get = fields.__getitem__ if isinstance(fields, dict) else lambda name: getattr(fields, name)
    return (get("transfers")[op]["ok"], get("transferred_bytes")[op],
            get("transfer_seconds")[op].count, get("post_seconds")[op].count)


class Tally:
    """Per op: calls and blocks begun and finished, as the recording side counts them. A read
    taken after ``finished`` was copied and before ``started`` was must lie between them."""

    def __init__(self) -> None:
        self.started = {op: [0, 0] for op in OPS}
        self.finished = {op: [0, 0] for op in OPS}

    def bounds(self, op: str, which: dict[str, list[int]], bytes_per_block: int) -> Reading:
        calls, blocks = which[op][:]  # one copy: a consistent pair
        return calls, blocks * bytes_per_block, calls, calls


class Checker:
    """Checks each read from the scraping thread: within bounds, consistent within itself,
    never below the read before it."""

    def __init__(self, tally: Tally, bytes_per_block: int) -> None:
        self.tally = tally
        self.bytes_per_block = bytes_per_block
        self.last: dict[tuple[str, str], Reading] = {}
        self.reads = 0

    def low(self) -> dict[str, Reading]:
        return {op: self.tally.bounds(op, self.tally.finished, self.bytes_per_block) for op in OPS}

    def high(self) -> dict[str, Reading]:
        return {op: self.tally.bounds(op, self.tally.started, self.bytes_per_block) for op in OPS}

    def check(self, source: str, op: str, got: Reading, low: Reading, high: Reading) -> None:
        assert all(lo <= g <= hi for lo, g, hi in zip(low, got, high, strict=True)), \
            (source, op, low, got, high)
        assert got[0] == got[2] == got[3], (source, op, got)  # every count saw the same transfers
        before = self.last.get((source, op), (0, 0, 0, 0))
        assert all(b <= g for b, g in zip(before, got, strict=True)), (source, op, before, got)
        self.last[source, op] = got
        self.reads += 1


def _scraping(checker: Checker, read: Callable[[Checker], None]
              ) -> tuple[threading.Thread, Callable[[], list[BaseException]]]:
    """A thread calling ``read(checker)`` until stopped; returns it and its stop-and-join."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                read(checker)
        except BaseException as exc:  # reported by the test, with its traceback
            errors.append(exc)

    thread = threading.Thread(target=run, name="scraper", daemon=True)

    def finish() -> list[BaseException]:
        stop.set()
        thread.join(60)
        assert not thread.is_alive()
        return errors

    return thread, finish


def test_snapshots_from_another_thread_count_each_transfer_once(switch_often: None) -> None:
    """The seqlock alone: this thread records (both ops, one block and several, whole blocks
    and parts, past many folds) while another snapshots; every read is exact and the end
    counts are."""
    bytes_per_block = 10
    values = [*LATENCY_BOUNDS, 0.0, 3e-7, 4e-3, 11.0]
    m = TransferMetrics(TransferResult, bytes_per_block, 2, RateLimitedLog(logging.getLogger("test")))
    tally = Tally()
    per_value = {op: [0] * len(values) for op in OPS}  # transfers recorded with each value
    checker = Checker(tally, bytes_per_block)

    def read(c: Checker) -> None:
        low = c.low()
        snap = m.snapshot()
        high = c.high()
        for op in OPS:
            c.check("snapshot", op, _reading(snap, op), low[op], high[op])

    thread, finish = _scraping(checker, read)
    thread.start()
    try:
        for i in range(400_000):
            op = OPS[i % 3 == 0]  # two reads, one write
            k = i % len(values)
            v = values[k]
            started, finished = tally.started[op], tally.finished[op]
            nblocks = 1 if i % 5 else 1 + i % 4
            started[1] += nblocks
            started[0] += 1
            if nblocks == 1 and i % 10:
                m.done_one(op, 0.0, v / 2, v, v)
            elif i % 2:
                m.done(op, nblocks, 0.0, v / 2, v, v, None)
            else:  # a transfer of block parts, moving as many bytes (a ring of its own)
                m.done_part(op, nblocks, nblocks * bytes_per_block, 1, 0.0, v / 2, v, v, None)
            finished[0] += 1
            finished[1] += nblocks
            per_value[op][k] += 1
    finally:
        errors = finish()
    assert errors == []
    assert checker.reads > 100  # the reads above were made, many of them
    # Folds happened meanwhile: one-block reads alone fill their ring 52 times.
    assert m.version >= 2 * 50 and m.version % 2 == 0
    end = m.snapshot()
    for op in OPS:
        calls, blocks = tally.finished[op]
        assert _reading(end, op) == (calls, blocks * bytes_per_block, calls, calls)
        assert end["transfers"][op] == {o: (calls if o == "ok" else 0) for o in OUTCOMES}
        for field, scale in (("transfer_seconds", 1.0), ("post_seconds", 0.5)):
            want = [0] * (len(LATENCY_BOUNDS) + 1)
            for v, n in zip(values, per_value[op], strict=True):
                want[bisect_left(LATENCY_BOUNDS, v * scale)] += n
            assert list(end[field][op].counts) == want, field
            assert end[field][op].sum == pytest.approx(
                sum(v * scale * n for v, n in zip(values, per_value[op], strict=True)))
    assert tally.started == tally.finished


async def test_metrics_and_the_collector_from_another_thread_while_transfers_run(
        switch_often: None) -> None:
    """Real transfers (one block and several, read and write, merged and alone, past the
    folds) while a thread reads engine.metrics() and scrapes the collector: every read lies
    between what had finished and what had begun, never goes down, and the end is exact."""
    rounds = 1500
    # Blocks per call of each task: 6 x 1500 one-block reads fill their ring (done_one) at
    # least twice, so at least two folds run while the thread reads.
    nblocks_of: dict[Literal["read", "write"], tuple[int, ...]] = {
        "read": (1, 1, 1, 1, 1, 1, 4, 2), "write": (1, 1, 3)}
    async with engine_pair(numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=6),
                           numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)) as (src, dst, peer):
        tally = Tally()
        checker = Checker(tally, PER_BLOCK)
        registry = CollectorRegistry()
        registry.register(EngineCollector(src, dst))
        in_flight: list[float] = []

        def read(c: Checker) -> None:
            low = c.low()
            m = dst.metrics()
            text = generate_latest(registry).decode()
            high = c.high()
            found = {(s.name, s.labels.get("engine"), s.labels.get("op"), s.labels.get("outcome")): s.value
                     for f in text_string_to_metric_families(text) for s in f.samples
                     if "le" not in s.labels}
            # Quick reads too: the in-flight table's count runs while the loop changes it.
            in_flight.extend(dst.metrics().in_flight for _ in range(20))
            in_flight.append(m.in_flight)
            for op in OPS:
                c.check("metrics", op, _reading(m, op), low[op], high[op])
                scraped = tuple(int(found[name, dst.name, op, outcome]) for name, outcome in (
                    ("aionixl_transfers_total", "ok"), ("aionixl_transferred_bytes_total", None),
                    ("aionixl_transfer_seconds_count", None), ("aionixl_transfer_post_seconds_count", None)))
                c.check("collector", op, scraped, low[op], high[op])  # type: ignore[arg-type]
                assert found["aionixl_transfers_total", src.name, op, "ok"] == 0

        # A quarter, half and three quarters in, every worker waits until the thread has read
        # a third, two thirds, all of ten rounds: its reads fall among the transfers however
        # fast the loop runs them (on uvloop, all once finished before ten rounds were read).
        paced = {rounds * k // 4: 4 * 10 * k // 3 for k in (1, 2, 3)}

        async def worker(op: Literal["read", "write"], nblocks: int, first: int) -> None:
            started, finished = tally.started[op], tally.finished[op]
            for i in range(rounds):
                if i in paced:
                    with anyio.fail_after(60):
                        while checker.reads < paced[i]:
                            await anyio.sleep(0.001)
                at = (first + i * nblocks) % (BLOCKS - nblocks)
                ids = list(range(at, at + nblocks))
                started[1] += nblocks
                started[0] += 1
                await dst.transfer_blocks(peer, ids, ids, op=op, timeout=60)
                finished[0] += 1
                finished[1] += nblocks

        thread, finish = _scraping(checker, read)
        thread.start()
        try:
            async with anyio.create_task_group() as tg:
                for op, sizes in nblocks_of.items():
                    for w, nblocks in enumerate(sizes):
                        tg.start_soon(worker, op, nblocks, 17 * w)
        finally:
            errors = finish()
        assert errors == []
        assert checker.reads >= 4 * 10  # at least ten rounds of reads, each op from each source
        assert max(in_flight) <= sum(map(len, nblocks_of.values())) and min(in_flight) >= 0
        assert dst._transfer_metrics.version >= 2 * 2  # folds at 4096 happened meanwhile
        m = dst.metrics()
        assert m.merged_requests > 0  # some one-block calls rode merged requests (done_one)
        text = generate_latest(registry).decode()
    total = 0
    for op, sizes in nblocks_of.items():
        calls, nbytes = rounds * len(sizes), rounds * sum(sizes) * PER_BLOCK
        total += calls
        assert tally.finished[op] == [calls, rounds * sum(sizes)]
        assert _reading(m, op) == (calls, nbytes, calls, calls)
        assert m.transfers[op] == {o: (calls if o == "ok" else 0) for o in OUTCOMES}
        assert sum(m.transfer_seconds[op].counts) == sum(m.post_seconds[op].counts) == calls
        found = {(s.name, s.labels.get("engine"), s.labels.get("op"), s.labels.get("le")): s.value
                 for f in text_string_to_metric_families(text) for s in f.samples
                 if s.labels.get("outcome") in (None, "ok")}
        assert found["aionixl_transfers_total", dst.name, op, None] == calls
        assert found["aionixl_transferred_bytes_total", dst.name, op, None] == nbytes
        assert found["aionixl_transfer_seconds_bucket", dst.name, op, "+Inf"] == calls
        assert found["aionixl_transfer_post_seconds_count", dst.name, op, None] == calls
    assert total >= 10_000


async def test_in_flight_from_another_thread_while_the_table_changes(
        monkeypatch: pytest.MonkeyPatch, switch_often: None) -> None:
    """Over TCP, without merging, each caller's request waits in the in-flight table, which
    the loop changes all the time: counting it from another thread never fails, and never
    counts more callers than there are."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    workers, rounds = 16, 200
    config = aionixl.EngineConfig(coalesce=False)
    async with engine_pair(numpy_cache(workers, 1 << 16, 1, seed=7), numpy_cache(workers, 1 << 16, 1),
                           config) as (_, dst, peer):
        seen: list[int] = []

        def read(c: Checker) -> None:
            counts = [dst._inflight.callers() for _ in range(100)]  # quick, as often as can be
            counts.append(dst.metrics().in_flight)
            assert all(0 <= n <= workers for n in counts), counts
            seen.extend(counts)
            c.reads += 1

        async def worker(w: int) -> None:
            for _ in range(rounds):
                await dst.transfer_blocks(peer, [w], [w], op="read" if w % 2 else "write", timeout=60)

        thread, finish = _scraping(Checker(Tally(), 1), read)
        thread.start()
        try:
            async with anyio.create_task_group() as tg:
                for w in range(workers):
                    tg.start_soon(worker, w)
        finally:
            errors = finish()
        assert errors == []
        # The table was counted while it held requests, many times.
        assert sum(1 for n in seen if n > 0) > 1000
        m = dst.metrics()
        assert m.in_flight == 0 and m.transfers["read"]["ok"] == m.transfers["write"]["ok"] == 8 * rounds
        assert m.merged_requests == 0
