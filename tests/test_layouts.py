"""``aionixl.layouts``: the parts real layout differences need, checked element by element.

Each case builds the model's KV of one block as a named array ``[kv, head, token, dim]``
whose every element says which (kv, head, token, dim) it is, lays it out as each side's
ranks hold it (HND or NHD, a TP rank's heads, a block size's tokens), applies the reads the
helper returns with the semantics of ``transfer_blocks`` parts (the selected bytes of the
source block, in increasing offset, land in the selected bytes of the destination block,
in increasing offset: :func:`apply`, written from that sentence alone), and compares with
how the reading rank must hold it. The same reads move real blocks between real engines in
``test_layouts_engines``.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from aionixl import BlockPart
from aionixl.layouts import block_size_reads, heads_of_rank, mla_reads, tp_reads

KV_HEADS, TOKENS, DIM = 8, 4, 2


def model_block(tokens: int = TOKENS, kv: int = 2) -> np.ndarray:
    """[kv, head, token, dim]: every element a distinct number naming its position."""
    k, h, t, d = np.meshgrid(np.arange(kv), np.arange(KV_HEADS), np.arange(tokens), np.arange(DIM),
                             indexing="ij")
    return (k * 1_000_000 + h * 10_000 + t * 100 + d).astype(np.int64)


def held(block: np.ndarray, heads: range, layout: str, kv_groups: int) -> np.ndarray:
    """The bytes of one block as a rank holding ``heads`` stores it (a flat int64 row).
    ``kv_groups=2``: K and V in one page; 1: this is one of the two regions (K)."""
    part = block[:kv_groups, heads.start:heads.stop]  # [kv, head, token, dim]
    if layout == "NHD":
        part = part.transpose(0, 2, 1, 3)  # [kv, token, head, dim]
    return np.ascontiguousarray(part).reshape(-1)


def selection(part: BlockPart | None, n: int) -> np.ndarray:
    """Indices of the elements ``part`` selects in a block of ``n`` elements, in order."""
    if part is None:
        return np.arange(n)
    assert n % (part.groups * part.count) == 0
    group, size = n // part.groups, n // (part.groups * part.count)
    return np.concatenate([np.arange(g * group + part.index * size, g * group + (part.index + 1) * size)
                           for g in range(part.groups)])


def apply(dst: np.ndarray, dst_part: BlockPart | None, src: np.ndarray, src_part: BlockPart | None) -> None:
    to, frm = selection(dst_part, dst.size), selection(src_part, src.size)
    assert to.size == frm.size, "the two selections must have the same size"
    dst[to] = src[frm]


TP_CASES = [(1, 2), (2, 1), (2, 4), (4, 2), (1, 8), (8, 1), (2, 8), (8, 2), (4, 4), (16, 2), (2, 16)]


@pytest.mark.parametrize(("prefill_tp", "decode_tp"), TP_CASES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kv_groups", [1, 2])
def test_every_decode_rank_ends_up_holding_exactly_its_heads(prefill_tp: int, decode_tp: int, layout: str,
                                                             kv_groups: int) -> None:
    block = model_block()
    prefill = [held(block, heads_of_rank(prefill_tp, r, KV_HEADS), layout, kv_groups)
               for r in range(prefill_tp)]
    for rank in range(decode_tp):
        want = held(block, heads_of_rank(decode_tp, rank, KV_HEADS), layout, kv_groups)
        got = np.full_like(want, -1)
        reads = tp_reads(prefill_tp, decode_tp, rank, kv_heads=KV_HEADS, layout=layout,  # type: ignore[arg-type]
                         kv_groups=kv_groups, block_size=TOKENS)
        for read in reads:
            apply(got, read.local_part, prefill[read.remote_rank], read.remote_part)
        np.testing.assert_array_equal(got, want)
        assert len(reads) == max(1, min(prefill_tp, KV_HEADS) // min(decode_tp, KV_HEADS))


def test_one_to_two_reads_half_of_each_page_and_two_to_one_fills_halves() -> None:
    assert tp_reads(1, 2, 1, kv_heads=8, kv_groups=2) == [
        type(tp_reads(1, 1, 0, kv_heads=8)[0])(0, BlockPart(1, 2, groups=2), None)]
    halves = tp_reads(2, 1, 0, kv_heads=8)
    assert [(r.remote_rank, r.remote_part, r.local_part) for r in halves] == [
        (0, None, BlockPart(0, 2)), (1, None, BlockPart(1, 2))]
    assert tp_reads(4, 4, 3, kv_heads=8)[0].remote_part is None  # equal TP: whole blocks


def test_heads_split_as_vllm_splits_them() -> None:
    assert [heads_of_rank(4, r, 8) for r in range(4)] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert [heads_of_rank(8, r, 2).start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]  # replicated


@pytest.mark.parametrize(("small", "big"), [(16, 32), (16, 64), (8, 32)])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("kv_groups", [1, 2])
def test_a_decode_block_gathers_the_prefill_blocks_of_its_tokens(small: int, big: int, layout: str,
                                                                  kv_groups: int) -> None:
    ratio, prompt_blocks = big // small, 7  # 7 prefill blocks: the last decode block partly filled
    prompt = model_block(tokens=small * prompt_blocks)  # the prompt's KV, [kv, head, token, dim]
    heads = range(KV_HEADS)
    prefill = {100 + j: held(prompt[:, :, j * small:(j + 1) * small], heads, layout, kv_groups)
               for j in range(prompt_blocks)}
    n_decode = -(-prompt_blocks // ratio)
    decode = {10 + i: np.full(prefill[100].size * ratio, -1, dtype=np.int64) for i in range(n_decode)}
    reads = block_size_reads(list(decode), list(prefill), prefill_block_size=small, decode_block_size=big,
                             layout=layout, heads=KV_HEADS, kv_groups=kv_groups)  # type: ignore[arg-type]
    for read in reads:
        for dst, src in zip(read.local_blocks, read.remote_blocks, strict=True):
            apply(decode[dst], read.local_part, prefill[src], None)
    for i, dst in enumerate(decode):
        tokens = prompt[:, :, i * big:(i + 1) * big]
        filled = tokens.shape[2]
        want = np.full((2, KV_HEADS, big, DIM), -1, dtype=np.int64)
        want[:, :, :filled] = tokens
        np.testing.assert_array_equal(decode[dst], held(want, heads, layout, kv_groups))


def test_mla_reads_whole_blocks_spread_over_the_prefill_ranks() -> None:
    assert [(r.remote_rank, r.remote_part, r.local_part) for d in range(4) for r in mla_reads(2, d)] == [
        (0, None, None), (1, None, None), (0, None, None), (1, None, None)]


@pytest.mark.parametrize("call", [
    lambda: tp_reads(3, 2, 0, kv_heads=8),  # 8 heads over TP 3
    lambda: tp_reads(1, 2, 2, kv_heads=8),  # no rank 2 at TP 2
    lambda: tp_reads(1, 2, 0, kv_heads=8, layout="NHD"),  # NHD needs the block size
    lambda: tp_reads(1, 2, 0, kv_heads=8, layout="LBHNC"),  # type: ignore[arg-type]
    lambda: tp_reads(1, 16, 0, kv_heads=6),  # 16 does not replicate 6 heads evenly
    lambda: tp_reads(2, 3, 0, kv_heads=6),  # 2 of a prefill rank's 3 heads: no equal part
    lambda: tp_reads(3, 2, 0, kv_heads=12),  # 4 of a decode rank's 6 heads: no equal part
    lambda: mla_reads(0, 0),
    lambda: block_size_reads([0], [1, 2], prefill_block_size=16, decode_block_size=24, layout="NHD"),
    lambda: block_size_reads([0], [1, 2, 3], prefill_block_size=16, decode_block_size=32, layout="NHD"),
    lambda: block_size_reads([0], [1], prefill_block_size=16, decode_block_size=16, layout="HND"),
    lambda: block_size_reads([0.7], [1, 2], prefill_block_size=16, decode_block_size=32, layout="NHD"),
    lambda: block_size_reads([0], [1, "2"], prefill_block_size=16, decode_block_size=32, layout="NHD"),
    lambda: block_size_reads([0], [1, True], prefill_block_size=16, decode_block_size=32, layout="NHD"),
])
def test_sizes_with_no_such_form_are_value_errors(call: object) -> None:
    with pytest.raises(ValueError):
        call()  # type: ignore[operator]


def test_tp_reads_select_as_many_heads_on_both_sides_or_refuse() -> None:
    for p, d, heads in itertools.product(range(1, 9), range(1, 9), range(1, 17)):
        for rank in range(d):
            try:
                reads = tp_reads(p, d, rank, kv_heads=heads)
            except ValueError:
                continue
            mine = heads_of_rank(d, rank, heads)
            for r in reads:
                theirs = heads_of_rank(p, r.remote_rank, heads)
                remote = len(theirs) // (r.remote_part.count if r.remote_part else 1)
                local = len(mine) // (r.local_part.count if r.local_part else 1)
                assert remote == local, (p, d, heads, rank, r)


def test_every_part_a_helper_returns_divides_the_blocks_it_is_meant_for() -> None:
    for p, d, layout in itertools.product((1, 2, 4, 8), (1, 2, 4, 8), ("HND", "NHD")):
        for rank in range(d):
            for read in tp_reads(p, d, rank, kv_heads=KV_HEADS, layout=layout,  # type: ignore[arg-type]
                                 kv_groups=2, block_size=TOKENS):
                remote_bytes = 2 * (KV_HEADS // min(p, KV_HEADS)) * TOKENS * DIM * 2
                local_bytes = 2 * (KV_HEADS // min(d, KV_HEADS)) * TOKENS * DIM * 2
                a = (read.remote_part or BlockPart(0, 1)).runs(remote_bytes, "remote")
                b = (read.local_part or BlockPart(0, 1)).runs(local_bytes, "local")
                assert sum(n for _, n in a) == sum(n for _, n in b)
