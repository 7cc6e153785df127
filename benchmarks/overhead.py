"""Per-transfer cost of an awaited one-block read against a bare synchronous NIXL loop.

Both run in this process, against the same kind of peer (a second agent / engine in the
same process, on DRAM), with the same regions and block ids. They alternate, a chunk of
``--n`` reads each, ``--repeats`` times: this machine's noise moves both alike, so the
number to watch is the median of the per-repeat ratios, printed with their p10-p90 spread.
``--telemetry`` creates the engines' agents with NIXL's per-request telemetry
(``aionixl.lowlevel.Tuning(nixl_telemetry=True)``). Usage:
    .venv/bin/python benchmarks/overhead.py [--regions 2] [--block-bytes 4096] [--n 1000]
                                            [--repeats 25] [--telemetry]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

import anyio
import numpy as np

import aionixl
import aionixl.lowlevel

logging.getLogger("nixl").setLevel(logging.WARNING)

#: The block every read moves (in every region).
BLOCK = 3


def clear(dst: list[np.ndarray]) -> None:
    """Zero ``BLOCK`` in every destination region before a chunk, so that its check can fail."""
    for m in dst:
        m[BLOCK] = 0


def check_landed(dst: list[np.ndarray], src: list[np.ndarray], who: str) -> None:
    """Raise unless every region's ``BLOCK`` in ``dst`` holds ``src``'s bytes."""
    if not all((mine[BLOCK] == theirs[BLOCK]).all() for mine, theirs in zip(dst, src, strict=True)):
        raise RuntimeError(f"the {who} reads did not land")


def bare_reader(stack: ExitStack, regions: int, blocks: int, block_bytes: int) -> Callable[[int], float]:
    """A bare NIXL agent pair reading ``BLOCK`` of every region; returns ``run(n)``, seconds
    per read over ``n`` reads, checked. ``stack`` releases everything."""
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("bare-a", cfg), nixl_agent("bare-b", cfg)
    mem_a = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(regions)]
    mem_b = [np.ones((blocks, block_bytes), np.uint8) for _ in range(regions)]

    def descs(mem: list[np.ndarray]) -> np.ndarray:
        rows = [np.array([[m[i].ctypes.data, block_bytes, 0] for i in range(blocks)], np.uint64) for m in mem]
        return np.concatenate(rows)

    for agent, mem in ((a, mem_a), (b, mem_b)):
        reg = agent.register_memory(np.array([[m.ctypes.data, m.nbytes, 0] for m in mem], np.uint64), "DRAM")
        stack.callback(agent.deregister_memory, reg)
    a.add_remote_agent(b.get_agent_metadata())
    stack.callback(a.remove_remote_agent, "bare-b")
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", descs(mem_a), "DRAM")
    remote = a.prep_xfer_dlist("bare-b", descs(mem_b), "DRAM")
    stack.callback(remote.release)
    stack.callback(local.release)
    idx = np.arange(regions, dtype=np.int32) * blocks + BLOCK

    def run(n: int) -> float:
        clear(mem_a)
        t = time.perf_counter()
        for _ in range(n):
            h = a.make_prepped_xfer("READ", local, idx, remote, idx)
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
                b.get_new_notifs()
            assert state == "DONE"
            h.release()
        seconds = (time.perf_counter() - t) / n
        check_landed(mem_a, mem_b, "bare")
        return seconds

    return run


async def paired(regions: int, blocks: int, block_bytes: int, n: int, repeats: int,
                 telemetry: bool) -> dict[str, list[float]]:
    """Seconds per read, bare and aionixl, over ``repeats`` alternating chunks of ``n``."""
    src = [np.ones((blocks, block_bytes), np.uint8) for _ in range(regions)]
    dst = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(regions)]
    tuning = aionixl.lowlevel.Tuning(nixl_telemetry=telemetry)
    with ExitStack() as stack:
        bare = bare_reader(stack, regions, blocks, block_bytes)
        async with aionixl.Engine("eng-src", src, tuning=tuning) as s, \
                aionixl.Engine("eng-dst", dst, listen=None, tuning=tuning) as d:
            assert s.address is not None
            peer = await d.connect(s.address)
            transfer = d.transfer_blocks

            async def engine(count: int) -> float:
                block = BLOCK  # a local: [block] costs what the literal [3] did
                clear(dst)
                t = time.perf_counter()
                for _ in range(count):
                    await transfer(peer, [block], [block])
                seconds = (time.perf_counter() - t) / count
                check_landed(dst, src, "engine's")
                return seconds

            bare(n), await engine(n)  # the first chunk of each warms up its connection
            out: dict[str, list[float]] = {"bare": [], "aionixl": []}
            for _ in range(repeats):
                out["bare"].append(bare(n))
                out["aionixl"].append(await engine(n))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--regions", type=int, default=2)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--n", type=int, default=1000)
    p.add_argument("--repeats", type=int, default=25)
    p.add_argument("--telemetry", action="store_true", help="engines capture NIXL telemetry")
    args = p.parse_args()
    shape = (args.regions, args.blocks, args.block_bytes, args.n, args.repeats, args.telemetry)
    print(f"one-block read, {args.regions} regions x {args.block_bytes} B, {args.repeats} alternating "
          f"chunks of {args.n} reads")
    print(f"{'backend':<9} {'bare us':>8} {'aionixl us':>11} {'ratio':>7} {'p10-p90':>13}")
    for backend in ("asyncio", "trio"):
        runs: dict[str, Any] = anyio.run(paired, *shape, backend=backend)
        ratios = [mine / theirs for mine, theirs in zip(runs["aionixl"], runs["bare"], strict=True)]
        q = statistics.quantiles(ratios, n=10)
        print(f"{backend:<9} {statistics.median(runs['bare']) * 1e6:>8.2f} "
              f"{statistics.median(runs['aionixl']) * 1e6:>11.2f} {statistics.median(ratios):>7.3f} "
              f"{q[0]:>6.3f}-{q[-1]:.3f}")


if __name__ == "__main__":
    main()
