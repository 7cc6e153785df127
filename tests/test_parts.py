"""Parts of blocks (``aionixl.BlockPart``, ``transfer_blocks(..., local_part=, remote_part=)``)
between engines whose layouts differ: another tensor parallelism (head slices), another
block size (token ranges), K and V in one page.

Every check compares numpy views with named dims (``[block, head, token, dim]`` for HND,
``[block, token, head, dim]`` for NHD) element by element, never raw offsets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl import BlockPart, _parts
from aionixl.testing import RemoteEngine, assert_no_resources

from .helpers import engine_pair, unique

pytestmark = pytest.mark.anyio

DIM = 8
GET = aionixl.EngineConfig(read_mode="get")
PUSH = aionixl.EngineConfig(read_mode="push")


def kv(shape: tuple[int, ...], seed: int | None, regions: int = 2) -> list[np.ndarray]:
    """``regions`` float16 regions of ``shape`` (the first dim indexes blocks): distinct
    values from ``seed``, or zeros."""
    if seed is None:
        return [np.zeros(shape, np.float16) for _ in range(regions)]
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float16) for _ in range(regions)]


def assert_equal(got: np.ndarray, want: np.ndarray, what: str) -> None:
    assert got.shape == want.shape, (what, got.shape, want.shape)
    wrong = np.argwhere(got.view(np.uint16) != want.view(np.uint16))
    assert wrong.size == 0, f"{what}: {len(wrong)} elements differ, first at {wrong[0].tolist()}"


# ---- BlockPart and the plan, without engines -----------------------------------------------


def test_block_part_is_a_frozen_exported_value_that_checks_its_fields() -> None:
    assert "BlockPart" in aionixl.__all__
    part = BlockPart(1, 2, groups=4)
    assert (part.index, part.count, part.groups) == (1, 2, 4)
    assert part == BlockPart(1, 2, 4) and hash(part) == hash(BlockPart(1, 2, 4))
    assert BlockPart(0, 1).groups == 1
    with pytest.raises(AttributeError):
        part.index = 0  # type: ignore[misc]
    for args, why in [((0, 0), "count must be >= 1"), ((0, 2, 0), "groups must be >= 1"),
                      ((2, 2), r"index must be in \[0, 2\)"), ((-1, 2), r"index must be in"),
                      ((True, 2), "index must be an int"), ((0, 2.0), "count must be an int"),
                      ((0, 2, np.int64(2)), "groups must be an int")]:
        with pytest.raises(ValueError, match=why):
            BlockPart(*args)


def test_a_plan_cuts_both_sides_at_every_boundary_either_needs() -> None:
    # Ours: the second half of each of 4 groups of a 64-byte block; theirs: a whole
    # 32-byte block. Their block is cut where our runs end.
    plan = _parts.plan_parts([64], BlockPart(1, 2, groups=4), [32], None)
    assert plan.local == (((8, 8), (24, 8), (40, 8), (56, 8)),)
    assert plan.remote == (((0, 8), (8, 8), (16, 8), (24, 8)),)
    assert plan.nbytes == 32 and plan.per_block == 4
    # A part of one group cut into as many parts is one run: groups=2 with count=1 is whole.
    assert _parts.plan_parts([64], BlockPart(0, 1, groups=2), [64], None).local == (((0, 64),),)


@pytest.mark.parametrize(("local", "lpart", "remote", "rpart", "message"), [
    ([64, 64], None, [64, 32], None,
     r"region 1: local_part \(the whole block\) selects 64 bytes of each 64-byte local block, "
     r"but remote_part \(the whole block\) selects 32 bytes of each 32-byte remote block"),
    ([48], BlockPart(0, 2), [48], BlockPart(0, 3),
     r"region 0: local_part .* selects 24 bytes .* remote_part .* selects 16 bytes"),
    ([64], BlockPart(0, 3), [64], None, r"region 0, local_part: a block of 64 bytes does not divide "
                                        r"into 1 group\(s\) x 3 part\(s\)"),
    ([64], None, [96], BlockPart(0, 5, groups=2), r"region 0, remote_part: a block of 96 bytes"),
], ids=["whole-blocks-of-other-sizes", "selections-of-other-sizes", "local-does-not-divide",
        "remote-does-not-divide"])
def test_parts_that_do_not_fit_are_refused_naming_region_and_sizes(
        local: list[int], lpart: BlockPart | None, remote: list[int], rpart: BlockPart | None,
        message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _parts.plan_parts(local, lpart, remote, rpart)


@dataclass(frozen=True)
class FakeRegion:
    base: int
    stride: int
    num_blocks: int
    device: int = 0


@pytest.mark.parametrize("segments", [1, 4, 64], ids=["whole-runs", "4-segments", "64-segments"])
def test_descriptor_indices_name_the_rows_of_each_block_whether_plain_or_numpy(
        segments: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Indices from plain lists of ids (plain Python, one block's remembered) and from int32
    arrays (numpy) agree, and each names the descriptor row of that block's segment."""
    monkeypatch.setattr(_parts, "_MEMO", 3)  # the memo starts over often
    sizes = [1024, 512, 1024]
    part = BlockPart(1, 2, groups=segments)
    plan = _parts.plan_parts(sizes, part, [n // 2 for n in sizes], None)
    ours = [FakeRegion((1 << 40) + (r << 32), 2 * n, 50) for r, n in enumerate(sizes)]
    theirs = [FakeRegion((1 << 41) + (r << 32), n, 70) for r, n in enumerate(sizes)]
    local_rows = _parts.part_descriptors(ours, plan.local)
    remote_rows = _parts.part_descriptors(theirs, plan.remote)
    lists = _parts.PartLists(plan, 1, 50, 2, 70)
    rng = np.random.default_rng(segments)
    for n in (1, 1, 1, 2, 5, 1, 40):
        local = rng.choice(50, n, replace=False).tolist()
        remote = rng.choice(70, n, replace=False).tolist()
        for _ in range(2):  # again: from the memo for one block
            plain = lists.indices(local, remote)
            arrays = lists.indices(np.array(local, np.int32), np.array(remote, np.int32))
            short = n * plan.per_block <= _parts._PLAIN
            for got, want in zip(plain, arrays, strict=True):
                assert isinstance(got, list) == short and isinstance(want, np.ndarray)
                assert want.dtype == np.int32 and np.array_equal(np.asarray(got), want)
        # Region, then block pair, then segment: both sides pair up row by row.
        local_idx, remote_idx = arrays
        expect_local: list[list[int]] = []
        expect_remote: list[list[int]] = []
        for r, (mine, yours) in enumerate(zip(ours, theirs, strict=True)):
            for lb, rb in zip(local, remote, strict=True):
                for (lo, ln), (ro, rn) in zip(plan.local[r], plan.remote[r], strict=True):
                    expect_local.append([mine.base + lb * mine.stride + lo, ln, 0])
                    expect_remote.append([yours.base + rb * yours.stride + ro, rn, 0])
        assert local_rows[local_idx].tolist() == expect_local
        assert remote_rows[remote_idx].tolist() == expect_remote


# ---- layouts: what lands where -------------------------------------------------------------


@dataclass
class Layout:
    """One case: the source and destination caches, the calls, and what each destination
    block must hold (a function of the source caches, by named dims)."""

    name: str
    src_shape: tuple[int, ...]
    dst_shape: tuple[int, ...]
    #: (destination block, source block, destination part, source part) per call.
    calls: list[tuple[int, int, BlockPart | None, BlockPart | None]]
    #: (source region, destination block) -> what that destination block must hold.
    expect: Callable[[np.ndarray, int], np.ndarray]


def _tp_1_to_2(rank: int) -> Layout:
    # HND [block, head, token, dim]: the prefill has 4 heads, this decode rank holds 2.
    return Layout(f"tp1to2-rank{rank}", (6, 4, 16, DIM), (6, 2, 16, DIM),
                  [(0, 3, None, BlockPart(rank, 2)), (1, 5, None, BlockPart(rank, 2))],
                  lambda src, d: src[{0: 3, 1: 5}[d], 2 * rank:2 * rank + 2, :, :])


def _tp_1_to_2_joint_page(rank: int) -> Layout:
    # [block, kv, head, token, dim]: K and V of a block in one page; half of the heads of both.
    return Layout(f"tp1to2-joint-kv-rank{rank}", (6, 2, 4, 16, DIM), (6, 2, 2, 16, DIM),
                  [(2, 4, None, BlockPart(rank, 2, groups=2))],
                  lambda src, d: src[4, :, 2 * rank:2 * rank + 2, :, :])


def _tp_2_to_1(rank: int) -> Layout:
    # The decode (4 heads) gathers prefill rank `rank`'s 2 heads into its half of the heads.
    return Layout(f"tp2to1-from-rank{rank}", (6, 2, 16, DIM), (6, 4, 16, DIM),
                  [(1, 2, BlockPart(rank, 2), None)], lambda src, d: src[2])


def _block_16_to_32_nhd() -> Layout:
    # NHD [block, token, head, dim]: decode block 1 holds prefill blocks 4 and 2, in that order.
    return Layout("blocks16to32-nhd", (6, 16, 2, DIM), (6, 32, 2, DIM),
                  [(1, 4, BlockPart(0, 2), None), (1, 2, BlockPart(1, 2), None)],
                  lambda src, d: np.concatenate([src[4], src[2]], axis=0))


def _block_16_to_32_hnd() -> Layout:
    # HND [block, head, token, dim]: each head row holds 32 tokens, 16 from each prefill block.
    heads = 2
    return Layout("blocks16to32-hnd", (6, heads, 16, DIM), (6, heads, 32, DIM),
                  [(3, 0, BlockPart(0, 2, groups=heads), None),
                   (3, 5, BlockPart(1, 2, groups=heads), None)],
                  lambda src, d: np.concatenate([src[0], src[5]], axis=1))


LAYOUTS = [_tp_1_to_2(0), _tp_1_to_2(1), _tp_1_to_2_joint_page(1), _tp_2_to_1(0), _tp_2_to_1(1),
           _block_16_to_32_nhd(), _block_16_to_32_hnd()]


def _check_layout(layout: Layout, src: list[np.ndarray], dst: list[np.ndarray]) -> None:
    for d in sorted({c[0] for c in layout.calls}):
        for r in range(len(src)):
            want = layout.expect(src[r], d)
            got = dst[r][d]
            if layout.name.startswith("tp2to1"):  # only the half this rank wrote is checked
                rank = int(layout.name[-1])
                got = got[2 * rank:2 * rank + 2]
            assert_equal(got, want, f"{layout.name}: region {r}, destination block {d}")
    untouched = [b for b in range(dst[0].shape[0]) if b not in {c[0] for c in layout.calls}]
    assert all(not region[untouched].any() for region in dst), "bytes landed outside the parts"


@pytest.mark.parametrize("op", ["read", "write"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=[layout.name for layout in LAYOUTS])
async def test_parts_land_where_the_layout_says(layout: Layout, op: str) -> None:
    """A read by the destination engine and a write by the source engine move the same
    bytes: the selected bytes of each source block, in order, into the selected bytes of
    the destination block."""
    src, dst = kv(layout.src_shape, seed=7), kv(layout.dst_shape, seed=None)
    async with engine_pair(src, dst, GET) as (src_engine, dst_engine, peer):
        assert peer.bytes_per_block == (src[0][0].nbytes,) * 2
        if op == "read":
            for d, s, dpart, spart in layout.calls:
                result = await dst_engine.transfer_blocks(peer, [d], [s], "read",
                                                          local_part=dpart, remote_part=spart)
                assert result.blocks == 1 and result.nbytes == dst[0][0].nbytes * 2 // (
                    1 if dpart is None else dpart.count)
        else:
            back = src_engine.peers[dst_engine.name]  # the destination, as the source sees it
            for d, s, dpart, spart in layout.calls:
                await src_engine.transfer_blocks(back, [s], [d], "write",
                                                 local_part=spart, remote_part=dpart)
        _check_layout(layout, src, dst)


async def test_several_blocks_in_one_call_pair_up_in_order() -> None:
    src, dst = kv((8, 4, 16, DIM), seed=3), kv((8, 2, 16, DIM), seed=None)
    async with engine_pair(src, dst, GET) as (_, dst_engine, peer):
        result = await dst_engine.transfer_blocks(peer, np.array([5, 0, 2]), (7, 1, 4),
                                                  remote_part=BlockPart(1, 2))
        assert result.blocks == 3 and result.nbytes == 3 * 2 * dst[0][0].nbytes
        assert result.descriptors == 3 * 2
        for r in range(2):
            for d, s in [(5, 7), (0, 1), (2, 4)]:
                assert_equal(dst[r][d], src[r][s, 2:4], f"region {r}, block {d}")


async def test_a_whole_block_and_a_part_of_equal_size_move_between_equal_engines() -> None:
    """Parts work between engines of one geometry too (here: swapping the halves of heads),
    and whole-block transfers keep their own path beside them."""
    src, dst = kv((4, 4, 16, DIM), seed=5), kv((4, 4, 16, DIM), seed=None)
    async with engine_pair(src, dst, GET) as (_, dst_engine, peer):
        await dst_engine.transfer_blocks(peer, [0], [1], local_part=BlockPart(0, 2),
                                         remote_part=BlockPart(1, 2))
        await dst_engine.transfer_blocks(peer, [2], [3])
        for r in range(2):
            assert_equal(dst[r][0, :2], src[r][1, 2:], f"region {r}: the swapped halves")
            assert not dst[r][0, 2:].any()
            assert_equal(dst[r][2], src[r][3], f"region {r}: the whole block")


# ---- many at once, push mode ---------------------------------------------------------------


async def test_sixty_four_concurrent_part_reads_and_whole_block_reads_all_land() -> None:
    """64 callers read head slices at once (each a block of its own) while 32 others read
    whole blocks from a peer of equal geometry: every byte in place, and the whole-block
    callers still merge into shared requests."""
    tp_src, tp_dst = kv((64, 4, 16, DIM), seed=11), kv((64, 2, 16, DIM), seed=None)
    eq_src, eq_dst = kv((32, 2, 16, DIM), seed=12, regions=1), kv((32, 2, 16, DIM), None, 1)
    async with engine_pair(tp_src, tp_dst, GET) as (_, tp_engine, tp_peer), \
            engine_pair(eq_src, eq_dst, GET) as (_, eq_engine, eq_peer):

        async def part(block: int) -> None:
            await tp_engine.transfer_blocks(tp_peer, [block], [63 - block],
                                            remote_part=BlockPart(block % 2, 2))

        async def whole(block: int) -> None:
            await eq_engine.transfer_blocks(eq_peer, [block], [31 - block])

        async with anyio.create_task_group() as tg:
            for b in range(64):
                tg.start_soon(part, b)
                if b < 32:
                    tg.start_soon(whole, b)
        for r in range(2):
            for b in range(64):
                half = b % 2
                assert_equal(tp_dst[r][b], tp_src[r][63 - b, 2 * half:2 * half + 2], f"region {r}, block {b}")
        for b in range(32):
            assert_equal(eq_dst[0][b], eq_src[0][31 - b], f"whole block {b}")
        assert tp_engine.metrics().transfers["read"]["ok"] == 64
        assert tp_engine.metrics().transferred_bytes["read"] == 64 * tp_dst[0][0].nbytes * 2
        assert eq_engine.metrics().merged_calls > 0


async def test_push_reads_of_parts_move_the_same_bytes_as_gets() -> None:
    """read_mode="push": the serving engine plans the same split from its side and writes
    the parts; the destination's other bytes stay untouched."""
    layouts = [_tp_1_to_2(1), _block_16_to_32_hnd(), _tp_2_to_1(1)]
    for layout in layouts:
        src, dst = kv(layout.src_shape, seed=21), kv(layout.dst_shape, seed=None)
        async with engine_pair(src, dst, PUSH) as (src_engine, dst_engine, peer):
            assert peer.read_mode == "push"
            for n, (d, s, dpart, spart) in enumerate(layout.calls):
                await dst_engine.transfer_blocks(peer, [d], [s], local_part=dpart, remote_part=spart,
                                                 notify=b"parts-%d" % n)
            for n in range(len(layout.calls)):  # delivered once the server counted its push
                await src_engine.wait_notification(b"parts-%d" % n, timeout=10)
            assert src_engine.metrics().pushes_served == len(layout.calls)
            _check_layout(layout, src, dst)


async def test_the_push_server_checks_parts_itself() -> None:
    """A request the reader did not check (sent as a peer could) is refused by the server
    with a TransferError, nothing written."""
    src, dst = kv((4, 4, 16, DIM), seed=1), kv((4, 2, 16, DIM), seed=None)
    async with engine_pair(src, dst, PUSH) as (src_engine, dst_engine, peer):
        with pytest.raises(aionixl.TransferError, match="does not divide"):
            await dst_engine._push.read(peer, np.array([0], np.int32), np.array([0], np.int32), 1,
                                        b"", 5.0, (None, BlockPart(0, 3)))
        with pytest.raises(aionixl.TransferError, match="whole blocks cannot be pushed"):
            await dst_engine._push.read(peer, np.array([0], np.int32), np.array([0], np.int32), 1,
                                        b"", 5.0)
        assert src_engine.metrics().pushes_refused == 2 and not dst[0].any() and not dst[1].any()


# ---- refusals --------------------------------------------------------------------------------


async def test_a_bad_part_is_refused_before_anything_is_posted() -> None:
    src, dst = kv((4, 4, 16, DIM), seed=1), kv((4, 2, 16, DIM), seed=None)
    for config in (GET, PUSH):
        async with engine_pair(src, dst, config) as (src_engine, dst_engine, peer):
            before = dst_engine.live_resources()
            bad: list[tuple[dict[str, Any], str]] = [
                ({}, r"region 0: local_part \(the whole block\) selects 512 bytes of each 512-byte "
                     r"local block, but remote_part \(the whole block\) selects 1024 bytes"),
                ({"remote_part": BlockPart(0, 3)}, "region 0, remote_part: a block of 1024 bytes does "
                                                   "not divide"),
                ({"remote_part": BlockPart(0, 4)}, "selects 256 bytes of each 1024-byte remote block"),
                ({"local_part": (0, 2)}, "local_part must be an aionixl.BlockPart"),
            ]
            for op in ("read", "write"):
                for kwargs, message in bad:
                    with pytest.raises(ValueError, match=message):
                        await dst_engine.transfer_blocks(peer, [0], [0], op, **kwargs)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="index must be in"):
                BlockPart(2, 2)
            with pytest.raises(ValueError, match="names the same block more than once"):
                await dst_engine.transfer_blocks(peer, [1, 1], [0, 2], remote_part=BlockPart(0, 2))
            assert dst_engine.live_resources() == before  # no descriptor list, nothing in flight
            transfers = dst_engine.metrics().transfers
            assert all(n == 0 for outcomes in transfers.values() for n in outcomes.values()), transfers
            assert src_engine.metrics().pushes_served == 0
            assert not dst[0].any() and not dst[1].any()


async def test_bad_ids_are_refused_as_for_whole_blocks_in_every_form() -> None:
    """Ids of a part transfer are checked as whole blocks' are (short lists in plain Python,
    anything else with numpy): the same error for each bad call, given as a list, a tuple
    or an array; valid ids in each form, short or long, land where they say."""
    src, dst = kv((80, 4, 2, DIM), seed=2), kv((80, 4, 2, DIM), seed=None)
    part = BlockPart(1, 2)
    async with engine_pair(src, dst, GET) as (_, dst_engine, peer):
        bad: list[tuple[Any, Any, str]] = [
            ([80], [0], "read"), ([0], [-1], "read"), ([0], [80], "write"), ([1, 1], [0, 2], "read"),
            ([0, 2], [1, 1], "write"), ([1, 1], [0, 2], "write-ok"), ([0, 1], [0], "read"), ([], [], "read"),
            ([True], [0], "read"), ([0.0], [0], "read"), ([*range(70), 3], list(range(71)), "read"),
            (list(range(75)), [*range(74), 99], "read"), ([2**70], [0], "read"),
        ]
        for local, remote, op in bad:
            if op == "write-ok":  # duplicates in the source of a write are fine
                await dst_engine.transfer_blocks(peer, local, remote, "write", local_part=part,
                                                 remote_part=part)
                continue
            for form in (list, tuple, np.array):
                if form is np.array and local and (type(local[0]) is float or local[0] == 2**70):
                    continue  # not an integer array
                mine, theirs = form(local), form(remote)
                with pytest.raises(ValueError) as whole:
                    await dst_engine.transfer_blocks(peer, mine, theirs, op)
                with pytest.raises(ValueError) as parts:
                    await dst_engine.transfer_blocks(peer, mine, theirs, op, local_part=part,
                                                     remote_part=part)
                assert str(parts.value) == str(whole.value), (local, remote, op, form)
        assert dst_engine.metrics().transfers["read"]["ok"] == 0
        calls = [([5], [6]), ((7,), (8,)), (np.array([9, 10]), np.array([11, 12], np.int64)),
                 (range(13, 16), range(20, 23)), (list(range(30, 100 - 20)), list(range(0, 50)))]
        for local, remote in calls:
            await dst_engine.transfer_blocks(peer, local, remote, local_part=part, remote_part=part)
            for r in range(2):
                for d, s in zip(list(local), list(remote), strict=True):
                    assert_equal(dst[r][d, 2:], src[r][s, 2:], f"region {r}, block {d}")
                    assert not dst[r][d, :2].any()
        m = dst_engine.metrics()
        assert m.transfers["read"]["ok"] == len(calls)
        assert m.transferred_bytes["read"] == (1 + 1 + 2 + 3 + 50) * 2 * dst[0][0].nbytes // 2


async def test_engines_with_other_block_sizes_connect_and_show_the_peer_sizes() -> None:
    src, dst = kv((4, 4, 16, DIM), seed=1), kv((9, 2, 16, DIM), seed=None)
    async with engine_pair(src, dst) as (src_engine, dst_engine, peer):
        assert peer.bytes_per_block == (1024, 1024) and peer.num_blocks == 4
        assert src_engine.peers[dst_engine.name].bytes_per_block == (512, 512)


async def test_part_lists_are_released_with_the_peer_and_at_close() -> None:
    src, dst = kv((4, 4, 16, DIM), seed=1), kv((4, 2, 16, DIM), seed=None)
    async with engine_pair(src, dst, GET) as (_, dst_engine, peer):
        base = dst_engine.live_resources()["dlists"]
        for rank in (0, 1):
            for _ in range(3):  # prepared once per pair of parts, then reused
                await dst_engine.transfer_blocks(peer, [0], [1], remote_part=BlockPart(rank, 2))
        assert dst_engine.live_resources()["dlists"] == base + 4
        await dst_engine.disconnect(peer)
        # ... and the peer's own lists: its blocks' and its staging slots'
        assert dst_engine.live_resources()["dlists"] == base - 2
    assert_no_resources(dst_engine)


# ---- engines in other processes ------------------------------------------------------------

HEADS, TOKENS = 4, 16


@pytest.mark.parametrize("config", [GET, PUSH], ids=["get", "push"])
async def test_a_decode_rank_reads_and_writes_head_slices_of_an_engine_in_another_process(
        config: aionixl.EngineConfig) -> None:
    """TP 1 -> 2 across processes: our engine holds 2 of the remote engine's 4 heads (HND,
    K and V as two regions). It reads rank 1's half of the heads, writes its own heads into
    rank 0's half of another remote block, and reads that back, every element checked."""
    async with RemoteEngine(seed=99, num_blocks=8, block_shape=(HEADS, TOKENS, DIM),
                            dtypes=("float16", "float16")) as remote:
        ours = kv((8, HEADS // 2, TOKENS, DIM), seed=None)
        async with aionixl.Engine(unique("decode"), ours, listen=None, config=config) as engine:
            peer = await engine.connect(remote.address, timeout=30)
            assert peer.read_mode == ("push" if config is PUSH else "get")
            theirs = [t.numpy() for t in remote.expected()]
            await engine.transfer_blocks(peer, [0, 1], [6, 2], remote_part=BlockPart(1, 2))
            for r in range(2):
                assert_equal(ours[r][0], theirs[r][6, 2:4], f"region {r}, block 6's heads 2-3")
                assert_equal(ours[r][1], theirs[r][2, 2:4], f"region {r}, block 2's heads 2-3")
            # Write our block 0 into heads 0-1 of remote block 5, read all of block 5 back
            # as two halves: heads 0-1 are ours, heads 2-3 are still the remote's own.
            await engine.transfer_blocks(peer, [0], [5], "write", remote_part=BlockPart(0, 2))
            await engine.transfer_blocks(peer, [2], [5], remote_part=BlockPart(0, 2))
            await engine.transfer_blocks(peer, [3], [5], remote_part=BlockPart(1, 2))
            for r in range(2):
                assert_equal(ours[r][2], ours[r][0], f"region {r}: the heads written")
                assert_equal(ours[r][3], theirs[r][5, 2:4], f"region {r}: the heads left alone")
            await engine.disconnect(peer)
        assert_no_resources(engine)
        assert all(v == 0 for k, v in (await remote.live_resources()).items()
                   if k in ("transfer_handles", "in_flight")), await remote.live_resources()


async def test_a_timed_out_part_push_read_from_a_stopped_server_fails_like_a_whole_block_read() -> None:
    """Deadlines hold for parts as for whole blocks: a push read from a paused server times
    out with TransferTimeoutError and leaves no transfer behind."""
    async with RemoteEngine(seed=5, num_blocks=4, block_shape=(HEADS, TOKENS, DIM),
                            dtypes=("float16",)) as remote:
        ours = kv((4, HEADS // 2, TOKENS, DIM), seed=None, regions=1)
        config = aionixl.EngineConfig(read_mode="push")
        tuning = aionixl.lowlevel.Tuning(push_cancel_timeout=0.3)
        async with aionixl.Engine(unique("decode"), ours, listen=None, config=config,
                                  tuning=tuning) as engine:
            peer = await engine.connect(remote.address, timeout=30)
            async with remote.paused():
                with pytest.raises(aionixl.TransferTimeoutError):
                    await engine.transfer_blocks(peer, [0], [1], remote_part=BlockPart(0, 2),
                                                 timeout=0.2)
            assert engine.live_resources()["in_flight"] == 0
            assert engine.metrics().transfers["read"]["timeout"] == 1
        assert_no_resources(engine)
