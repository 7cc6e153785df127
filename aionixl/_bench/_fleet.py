"""``aionixl bench --workload fleet``: many engines on several hosts, found through etcd.

:func:`run_fleet` starts ``hosts x engines_per_host`` engine processes
(:class:`aionixl.testing.RemoteEngine`) on network-namespace hosts joined by one bridge
(:class:`aionixl.testing.FleetHosts`: UCX over TCP between hosts, a real etcd beside them),
every engine registered in that etcd, and measures:

- **1 peer**: one decode engine reads the fan-in's bytes from one prefill in one transfer;
- **fan-in**: one decode engine reads from ``fan`` prefill engines on the other hosts at
  once (several one-block reads per prefill, all concurrent);
- **fan-out**: ``fan`` decode engines on the other hosts read from one prefill at once;
- **cost per transfer**: sequential one-block reads from one peer while the reader is
  connected to that peer only, and while it is connected to every other engine of the
  fleet too, in turn (1 peer, all, 1 peer, ...: each all-peers measure is bracketed);
- **memory and threads** of every engine process (``/proc/PID/status``), idle after the
  start and again after all of the above;
- **the close**: every engine closes gracefully, and its child checks that no NIXL
  resource and no thread is left (:class:`aionixl.testing.RemoteEngineStopError` otherwise).

Every byte read is compared in the reading child with what the source engine's cache holds
(``aionixl.testing.make_caches(seed, ...)``, block by block). The functions the children
run are the ``async def ...(engine, args)`` ones below, called by name through
:meth:`RemoteEngine.call` (``"aionixl._bench._fleet:fan_read"``); they run on the child's
event loop (no threads), their arguments are msgpack structs, their results JSON-able.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import anyio
import msgspec
import numpy as np

import aionixl
import aionixl.lowlevel
from aionixl._regions import block_view
from aionixl.testing import FleetHosts, RemoteEngine, TwoHostsError, block_bytes
from aionixl.testing._remote import each_at_most

_HERE = "aionixl._bench._fleet"

U8 = np.ndarray[Any, np.dtype[np.uint8]]


class FleetUnavailable(Exception):
    """The fleet cannot run on this machine (not root, no network namespaces, no etcd)."""


# ---- what runs inside the engine children


class FanPeer(msgspec.Struct, frozen=True):
    """Reads from one source engine: ``transfers[i]`` is one ``transfer_blocks`` call,
    ``(source block ids, destination block ids)``."""

    name: str
    seed: int
    transfers: list[tuple[list[int], list[int]]]


class FanArgs(msgspec.Struct, frozen=True):
    rounds: list[list[FanPeer]]  # one after the other, each all at once
    start_at: float = 0.0  # time.time() to start at (0: at once), so that children start together
    timeout: float = 30.0


class SeqArgs(msgspec.Struct, frozen=True):
    name: str
    seed: int
    reads: int
    pairs: list[tuple[int, int]]  # (source, destination): read i uses pairs[i % len(pairs)]
    timeout: float = 30.0


class ReadOnce(msgspec.Struct, frozen=True):
    name: str
    seed: int
    source: int
    destination: int
    timeout: float
    connect_timeout: float = 10.0


def _region_bytes(engine: aionixl.Engine) -> list[U8]:
    """Every region of ``engine`` as a ``(num_blocks, block_bytes)`` uint8 array over its
    memory (DRAM only)."""
    views: list[U8] = []
    for region in engine.regions:
        if region.mem_type != "DRAM":
            raise RuntimeError(f"the fleet runs on DRAM regions, not {region.mem_type}")
        views.append(block_view(region))
    return views


class _Checker:
    """Compares destination blocks with what ``make_caches(seed, ...)`` holds at the source
    (block ``b`` of region ``r`` is ``block_bytes(seed, r, b, nbytes)``); keeps the expected
    blocks it computed."""

    def __init__(self, engine: aionixl.Engine) -> None:
        self.views = _region_bytes(engine)
        self._expected: dict[tuple[int, int, int], U8] = {}
        self.bytes = 0
        self.blocks = 0

    def clear(self, destinations: Sequence[int]) -> None:
        for view in self.views:
            view[list(destinations)] = 0

    def check(self, peer: str, seed: int, sources: Sequence[int], destinations: Sequence[int]) -> None:
        for region, view in enumerate(self.views):
            nbytes = view.shape[1]
            for source, destination in zip(sources, destinations, strict=True):
                key = (seed, region, source)
                expected = self._expected.get(key)
                if expected is None:
                    expected = self._expected[key] = block_bytes(seed, region, source, nbytes)
                actual = view[destination]
                if not np.array_equal(actual, expected):
                    differ = np.flatnonzero(actual != expected)
                    raise AssertionError(
                        f"region {region}: block {destination} read from {peer}'s block {source} "
                        f"(seed {seed}): {differ.size} of {nbytes} bytes differ, the first at byte "
                        f"{int(differ[0])}")
                self.bytes += nbytes
        self.blocks += len(sources)


async def _peer(engine: aionixl.Engine, name: str, timeout: float = 10.0) -> aionixl.Peer:
    peer = engine.peers.get(name)
    if peer is not None and peer.connected:
        return peer
    return await engine.connect_to(name, timeout=timeout)


async def connect(engine: aionixl.Engine, args: bytes) -> dict[str, Any]:
    """``connect_to`` every name of ``args`` (msgpack list of names) at once, by name through
    the engine's discovery; returns each one's seconds and the wall time of all."""
    names = msgspec.msgpack.decode(args, type=list[str])
    seconds: dict[str, float] = {}

    async def one(name: str) -> None:
        started = time.perf_counter()
        await engine.connect_to(name, timeout=30.0)
        seconds[name] = time.perf_counter() - started

    started = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for name in names:
            tg.start_soon(one, name)
    return {"wall_s": time.perf_counter() - started, "seconds": seconds, "peers": len(engine.peers)}


async def disconnect(engine: aionixl.Engine, args: bytes) -> dict[str, Any]:
    """Disconnect from every name of ``args`` (msgpack list) that is a peer now."""
    for name in msgspec.msgpack.decode(args, type=list[str]):
        peer = engine.peers.get(name)
        if peer is not None:
            await engine.disconnect(peer)
    return {"peers": len(engine.peers)}


async def registered(engine: aionixl.Engine, args: bytes) -> list[str]:
    """The names registered in the engine's discovery now (sorted)."""
    assert engine.discovery is not None
    return sorted(await engine.discovery.records())


