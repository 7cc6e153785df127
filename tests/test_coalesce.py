"""Coalesced transfers: concurrent callers merged into one NIXL request, each kept exact."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
from aionixl import _transfers
from aionixl._regions import region_offsets, small_indices
from aionixl.testing import RemoteEngine

from .conftest import engine_pair, numpy_cache, report_inline_ends_as_running, unique, zero_resources

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 64, 1024, 2
#: A wide window makes "arriving together" certain on a loaded machine.
TOGETHER = aionixl.EngineConfig(coalesce_window=0.05)


def merged(engine: aionixl.Engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["merged_requests"], stats["merged_calls"]


def posted_requests(engine: aionixl.Engine, side: str) -> list[list[int]]:
    """From now on, each NIXL request the engine posts: its descriptor indices on ``side``
    ("local" or "remote"), in posting order."""
    posted: list[list[int]] = []
    agent = engine._transfers.agent
    assert agent is not None
    real = agent.start_xfer

    def spy(op: str, local: int, local_idx: Any, remote: int, remote_idx: Any, *rest: Any) -> Any:
        posted.append([int(i) for i in (local_idx if side == "local" else remote_idx)])
        return real(op, local, local_idx, remote, remote_idx, *rest)

    agent.start_xfer = spy  # type: ignore[method-assign, assignment]
    return posted


def _in_local_order(entries: list[Any]) -> tuple[list[int], list[int]]:
    """What a merged request must carry: every member's (local, remote) descriptor pairs,
    ordered by local descriptor, members in arrival order where local ones tie."""
    pairs = sorted(((int(a), int(b)) for e in entries for a, b in zip(e[0], e[1], strict=True)),
                   key=lambda pair: pair[0])
    return [a for a, _ in pairs], [b for _, b in pairs]


@pytest.mark.parametrize("seed", range(5))
def test_merged_indices_pair_each_members_descriptors_in_local_order(seed: int) -> None:
    rng = np.random.default_rng(seed)
    local_blocks, remote_blocks = 64, 96  # the peer's cache is another size
    local_offsets = region_offsets(REGIONS, local_blocks)
    remote_offsets = region_offsets(REGIONS, remote_blocks)
    local_list = local_offsets.ravel().tolist()
    remote_list = remote_offsets.ravel().tolist()
    # One-block members: sources may repeat (writes from one block to several), as lists
    # (the engine's fast path) and as arrays (a caller that passed numpy ids).
    entries: list[Any] = []
    for i, theirs in enumerate(rng.permutation(remote_blocks)[:40].tolist()):
        mine = int(rng.integers(0, local_blocks))
        local_idx: Any = small_indices([mine], local_blocks, local_list)
        remote_idx: Any = small_indices([theirs], remote_blocks, remote_list)
        if i % 7 == 3:
            local_idx, remote_idx = np.array(local_idx, np.int32), np.array(remote_idx, np.int32)
        entries.append((local_idx, remote_idx, 1, b"", 1.0))
    local, remote = _transfers._merged_indices(entries, len(entries), local_offsets, remote_offsets)
    assert local.dtype == remote.dtype == np.int32
    assert (local.tolist(), remote.tolist()) == _in_local_order(entries)
    # With a member of several blocks the members' lists are joined instead: same pairing.
    several = (small_indices([5, 9], local_blocks, local_list),
               small_indices([90, 91], remote_blocks, remote_list), 2, b"", 1.0)
    entries.insert(len(entries) // 2, several)
    local, remote = _transfers._merged_indices(entries, len(entries) + 1, local_offsets,
                                               remote_offsets)
    assert (local.tolist(), remote.tolist()) == _in_local_order(entries)


@pytest.mark.parametrize("seed", range(5))
def test_merged_indices_carry_each_repeated_pair_once(seed: int) -> None:
    """Members that move the very block pair of another (``dups``): each (local, remote)
    descriptor pair goes in once, ordered by local then remote; pairs that differ only on
    one side (one local block written to two remote ones) both stay."""
    rng = np.random.default_rng(seed)
    local_offsets, remote_offsets = region_offsets(REGIONS, 16), region_offsets(REGIONS, 24)
    local_list, remote_list = local_offsets.ravel().tolist(), remote_offsets.ravel().tolist()
    pairs = [(int(rng.integers(0, 16)), int(rng.integers(0, 24))) for _ in range(12)]
    members = [pairs[int(i)] for i in rng.integers(0, len(pairs), 60)]
    entries: list[Any] = [(small_indices([a], 16, local_list), small_indices([b], 24, remote_list),
                           1, b"", 1.0) for a, b in members]
    want = sorted({(r * 16 + a, r * 24 + b) for a, b in members for r in range(REGIONS)})
    local, remote = _transfers._merged_indices(entries, len(entries), local_offsets, remote_offsets,
                                               True)
    assert list(zip(local.tolist(), remote.tolist(), strict=True)) == want
    # With a member of several blocks (the joined-lists way): the same pairs, and its own.
    entries.append((small_indices([3, 4], 16, local_list), small_indices([20, 21], 24, remote_list),
                    2, b"", 1.0))
    local, remote = _transfers._merged_indices(entries, len(entries) + 1, local_offsets,
                                               remote_offsets, True)
    more = {(r * 16 + a, r * 24 + b) for a, b in ((3, 20), (4, 21)) for r in range(REGIONS)}
    assert list(zip(local.tolist(), remote.tolist(), strict=True)) == sorted(set(want) | more)


@pytest.mark.parametrize("op", ["read", "write"])
async def test_callers_moving_the_same_block_pair_ride_once(op: str) -> None:
    """Twelve callers move the same pair (block 5 -> block 9, or back), four others their
    own blocks, each with a notification: one request carries the pair once; every caller
    gets its result and its notification exactly once; the bytes are the source's. A
    caller writing block 9 from another source (block 6) is not merged with them."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=41)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=42)
    src_before, dst_before = [r.copy() for r in src_cache], [r.copy() for r in dst_cache]
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        await dst.transfer_blocks(peer, [60], [60])  # the next caller comes "together" with it
        posted = posted_requests(dst, "local" if op == "read" else "remote")
        results: dict[int, Any] = {}
        # (local, remote): reads move remote -> local, writes local -> remote.
        calls = [(9, 5) if op == "read" else (5, 9)] * 12 + [(20 + i, 30 + i) for i in range(4)]
        other = (9, 6) if op == "read" else (6, 9)  # the same destination, another source

        async def call(i: int, pair: tuple[int, int]) -> None:
            results[i] = await dst.transfer_blocks(peer, [pair[0]], [pair[1]], op,
                                                   notify=b"c-%d" % i)

        async with anyio.create_task_group() as tg:
            for i, pair in enumerate(calls):
                tg.start_soon(call, i, pair)
        assert sorted(results) == list(range(len(calls)))
        assert all(r.blocks == 1 and r.nbytes == BLOCK_BYTES * REGIONS for r in results.values())
        assert len(posted) == 1, posted  # all together, the pair once
        assert sorted(posted[0]) == sorted({r * BLOCKS + b for b in (9, 20, 21, 22, 23)
                                            for r in range(REGIONS)} if op == "read" else
                                           {r * BLOCKS + b for b in (9, 30, 31, 32, 33)
                                            for r in range(REGIONS)})
        assert merged(dst) == (1, len(calls))
        for i in range(len(calls)):
            assert (await src.wait_notification(b"c-%d" % i, timeout=10)).peer == dst.name
        for local_block, remote_block in set(calls):
            for r in range(REGIONS):
                if op == "read":
                    assert np.array_equal(dst_cache[r][local_block], src_before[r][remote_block])
                else:
                    assert np.array_equal(src_cache[r][remote_block], dst_before[r][local_block])
        # Another source for the same destination: never in one request with the pair.
        del posted[:]
        async with anyio.create_task_group() as tg:
            for i in range(3):
                tg.start_soon(call, 100 + i, calls[0])
            tg.start_soon(call, 200, other)
        for request in posted:
            dest = {r * BLOCKS + 9 for r in range(REGIONS)}
            assert len([d for d in request if d in dest]) <= REGIONS, request
        assert len(posted) >= 2
        for i in (100, 101, 102, 200):
            assert (await src.wait_notification(b"c-%d" % i, timeout=10)).peer == dst.name
        await anyio.sleep(0.2)
        assert src.stats()["notifications_kept"] == 0  # each arrived once, and was taken
        for i in range(len(calls)):
            with pytest.raises(TimeoutError):
                await src.wait_notification(b"c-%d" % i, timeout=0.05)
    assert zero_resources(dst) and zero_resources(src)


