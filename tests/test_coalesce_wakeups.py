"""Members of an ended merged request woken in chunks: each wakes with its own bytes,
the drainer is not woken for it, closing wakes the rest; and members cancelled while
they wait keep their results (returning) and meet the cancellation after."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl import _coalesce

from .helpers import (
    BLOCK_BYTES,
    BLOCKS,
    REGIONS,
    TOGETHER,
    engine_pair,
    finish_inside_posts,
    numpy_cache,
    posted_requests,
    zero_resources,
)

pytestmark = pytest.mark.anyio


#: More one-block callers than the engine wakes in one go when their merged request ends.
MANY = 3 * _coalesce._WAKE_CHUNK + 17


async def test_members_beyond_one_wake_chunk_all_wake_with_their_own_bytes() -> None:
    """Long-lived callers, more than a wake chunk of them: every round each gets its bytes
    (another source block each round, so a caller woken before its data landed would
    see the last round's)."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=31)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        posted = posted_requests(dst, "local")
        rounds = 4
        done = [0] * MANY

        async def caller(block: int) -> None:
            for r in range(rounds):
                result = await dst.transfer_blocks(peer, [block], [(block + r) % MANY])
                assert result.blocks == 1
                for region in range(REGIONS):
                    assert np.array_equal(dst_cache[region][block],
                                          src_cache[region][(block + r) % MANY]), (block, r)
                done[block] += 1

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for block in range(MANY):
                    tg.start_soon(caller, block)
        assert done == [rounds] * MANY
        sizes = [len(request) // REGIONS for request in posted]
        assert max(sizes) > _coalesce._WAKE_CHUNK, sizes  # some request woke in chunks
        assert dst._inflight.deferred == []
    assert zero_resources(dst) and zero_resources(src)


async def test_waking_members_in_chunks_does_not_wake_the_drainer() -> None:
    """The poller wakes the notification drainer (ending its back-off) when requests are in
    flight, not when it was woken only to wake members in chunks: in one process a merged
    request often finishes inside its post, and each such wake restarted the drainer's
    back-off from its shortest step."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=34)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        transfers = dst._coalescer
        chunk_wakes = 0
        real_wake_members = transfers._wake_members

        def wake_members(waiters: list[object]) -> None:
            nonlocal chunk_wakes
            real_wake_members(waiters)
            chunk_wakes += bool(waiters)  # the poller wakes the rest

        transfers._wake_members = wake_members  # type: ignore[method-assign]
        busy_at_wake: list[bool] = []
        real_wake = dst._drainer.wake

        def wake() -> None:
            busy_at_wake.append(bool(dst._inflight.records or dst._inflight.parked))
            real_wake()

        dst._drainer.wake = wake  # type: ignore[method-assign]

        async def caller(block: int) -> None:
            for _ in range(4):
                await dst.transfer_blocks(peer, [block], [block])

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for block in range(MANY):
                    tg.start_soon(caller, block)
        assert chunk_wakes > 0
        assert all(busy_at_wake), busy_at_wake
    assert zero_resources(dst) and zero_resources(src)


async def test_closing_while_members_are_woken_in_chunks_leaves_no_one_waiting() -> None:
    """The poller wakes all but the first chunk; closing stops it, and it wakes the rest."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=32)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    outcomes: list[str] = []

    async def caller(engine: aionixl.Engine, peer: aionixl.Peer, block: int) -> None:
        try:
            await engine.transfer_blocks(peer, [block], [block])
            outcomes.append("ok")
        except aionixl.EngineClosedError:
            outcomes.append("closed")

    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for block in range(MANY):
                    tg.start_soon(caller, dst, peer, block)
                while not dst._inflight.deferred:  # a merged request ended, chunks left
                    await anyio.sleep(0)
                await dst.aclose()
    assert len(outcomes) == MANY
    assert outcomes.count("ok") >= _coalesce._WAKE_CHUNK
    assert zero_resources(dst) and zero_resources(src)


async def _until_chunks_wait_then(dst: aionixl.Engine, peer: aionixl.Peer, caller: Any,
                                  act: Callable[[], object]) -> None:
    """Run ``caller(dst, peer, block)`` for MANY blocks; once a merged request has ended
    with members still parked for their wake chunk, call ``act`` (it cancels them)."""
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for block in range(MANY):
                tg.start_soon(caller, dst, peer, block)
            while not dst._inflight.deferred:  # a request ended, chunks still parked
                await anyio.sleep(0)
            act()


async def test_a_member_cancelled_while_waiting_for_its_wake_after_its_blocks_landed_reports_them(
        ) -> None:
    """The members of an ended request are woken a chunk at a time; one cancelled before its
    turn comes gets its result (its blocks did land: told otherwise it would retry, and
    write and notify twice), and the cancellation at its next checkpoint."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=34)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    returned: list[int] = []
    cancelled_after: list[int] = []
    scopes = [anyio.CancelScope() for _ in range(MANY)]

    async def caller(engine: aionixl.Engine, peer: aionixl.Peer, block: int) -> None:
        with scopes[block]:
            await engine.transfer_blocks(peer, [block], [block])
            returned.append(block)
            await anyio.lowlevel.checkpoint()
        if scopes[block].cancelled_caught:
            cancelled_after.append(block)

    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        posted = posted_requests(dst, "local")
        await _until_chunks_wait_then(dst, peer, caller, lambda: [s.cancel() for s in scopes])
        stats = dst.metrics().transfers["read"]
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region], src_cache[region])  # every block landed
    # The first caller posted alone (a lone transfer still in flight when cancelled raises,
    # as before); every member of the merged request was told its blocks landed.
    members = {i for i in max(posted, key=len) if i < MANY}
    assert len(members) > 2 * _coalesce._WAKE_CHUNK
    assert members <= set(returned)
    assert len(cancelled_after) > len(members) - 2 * _coalesce._WAKE_CHUNK  # parked, then cancelled
    assert stats["ok"] >= len(members) and stats["cancelled"] <= MANY - len(members)
    assert zero_resources(dst) and zero_resources(src)


# ---- asyncio's own cancellation: a kept result requests the cancellation again ------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_member_that_keeps_its_result_still_times_out_in_asyncio_timeout(
        ) -> None:
    """``asyncio.timeout`` expiring while members wait for their wake chunk: each keeps its
    result, then its next await raises, and the timeout turns that into TimeoutError
    (the cancellation was requested again and is counted once, as the timeout expects)."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=35)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    loop = asyncio.get_running_loop()
    timeouts: list[asyncio.Timeout] = []
    returned: list[int] = []
    went_on: list[int] = []
    timed_out: list[int] = []
    leaked: list[int] = []

    async def caller(engine: aionixl.Engine, peer: aionixl.Peer, block: int) -> None:
        try:
            async with asyncio.timeout(None) as timeout:
                timeouts.append(timeout)
                await engine.transfer_blocks(peer, [block], [block])
                returned.append(block)
                await asyncio.sleep(0)
                went_on.append(block)
        except TimeoutError:
            timed_out.append(block)
        except asyncio.CancelledError:
            leaked.append(block)

    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        posted = posted_requests(dst, "local")
        await _until_chunks_wait_then(dst, peer, caller,
                                      lambda: [t.reschedule(loop.time()) for t in timeouts])
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region], src_cache[region])
    members = {i for i in max(posted, key=len) if i < MANY}
    assert len(members) > 2 * _coalesce._WAKE_CHUNK
    assert leaked == []
    assert len(timed_out) + len(went_on) == MANY
    assert members <= set(returned)
    assert len(set(timed_out) & members) > len(members) - 2 * _coalesce._WAKE_CHUNK
    assert zero_resources(dst) and zero_resources(src)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("scope_kind", ["anyio", "asyncio.timeout"])
