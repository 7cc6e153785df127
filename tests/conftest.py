"""Shared fixtures: real NIXL engines on loopback, both anyio backends."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aionixl

pytest_plugins = ["aionixl.testing"]  # aionixl_remote, aionixl_pair

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


def threads() -> dict[int, str]:
    """This process's OS threads, id -> name (a thread gone mid-read is skipped)."""
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                found[int(tid)] = f.read().strip()
        except OSError:
            pass
    return found


def report_inline_ends_as_running(engine: aionixl.Engine) -> set[int]:
    """From now on, a request of ``engine`` that finishes inside its post (in one process,
    often) is reported posted and running instead, under a stand-in handle (never NIXL's;
    ``release_xfer`` passes it), so that the caller waits for it. Returns the stand-ins
    handed out so far: their requests have ended. The test decides what ``check`` says."""
    from aionixl import _transfers

    agent = engine._transfers.agent
    assert agent is not None
    real_start = agent.start_xfer
    stand_ins = itertools.count(-1000, -1)
    ended: set[int] = set()

    def start_xfer(*args: Any) -> Any:
        handle, state = real_start(*args)
        if state == _transfers.DONE and handle == _transfers.NO_HANDLE:
            handle = next(stand_ins)
            ended.add(handle)
            return handle, _transfers.PROC
        return handle, state

    agent.start_xfer = start_xfer  # type: ignore[method-assign]
    return ended
