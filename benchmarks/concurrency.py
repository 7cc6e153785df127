"""Concurrent one-block callers in one process against bare NIXL's batched loop of the same width.

For each width W (1 = one sequential caller), both sides move one-block reads between two
agents in this process (DRAM): bare NIXL posts W requests, then polls them all until done
(its batched loop). aionixl's W callers, by harness:

- ``loop``: W tasks already running and waiting are released at once; each awaits
  ``transfer_blocks`` again and again (a server's long-lived workers: task start-up outside
  the timing, one release per caller inside);
- ``wave``: the same, but each caller makes one call (one request, one transfer: a release
  per transfer; the shape of the default bench's "in flight" rows);
- ``spawn``: a new task per call, created inside the timing;
- ``gather``: the same through the loop's own primitive (``asyncio.gather`` of the calls,
  or a trio nursery), skipping anyio's task group: the cheapest task per call there is.

Timed from the release (or the first spawn) to the last transfer done. Reports microseconds
per transfer (medians over repeats, with min and max), the ratio to bare NIXL at the same
width, and each contender's growth from width 1 to width W. Floor rows run the same harness
with each transfer replaced by nothing, by one suspension, or by the engine's own parking
(callers park until the W-th of a round arrives and wakes them, as the end of a merged
request does): what the event loop alone costs. "bare NIXL, one request" posts each round's
W reads as one NIXL request (the request coalescing builds): NIXL's own cost per read once
merged. A coalescing engine costs at least its park floor plus that; the rest of its time
is its Python per call.
Usage:
    .venv/bin/python benchmarks/concurrency.py [--widths 1 64 1024] [--harness loop wave spawn gather]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import statistics
import time
from typing import Any

import anyio
import numpy as np

import aionixl

logging.getLogger("nixl").setLevel(logging.WARNING)


def bare(widths: list[int], regions: int, blocks: int, block_bytes: int, transfers: int,
         repeats: int) -> tuple[dict[int, list[float]], dict[int, list[float]]]:
    """Per width: bare NIXL's batched loop (W requests), and the W reads as one request."""
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("conc-bare-a", cfg), nixl_agent("conc-bare-b", cfg)
    mem_a = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(regions)]
    mem_b = [np.full((blocks, block_bytes), 7, np.uint8) for _ in range(regions)]

    def descs(mem: list[np.ndarray]) -> np.ndarray:
        rows = [np.array([[m[i].ctypes.data, block_bytes, 0] for i in range(blocks)], np.uint64)
                for m in mem]
        return np.concatenate(rows)

    regs = [(agent, agent.register_memory(np.array([[m.ctypes.data, m.nbytes, 0] for m in mem],
                                                   np.uint64), "DRAM"))
            for agent, mem in ((a, mem_a), (b, mem_b))]
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", descs(mem_a), "DRAM")
    remote = a.prep_xfer_dlist("conc-bare-b", descs(mem_b), "DRAM")
    offsets = np.arange(regions, dtype=np.int32) * blocks
    out: dict[int, list[float]] = {}
    merged: dict[int, list[float]] = {}
    for width in widths:
        idx = [offsets + (i % blocks) for i in range(width)]
        # The same reads as one request, in local order (the order the engine merges in).
        one = np.sort(np.concatenate(idx)).astype(np.int32)
        rounds = max(1, transfers // width)
        results, results_one = [], []
        for rep in range(repeats + 1):
            t = time.perf_counter()
            for _ in range(rounds):
                handles = [a.make_prepped_xfer("READ", local, idx[i], remote, idx[i])
                           for i in range(width)]
                states = [a.transfer(h) for h in handles]
                pending = [h for h, s in zip(handles, states, strict=True) if s != "DONE"]
                while pending:
                    pending = [h for h in pending if a.check_xfer_state(h) != "DONE"]
                    b.get_new_notifs()
                for h in handles:
                    h.release()
            spent = time.perf_counter() - t
            assert all((m[:width] == 7).all() for m in mem_a)
            for m in mem_a:
                m.fill(0)  # so that the one-request reads are checked too
            t = time.perf_counter()
            for _ in range(rounds):
                h = a.make_prepped_xfer("READ", local, one, remote, one)
                state = a.transfer(h)
                while state != "DONE":
                    state = a.check_xfer_state(h)
                    b.get_new_notifs()
                h.release()
            one_spent = time.perf_counter() - t
            assert all((m[:width] == 7).all() for m in mem_a)
            if rep:
                results.append(spent / (rounds * width))
                results_one.append(one_spent / (rounds * width))
        out[width] = results
        merged[width] = results_one
    local.release()
    remote.release()
    a.remove_remote_agent("conc-bare-b")
    for agent, reg in regs:
        agent.deregister_memory(reg)
    return out, merged


async def released(transfer: Any, peer: aionixl.Peer, width: int, blocks: int, calls: int) -> float:
    """Seconds from releasing ``width`` waiting tasks to the last of their transfers done;
    each task makes ``calls`` calls, one after the other."""
    go, finished = anyio.Event(), anyio.Event()
    left = width

    async def request(block: int) -> None:
        nonlocal left
        await go.wait()
        for _ in range(calls):
            await transfer(peer, [block], [block])
        left -= 1
        if not left:
            finished.set()

    async with anyio.create_task_group() as tg:
        for i in range(width):
            tg.start_soon(request, i % blocks)
        await anyio.sleep(0.005)
        t = time.perf_counter()
        go.set()
        await finished.wait()
        return time.perf_counter() - t


async def gathered(transfer: Any, peer: Any, width: int, blocks: int, rounds: int) -> float:
    """Seconds for ``rounds`` rounds of ``width`` calls, each call a new task spawned by
    the running loop's own primitive (asyncio.gather, or a trio nursery)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio
        import trio

        t = time.perf_counter()
        for _ in range(rounds):
            async with trio.open_nursery() as nursery:
                for i in range(width):
                    nursery.start_soon(transfer, peer, [i % blocks], [i % blocks])
        return time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(rounds):
        await asyncio.gather(*[transfer(peer, [i % blocks], [i % blocks]) for i in range(width)])
    return time.perf_counter() - t


async def timed(harness: str, transfer: Any, peer: Any, width: int, blocks: int,
                transfers: int) -> tuple[float, int]:
    """One repeat of ``harness`` at ``width``: (seconds, transfers made)."""
    rounds = max(1, transfers // width)
    if width == 1:
        t = time.perf_counter()
        one = 3 % blocks
        for _ in range(rounds):
            await transfer(peer, [one], [one])
        return time.perf_counter() - t, rounds
    if harness == "loop":
        return await released(transfer, peer, width, blocks, rounds), rounds * width
    if harness == "gather":
        return await gathered(transfer, peer, width, blocks, rounds), rounds * width
    spent = 0.0
    for _ in range(rounds):
        if harness == "wave":
            spent += await released(transfer, peer, width, blocks, 1)
            continue
        t = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for i in range(width):
                tg.start_soon(transfer, peer, [i % blocks], [i % blocks])
        spent += time.perf_counter() - t
    return spent, rounds * width


async def floor(harness: str, widths: list[int], blocks: int, transfers: int, repeats: int,
                wait: str) -> dict[int, list[float]]:
    """The harness alone, each caller's transfer replaced by nothing (``wait="none"``), by
    one suspension (``"checkpoint"``), or by the engine's own parking (``"park"``).

    No coalescing engine on this event loop can beat the last: a caller that waits for a
    merged request parks at least once, and its wake-up costs what that row shows.
    """
    from aionixl._parking import loop_tools

    tools = loop_tools()
    park, unpark_all = tools.park, tools.unpark_all
    parked: list[Any] = []
    arrived = 0
    width = 1

    async def nothing(peer: Any, local: list[int], remote: list[int]) -> None:
        nonlocal parked, arrived
        if wait == "checkpoint":
            await anyio.lowlevel.checkpoint()
        elif wait == "park":
            # Each round's first W-1 callers park; the W-th wakes them (a merged request's end).
            arrived += 1
            if arrived < width:
                await park(parked)
            else:
                arrived = 0
                woken, parked = parked, []
                unpark_all(woken)

    out: dict[int, list[float]] = {}
    for width in widths:
        results = []
        for rep in range(repeats + 1):
            spent, count = await timed(harness, nothing, None, width, blocks, transfers)
            if rep:
                results.append(spent / count)
        out[width] = results
    return out


async def engine(harness: str, widths: list[int], regions: int, blocks: int, block_bytes: int,
                 transfers: int, repeats: int, coalesce: bool) -> dict[int, list[float]]:
    src = [np.full((blocks, block_bytes), 7, np.uint8) for _ in range(regions)]
    dst = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(regions)]
    cfg = aionixl.EngineConfig(coalesce=coalesce)
    out: dict[int, list[float]] = {}
    async with aionixl.Engine("conc-src", src, config=cfg) as s, \
            aionixl.Engine("conc-dst", dst, listen=None, config=cfg) as d:
        assert s.address is not None
        peer = await d.connect(s.address)
        for width in widths:
            results = []
            for rep in range(repeats + 1):
                spent, count = await timed(harness, d.transfer_blocks, peer, width, blocks,
                                           transfers)
                if rep:
                    results.append(spent / count)
            out[width] = results
    # The blocks the callers read (all of them unless --blocks exceeds the widest width).
    touched = sorted({3 % blocks if w == 1 else i % blocks for w in widths for i in range(w)})
    assert all((m[touched] == 7).all() for m in dst)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--widths", type=int, nargs="+", default=[1, 64, 1024])
    p.add_argument("--regions", type=int, default=2)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--blocks", type=int, default=None,
                   help="blocks per region (default: the widest width, one block per caller); "
                        "fewer make callers share blocks")
    p.add_argument("--transfers", type=int, default=8192, help="transfers per repeat and width")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--harness", nargs="+", choices=["loop", "wave", "spawn", "gather"],
                   default=["loop", "wave"])
    p.add_argument("--backends", nargs="+", default=["asyncio", "trio"])
    p.add_argument("--no-baseline-off", action="store_true", help="skip the coalesce=False rows")
    p.add_argument("--no-floor", action="store_true", help="skip the harness-floor rows")
    args = p.parse_args()
    blocks = args.blocks or max(args.widths)
    shape = (args.widths, args.regions, blocks, args.block_bytes)
    rows: dict[str, dict[int, list[float]]] = {}
    rows["bare NIXL batched"], rows["bare NIXL, one request"] = bare(*shape, args.transfers,
                                                                     args.repeats)
    for harness in args.harness:
        for backend in args.backends:
            for coalesce in (True,) if args.no_baseline_off else (True, False):
                name = f"{harness}: aionixl {backend}{'' if coalesce else ' (no coalescing)'}"
                rows[name] = anyio.run(engine, harness, *shape, args.transfers, args.repeats,
                                       coalesce, backend=backend)
            if not args.no_floor:
                for wait, what in (("none", "no await"), ("checkpoint", "one suspension"),
                                   ("park", "engine's park")):
                    rows[f"{harness}: floor {backend} ({what})"] = anyio.run(
                        floor, harness, args.widths, blocks, args.transfers, args.repeats, wait,
                        backend=backend)
    base = {w: statistics.median(v) for w, v in rows["bare NIXL batched"].items()}
    first = args.widths[0]
    print(f"one-block reads, {args.regions} regions x {args.block_bytes} B, in one process; "
          f"us per transfer, median [min-max] of {args.repeats}")
    print(f"{'contender':<44}" + "".join(f"{'W=' + str(w):>26}" for w in args.widths)
          + f"{'growth':>10}")
    for name, by_width in rows.items():
        cells = []
        for w in args.widths:
            v = by_width[w]
            med = statistics.median(v)
            cells.append(f"{med * 1e6:7.2f} [{min(v) * 1e6:.1f}-{max(v) * 1e6:.1f}] {med / base[w]:.2f}x")
        growth = statistics.median(by_width[args.widths[-1]]) / statistics.median(by_width[first])
        print(f"{name:<44}" + "".join(f"{c:>26}" for c in cells) + f"{growth:>9.2f}x")


if __name__ == "__main__":
    main()
