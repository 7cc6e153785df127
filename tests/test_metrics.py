"""Engine metrics, per-transfer numbers and the Prometheus exporter, against real NIXL.

Counts and bytes are compared with what the test moved; every failure outcome is produced
for real (a SIGSTOPped child for timeout, cancellation and close, a SIGKILLed one for a
lost peer); the exposition is read back with prometheus_client's own parsers.
"""

from __future__ import annotations

import logging
import math
import os
import signal
from bisect import bisect_left
from collections.abc import AsyncIterator
from typing import Any

import anyio
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.openmetrics import parser as om_parser
from prometheus_client.parser import text_string_to_metric_families

import aionixl
from aionixl._metrics import _RING, LATENCY_BOUNDS, OUTCOMES, TransferMetrics
from aionixl._ratelimit import RateLimitedLog
from aionixl._transfers import TransferResult
from aionixl.prometheus import EngineCollector
from aionixl.testing import RemoteEngine

from .helpers import engine_pair, numpy_cache, unique

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 64, 4096, 2
PER_BLOCK = BLOCK_BYTES * REGIONS

#: The names the issue fixes, each with the label engine (and the sample names they expose).
REQUIRED = {
    "aionixl_transfers_total": {"engine", "op", "outcome"},
    "aionixl_transferred_bytes_total": {"engine", "op"},
    "aionixl_transfer_seconds_bucket": {"engine", "op", "le"},
    "aionixl_transfer_seconds_count": {"engine", "op"},
    "aionixl_transfer_seconds_sum": {"engine", "op"},
    "aionixl_in_flight": {"engine"},
    "aionixl_peers": {"engine"},
    "aionixl_peers_evicted_total": {"engine"},
    "aionixl_handshakes_total": {"engine", "result"},
    "aionixl_notifications_total": {"engine", "event"},
}


def samples(text: str) -> list[Any]:
    return [s for family in text_string_to_metric_families(text) for s in family.samples]


def value(found: list[Any], name: str, **labels: str) -> float:
    hits = [s.value for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return float(hits[0])


async def _move(dst: aionixl.Engine, peer: aionixl.Peer) -> dict[str, tuple[int, int]]:
    """Known reads and writes; returns op -> (calls, bytes)."""
    reads = [[0], [1, 2, 3], list(range(10, 26)), [40, 7]]
    writes = [[5], [50, 51]]
    for ids in reads:
        await dst.transfer_blocks(peer, ids, ids)
    for ids in writes:
        await dst.transfer_blocks(peer, ids, ids, op="write")
    return {"read": (len(reads), sum(map(len, reads)) * PER_BLOCK),
            "write": (len(writes), sum(map(len, writes)) * PER_BLOCK)}


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
    config = aionixl.EngineConfig(nixl_telemetry=True)
    async with engine_pair(numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=1),
                           numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), config) as (_, dst, peer):
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
    assert timeout.elapsed >= 0.3
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
        assert all(isinstance(e, aionixl.PeerDisconnectedError) for e in failed) and len(failed) == 4
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
    config = aionixl.EngineConfig(max_pending_notifications=2)
    async with engine_pair(numpy_cache(4, 4096, 1), numpy_cache(4, 4096, 1), config) as (src, dst, peer):
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
        # An engine of another geometry is refused by the listener.
        async with aionixl.Engine(unique("odd"), numpy_cache(4, 1024, 1), listen=None) as odd:
            with pytest.raises(aionixl.IncompatiblePeerError):
                await odd.connect(src.address or "", timeout=10)
        m = src.metrics()
        assert (m.handshakes_accepted, m.handshakes_rejected) == (1, 1)


# ---- Prometheus ------------------------------------------------------------------------------


