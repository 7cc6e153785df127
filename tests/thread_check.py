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


async def main() -> dict[str, int]:
    async with aionixl.Engine("warm", [np.zeros((2, 64), np.uint8)]):
        pass  # the first engine loads NIXL's plugins; count from here
    report = {"python_threads_before": threading.active_count(), "os_tasks_before": tasks()}
    async with aionixl.Engine("a", [np.zeros((4, 64), np.uint8)]) as a, \
            aionixl.Engine("b", [np.ones((4, 64), np.uint8)], listen=None) as b:
        assert a.address is not None
        peer = await b.connect(a.address)
        await b.transfer_blocks(peer, [0], [1], notify=b"n")
        await a.wait_notification(b"n", timeout=10)
        report["python_threads_during"] = threading.active_count()
        report["os_tasks_during"] = tasks()
    report["python_threads_after"] = threading.active_count()
    report["os_tasks_after"] = tasks()
    return report


if __name__ == "__main__":
    print(json.dumps(anyio.run(main, backend=sys.argv[1])))
