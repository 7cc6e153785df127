"""The engine used the way an asyncio server uses it (pytest-asyncio, strict mode):
``asyncio.timeout``, ``asyncio.TaskGroup``, ``task.cancel()``."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aionixl
from aionixl.testing import assert_blocks_equal
from aionixl.testing._plugin import RemoteEngineFactory

from .helpers import engine_pair, numpy_cache, unique


@pytest.mark.asyncio
async def test_taskgroup_of_requests_each_with_asyncio_timeout() -> None:
    src, dst = numpy_cache(32, 1024, 2, seed=9), numpy_cache(32, 1024, 2)
    async with engine_pair(src, dst) as (listener, eng, peer):
        async def request(i: int) -> aionixl.Notification:
            async with asyncio.timeout(10):
                await eng.transfer_blocks(peer, [i], [31 - i], notify=b"req-%d" % i)
                return await listener.wait_notification(b"req-%d" % i)

        async with asyncio.TaskGroup() as tg:
            tasks = [tg.create_task(request(i)) for i in range(32)]
        assert sorted(t.result().message for t in tasks) == sorted(b"req-%d" % i for i in range(32))
        for s, d in zip(src, dst, strict=True):
            assert np.array_equal(d, s[::-1])


@pytest.mark.asyncio
async def test_task_cancel_of_a_notification_wait() -> None:
    async with aionixl.Engine(unique("solo"), numpy_cache(2, 64, 1), listen=None) as eng:
        task = asyncio.create_task(eng.wait_notification(b"never"))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert eng.metrics().notification_waiters == 0


@pytest.mark.asyncio
async def test_asyncio_timeout_and_task_cancel_release_stuck_transfers(
        aionixl_remote: RemoteEngineFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Also the aionixl_remote fixture under pytest-asyncio (with anyio's plugin loaded too)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    child = await aionixl_remote(seed=1234, num_blocks=4, block_shape=(4 << 20,), dtypes=("uint8",),
                                 env={"UCX_TLS": "tcp"})
    local = numpy_cache(4, 4 << 20, 1)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await eng.connect(child.address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0], timeout=30)
        async with child.paused():
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.2):
                    await eng.transfer_blocks(peer, [1], [1])
            assert eng.live_resources()["transfer_handles"] == 0
        # A stopped peer cannot confirm the cancelled read: it was evicted to fence it, and
        # the same Peer reconnects on its next use.
        await eng.transfer_blocks(peer, [1], [1], timeout=30)
        async with child.paused():
            task = asyncio.create_task(eng.transfer_blocks(peer, [2], [2]))
            await asyncio.sleep(0.1)
            assert eng.live_resources()["in_flight"] == 1
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert eng.live_resources()["transfer_handles"] == 0
            assert eng.live_resources()["in_flight"] == 0
        await eng.transfer_blocks(peer, [3], [3], timeout=30)
        assert_blocks_equal(local, [0, 1, 3], child.seed, [0, 1, 3], **child.geometry)