async def _all_at_once(engine: aionixl.Engine, reads: list[tuple[aionixl.Peer, list[int], list[int]]],
                       timeout: float) -> list[aionixl.TransferResult]:
    """``(peer, sources, destinations)`` reads, all started at once; their results."""
    results: list[aionixl.TransferResult] = []

    async def one(peer: aionixl.Peer, sources: list[int], destinations: list[int]) -> None:
        results.append(await engine.transfer_blocks(peer, destinations, sources, timeout=timeout))

    async with anyio.create_task_group() as tg:
        for read in reads:
            tg.start_soon(one, *read)
    return results


async def fan_read(engine: aionixl.Engine, args: bytes) -> dict[str, Any]:
    """Rounds of reads (``args``: :class:`FanArgs`), one after the other; in each, every
    transfer from every peer at once. Before a round its destination blocks are zeroed,
    after it every byte read is checked against the source's cache."""
    spec = msgspec.msgpack.decode(args, type=FanArgs)
    checker = _Checker(engine)
    peers = {p.name: await _peer(engine, p.name) for r in spec.rounds for p in r}
    if spec.start_at:
        await anyio.sleep(max(0.0, spec.start_at - time.time()))
    rounds = []
    for fan in spec.rounds:
        for p in fan:
            for _, destinations in p.transfers:
                checker.clear(destinations)
        t_start = time.time()
        started = time.perf_counter()
        results = await _all_at_once(engine, [(peers[p.name], sources, destinations) for p in fan
                                              for sources, destinations in p.transfers], spec.timeout)
        wall = time.perf_counter() - started
        t_end = time.time()
        verified_bytes, verified_blocks = checker.bytes, checker.blocks
        for p in fan:
            for sources, destinations in p.transfers:
                checker.check(p.name, p.seed, sources, destinations)
        rounds.append({"t_start": t_start, "t_end": t_end, "wall_s": wall, "transfers": len(results),
                       "blocks": sum(r.blocks for r in results), "bytes": sum(r.nbytes for r in results),
                       "verified_bytes": checker.bytes - verified_bytes,
                       "verified_blocks": checker.blocks - verified_blocks,
                       "seconds": [r.seconds for r in results]})
    return {"rounds": rounds, "peers": len(engine.peers)}


