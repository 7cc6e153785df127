"""Drives the threaded-connector MODEL (:mod:`.threaded_connector`) through the measures of
``aionixl bench``.

The engine loop is this thread: each step posts what the "scheduler" asked for, runs the
forward pass (a sleep of ``--step-ms``), then polls (``get_finished``). A transfer is
therefore seen done at the first step boundary after NIXL finished it, and a handshake at
the first step after the executor's worker finished it. Run by ``aionixl bench``;
``run(ctx)`` returns samples per measure.
"""

from __future__ import annotations

import time
from typing import Any

from .threaded_connector import ThreadedConnector, engine_step


def _wait(conn: ThreadedConnector, step_s: float, requests: set[Any] | None = None,
          peers: set[str] | None = None, limit_s: float = 60.0) -> None:
    want_r = set(requests or ())
    want_p = set(peers or ())
    deadline = time.perf_counter() + limit_s
    while want_r or want_p:
        done, ready = engine_step(conn, step_s)
        want_r.difference_update(done)
        want_p.difference_update(ready)
        if time.perf_counter() > deadline:
            raise RuntimeError(f"threaded model: {len(want_r)} reads / {len(want_p)} handshakes "
                               f"did not finish within {limit_s} s")


class _Requests:
    def __init__(self) -> None:
        self.n = 0

    def new(self) -> int:
        self.n += 1
        return self.n


def _connect(ctx: Any, conn: ThreadedConnector, units: list[Any], step_s: float) -> None:
    for unit in units:
        conn.request_handshake(unit.meta_address)
    _wait(conn, step_s, peers={u.meta_address for u in units})


def _verify(ctx: Any, conn: ThreadedConnector, address: str, step_s: float, req: _Requests) -> int:
    """Read the verify set into cleared blocks and compare its bytes with the prefill
    pattern; raises on a mismatch, else returns the block ids compared."""
    ctx.clear_verify_set()
    loc, rem = ctx.verify_set
    r = req.new()
    conn.read_blocks(r, address, loc, rem)
    _wait(conn, step_s, requests={r})
    if not ctx.check_verify_set():
        raise RuntimeError("threaded model: the bytes read do not match the prefill pattern")
    return int(ctx.verify_blocks)


def _seq(conn: ThreadedConnector, address: str, pairs: list[Any], n: int, step_s: float,
         req: _Requests) -> float:
    k = len(pairs)
    t = time.perf_counter()
    for i in range(n):
        loc, rem = pairs[i % k]
        r = req.new()
        conn.read_blocks(r, address, loc, rem)
        _wait(conn, step_s, requests={r})
    return (time.perf_counter() - t) / n


def _latencies(conn: ThreadedConnector, address: str, pairs: list[Any], n: int, step_s: float,
               req: _Requests) -> list[float]:
    k = len(pairs)
    out = []
    for i in range(n):
        loc, rem = pairs[i % k]
        r = req.new()
        t = time.perf_counter()
        conn.read_blocks(r, address, loc, rem)
        _wait(conn, step_s, requests={r})
        out.append(time.perf_counter() - t)
    return out


def _batched(conn: ThreadedConnector, address: str, pairs: list[Any], step_s: float,
             req: _Requests) -> float:
    t = time.perf_counter()
    want = set()
    for loc, rem in pairs:  # one step's worth of new requests, posted together
        r = req.new()
        conn.read_blocks(r, address, loc, rem)
        want.add(r)
    _wait(conn, step_s, requests=want)
    return (time.perf_counter() - t) / len(pairs)