async def test_on_asyncio_a_kept_result_leaves_no_cancellation_behind_its_scope(scope_kind: str) -> None:
    """Members waiting for their wake chunk are cancelled by their scopes, and keep their
    results; the transfer is the last thing in each scope. The scope ends as if nothing
    happened, and the await after it must not raise: the cancellation belonged to the
    scope (before, it was requested again at once, and Python < 3.13 kept it armed past the
    scope's uncancel(): 272 of 401 callers were cancelled outside their scope)."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=38)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    loop = asyncio.get_running_loop()
    cancels: list[Callable[[], object]] = []
    kept: list[int] = []
    after: list[str] = []

    async def caller(engine: aionixl.Engine, peer: aionixl.Peer, block: int) -> None:
        if scope_kind == "anyio":
            with anyio.CancelScope() as scope:
                cancels.append(scope.cancel)
                await engine.transfer_blocks(peer, [block], [block])
                kept.append(block)
        else:
            try:
                async with asyncio.timeout(None) as timeout:
                    cancels.append(lambda: timeout.reschedule(loop.time()))
                    await engine.transfer_blocks(peer, [block], [block])
                    kept.append(block)
            except TimeoutError:
                pass
        try:
            await asyncio.sleep(0)
            after.append("ok")
        except asyncio.CancelledError:
            after.append("cancelled outside its scope")

    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        await _until_chunks_wait_then(dst, peer, caller, lambda: [c() for c in cancels])
    assert len(kept) > 2 * _coalesce._WAKE_CHUNK  # members that kept their results
    assert after == ["ok"] * MANY
    assert zero_resources(dst) and zero_resources(src)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_member_that_keeps_its_result_still_stops_with_its_task_group(
        ) -> None:
    """Long-lived readers in an ``asyncio.TaskGroup`` whose sibling fails while members wait
    for their wake chunk: a reader that keeps its result is still cancelled at its next
    await, so every reader stops and the group raises the sibling's error."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=36)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    stopped: list[int] = []

    async def reader(engine: aionixl.Engine, peer: aionixl.Peer, block: int) -> None:
        try:
            for _ in range(300):  # bounded: a reader that lost its cancellation ends here
                await engine.transfer_blocks(peer, [block], [block])
        except asyncio.CancelledError:
            stopped.append(block)
            raise

    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        transfers = dst._coalescer
        chunks_wait = asyncio.Event()
        real_wake = transfers._wake_members

        def wake_members(waiters: list[Any]) -> None:
            real_wake(waiters)
            if dst._inflight.deferred:  # members left parked for their chunk
                chunks_wait.set()

        transfers._wake_members = wake_members  # before any request: each takes it at birth

        async def fail_when_chunks_wait() -> None:
            await chunks_wait.wait()
            raise ValueError("sibling failed")

        with anyio.fail_after(30), pytest.raises(ExceptionGroup) as caught:
            async with asyncio.TaskGroup() as group:
                for block in range(MANY):
                    group.create_task(reader(dst, peer, block))
                group.create_task(fail_when_chunks_wait())
        assert [type(e) for e in caught.value.exceptions] == [ValueError]
        assert sorted(stopped) == list(range(MANY))
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
    assert zero_resources(dst) and zero_resources(src)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_task_that_kept_a_result_meets_its_cancellation_on_its_next_call(
        ) -> None:
    """A member cancelled while its request gathers runs again only after the request
    finished (asyncio runs the gatherer before the joiners it let in): it keeps its result.
    Its next call, joining the next request the same way, must raise the cancellation
    rather than keep another result (round after round, it would never stop)."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=37)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (src, dst, peer):
        await dst.transfer_blocks(peer, [0], [0])  # another task called: the next gathers
        finish_inside_posts(dst, src)  # on a loaded machine a post may return before its end
        outcomes: list[str] = []

        async def gatherer() -> None:
            for block in (10, 11, 12):
                await dst.transfer_blocks(peer, [block], [block])

        async def member() -> None:
            for block in (1, 2):
                try:
                    await dst.transfer_blocks(peer, [block], [block])
                except asyncio.CancelledError:
                    outcomes.append(f"{block} cancelled")
                    raise
                outcomes.append(f"{block} ok")

        with anyio.fail_after(10):
            g = asyncio.create_task(gatherer())
            m = asyncio.create_task(member())
            await asyncio.sleep(0)  # g gathers and yields, m joins and parks
            m.cancel()
            with pytest.raises(asyncio.CancelledError):
                await m
            await g
        # The first read's block was in the request and landed: it is reported; the
        # cancellation comes at the next call.
        assert outcomes == ["1 ok", "2 cancelled"]
        for block in (1, 10, 11, 12):
            assert all(np.array_equal(d[block], s[block])
                       for d, s in zip(dst_cache, src_cache, strict=True))
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
