"""aionixl itself, on asyncio or trio: the same measures through ``Engine``'s public API.

The engine runs with its product defaults (``EngineConfig()``, a handshake listener of its
own, NIXL's progress thread off). Block ids are passed as a user would: lists when short,
int64 arrays when long. Two measures need transfers that stay in flight long enough to
reach the engine's poller task (on this host UCX finishes DRAM reads inside the post):
completion-to-wake latency and close-with-transfers-in-flight run on engines whose NIXL
agent was created with ``UCX_TLS=tcp``, where every transfer waits for the network.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from functools import partial
from typing import Any

import anyio
import numpy as np

from .. import lowlevel
from .._config import EngineConfig
from .._engine import Engine, Peer
from .._errors import EngineClosedError
from .._parts import BlockPart
from ._context import Context, Ids
from ._memory import WRITE_SALT, KVMemory


async def _seq(eng: Engine, peer: Peer, pairs: list[tuple[Ids, Ids]], n: int, op: str = "read") -> float:
    k = len(pairs)
    transfer = eng.transfer_blocks
    t = time.perf_counter()
    if op == "read":
        for i in range(n):
            loc, rem = pairs[i % k]
            await transfer(peer, loc, rem)
    else:
        for i in range(n):
            loc, rem = pairs[i % k]
            await transfer(peer, loc, rem, op="write")
    return (time.perf_counter() - t) / n


async def _seq_parts(eng: Engine, peer: Peer, pairs: list[tuple[Ids, Ids, BlockPart]], n: int) -> float:
    """As :func:`_seq`, each read moving its pair's part of the remote block into the same
    part of the local block."""
    k = len(pairs)
    transfer = eng.transfer_blocks
    t = time.perf_counter()
    for i in range(n):
        loc, rem, part = pairs[i % k]
        await transfer(peer, loc, rem, local_part=part, remote_part=part)
    return (time.perf_counter() - t) / n


async def _latencies(eng: Engine, peer: Peer, pairs: list[tuple[Ids, Ids]], n: int) -> list[float]:
    """Seconds of each of ``n`` one-block reads, timed one by one."""
    k = len(pairs)
    out = []
    for i in range(n):
        loc, rem = pairs[i % k]
        t = time.perf_counter()
        await eng.transfer_blocks(peer, loc, rem)
        out.append(time.perf_counter() - t)
    return out


async def _inflight(eng: Engine, peer: Peer, pairs: list[tuple[list[int], list[int]]],
                    notify: bool = False) -> float:
    """One task per request, already running and waiting (as in a server); on the signal,
    each starts its transfer (with ``notify``: each carrying its own notification).
    Seconds from the signal until the last one is done, / count."""
    go, finished = anyio.Event(), anyio.Event()
    left = len(pairs)

    async def request(loc: list[int], rem: list[int]) -> None:
        nonlocal left
        await go.wait()
        await eng.transfer_blocks(peer, loc, rem, notify=b"req-%d" % loc[0] if notify else None)
        left -= 1
        if not left:
            finished.set()

    async with anyio.create_task_group() as tg:
        for loc, rem in pairs:
            tg.start_soon(request, loc, rem)
        await anyio.sleep(0.01)  # every task is waiting on `go` now
        t = time.perf_counter()
        go.set()
        await finished.wait()
        seconds = time.perf_counter() - t
    return seconds / len(pairs)


def _mixed_pairs(blocks: int) -> list[tuple[list[int], list[int]]]:
    """Callers of 1, 16 and 256 blocks at once (three of each where the cache has room),
    distinct destination blocks, contiguous ids."""
    pairs: list[tuple[list[int], list[int]]] = []
    at = 0
    for _ in range(3):
        for size in (1, 16, 256):
            if at + size > blocks:
                return pairs
            ids = list(range(at, at + size))
            pairs.append((ids, [blocks - 1 - i for i in ids]))
            at += size
    return pairs


async def _inflight_spawn(eng: Engine, peer: Peer, pairs: list[tuple[list[int], list[int]]]) -> float:
    """As _inflight, but a new task per transfer, created inside the timing."""
    t = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for loc, rem in pairs:
            tg.start_soon(eng.transfer_blocks, peer, loc, rem)
    return (time.perf_counter() - t) / len(pairs)


async def _verify(ctx: Context, eng: Engine, peer: Peer, what: str, memory: KVMemory | None = None) -> int:
    """Read the verify set into cleared blocks of ``memory`` (ours by default) and compare its
    bytes with the prefill pattern; raises on a mismatch, else returns the block ids compared."""
    ctx.clear_verify_set(memory)
    loc, rem = ctx.verify_set
    await eng.transfer_blocks(peer, loc, rem)
    if not ctx.check_verify_set(memory):
        raise RuntimeError(f"aionixl ({what}): the bytes read do not match the prefill pattern")
    return ctx.verify_blocks


async def _verify_parts(ctx: Context, eng: Engine, peer: Peer, what: str) -> int:
    """Zero our cache, read the verify set's block parts (one call per part index), and check
    that each part landed in its place and nothing else changed; raises on a mismatch, else
    returns the block ids compared."""
    ctx.clear_for_parts()
    for loc, rem, index in ctx.part_verify_calls:
        part = BlockPart(index, ctx.spec.tp_ratio)
        await eng.transfer_blocks(peer, loc, rem, local_part=part, remote_part=part)
    if not ctx.check_part_verify():
        raise RuntimeError(f"aionixl ({what}): the block parts read are not where they belong "
                           "(or other bytes changed)")
    return ctx.verify_blocks


async def loop_lag(eng: Engine | None, peers: list[Peer], workers: int, window: float,
                   tick: float) -> list[float]:
    """Lateness of a ``tick``-second sleep, repeated for ``window`` seconds while ``workers``
    tasks each keep reading one block (their own) in a loop."""
    lags: list[float] = []
    deadline = time.perf_counter() + window

    async def ticker() -> None:
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            await anyio.sleep(tick)
            lags.append(time.perf_counter() - t - tick)

    async def worker(i: int) -> None:
        assert eng is not None
        peer = peers[i % len(peers)]
        ids = [i]
        while time.perf_counter() < deadline:
            await eng.transfer_blocks(peer, ids, ids)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        for i in range(workers):
            tg.start_soon(worker, i)
    return lags


async def _alternate(mine: Callable[[], Awaitable[float]], others: list[Callable[[], float]],
                     repeats: int) -> tuple[list[float], list[list[float]]]:
    """Repeats of our loop and of each reference loop, interleaved in ABBA order, so that a
    drifting machine hits all of them alike. Returns our samples and each reference's."""
    ours: list[float] = []
    theirs: list[list[float]] = [[] for _ in others]
    for i in range(repeats):
        order = list(range(len(others)))
        if i % 2:
            for j in reversed(order):
                theirs[j].append(others[j]())
            ours.append(await mine())
        else:
            ours.append(await mine())
            for j in order:
                theirs[j].append(others[j]())
    return ours, theirs


