"""Shared fixtures: real NIXL engines on loopback, both anyio backends."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aionixl

_names = itertools.count()
HERE = Path(__file__).parent


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def unique(prefix: str) -> str:
    """NIXL agent names must be unique among the agents that meet; keep them unique per run."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def numpy_cache(num_blocks: int = 16, block_bytes: int = 4096, regions: int = 2,
                seed: int | None = None) -> list[np.ndarray]:
    if seed is None:
        return [np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]


@asynccontextmanager
async def engine_pair(src_cache: list[Any], dst_cache: list[Any],
                      config: aionixl.EngineConfig | None = None,
                      ) -> AsyncIterator[tuple[aionixl.Engine, aionixl.Engine, aionixl.Peer]]:
    """(source engine that listens, destination engine, the destination's Peer for the source)."""
    async with aionixl.Engine(unique("src"), src_cache, config=config) as src, \
            aionixl.Engine(unique("dst"), dst_cache, listen=None, config=config) as dst:
        assert src.address is not None
        peer = await dst.connect(src.address, timeout=10)
        yield src, dst, peer


def zero_resources(engine: aionixl.Engine) -> bool:
    return all(v == 0 for v in engine.live_resources().values())


def task_count() -> int:
    return len(os.listdir("/proc/self/task"))


class PeerProcess:
    """An aionixl engine in a child process, filled with seeded random blocks."""

    def __init__(self, *, seed: int, num_blocks: int, block_bytes: int, regions: int,
                 env: dict[str, str] | None = None, name: str | None = None,
                 listen: str = "tcp://127.0.0.1:0", connect: str | None = None,
                 secret: bytes | None = None, merge_stderr: bool = False) -> None:
        self.seed, self.num_blocks, self.block_bytes, self.regions = seed, num_blocks, block_bytes, regions
        args = [sys.executable, str(HERE / "peer_main.py"), "--name", name or unique("child"),
                "--seed", str(seed), "--blocks", str(num_blocks), "--block-bytes", str(block_bytes),
                "--regions", str(regions), "--listen", listen, *(["--connect", connect] if connect else []),
                *(["--secret", secret.decode()] if secret else [])]
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT if merge_stderr else None,
                                     env={**os.environ, **(env or {})}, text=True)
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                info = json.loads(line)
                self.address: str = info["address"]
                self.name: str = info["name"]
                break
        else:
            raise RuntimeError(f"peer process exited early with {self.proc.wait()}")

    def expected(self) -> list[np.ndarray]:
        return numpy_cache(self.num_blocks, self.block_bytes, self.regions, seed=self.seed)

    def stop(self) -> int:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, 18)  # SIGCONT, in case a test stopped it
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                return self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        return self.proc.returncode


@pytest.fixture
def peer_process_factory() -> Iterator[Any]:
    started: list[PeerProcess] = []

    def start(**kw: Any) -> PeerProcess:
        kw.setdefault("seed", 1234)
        kw.setdefault("num_blocks", 32)
        kw.setdefault("block_bytes", 8192)
        kw.setdefault("regions", 2)
        p = PeerProcess(**kw)
        started.append(p)
        return p

    yield start
    for p in started:
        p.stop()
