"""Run by test_cross_process in a fresh interpreter, so that everything UCX prints is seen:
close an engine with 64 transfers in flight to a live peer in another process."""

from __future__ import annotations

import json
import logging
import sys

import anyio

import aionixl
import aionixl.lowlevel
from aionixl.testing import RemoteEngine

from .helpers import numpy_cache

logging.getLogger("nixl").setLevel(logging.WARNING)


async def main() -> None:
    outcomes: dict[str, int] = {}
    remote = RemoteEngine(seed=1, num_blocks=64, block_shape=(1 << 18,), dtypes=("uint8", "uint8"))
    async with remote:
        # A longer grace than the default 0.5 s: on a loaded 2-core machine 64 reads of
        # 512 KiB over TCP can outlast 0.5 s, and what is checked is that close waits.
        eng = aionixl.Engine("close-check", numpy_cache(64, 1 << 18, 2), listen=None,
                             tuning=aionixl.lowlevel.Tuning(close_grace=3.0))
        async with eng:
            peer = await eng.connect(remote.address, timeout=30)

            async def read(block: int) -> None:
                try:
                    await eng.transfer_blocks(peer, [block], [block], timeout=60)
                    key = "done"
                except aionixl.EngineClosedError:
                    key = "closed"
                outcomes[key] = outcomes.get(key, 0) + 1

            async with anyio.create_task_group() as tg:
                for block in range(64):
                    tg.start_soon(read, block)
                # Close as soon as the reads are posted: a fixed sleep (it was 10 ms) could
                # outlast them on loopback TCP, and then close met nothing under way.
                with anyio.fail_after(30):
                    while not (in_flight := eng.live_resources()["in_flight"]):
                        await anyio.sleep(0)
                await eng.aclose()
    # The child's output (its UCX warnings, if any) goes to a file: the test reads it here.
    sys.stderr.write(remote.stderr_tail(1 << 24))
    print(json.dumps({"in_flight_at_close": in_flight, "outcomes": outcomes,
                      "resources": eng.live_resources()}), flush=True)


if __name__ == "__main__":
    sys.exit(anyio.run(main))
