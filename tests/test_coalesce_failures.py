"""Failures under coalescing: a bad call fails alone, a killed or evicted peer and a
failed merged request reach every member, each with its own error, after its fence."""

from __future__ import annotations

import contextlib
import math
import sys
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl import _coalesce, _nixl
from aionixl.testing import RemoteEngine

from .helpers import (
    BLOCK_BYTES,
    BLOCKS,
    GEOMETRY,
    REGIONS,
    STAND_IN,
    TOGETHER,
    engine_pair,
    first_post_reported_running,
    gathering_next,
    merged,
    numpy_cache,
    report_inline_ends_as_running,
    unique,
    zero_resources,
)

pytestmark = pytest.mark.anyio


async def test_a_bad_timeout_or_notify_fails_alone_while_a_merged_request_gathers() -> None:
    # Joining on the one-block fast path (blocks seen before) checks the timeout and the
    # notification as the general path does: a bad one is a ValueError for that caller
    # alone; the others merge.
    bad: list[dict[str, Any]] = [
        {"timeout": math.nan}, {"timeout": -1.0}, {"timeout": 0}, {"timeout": True},
        {"timeout": "1"}, {"timeout": -math.inf}, {"notify": "text"},
        {"notify": b"\x00aionixl-x"}, {"notify": bytearray(b"\x00aionixl-y")}]
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=15)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=16)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        for block in range(20):
            await dst.transfer_blocks(peer, [block], [block])
        before = dst_cache[0][0].copy()
        joined: set[int] = set()  # bad calls made while a merged request gathered

        async def call(i: int, errors: dict[int, Exception]) -> None:
            try:
                if i < len(bad):
                    if dst._coalescer.gathering:
                        joined.add(i)
                    await dst.transfer_blocks(peer, [i], [i], **bad[i])
                else:
                    await dst.transfer_blocks(peer, [i], [i], timeout=5 if i % 2 else 5.0)
            except ValueError as exc:
                errors[i] = exc

        for _ in range(20):  # until each bad value met a gathering request (trio's order varies)
            src_cache[0][:20] += 1
            errors: dict[int, Exception] = {}
            async with anyio.create_task_group() as tg:
                for i in [*range(len(bad), 20), *range(len(bad))]:  # the good ones first
                    tg.start_soon(call, i, errors)
            assert sorted(errors) == list(range(len(bad))), errors
            assert all(next(iter(bad[i])) in str(e) for i, e in errors.items()), errors
            assert np.array_equal(dst_cache[0][len(bad):20], src_cache[0][len(bad):20])
            assert np.array_equal(dst_cache[0][0], before)  # never moved again
            if len(joined) == len(bad):
                break
        assert len(joined) == len(bad), joined
        assert merged(dst)[1] >= 10, merged(dst)
    assert zero_resources(dst) and zero_resources(src)


async def test_a_bad_call_among_good_ones_fails_alone_before_anything_is_posted() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=5)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (_src, dst, peer):
        outcomes: dict[int, object] = {}

        async def call(i: int, lb: list[int], rb: list[int]) -> None:
            try:
                outcomes[i] = await dst.transfer_blocks(peer, lb, rb)
            except ValueError as exc:
                outcomes[i] = exc

        async with anyio.create_task_group() as tg:
            for i in range(8):
                bad = i == 4
                tg.start_soon(call, i, [i], [BLOCKS + 5] if bad else [i])
            tg.start_soon(call, 8, [9, 9], [1, 2])  # one destination block twice
        assert isinstance(outcomes[4], ValueError) and "block id 69" in str(outcomes[4])
        assert isinstance(outcomes[8], ValueError)
        for i in (0, 1, 2, 3, 5, 6, 7):
            assert isinstance(outcomes[i], aionixl.TransferResult)
            for region in range(REGIONS):
                assert np.array_equal(dst_cache[region][i], src_cache[region][i])
        assert not dst_cache[0][9].any()


async def test_a_peer_killed_under_a_merged_request_fails_every_member() -> None:
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    config = aionixl.EngineConfig(read_mode="get")  # GET reads merge
    tuning = aionixl.lowlevel.Tuning(coalesce_window=0.05)
    async with RemoteEngine(seed=12, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("coal"), local, listen=None, config=config, tuning=tuning) as eng:
        peer = await eng.connect(child.address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0])
        await child.pause()
        errors: list[BaseException] = []

        async def read(i: int) -> None:
            try:
                await eng.transfer_blocks(peer, [i], [i], timeout=30)
            except aionixl.AionixlError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            for i in range(1, 9):
                tg.start_soon(read, i)
            await anyio.sleep(0.3)
            assert merged(eng)[0] >= 1
            await child.kill()
        assert len(errors) == 8
        assert all(isinstance(e, aionixl.PeerDisconnectedError) for e in errors), errors
        assert len({id(e) for e in errors}) == 8  # each member its own instance
        assert not peer.connected
        live = eng.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
    assert zero_resources(eng)