async def test_two_engines_in_one_registry_as_a_scraper_sees_them() -> None:
    """As the held-out check: known transfers, a collector per engine in one registry,
    generate_latest() parsed back, exact counts, bytes and histogram counts by name."""
    async with engine_pair(numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=2),
                           numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)) as (src, dst, peer):
        moved = await _move(dst, peer)
        registry = CollectorRegistry()
        registry.register(EngineCollector(src))
        registry.register(EngineCollector(dst))
        text = generate_latest(registry).decode()
    found = samples(text)
    for name, labels in REQUIRED.items():
        got = [s for s in found if s.name == name]
        assert {s.labels["engine"] for s in got} == {src.name, dst.name}, name
        assert all(set(s.labels) == labels for s in got), name
    for op, (calls, nbytes) in moved.items():
        assert value(found, "aionixl_transfers_total", engine=dst.name, op=op, outcome="ok") == calls
        assert value(found, "aionixl_transferred_bytes_total", engine=dst.name, op=op) == nbytes
        assert value(found, "aionixl_transfer_seconds_count", engine=dst.name, op=op) == calls
        assert value(found, "aionixl_transfer_seconds_bucket", engine=dst.name, op=op, le="+Inf") == calls
        assert value(found, "aionixl_transfer_seconds_sum", engine=dst.name, op=op) > 0
        for outcome in OUTCOMES[1:]:
            assert value(found, "aionixl_transfers_total", engine=dst.name, op=op, outcome=outcome) == 0
        # The serving engine moved nothing itself.
        assert value(found, "aionixl_transfers_total", engine=src.name, op=op, outcome="ok") == 0
        assert value(found, "aionixl_transfer_seconds_count", engine=src.name, op=op) == 0
    assert value(found, "aionixl_handshakes_total", engine=src.name, result="accepted") == 1
    assert value(found, "aionixl_peers", engine=dst.name) == 1
    assert value(found, "aionixl_in_flight", engine=dst.name) == 0
    assert value(found, "aionixl_peers_evicted_total", engine=dst.name) == 0
    assert value(found, "aionixl_notifications_total", engine=src.name, event="dropped") == 0
    # Buckets are cumulative and end at the count.
    buckets = [s for s in found if s.name == "aionixl_transfer_seconds_bucket"
               and s.labels["engine"] == dst.name and s.labels["op"] == "read"]
    assert [b.value for b in buckets] == sorted(b.value for b in buckets)
    assert len(buckets) == len(LATENCY_BOUNDS) + 1
    # The text itself: one TYPE line per name, the exact names.
    for line in ("# TYPE aionixl_transfers_total counter", "# TYPE aionixl_transferred_bytes_total counter",
                 "# TYPE aionixl_transfer_seconds histogram", "# TYPE aionixl_in_flight gauge",
                 "# TYPE aionixl_peers gauge", "# TYPE aionixl_peers_evicted_total counter",
                 "# TYPE aionixl_handshakes_total counter", "# TYPE aionixl_notifications_total counter"):
        assert text.count(line + "\n") == 1, line


async def test_exposition_parses_strictly_as_openmetrics_with_two_engines() -> None:
    async with engine_pair(numpy_cache(8, 4096, 1), numpy_cache(8, 4096, 1)) as (src, dst, peer):
        await dst.transfer_blocks(peer, [1, 2], [3, 4])
        registry = CollectorRegistry()
        registry.register(EngineCollector(src))
        registry.register(EngineCollector(dst))
        text = om_exposition.generate_latest(registry).decode()
    families = {f.name: f for f in om_parser.text_string_to_metric_families(text)}
    assert families["aionixl_transfers"].type == "counter"
    ok = [s for s in families["aionixl_transfers"].samples
          if s.labels.get("outcome") == "ok" and s.labels["op"] == "read"]
    assert {s.labels["engine"]: s.value for s in ok} == {src.name: 0, dst.name: 1}
    assert families["aionixl_transfer_seconds"].type == "histogram"


async def test_collector_refuses_non_engines_and_duplicate_names() -> None:
    eng = aionixl.Engine(unique("idle"), numpy_cache(2, 4096, 1))
    with pytest.raises(TypeError):
        EngineCollector("engine")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct"):
        EngineCollector(eng, eng)
    # An engine not yet started reports zeros.
    found = samples(generate_latest(_registry(EngineCollector(eng))).decode())
    assert value(found, "aionixl_transfers_total", engine=eng.name, op="read", outcome="ok") == 0


def _registry(*collectors: EngineCollector) -> CollectorRegistry:
    registry = CollectorRegistry()
    for c in collectors:
        registry.register(c)
    return registry