def _ratios(a: list[float], b: list[float]) -> list[float]:
    return [x / y for x, y in zip(a, b, strict=True) if y > 0]


def _p99(values: list[float]) -> float:
    return float(np.percentile(values, 99)) if values else float("nan")


async def run(ctx: Context, backend: str) -> dict[str, Any]:
    spec = ctx.spec
    label = f"aionixl on {backend}"
    out: dict[str, Any] = {}
    info: dict[str, Any] = {"backend": backend}
    checked = 0  # block ids whose bytes were compared with the expected pattern
    unit = ctx.units[0]
    ctx.spin()
    ctx.progress(f"{label}: engine, connect")
    async with Engine(ctx.unique(f"aionixl-{backend}"), ctx.local.regions) as eng:
        peer = await eng.connect(unit.address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0])  # wire-up
        checked += await _verify(ctx, eng, peer, "start")
        wakes: list[int] = []
        lowlevel.trace_wakeups(eng, wakes)
        ref = ctx.open_reference()
        refs: dict[str, Callable[[], float]] = {} if ref is None else ref.pairs
        paired: dict[str, list[float]] = {}
        try:
            for nblocks, count in spec.seq.items():
                pairs = ctx.workload("contiguous", nblocks)
                others = [refs[k] for k in ("seq_1", "seq_1_raw") if k in refs] if nblocks == 1 else []
                ctx.progress(f"{label}: {nblocks}-block reads"
                             + (" (alternating with bare NIXL)" if others else ""))
                mine, theirs = await _alternate(partial(_seq, eng, peer, pairs, count), others, spec.repeats)
                out[f"seq_{nblocks}"] = mine
                for k, vals in zip([k for k in ("seq_1", "seq_1_raw") if k in refs], theirs, strict=False):
                    paired[f"seq_1_vs_{'bare' if k == 'seq_1' else 'bare_raw'}"] = _ratios(mine, vals)
            checked += await _verify_parts(ctx, eng, peer, "block parts, before")  # prepares them
            parts = [(loc, rem, BlockPart(index, spec.tp_ratio)) for loc, rem, index in ctx.part_workload()]
            others = [refs["seq_1_part"]] if "seq_1_part" in refs else []
            ctx.progress(f"{label}: 1-block reads of 1/{spec.tp_ratio} of a block (head slices)"
                         + (" (alternating with bare NIXL)" if others else ""))
            mine, theirs = await _alternate(partial(_seq_parts, eng, peer, parts, spec.seq[1]), others,
                                            spec.repeats)
            out["seq_1_part"] = mine
            if theirs:
                paired["seq_1_part_vs_bare"] = _ratios(mine, theirs[0])
            checked += await _verify_parts(ctx, eng, peer, "block parts, after")
            if spec.with_vllm:
                pairs = ctx.workload("contiguous", 1)
                ctx.progress(f"{label}: one-block reads timed one by one")
                out.update(ctx.latency_rows([await _latencies(eng, peer, pairs, spec.lat_count)
                                             for _ in range(spec.repeats)]))
            for nblocks in spec.scattered:
                pairs = ctx.workload("scattered", nblocks)
                count = spec.seq.get(nblocks, 10)
                ctx.progress(f"{label}: {nblocks} scattered blocks")
                out[f"scattered_{nblocks}"] = [await _seq(eng, peer, pairs, count)
                                               for _ in range(spec.repeats)]
            for count in spec.inflight:
                one = ctx.one_block_pairs(count)
                others = [refs["inflight_64"]] if count == 64 and "inflight_64" in refs else []
                ctx.progress(f"{label}: {count} in flight (one waiting task each)"
                             + (" (alternating with bare NIXL)" if others else ""))
                mine, theirs = await _alternate(partial(_inflight, eng, peer, one), others, spec.repeats)
                out[f"inflight_{count}"] = mine
                if theirs:
                    paired["inflight_64_vs_bare"] = _ratios(mine, theirs[0])
            one = ctx.one_block_pairs(64)
            ctx.progress(f"{label}: 64 in flight (a new task each)")
            out["inflight_64_spawn"] = [await _inflight_spawn(eng, peer, one) for _ in range(spec.repeats)]
            ctx.progress(f"{label}: 64 in flight, each with its own notification")
            out["inflight_64_notify"] = [await _inflight(eng, peer, one, notify=True)
                                         for _ in range(spec.repeats)]
            mixed = _mixed_pairs(spec.blocks)
            ctx.progress(f"{label}: {len(mixed)} in flight of 1, 16 and 256 blocks")
            out["inflight_mixed"] = [await _inflight(eng, peer, mixed) for _ in range(spec.repeats)]
            bulk = ctx.workload("contiguous", spec.bulk_blocks)
            nbytes = spec.bulk_blocks * spec.bytes_per_block_id
            others = [refs["bulk"]] if "bulk" in refs else []
            ctx.progress(f"{label}: 16 MiB reads" + (" (alternating with numpy.copyto)" if others else ""))
            mine, theirs = await _alternate(partial(_seq, eng, peer, bulk, spec.bulk_count), others,
                                            spec.repeats)
            out["bulk"] = [nbytes / t for t in mine]
            if theirs:  # throughput ratio: their time / ours
                paired["bulk_vs_memcpy"] = _ratios(theirs[0], mine)
            rows, pushed = await _push_reads(ctx, label, unit.address, bulk)
            out.update(rows)
            checked += pushed
        finally:
            if ref is not None:
                ref.close()
        info["paired"] = paired
        info["wake_samples_default_transport"] = len(wakes)
        lowlevel.trace_wakeups(eng, None)
        checked += await _verify(ctx, eng, peer, "after the timed loops")

        ctx.progress(f"{label}: event-loop lag")
        out["lag_idle"] = [_p99(await loop_lag(None, [], 0, spec.lag_window_s, spec.lag_tick_s))
                           for _ in range(spec.lag_windows)]
        lag = []
        for _ in range(spec.lag_windows):
            samples = await loop_lag(eng, [peer], spec.lag_workers, spec.lag_window_s, spec.lag_tick_s)
            lag.append(_p99(samples))
            info.setdefault("lag_64_ticks", []).append(len(samples))
        out["lag_64"] = lag

        ctx.rest()
        ctx.progress(f"{label}: reconnects")
        connect = []
        for _ in range(spec.connect_count):
            await eng.disconnect(peer)
            t = time.perf_counter()
            peer = await eng.connect(unit.address, timeout=30)
            connect.append(time.perf_counter() - t)
        out["connect"] = connect
        ctx.progress(f"{label}: idle CPU (one open, connected engine)")
        await anyio.sleep(spec.idle_settle_s)
        idle = []
        for _ in range(spec.idle_windows):
            c0, t0 = ctx.cpu_seconds(), time.perf_counter()
            await anyio.sleep(spec.idle_window_s)
            idle.append((ctx.cpu_seconds() - c0) / (time.perf_counter() - t0))
        out["idle_cpu"] = idle
        ctx.spin()
        await eng.transfer_blocks(peer, [0], [0])
        checked += await _verify(ctx, eng, peer, "after reconnecting")
        info["metrics"] = eng.metrics().as_dict()  # everything this engine did, for the record
    info["resources_left"] = sum(eng.live_resources().values())

    if ctx.host is not None:
        rows, host_checked = await _host_device(ctx, label)
        out.update(rows)
        checked += host_checked
    info["verified_blocks"] = checked

    closes, at_close, left = [], [], []
    for i in range(spec.close_repeats):
        ctx.progress(f"{label}: close with {spec.peers} peers and {spec.close_inflight} transfers in "
                     f"flight over UCX tcp ({i + 1}/{spec.close_repeats})")
        seconds, inflight, leftover, extra = await _close_once(ctx, backend, first=i == 0)
        closes.append(seconds)
        at_close.append(inflight)
        left.append(leftover)
        out.update(extra)
    out["close"] = closes
    info.update(close_in_flight=at_close, close_resources_left=left, close_transport=spec.slow_tls)
    if spec.with_vllm:
        closes, opened, after = [], [], []
        for i in range(spec.close_repeats):
            ctx.progress(f"{label}: close with 1 peer and {spec.close_inflight} transfers in flight "
                         f"over UCX tcp ({i + 1}/{spec.close_repeats})")
            threads: dict[str, int] = {}
            seconds, inflight, leftover, _ = await _close_once(ctx, backend, first=False, npeers=1,
                                                               threads=threads)
            closes.append(seconds)
            opened.append(float(threads["open"] - threads["base"]))
            after.append(float(threads["after"] - threads["base"]))
            info.setdefault("close_1_in_flight", []).append(inflight)
        out.update(close_1=closes, threads_open=opened, threads_closed=after)
    out["info"] = info
    return out


