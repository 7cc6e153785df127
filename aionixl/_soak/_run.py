"""The soak's orchestrator: hosts, etcd and engines up, faults in, everything down, report.

It runs in the parent process (``aionixl soak``), on asyncio or trio, and drives every
engine through :class:`aionixl.testing.RemoteEngine` (its worker is :mod:`._worker`, run in
the child by name) inside :class:`aionixl.testing.FleetHosts`. The fault injector starts a
fault every ``fault_interval`` seconds on average, one at a time per engine and per host:
SIGKILL and restart an engine, SIGSTOP and SIGCONT one, cut and restore a host's link,
SIGKILL and restart etcd. A monitor notices any engine that exits without being killed. At
the end every fault is undone, every engine is stopped gracefully (the stop fails on a
non-zero exit, NIXL resources left or threads left) and :func:`._report.summarize` turns the
engines' event files, the fault log and these findings into the soak JSON.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import anyio

from aionixl import EngineConfig
from aionixl.testing import FleetHosts, RemoteEngine, RemoteEngineError
from aionixl.testing._remote import each_at_most

from ._report import plot, summarize
from ._worker import WorkerSpec

FAULT_KINDS = ("sigkill", "sigstop", "link_cut", "etcd_restart")
FAULT_WEIGHTS = {"sigkill": 3, "sigstop": 3, "link_cut": 2, "etcd_restart": 1}

#: Engines starting (and stopping) at once: each start imports NIXL and starts UCX (a couple
#: of seconds of CPU), and all of them at once on a small machine would push some past their
#: start (or graceful stop) timeout.
STARTS_AT_ONCE = 4
#: What each engine's stats() says at the end, summed into the report: how often a read
#: ended unconfirmed (its staging slots stranded, a late byte's only place to land) and
#: how often the server's late word gave them back.
ENGINE_STATS = ("fence_evictions", "peers_evicted", "pushes_lost", "staging_stranded", "staging_reclaimed",
                "staging_exhausted")

#: Seconds a failed read's destination is watched beyond the longest deadline: late bytes
#: of a server stopped or cut off for up to 3-4 s come once it runs or its link is back,
#: and TCP's retransmission backs off for seconds after an outage.
QUARANTINE_MARGIN = 8.0

#: How often the monitor looks for engines that died on their own.
MONITOR_PERIOD = 0.25

#: Seconds beyond the lease ttl that a restart is retried while discovery refuses it (etcd
#: down at most 3 s, then up to ttl for the killed incarnation's key to lapse).
RESTART_PATIENCE = 30.0


@dataclass(frozen=True)
class SoakOptions:
    """What ``aionixl soak`` was asked for (its command-line options)."""

    duration: float = 60.0
    hosts: int = 4
    engines: int = 8  # per host
    seed: int = 0
    rate: float = 3.0  # operations per second per engine
    concurrency: int = 2
    deadline_min: float = 0.3
    deadline_max: float = 3.0
    fault_interval: float = 2.0  # mean seconds between fault starts
    ttl: float = 4.0  # etcd lease of each engine
    backend: str = "asyncio"  # the engines' event loop
    faults: tuple[str, ...] = FAULT_KINDS  # the kinds injected

    def check(self) -> None:
        if not 0 < self.duration < math.inf:
            raise ValueError("--duration must be a finite number of seconds > 0")
        if not 2 <= self.hosts <= 200 or self.engines < 1:
            raise ValueError("--hosts must be from 2 to 200 and --engines at least 1")
        if self.seed < 0:
            raise ValueError("--seed must be >= 0")
        if not 0 < self.deadline_min <= self.deadline_max < math.inf:
            raise ValueError("--deadline-min must be positive and at most --deadline-max, both finite")
        if not (0 < self.rate < math.inf and 0 < self.fault_interval < math.inf) or self.concurrency < 1:
            raise ValueError("--rate and --fault-interval must be finite and positive, --concurrency "
                             "at least 1")
        unknown = set(self.faults) - set(FAULT_KINDS)
        if unknown or not self.faults:
            raise ValueError(f"--faults must name some of {', '.join(FAULT_KINDS)}; "
                             f"unknown: {', '.join(sorted(unknown)) or 'none given'}")


@dataclass(frozen=True)
class _Geometry:
    source_blocks: int = 32
    slot_blocks: int = 4
    pool_blocks: int = 256
    block_shape: tuple[int, ...] = (8, 4, 64)  # 4 KiB a block per float16 region
    dtypes: tuple[str, ...] = ("float16", "bfloat16")
    max_blocks: int = 4


class Soak:
    """One soak run: call :meth:`run` once; :attr:`faults` and :attr:`findings` fill up."""

    def __init__(self, options: SoakOptions, workdir: Path, log: Callable[[str], None]) -> None:
        options.check()
        self.options = options
        self.workdir = workdir
        self._log = log
        self._rng = random.Random(options.seed)
        self._geometry = _Geometry()
        count = options.hosts * options.engines
        self.names = [f"soak-h{i // options.engines}-e{i % options.engines}" for i in range(count)]
        self.seeds = [1000 + options.seed * 1000 + i for i in range(count)]
        self.faults: list[dict[str, Any]] = []
        self.findings: list[dict[str, Any]] = []  # violations the orchestrator saw
        self.stops: list[dict[str, Any]] = []  # each engine's final graceful stop
        self.restarts = 0
        #: Failed starts retried, by why: "discovery" (etcd down, the old key still there),
        #: "nixl_backend" (the host's link cut: UCX finds no device), "other".
        self.restart_retries: dict[str, int] = {}
        self._engines: list[RemoteEngine] = []
        self._busy: set[str] = set()  # engines and hosts under a fault now
        self._down: set[int] = set()  # engines killed (or dead) and not started again yet

    def _host_of(self, index: int) -> int:
        return index // self.options.engines

    def _spec(self, index: int) -> WorkerSpec:
        g, o = self._geometry, self.options
        count = len(self.names)
        return WorkerSpec(
            index=index, names=self.names, seeds=self.seeds,
            num_blocks=g.source_blocks + count * g.slot_blocks + g.pool_blocks,
            block_shape=list(g.block_shape), dtypes=list(g.dtypes), source_blocks=g.source_blocks,
            slot_blocks=g.slot_blocks, rate=o.rate, concurrency=o.concurrency,
            deadline_min=o.deadline_min, deadline_max=o.deadline_max, max_blocks=g.max_blocks,
            events_path=str(self.workdir / f"events-{index:03d}.jsonl"),
            quarantine_s=o.deadline_max + QUARANTINE_MARGIN, rng_seed=o.seed * 100003 + index)

    async def run(self) -> dict[str, Any]:
        """Hosts, etcd and engines up; faults for ``duration``; all down; the summary."""
        o = self.options
        started = time.time()
        async with FleetHosts(o.hosts) as fleet:
            config = EngineConfig()  # the defaults: what a user gets
            for index, name in enumerate(self.names):
                spec = self._spec(index)
                self._engines.append(fleet.remote_engine(
                    self._host_of(index), name, seed=self.seeds[index], num_blocks=spec.num_blocks,
                    block_shape=spec.block_shape, dtypes=spec.dtypes, prefix=f"/aionixl-soak-{o.seed}/",
                    ttl=o.ttl, config=config, backend=o.backend,
                    workload="aionixl._soak._worker:main", workload_args=spec.encode()))
            self._log(f"starting etcd, {o.hosts} hosts and {len(self._engines)} engines...")
            await each_at_most(STARTS_AT_ONCE, RemoteEngine.start, self._engines)
            up = time.time()
            self._log(f"up in {up - started:.1f} s; soaking for {o.duration:g} s")
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._monitor)
                with anyio.move_on_after(o.duration):
                    await self._inject(fleet, tg)
                tg.cancel_scope.cancel()  # the monitor; every fault task undoes itself first
            soaked = time.time()
            self._log(f"faults stopped; {len(self.faults)} injected; stopping the engines...")
            await each_at_most(STARTS_AT_ONCE, self._stop, range(len(self._engines)))
        files = sorted(self.workdir.glob("events-*.jsonl"))
        summary = summarize(files, self.faults, self.findings, soaked - up)
        summary.update({
            "options": asdict(o), "engine_restarts": self.restarts,
            "restart_retries": self.restart_retries,
            "engines_closed_clean": sum(1 for s in self.stops if s["clean"]),
            # As the engines running at the end counted them (a restart starts at zero).
            **{k: sum(s.get(k, 0) for s in self.stops) for k in ENGINE_STATS},
            "engine_stops": self.stops, "startup_s": round(up - started, 2),
            "teardown_s": round(time.time() - soaked, 2)})
        return summary

    # ---- faults ---------------------------------------------------------------------------

    async def _inject(self, fleet: FleetHosts, tg: anyio.abc.TaskGroup) -> None:
        """Faults at Poisson times, their kinds dealt from a shuffled deck holding each kind
        :data:`FAULT_WEIGHTS` times: every kind comes up once per deck, in proportion."""
        deck: list[str] = []
        while True:
            await anyio.sleep(self._rng.expovariate(1.0 / self.options.fault_interval))
            if not deck:
                deck = [k for k in FAULT_KINDS if k in self.options.faults for _ in range(FAULT_WEIGHTS[k])]
                self._rng.shuffle(deck)
            kind = deck.pop()
            if kind in ("sigkill", "sigstop"):
                free = self._faultable_engines()
                if free:
                    tg.start_soon(self._engine_fault, kind, self._rng.choice(free))
            elif kind == "link_cut":
                hosts = [h for h in range(self.options.hosts) if f"host-{h}" not in self._busy]
                if hosts:
                    tg.start_soon(self._link_fault, fleet, self._rng.choice(hosts))
            elif "etcd" not in self._busy:
                tg.start_soon(self._etcd_fault, fleet)

    def _faultable_engines(self) -> list[int]:
        """Engines a signal may hit now: running, and under no other fault. One whose
        restart failed stays down (a finding already): signalling it would raise."""
        return [i for i in range(len(self._engines))
                if i not in self._down and self.names[i] not in self._busy]

    def _fault(self, kind: str, target: str, duration: float) -> None:
        self.faults.append({"t": time.time(), "kind": kind, "target": target, "duration": round(duration, 3)})
        self._log(f"  fault: {kind} {target} for {duration:.1f} s")

    async def _engine_fault(self, kind: str, index: int) -> None:
        engine, name = self._engines[index], self.names[index]
        down = self._rng.uniform(0.5, 3.0)
        self._busy.add(name)
        try:
            self._fault(kind, name, down)
            if kind == "sigkill":
                self._down.add(index)
                await engine.kill()
                await anyio.sleep(down)
            else:
                async with engine.paused():
                    await anyio.sleep(down)
        finally:
            with anyio.CancelScope(shield=True):
                if kind == "sigkill":
                    await self._restart(index)
            self._busy.discard(name)

    async def _link_fault(self, fleet: FleetHosts, host: int) -> None:
        down = self._rng.uniform(1.0, 4.0)
        self._busy.add(f"host-{host}")
        try:
            self._fault("link_cut", f"host-{host}", down)
            fleet.cut(host)
            await anyio.sleep(down)
        finally:
            fleet.restore(host)
            self._busy.discard(f"host-{host}")

    async def _etcd_fault(self, fleet: FleetHosts) -> None:
        assert fleet.etcd is not None
        down = self._rng.uniform(0.5, 3.0)
        self._busy.add("etcd")
        try:
            self._fault("etcd_restart", "etcd", down)
            await fleet.etcd.stop(kill=True)
            await anyio.sleep(down)
        finally:
            with anyio.CancelScope(shield=True):
                await fleet.etcd.start()
            self._busy.discard("etcd")

    async def _restart(self, index: int) -> None:
        """Start a killed (or dead) engine again. A start fails by design while etcd is down,
        while the killed incarnation's key has not lapsed (names are unique: up to ``ttl``
        after a crash) and while its host's link is cut (UCX finds no usable device), so it is
        retried for a while; an engine that cannot be started is a finding and stays down."""
        give_up = anyio.current_time() + self.options.ttl + RESTART_PATIENCE
        self._down.add(index)
        while True:
            try:
                await self._engines[index].restart()
            except RemoteEngineError as exc:
                if anyio.current_time() < give_up:
                    why = ("discovery" if "DiscoveryError" in str(exc) else
                           "nixl_backend" if "NIXL_ERR_BACKEND" in str(exc) else "other")
                    self.restart_retries[why] = self.restart_retries.get(why, 0) + 1
                    await anyio.sleep(0.5)
                    continue
                self.findings.append({"kind": "restart_failed", "engine": self.names[index],
                                      "t": time.time(), "detail": str(exc)[-1500:]})
                return
            self.restarts += 1
            self._down.discard(index)
            return

    # ---- the monitor and the end ----------------------------------------------------------

    async def _monitor(self) -> None:
        """Any engine not killed by the injector that has exited died on its own."""
        while True:
            await anyio.sleep(MONITOR_PERIOD)
            for index, engine in enumerate(self._engines):
                if index in self._down or engine.running or self.names[index] in self._busy:
                    continue
                self._busy.add(self.names[index])
                try:
                    with anyio.CancelScope(shield=True):
                        died = await engine.aclose()
                        self.findings.append({
                            "kind": "engine_died", "engine": self.names[index], "t": time.time(),
                            "returncode": engine.returncode, "detail": str(died)[-1500:]})
                        self._log(f"  VIOLATION: {self.names[index]} died (status {engine.returncode})")
                        await self._restart(index)
                finally:
                    self._busy.discard(self.names[index])

    async def _stop(self, index: int) -> None:
        engine, name = self._engines[index], self.names[index]
        if index in self._down:  # its restart failed: a finding already
            await engine.aclose()
            self.stops.append({"engine": name, "clean": False, "kind": "down"})
            return
        was_running = engine.running
        stats: dict[str, int] = {}
        if was_running:
            with anyio.move_on_after(10), contextlib.suppress(Exception):
                stats = await engine.stats()
        died = await engine.aclose()
        report: dict[str, Any] = {"engine": name, "clean": died is None and was_running,
                                  **{k: stats[k] for k in ENGINE_STATS if k in stats}}
        if died is not None:
            kind = "stop_failed"
            threads_left = getattr(died, "threads_left", 0)
            resources = getattr(died, "resources", None)
            if threads_left:
                kind = "threads_left"
            elif resources and any(resources.values()):
                kind = "resources_left"
            elif not was_running:
                kind = "engine_died"
            report.update(kind=kind, returncode=died.returncode, resources=resources,
                          threads_left=threads_left)
            self.findings.append({"kind": kind, "engine": name, "t": time.time(),
                                  "detail": str(died)[-1500:]})
        self.stops.append(report)


async def soak(options: SoakOptions, json_path: str | None, plot_path: str | None,
               log: Callable[[str], None] = print, keep: bool = False) -> dict[str, Any]:
    """Run a soak, write its JSON (and plot), and return the summary."""
    workdir = Path(tempfile.mkdtemp(prefix="aionixl-soak-"))
    try:
        summary = await Soak(options, workdir, log).run()
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            log(f"events kept in {workdir}")
    if json_path is not None:
        Path(json_path).write_text(json.dumps(summary, indent=1, default=str))
    if plot_path is not None:
        with contextlib.suppress(ImportError):
            plot(summary, plot_path)
    return summary