async def seq_read(engine: aionixl.Engine, args: bytes) -> dict[str, Any]:
    """``reads`` one-block reads from one peer, one after the other, each timed; every
    block read is checked (after each pass over ``pairs``, outside the timed reads)."""
    spec = msgspec.msgpack.decode(args, type=SeqArgs)
    peer = await _peer(engine, spec.name)
    checker = _Checker(engine)
    destinations = [d for _, d in spec.pairs]
    checker.clear(destinations)
    times: list[float] = []
    done: list[tuple[int, int]] = []
    for i in range(spec.reads):
        source, destination = spec.pairs[i % len(spec.pairs)]
        started = time.perf_counter()
        await engine.transfer_blocks(peer, [destination], [source], timeout=spec.timeout)
        times.append(time.perf_counter() - started)
        done.append((source, destination))
        if len(done) == len(spec.pairs) or i == spec.reads - 1:
            checker.check(spec.name, spec.seed, [s for s, _ in done], [d for _, d in done])
            checker.clear(destinations)
            done.clear()
    return {"seconds": times, "verified_bytes": checker.bytes, "verified_blocks": checker.blocks,
            "peers": len(engine.peers)}


async def read_once(engine: aionixl.Engine, args: bytes) -> dict[str, Any]:
    """Connect (by name, unless connected) and read one block; an :class:`aionixl.AionixlError`
    is returned as its type's name with the seconds it took, not raised."""
    spec = msgspec.msgpack.decode(args, type=ReadOnce)
    checker = _Checker(engine)
    checker.clear([spec.destination])
    started = time.perf_counter()
    try:
        peer = await _peer(engine, spec.name, spec.connect_timeout)
        started = time.perf_counter()
        await engine.transfer_blocks(peer, [spec.destination], [spec.source], timeout=spec.timeout)
    except aionixl.AionixlError as exc:
        return {"ok": False, "error": type(exc).__name__, "message": str(exc),
                "seconds": time.perf_counter() - started}
    seconds = time.perf_counter() - started
    checker.check(spec.name, spec.seed, [spec.source], [spec.destination])
    return {"ok": True, "seconds": seconds, "verified_bytes": checker.bytes}


# ---- the orchestrator (the bench's, or a test's, process)


@dataclass(frozen=True)
class FleetSpec:
    """The fleet's shape and how much it measures."""

    hosts: int = 4
    engines_per_host: int = 8
    fan: int = 16  # width of the fan-in and the fan-out
    num_blocks: int = 64  # per engine; the lower half is read from, the upper half written
    block_shape: tuple[int, ...] = (32, 8, 128)  # float16/bfloat16: 64 KiB per block per region
    dtypes: tuple[str, ...] = ("float16", "bfloat16", "float16", "bfloat16")
    fan_in_reads: int = 2  # one-block reads per prefill per fan-in round, all concurrent
    fan_out_blocks: int = 4  # blocks per decoder per fan-out round, one transfer each
    rounds: int = 4  # of each fan, one after the other (the first reaches idle sources)
    seq_reads: int = 200  # per cost measure
    cost_cycles: int = 2  # of the cost measure: 1 peer, all peers, ..., 1 peer
    start_limit: int = 8  # engine processes starting at once
    # engine processes stopping at once: a stop ends with the interpreter's exit, which cost
    # ~0.3-1 s of CPU while children loaded torch. 32 at once took 8.9 s on a quiet 2-core
    # machine then, but overran RemoteEngine's 15 s stop limit beside a loaded one (load
    # ~25); 4 at a time takes as long
    close_limit: int = 4
    timeout: float = 30.0  # per transfer
    idle_poll_interval: float | None = None  # every engine's EngineConfig field; None: its default

    @property
    def engines(self) -> int:
        return self.hosts * self.engines_per_host

    @property
    def block_id_bytes(self) -> int:
        return len(self.dtypes) * math.prod(self.block_shape) * 2

    def problems(self) -> list[str]:
        out = []
        if self.hosts < 2:
            out.append("the fleet needs at least 2 hosts")
        if self.engines_per_host < 3:
            out.append("the fleet needs at least 3 engines per host")
        if self.fan < 1 or self.rounds < 1 or self.seq_reads < 1 or self.cost_cycles < 1:
            out.append("fan, rounds, seq_reads and cost_cycles must be at least 1")
        if self.fan < 1:
            out.append("fan must be at least 1")
        if any(d not in ("float16", "bfloat16") for d in self.dtypes):
            out.append("dtypes must be 2-byte float types")
        half = self.num_blocks // 2
        if self.fan_in_reads * min(self.fan, self.engines) > half or self.fan_out_blocks > half:
            out.append(f"{self.num_blocks} blocks are too few for the reads asked")
        return out


def quick_fleet(**changes: Any) -> FleetSpec:
    """CI-sized: the same fleet, fewer rounds and reads."""
    return FleetSpec(**{"rounds": 3, "seq_reads": 100, "cost_cycles": 1, **changes})