async def test_a_caller_of_a_repeated_pair_that_times_out_leaves_the_others_their_blocks() -> None:
    """Three callers read the same pair; their request finishes but is reported running,
    and the one with a 0.3 s timeout leaves: the request is aborted, the leaver's blocks
    fenced, and the pair posted again, once, for the two others (the leaver's entry goes,
    theirs stay), who get their results and the bytes."""
    async with _first_post_reported_running(seed=43) as (src_cache, dst_cache, dst, peer, posts):
        agent = dst._transfers.agent
        assert agent is not None
        real_check = agent.check

        def check(handle: int) -> Any:
            return _transfers.PROC if handle == STAND_IN else real_check(handle)

        agent.check = check  # type: ignore[method-assign]
        outcomes = await _together(lambda i, timeout: dst.transfer_blocks(peer, [9], [5],
                                                                            timeout=timeout),
                                   {0: 15, 1: 0.3, 2: 15})
        pair = [9, BLOCKS + 9]
        assert posts[0] == pair and posts[-1] == pair and len(posts) <= 3, posts  # (a fence between)
        assert dst.stats()["reposts"] == 1 and merged(dst) == (1, 3)
        assert isinstance(outcomes[1], aionixl.TransferTimeoutError), outcomes
        assert all(isinstance(outcomes[i], aionixl.TransferResult) for i in (0, 2)), outcomes
        for r in range(REGIONS):
            assert np.array_equal(dst_cache[r][9], src_cache[r][5])
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_concurrent_reads_and_writes_of_mixed_sizes_are_merged_and_exact() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=1)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=2)
    src_before = [r.copy() for r in src_cache]
    dst_before = [r.copy() for r in dst_cache]
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        # Reads: dst blocks 0..31 <- src blocks 32..63 (reversed), in calls of 1, 3 and 12.
        reads: list[tuple[list[int], list[int]]] = []
        local = list(range(32))
        remote = list(range(63, 31, -1))
        for size in (1, 3, 12, 1, 1, 3, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1):
            reads.append((local[:size], remote[:size]))
            local, remote = local[size:], remote[size:]
        assert not local
        # Writes: dst blocks 32..47 -> src blocks 0..15, one or two at a time.
        writes = [([32 + i, 33 + i], [i, i + 1]) for i in range(0, 16, 2)]
        results: dict[int, aionixl.TransferResult] = {}

        async def call(i: int, lb: list[int], rb: list[int], op: Any) -> None:
            results[i] = await dst.transfer_blocks(peer, lb, rb, op=op)

        async with anyio.create_task_group() as tg:
            for i, (lb, rb) in enumerate(reads):
                tg.start_soon(call, i, lb, rb, "read")
            for j, (lb, rb) in enumerate(writes):
                tg.start_soon(call, 100 + j, lb, rb, "write")
        requests, calls = merged(dst)
        assert requests >= 1 and calls >= 2 * requests, (requests, calls)
        for i, (lb, rb) in enumerate(reads):
            assert results[i].blocks == len(lb)
            assert results[i].nbytes == len(lb) * BLOCK_BYTES * REGIONS
            for region in range(REGIONS):
                assert np.array_equal(dst_cache[region][lb], src_before[region][rb]), (i, region)
        for lb, rb in writes:
            for region in range(REGIONS):
                assert np.array_equal(src_cache[region][rb], dst_before[region][lb])
        # Blocks nobody touched are unchanged on both sides.
        for region in range(REGIONS):
            assert np.array_equal(src_cache[region][16:], src_before[region][16:])
            assert np.array_equal(dst_cache[region][48:], dst_before[region][48:])
    assert zero_resources(dst) and zero_resources(src)


