"""Members leaving a merged request: timeouts at their own deadlines, cancellation
while gathering or in flight, leavers that find the request finished, and the fences
of leavers, with the others kept exact."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl import _nixl
from aionixl._regions import region_offsets
from aionixl.testing import RemoteEngine

from .helpers import (
    BLOCK_BYTES,
    BLOCKS,
    GEOMETRY,
    REGIONS,
    STAND_IN,
    engine_pair,
    first_post_reported_running,
    merged,
    numpy_cache,
    posted_requests,
    report_inline_ends_as_running,
    together,
    unique,
    zero_resources,
)

pytestmark = pytest.mark.anyio


def _stand_in_never_ends(dst: aionixl.Engine) -> None:
    """The poller sees the first post (reported running under ``STAND_IN``) never end: only
    a member leaving finds out how it did."""
    agent = dst._local.agent
    assert agent is not None
    real_check = agent.check

    def check(handle: int) -> Any:
        return _nixl.PROC if handle == STAND_IN else real_check(handle)

    agent.check = check  # type: ignore[method-assign]


async def test_a_caller_of_a_repeated_pair_that_times_out_leaves_the_others_their_blocks() -> None:
    """Three callers read the same pair; their request finishes but is reported running,
    and the one with a 0.3 s timeout leaves: the request is aborted, the leaver's blocks
    fenced, and the pair posted again, once, for the two others (the leaver's entry goes,
    theirs stay), who get their results and the bytes."""
    async with first_post_reported_running(seed=43) as (src_cache, dst_cache, dst, peer, posts):
        _stand_in_never_ends(dst)
        outcomes = await together(lambda i, timeout: dst.transfer_blocks(peer, [9], [5],
                                                                            timeout=timeout),
                                   {0: 15, 1: 0.3, 2: 15})
        pair = [9, BLOCKS + 9]
        assert posts[0] == pair and posts[-1] == pair and len(posts) <= 3, posts  # (a fence between)
        assert dst.metrics().reposts == 1 and merged(dst) == (1, 3)
        assert isinstance(outcomes[1], aionixl.TransferTimeoutError), outcomes
        assert all(isinstance(outcomes[i], aionixl.TransferResult) for i in (0, 2)), outcomes
        for r in range(REGIONS):
            assert np.array_equal(dst_cache[r][9], src_cache[r][5])
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_cancelling_one_member_leaves_the_others_correct() -> None:
    """Over TCP with the peer stopped, a merged write stays in flight; one member is
    cancelled: the request is aborted and posted again for the others, whose blocks land
    once the peer resumes. (Writes: a GET over TCP that is aborted must be fenced, and a
    stopped peer cannot answer the fence: it is evicted, see the read modes.)"""
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=21)
    source = [r.copy() for r in local]
    tuning = aionixl.lowlevel.Tuning(coalesce_window=0.05)
    async with RemoteEngine(seed=11, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("coal"), local, listen=None, tuning=tuning) as eng:
        peer = await eng.connect(child.address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0])  # connection warm
        await child.pause()
        try:
            done: dict[int, aionixl.TransferResult] = {}
            cancelled: list[int] = []
            scopes: dict[int, anyio.CancelScope] = {}

            async def write(i: int) -> None:
                with anyio.CancelScope() as scope:
                    scopes[i] = scope
                    done[i] = await eng.transfer_blocks(peer, [i], [i], op="write", timeout=30)
                if scope.cancelled_caught:
                    cancelled.append(i)

            async with anyio.create_task_group() as tg:
                for i in range(1, 9):
                    tg.start_soon(write, i)
                await anyio.sleep(0.3)
                assert eng.live_resources()["in_flight"] >= 1
                scopes[4].cancel()
                await anyio.sleep(0.1)
                await child.resume()
        finally:
            await child.resume()
        assert cancelled == [4]
        assert sorted(done) == [1, 2, 3, 5, 6, 7, 8]
        # (the abort-and-re-post path ran unless the request was found done on the way out)
        assert merged(eng)[0] >= 1
        live = eng.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
        # Read the peer's blocks back (into blocks 32+) and compare with what was written.
        ok = sorted(done)
        await eng.transfer_blocks(peer, [32 + i for i in ok], ok, timeout=30)
        for region in range(REGIONS):
            assert np.array_equal(local[region][[32 + i for i in ok]], source[region][ok])
    assert zero_resources(eng)


async def test_a_caller_cancelled_while_gathering_leaves_and_the_others_go_out(
        anyio_backend_name: str) -> None:
    """The first caller of a wave opens the merged request and yields once for the others
    to join; cancelled right there, it leaves (its block never moves) and the request still
    goes out for the rest. On trio the order within a wave is shuffled: the cancelled caller
    may be a joiner instead, and the request may go out before it runs again (then it is
    aborted and posted again for the others, or found finished): the others are exact either
    way, and the cancelled one raises, or, when its request had already moved its block
    before it ran again, returns its result and meets the cancellation at its next
    checkpoint."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=31)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=32)
    before = [r.copy() for r in dst_cache]
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (_src, dst, peer):
        posted = posted_requests(dst, "local")
        done: dict[int, aionixl.TransferResult] = {}
        cancelled: list[int] = []

        async def read(i: int) -> None:
            with anyio.CancelScope() as scope:
                if i == 1:
                    scope.cancel()  # delivered at the call's first checkpoint
                done[i] = await dst.transfer_blocks(peer, [i], [i])
                await anyio.lowlevel.checkpoint()
            if scope.cancelled_caught:
                cancelled.append(i)

        # Another task called just now (a wide window: even on a loaded machine), so the
        # wave's first caller gathers.
        await dst.transfer_blocks(peer, [0], [0])
        posted.clear()
        async with anyio.create_task_group() as tg:
            for i in range(1, 9):
                tg.start_soon(read, i)
        assert cancelled == [1]
        assert sorted(done) == [2, 3, 4, 5, 6, 7, 8] or (
            anyio_backend_name == "trio" and sorted(done) == list(range(1, 9))
            and all(np.array_equal(dst_cache[r][1], src_cache[r][1]) for r in range(REGIONS)))
        assert all(r.blocks == 1 for r in done.values())
        assert any(len(r) > REGIONS for r in posted)  # the others did ride together
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region][2:9], src_cache[region][2:9])
        if anyio_backend_name == "asyncio":  # first come, first run: it was the gatherer
            assert all(1 not in request and 1 + BLOCKS not in request for request in posted)
            for region in range(REGIONS):
                assert np.array_equal(dst_cache[region][1], before[region][1])
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
    assert zero_resources(dst)


