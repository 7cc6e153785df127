"""The first transfers with ``notify=`` to a peer just connected, against later ones.

Each round opens a fresh engine in this process, connects to the benchmark's prefill child
process (another process: UCX sends notifications over TCP there), reads one block to wire
the data path up, then times three one-block reads with a notification. UCX sets up the
path notifications take on first use; ``connect()`` sends a probe so that it is set up
then (docs/architecture.md, "Reserved notifications"), not inside the first notified read.

Usage: .venv/bin/python benchmarks/first_notify.py [rounds] [asyncio|trio]
"""

from __future__ import annotations

import logging
import sys
import time

import anyio
import numpy as np

import aionixl
from aionixl._bench._target import Target

logging.getLogger("nixl").setLevel(logging.WARNING)


async def rounds(address: str, regions: list[np.ndarray], n: int) -> np.ndarray:
    out = []
    for i in range(n):
        async with aionixl.Engine(f"first-notify-{i}", regions, listen=None) as engine:
            t = time.perf_counter()
            peer = await engine.connect(address, timeout=30)
            row = [time.perf_counter() - t]
            await engine.transfer_blocks(peer, [0], [0])
            for k in range(1, 4):
                t = time.perf_counter()
                await engine.transfer_blocks(peer, [k], [k], notify=b"first-notify-%d" % k)
                row.append(time.perf_counter() - t)
        out.append(row)
    return np.array(out) * 1e3


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 9
    backend = sys.argv[2] if len(sys.argv) > 2 else "asyncio"
    layers, blocks, block_bytes = 2, 64, 16384
    target = Target(layers, blocks, block_bytes, "cpu", 1)
    try:
        target.wait_ready()
        regions = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(2 * layers)]
        ms = anyio.run(rounds, target.units[0].address, regions, n, backend=backend)
    finally:
        target.stop()
    labels = ["connect()", "1st notified read", "2nd notified read", "3rd notified read"]
    print(f"{backend}, {n} fresh engines, ms: median [min, max]")
    for label, col in zip(labels, ms.T, strict=True):
        print(f"  {label:<20} {np.median(col):8.3f} [{col.min():.3f}, {col.max():.3f}]")


if __name__ == "__main__":
    main()
