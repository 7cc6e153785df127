"""The Prometheus collector, read back the way a scraper reads it.

Every scrape goes through prometheus_client itself (``generate_latest``, a restricted
registry, the WSGI app with ``?name[]=``, the OpenMetrics exposition) and is parsed back
with prometheus_client's own parsers; counts come from real NIXL transfers.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any
from wsgiref.util import setup_testing_defaults

import pytest
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app
from prometheus_client.openmetrics import exposition as om_exposition
from prometheus_client.openmetrics import parser as om_parser
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import DuplicateTimeseries

import aionixl
from aionixl._metrics import LATENCY_BOUNDS, OUTCOMES
from aionixl.prometheus import EngineCollector

from .helpers import engine_pair, numpy_cache, unique

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 64, 4096, 2
PER_BLOCK = BLOCK_BYTES * REGIONS

#: Every family the collector reports (names as the text parser gives them), with its type.
FAMILIES = {
    "aionixl_transfers": "counter",
    "aionixl_transferred_bytes": "counter",
    "aionixl_transfer_seconds": "histogram",
    "aionixl_transfer_post_seconds": "histogram",
    "aionixl_in_flight": "gauge",
    "aionixl_peers": "gauge",
    "aionixl_peers_evicted": "counter",
    "aionixl_peer_evictions": "counter",
    "aionixl_handshakes": "counter",
    "aionixl_notifications": "counter",
    "aionixl_notifications_kept": "gauge",
    "aionixl_coalesced_requests": "counter",
    "aionixl_coalesced_calls": "counter",
    "aionixl_leases_active": "gauge",
    "aionixl_leases_ended": "counter",
    "aionixl_discovery_registered": "gauge",
    "aionixl_discovery_registrations": "counter",
    "aionixl_discovery_keepalive_failures": "counter",
}

#: The sample names the issue fixes, each with its labels.
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


def parse(text: str) -> list[Any]:
    """The families of a text-format scrape, in order (a name twice is kept twice)."""
    return list(text_string_to_metric_families(text))


def samples(families: list[Any]) -> list[Any]:
    return [s for family in families for s in family.samples]


def value(found: list[Any], name: str, **labels: str) -> float:
    hits = [s.value for s in found if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(hits) == 1, (name, labels, hits)
    return float(hits[0])


def once_each(families: list[Any]) -> dict[str, Any]:
    """The families by name; fails if a name came twice."""
    counts = Counter(f.name for f in families)
    assert all(n == 1 for n in counts.values()), counts
    return {f.name: f for f in families}


def engines_in(family: Any) -> set[str]:
    return {s.labels["engine"] for s in family.samples}


def everywhere(*engines: str) -> dict[str, set[str]]:
    """Every family, with samples of these engines."""
    return {name: set(engines) for name in FAMILIES}


def registry_of(*collectors: EngineCollector, **kwargs: Any) -> CollectorRegistry:
    registry = CollectorRegistry(**kwargs)
    for c in collectors:
        registry.register(c)
    return registry


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


def idle_engine(name: str = "idle") -> aionixl.Engine:
    """A real engine not entered: it reports zeros (enough where only names and labels count)."""
    return aionixl.Engine(unique(name), numpy_cache(2, 4096, 1))


# ---- what a scraper sees -----------------------------------------------------------------------


async def test_two_engines_in_one_collector_each_family_once_with_both_engines() -> None:
    """As the held-out check: known transfers, one collector for both engines,
    generate_latest() parsed back, exact counts, bytes and histogram counts by name."""
    async with engine_pair(numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=2),
                           numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)) as (src, dst, peer):
        moved = await _move(dst, peer)
        registry = registry_of(EngineCollector(src, dst))
        text = generate_latest(registry).decode()
    families = once_each(parse(text))
    assert {name: f.type for name, f in families.items()} == FAMILIES
    for name, family in families.items():
        assert engines_in(family) == {src.name, dst.name}, name
    found = samples(list(families.values()))
    for name, labels in REQUIRED.items():
        got = [s for s in found if s.name == name]
        assert {s.labels["engine"] for s in got} == {src.name, dst.name}, name
        assert all(set(s.labels) == labels for s in got), name
    for op, (calls, nbytes) in moved.items():
        assert value(found, "aionixl_transfers_total", engine=dst.name, op=op, outcome="ok") == calls
        assert value(found, "aionixl_transferred_bytes_total", engine=dst.name, op=op) == nbytes
        assert value(found, "aionixl_transfer_seconds_count", engine=dst.name, op=op) == calls
        assert value(found, "aionixl_transfer_seconds_bucket", engine=dst.name, op=op, le="+Inf") == calls
        assert value(found, "aionixl_transfer_post_seconds_count", engine=dst.name, op=op) == calls
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


async def test_restricted_scrapes_return_the_names_asked_for() -> None:
    """registry.restricted_registry() and the WSGI app's ?name[]= find the collector by the
    names its describe() gave the registry."""
    async with engine_pair(numpy_cache(16, 4096, 1, seed=4), numpy_cache(16, 4096, 1)) as (src, dst, peer):
        await dst.transfer_blocks(peer, [1, 2], [3, 4])
        await dst.transfer_blocks(peer, [5], [5], op="write")
        registry = registry_of(EngineCollector(src, dst))
        restricted = generate_latest(registry.restricted_registry(
            ["aionixl_transfers_total", "aionixl_transfer_seconds_count", "aionixl_peers"])).decode()
        environ: dict[str, Any] = {"QUERY_STRING": "name[]=aionixl_transferred_bytes_total"}
        setup_testing_defaults(environ)
        replies: list[str] = []
        body = b"".join(make_wsgi_app(registry)(environ, lambda status, headers: replies.append(status)))
        unrelated = generate_latest(registry.restricted_registry(["no_such_metric"])).decode()
    families = once_each(parse(restricted))
    assert set(families) == {"aionixl_transfers", "aionixl_transfer_seconds", "aionixl_peers"}
    found = samples(list(families.values()))
    assert {s.name for s in found} == {"aionixl_transfers_total", "aionixl_transfer_seconds_count",
                                       "aionixl_peers"}  # no buckets, no sums: not asked for
    for family in families.values():
        assert engines_in(family) == {src.name, dst.name}
    assert value(found, "aionixl_transfers_total", engine=dst.name, op="read", outcome="ok") == 1
    assert value(found, "aionixl_transfers_total", engine=dst.name, op="write", outcome="ok") == 1
    assert value(found, "aionixl_transfer_seconds_count", engine=dst.name, op="read") == 1
    assert value(found, "aionixl_transfers_total", engine=src.name, op="read", outcome="ok") == 0
    assert value(found, "aionixl_peers", engine=src.name) == 1

    assert replies == ["200 OK"]
    served = once_each(parse(body.decode()))
    assert list(served) == ["aionixl_transferred_bytes"]
    got = samples(list(served.values()))
    assert value(got, "aionixl_transferred_bytes_total", engine=dst.name, op="read") == 2 * 4096
    assert value(got, "aionixl_transferred_bytes_total", engine=dst.name, op="write") == 4096
    assert value(got, "aionixl_transferred_bytes_total", engine=src.name, op="read") == 0
    assert "aionixl" not in unrelated


async def test_openmetrics_parses_strictly_with_two_engines_in_one_collector() -> None:
    async with engine_pair(numpy_cache(8, 4096, 1), numpy_cache(8, 4096, 1)) as (src, dst, peer):
        await dst.transfer_blocks(peer, [1, 2], [3, 4])
        await dst.transfer_blocks(peer, [6], [6], op="write")
        registry = registry_of(EngineCollector(src, dst))
        text = om_exposition.generate_latest(registry).decode()
    families = once_each(list(om_parser.text_string_to_metric_families(text)))
    assert {name: f.type for name, f in families.items()} == FAMILIES
    for name, family in families.items():
        assert engines_in(family) == {src.name, dst.name}, name
    ok = [s for s in families["aionixl_transfers"].samples if s.labels["outcome"] == "ok"]
    assert {(s.labels["engine"], s.labels["op"]): s.value for s in ok} == {
        (src.name, "read"): 0, (src.name, "write"): 0, (dst.name, "read"): 1, (dst.name, "write"): 1}
    counts = [s for s in families["aionixl_transfer_seconds"].samples
              if s.name == "aionixl_transfer_seconds_count" and s.labels["engine"] == dst.name]
    assert {s.labels["op"]: s.value for s in counts} == {"read": 1, "write": 1}


# ---- one collector, engines added and removed --------------------------------------------------


async def test_a_registry_refuses_a_second_collector_whatever_its_engine() -> None:
    a, b = idle_engine("a"), idle_engine("b")
    registry = registry_of(EngineCollector(a))
    for again in (EngineCollector(a), EngineCollector(b)):
        with pytest.raises(ValueError, match="Duplicated timeseries in CollectorRegistry") as refused:
            registry.register(again)
        assert isinstance(refused.value, DuplicateTimeseries)
        assert {"aionixl_transfers_total", "aionixl_transfer_seconds_bucket",
                "aionixl_in_flight"} <= refused.value.duplicates
    # Still one family per name, the first collector's engine only.
    families = once_each(parse(generate_latest(registry).decode()))
    assert set(families) == set(FAMILIES)
    assert all(engines_in(f) == {a.name} for f in families.values())


async def test_lenient_registries_and_forwarding_collectors_get_each_family_once() -> None:
    """A registry with support_collectors_without_names, scraped whole and restricted, and a
    collector that only forwards collect() (no describe): each family once, both engines."""
    a, b = idle_engine("a"), idle_engine("b")
    collector = EngineCollector(a, b)
    lenient = registry_of(collector, support_collectors_without_names=True)

    class Forwarding:
        def collect(self) -> Any:
            return collector.collect()

    forwarding = registry_of(Forwarding())  # type: ignore[arg-type]
    scrapes = [(generate_latest(r).decode(), om_exposition.generate_latest(r).decode())
               for r in (lenient, forwarding)]
    restricted = lenient.restricted_registry(["aionixl_peers", "aionixl_transfers_total"])
    for text, om_text in scrapes:
        for parsed in (parse(text), list(om_parser.text_string_to_metric_families(om_text))):
            by_name = once_each(parsed)
            assert set(by_name) == set(FAMILIES)
            assert all(engines_in(f) == {a.name, b.name} for f in by_name.values())
    families = once_each(list(om_parser.text_string_to_metric_families(
        om_exposition.generate_latest(restricted).decode())))
    assert set(families) == {"aionixl_peers", "aionixl_transfers"}
    assert all(engines_in(f) == {a.name, b.name} for f in families.values())


async def test_add_and_remove_engines_of_a_registered_collector() -> None:
    a, b, c = idle_engine("a"), idle_engine("b"), idle_engine("c")
    collector = EngineCollector()
    registry = registry_of(collector)

    def scraped() -> dict[str, set[str]]:
        families = once_each(parse(generate_latest(registry).decode()))
        assert set(families) == set(FAMILIES)  # every family, with samples or without
        om = once_each(list(om_parser.text_string_to_metric_families(
            om_exposition.generate_latest(registry).decode())))
        assert set(om) == set(FAMILIES)
        return {name: engines_in(f) | engines_in(om[name]) for name, f in families.items()}

    assert scraped() == everywhere()
    collector.add(a)
    collector.add(b)
    assert collector.engines == (a, b)
    assert scraped() == everywhere(a.name, b.name)
    collector.remove(a)
    collector.add(c)
    assert collector.engines == (b, c)
    assert scraped() == everywhere(b.name, c.name)
    collector.add(a)  # back again, after the others
    assert collector.engines == (b, c, a)
    assert scraped() == everywhere(a.name, b.name, c.name)

    with pytest.raises(ValueError, match=re.escape(f"engine {b.name!r} is already in this collector")):
        collector.add(b)
    namesake = aionixl.Engine(b.name, numpy_cache(2, 4096, 1))
    with pytest.raises(ValueError, match="distinct names"):
        collector.add(namesake)
    with pytest.raises(TypeError, match=r"aionixl\.Engine"):
        collector.add("engine")  # type: ignore[arg-type]
    collector.remove(b)
    with pytest.raises(ValueError, match=re.escape(f"engine {b.name!r} is not in this collector")):
        collector.remove(b)
    assert collector.engines == (c, a)  # the refusals changed nothing
    assert scraped() == everywhere(a.name, c.name)


async def test_the_constructor_refuses_non_engines_and_an_engine_twice() -> None:
    eng = idle_engine()
    with pytest.raises(TypeError, match=r"aionixl\.Engine"):
        EngineCollector("engine")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"aionixl\.Engine"):
        EngineCollector(eng, None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="already in this collector"):
        EngineCollector(eng, eng)
    with pytest.raises(ValueError, match="distinct names"):
        EngineCollector(eng, aionixl.Engine(eng.name, numpy_cache(2, 4096, 1)))
    # An engine not yet started reports zeros.
    found = samples(parse(generate_latest(registry_of(EngineCollector(eng))).decode()))
    assert value(found, "aionixl_transfers_total", engine=eng.name, op="read", outcome="ok") == 0
    assert value(found, "aionixl_transfer_seconds_count", engine=eng.name, op="write") == 0


async def test_describe_names_every_family_without_samples() -> None:
    described = list(EngineCollector(idle_engine()).describe())
    assert {m.name: m.type for m in described} == FAMILIES
    assert all(m.samples == [] for m in described)
    text = generate_latest(registry_of(EngineCollector())).decode()
    assert "aionixl_transfers_total{" not in text and "# TYPE aionixl_transfers_total counter" in text
