"""Run by test_engine in a fresh interpreter: count threads around an engine's life."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import threading
from typing import Any

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


#: A peer in a process of its own, killed by the test: prints its address, then waits.
SERVER = """
import sys, anyio, numpy as np, aionixl
async def serve():
    async with aionixl.Engine("killed-" + sys.argv[1], [np.ones((4, 4096), np.uint8)]) as e:
        print(e.address, flush=True)
        await anyio.sleep_forever()
anyio.run(serve)
"""


async def peer_killed() -> dict[str, Any]:
    """A transfer posted to a SIGKILLed peer fails (and evicts it) while the caller keeps
    its Peer and the error: the engine's close must still end NIXL's agent and its threads."""
    async with aionixl.Engine("warm", [np.zeros((2, 64), np.uint8)]):
        pass
    report: dict[str, Any] = {"os_tasks_before": await settled_tasks()}
    server = subprocess.Popen([sys.executable, "-c", SERVER, str(os.getpid())], stdout=subprocess.PIPE,
                              text=True)
    assert server.stdout is not None
    address = server.stdout.readline().strip()
    errors: list[BaseException] = []
    engine = aionixl.Engine("reader", [np.zeros((4, 4096), np.uint8)], listen=None)
    async with engine:
        peer = await engine.connect(address)
        await engine.transfer_blocks(peer, [0], [1], op="write")
        server.kill()
        server.wait()
        for _ in range(50):
            try:
                await engine.transfer_blocks(peer, [0], [1], op="write", timeout=5)
            except aionixl.AionixlError as exc:
                errors.append(exc)  # kept, as a caller may keep it
                break
            await anyio.sleep(0.05)
    report["error"] = type(errors[0]).__name__ if errors else None
    report["peer_connected"] = peer.connected
    report["leaked_on_close"] = engine.metrics().leaked_on_close
    report["os_tasks_after"] = await settled_tasks(at_most=report["os_tasks_before"])
    return report


if __name__ == "__main__":
    # "asyncio", "trio", or "uvloop" (asyncio on uvloop's loop); then "peer-killed" for that check
    loop = sys.argv[1]
    uvloop = {"use_uvloop": True} if loop == "uvloop" else {}
    backend = "asyncio" if uvloop else loop
    check = peer_killed if sys.argv[2:] == ["peer-killed"] else main
    print(json.dumps(anyio.run(check, backend=backend, backend_options=uvloop)))
