"""Prometheus export of engine metrics (``pip install aionixl[prometheus]``).

::

    from prometheus_client import CollectorRegistry, generate_latest
    from aionixl.prometheus import EngineCollector

    registry = CollectorRegistry()
    registry.register(EngineCollector(engine))      # one per engine; label engine=<name>
    text = generate_latest(registry)

Each scrape reads :meth:`Engine.metrics` (a copy of the engine's counters), so a collector
costs nothing between scrapes. Every sample carries the label ``engine`` (the engine's
name); several engines in one process are told apart by it.

The text format wants one block per metric name. When a registry scrapes several
``EngineCollector``s, the first one it asks emits every family for all of them and the
others emit nothing (the collectors find each other in the registry's scrape); should that
lookup not work (another prometheus_client layout), each emits its own families and the
names repeat, as with any collectors that share names. A collector may also simply be
given several engines: ``EngineCollector(a, b)``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from ._engine import Engine
from ._metrics import EVICTION_CAUSES, OPS, OUTCOMES, EngineMetrics, Histogram

__all__ = ["EngineCollector", "families"]

#: prometheus_client's own formatting of ``le`` values (untyped there).
_le: Callable[[float], str] = floatToGoString


class EngineCollector(Collector):
    """A prometheus_client collector for one engine (or a few): register it with any
    ``CollectorRegistry``. Metric names are listed in docs/metrics.md."""

    def __init__(self, engine: Engine, *more: Engine) -> None:
        engines = (engine, *more)
        for e in engines:
            if not isinstance(e, Engine):
                raise TypeError(f"EngineCollector takes aionixl.Engine objects, got {e!r}")
        names = [e.name for e in engines]
        if len(set(names)) != len(names):
            raise ValueError(f"engines must have distinct names to be told apart: {names}")
        self._engines = engines

    def describe(self) -> Iterable[Metric]:
        # No up-front names: several collectors of this kind share metric names (told apart
        # by the engine label), which a registry would otherwise refuse as duplicates.
        return []

    def collect(self) -> Iterable[Metric]:
        group = _scraped_with(self)
        if group is None:
            return families(e.metrics() for e in self._engines)
        if group[0] is not self:
            return ()  # the first EngineCollector of this scrape reports ours too
        return families(e.metrics() for c in group for e in c._engines)


def _scraped_with(me: EngineCollector) -> list[EngineCollector] | None:
    """The EngineCollectors of the registry scrape that is calling ``me.collect()``, in the
    registry's order; None when that cannot be told (then ``me`` reports only itself)."""
    try:
        caller = sys._getframe(2)  # _scraped_with <- collect <- the registry's loop
    except ValueError:
        return None
    collectors = caller.f_locals.get("collectors")
    if not isinstance(collectors, dict) or me not in collectors:
        return None
    return [c for c in collectors if isinstance(c, EngineCollector)]


def families(snapshots: Iterable[EngineMetrics]) -> Iterator[Metric]:
    """Metric families for engine snapshots, one family per name, a sample set per engine."""
    transfers = CounterMetricFamily(
        "aionixl_transfers", "transfer_blocks calls that reached NIXL, by op and outcome",
        labels=["engine", "op", "outcome"])
    nbytes = CounterMetricFamily(
        "aionixl_transferred_bytes", "Bytes moved by finished transfers", labels=["engine", "op"])
    seconds = HistogramMetricFamily(
        "aionixl_transfer_seconds", "Finished transfers: seconds from call to return",
        labels=["engine", "op"])
    post = HistogramMetricFamily(
        "aionixl_transfer_post_seconds",
        "Finished transfers: seconds to create and post the NIXL request", labels=["engine", "op"])
    in_flight = GaugeMetricFamily(
        "aionixl_in_flight", "Transfers posted and not finished yet", labels=["engine"])
    peers = GaugeMetricFamily("aionixl_peers", "Live peers", labels=["engine"])
    evicted = CounterMetricFamily(
        "aionixl_peers_evicted", "Peers evicted after NIXL reported them failing", labels=["engine"])
    evictions = CounterMetricFamily(
        "aionixl_peer_evictions", "Peers evicted, by cause", labels=["engine", "cause"])
    handshakes = CounterMetricFamily(
        "aionixl_handshakes", "Handshakes answered by the listener", labels=["engine", "result"])
    notes = CounterMetricFamily(
        "aionixl_notifications",
        "Notifications handed to wait_notification callers, or dropped from a full mailbox",
        labels=["engine", "event"])
    kept = GaugeMetricFamily(
        "aionixl_notifications_kept", "Notifications kept for no waiter yet", labels=["engine"])
    merged = CounterMetricFamily(
        "aionixl_coalesced_requests", "Transfer requests merged into shared NIXL calls",
        labels=["engine"])
    merged_calls = CounterMetricFamily(
        "aionixl_coalesced_calls", "NIXL calls that carried merged requests", labels=["engine"])
    for m in snapshots:
        e = m.engine
        for op in OPS:
            for outcome in OUTCOMES:
                transfers.add_metric([e, op, outcome], m.transfers[op][outcome])
            nbytes.add_metric([e, op], m.transferred_bytes[op])
            seconds.add_metric([e, op], *_buckets(m.transfer_seconds[op]))
            post.add_metric([e, op], *_buckets(m.post_seconds[op]))
        in_flight.add_metric([e], m.in_flight)
        peers.add_metric([e], m.peers)
        evicted.add_metric([e], m.peers_evicted)
        for cause in EVICTION_CAUSES:
            evictions.add_metric([e, cause], m.evictions[cause])
        handshakes.add_metric([e, "accepted"], m.handshakes_accepted)
        handshakes.add_metric([e, "rejected"], m.handshakes_rejected)
        notes.add_metric([e, "delivered"], m.notifications_delivered)
        notes.add_metric([e, "dropped"], m.notifications_dropped)
        kept.add_metric([e], m.notifications_kept)
        merged.add_metric([e], m.merged_requests)
        merged_calls.add_metric([e], m.merged_calls)
    yield from (transfers, nbytes, seconds, post, in_flight, peers, evicted, evictions, handshakes,
                notes, kept, merged, merged_calls)


def _buckets(h: Histogram) -> tuple[list[tuple[str, float]], float]:
    return [(_le(le), float(n)) for le, n in h.cumulative()], h.sum