async def _push_reads(ctx: Context, label: str, address: str, bulk: list[tuple[Ids, Ids]],
                      ) -> tuple[dict[str, list[float]], int]:
    """The same one-block and 16 MiB reads in push mode (the peer writes into our blocks:
    what ``read_mode="auto"`` picks over UCX TCP), so the cost of that extra hop is on record.
    Also returns the block ids verified."""
    spec = ctx.spec
    out: dict[str, list[float]] = {}
    config = EngineConfig(read_mode="push")
    async with Engine(ctx.unique(f"aionixl-push-{label[-4:]}"), ctx.local.regions, listen=None,
                      config=config) as eng:
        peer = await eng.connect(address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0])  # wire-up
        ctx.progress(f"{label}: 1-block reads, push mode")
        pairs = ctx.workload("contiguous", 1)
        out["seq_1_push"] = [await _seq(eng, peer, pairs, spec.seq[1]) for _ in range(spec.repeats)]
        ctx.progress(f"{label}: 16 MiB reads, push mode")
        nbytes = spec.bulk_blocks * spec.bytes_per_block_id
        out["bulk_push"] = [nbytes / await _seq(eng, peer, bulk, spec.bulk_count)
                            for _ in range(spec.repeats)]
        checked = await _verify(ctx, eng, peer, "after the push-mode reads")
    return out, checked


