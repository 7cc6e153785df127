"""Per-transfer cost of an awaited one-block read against a bare synchronous NIXL loop.

Both run in this process, against the same kind of peer (a second agent / engine in the
same process, on DRAM), with the same regions and block ids. Prints medians over repeats
and the spread; the ratio is the number to watch. ``--telemetry`` creates the engines' agents
with NIXL's per-request telemetry (``EngineConfig(nixl_telemetry=True)``). Usage:
    .venv/bin/python benchmarks/overhead.py [--regions 2] [--n 3000] [--repeats 7] [--telemetry]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

import anyio
import numpy as np

import aionixl

logging.getLogger("nixl").setLevel(logging.WARNING)


def bare_loop(regions: int, blocks: int, block_bytes: int, n: int, repeats: int) -> list[float]:
    from nixl._api import nixl_agent, nixl_agent_config

    cfg = nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
    a, b = nixl_agent("bare-a", cfg), nixl_agent("bare-b", cfg)
    mem_a = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(regions)]
    mem_b = [np.ones((blocks, block_bytes), np.uint8) for _ in range(regions)]

    def descs(mem: list[np.ndarray]) -> np.ndarray:
        rows = [np.array([[m[i].ctypes.data, block_bytes, 0] for i in range(blocks)], np.uint64) for m in mem]
        return np.concatenate(rows)

    regs = []
    for agent, mem in ((a, mem_a), (b, mem_b)):
        regs.append((agent, agent.register_memory(
            np.array([[m.ctypes.data, m.nbytes, 0] for m in mem], np.uint64), "DRAM")))
    a.add_remote_agent(b.get_agent_metadata())
    local = a.prep_xfer_dlist("NIXL_INIT_AGENT", descs(mem_a), "DRAM")
    remote = a.prep_xfer_dlist("bare-b", descs(mem_b), "DRAM")
    idx = np.arange(regions, dtype=np.int32) * blocks + 3
    results = []
    for rep in range(repeats + 1):
        t = time.perf_counter()
        for _ in range(n):
            h = a.make_prepped_xfer("READ", local, idx, remote, idx)
            state = a.transfer(h)
            while state == "PROC":
                state = a.check_xfer_state(h)
                b.get_new_notifs()
            assert state == "DONE"
            h.release()
        if rep:  # the first round warms up the connection
            results.append((time.perf_counter() - t) / n)
    local.release()
    remote.release()
    a.remove_remote_agent("bare-b")
    for agent, reg in regs:
        agent.deregister_memory(reg)
    return results


async def engine_loop(regions: int, blocks: int, block_bytes: int, n: int, repeats: int,
                      telemetry: bool = False) -> list[float]:
    src = [np.ones((blocks, block_bytes), np.uint8) for _ in range(regions)]
    dst = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(regions)]
    cfg = aionixl.EngineConfig(nixl_telemetry=True) if telemetry else aionixl.EngineConfig()
    async with aionixl.Engine("eng-src", src, config=cfg) as s, \
            aionixl.Engine("eng-dst", dst, listen=None, config=cfg) as d:
        assert s.address is not None
        peer = await d.connect(s.address)
        results = []
        for rep in range(repeats + 1):
            t = time.perf_counter()
            for _ in range(n):
                await d.transfer_blocks(peer, [3], [3])
            if rep:
                results.append((time.perf_counter() - t) / n)
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--regions", type=int, default=2)
    p.add_argument("--blocks", type=int, default=64)
    p.add_argument("--block-bytes", type=int, default=4096)
    p.add_argument("--n", type=int, default=3000)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--telemetry", action="store_true", help="engines capture NIXL telemetry")
    args = p.parse_args()
    shape = (args.regions, args.blocks, args.block_bytes, args.n, args.repeats)
    rows = {"bare NIXL (sync loop)": bare_loop(*shape)}
    for backend in ("asyncio", "trio"):
        rows[f"aionixl on {backend}"] = anyio.run(engine_loop, *shape, args.telemetry, backend=backend)
    base = statistics.median(rows["bare NIXL (sync loop)"])
    print(f"one-block read, {args.regions} regions x {args.block_bytes} B, {args.n} transfers x "
          f"{args.repeats} repeats")
    print(f"{'contender':<24} {'median us':>10} {'min':>8} {'max':>8} {'ratio':>7}")
    for name, values in rows.items():
        med = statistics.median(values)
        print(f"{name:<24} {med * 1e6:>10.2f} {min(values) * 1e6:>8.2f} {max(values) * 1e6:>8.2f} "
              f"{med / base:>7.2f}")


if __name__ == "__main__":
    main()