async def test_an_eviction_just_after_a_merged_request_ended_leaves_its_members_their_results() -> None:
    """The poller saw a merged read end and woke its members; before they run, the peer is
    evicted (as when a later transfer to it fails in the same poller turn). The request
    had ended: its members report their blocks, not PeerDisconnectedError (a caller told
    its read failed would read, and notify, again)."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=35)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (_src, dst, peer):
        transfers = dst._coalescer
        await dst.transfer_blocks(peer, [0], [0])  # another task called just now: gather
        # The merged read must end through the poller, not inside its post: one that did is
        # reported running, under a stand-in handle that its first check finds done.
        agent = dst._local.agent
        assert agent is not None
        real_check = agent.check
        ended_inside = report_inline_ends_as_running(dst)
        agent.check = lambda h: _nixl.DONE if h in ended_inside else real_check(h)  # type: ignore[method-assign]
        real_wake = transfers._wake_members
        evicted_at: list[object] = []

        def wake(waiters: list[object]) -> None:
            real_wake(waiters)
            if not evicted_at:
                ended = [rec for rec in dst._inflight.records.values()
                         if isinstance(rec, _coalesce.Batch) and rec.status == _nixl.DONE]
                evicted_at.append(len(ended))
                dst._peers.evict(peer, aionixl.TransferError("another transfer failed"))

        transfers._wake_members = wake  # type: ignore[method-assign]
        outcomes: dict[int, object] = {}

        async def read(block: int) -> None:
            try:
                outcomes[block] = await dst.transfer_blocks(peer, [block], [block])
            except aionixl.AionixlError as exc:
                outcomes[block] = exc

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for block in range(1, 17):
                    tg.start_soon(read, block)
        assert evicted_at == [1] and sorted(outcomes) == list(range(1, 17))
        assert all(isinstance(o, aionixl.TransferResult) for o in outcomes.values()), outcomes
        for block in range(1, 17):
            assert all(np.array_equal(d[block], s[block]) for d, s in zip(dst_cache, src_cache, strict=True))
        assert not peer.connected
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


@pytest.mark.parametrize("others", [(3, 4), ()], ids=["with others", "alone"])
@pytest.mark.parametrize("failure", ["check raises", "ERR"])
async def test_a_leaver_that_finds_the_merged_request_failed_fails_the_others(
        failure: str, others: tuple[int, ...]) -> None:
    """A member leaves (cancelled) a merged write just as NIXL reports the request failed:
    the others get the failure, as the poller would have given it (the peer evicted on
    ERR), instead of a re-post of a request NIXL gave up on. Alone (it gathered and no one
    joined), it still releases the request: the poller skips ended ones."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=39)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=40)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (src, dst, peer):
        agent, real_start, real_check = await gathering_next(src, dst, peer)
        stuck = STAND_IN
        posts: list[int] = []

        def start_xfer(*args: Any) -> Any:
            posts.append(len(args[2]))
            handle, state = real_start(*args)
            return (stuck, _nixl.PROC) if len(posts) == 1 else (handle, state)

        def check(handle: int) -> Any:
            if handle != stuck:
                return real_check(handle)
            if sys._getframe(1).f_code.co_name != "_leave":
                return _nixl.PROC  # the poller sees it running
            if failure == "ERR":
                return _nixl.ERR
            raise aionixl.TransferError("the request failed")

        agent.start_xfer = start_xfer  # type: ignore[method-assign, assignment]
        agent.check = check  # type: ignore[method-assign]
        outcomes: dict[int, object] = {}
        leaver = anyio.CancelScope()

        async def write(block: int) -> None:
            try:
                with leaver if block == 1 else contextlib.nullcontext():
                    outcomes[block] = await dst.transfer_blocks(peer, [block], [block], "write")
            except aionixl.AionixlError as exc:
                outcomes[block] = exc

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for block in (1, *others):
                    tg.start_soon(write, block)
                while not posts:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.05)
                leaver.cancel()
        assert posts == [(1 + len(others)) * REGIONS] and dst.metrics().reposts == 0, posts
        assert 1 not in outcomes  # cancelled: nothing returned
        expected = aionixl.PeerDisconnectedError if failure == "ERR" else aionixl.TransferError
        for block in others:
            assert type(outcomes[block]) is expected, outcomes
        assert len({id(outcomes[block]) for block in others}) == len(others)
        assert STAND_IN not in dst._inflight.records
        assert (peer.name in dst.peers) is (failure != "ERR")
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_members_of_a_merged_read_that_failed_fence_before_they_return() -> None:
    """NIXL fails a merged read (its check raises) while the peer stays connected: the
    read may still be writing, as a lone read that failed may, so each member fences its
    blocks (one more one-descriptor read from the peer) before it raises TransferError."""
    async with first_post_reported_running(seed=45) as (_, _, dst, peer, posts):
        agent = dst._local.agent
        assert agent is not None
        real_check = agent.check
        failing = False

        def check(handle: int) -> Any:
            if handle != STAND_IN:
                return real_check(handle)
            if failing:
                raise aionixl.TransferError("the request failed")
            return _nixl.PROC

        agent.check = check  # type: ignore[method-assign]
        outcomes: dict[int, object] = {}

        async def read(block: int) -> None:
            try:
                outcomes[block] = await dst.transfer_blocks(peer, [block], [block])
            except aionixl.AionixlError as exc:
                outcomes[block] = exc

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                for block in (1, 3, 4):
                    tg.start_soon(read, block)
                while not posts:
                    await anyio.sleep(0.01)
                await anyio.sleep(0.05)
                failing = True
        assert all(type(outcomes[b]) is aionixl.TransferError for b in (1, 3, 4)), outcomes
        assert posts[0] == sorted(r * BLOCKS + b for b in (1, 3, 4) for r in range(REGIONS))
        assert sorted(posts[1:]) == [[1], [3], [4]], posts  # a fence per member, its first block
        assert peer.name in dst.peers and dst.metrics().reposts == 0
        assert STAND_IN not in dst._inflight.records
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