async def _hide_request_ends(dst: aionixl.Engine, peer: aionixl.Peer) -> Callable[[], bool]:
    """Read block 2 once (so, with a wide ``coalesce_window``, the next call from another
    task gathers), then keep the poller from seeing any request end until some member
    leaves (times out or is cancelled): ``agent.check`` answers PROC meanwhile, remembering
    the real state, so the member's own check on its way out finds the request finished.
    A request that finished inside its post (in one process, often) is reported posted and
    running, under a handle of its own that only these wrappers know. Returns whether a
    member has left."""
    await dst.transfer_blocks(peer, [2], [2])
    transfers = dst._coalescer
    agent = dst._local.agent
    assert agent is not None
    real_check, real_leave = agent.check, transfers._leave
    left = False
    finished = report_inline_ends_as_running(dst)  # and those NIXL saw end (it says so once)

    def check(handle: int) -> Any:
        if handle not in finished and real_check(handle) == _nixl.DONE:
            finished.add(handle)
        if not left:
            return _nixl.PROC
        return _nixl.DONE if handle in finished else real_check(handle)

    async def leave(batch: Any, entry: Any) -> bool:
        nonlocal left
        left = True
        return await real_leave(batch, entry)

    agent.check = check
    transfers._leave = leave
    return lambda: left