async def _doomed(eng: Engine, peer: Peer, ids: list[int], counts: dict[str, int]) -> None:
    counts["posted"] += 1  # from here to its first wait, transfer_blocks runs without yielding
    try:
        await eng.transfer_blocks(peer, ids, ids)
    except EngineClosedError:
        counts["aborted"] += 1
    else:
        counts["finished"] += 1


async def _close_once(ctx: Context, backend: str, first: bool, npeers: int | None = None,
                      threads: dict[str, int] | None = None) -> tuple[float, int, int, dict[str, Any]]:
    """``threads``, when given, gets this process's OS thread count before the engine, with it
    open and connected, and right after its close."""
    spec = ctx.spec
    extra: dict[str, Any] = {}
    counts_threads = threads if threads is not None else {}
    counts_threads["base"] = ctx.thread_count()
    async with AsyncExitStack() as stack:
        with ctx.ucx_env(spec.slow_tls):
            # GET over tcp, as in earlier runs: these rows measure the poller and the close.
            # Forced GET over tcp is the mode in which a reader that disconnects mid-read
            # aborts the server (docs/read-modes.md), and on a loaded machine these 64 reads
            # can outlast the default 0.5 s close_grace: the close waits for them instead,
            # up to its close_timeout (they take tens of ms on a quiet machine).
            config = EngineConfig(read_mode="get")
            tuning = lowlevel.Tuning(close_grace=config.close_timeout)
            eng = await stack.enter_async_context(Engine(ctx.unique(f"aionixl-{backend}-tcp"),
                                                         ctx.local.regions, config=config,
                                                         tuning=tuning))
        peers = [await eng.connect(u.address, timeout=30)
                 for u in ctx.units[: spec.peers if npeers is None else npeers]]
        for p in peers:
            await eng.transfer_blocks(p, [0], [0])  # wire-up, over tcp
        if first:
            ctx.progress(f"aionixl on {backend}: completion-to-wake over UCX tcp")
            trace: list[int] = []
            lowlevel.trace_wakeups(eng, trace)
            for i in range(spec.wake_count):
                ids = [i % spec.blocks]
                await eng.transfer_blocks(peers[0], ids, ids)
            lowlevel.trace_wakeups(eng, None)
            extra["wake"] = [ns * 1e-9 for ns in trace]
            ctx.progress(f"aionixl on {backend}: event-loop lag, {spec.lag_workers} in flight over tcp")
            extra["lag_64_tcp"] = [
                _p99(await loop_lag(eng, peers, spec.lag_workers, spec.lag_window_s, spec.lag_tick_s))
                for _ in range(spec.lag_windows)]
        b = spec.blocks
        counts = {"posted": 0, "aborted": 0, "finished": 0}
        async with anyio.create_task_group() as tg:
            for i in range(spec.close_inflight):
                first_id = (i * spec.close_blocks) % (b - spec.close_blocks + 1)
                tg.start_soon(_doomed, eng, peers[i % len(peers)],
                              list(range(first_id, first_id + spec.close_blocks)), counts)
            while counts["posted"] < spec.close_inflight:
                await anyio.sleep(0)  # until every task has posted its transfer
            inflight = eng.live_resources()["in_flight"]
            counts_threads["open"] = ctx.thread_count()
            t = time.perf_counter()
            await eng.aclose()
            seconds = time.perf_counter() - t
            counts_threads["after"] = ctx.thread_count()
    leftover = sum(eng.live_resources().values())
    return seconds, inflight, leftover, extra


