"""Block parts: moving a selection of each block's bytes instead of the whole block.

Why: fleets rarely share one layout. A decode engine at twice the prefill's tensor
parallelism holds half of the heads, so it reads one half of every head row of the
prefill's blocks; a decode engine with twice the block size gathers two prefill blocks
into the two halves of one of its own. Both are the same operation: the selected bytes of
a block on one side, in increasing offset, land in the selected bytes of a block on the
other side, in increasing offset. :class:`BlockPart` names such a selection without
knowing the tensor's layout, so one primitive serves head slices (HND), token ranges (NHD),
joint K/V pages and whatever else can be cut into equal consecutive pieces.

Arithmetic on byte counts and numpy, no NIXL: :func:`plan_parts` checks
that two selections fit each other and splits both into segments at every boundary either
side needs (a :class:`PartPlan`); :func:`part_descriptors` and :class:`PartLists` turn a
plan into NIXL descriptor rows and descriptor indices. The NIXL lists themselves are
prepared and owned by the peer table (``aionixl._peers``), cached per peer and pair of
parts, and released with the peer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, overload

import numpy as np
import numpy.typing as npt

#: The most segments one block of one region may be cut into. It bounds the descriptor
#: lists a pair of parts makes an engine prepare by its own geometry (at most this many
#: descriptors per block and region, where whole blocks take one), also where a peer's push
#: request names the parts: real layouts need a segment per head or per token of a block
#: at most (a token-major block of 128 tokens cut by heads; a head-major one of 128 heads cut
#: by tokens). ~70 bytes per descriptor pass through memory while a list is prepared.
MAX_SEGMENTS = 128
_INT32_MAX = 2**31 - 1

#: (offset in the block, length) of each segment, in increasing offset.
Segments = tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class BlockPart:
    """A selection of every block's bytes, the same in every region.

    Each block is viewed as ``groups`` equal consecutive groups, each cut into ``count``
    equal consecutive parts; the part selects part ``index`` of every group. Examples, for
    an HND block ``[heads, tokens, dim]``: ``BlockPart(r, 2)`` is half of the heads (rank
    ``r`` of a TP ratio of 2); ``BlockPart(h, 2, groups=heads)`` is half of the tokens of
    every head row. With K and V in one page (``[2, heads, tokens, dim]``),
    ``BlockPart(r, 2, groups=2)`` is half of the heads of K and of V. A block whose size
    does not divide into ``groups * count`` is refused when a transfer uses the part.
    """

    index: int
    count: int
    groups: int = 1

    def __post_init__(self) -> None:
        for name in ("index", "count", "groups"):
            value = getattr(self, name)
            if type(value) is not int:
                raise ValueError(f"BlockPart.{name} must be an int, got {value!r}")
        if self.count < 1:
            raise ValueError(f"BlockPart.count must be >= 1, got {self.count}")
        if self.groups < 1:
            raise ValueError(f"BlockPart.groups must be >= 1, got {self.groups}")
        if not 0 <= self.index < self.count:
            raise ValueError(f"BlockPart.index must be in [0, {self.count}), got {self.index}")

    def runs(self, block_bytes: int, where: str) -> Segments:
        """The selected bytes of a block of ``block_bytes``, as maximal contiguous runs.
        ``ValueError`` (naming ``where``) when the block does not divide evenly."""
        pieces = self.groups * self.count
        if block_bytes % pieces:
            raise ValueError(f"{where}: a block of {block_bytes} bytes does not divide into "
                             f"{self.groups} group(s) x {self.count} part(s) ({self!r})")
        if self.count == 1:
            return ((0, block_bytes),)
        group, size = block_bytes // self.groups, block_bytes // pieces
        return tuple((g * group + self.index * size, size) for g in range(self.groups))

    def as_tuple(self) -> tuple[int, int, int]:
        return (self.index, self.count, self.groups)


def _selection(part: BlockPart | None, block_bytes: int, where: str) -> Segments:
    return ((0, block_bytes),) if part is None else part.runs(block_bytes, where)


def _describe(part: BlockPart | None) -> str:
    return "the whole block" if part is None else repr(part)


@dataclass(frozen=True, slots=True)
class PartPlan:
    """Two selections that fit each other, split at every boundary either side needs.

    ``local[r]`` and ``remote[r]`` are region ``r``'s segments on each side: the same
    number, pairwise of the same length, so segment ``i`` of a local block and segment
    ``i`` of a remote block are the two ends of one descriptor pair. ``nbytes`` is what
    one pair of blocks moves, over all regions.
    """

    local: tuple[Segments, ...]
    remote: tuple[Segments, ...]
    nbytes: int

    @property
    def per_block(self) -> int:
        """Descriptors per pair of blocks, over all regions."""
        return sum(len(s) for s in self.local)


def plan_parts(local_bytes: Sequence[int], local_part: BlockPart | None,
               remote_bytes: Sequence[int], remote_part: BlockPart | None) -> PartPlan:
    """Check that the parts select as many bytes of each region's blocks on both sides and
    split both selections into matching segments; ``ValueError`` naming the region and
    the sizes otherwise. ``None`` is the whole block."""
    if len(local_bytes) != len(remote_bytes):
        raise ValueError(f"the engines have {len(local_bytes)} and {len(remote_bytes)} regions")
    local: list[Segments] = []
    remote: list[Segments] = []
    total = 0
    done: dict[tuple[int, int], tuple[Segments, Segments, int]] = {}  # regions mostly share sizes
    for r, (mine, theirs) in enumerate(zip(local_bytes, remote_bytes, strict=True)):
        known = done.get((mine, theirs))
        if known is not None:
            local.append(known[0])
            remote.append(known[1])
            total += known[2]
            continue
        ours_sel = _selection(local_part, mine, f"region {r}, local_part")
        theirs_sel = _selection(remote_part, theirs, f"region {r}, remote_part")
        selected = sum(n for _, n in ours_sel)
        if selected != sum(n for _, n in theirs_sel):
            raise ValueError(
                f"region {r}: local_part ({_describe(local_part)}) selects {selected} bytes of "
                f"each {mine}-byte local block, but remote_part ({_describe(remote_part)}) "
                f"selects {sum(n for _, n in theirs_sel)} bytes of each {theirs}-byte remote "
                "block; both sides must select as many bytes")
        a, b = _split(ours_sel, theirs_sel)
        if len(a) > MAX_SEGMENTS:
            raise ValueError(f"region {r}: these parts cut each block into {len(a)} segments "
                             f"(at most {MAX_SEGMENTS})")
        done[mine, theirs] = (a, b, selected)
        local.append(a)
        remote.append(b)
        total += selected
    return PartPlan(tuple(local), tuple(remote), total)


def _split(left: Segments, right: Segments) -> tuple[Segments, Segments]:
    """Both selections cut at the union of their boundaries (as positions in the stream of
    selected bytes): segment ``i`` of each result has the same length."""
    out_left: list[tuple[int, int]] = []
    out_right: list[tuple[int, int]] = []
    i = j = 0
    used_left = used_right = 0  # bytes of left[i] / right[j] already covered
    while i < len(left) and j < len(right):
        (lo, ln), (ro, rn) = left[i], right[j]
        step = min(ln - used_left, rn - used_right)
        out_left.append((lo + used_left, step))
        out_right.append((ro + used_right, step))
        used_left += step
        used_right += step
        if used_left == ln:
            i, used_left = i + 1, 0
        if used_right == rn:
            j, used_right = j + 1, 0
    return tuple(out_left), tuple(out_right)


class RegionLike(Protocol):
    """Where a region's blocks are (``aionixl._regions.Region``)."""

    @property
    def base(self) -> int: ...
    @property
    def stride(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def device(self) -> int: ...


def part_descriptors(regions: Sequence[RegionLike], side: Sequence[Segments]) -> npt.NDArray[np.uint64]:
    """One side's (address, length, device) rows for a plan (its ``local`` or ``remote``):
    region-major, then block, then segment, the order :class:`PartLists` indexes."""
    return np.concatenate([_region_descriptors(r.base, r.stride, r.num_blocks, r.device, segments)
                           for r, segments in zip(regions, side, strict=True)])


def _region_descriptors(base: int, stride: int, num_blocks: int, device: int,
                        segments: Segments) -> npt.NDArray[np.uint64]:
    """Rows of one region: entry ``b * len(segments) + s`` is segment ``s`` of block ``b``."""
    offsets = np.array([o for o, _ in segments], dtype=np.uint64)
    lengths = np.array([n for _, n in segments], dtype=np.uint64)
    starts = np.uint64(base) + np.arange(num_blocks, dtype=np.uint64) * np.uint64(stride)
    rows = np.empty((num_blocks, len(segments), 3), dtype=np.uint64)
    rows[:, :, 0] = starts[:, None] + offsets[None, :]
    rows[:, :, 1] = lengths[None, :]
    rows[:, :, 2] = device
    return rows.reshape(-1, 3)


def check_list_size(num_blocks: int, plan_side: Sequence[Segments], where: str,
                    limit: int = _INT32_MAX) -> None:
    """Refuse a list of more than ``limit`` descriptors (at most what int32 indices reach)."""
    rows = num_blocks * sum(len(s) for s in plan_side)
    if rows > min(limit, _INT32_MAX):
        raise ValueError(f"{where}: these parts need {rows} descriptors, more than "
                         f"{min(limit, _INT32_MAX)} (Tuning.max_peer_descriptors, int32 indices)")


#: Descriptor indices in either form NIXL's wrapper takes (``aionixl._nixl.Indices``; this
#: layer sits below it): an int32 array or a plain list of ints.
Indices = npt.NDArray[np.int32] | list[int]
#: Indices up to this many on one side are made in plain Python (numpy's fixed cost per
#: call is larger below that); one block's up to this many are remembered per block id.
_PLAIN = 1024
#: Block ids whose indices one side remembers (then it starts over), as the whole-block
#: path's memo does (``aionixl._transfers``).
_MEMO = 4096


class PartLists:
    """Prepared NIXL descriptor lists for one pair of parts with one peer, and how to index
    them: each list is region-major, then block, then segment (``part_descriptors``).
    ``local`` and ``remote`` are the list handles (owned by the peer table)."""

    __slots__ = ("plan", "local", "remote", "nbytes", "per_block", "_local_index", "_remote_index")

    def __init__(self, plan: PartPlan, local: int, local_blocks: int, remote: int,
                 remote_blocks: int) -> None:
        self.plan = plan
        self.local = local
        self.remote = remote
        #: Bytes and descriptors per pair of blocks.
        self.nbytes = plan.nbytes
        self.per_block = plan.per_block
        self._local_index = _SideIndex(plan.local, local_blocks)
        self._remote_index = _SideIndex(plan.remote, remote_blocks)

    @overload
    def indices(self, local_ids: npt.NDArray[np.int32],
                remote_ids: npt.NDArray[np.int32]) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]: ...
    @overload
    def indices(self, local_ids: Indices, remote_ids: Indices) -> tuple[Indices, Indices]: ...

    def indices(self, local_ids: Indices, remote_ids: Indices) -> tuple[Indices, Indices]:
        """Descriptor indices of blocks ``local_ids`` and ``remote_ids`` (valid ids, equal
        lengths), in matching order: region, then block pair, then segment. From int32
        arrays, int32 arrays; from lists of plain ints (short ones:
        :func:`aionixl._regions.small_pair`), plain lists made without numpy where they
        are short (one block's remembered per block id), int32 arrays otherwise."""
        return self._local_index.of(local_ids), self._remote_index.of(remote_ids)