def _status(pid: int) -> dict[str, int]:
    """VmRSS and RssAnon (KiB) and Threads of process ``pid``."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "Threads"):
                out[key] = int(value.split()[0])
    return out


_BASELINE = ("import os, aionixl.testing._child; "
             "print(open(f'/proc/{os.getpid()}/status').read(), flush=True)")


async def _baseline() -> dict[str, float]:
    """RSS, RssAnon (MiB) and threads of a Python that imported what an engine child imports
    (aionixl and the child's module; no torch: children serve numpy bytes) but opened no
    engine: what of an engine process is the harness's rather than the engine's."""
    import sys

    result = await anyio.run_process([sys.executable, "-c", _BASELINE])
    fields = dict(line.split(":", 1) for line in result.stdout.decode().splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024,
            "anon_mib": int(fields["RssAnon"].split()[0]) / 1024,
            "threads": int(fields["Threads"].split()[0])}


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _processes(engines: Sequence[RemoteEngine]) -> dict[str, Any]:
    status = [_status(e.pid) for e in engines]
    rss = [s["VmRSS"] / 1024 for s in status]
    anon = [s["RssAnon"] / 1024 for s in status]
    threads = [float(s["Threads"]) for s in status]
    # VmRSS counts the pages of shared libraries (NIXL's, UCX's) that every engine process
    # maps from the same files; RssAnon is each process's own memory.
    return {"rss_mib": _spread(rss), "anon_mib": _spread(anon), "threads": _spread(threads),
            "rss_total_mib": sum(rss), "anon_total_mib": sum(anon),
            "per_engine": {e.name: {"rss_mib": r, "anon_mib": a, "threads": int(t)}
                           for e, r, a, t in zip(engines, rss, anon, threads, strict=True)}}


async def run_fleet(spec: FleetSpec | None = None, progress: Callable[[str], None] | None = None,
                    **changes: Any) -> dict[str, Any]:
    """Run the fleet once and return what it measured (JSON-able): ``phases_s`` (wall time
    of each phase), ``fan_in``, ``fan_out``, ``cost`` (ratios), ``processes`` (memory and
    threads per engine process, idle and after the run) and ``close`` (every engine's
    graceful stop). Raises :class:`FleetUnavailable` where it cannot run (under pytest,
    FleetHosts skips instead), ``AssertionError`` (bytes that differ, a name not registered)
    or :class:`aionixl.testing.RemoteEngineError` (a child failed) when a read went wrong."""
    spec = spec if spec is not None else FleetSpec(**changes)
    problems = spec.problems()
    if problems:
        raise ValueError("; ".join(problems))
    say = progress or (lambda message: None)
    why = unavailable()
    if why is not None:
        raise FleetUnavailable(why)
    started = time.perf_counter()
    phases: dict[str, float] = {}
    report: dict[str, Any] = {"spec": {**asdict(spec), "engines": spec.engines,
                                       "block_id_bytes": spec.block_id_bytes}}
    say(f"fleet: {spec.hosts} hosts on a bridge, etcd")
    try:
        fleet = FleetHosts(spec.hosts)
        await fleet.__aenter__()
    except TwoHostsError as exc:
        raise FleetUnavailable(str(exc)) from None
    try:
        phases["hosts_and_etcd"] = time.perf_counter() - started
        result = await _run(fleet, spec, say, phases, report)
    finally:
        with anyio.CancelScope(shield=True):
            await fleet.__aexit__(None, None, None)
    result["phases_s"] = {**phases, "total": time.perf_counter() - started}
    return result


def unavailable() -> str | None:
    """Why the fleet cannot run here, or None."""
    from aionixl.testing._etcd import etcd_binary

    if os.geteuid() != 0:
        return "the fleet's hosts are network namespaces, which need root"
    if etcd_binary() is None:
        return "no etcd binary (Debian: apt-get install etcd-server)"
    return None


async def _run(fleet: FleetHosts, spec: FleetSpec, say: Callable[[str], None], phases: dict[str, float],
               report: dict[str, Any]) -> dict[str, Any]:
    geometry: dict[str, Any] = {"num_blocks": spec.num_blocks, "block_shape": spec.block_shape,
                                "dtypes": spec.dtypes}
    if spec.idle_poll_interval is not None:
        geometry["tuning"] = aionixl.lowlevel.Tuning(idle_poll_interval=spec.idle_poll_interval)
    grid = [[fleet.remote_engine(h, f"fleet-h{h}-e{j}", seed=1000 + h * 100 + j, **geometry)
             for j in range(spec.engines_per_host)] for h in range(spec.hosts)]
    engines = [e for row in grid for e in row]
    seeds = {e.name: e.seed for e in engines}
    half = spec.num_blocks // 2

    # -- start every engine (a few at a time: each imports NIXL and starts UCX, on every core)
    say(f"fleet: starting {len(engines)} engine processes")
    mark = time.perf_counter()
    limiter = anyio.CapacityLimiter(spec.start_limit)
    start_s: dict[str, float] = {}

    async def start(engine: RemoteEngine) -> None:
        async with limiter:
            began = time.perf_counter()
            await engine.start()
            start_s[engine.name] = time.perf_counter() - began

    async def baseline() -> None:
        async with limiter:
            report["baseline"] = await _baseline()

    async with anyio.create_task_group() as tg:
        tg.start_soon(baseline)
        for engine in engines:
            tg.start_soon(start, engine)
    phases["start_engines"] = time.perf_counter() - mark
    report["start"] = {"engines": len(engines), "each_s": _spread(list(start_s.values()))}

    close: dict[str, Any] = {}
    try:
        found: list[str] = await grid[0][0].call(f"{_HERE}:registered")
        report["registered"] = len(found)
        missing = sorted(set(seeds) - set(found))
        if missing:
            raise AssertionError(f"not registered in etcd: {missing}")
        report["processes_idle"] = _processes(engines)
        await _measure(grid, spec, half, say, phases, report)
        report["processes_busy"] = _processes(engines)
        stats = await _gather([e.stats() for e in engines])
        report["peers_evicted"] = sum(s.get("peers_evicted", 0) for s in stats)
    finally:
        # -- every engine closes gracefully, checked by its child (resources, threads)
        say(f"fleet: closing {len(engines)} engines")
        mark = time.perf_counter()
        failures: dict[str, str] = {}
        with anyio.CancelScope(shield=True):

            async def stop(engine: RemoteEngine) -> None:
                if not engine.running:
                    failures[engine.name] = "not running before the close"
                died = await engine.aclose()
                if died is not None:
                    failures[engine.name] = str(died)

            await each_at_most(spec.close_limit, stop, engines)
        phases["close_engines"] = time.perf_counter() - mark
        close.update(engines=len(engines), clean=len(engines) - len(failures), failures=failures)
        report["close"] = close
    return report


async def _gather(awaitables: Sequence[Any]) -> list[Any]:
    results: list[Any] = [None] * len(awaitables)

    async def one(i: int, awaitable: Any) -> None:
        results[i] = await awaitable

    async with anyio.create_task_group() as tg:
        for i, awaitable in enumerate(awaitables):
            tg.start_soon(one, i, awaitable)
    return results


def _others(grid: list[list[RemoteEngine]], skip: set[str]) -> list[RemoteEngine]:
    """The engines of hosts 1.. taken host by host in turn (h1e0, h2e0, h3e0, h1e1, ...),
    so that any prefix of it is spread evenly over those hosts."""
    out = []
    for j in range(len(grid[0])):
        for row in grid[1:]:
            if row[j].name not in skip:
                out.append(row[j])
    return out


async def _measure(grid: list[list[RemoteEngine]], spec: FleetSpec, half: int,
                   say: Callable[[str], None], phases: dict[str, float], report: dict[str, Any]) -> None:
    encode = msgspec.msgpack.encode
    reader, source = grid[0][2], grid[1][-1]  # the cost measure's pair, on two hosts
    everyone = [e for row in grid for e in row]

    # -- bulk from 1 peer: the fan-in's bytes per round in one transfer, for its GB/s
    say("fleet: 1 decode <- 1 prefill")
    mark = time.perf_counter()
    await reader.call(f"{_HERE}:connect", encode([source.name]))
    blocks = min(half, spec.fan * spec.fan_in_reads)
    bulk_rounds = [[FanPeer(source.name, source.seed, [([(i + r * 3) % half for i in range(blocks)],
                                                         [half + i for i in range(blocks)])])]
                   for r in range(spec.rounds)]
    bulk = await reader.call(f"{_HERE}:fan_read", encode(FanArgs(bulk_rounds, 0.0, spec.timeout)))
    phases["bulk_1_peer"] = time.perf_counter() - mark
    report["bulk"] = _fan_report([bulk], [], sources=1, asked_blocks=blocks)

    # -- fan-in: one decode reads from `fan` prefills on the other hosts at once
    decode = grid[0][0]
    prefills = _others(grid, set())[:spec.fan]
    say(f"fleet: fan-in, 1 decode <- {len(prefills)} prefills")
    mark = time.perf_counter()
    connected = await decode.call(f"{_HERE}:connect", encode([p.name for p in prefills]))
    rounds = []
    for r in range(spec.rounds):
        peers = []
        for k, p in enumerate(prefills):
            transfers = []
            for i in range(spec.fan_in_reads):
                slot = k * spec.fan_in_reads + i
                transfers.append(([(slot + r * 7) % half], [half + slot]))
            peers.append(FanPeer(p.name, p.seed, transfers))
        rounds.append(peers)
    fan_in = await decode.call(f"{_HERE}:fan_read", encode(FanArgs(rounds, 0.0, spec.timeout)))
    phases["fan_in"] = time.perf_counter() - mark
    report["fan_in"] = _fan_report([fan_in], connected["seconds"].values(), sources=len(prefills),
                                   asked_blocks=len(prefills) * spec.fan_in_reads)

    # -- fan-out: `fan` decoders on the other hosts read from one prefill at once
    prefill = grid[0][1]
    decoders = _others(grid, set())[:spec.fan]
    say(f"fleet: fan-out, {len(decoders)} decoders <- 1 prefill")
    mark = time.perf_counter()
    connects = await _gather([d.call(f"{_HERE}:connect", encode([prefill.name])) for d in decoders])
    start_at = time.time() + 0.25
    calls = []
    for k, d in enumerate(decoders):
        rounds = []
        for r in range(spec.rounds):
            sources = [(k * spec.fan_out_blocks + i + r * 5) % half for i in range(spec.fan_out_blocks)]
            destinations = [half + i for i in range(spec.fan_out_blocks)]
            rounds.append([FanPeer(prefill.name, prefill.seed, [(sources, destinations)])])
        calls.append(d.call(f"{_HERE}:fan_read", encode(FanArgs(rounds, start_at, spec.timeout))))
    fan_out = await _gather(calls)
    phases["fan_out"] = time.perf_counter() - mark
    report["fan_out"] = _fan_report(fan_out, [s for c in connects for s in c["seconds"].values()],
                                    sources=1, asked_blocks=len(decoders) * spec.fan_out_blocks)

    # -- cost per transfer: sequential one-block reads from one peer, the reader connected to
    # that peer only, then to every other engine too, in turn (one, all, one, all, ..., one)
    others = [e.name for e in everyone if e is not reader and e is not source]
    say(f"fleet: sequential one-block reads, reader connected to 1 peer, then {len(others) + 1}, in turn")
    mark = time.perf_counter()
    pairs = [(i % half, half + i % half) for i in range(half)]
    seq = encode(SeqArgs(source.name, source.seed, spec.seq_reads, pairs, spec.timeout))
    one_peer = [await reader.call(f"{_HERE}:seq_read", seq)]
    all_peers, connects = [], []
    for _ in range(spec.cost_cycles):
        connects.append(await reader.call(f"{_HERE}:connect", encode(others)))
        all_peers.append(await reader.call(f"{_HERE}:seq_read", seq))
        await reader.call(f"{_HERE}:disconnect", encode(others))
        one_peer.append(await reader.call(f"{_HERE}:seq_read", seq))
    phases["cost"] = time.perf_counter() - mark
    report["cost"] = _cost_report(one_peer, all_peers, connects, report["fan_in"], spec.seq_reads)
    # the fan-in's throughput / one peer's, the same bytes in one transfer (rounds after the first)
    fan, single = (report[k]["next"] or report[k]["first"] for k in ("fan_in", "bulk"))
    report["cost"]["fan_in_over_bulk_gbps"] = fan["gbps"] / single["gbps"]


def _timing(rounds: Sequence[Sequence[dict[str, Any]]]) -> dict[str, Any]:
    """Wall time, throughput and per-transfer times of consecutive rounds: ``rounds[i]``
    holds round i as each reader saw it. The readers' clocks are one machine's
    ``time.time()``; after their common start they drift apart, so the time is the span from
    the first start to the last end, per round."""
    span = max(r["t_end"] for rnd in rounds for r in rnd) - min(r["t_start"] for rnd in rounds for r in rnd)
    nbytes = sum(r["bytes"] for rnd in rounds for r in rnd)
    seconds = [s for rnd in rounds for r in rnd for s in r["seconds"]]
    return {"rounds": len(rounds), "round_s": span / len(rounds), "gbps": nbytes / span / 1e9,
            "transfer_s": {"p50": statistics.median(seconds), "p90": _percentile(seconds, 0.9),
                           "max": max(seconds)}}


def _fan_report(readers: list[dict[str, Any]], connects: Any, sources: int,
                asked_blocks: int) -> dict[str, Any]:
    """One fan's report from what each reader's ``fan_read`` returned."""
    count = len(readers[0]["rounds"])
    by_round = [[reader["rounds"][i] for reader in readers] for i in range(count)]

    def total(key: str) -> list[int]:
        return [sum(r[key] for r in rnd) for rnd in by_round]

    # The first round reaches sources that were idle: each answers a push read at its next
    # poll, up to idle_poll_interval (100 ms) later; the rounds after it follow at once.
    return {
        "readers": len(readers), "sources": sources, "rounds": count,
        "transfers_per_round": total("transfers"), "blocks_per_round": total("blocks"),
        "asked_blocks_per_round": asked_blocks, "bytes_per_round": total("bytes"),
        "verified_bytes_per_round": total("verified_bytes"),
        "verified_blocks_per_round": total("verified_blocks"),
        "first": _timing(by_round[:1]), "next": _timing(by_round[1:]) if count > 1 else None,
        "start_skew_s": max(r["t_start"] for r in by_round[0]) - min(r["t_start"] for r in by_round[0]),
        "connect_each_s": _spread(list(connects)) if connects else None,
        "peers_of_readers": [reader["peers"] for reader in readers],
    }


def _cost_report(one: list[dict[str, Any]], every: list[dict[str, Any]], connects: list[dict[str, Any]],
                 fan_in: dict[str, Any], reads: int) -> dict[str, Any]:
    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        seconds = [s for r in runs for s in r["seconds"]]
        return {"mean_s": statistics.fmean(seconds), "p10_s": _percentile(seconds, 0.1),
                "p50_s": statistics.median(seconds), "p90_s": _percentile(seconds, 0.9),
                "reads": len(seconds), "measures": len(runs),
                "verified_bytes": sum(r["verified_bytes"] for r in runs),
                "verified_blocks": sum(r["verified_blocks"] for r in runs),
                "peers": sorted({r["peers"] for r in runs})}

    # Sequential one-block reads over UCX TCP are bimodal here (~0.35 ms, or ~1.4 ms when the
    # source's poll has backed off a step), in proportions that vary from measure to
    # measure, so the ratios are of means: each measure with every peer over the mean of the
    # 1-peer measures just before and after it (which brackets the machine's drift).
    means = [statistics.fmean(r["seconds"]) for r in one]
    ratios = [statistics.fmean(r["seconds"]) / ((means[i] + means[i + 1]) / 2) for i, r in enumerate(every)]
    single = statistics.fmean(means)
    warm = fan_in["next"] or fan_in["first"]
    walls = [c["wall_s"] for c in connects]
    return {
        "one_peer": summary(one), "all_peers": summary(every),
        "connect_all": {"peers": len(connects[0]["seconds"]), "wall_s": _spread(walls),
                        "each_s": _spread([s for c in connects for s in c["seconds"].values()])},
        "all_over_one": statistics.median(ratios), "all_over_one_each": ratios,
        # inside the fan-in (its rounds after the first): a transfer's own p50 / a sequential
        # one-block read, and the round's wall time per transfer (what a transfer costs in
        # throughput) / the same
        "fan_in_transfer_over_one": warm["transfer_s"]["p50"] / single,
        "fan_in_wall_per_transfer_over_one": warm["round_s"] / fan_in["transfers_per_round"][0] / single,
        "reads_per_measure": reads,
    }


def table(fleet: dict[str, Any]) -> str:
    """The fleet section of the bench's output."""
    if "skipped" in fleet:
        return f"fleet: skipped: {fleet['skipped']}"
    if "error" in fleet:
        return f"fleet: FAILED: {fleet['error']}"
    s, ph = fleet["spec"], fleet["phases_s"]
    fi, fo, cost, bulk = fleet["fan_in"], fleet["fan_out"], fleet["cost"], fleet["bulk"]
    idle, busy = fleet["processes_idle"], fleet["processes_busy"]
    close, base, start = fleet["close"], fleet["baseline"], fleet["start"]["each_s"]

    def us(seconds: float) -> str:
        return f"{seconds * 1e6:.0f} us"

    def mib(n: int) -> str:
        return f"{n / 2**20:.0f} MiB"

    def fan(f: dict[str, Any], what: str) -> list[str]:
        rows = []
        for key, label in (("first", "first round (idle sources)"), ("next", "rounds after")):
            t = f[key]
            if t is None:
                continue
            rows.append(f"| {what}: {label} | {t['round_s'] * 1e3:.1f} ms a round, "
                        f"{t['gbps']:.2f} GB/s; a transfer {us(t['transfer_s']['p50'])} p50, "
                        f"{us(t['transfer_s']['max'])} max |")
        return rows

    one, every = cost["one_peer"], cost["all_peers"]
    lines = [
        f"fleet: {s['hosts']} hosts x {s['engines_per_host']} engines = {s['engines']} engine processes "
        f"(UCX over TCP between network namespaces on one bridge), {fleet['registered']} registered in "
        f"etcd and connected to by name; {len(s['dtypes'])} DRAM regions x {s['num_blocks']} blocks, "
        f"{s['block_id_bytes'] // 1024} KiB per block id; {ph['total']:.1f} s",
        "| measure | value |",
        "| --- | --- |",
        f"| start {s['engines']} engine processes, {s['start_limit']} at a time | "
        f"{ph['start_engines']:.1f} s (each {start['median']:.1f} s p50, {start['max']:.1f} s max) |",
        *fan(bulk, f"1 decode <- 1 prefill, {bulk['transfers_per_round'][0]} transfer of "
                   f"{bulk['blocks_per_round'][0]} blocks ({mib(bulk['bytes_per_round'][0])})"),
        *fan(fi, f"fan-in, 1 decode <- {fi['sources']} prefills, {fi['transfers_per_round'][0]} one-block "
                 f"reads at once ({mib(fi['bytes_per_round'][0])})"),
        *fan(fo, f"fan-out, {fo['readers']} decoders <- 1 prefill, {s['fan_out_blocks']} blocks each "
                 f"({mib(fo['bytes_per_round'][0])})"),
        f"| one-block read, sequential, reader with 1 peer | {us(one['mean_s'])} mean, "
        f"{us(one['p10_s'])} p10, {us(one['p50_s'])} p50 ({one['reads']} reads) |",
        f"| ... reader with {every['peers'][0]} peers | {us(every['mean_s'])} mean, "
        f"{us(every['p10_s'])} p10, {us(every['p50_s'])} p50: {cost['all_over_one']:.2f}x |",
        f"| fan-in transfer p50 / 1-peer read | {cost['fan_in_transfer_over_one']:.2f}x (round wall per "
        f"transfer: {cost['fan_in_wall_per_transfer_over_one']:.2f}x) |",
        f"| fan-in GB/s / 1 peer's (the same bytes in one transfer) | {cost['fan_in_over_bulk_gbps']:.2f}x |",
        f"| connect_to {cost['connect_all']['peers']} peers by name at once | "
        f"{cost['connect_all']['wall_s']['median'] * 1e3:.0f} ms |",
        f"| engine process RSS, idle / after | {idle['rss_mib']['median']:.0f} / "
        f"{busy['rss_mib']['median']:.0f} MiB p50, max {busy['rss_mib']['max']:.0f} MiB |",
        f"| ... its own (RssAnon), idle / after | {idle['anon_mib']['median']:.0f} / "
        f"{busy['anon_mib']['median']:.0f} MiB p50, max {busy['anon_mib']['max']:.0f} MiB "
        f"(all: {busy['anon_total_mib'] / 1024:.2f} GiB) |",
        f"| ... beyond a Python with the same imports, no engine "
        f"({base['anon_mib']:.0f} MiB, {base['threads']} threads) | "
        f"{busy['anon_mib']['median'] - base['anon_mib']:.0f} MiB p50, "
        f"{mib(s['num_blocks'] * s['block_id_bytes'])} of it KV cache |",
        f"| engine process threads, idle / after | {idle['threads']['median']:.0f} / "
        f"{busy['threads']['median']:.0f} p50, max {busy['threads']['max']:.0f} |",
        f"| graceful close, {s['close_limit']} at a time | {ph['close_engines']:.1f} s: {close['clean']}/"
        f"{close['engines']} clean (no NIXL resources, no threads left) |",
    ]
    verified = (sum(fi["verified_bytes_per_round"]) + sum(fo["verified_bytes_per_round"])
                + sum(bulk["verified_bytes_per_round"])
                + sum(cost[k]["verified_bytes"] for k in ("one_peer", "all_peers")))
    lines.append(f"  every byte read was compared with the source engine's cache: "
                 f"{verified / 2**20:.0f} MiB; peers evicted: {fleet['peers_evicted']}")
    for name, why in close["failures"].items():
        lines.append(f"  CLOSE FAILED: {name}: {why.splitlines()[0]}")
    return "\n".join(lines)


__all__ = ["FleetSpec", "FleetUnavailable", "quick_fleet", "run_fleet", "table", "unavailable"]