async def _host_device(ctx: Context, label: str) -> tuple[dict[str, list[float]], int]:
    """--device cuda: DRAM here <-> VRAM on the prefill side, 16 MiB at a time. Returns the
    rows and the block ids verified.

    The reads are checked as everywhere else. The writes put a pattern the prefill side
    never holds on its own (``WRITE_SALT``) into its blocks, which are then read back and
    checked, so a write that moved nothing fails; then the prefill pattern is written back
    (checked the same way) for the contenders after this one.
    """
    spec = ctx.spec
    host = ctx.host
    assert host is not None
    who = f"{label} (host<->device)"
    out: dict[str, list[float]] = {}
    nbytes = spec.bulk_blocks * spec.bytes_per_block_id
    async with Engine(ctx.unique("aionixl-host"), host.regions) as eng:
        peer = await eng.connect(ctx.units[0].address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0])
        checked = await _verify(ctx, eng, peer, "host", host)
        pairs = ctx.workload("contiguous", spec.bulk_blocks)
        ctx.progress(f"{label}: 16 MiB device->host reads")
        out["bulk_d2h"] = [nbytes / await _seq(eng, peer, pairs, spec.bulk_count)
                           for _ in range(spec.repeats)]
        checked += await _verify(ctx, eng, peer, "host, after the device->host reads", host)
        loc, rem = ctx.write_pair()

        async def read_back(salt: int) -> int:
            host.clear(loc)
            await eng.transfer_blocks(peer, loc, rem)
            return ctx.check_read_back(loc, rem, salt, who)

        host.fill_expected(loc, rem, WRITE_SALT)
        ctx.progress(f"{label}: 16 MiB host->device writes")
        out["bulk_h2d"] = [nbytes / await _seq(eng, peer, [(loc, rem)], spec.bulk_count, op="write")
                           for _ in range(spec.repeats)]
        checked += await read_back(WRITE_SALT)
        host.fill_expected(loc, rem)  # the prefill pattern back, for the contenders after this one
        await eng.transfer_blocks(peer, loc, rem, op="write")
        checked += await read_back(0)
    return out, checked