class _SideIndex:
    """Descriptor indices into one side's list: per region, where its entries start and
    its segments per block; entry ``start + b * n + s`` is segment ``s`` of block ``b``."""

    __slots__ = ("_layout", "_per_block", "_one", "_segments")

    def __init__(self, side: Sequence[Segments], num_blocks: int) -> None:
        self._layout: list[tuple[int, int]] = []
        start = 0
        for segments in side:
            self._layout.append((start, len(segments)))
            start += num_blocks * len(segments)
        self._per_block = sum(len(s) for s in side)
        self._segments = [np.arange(n, dtype=np.int64) for _, n in self._layout]
        self._one: dict[int, list[int]] = {}  # block id -> its indices (short ones only)

    def of(self, ids: Indices) -> Indices:
        if not isinstance(ids, list):
            return self.of_array(ids)
        if len(ids) * self._per_block > _PLAIN:  # numpy's fixed cost is the smaller one
            return self.of_array(np.array(ids, dtype=np.int64))
        if len(ids) != 1:
            return self._plain(ids)
        block = ids[0]
        found = self._one.get(block)
        if found is None:
            if len(self._one) >= _MEMO:
                self._one.clear()
            found = self._one[block] = self._plain(ids)
        return found

    def _plain(self, ids: Sequence[int]) -> list[int]:
        return [start + b * n + s for start, n in self._layout for b in ids for s in range(n)]

    def of_array(self, ids: npt.NDArray[np.integer[Any]]) -> npt.NDArray[np.int32]:
        blocks = ids.astype(np.int64)[:, None]
        parts = [(start + blocks * n + seg[None, :]).ravel()
                 for (start, n), seg in zip(self._layout, self._segments, strict=True)]
        return np.concatenate(parts).astype(np.int32)
