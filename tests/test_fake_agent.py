"""The engine's state machines on the in-memory fake agent (tests/fake_agent.py): what a
transfer does is scripted (in flight for n checks, stuck, failed, its peer gone), so each
path is taken on purpose, whatever the machine's speed. The wire is tested on real NIXL
elsewhere; these test what the engine does with each answer NIXL can give."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import anyio
import numpy as np
import pytest

import aionixl
from aionixl.lowlevel import Tuning

from .fake_agent import FakeAgent, FakeNixl, Outcome
from .helpers import numpy_cache, unique, zero_resources

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 16, 1024, 2


@dataclass
class Fakes:
    src: aionixl.Engine  # listens; its blocks are read
    dst: aionixl.Engine  # reads from src through `peer`
    peer: aionixl.Peer
    src_cache: list[np.ndarray]
    dst_cache: list[np.ndarray]
    agent: FakeAgent  # dst's: script its transfers
    world: FakeNixl

    def landed(self, dst: int, src: int) -> bool:
        return all(np.array_equal(self.dst_cache[r][dst], self.src_cache[r][src]) for r in range(REGIONS))


@asynccontextmanager
async def pair(config: aionixl.EngineConfig | None = None, **tuning: object) -> AsyncIterator[Fakes]:
    world = FakeNixl()
    tune = Tuning(agent_factory=world.factory, **tuning)  # type: ignore[arg-type]
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=1)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with aionixl.Engine(unique("src"), src_cache, config=config, tuning=tune) as src, \
            aionixl.Engine(unique("dst"), dst_cache, listen=None, config=config, tuning=tune) as dst:
        assert src.address is not None
        peer = await dst.connect(src.address, timeout=10)
        yield Fakes(src, dst, peer, src_cache, dst_cache, world.agents[dst.name], world)
    assert zero_resources(src) and zero_resources(dst)


async def test_a_transfer_in_flight_for_twenty_checks_ends_through_the_poller_with_its_bytes() -> None:
    async with pair() as f:
        f.agent.script(Outcome(checks=20))  # past the inline polls: the poller finishes it
        result = await f.dst.transfer_blocks(f.peer, [2, 3], [7, 8])
        assert result.blocks == 2 and f.landed(2, 7) and f.landed(3, 8)
        assert list(f.agent.released.values()) == [1] and not f.agent.xfers


async def test_nothing_of_a_timed_out_read_lands_after_the_call_raised() -> None:
    """A read stuck in flight whose bytes land when it is released (as a UCX GET under way
    may): the handle is released, once, before the caller hears of the timeout."""
    async with pair() as f:
        f.agent.script(Outcome(stuck=True, lands_after_release=True))
        with pytest.raises(aionixl.TransferTimeoutError):
            await f.dst.transfer_blocks(f.peer, [4], [9], timeout=0.05)
        assert f.landed(4, 9)  # it landed at the release, before the raise
        for r in range(REGIONS):
            f.dst_cache[r][4] = 0
        await anyio.sleep(0.05)
        assert not f.dst_cache[0][4].any() and not f.dst_cache[1][4].any()
        assert f.agent.released and set(f.agent.released.values()) == {1}
        assert f.dst.metrics().transfers["read"]["timeout"] == 1
        assert f.peer.connected  # the fencing read answered: the peer is fine
        await f.dst.transfer_blocks(f.peer, [5], [10])
        assert f.landed(5, 10)


async def test_a_peer_whose_process_is_gone_at_the_post_is_evicted() -> None:
    async with pair() as f:
        f.agent.script(Outcome(gone=True))
        with pytest.raises(aionixl.PeerDisconnectedError):
            await f.dst.transfer_blocks(f.peer, [1], [1])
        assert not f.peer.connected
        metrics = f.dst.metrics()
        assert metrics.peers_evicted == 1 and metrics.evictions["disconnected"] == 1
        with pytest.raises(aionixl.PeerDisconnectedError, match="evicted"):
            await f.dst.transfer_blocks(f.peer, [1], [1])


async def test_a_transfer_nixl_reports_failed_raises_transfer_error_and_keeps_the_peer() -> None:
    async with pair() as f:
        f.agent.script(Outcome(fail=True))
        with pytest.raises(aionixl.TransferError) as caught:
            await f.dst.transfer_blocks(f.peer, [1], [2])
        assert not isinstance(caught.value, aionixl.PeerDisconnectedError)
        assert f.peer.connected and f.dst.metrics().transfers["read"]["error"] == 1
        await f.dst.transfer_blocks(f.peer, [1], [2])
        assert f.landed(1, 2)


async def test_closing_under_a_stuck_transfer_tells_its_caller_and_releases_everything() -> None:
    outcome: list[BaseException] = []
    async with pair(close_grace=0.05) as f:
        f.agent.script(Outcome(stuck=True))

        async def stuck() -> None:
            try:
                await f.dst.transfer_blocks(f.peer, [6], [6], timeout=60)
            except aionixl.AionixlError as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(stuck)
            await anyio.sleep(0.02)
            await f.dst.aclose()
        assert [type(e) for e in outcome] == [aionixl.EngineClosedError]
        assert set(f.agent.released.values()) == {1}
        assert zero_resources(f.dst)


async def test_a_push_read_whose_server_never_confirms_the_cancel_evicts_the_server() -> None:
    """The server's chunk is stuck in flight: the reader times out, asks it to stop, hears
    nothing within push_cancel_timeout, and evicts it (its connection may still deliver)."""
    config = aionixl.EngineConfig(read_mode="push", push_staging_bytes=0)
    async with pair(config, push_cancel_timeout=0.05) as f:
        assert f.peer.read_mode == "push"
        f.world.agents[f.src.name].script(Outcome(stuck=True))  # the server's write
        with pytest.raises(aionixl.TransferTimeoutError):
            await f.dst.transfer_blocks(f.peer, [3], [3], timeout=0.05)
        metrics = f.dst.metrics()
        assert metrics.fence_evictions == 1 and not f.peer.connected


async def test_callers_arriving_together_ride_in_one_merged_request() -> None:
    """The first caller's request is held in flight; the seven that call meanwhile gather
    into one merged request, each with its own blocks."""
    async with pair(coalesce_window=0.05) as f:
        f.agent.script(Outcome(checks=200))

        async def read(i: int) -> None:
            await f.dst.transfer_blocks(f.peer, [i], [15 - i])

        async with anyio.create_task_group() as tg:
            for i in range(8):
                tg.start_soon(read, i)
        assert all(f.landed(i, 15 - i) for i in range(8))
        metrics = f.dst.metrics()
        assert metrics.merged_requests >= 1 and metrics.merged_calls >= 2
