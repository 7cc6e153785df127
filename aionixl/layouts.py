"""The block parts that real fleets' layouts need, worked out once (:class:`aionixl.BlockPart`).

``transfer_blocks(..., local_part=, remote_part=)`` moves any equal-sized selection of
bytes; these helpers say which selection a common layout difference needs, so a server
does not redo the head and token arithmetic. Every helper is pure: it takes sizes and
returns parts, and raises ``ValueError`` for sizes that have no such form.

Terms. A block holds ``kv_groups`` equal groups (2 when K and V share one page, e.g. vLLM's
``LBHNC``; 1 when they are regions of their own), each laid out **head-major** (``"HND"``:
``[heads, tokens, dim]``) or **token-major** (``"NHD"``: ``[tokens, heads, dim]``).
A TP rank holds ``kv_heads // tp`` of the model's KV heads (rank ``r`` the ``r``-th slice);
where ``tp > kv_heads`` each head is replicated on ``tp // kv_heads`` consecutive ranks.

Tensor parallelism (a decode rank reads its heads from the prefill ranks holding them)::

    for read in aionixl.layouts.tp_reads(prefill_tp=1, decode_tp=2, decode_rank=rank,
                                         kv_heads=8, layout="HND", kv_groups=2):
        peer = prefill_peers[read.remote_rank]
        await engine.transfer_blocks(peer, local_ids, remote_ids,
                                     local_part=read.local_part, remote_part=read.remote_part)

MLA (the latent KV is replicated on every rank): :func:`mla_reads`, whole blocks from one
rank. A smaller prefill block size (each decode block gathers several prefill blocks)::

    for read in aionixl.layouts.block_size_reads(local_ids, remote_ids, prefill_block_size=16,
                                                 decode_block_size=32, layout="NHD", heads=8):
        await engine.transfer_blocks(peer, read.local_blocks, read.remote_blocks,
                                     local_part=read.local_part)
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from ._checks import _shown, check_int
from ._parts import BlockPart

Layout = Literal["HND", "NHD"]

__all__ = ["BlockRead", "Layout", "RankRead", "block_size_reads", "heads_of_rank", "mla_reads", "tp_reads"]


@dataclass(frozen=True, slots=True)
class RankRead:
    """One read of a decode rank: whole blocks' ``remote_part`` of prefill rank
    ``remote_rank`` into their ``local_part`` (None: the whole block)."""

    remote_rank: int
    remote_part: BlockPart | None
    local_part: BlockPart | None


@dataclass(frozen=True, slots=True)
class BlockRead:
    """One ``transfer_blocks`` call of a block-size change: ``remote_blocks[i]`` lands in
    ``local_part`` of ``local_blocks[i]``."""

    local_blocks: list[int]
    remote_blocks: list[int]
    local_part: BlockPart


def _positive(value: object, what: str) -> int:
    return check_int(value, what, 1)


def _block_ids(values: Iterable[object], what: str) -> list[int]:
    """``values`` as ints; ``ValueError`` for one that is not an integer (block 0.7 is not
    block 0)."""
    ids = []
    for value in values:
        try:
            if isinstance(value, bool):
                raise TypeError
            ids.append(operator.index(value))  # type: ignore[arg-type]
        except TypeError:
            raise ValueError(f"{what} must hold integer block ids, got {_shown(value)}") from None
    return ids


def heads_of_rank(tp: int, rank: int, kv_heads: int) -> range:
    """The KV heads TP rank ``rank`` of ``tp`` holds (vLLM's split; replicated when
    ``tp > kv_heads``)."""
    _positive(tp, "tp")
    _positive(kv_heads, "kv_heads")
    if type(rank) is not int or not 0 <= rank < tp:
        raise ValueError(f"rank must be an int in [0, {tp}), got {rank!r}")
    if tp <= kv_heads:
        if kv_heads % tp:
            raise ValueError(f"{kv_heads} KV heads do not split evenly over TP {tp}")
        per = kv_heads // tp
        return range(rank * per, (rank + 1) * per)
    if tp % kv_heads:
        raise ValueError(f"TP {tp} is not a multiple of the {kv_heads} KV heads it replicates")
    head = rank // (tp // kv_heads)
    return range(head, head + 1)


def _heads_part(held: range, wanted: range, layout: Layout, kv_groups: int,
                block_size: int | None) -> BlockPart | None:
    """The part of a block holding heads ``held`` that is heads ``wanted`` (a sub-range)."""
    n, size = len(held), len(wanted)
    if size == n:
        return None
    offset = wanted.start - held.start
    if n % size or offset % size:  # TP sizes where neither divides the other
        raise ValueError(f"heads {wanted.start}..{wanted.stop - 1} are not an equal part of heads "
                         f"{held.start}..{held.stop - 1}, which one rank holds: no BlockPart selects "
                         "them (use TP sizes where one divides the other)")
    groups = kv_groups if layout == "HND" else kv_groups * (block_size or 1)
    return BlockPart(offset // size, n // size, groups=groups)


def _check_layout(layout: object, kv_groups: object) -> None:
    if layout not in ("HND", "NHD"):
        raise ValueError(f"layout must be 'HND' (head-major) or 'NHD' (token-major), got {layout!r}")
    _positive(kv_groups, "kv_groups")


def tp_reads(prefill_tp: int, decode_tp: int, decode_rank: int, *, kv_heads: int,
             layout: Layout = "HND", kv_groups: int = 1, block_size: int | None = None) -> list[RankRead]:
    """The reads that give decode rank ``decode_rank`` (of ``decode_tp``) its heads from a
    prefill at ``prefill_tp``: one per prefill rank holding some of them (of replicated
    heads, the first rank holding them), each a head slice of the prefill's block into a
    head slice of ours. ``block_size`` (tokens per block) is needed for ``"NHD"`` only,
    where a head slice is one piece of every token row."""
    _check_layout(layout, kv_groups)
    if layout == "NHD":
        block_size = _positive(block_size, "block_size (tokens per block, for 'NHD')")
    mine = heads_of_rank(decode_tp, decode_rank, kv_heads)
    reads: list[RankRead] = []
    covered: set[int] = set()
    for rank in range(_positive(prefill_tp, "prefill_tp")):
        theirs = heads_of_rank(prefill_tp, rank, kv_heads)
        common = range(max(mine.start, theirs.start), min(mine.stop, theirs.stop))
        if not common or common.start in covered:
            continue  # none of ours, or replicated heads another rank already gives us
        covered.update(common)
        reads.append(RankRead(rank, _heads_part(theirs, common, layout, kv_groups, block_size),
                              _heads_part(mine, common, layout, kv_groups, block_size)))
    return reads


def mla_reads(prefill_tp: int, decode_rank: int) -> list[RankRead]:
    """MLA: every rank holds the whole latent KV, so a decode rank reads whole blocks from
    one prefill rank (spread over them: ``decode_rank % prefill_tp``)."""
    _positive(prefill_tp, "prefill_tp")
    check_int(decode_rank, "decode_rank", 0)
    return [RankRead(decode_rank % prefill_tp, None, None)]


def block_size_reads(local_blocks: Sequence[int], remote_blocks: Sequence[int], *, prefill_block_size: int,
                     decode_block_size: int, layout: Layout, heads: int = 1,
                     kv_groups: int = 1) -> list[BlockRead]:
    """A prefill with smaller blocks: decode block ``local_blocks[i]`` gathers prefill
    blocks ``remote_blocks[i*r : (i+1)*r]`` (``r = decode_block_size // prefill_block_size``,
    the last one possibly fewer), prefill block ``j`` of each into token slice ``j``. One
    call per slice. ``heads``: the KV heads a block holds (``"HND"`` only: each head row is
    cut)."""
    _check_layout(layout, kv_groups)
    small, big = _positive(prefill_block_size, "prefill_block_size"), _positive(decode_block_size,
                                                                                "decode_block_size")
    if big % small or big == small:
        raise ValueError(f"decode_block_size {big} must be a multiple (> 1x) of prefill_block_size {small}")
    ratio = big // small
    mine, theirs = _block_ids(local_blocks, "local_blocks"), _block_ids(remote_blocks, "remote_blocks")
    if not theirs or -(-len(theirs) // ratio) != len(mine):
        raise ValueError(f"{len(theirs)} prefill blocks fill {-(-len(theirs) // ratio)} decode blocks of "
                         f"{ratio}, not {len(mine)}")
    groups = kv_groups if layout == "NHD" else kv_groups * _positive(heads, "heads")
    reads = []
    for j in range(ratio):
        remote = theirs[j::ratio]
        if remote:
            reads.append(BlockRead(mine[:len(remote)], remote, BlockPart(j, ratio, groups=groups)))
    return reads
