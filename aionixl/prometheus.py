"""Prometheus export of engine metrics (``pip install aionixl[prometheus]``).

::

    from prometheus_client import CollectorRegistry, generate_latest
    from aionixl.prometheus import EngineCollector

    registry = CollectorRegistry()
    collector = EngineCollector(engine)          # label engine=<name> on every sample
    registry.register(collector)
    collector.add(other_engine)                  # more engines: the same collector
    text = generate_latest(registry)

One collector per registry, for all of its engines: it reports each metric family once,
with samples for every engine it holds, told apart by the label ``engine`` (the engine's
name). Give it several engines at once (``EngineCollector(a, b)``), or ``add()`` and
``remove()`` them while it is registered. Its :meth:`~EngineCollector.describe` returns the
real families, so a registry knows the names: restricted scrapes (``?name[]=`` of
``make_wsgi_app``/``start_http_server``, ``registry.restricted_registry([...])``) return
aionixl's samples, and a registry refuses a second ``EngineCollector`` (prometheus_client's
``ValueError: Duplicated timeseries in CollectorRegistry``), because two would repeat the
names.

Each scrape reads :meth:`Engine.metrics` (a copy of the engine's counters), so a collector
costs nothing between scrapes. A scrape is safe from any thread: ``start_http_server``
scrapes from its own, while the engines run in their event loops.
"""

from __future__ import annotations

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
    """A prometheus_client collector for the engines of one registry: register it once
    (with any ``CollectorRegistry``) and give it every engine, at construction or through
    :meth:`add`. Metric names are listed in docs/metrics.md.

    An engine can be in a collector once, and two engines of one collector need distinct
    names (``ValueError`` otherwise); anything but an ``aionixl.Engine`` is a
    ``TypeError``. ``add`` and ``remove`` replace the tuple of engines in one step, so a
    scrape running meanwhile (in another thread) sees the engines before or after, never
    half; make them from one thread at a time (the engines' event loop, say).
    """

    def __init__(self, *engines: Engine) -> None:
        self._engines: tuple[Engine, ...] = ()
        for engine in engines:
            self.add(engine)

    @property
    def engines(self) -> tuple[Engine, ...]:
        """The engines this collector reports, in the order they were given."""
        return self._engines

    def add(self, engine: Engine) -> None:
        """Report ``engine`` too, from the next scrape on."""
        if not isinstance(engine, Engine):
            raise TypeError(f"EngineCollector takes aionixl.Engine objects, got {engine!r}")
        engines = self._engines
        if any(e is engine for e in engines):
            raise ValueError(f"engine {engine.name!r} is already in this collector")
        if any(e.name == engine.name for e in engines):
            raise ValueError(f"engines must have distinct names to be told apart: another engine "
                             f"named {engine.name!r} is already in this collector")
        self._engines = (*engines, engine)

    def remove(self, engine: Engine) -> None:
        """Stop reporting ``engine`` (its series leave the next scrape)."""
        engines = self._engines
        if not any(e is engine for e in engines):
            raise ValueError(f"engine {getattr(engine, 'name', engine)!r} is not in this collector")
        self._engines = tuple(e for e in engines if e is not engine)

    def describe(self) -> Iterable[Metric]:
        """Every family this collector reports, without samples: the registry learns the
        names (restricted scrapes, refusing a second collector of the same names)."""
        return list(families(()))

    def collect(self) -> Iterable[Metric]:
        return families(e.metrics() for e in self._engines)


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
        "aionixl_coalesced_requests", "Merged NIXL requests: each carried more than one caller's transfer",
        labels=["engine"])
    merged_calls = CounterMetricFamily(
        "aionixl_coalesced_calls", "transfer_blocks calls that rode in a merged NIXL request",
        labels=["engine"])
    leases = GaugeMetricFamily(
        "aionixl_leases_active", "Leases live and not past their time", labels=["engine"])
    lease_ends = CounterMetricFamily(
        "aionixl_leases_ended", "Leases ended: every reader done (released) or no heartbeat in "
        "time (expired)", labels=["engine", "how"])
    registered = GaugeMetricFamily(
        "aionixl_discovery_registered", "1 while the engine's key is believed to be in etcd "
        "(Engine(discovery=))", labels=["engine"])
    registrations = CounterMetricFamily(
        "aionixl_discovery_registrations", "etcd leases granted and keys put for the engine",
        labels=["engine"])
    keepalive_failures = CounterMetricFamily(
        "aionixl_discovery_keepalive_failures", "etcd keep-alive or re-registration attempts "
        "that failed", labels=["engine"])
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
        leases.add_metric([e], m.leases_active)
        lease_ends.add_metric([e, "released"], m.leases_released)
        lease_ends.add_metric([e, "expired"], m.leases_expired)
        registered.add_metric([e], int(m.discovery_registered))
        registrations.add_metric([e], m.discovery_registrations)
        keepalive_failures.add_metric([e], m.discovery_keepalive_failures)
    yield from (transfers, nbytes, seconds, post, in_flight, peers, evicted, evictions, handshakes,
                notes, kept, merged, merged_calls, leases, lease_ends, registered, registrations,
                keepalive_failures)


def _buckets(h: Histogram) -> tuple[list[tuple[str, float]], float]:
    return [(_le(le), float(n)) for le, n in h.cumulative()], h.sum