async def test_a_member_whose_deadline_passes_as_its_request_finishes_reports_its_blocks() -> None:
    """The poller has not yet seen a merged read finish when one member's deadline passes;
    that member, checking on its way out, finds the request done: it returns its result
    (a caller told it timed out would move, and notify, twice), as do the others."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=31)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (_src, dst, peer):
        someone_left = await _hide_request_ends(dst, peer)  # block 2 read: the next gathers
        results: dict[int, aionixl.TransferResult] = {}

        async def read(block: int, timeout: float) -> None:
            results[block] = await dst.transfer_blocks(peer, [block], [block], timeout=timeout)

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(read, 1, 0.3)
                for block in (3, 4):
                    tg.start_soon(read, block, 15)
        assert someone_left() and merged(dst) == (1, 3)
        assert sorted(results) == [1, 3, 4]
        for block in (1, 2, 3, 4):
            assert all(np.array_equal(d[block], s[block]) for d, s in zip(dst_cache, src_cache, strict=True))
        assert results[1].seconds >= 0.3
        counts = dst.metrics().transfers["read"]
        assert counts["ok"] == 4 and counts["timeout"] == 0
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


@pytest.mark.parametrize("role", ["gatherer", "joiner"])
async def test_a_member_cancelled_as_its_request_finishes_reports_its_blocks(role: str) -> None:
    """A member (the one that gathered the request, or one that joined it) is cancelled
    while the poller has not yet seen its merged read end; on its way out it finds the
    request done. It returns its result and meets the cancellation at its next checkpoint."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=32)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (_src, dst, peer):
        someone_left = await _hide_request_ends(dst, peer)  # block 2 read: the next gathers
        results: dict[int, aionixl.TransferResult] = {}
        events: list[str] = []
        scope = anyio.CancelScope()

        async def read(block: int) -> None:
            results[block] = await dst.transfer_blocks(peer, [block], [block], timeout=15)

        async def cancelled_read() -> None:
            with scope:
                try:
                    results[1] = await dst.transfer_blocks(peer, [1], [1], timeout=15)
                except anyio.get_cancelled_exc_class():
                    events.append("raised")
                    raise
                events.append("returned")
                await anyio.lowlevel.checkpoint()
                events.append("not cancelled")

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                # Trio runs a batch of new tasks forwards or backwards: there the role
                # is either; asyncio keeps the order.
                if role == "joiner":
                    tg.start_soon(read, 3)
                tg.start_soon(cancelled_read)
                if role == "gatherer":
                    tg.start_soon(read, 3)
                tg.start_soon(read, 4)
                await anyio.sleep(0.3)  # the read has landed by now; the poller does not know
                assert not someone_left() and not results
                scope.cancel()
        assert someone_left() and merged(dst) == (1, 3)
        for block in (1, 2, 3, 4):
            assert all(np.array_equal(d[block], s[block])
                       for d, s in zip(dst_cache, src_cache, strict=True))
        counts = dst.metrics().transfers["read"]
        assert events == ["returned"] and sorted(results) == [1, 3, 4]
        assert counts["ok"] == 4 and counts["cancelled"] == 0  # block 2's read too
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_members_leaving_together_each_take_their_blocks_out_and_fence_them() -> None:
    """Two members of a stuck merged read leave together (cancelled at once here; two equal
    deadlines passing take the same path, but not at a moment a test can fix). The first
    to leave aborts the request and fences the aborted read before it posts the request
    again for the rest; the second leaves during that fence. It must take its blocks out
    too (the new request carries only the member still waiting) and fence them before it
    returns: its blocks may not be written, nor its notification sent, after it left."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=33)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (_src, dst, peer):
        await dst.transfer_blocks(peer, [2], [2])  # the next call from another task gathers
        agent, direct = dst._local.agent, dst._direct
        assert agent is not None
        real_start, real_check, real_fence = agent.start_xfer, agent.check, direct.fence
        stuck = -1000  # a stand-in handle: never NIXL's; release_xfer passes it
        posts: list[list[int]] = []
        fenced: list[int] = []

        def start_xfer(op: str, local: int, local_idx: Any, *rest: Any) -> Any:
            posts.append([int(i) for i in local_idx])
            handle, state = real_start(op, local, local_idx, *rest)
            if len(posts) == 1:  # the merged read: report it running for good
                if handle != _nixl.NO_HANDLE:
                    agent.release_xfer(handle)
                return stuck, _nixl.PROC
            return handle, state

        def check(handle: int) -> Any:
            return _nixl.PROC if handle == stuck else real_check(handle)

        async def fence_get(peer: Any, local_idx: Any, remote_idx: Any) -> None:
            fenced.append(int(local_idx[0]))
            with anyio.CancelScope(shield=True):  # as the real fence is
                await anyio.sleep(0.3)  # long enough for the other leaver to leave meanwhile
            await real_fence(peer, local_idx, remote_idx)

        agent.start_xfer = start_xfer  # type: ignore[method-assign]
        agent.check = check  # type: ignore[method-assign]
        direct.fence = fence_get  # type: ignore[method-assign]
        outcomes: dict[int, object] = {}
        leavers = {1: anyio.CancelScope(), 3: anyio.CancelScope()}

        async def read(block: int) -> None:
            outcomes[block] = await dst.transfer_blocks(peer, [block], [block], timeout=15)

        async def leaving_read(block: int) -> None:
            with leavers[block]:
                try:
                    await read(block)
                except anyio.get_cancelled_exc_class():
                    outcomes[block] = "cancelled"
                    raise

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(leaving_read, 1)
                tg.start_soon(leaving_read, 3)
                tg.start_soon(read, 4)
                while not posts:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.1)  # all three parked on the running request
                for scope in leavers.values():  # both in the same loop turn
                    scope.cancel()
        assert merged(dst) == (1, 3)
        assert outcomes[1] == outcomes[3] == "cancelled", outcomes
        assert isinstance(outcomes[4], aionixl.TransferResult), outcomes
        offsets = region_offsets(REGIONS, BLOCKS).ravel()
        # After the merged read: the two fences (one descriptor each) and block 4's read.
        assert posts[0] == sorted(int(i) for i in np.concatenate([offsets + 1, offsets + 3, offsets + 4]))
        assert [p for p in posts[1:] if len(p) > 1] == [[int(i) for i in offsets + 4]], posts
        assert sorted(fenced) == [int(offsets[0]) + 1, int(offsets[0]) + 3]
        assert all(np.array_equal(d[4], s[4]) for d, s in zip(dst_cache, src_cache, strict=True))
        assert dst.metrics().transfers["read"]["cancelled"] == 2
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_leavers_fence_cut_short_by_a_native_cancel_still_settles_the_rest(
        ) -> None:
    """A member of a stuck merged read leaves at its deadline and fences the aborted read;
    its caller's own ``asyncio.timeout`` cancels it during the fence (anyio's shield does
    not stop asyncio's own cancellations). The fence is unconfirmed, so the peer is evicted
    as for a fence that timed out, and the others fail at once with PeerDisconnectedError:
    before, the request was never posted again and they waited past their deadlines."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=36)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (_src, dst, peer):
        await dst.transfer_blocks(peer, [2], [2])  # the next call from another task gathers
        agent = dst._local.agent
        assert agent is not None
        real_start, real_check = agent.start_xfer, agent.check
        stuck = {-1000, -1001}  # stand-in handles: never NIXL's; release_xfer passes them
        posts: list[int] = []

        def start_xfer(*args: Any) -> Any:
            posts.append(len(args[2]))
            handle, state = real_start(*args)
            if len(posts) <= 2:  # the merged read, then the fence: both never end
                if handle != _nixl.NO_HANDLE:
                    agent.release_xfer(handle)
                return -999 - len(posts), _nixl.PROC
            return handle, state

        agent.start_xfer = start_xfer  # type: ignore[method-assign]
        agent.check = lambda h: _nixl.PROC if h in stuck else real_check(h)  # type: ignore[method-assign]
        outcomes: dict[int, str] = {}

        async def leaver() -> None:
            try:
                async with asyncio.timeout(0.4):  # the caller's own, around the call
                    await dst.transfer_blocks(peer, [1], [1], timeout=0.2)
            except TimeoutError:
                outcomes[1] = "asyncio.timeout"

        async def member(block: int) -> None:
            try:
                await dst.transfer_blocks(peer, [block], [block], timeout=10)
            except aionixl.PeerDisconnectedError:
                outcomes[block] = "peer disconnected"

        with anyio.fail_after(5):
            async with anyio.create_task_group() as tg:
                tg.start_soon(leaver)
                tg.start_soon(member, 3)
                tg.start_soon(member, 4)
        assert outcomes == {1: "asyncio.timeout", 3: "peer disconnected", 4: "peer disconnected"}
        assert posts[:2] == [3 * REGIONS, 1], posts  # the merged read, then the fence
        assert not peer.connected and dst.metrics().fence_evictions == 1
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_members_time_out_at_their_own_deadlines_and_the_rest_go_on() -> None:
    """A stopped TCP peer keeps a merged write in flight: the members with a short timeout
    fail at their deadline, the others wait on and their blocks land after the resume."""
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=22)
    source = [r.copy() for r in local]
    tuning = aionixl.lowlevel.Tuning(coalesce_window=0.05)
    async with RemoteEngine(seed=13, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("coal"), local, listen=None, tuning=tuning) as eng:
        peer = await eng.connect(child.address, timeout=30)
        for i in range(7):  # each block once: later one-block calls join on the fast path
            await eng.transfer_blocks(peer, [i], [i], "write")
        await child.pause()
        outcomes: dict[int, object] = {}
        timed: dict[int, float] = {}
        limits = {2: 0.5, 5: 0.9}

        async def write(i: int, timeout: float) -> None:
            # perf_counter, the engine's clock: uvloop's loop time moves in whole milliseconds.
            start = time.perf_counter()
            try:
                outcomes[i] = await eng.transfer_blocks(peer, [i], [i], "write", timeout=timeout)
            except aionixl.TransferTimeoutError as exc:
                outcomes[i] = exc
            timed[i] = time.perf_counter() - start

        try:
            async with anyio.create_task_group() as tg:
                for i in range(1, 7):
                    tg.start_soon(write, i, limits.get(i, 30))
                await anyio.sleep(1.5)
                await child.resume()
        finally:
            await child.resume()
        assert merged(eng)[0] >= 1
        for i, limit in limits.items():
            # Each at its own deadline: the first one woken must not sleep on to the next.
            assert isinstance(outcomes[i], aionixl.TransferTimeoutError), outcomes[i]
            assert f"within {limit} s" in str(outcomes[i]), outcomes[i]
            assert limit <= timed[i] < limit + 0.3, (i, timed[i])
        ok = [1, 3, 4, 6]
        assert all(isinstance(outcomes[i], aionixl.TransferResult) for i in ok), outcomes
        await eng.transfer_blocks(peer, [32 + i for i in ok], ok, timeout=30)
        for region in range(REGIONS):
            assert np.array_equal(local[region][[32 + i for i in ok]], source[region][ok])
        live = eng.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_a_one_block_member_leaves_a_request_opened_by_a_call_with_array_indices() -> None:
    """A call of 40 ids given as an array (its descriptor indices are numpy arrays) opens a
    merged request; two one-block callers join. The request finishes but is reported
    running, and the one-block caller with a 0.3 s timeout leaves: its entry comes out (found
    by identity: comparing it with the array entry raised ValueError, which left it in the
    request and replaced its TransferTimeoutError), the request is posted again for the
    others without it, and they get their bytes."""
    async with first_post_reported_running(seed=51) as (src_cache, dst_cache, dst, peer, posts):
        _stand_in_never_ends(dst)
        wide = np.arange(20, 60)

        def call(i: int, timeout: float) -> Any:
            ids = wide if i == 0 else [i]
            return dst.transfer_blocks(peer, ids, ids, timeout=timeout)

        outcomes = await together(call, {0: 15, 1: 15, 2: 0.3})
        assert isinstance(outcomes[2], aionixl.TransferTimeoutError), outcomes
        assert all(isinstance(outcomes[i], aionixl.TransferResult) for i in (0, 1)), outcomes
        assert len(posts[0]) == 42 * REGIONS and dst.metrics().reposts == 1, posts
        assert 2 not in posts[-1] and 1 in posts[-1] and len(posts[-1]) == 41 * REGIONS, posts
        for r in range(REGIONS):
            for block in [1, *wide]:
                assert np.array_equal(dst_cache[r][block], src_cache[r][block])
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
