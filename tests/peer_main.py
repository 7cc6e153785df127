"""A peer engine for cross-process tests: serves seeded random blocks until stdin closes.

Prints one JSON line with its name and address once it listens. Block contents are
``conftest.numpy_cache(blocks, block_bytes, regions, seed)``, so the parent can check
every byte it reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import anyio
import numpy as np

import aionixl


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--name", required=True)
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--blocks", type=int, required=True)
    parser.add_argument("--block-bytes", type=int, required=True)
    parser.add_argument("--regions", type=int, required=True)
    parser.add_argument("--listen", default="tcp://127.0.0.1:0")
    parser.add_argument("--connect", default=None, help="also connect to the engine listening here")
    parser.add_argument("--secret", default=None, help="EngineConfig.handshake_secret (text)")
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    cache = [rng.integers(0, 256, (args.blocks, args.block_bytes), dtype=np.uint8)
             for _ in range(args.regions)]
    config = aionixl.EngineConfig(handshake_secret=args.secret.encode() if args.secret else None)
    async with aionixl.Engine(args.name, cache, listen=args.listen, config=config) as engine:
        print(json.dumps({"name": engine.name, "address": engine.address}), flush=True)
        if args.connect:  # after the line above: the parent reads it before it can answer
            await engine.connect(args.connect, timeout=30)
        fd = sys.stdin.fileno()
        while True:
            await anyio.wait_readable(fd)
            if not os.read(fd, 4096):
                break


if __name__ == "__main__":
    anyio.run(main)
