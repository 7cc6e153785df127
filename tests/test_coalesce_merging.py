"""Coalesced transfers: who rides together in one NIXL request (merged indices, the
same block pair once, destinations never twice, the forms ids come in, a lone caller
and coalescing off), each caller kept exact."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl import _coalesce, _transfers
from aionixl._regions import region_offsets, small_indices

from .helpers import (
    BLOCK_BYTES,
    BLOCKS,
    REGIONS,
    TOGETHER,
    TOGETHER_WHATEVER_THE_LOAD,
    engine_pair,
    merged,
    numpy_cache,
    posted_requests,
    zero_resources,
)

pytestmark = pytest.mark.anyio


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
    local, remote = _coalesce._merged_indices(entries, len(entries), local_offsets, remote_offsets)
    assert local.dtype == remote.dtype == np.int32
    assert (local.tolist(), remote.tolist()) == _in_local_order(entries)
    # With a member of several blocks the members' lists are joined instead: same pairing.
    several = (small_indices([5, 9], local_blocks, local_list),
               small_indices([90, 91], remote_blocks, remote_list), 2, b"", 1.0)
    entries.insert(len(entries) // 2, several)
    local, remote = _coalesce._merged_indices(entries, len(entries) + 1, local_offsets,
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
    local, remote = _coalesce._merged_indices(entries, len(entries), local_offsets, remote_offsets,
                                               True)
    assert list(zip(local.tolist(), remote.tolist(), strict=True)) == want
    # With a member of several blocks (the joined-lists way): the same pairs, and its own.
    entries.append((small_indices([3, 4], 16, local_list), small_indices([20, 21], 24, remote_list),
                    2, b"", 1.0))
    local, remote = _coalesce._merged_indices(entries, len(entries) + 1, local_offsets,
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
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER_WHATEVER_THE_LOAD) as (src, dst, peer):
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
        assert src.metrics().notifications_kept == 0  # each arrived once, and was taken
        for i in range(len(calls)):
            with pytest.raises(TimeoutError):
                await src.wait_notification(b"c-%d" % i, timeout=0.05)
    assert zero_resources(dst) and zero_resources(src)


async def test_concurrent_reads_and_writes_of_mixed_sizes_are_merged_and_exact() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=1)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=2)
    src_before = [r.copy() for r in src_cache]
    dst_before = [r.copy() for r in dst_cache]
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
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
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
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
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
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


async def test_writes_to_the_same_destination_block_are_never_merged() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=6)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (_src, dst, peer):
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
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER_WHATEVER_THE_LOAD) as (_src, dst, peer):
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
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER_WHATEVER_THE_LOAD) as (_src, dst, peer):
        await dst.transfer_blocks(peer, [60], [60])  # the next caller comes "together" with it
        posted = posted_requests(dst, "remote")
        async with anyio.create_task_group() as tg:
            for i in range(4):  # remote block 7 from four local blocks, ids as objects
                tg.start_soon(dst.transfer_blocks, peer, [_Index(i)], [_Index(7)], "write")
        block7 = {7, BLOCKS + 7}
        assert len(posted) == 4, posted
        for request in posted:
            assert len([i for i in request if i in block7]) <= REGIONS, request


async def test_a_lone_caller_never_gathers() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=7)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (_src, dst, peer):
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


async def test_calls_moving_more_than_coalesce_max_call_bytes_post_alone() -> None:
    # Four blocks of 2 KiB ride; five do not. Large calls gain little from a shared post and
    # would wait for each other's bytes (docs/coalescing.md).
    limit = 4 * BLOCK_BYTES * REGIONS
    tuning = aionixl.lowlevel.Tuning(coalesce_window=0.05, coalesce_max_call_bytes=limit)
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=34)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (src, dst, peer):
        async def read(size: int, i: int) -> None:
            ids = list(range(i * size, (i + 1) * size))
            await dst.transfer_blocks(peer, ids, ids[::-1])

        for size, callers in ((5, 12), (4, 16)):
            before = merged(dst)
            async with anyio.create_task_group() as tg:
                for i in range(callers):
                    tg.start_soon(read, size, i)
            requests, calls = (a - b for a, b in zip(merged(dst), before, strict=True))
            if size == 5:
                assert (requests, calls) == (0, 0)
            else:
                assert requests >= 1 and calls >= 2 * requests, (requests, calls)
            for i in range(callers):
                ids = list(range(i * size, (i + 1) * size))
                for region in range(REGIONS):
                    assert np.array_equal(dst_cache[region][ids], src_cache[region][ids[::-1]]), (size, i)
    assert zero_resources(dst) and zero_resources(src)


async def test_a_merged_request_of_a_mebibyte_or_more_carries_every_member_exactly() -> None:
    """Such a request gets one more loop turn before its post (the copy inside the post is
    long); its members still get their own bytes, and nothing is left behind."""
    block_bytes = 64 * 1024
    callers = _coalesce._LONG_POST // (block_bytes * REGIONS) + 8
    src_cache = numpy_cache(callers, block_bytes, REGIONS, seed=33)
    dst_cache = numpy_cache(callers, block_bytes, REGIONS)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
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
        assert largest * block_bytes * REGIONS >= _coalesce._LONG_POST, [len(r) for r in posted]
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region], src_cache[region][::-1])
    assert zero_resources(dst) and zero_resources(src)
