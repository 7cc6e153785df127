"""Staging slots (``aionixl._staging``) on their own, without NIXL: the copy out, slots
free again only once confirmed, stranded ones coming back, and the handshake's check of a
peer's slots. Push reads through them are in tests/test_push.py."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from aionixl import BlockPart
from aionixl import _protocol as proto
from aionixl._regions import Region
from aionixl._staging import MAX_SLOTS, Staging

pytestmark = pytest.mark.anyio


def _regions(blocks: np.ndarray) -> list[Region]:
    """One region per [num_blocks, block_bytes] uint8 array."""
    return [Region(b.ctypes.data, b.strides[0], b.shape[1], b.shape[0], "DRAM", 0) for b in blocks]


def test_slots_mirror_the_regions_within_the_budget() -> None:
    caches = [np.zeros((8, 64), np.uint8), np.zeros((8, 32), np.uint8)]
    staging = Staging(_regions(caches), budget=4 * 96 + 50)
    assert staging.slots == 4 and staging.usable == 4 and staging.free == 4
    assert [(r.block_bytes, r.num_blocks, r.mem_type) for r in staging.regions] == \
        [(64, 4, "DRAM"), (32, 4, "DRAM")]
    assert Staging(_regions(caches), budget=10).slots == 1  # at least one slot
    assert Staging(_regions(caches), budget=1 << 30).slots == 8  # no more than the blocks
    tiny = [np.zeros((10_000, 8), np.uint8)]
    assert Staging(_regions(tiny), budget=1 << 30).slots == MAX_SLOTS


async def test_copy_out_moves_each_region_s_slots_into_the_blocks_named() -> None:
    caches = [np.zeros((8, 64), np.uint8), np.zeros((8, 32), np.uint8)]
    staging = Staging(_regions(caches), budget=4 * 96)
    slots = await staging.acquire(3)
    assert slots is not None
    rng = np.random.default_rng(5)
    for view in staging._views:
        view[:] = rng.integers(0, 256, view.shape, dtype=np.uint8)
    staging.copy_out(slots, np.array([6, 0, 3]), None)
    for cache, view in zip(caches, staging._views, strict=True):
        assert np.array_equal(cache[[6, 0, 3]], view[slots])
        assert not cache[[1, 2, 4, 5, 7]].any()
    caches[0][:] = 0
    caches[1][:] = 0
    part = BlockPart(1, 2, groups=2)  # the second half of each half of every block
    staging.copy_out(slots[:1], np.array([2]), part)
    for cache, view in zip(caches, staging._views, strict=True):
        size = cache.shape[1]
        want = np.zeros(size, np.uint8)
        for start, length in part.runs(size, "test"):
            want[start:start + length] = view[slots[0], start:start + length]
        assert np.array_equal(cache[2], want) and cache[2].any()


async def test_slots_come_back_only_when_the_server_confirmed() -> None:
    staging = Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=4 * 16)
    a = await staging.acquire(2)
    b = await staging.acquire(2)
    assert a is not None and b is not None and staging.free == 0
    staging.settle(a, True, "p", 1, b"proc-1")
    assert staging.free == 2 and staging.stranded == 0
    staging.settle(b, False, "p", 2, b"proc-1")
    assert staging.free == 2 and staging.stranded == 2 and staging.usable == 2
    staging.confirmed_late("q", 2)  # another server's word counts for nothing
    staging.confirmed_late("p", 3)
    assert staging.stranded == 2
    staging.confirmed_late("p", 2)
    assert staging.free == 4 and staging.stranded == 0 and staging.reclaimed == 2


async def test_a_new_agent_of_the_same_name_frees_what_the_old_one_stranded() -> None:
    staging = Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=4 * 16)
    slots = await staging.acquire(3)
    assert slots is not None
    staging.settle(slots[:2], False, "p", 1, b"proc-1")
    staging.settle(slots[2:], False, "q", 2, b"proc-9")
    staging.admitted("p", b"proc-1")  # the same process handshaking again: it may still write
    assert staging.stranded == 3
    staging.admitted("p", b"proc-2")  # a new process of that name: the old one is gone
    assert staging.stranded == 1 and staging.free == 3 and staging.reclaimed == 2
    # A round of the old process that ends unconfirmed only now (its peer was dropped when
    # the new one was admitted) is not stranded for good.
    late = await staging.acquire(1)
    assert late is not None
    staging.settle(late, False, "p", 3, b"proc-1")
    assert staging.stranded == 1 and staging.free == 3 and staging.reclaimed == 3


async def test_one_server_strands_at_most_three_quarters_of_the_slots() -> None:
    staging = Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=8 * 16)
    assert staging.room_for("p") == 6
    a = await staging.acquire(4)
    assert a is not None
    staging.settle(a, False, "p", 1, b"proc-1")
    assert staging.room_for("p") == 2 and staging.room_for("q") == 6  # another server's room is whole
    b = await staging.acquire(2)
    assert b is not None
    staging.settle(b, False, "p", 2, b"proc-1")
    assert staging.room_for("p") == 0 and staging.usable == 2  # a quarter left for the others
    staging.confirmed_late("p", 1)
    assert staging.room_for("p") == 4
    assert Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=16).room_for("p") == 1  # one slot


async def test_stranded_slots_of_a_server_gone_that_long_come_back_after_the_ttl() -> None:
    now = [100.0]
    staging = Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=8 * 16, ttl=60.0,
                      clock=lambda: now[0])
    a = await staging.acquire(2)
    b = await staging.acquire(1)
    assert a is not None and b is not None
    staging.settle(a, False, "gone", 1, b"proc-1")
    now[0] = 130.0
    staging.settle(b, False, "still-here", 1, b"proc-7")
    peers = {"still-here"}

    def gone(name: str) -> bool:
        return name not in peers

    staging.expire(gone)  # 30 s: too early for either
    assert staging.stranded == 3 and staging.expired == 0
    now[0] = 160.0
    staging.expire(gone)  # 60 s for "gone"'s round; "still-here" is a peer: its slot waits
    assert staging.stranded == 1 and staging.free == 7
    assert staging.expired == 2 and staging.reclaimed == 2
    now[0] = 10_000.0
    staging.expire(gone)
    assert staging.stranded == 1  # however long: a server still a peer can still confirm
    peers.clear()
    staging.expire(gone)
    assert staging.stranded == 0 and staging.free == 8 and staging.expired == 3


async def test_acquire_waits_for_slots_and_gives_up_when_too_few_are_usable() -> None:
    staging = Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=4 * 16)
    held = await staging.acquire(3)
    assert held is not None
    got: list[object] = []

    async def want(n: int) -> None:
        got.append(await staging.acquire(n))

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 2)
        await anyio.sleep(0.05)
        assert got == []  # one slot free: it waits
        staging.settle(held[:1], True, "p", 1, b"proc")
    assert len(got) == 1 and isinstance(got[0], np.ndarray) and got[0].size == 2
    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 2)
        await anyio.sleep(0.05)
        staging.settle(held[1:], False, "p", 2, b"proc")  # stranded: 2 usable, both taken
        await anyio.sleep(0.05)
        assert len(got) == 1
        staging.settle(got[0], False, "p", 3, b"proc")  # type: ignore[arg-type]
    assert got[1] is None and staging.usable == 0


async def test_slots_go_to_readers_in_the_order_they_asked() -> None:
    """A read waiting for two slots is not overtaken by a later one wanting a single slot."""
    staging = Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=4 * 16)
    held = await staging.acquire(4)
    assert held is not None
    order: list[int] = []

    async def want(n: int) -> None:
        slots = await staging.acquire(n)
        assert slots is not None and slots.size == n
        order.append(n)

    async with anyio.create_task_group() as tg:
        tg.start_soon(want, 2)
        await anyio.sleep(0.02)
        tg.start_soon(want, 1)
        await anyio.sleep(0.02)
        staging.settle(held[:1], True, "p", 1, b"proc")  # one free: enough for the later reader
        await anyio.sleep(0.05)
        assert order == []  # ... which waits its turn
        staging.settle(held[1:2], True, "p", 2, b"proc")  # two free: the first in line goes
        await anyio.sleep(0.05)
        assert order == [2]
        staging.settle(held[2:3], True, "p", 3, b"proc")
    assert order == [2, 1] and staging.free == 0


async def test_closing_wakes_readers_waiting_for_slots() -> None:
    staging = Staging(_regions([np.zeros((8, 16), np.uint8)]), budget=2 * 16)
    held = await staging.acquire(2)
    got: list[object] = []

    async def want() -> None:
        got.append(await staging.acquire(1))

    async with anyio.create_task_group() as tg:
        tg.start_soon(want)
        await anyio.sleep(0.02)
        staging.close()
    assert held is not None and got == [None]


def _info(slots: int, block_bytes: int = 64, mem: str = "DRAM") -> proto.RegionInfo:
    return proto.RegionInfo(4096, block_bytes, block_bytes, slots, mem, 0)  # type: ignore[arg-type]


def test_the_handshake_refuses_staging_slots_that_do_not_mirror_the_regions() -> None:
    regions = [proto.RegionInfo(1 << 20, 64, 64, 8, "DRAM", 0)] * 2
    proto.check_staging(regions, [])  # none at all is fine
    proto.check_staging(regions, [_info(4), _info(4)])
    for bad in ([_info(4)], [_info(4), _info(5)], [_info(4), _info(4, 32)],
                [_info(4), _info(4, mem="VRAM")], [_info(0), _info(0)],
                [_info(proto.MAX_STAGING_SLOTS + 1)] * 2,
                [proto.RegionInfo(-64, 64, 64, 4, "DRAM", 0)] * 2,
                [proto.RegionInfo(2**64 - 128, 64, 64, 4, "DRAM", 0)] * 2,
                [proto.RegionInfo(4096, 64, 64, 4, "DRAM", 3)] * 2):
        with pytest.raises(proto.ProtocolError):
            proto.check_staging(regions, bad)