async def test_one_block_calls_given_as_tuples_ranges_arrays_or_numpy_ints_merge_exactly() -> None:
    # Ids as a server may hold them: each form is made a list once and then takes the
    # one-block path that lists take (joining merged requests), with the same bytes.
    forms: list[Callable[[int], Any]] = [
        lambda b: (b,), lambda b: range(b, b + 1), lambda b: np.array([b], np.int64),
        lambda b: np.array([b], np.uint16), lambda b: [np.int64(b)], lambda b: [b]]
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=11)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=12)
    src_before = [r.copy() for r in src_cache]
    dst_before = [r.copy() for r in dst_cache]
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        results: dict[int, aionixl.TransferResult] = {}

        async def call(i: int) -> None:
            form = forms[i % len(forms)]
            # Reads into dst 0..39 from src 63..24; writes from dst 40..59 to src 0..19.
            if i < 40:
                results[i] = await dst.transfer_blocks(peer, form(i), form(63 - i))
            else:
                results[i] = await dst.transfer_blocks(peer, form(i), form(i - 40), op="write")

        async with anyio.create_task_group() as tg:
            for i in range(60):
                tg.start_soon(call, i)
        requests, calls = merged(dst)
        assert requests >= 2 and calls >= 50, (requests, calls)
        assert all(r.blocks == 1 and r.nbytes == BLOCK_BYTES * REGIONS for r in results.values())
        assert len(results) == 60
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region][:40], src_before[region][63:23:-1])
            assert np.array_equal(src_cache[region][:20], dst_before[region][40:60])
            assert np.array_equal(dst_cache[region][40:], dst_before[region][40:])
            assert np.array_equal(src_cache[region][20:], src_before[region][20:])
    assert zero_resources(dst) and zero_resources(src)


async def test_one_block_calls_over_more_blocks_than_the_engine_remembers_are_exact() -> None:
    # The engine remembers the descriptor indices of the last few thousand one-block ids
    # (_ONE_BLOCK_CACHE); past that, each call builds them again and still joins inline.
    blocks = _transfers._ONE_BLOCK_CACHE + 904
    src_cache = numpy_cache(blocks, 16, REGIONS, seed=17)
    dst_cache = numpy_cache(blocks, 16, REGIONS, seed=18)
    src_before = [r.copy() for r in src_cache]
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        width = 64

        async def worker(i: int) -> None:
            for block in range(i, blocks, width):  # remote blocks in reverse
                await dst.transfer_blocks(peer, [block], [blocks - 1 - block])

        for _ in range(2):
            async with anyio.create_task_group() as tg:
                for i in range(width):
                    tg.start_soon(worker, i)
            for region in range(REGIONS):
                assert np.array_equal(dst_cache[region], src_before[region][::-1])
            dst_cache[0][:] = 0
        requests, calls = merged(dst)
        assert calls >= blocks, (requests, calls)
        assert len(dst._transfers._one_block) <= _transfers._ONE_BLOCK_CACHE
    assert zero_resources(dst) and zero_resources(src)


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
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        for block in range(20):
            await dst.transfer_blocks(peer, [block], [block])
        before = dst_cache[0][0].copy()
        joined: set[int] = set()  # bad calls made while a merged request gathered

        async def call(i: int, errors: dict[int, Exception]) -> None:
            try:
                if i < len(bad):
                    if dst._transfers._gathering:
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


@pytest.mark.parametrize("warm", [False, True], ids=["first-calls", "fast-path"])
async def test_each_notification_arrives_once_and_after_its_data(warm: bool) -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=3)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=4)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        if warm:
            # Every block below seen once (crosswise, so that no data is in place yet): the
            # one-block calls then join on the fast path, notifications and all.
            for i in range(16):
                await dst.transfer_blocks(peer, [i], [32 + i])
                await dst.transfer_blocks(peer, [32 + i], [i])
        dst_before = [r.copy() for r in dst_cache]
        seen: list[bytes] = []

        async def write(i: int) -> None:
            await dst.transfer_blocks(peer, [i], [i], op="write", notify=b"w-%d" % i)

        async def read(i: int) -> None:
            await dst.transfer_blocks(peer, [32 + i], [32 + i], op="read", notify=b"r-%d" % i)

        async def watch(i: int) -> None:
            note = await src.wait_notification(b"w-%d" % i, timeout=30)
            # The target sees the notification only once this caller's block is in place.
            for region in range(REGIONS):
                assert np.array_equal(src_cache[region][i], dst_before[region][i])
            seen.append(note.message)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(watch, i)
            await anyio.sleep(0.05)
            for i in range(16):
                tg.start_soon(write, i)
                tg.start_soon(read, i)
        for i in range(16):
            note = await src.wait_notification(b"r-%d" % i, timeout=30)
            assert note.peer == dst.name
        assert sorted(seen) == sorted(b"w-%d" % i for i in range(16))
        requests, calls = merged(dst)
        assert requests >= 1 and calls > requests
        # Exactly once: nothing left over, nothing else arrives.
        await anyio.sleep(0.1)
        assert src.stats()["notifications_kept"] == 0
        with pytest.raises(TimeoutError):
            await src.wait_notification(b"w-0", timeout=0.2)


