"""Run by test_engine in a fresh interpreter: count threads around an engine's life."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading

import anyio
import numpy as np

import aionixl

logging.getLogger("nixl").setLevel(logging.WARNING)


def tasks() -> int:
    return len(os.listdir("/proc/self/task"))


async def settled_tasks(at_most: int | None = None) -> int:
    """The OS task count once exiting threads are gone from /proc.

    pthread_join (zmq's context term, UCX's async thread) returns when the kernel clears the
    thread's tid, a moment before its /proc entry goes: on a loaded machine a joined thread can
    still be listed. So wait, bounded, until the count reaches ``at_most`` or holds still for
    50 ms; a thread that is really left running keeps the count up and fails the test.
    """
    last, still = tasks(), 0
    with anyio.move_on_after(5):
        while (at_most is None and still < 5) or (at_most is not None and last > at_most):
            await anyio.sleep(0.01)
            now = tasks()
            still = still + 1 if now == last else 0
            last = now
    return last


async def main() -> dict[str, int]:
    async with aionixl.Engine("warm", [np.zeros((2, 64), np.uint8)]):
        pass  # the first engine loads NIXL's plugins; count from here
    report = {"python_threads_before": threading.active_count(), "os_tasks_before": await settled_tasks()}
    async with aionixl.Engine("a", [np.zeros((4, 64), np.uint8)]) as a, \
            aionixl.Engine("b", [np.ones((4, 64), np.uint8)], listen=None) as b:
        assert a.address is not None
        peer = await b.connect(a.address)
        await b.transfer_blocks(peer, [0], [1], notify=b"n")
        await a.wait_notification(b"n", timeout=10)
        report["python_threads_during"] = threading.active_count()
        report["os_tasks_during"] = tasks()
    report["python_threads_after"] = threading.active_count()
    report["os_tasks_after"] = await settled_tasks(at_most=report["os_tasks_before"])
    return report


if __name__ == "__main__":
    # "asyncio", "trio", or "uvloop" (asyncio on uvloop's loop)
    loop = sys.argv[1]
    uvloop = {"use_uvloop": True} if loop == "uvloop" else {}
    backend = "asyncio" if uvloop else loop
    print(json.dumps(anyio.run(main, backend=backend, backend_options=uvloop)))
