"""Idle CPU of two open, connected engines in one process, and with one notification waiter.

Usage: .venv/bin/python benchmarks/idle_cpu.py [asyncio|trio]
"""

from __future__ import annotations

import logging
import resource
import sys
import time

import anyio
import numpy as np

import aionixl

logging.getLogger("nixl").setLevel(logging.WARNING)


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def share_of_a_core(seconds: float) -> float:
    c0, t0 = cpu_seconds(), time.perf_counter()
    await anyio.sleep(seconds)
    return 100 * (cpu_seconds() - c0) / (time.perf_counter() - t0)


async def main(backend: str) -> None:
    a, b = [np.zeros((16, 4096), np.uint8)], [np.zeros((16, 4096), np.uint8)]
    async with aionixl.Engine("idle-a", a) as e1, aionixl.Engine("idle-b", b, listen=None) as e2:
        assert e1.address is not None
        peer = await e2.connect(e1.address)
        await e2.transfer_blocks(peer, [0], [0])
        await anyio.sleep(1)
        print(f"{backend}: two open idle engines: {await share_of_a_core(5):.2f}% of a core")
        async with anyio.create_task_group() as tg:
            tg.start_soon(e1.wait_notification, b"never")
            await anyio.sleep(0.5)
            print(f"{backend}: with one notification waiter: {await share_of_a_core(3):.2f}%")
            tg.cancel_scope.cancel()


if __name__ == "__main__":
    chosen = sys.argv[1] if len(sys.argv) > 1 else "asyncio"
    anyio.run(main, chosen, backend=chosen)