async def test_a_bad_call_among_good_ones_fails_alone_before_anything_is_posted() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=5)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (_src, dst, peer):
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


async def test_writes_to_the_same_destination_block_are_never_merged() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=6)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (_src, dst, peer):
        posted = posted_requests(dst, "remote")
        async with anyio.create_task_group() as tg:
            for i in range(6):
                # Six writers of remote block 7 (from six different local blocks), and others.
                tg.start_soon(dst.transfer_blocks, peer, [i], [7], "write")
                tg.start_soon(dst.transfer_blocks, peer, [10 + i], [20 + i], "write")
        remote_offset = [0, BLOCKS]  # descriptor index of block b in region r: r * BLOCKS + b
        for request in posted:
            block7 = [i for i in request if i in (7 + remote_offset[0], 7 + remote_offset[1])]
            assert len(block7) <= REGIONS, request  # block 7 at most once per request
        assert any(len(r) > REGIONS for r in posted)  # and merging did happen


async def test_callers_sharing_destination_blocks_fill_few_requests() -> None:
    """Sixteen readers into four local blocks, arriving block by block (0, 0, 0, 0, 1, ...):
    each caller that finds its block taken in the newest request joins an older one that
    is still gathering, so four requests carry them all, none with a block twice. (Had
    each conflict opened a request that later callers could only join as the newest, the
    run of equal blocks would open one request per caller: 13 here.)"""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=6)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (_src, dst, peer):
        await dst.transfer_blocks(peer, [60], [60])  # the next caller comes "together" with it
        posted = posted_requests(dst, "local")
        results: dict[int, Any] = {}

        async def call(i: int) -> None:
            results[i] = await dst.transfer_blocks(peer, [i // 4], [20 + i])

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(call, i)
        assert sorted(results) == list(range(16))
        assert all(isinstance(r, aionixl.TransferResult) and r.blocks == 1 for r in results.values())
        assert sorted(i for request in posted for i in request) == sorted(
            r * BLOCKS + i // 4 for i in range(16) for r in range(REGIONS))
        for request in posted:
            assert len(set(request)) == len(request), request  # no destination block twice
        assert len(posted) == 4, posted
        for block in range(4):  # the last of its four readers wins: one of their sources
            assert any(all(np.array_equal(dst_cache[r][block], src_cache[r][20 + 4 * block + k])
                           for r in range(REGIONS)) for k in range(4))


class _Index:
    """An id that is an integer only through ``__index__`` (equal and hashed as itself)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


async def test_writers_of_one_block_given_as_index_objects_are_never_merged() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=6)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (_src, dst, peer):
        await dst.transfer_blocks(peer, [60], [60])  # the next caller comes "together" with it
        posted = posted_requests(dst, "remote")
        async with anyio.create_task_group() as tg:
            for i in range(4):  # remote block 7 from four local blocks, ids as objects
                tg.start_soon(dst.transfer_blocks, peer, [_Index(i)], [_Index(7)], "write")
        block7 = {7, BLOCKS + 7}
        assert len(posted) == 4, posted
        for request in posted:
            assert len([i for i in request if i in block7]) <= REGIONS, request


GEOMETRY: dict[str, Any] = {"num_blocks": BLOCKS, "block_shape": (BLOCK_BYTES,),
                            "dtypes": ("uint8",) * REGIONS}


async def test_cancelling_one_member_leaves_the_others_correct() -> None:
    """Over TCP with the peer stopped, a merged write stays in flight; one member is
    cancelled: the request is aborted and posted again for the others, whose blocks land
    once the peer resumes. (Writes: a GET over TCP that is aborted must be fenced, and a
    stopped peer cannot answer the fence: it is evicted, see the read modes.)"""
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=21)
    source = [r.copy() for r in local]
    config = aionixl.EngineConfig(coalesce_window=0.05)
    async with RemoteEngine(seed=11, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("coal"), local, listen=None, config=config) as eng:
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


async def test_a_caller_cancelled_while_gathering_leaves_and_the_others_go_out(anyio_backend: str) -> None:
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
    config = aionixl.EngineConfig(coalesce_window=5.0)
    async with engine_pair(src_cache, dst_cache, config) as (_src, dst, peer):
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
            anyio_backend == "trio" and sorted(done) == list(range(1, 9))
            and all(np.array_equal(dst_cache[r][1], src_cache[r][1]) for r in range(REGIONS)))
        assert all(r.blocks == 1 for r in done.values())
        assert any(len(r) > REGIONS for r in posted)  # the others did ride together
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region][2:9], src_cache[region][2:9])
        if anyio_backend == "asyncio":  # first come, first run: it was the gatherer
            assert all(1 not in request and 1 + BLOCKS not in request for request in posted)
            for region in range(REGIONS):
                assert np.array_equal(dst_cache[region][1], before[region][1])
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
    assert zero_resources(dst)


async def test_a_peer_killed_under_a_merged_request_fails_every_member() -> None:
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    config = aionixl.EngineConfig(coalesce_window=0.05, read_mode="get")  # GET reads merge
    async with RemoteEngine(seed=12, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("coal"), local, listen=None, config=config) as eng:
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
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (_src, dst, peer):
        transfers = dst._transfers
        await dst.transfer_blocks(peer, [0], [0])  # another task called just now: gather
        # The merged read must end through the poller, not inside its post: one that did is
        # reported running, under a stand-in handle that its first check finds done.
        agent = transfers.agent
        assert agent is not None
        real_check = agent.check
        ended_inside = report_inline_ends_as_running(dst)
        agent.check = lambda h: _transfers.DONE if h in ended_inside else real_check(h)  # type: ignore[method-assign]
        real_wake = transfers._wake_members
        evicted_at: list[object] = []

        def wake(waiters: list[object]) -> None:
            real_wake(waiters)
            if not evicted_at:
                ended = [rec for rec in transfers.inflight.values()
                         if isinstance(rec, _transfers._Batch) and rec.status == _transfers.DONE]
                evicted_at.append(len(ended))
                transfers._peers.evict(peer, aionixl.TransferError("another transfer failed"))

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


async def test_a_lone_caller_never_gathers() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=7)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (_src, dst, peer):
        for i in range(200):
            await dst.transfer_blocks(peer, [i % BLOCKS], [i % BLOCKS], notify=b"n")
        assert merged(dst) == (0, 0)
        assert np.array_equal(dst_cache[1], src_cache[1])


async def test_coalescing_off_posts_one_request_per_call() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=8)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    config = aionixl.EngineConfig(coalesce=False)
    async with engine_pair(src_cache, dst_cache, config) as (_src, dst, peer):
        async with anyio.create_task_group() as tg:
            for i in range(32):
                tg.start_soon(dst.transfer_blocks, peer, [i], [i])
        assert merged(dst) == (0, 0)
        assert np.array_equal(dst_cache[0][:32], src_cache[0][:32])


async def _hide_request_ends(dst: aionixl.Engine, peer: aionixl.Peer) -> Callable[[], bool]:
    """Read block 2 once (so, with a wide ``coalesce_window``, the next call from another
    task gathers), then keep the poller from seeing any request end until some member
    leaves (times out or is cancelled): ``agent.check`` answers PROC meanwhile, remembering
    the real state, so the member's own check on its way out finds the request finished.
    A request that finished inside its post (in one process, often) is reported posted and
    running, under a handle of its own that only these wrappers know. Returns whether a
    member has left."""
    await dst.transfer_blocks(peer, [2], [2])
    transfers = dst._transfers
    agent = transfers.agent
    assert agent is not None
    real_check, real_leave = agent.check, transfers._leave
    left = False
    finished = report_inline_ends_as_running(dst)  # and those NIXL saw end (it says so once)

    def check(handle: int) -> Any:
        if handle not in finished and real_check(handle) == _transfers.DONE:
            finished.add(handle)
        if not left:
            return _transfers.PROC
        return _transfers.DONE if handle in finished else real_check(handle)

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
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (_src, dst, peer):
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
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (_src, dst, peer):
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
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (_src, dst, peer):
        await dst.transfer_blocks(peer, [2], [2])  # the next call from another task gathers
        transfers = dst._transfers
        agent, push = transfers.agent, transfers.push
        assert agent is not None and push is not None
        real_start, real_check, real_fence = agent.start_xfer, agent.check, push.fence_get
        stuck = -1000  # a stand-in handle: never NIXL's; release_xfer passes it
        posts: list[list[int]] = []
        fenced: list[int] = []

        def start_xfer(op: str, local: int, local_idx: Any, *rest: Any) -> Any:
            posts.append([int(i) for i in local_idx])
            handle, state = real_start(op, local, local_idx, *rest)
            if len(posts) == 1:  # the merged read: report it running for good
                if handle != _transfers.NO_HANDLE:
                    agent.release_xfer(handle)
                return stuck, _transfers.PROC
            return handle, state

        def check(handle: int) -> Any:
            return _transfers.PROC if handle == stuck else real_check(handle)

        async def fence_get(peer: Any, local_idx: Any, remote_idx: Any) -> None:
            fenced.append(int(local_idx[0]))
            with anyio.CancelScope(shield=True):  # as the real fence is
                await anyio.sleep(0.3)  # long enough for the other leaver to leave meanwhile
            await real_fence(peer, local_idx, remote_idx)

        agent.start_xfer = start_xfer  # type: ignore[method-assign]
        agent.check = check  # type: ignore[method-assign]
        push.fence_get = fence_get  # type: ignore[method-assign]
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



#: A stand-in transfer handle: never NIXL's; release_xfer passes it.
STAND_IN = -1000


async def _gathering_next(src: aionixl.Engine, dst: aionixl.Engine,
                          peer: aionixl.Peer) -> tuple[Any, Any, Any]:
    """One call from this task, so that the next calls from others gather; from then on
    ``dst``'s posts end inside them (``_finish_inside_posts``). Returns its agent and the
    agent's ``start_xfer`` and ``check`` as they are then, for stand-ins to call."""
    await dst.transfer_blocks(peer, [2], [2])
    agent = dst._transfers.agent
    assert agent is not None
    _finish_inside_posts(dst, src)
    return agent, agent.start_xfer, agent.check


@contextlib.asynccontextmanager
async def _first_post_reported_running(seed: int) -> AsyncIterator[
        tuple[list[np.ndarray], list[np.ndarray], aionixl.Engine, aionixl.Peer, list[list[int]]]]:
    """An engine pair (``coalesce_window`` 5 s, no inline polls) whose ``dst`` gathers the
    next calls; ``dst``'s first post from then on finishes but is reported running (handle
    ``STAND_IN``, for the test's own ``check`` to answer). Yields the source and destination
    caches, ``dst``, its peer, and every post's local indices, in order."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=seed)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=seed + 1)
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (src, dst, peer):
        agent, real_start, _ = await _gathering_next(src, dst, peer)
        posts: list[list[int]] = []

        def start_xfer(*args: Any) -> Any:
            posts.append([int(i) for i in args[2]])
            handle, state = real_start(*args)
            return (STAND_IN, _transfers.PROC) if len(posts) == 1 else (handle, state)

        agent.start_xfer = start_xfer  # type: ignore[method-assign]
        yield src_cache, dst_cache, dst, peer, posts


async def _notify_writes_with_one_post_stuck(src: aionixl.Engine, dst: aionixl.Engine,
                                              peer: aionixl.Peer) -> tuple[list[bytes], dict[int, object]]:
    """Writes of blocks 1 (timeout 0.5 s), 3 and 4 (15 s), each with ``notify=b"n-<block>"``,
    called together. Every post finishes (data and notification) inside it, but the first
    that carries ``n-1`` is reported running for ever, so that its callers time out or
    leave. Returns the notifications posted, in order, and each call's result or
    ``TransferTimeoutError``."""
    agent, real_start, real_check = await _gathering_next(src, dst, peer)
    stuck = STAND_IN
    posts: list[bytes] = []

    def start_xfer(op: str, local: int, local_idx: Any, remote: int, remote_idx: Any,
                   notify: bytes, polls: int) -> Any:
        posts.append(notify)
        handle, state = real_start(op, local, local_idx, remote, remote_idx, notify, polls)
        assert (handle, state) == (_transfers.NO_HANDLE, _transfers.DONE)
        if b"n-1" in notify and sum(b"n-1" in p for p in posts) == 1:
            return stuck, _transfers.PROC
        return handle, state

    def check(handle: int) -> Any:
        return _transfers.PROC if handle == stuck else real_check(handle)

    agent.start_xfer = start_xfer  # type: ignore[method-assign]
    agent.check = check  # type: ignore[method-assign]
    outcomes = await _together(lambda block, timeout: dst.transfer_blocks(
        peer, [block], [block], "write", notify=b"n-%d" % block, timeout=timeout), {1: 0.5, 3: 15, 4: 15})
    assert isinstance(outcomes[1], aionixl.TransferTimeoutError), outcomes
    assert all(isinstance(outcomes[b], aionixl.TransferResult) for b in (3, 4)), outcomes
    return posts, outcomes


async def _together(call: Callable[[int, float], Awaitable[aionixl.TransferResult]],
                    timeouts: dict[int, float]) -> dict[int, object]:
    """``call(key, timeout)`` for every key at once (started in the dict's order); each
    key's ``TransferResult`` or ``TransferTimeoutError``."""
    outcomes: dict[int, object] = {}

    async def one(key: int, timeout: float) -> None:
        try:
            outcomes[key] = await call(key, timeout)
        except aionixl.TransferTimeoutError as exc:
            outcomes[key] = exc

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for key, timeout in timeouts.items():
                tg.start_soon(one, key, timeout)
    return outcomes


async def _heard_once(src: aionixl.Engine, dst: aionixl.Engine, blocks: tuple[int, ...]) -> None:
    """Each of ``blocks``' notifications reached ``src`` once, nothing is kept unclaimed."""
    for block in blocks:
        assert (await src.wait_notification(b"n-%d" % block, timeout=10)).peer == dst.name
    await anyio.sleep(0.2)
    assert src.stats()["notifications_kept"] == 0
    for block in blocks:
        with pytest.raises(TimeoutError):
            await src.wait_notification(b"n-%d" % block, timeout=0.2)
    live = dst.live_resources()
    assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_a_merged_write_posted_again_after_a_member_left_notifies_the_others_once() -> None:
    """A member leaves a merged write with notifications that NIXL already finished (its
    notification delivered) but the engine still saw running: the request is aborted and
    posted again for the rest. The target must hear each remaining caller once, not once
    per post: the re-post carries the first post's tag, and the target drops a tag it has
    already delivered (both sides announce "tagged-notify")."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=35)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=36)
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (src, dst, peer):
        assert "tagged-notify" in peer.features
        posts, _ = await _notify_writes_with_one_post_stuck(src, dst, peer)
        assert len(posts) == 2 and merged(dst) == (1, 3) and dst.stats()["reposts"] == 1, posts
        for block in (3, 4):
            for region in range(REGIONS):
                assert np.array_equal(src_cache[region][block], dst_cache[region][block])
        # The first post's own notifications, the leaver's included, arrived with it.
        await _heard_once(src, dst, (1, 3, 4))


async def test_calls_with_notify_to_a_peer_without_tags_post_alone() -> None:
    """A peer that unpacks merged notifications but does not drop repeated tags (an engine
    from before "tagged-notify") could hear a caller twice if a merged request were aborted
    and posted again. So calls with ``notify`` to it are not merged: here the write carrying
    ``n-1`` is reported running after it finished, times out and is aborted, and the other
    two callers' notifications still arrive exactly once."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=37)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=38)
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (src, dst, peer):
        peer.features = peer.features - {"tagged-notify"}
        posts, _ = await _notify_writes_with_one_post_stuck(src, dst, peer)
        assert sorted(posts) == [b"n-1", b"n-3", b"n-4"] and merged(dst) == (0, 0), posts
        for block in (3, 4):
            for region in range(REGIONS):
                assert np.array_equal(src_cache[region][block], dst_cache[region][block])
        # The aborted lone write of block 1 had finished: its notification came, once.
        await _heard_once(src, dst, (1, 3, 4))


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
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (src, dst, peer):
        agent, real_start, real_check = await _gathering_next(src, dst, peer)
        stuck = STAND_IN
        posts: list[int] = []

        def start_xfer(*args: Any) -> Any:
            posts.append(len(args[2]))
            handle, state = real_start(*args)
            return (stuck, _transfers.PROC) if len(posts) == 1 else (handle, state)

        def check(handle: int) -> Any:
            if handle != stuck:
                return real_check(handle)
            if sys._getframe(1).f_code.co_name != "_leave":
                return _transfers.PROC  # the poller sees it running
            if failure == "ERR":
                return _transfers.ERR
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
        assert posts == [(1 + len(others)) * REGIONS] and dst.stats()["reposts"] == 0, posts
        assert 1 not in outcomes  # cancelled: nothing returned
        expected = aionixl.PeerDisconnectedError if failure == "ERR" else aionixl.TransferError
        for block in others:
            assert type(outcomes[block]) is expected, outcomes
        assert len({id(outcomes[block]) for block in others}) == len(others)
        assert STAND_IN not in dst._transfers.inflight
        assert (peer.name in dst.peers) is (failure != "ERR")
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_members_of_a_merged_read_that_failed_fence_before_they_return() -> None:
    """NIXL fails a merged read (its check raises) while the peer stays connected: the
    read may still be writing, as a lone read that failed may, so each member fences its
    blocks (one more one-descriptor read from the peer) before it raises TransferError."""
    async with _first_post_reported_running(seed=45) as (_, _, dst, peer, posts):
        agent = dst._transfers.agent
        assert agent is not None
        real_check = agent.check
        failing = False

        def check(handle: int) -> Any:
            if handle != STAND_IN:
                return real_check(handle)
            if failing:
                raise aionixl.TransferError("the request failed")
            return _transfers.PROC

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
        assert peer.name in dst.peers and dst.stats()["reposts"] == 0
        assert STAND_IN not in dst._transfers.inflight
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_notification_tags_of_an_engine_do_not_repeat_after_random_seed() -> None:
    """A receiver drops a tag it has seen from that sender's name; a sender started again
    under the same name after ``random.seed(0)`` (reproducible ML runs do that) must not
    repeat its predecessor's tags, or its merged notifications would be dropped."""
    starts = []
    for _ in range(2):
        random.seed(0)
        async with aionixl.Engine("same-name", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS),
                                  listen=None) as engine:
            starts.append(next(engine._transfers._tags))
    assert starts[0] != starts[1]


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
    config = aionixl.EngineConfig(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config) as (_src, dst, peer):
        await dst.transfer_blocks(peer, [2], [2])  # the next call from another task gathers
        agent = dst._transfers.agent
        assert agent is not None
        real_start, real_check = agent.start_xfer, agent.check
        stuck = {-1000, -1001}  # stand-in handles: never NIXL's; release_xfer passes them
        posts: list[int] = []

        def start_xfer(*args: Any) -> Any:
            posts.append(len(args[2]))
            handle, state = real_start(*args)
            if len(posts) <= 2:  # the merged read, then the fence: both never end
                if handle != _transfers.NO_HANDLE:
                    agent.release_xfer(handle)
                return -999 - len(posts), _transfers.PROC
            return handle, state

        agent.start_xfer = start_xfer  # type: ignore[method-assign]
        agent.check = lambda h: _transfers.PROC if h in stuck else real_check(h)  # type: ignore[method-assign]
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
        assert not peer.connected and dst.stats()["fence_evictions"] == 1
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_members_time_out_at_their_own_deadlines_and_the_rest_go_on() -> None:
    """A stopped TCP peer keeps a merged write in flight: the members with a short timeout
    fail at their deadline, the others wait on and their blocks land after the resume."""
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=22)
    source = [r.copy() for r in local]
    config = aionixl.EngineConfig(coalesce_window=0.05)
    async with RemoteEngine(seed=13, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("coal"), local, listen=None, config=config) as eng:
        peer = await eng.connect(child.address, timeout=30)
        for i in range(7):  # each block once: later one-block calls join on the fast path
            await eng.transfer_blocks(peer, [i], [i], "write")
        await child.pause()
        outcomes: dict[int, object] = {}
        timed: dict[int, float] = {}
        limits = {2: 0.5, 5: 0.9}

        async def write(i: int, timeout: float) -> None:
            start = anyio.current_time()
            try:
                outcomes[i] = await eng.transfer_blocks(peer, [i], [i], "write", timeout=timeout)
            except aionixl.TransferTimeoutError as exc:
                outcomes[i] = exc
            timed[i] = anyio.current_time() - start

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


#: More one-block callers than the engine wakes in one go when their merged request ends.
MANY = 3 * _transfers._WAKE_CHUNK + 17


async def test_members_beyond_one_wake_chunk_all_wake_with_their_own_bytes() -> None:
    """Long-lived callers, more than a wake chunk of them: every round each gets its bytes
    (another source block each round, so a caller woken before its data landed would
    see the last round's)."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=31)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
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
        assert max(sizes) > _transfers._WAKE_CHUNK, sizes  # some request woke in chunks
        assert dst._transfers._waking == []
    assert zero_resources(dst) and zero_resources(src)


async def test_waking_members_in_chunks_does_not_wake_the_drainer() -> None:
    """The poller wakes the notification drainer (ending its back-off) when requests are in
    flight, not when it was woken only to wake members in chunks: in one process a merged
    request often finishes inside its post, and each such wake restarted the drainer's
    back-off from its shortest step."""
    src_cache = numpy_cache(MANY, 512, REGIONS, seed=34)
    dst_cache = numpy_cache(MANY, 512, REGIONS)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        transfers = dst._transfers
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
            busy_at_wake.append(bool(transfers.inflight or transfers.parked))
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

    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for block in range(MANY):
                    tg.start_soon(caller, dst, peer, block)
                while not dst._transfers._waking:  # a merged request ended, chunks left
                    await anyio.sleep(0)
                await dst.aclose()
    assert len(outcomes) == MANY
    assert outcomes.count("ok") >= _transfers._WAKE_CHUNK
    assert zero_resources(dst) and zero_resources(src)


async def test_a_merged_request_of_a_mebibyte_or_more_carries_every_member_exactly() -> None:
    """Such a request gets one more loop turn before its post (the copy inside the post is
    long); its members still get their own bytes, and nothing is left behind."""
    block_bytes = 64 * 1024
    callers = _transfers._LONG_POST // (block_bytes * REGIONS) + 8
    src_cache = numpy_cache(callers, block_bytes, REGIONS, seed=33)
    dst_cache = numpy_cache(callers, block_bytes, REGIONS)
    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        posted = posted_requests(dst, "local")
        results: dict[int, aionixl.TransferResult] = {}

        async def read(i: int) -> None:
            results[i] = await dst.transfer_blocks(peer, [i], [callers - 1 - i])

        await dst.transfer_blocks(peer, [0], [0])  # another task called just now: gather
        posted.clear()
        async with anyio.create_task_group() as tg:
            for i in range(callers):
                tg.start_soon(read, i)
        assert sorted(results) == list(range(callers))
        largest = max(len(request) // REGIONS for request in posted)
        assert largest * block_bytes * REGIONS >= _transfers._LONG_POST, [len(r) for r in posted]
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region], src_cache[region][::-1])
    assert zero_resources(dst) and zero_resources(src)


async def _until_chunks_wait_then(dst: aionixl.Engine, peer: aionixl.Peer, caller: Any,
                                  act: Callable[[], object]) -> None:
    """Run ``caller(dst, peer, block)`` for MANY blocks; once a merged request has ended
    with members still parked for their wake chunk, call ``act`` (it cancels them)."""
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for block in range(MANY):
                tg.start_soon(caller, dst, peer, block)
            while not dst._transfers._waking:  # a request ended, chunks still parked
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

    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        posted = posted_requests(dst, "local")
        await _until_chunks_wait_then(dst, peer, caller, lambda: [s.cancel() for s in scopes])
        stats = dst.metrics().transfers["read"]
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region], src_cache[region])  # every block landed
    # The first caller posted alone (a lone transfer still in flight when cancelled raises,
    # as before); every member of the merged request was told its blocks landed.
    members = {i for i in max(posted, key=len) if i < MANY}
    assert len(members) > 2 * _transfers._WAKE_CHUNK
    assert members <= set(returned)
    assert len(cancelled_after) > len(members) - 2 * _transfers._WAKE_CHUNK  # parked, then cancelled
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

    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        posted = posted_requests(dst, "local")
        await _until_chunks_wait_then(dst, peer, caller,
                                      lambda: [t.reschedule(loop.time()) for t in timeouts])
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region], src_cache[region])
    members = {i for i in max(posted, key=len) if i < MANY}
    assert len(members) > 2 * _transfers._WAKE_CHUNK
    assert leaked == []
    assert len(timed_out) + len(went_on) == MANY
    assert members <= set(returned)
    assert len(set(timed_out) & members) > len(members) - 2 * _transfers._WAKE_CHUNK
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

    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        await _until_chunks_wait_then(dst, peer, caller, lambda: [c() for c in cancels])
    assert len(kept) > 2 * _transfers._WAKE_CHUNK  # members that kept their results
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

    async with engine_pair(src_cache, dst_cache, TOGETHER) as (src, dst, peer):
        transfers = dst._transfers
        chunks_wait = asyncio.Event()
        real_wake = transfers._wake_members

        def wake_members(waiters: list[Any]) -> None:
            real_wake(waiters)
            if transfers._waking:  # members left parked for their chunk
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


def _finish_inside_posts(engine: aionixl.Engine, target: aionixl.Engine) -> None:
    """From now on the engine's posts return only once their request ended, as an
    in-process read's post usually does by itself: the post polls it, and progresses the
    target's agent too (a small read over shared memory needs its reply), up to a bound.
    What that progress call reads, the target's own next read gets."""
    agent, target_agent = engine._transfers.agent, target._transfers.agent
    assert agent is not None and target_agent is not None
    real_start, real_check, real_notifs = agent.start_xfer, agent.check, target_agent.get_notifs
    kept: dict[str, list[bytes]] = {}

    def notifs() -> dict[str, list[bytes]]:
        got = real_notifs()
        for name, messages in kept.items():
            got[name] = messages + got.get(name, [])
        kept.clear()
        return got

    def start_xfer(*args: Any) -> Any:
        handle, state = real_start(*args)
        for _ in range(100_000):
            if state != _transfers.PROC:
                break
            for name, messages in real_notifs().items():
                kept.setdefault(name, []).extend(messages)
            state = real_check(handle)
        if state == _transfers.DONE and handle != _transfers.NO_HANDLE:
            agent.release_xfer(handle)
            return _transfers.NO_HANDLE, _transfers.DONE
        return handle, state

    agent.start_xfer = start_xfer  # type: ignore[method-assign]
    target_agent.get_notifs = notifs  # type: ignore[method-assign]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_task_that_kept_a_result_meets_its_cancellation_on_its_next_call(
        ) -> None:
    """A member cancelled while its request gathers runs again only after the request
    finished (asyncio runs the gatherer before the joiners it let in): it keeps its result.
    Its next call, joining the next request the same way, must raise the cancellation
    rather than keep another result (round after round, it would never stop)."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=37)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    config = aionixl.EngineConfig(coalesce_window=5.0)
    async with engine_pair(src_cache, dst_cache, config) as (src, dst, peer):
        await dst.transfer_blocks(peer, [0], [0])  # another task called: the next gathers
        _finish_inside_posts(dst, src)  # on a loaded machine a post may return before its end
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
