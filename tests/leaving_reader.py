"""A reader that leaves in the middle of a large read: the process side of issue 13's scenario.

    python -m tests.leaving_reader --address tcp://127.0.0.1:5555 --way timeout \
        --blocks 64 --block-bytes 1048576 --regions 1 --backend trio

It connects, reads every block once (wiring up the connection and timing a full read),
then starts the same read again and leaves after a random part of that time, in one of
five ways: ``aclose`` (the engine closes under the read), ``disconnect``, ``cancel`` (the
caller's scope is cancelled), ``timeout`` (``transfer_blocks(timeout=...)``) or ``kill``
(SIGKILL of this process). Where the process lives on, it then overwrites its destination
blocks, keeps its engine (or a new one) running for a while, and checks that no byte of
the abandoned read landed afterwards. The last message on stdout is its report
(a line of :mod:`aionixl._lines`).
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
import time
from typing import Any

import anyio
import numpy as np

import aionixl
from aionixl._lines import write_file


async def main(args: argparse.Namespace) -> None:
    cache = [np.zeros((args.blocks, args.block_bytes), np.uint8) for _ in range(args.regions)]
    ids = list(range(args.blocks))
    report: dict[str, Any] = {"way": args.way}
    config = aionixl.EngineConfig(read_mode=args.read_mode)
    engine = aionixl.Engine(f"reader-{os.getpid()}", cache, listen=None, config=config)
    async with engine:
        peer = await engine.connect(args.address, timeout=30)
        report["read_mode"] = peer.read_mode
        full = float("inf")
        for _ in range(2):  # the first one also wires the connection up
            start = time.perf_counter()
            await engine.transfer_blocks(peer, ids, ids, timeout=120)
            full = min(full, time.perf_counter() - start)
        report["full_read_s"] = full
        rng = random.Random(args.seed)
        leave_after = full * rng.uniform(0.1, 0.5)
        report["left_after_s"] = leave_after
        for region in cache:
            region[:] = 0
        finished = False
        outcome = "none"

        async def read(timeout: float) -> None:
            nonlocal finished, outcome
            try:
                await engine.transfer_blocks(peer, ids, ids, timeout=timeout)
                finished = True
                outcome = "finished"
            except Exception as exc:
                outcome = type(exc).__name__

        async with anyio.create_task_group() as tg:
            if args.way == "timeout":
                tg.start_soon(read, leave_after)
            else:
                tg.start_soon(read, 120.0)
                await anyio.sleep(leave_after)
                if args.way == "kill":
                    write_file(sys.stdout, {
                        "event": "killing", "way": "kill", "read_mode": peer.read_mode, "full_read_s": full,
                        "left_after_s": leave_after, "finished_before_leaving": finished})
                    os.kill(os.getpid(), signal.SIGKILL)
                elif args.way == "cancel":
                    tg.cancel_scope.cancel()
                elif args.way == "disconnect":
                    await engine.disconnect(peer)
                elif args.way == "aclose":
                    await engine.aclose()
        report["outcome"] = "cancelled" if args.way == "cancel" and not finished else outcome
        report["finished_before_leaving"] = finished
        # No late bytes: our blocks now hold our own pattern and must keep it.
        for region in cache:
            region[:] = 0xA5
        await anyio.sleep(args.settle)  # an open engine keeps progressing meanwhile
        report["late_bytes"] = int(sum(int(np.count_nonzero(r != 0xA5)) for r in cache))
        # metrics()'s counts and flags (what the deprecated stats() had, and more)
        report["stats"] = ({k: v for k, v in engine.metrics().as_dict().items() if isinstance(v, (int, bool))}
                           if not engine.closed else {})
    report["resources"] = engine.live_resources()
    write_file(sys.stdout, report)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--way", required=True, choices=["aclose", "disconnect", "cancel", "timeout", "kill"])
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--regions", type=int, default=1)
    parser.add_argument("--backend", default="asyncio")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--settle", type=float, default=0.5)
    parser.add_argument("--read-mode", default="auto", choices=["auto", "get", "push"])
    a = parser.parse_args()
    anyio.run(main, a, backend=a.backend)