def run(ctx: Any) -> dict[str, Any]:
    spec = ctx.spec
    step_s = spec.step_s
    out: dict[str, Any] = {}
    req = _Requests()
    checked = 0  # block ids whose bytes were compared with the prefill pattern
    ctx.spin()
    ctx.progress(f"threaded model (step {step_s * 1e3:g} ms): agent, listener, handshake")
    conn = ThreadedConnector(ctx.unique("threaded"), ctx.local.layout())
    unit = ctx.units[0]
    address = unit.meta_address
    try:
        _connect(ctx, conn, [unit], step_s)
        r = req.new()
        conn.read_blocks(r, address, [0], [0])  # wire-up
        _wait(conn, step_s, requests={r})
        checked += _verify(ctx, conn, address, step_s, req)

        def count_for(n: int) -> int:
            return max(3, min(n, int(spec.threaded_repeat_budget_s / max(step_s, 1e-4))))

        for nblocks, count in spec.seq.items():
            pairs = ctx.workload("contiguous", nblocks)
            n = count_for(count)
            out[f"seq_{nblocks}"] = ctx.timed_repeats(
                f"threaded model: {nblocks}-block reads",
                lambda p=pairs, n=n: _seq(conn, address, p, n, step_s, req))
        if spec.with_vllm:
            pairs = ctx.workload("contiguous", 1)
            n = count_for(spec.lat_count)
            out.update(ctx.latency_rows(ctx.timed_repeats(
                "threaded model: one-block reads timed one by one",
                lambda p=pairs, n=n: _latencies(conn, address, p, n, step_s, req))))
        for nblocks in spec.scattered:
            pairs = ctx.workload("scattered", nblocks)
            n = count_for(spec.seq.get(nblocks, 10))
            out[f"scattered_{nblocks}"] = ctx.timed_repeats(
                f"threaded model: {nblocks} scattered blocks",
                lambda p=pairs, n=n: _seq(conn, address, p, n, step_s, req))
        for count in spec.inflight:
            pairs = ctx.one_block_pairs(count)
            out[f"inflight_{count}"] = ctx.timed_repeats(
                f"threaded model: {count} in flight",
                lambda p=pairs: _batched(conn, address, p, step_s, req))
        bulk = ctx.workload("contiguous", spec.bulk_blocks)
        nbytes = spec.bulk_blocks * spec.bytes_per_block_id
        n = count_for(spec.bulk_count)
        out["bulk"] = [nbytes / s for s in ctx.timed_repeats(
            "threaded model: 16 MiB reads", lambda: _seq(conn, address, bulk, n, step_s, req))]
        checked += _verify(ctx, conn, address, step_s, req)

        ctx.rest()
        ctx.progress("threaded model: reconnects (handshake on the executor, seen at the next step)")
        connect = []
        for _ in range(spec.connect_count):
            conn.forget(address)
            t = time.perf_counter()
            conn.request_handshake(address)
            _wait(conn, step_s, peers={address})
            connect.append(time.perf_counter() - t)
        out["connect"] = connect
        ctx.progress("threaded model: idle CPU (listener thread waiting, engine loop blocked)")
        time.sleep(spec.idle_settle_s)
        idle = []
        for _ in range(spec.idle_windows):
            c0, t0 = ctx.cpu_seconds(), time.perf_counter()
            time.sleep(spec.idle_window_s)  # an idle engine waits for requests
            idle.append((ctx.cpu_seconds() - c0) / (time.perf_counter() - t0))
        out["idle_cpu"] = idle
        ctx.spin()
        r = req.new()
        conn.read_blocks(r, address, [0], [0])
        _wait(conn, step_s, requests={r})
        checked += _verify(ctx, conn, address, step_s, req)
    finally:
        conn.shutdown()
    closes, at_close = [], []
    # A UCX GET target aborts when its reader disconnects mid-read (over tcp): this close can
    # kill the prefill process. Then it is started again and that close measured once more.
    killed = "killed by the threaded model's close with reads in flight"
    for i in range(spec.close_repeats):
        ctx.progress(f"threaded model: close with {spec.peers} peers and {spec.close_inflight} reads "
                     f"in flight over UCX tcp ({i + 1}/{spec.close_repeats})")
        try:
            seconds, inflight = _close_once(ctx, step_s, req)
        except Exception:
            if not ctx.target_died(5.0):
                raise
            ctx.restart_target(killed)
            seconds, inflight = _close_once(ctx, step_s, req)
        closes.append(seconds)
        at_close.append(inflight)
        if ctx.target_died(0.5):
            ctx.restart_target(killed)
    out["close"] = closes
    out["info"] = {"verified_blocks": checked, "step_s": step_s, "close_in_flight": at_close,
                   "close_transport": spec.slow_tls}
    if spec.with_vllm:
        closes, opened, after = [], [], []
        for i in range(spec.close_repeats):
            ctx.progress(f"threaded model: close with 1 peer and {spec.close_inflight} reads in flight "
                         f"over UCX tcp ({i + 1}/{spec.close_repeats})")
            threads: dict[str, int] = {}
            seconds, _ = _close_once(ctx, step_s, req, npeers=1, threads=threads)
            closes.append(seconds)
            opened.append(float(threads["open"] - threads["base"]))
            after.append(float(threads["after"] - threads["base"]))
        out.update(close_1=closes, threads_open=opened, threads_closed=after)
    return out


