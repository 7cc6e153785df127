"""The demo behind ``aionixl demo``: a prefill engine in a child process, a decode engine here.

The prefill side fills its KV cache with seeded random bytes; the decode side reads blocks,
checks every byte, writes some back, and waits for the prefill side to confirm by
notification. It prints what moved and how long it took.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import anyio
import numpy as np
import numpy.typing as npt

from ._engine import Engine
from ._notifications import Notification


def make_cache(layers: int, blocks: int, block_bytes: int, seed: int | None) -> list[npt.NDArray[np.uint8]]:
    """Per layer one K and one V region, as a [2 * layers] list of [blocks, block_bytes]."""
    if seed is None:
        return [np.zeros((blocks, block_bytes), np.uint8) for _ in range(2 * layers)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (blocks, block_bytes), dtype=np.uint8) for _ in range(2 * layers)]


async def serve(layers: int, blocks: int, block_bytes: int, seed: int) -> None:
    """Child side: serve the seeded cache until stdin closes; confirm writes it receives."""
    cache = make_cache(layers, blocks, block_bytes, seed)
    async with Engine(f"demo-prefill-{os.getpid()}", cache) as engine:
        print(json.dumps({"address": engine.address}), flush=True)
        async with anyio.create_task_group() as tg:
            async def confirm_writes() -> None:
                note: Notification = await engine.wait_notification(b"wrote-block-0")
                ok = all(np.array_equal(r[0], np.full(block_bytes, 7, np.uint8)) for r in cache)
                peer = engine.peers[note.peer]
                await engine.send_notification(peer, b"verified" if ok else b"corrupt")

            tg.start_soon(confirm_writes)
            fd = sys.stdin.fileno()
            while True:
                await anyio.wait_readable(fd)
                if not os.read(fd, 4096):
                    break
            tg.cancel_scope.cancel()


async def run(layers: int, blocks: int, block_bytes: int, rounds: int, backend: str) -> int:
    seed = 20261202
    child = subprocess.Popen(
        [sys.executable, "-m", "aionixl", "_demo-serve", str(layers), str(blocks), str(block_bytes),
         str(seed)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        address = json.loads(_first_json_line(child.stdout))["address"]
        expected = make_cache(layers, blocks, block_bytes, seed)
        cache = make_cache(layers, blocks, block_bytes, None)
        block_set_bytes = block_bytes * 2 * layers
        print(f"aionixl demo ({backend}): {layers} layers x K/V, {blocks} blocks of "
              f"{block_bytes} B per region ({block_set_bytes / 1024:.0f} KiB per block id)")
        t0 = time.perf_counter()
        async with Engine(f"demo-decode-{os.getpid()}", cache, listen=None) as engine:
            peer = await engine.connect(address, timeout=30)
            print(f"  connected to {peer.name} at {address} in {(time.perf_counter() - t0) * 1e3:.1f} ms")
            ids = list(range(blocks))
            result = await engine.transfer_blocks(peer, ids, ids[::-1], op="read")
            ok = all(np.array_equal(c, e[::-1]) for c, e in zip(cache, expected, strict=True))
            print(f"  read {result.blocks} blocks ({result.nbytes / 2**20:.1f} MiB) in "
                  f"{result.seconds * 1e3:.2f} ms: {'bytes verified' if ok else 'MISMATCH'}")
            times = []
            for i in range(rounds):
                r = await engine.transfer_blocks(peer, [i % blocks], [(i * 7) % blocks])
                times.append(r.seconds)
            print(f"  {rounds} one-block reads: median {statistics.median(times) * 1e6:.1f} us, "
                  f"p90 {sorted(times)[int(0.9 * len(times))] * 1e6:.1f} us")
            for region in cache:
                region[0] = 7
            await engine.transfer_blocks(peer, [0], [0], op="write", notify=b"wrote-block-0")
            verdict = await engine.wait_notification(b"verified", peer=peer, timeout=10)
            print(f"  wrote block 0 back; the prefill side says: {verdict.message.decode()}")
            t1 = time.perf_counter()
        print(f"  engine closed in {(time.perf_counter() - t1) * 1e3:.1f} ms; "
              f"resources left: {sum(engine.live_resources().values())}")
        return 0 if ok else 1
    finally:
        if child.stdin is not None:
            child.stdin.close()
        child.wait(timeout=30)


def _first_json_line(stream: object) -> str:
    for line in stream:  # type: ignore[attr-defined]
        if isinstance(line, str) and line.startswith("{"):
            return line
    raise RuntimeError("the prefill process exited before it listened")