def _close_once(ctx: Any, step_s: float, req: _Requests, npeers: int | None = None,
                threads: dict[str, int] | None = None) -> tuple[float, int]:
    spec = ctx.spec
    counts = threads if threads is not None else {}
    counts["base"] = ctx.thread_count()
    conn = ThreadedConnector(ctx.unique("threaded-close"), ctx.local.layout(), ucx_tls=spec.slow_tls)
    try:
        units = ctx.units[: spec.peers if npeers is None else npeers]
        _connect(ctx, conn, units, step_s)
        warm = set()
        for unit in units:
            r = req.new()
            conn.read_blocks(r, unit.meta_address, [0], [0])
            warm.add(r)
        _wait(conn, step_s, requests=warm)
        b = spec.blocks
        for i in range(spec.close_inflight):
            unit = units[i % len(units)]
            first = (i * spec.close_blocks) % (b - spec.close_blocks + 1)
            ids = list(range(first, first + spec.close_blocks))
            conn.read_blocks(req.new(), unit.meta_address, ids, ids)
        inflight = conn.in_flight
        counts["open"] = ctx.thread_count()
        t = time.perf_counter()
        conn.shutdown()
        seconds = time.perf_counter() - t
        counts["after"] = ctx.thread_count()
        return seconds, inflight
    finally:
        conn.shutdown()


# ---- the P/D request workload (aionixl bench --workload pd) -----------------------------


class ThreadedPd:
    """The threaded model on the P/D workload: its engine loop steps every ``step_s`` (the
    forward pass), and at each step boundary the scheduler hands it every request that has
    arrived since (blocks permitting); each is posted as one read with its notification and
    seen done at the first step boundary after NIXL finished it."""

    name = "threaded"

    def __init__(self, ctx: Any, step_s: float) -> None:
        self.ctx = ctx
        self.step_s = step_s
        self.req = _Requests()
        self.conn = ThreadedConnector(ctx.unique("threaded-pd"), ctx.local.layout())
        self.unit = ctx.units[0]
        self.address = self.unit.meta_address
        _connect(ctx, self.conn, [self.unit], step_s)
        r = self.req.new()
        self.conn.read_blocks(r, self.address, [0], [0])  # wire-up
        _wait(self.conn, step_s, requests={r})

    def step(self, rec: Any, reqs: list[Any], concurrency: int | None = None) -> None:
        conn, step_s = self.conn, self.step_s
        pending: dict[int, tuple[Any, Any, float, float]] = {}
        n, i = len(reqs), 0
        limit = concurrency or n
        rec.start()
        while i < n or pending:
            now = time.perf_counter()
            while i < n and len(pending) < limit:  # what the scheduler hands over this step
                req = reqs[i]
                admitted = rec.admit(req, now, concurrency is not None)
                if admitted is None:
                    break
                due, ids = admitted
                key = self.req.new()
                pending[key] = (req, ids, due, time.perf_counter())
                conn.read_blocks(key, self.address, ids, req.remote, req.notify)
                i += 1
            done, _ = engine_step(conn, step_s)
            for key in done:
                req, ids, due, called = pending.pop(key)
                rec.done(req, ids, due, called)

    def verify(self) -> int:
        return _verify(self.ctx, self.conn, self.address, self.step_s, self.req)

    def close(self) -> None:
        self.conn.shutdown()
