"""KV-cache regions: validating the user's tensors and turning block ids into NIXL indices.

Pure numpy; no NIXL here. A region is one tensor or array whose first dimension indexes
blocks. Block ``b`` of a region is ``region[b]`` and must be one contiguous run of bytes.
Every region of an engine has the same number of blocks, so one block id names one block
in every region. The engine's descriptor list holds ``num_regions * num_blocks`` entries,
region-major: entry ``r * num_blocks + b`` is block ``b`` of region ``r``.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np
import numpy.typing as npt

IndexArray = npt.NDArray[np.int32]
_INT32_MAX = 2**31 - 1
_SMALL = 64  # lists up to this long are checked in plain Python


@dataclass(frozen=True, slots=True)
class Region:
    """Where one region's blocks live. Addresses are process-local integers."""

    base: int
    stride: int
    block_bytes: int
    num_blocks: int
    mem_type: str  # "DRAM" or "VRAM"
    device: int

    @property
    def span(self) -> int:
        """Bytes from ``base`` to the end of the last block."""
        return (self.num_blocks - 1) * self.stride + self.block_bytes


def describe_region(obj: object, position: int) -> Region:
    """Check one kv_caches entry and say where its blocks are, or raise ValueError."""
    where = f"kv_caches[{position}]"
    torch = _torch_module()
    if torch is not None and isinstance(obj, torch.Tensor):
        return _describe_tensor(obj, where)
    if isinstance(obj, np.ndarray):
        return _describe_ndarray(obj, where)
    raise ValueError(f"{where}: expected a torch.Tensor or numpy.ndarray, got {type(obj).__name__}")


def _torch_module() -> Any:
    import sys

    return sys.modules.get("torch")


def _describe_tensor(t: Any, where: str) -> Region:
    if t.dim() < 1:
        raise ValueError(f"{where}: a region needs a block dimension; got a 0-d tensor")
    if t.device.type == "cpu":
        mem_type, device = "DRAM", 0
    elif t.device.type == "cuda":
        mem_type, device = "VRAM", int(t.device.index or 0)
    else:
        raise ValueError(f"{where}: tensors on {t.device.type!r} are not supported (cpu or cuda)")
    if t.layout is not _torch_module().strided:
        raise ValueError(f"{where}: only strided (dense) tensors are supported")
    num_blocks = int(t.shape[0])
    itemsize = int(t.element_size())
    block_bytes = int(t[0].numel()) * itemsize if num_blocks else 0
    if num_blocks and not t[0].is_contiguous():
        raise ValueError(
            f"{where}: block {where}[0] is not contiguous (strides {tuple(t.stride())}); "
            "every block must be one contiguous run of bytes"
        )
    return _checked(where, int(t.data_ptr()), int(t.stride(0)) * itemsize, block_bytes,
                    num_blocks, mem_type, device)


def _describe_ndarray(a: npt.NDArray[Any], where: str) -> Region:
    if a.ndim < 1:
        raise ValueError(f"{where}: a region needs a block dimension; got a 0-d array")
    if not a.flags.writeable:
        raise ValueError(f"{where}: the array is read-only; NIXL may write into it")
    if a.dtype.hasobject:
        raise ValueError(f"{where}: object arrays hold pointers, not data")
    num_blocks = int(a.shape[0])
    block_bytes = int(a[0].nbytes) if num_blocks else 0
    if num_blocks and not a[0].flags.c_contiguous:
        raise ValueError(
            f"{where}: block {where}[0] is not contiguous (strides {a.strides}); "
            "every block must be one contiguous run of bytes"
        )
    return _checked(where, int(a.__array_interface__["data"][0]), int(a.strides[0]),
                    block_bytes, num_blocks, "DRAM", 0)


def _checked(where: str, base: int, stride: int, block_bytes: int, num_blocks: int,
             mem_type: str, device: int) -> Region:
    if num_blocks < 1:
        raise ValueError(f"{where}: the region has no blocks")
    if block_bytes < 1:
        raise ValueError(f"{where}: blocks are empty (0 bytes)")
    if num_blocks > 1 and stride < block_bytes:
        raise ValueError(
            f"{where}: blocks overlap or run backwards (block stride {stride} bytes, "
            f"block size {block_bytes} bytes)"
        )
    return Region(base, stride, block_bytes, num_blocks, mem_type, device)


def describe_regions(kv_caches: Sequence[object]) -> list[Region]:
    """Validate all regions together: same block count, one memory kind."""
    if isinstance(kv_caches, (np.ndarray, str, bytes)) or _is_tensor(kv_caches):
        raise ValueError("kv_caches must be a sequence of tensors/arrays, not a single one")
    regions = [describe_region(obj, i) for i, obj in enumerate(kv_caches)]
    if not regions:
        raise ValueError("kv_caches is empty: an engine needs at least one region")
    counts = {r.num_blocks for r in regions}
    if len(counts) != 1:
        raise ValueError(f"every region must have the same number of blocks; got {sorted(counts)}")
    kinds = {r.mem_type for r in regions}
    if len(kinds) != 1:
        raise ValueError("all regions of one engine must be of one memory kind (all CPU or all CUDA)")
    if len(regions) * regions[0].num_blocks > _INT32_MAX:
        raise ValueError("too many blocks: regions * blocks must fit in int32")
    return regions


def _is_tensor(obj: object) -> bool:
    torch = _torch_module()
    return torch is not None and isinstance(obj, torch.Tensor)


def block_view(region: Region) -> npt.NDArray[np.uint8]:
    """A writable ``(num_blocks, block_bytes)`` uint8 view of a DRAM region's blocks, over
    the region's own memory (the caller checked it is host memory that outlives the view)."""
    flat = np.ctypeslib.as_array((ctypes.c_uint8 * region.span).from_address(region.base))
    return np.lib.stride_tricks.as_strided(flat, shape=(region.num_blocks, region.block_bytes),
                                           strides=(region.stride, 1), writeable=True)


def block_descriptors(regions: Sequence[Region]) -> npt.NDArray[np.uint64]:
    """One (address, length, device) row per block, region-major, for ``prep_xfer_dlist``."""
    rows = []
    for r in regions:
        d = np.empty((r.num_blocks, 3), dtype=np.uint64)
        d[:, 0] = np.uint64(r.base) + np.arange(r.num_blocks, dtype=np.uint64) * np.uint64(r.stride)
        d[:, 1] = r.block_bytes
        d[:, 2] = r.device
        rows.append(d)
    return np.concatenate(rows)


def registration_spans(regions: Sequence[Region]) -> npt.NDArray[np.uint64]:
    """(address, length, device) rows covering every block, overlapping spans merged.

    Views of one tensor may share or touch memory; NIXL registers each byte once.
    """
    spans = sorted((r.device, r.base, r.base + r.span) for r in regions)
    merged: list[list[int]] = []
    for device, start, end in spans:
        if merged and merged[-1][0] == device and start <= merged[-1][2]:
            merged[-1][2] = max(merged[-1][2], end)
        else:
            merged.append([device, start, end])
    return np.array([[s, e - s, d] for d, s, e in merged], dtype=np.uint64)


def small_ids(value: object, num_blocks: int) -> TypeGuard[list[int] | tuple[int, ...]]:
    """Whether ``value`` is a short list or tuple of valid plain-int block ids.

    The hot paths' check for the common case: no numpy at all. Anything unusual (arrays,
    long lists, bad ids) is False and goes through :func:`block_ids`, which also explains
    what is wrong.
    """
    if (type(value) is not list and type(value) is not tuple) or not 0 < len(value) <= _SMALL:
        return False
    for v in value:  # noqa: SIM110  # a loop: all() over a generator costs more
        if type(v) is not int or v < 0 or v >= num_blocks:
            return False
    return True


def small_indices(value: object, num_blocks: int, offsets: list[int]) -> list[int] | None:
    """Descriptor indices for a short list of valid plain-int block ids (:func:`small_ids`);
    None otherwise."""
    if not small_ids(value, num_blocks):
        return None
    return [o + b for o in offsets for b in value]


def small_pair(local_blocks: object, remote_blocks: object, local_count: int, remote_count: int,
               op: str) -> tuple[list[int], list[int]] | None:
    """A call's ids as plain lists where they are short lists of plain ints (or stand for
    them: :func:`plain_ids`) that pass every check of :func:`paired_ids`, told without
    numpy; None for anything else, which :func:`paired_ids` then decides (and explains)."""
    mine, theirs = plain_ids(local_blocks), plain_ids(remote_blocks)
    if small_ids(mine, local_count) and small_ids(theirs, remote_count) \
            and type(mine) is list and type(theirs) is list and len(mine) == len(theirs) \
            and not has_duplicates(mine if op == "read" else theirs):
        return mine, theirs
    return None


def plain_ids(value: object, most: int = _SMALL) -> object:
    """A tuple, or a range or 1-D integer numpy array of at most ``most`` block ids, as a
    list: the form the transfer fast paths take (given as arrays or tuples, a one-block call
    cost 2-3x more than given as lists); anything else as it is."""
    if type(value) is tuple or (type(value) is range and _short(value, most)):
        return list(value)
    if type(value) is np.ndarray and value.ndim == 1 and value.dtype.kind in "iu" \
            and value.size <= most:
        return value.tolist()
    return value


def _short(ids: range, most: int) -> bool:
    try:
        return len(ids) <= most
    except OverflowError:  # longer than any index
        return False


def plain_int(value: Any) -> Any:
    """A numpy integer as an int; anything else as it is."""
    return int(value) if isinstance(value, np.integer) else value


def has_duplicates(value: Sequence[int]) -> bool:
    return len(value) > 1 and len(set(value)) != len(value)


def block_ids(value: object, num_blocks: int, what: str) -> IndexArray:
    """Turn a sequence of ints or a 1-D integer array into validated int32 block ids."""
    if isinstance(value, np.ndarray):
        arr = value
    elif isinstance(value, range):
        # Checked by its ends, not walked: range(2**70) and range(-2**70, 0) are refused at once.
        if value and (low := min(value[0], value[-1])) < 0:
            raise _no_such_block(what, low, num_blocks)
        if value and (high := max(value[0], value[-1])) >= num_blocks:
            raise _no_such_block(what, high, num_blocks)
        arr = np.arange(value.start, value.stop, value.step, dtype=np.int64)
    elif isinstance(value, (str, bytes, bytearray)) or not isinstance(value, Sequence):
        raise ValueError(f"{what} must be a sequence of ints or a 1-D integer numpy array")
    else:
        try:
            arr = np.array([operator.index(v) if not isinstance(v, bool) else _no_bool(what)
                            for v in value], dtype=np.int64)
        except TypeError:
            raise ValueError(f"{what} must contain ints only") from None
        except OverflowError:  # an int beyond int64: no such block either way
            wild = next((i for i in map(operator.index, value) if not _INT64_MIN <= i <= _INT64_MAX),
                        None)
            if wild is None:  # an __index__ that answered differently the second time
                raise ValueError(f"{what} has a block id out of range") from None
            raise _no_such_block(what, wild, num_blocks) from None
    if arr.ndim != 1:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    if arr.size == 0:
        raise ValueError(f"{what} is empty: nothing to transfer")
    # One pass for the common case: seen as unsigned, a negative id is larger than any valid.
    unsigned = arr.view(_UNSIGNED[arr.dtype.itemsize]) if arr.dtype.kind == "i" else arr
    if int(unsigned.max()) >= num_blocks:
        low, high = int(arr.min()), int(arr.max())
        raise _no_such_block(what, low if low < 0 else high, num_blocks)
    return arr.astype(np.int32, copy=False)


def _no_such_block(what: str, block: int, num_blocks: int) -> ValueError:
    """The error for an id outside 0..num_blocks-1, said the same way wherever it is found
    (an id too long to print, as Python refuses past 4300 digits, by its size)."""
    shown = str(block) if block.bit_length() <= 128 else f"of {block.bit_length()} bits"
    if block < 0:
        return ValueError(f"{what} has a negative block id ({shown})")
    return ValueError(f"{what} has block id {shown}, but there are only {num_blocks} blocks")


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: The unsigned integer dtype of each signed one's size (a view, not a copy).
_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _no_bool(what: str) -> int:
    raise ValueError(f"{what} must contain ints, not bools")


def region_offsets(num_regions: int, num_blocks: int) -> IndexArray:
    """Column of per-region offsets into a region-major descriptor list."""
    return (np.arange(num_regions, dtype=np.int32) * np.int32(num_blocks)).reshape(-1, 1)


def descriptor_indices(offsets: IndexArray, ids: IndexArray) -> IndexArray:
    """Descriptor indices of blocks ``ids`` in every region, region-major."""
    return (offsets + ids).ravel()


def paired_ids(local_blocks: object, remote_blocks: object, local_count: int, remote_count: int,
               op: str) -> tuple[IndexArray, IndexArray]:
    """A transfer's block ids, validated with clear errors: in range on each side, as many
    on both, and no block of the destination (ours for a read) named twice."""
    local_ids = block_ids(local_blocks, local_count, "local_blocks")
    remote_ids = block_ids(remote_blocks, remote_count, "remote_blocks")
    if local_ids.size != remote_ids.size:
        raise ValueError(f"local_blocks has {local_ids.size} ids but remote_blocks has "
                         f"{remote_ids.size}")
    if op == "read":
        check_distinct(local_ids, "local_blocks (the destination of a read)")
    else:
        check_distinct(remote_ids, "remote_blocks (the destination of a write)")
    return local_ids, remote_ids


def check_distinct(ids: IndexArray, what: str) -> None:
    """Refuse a destination that names one block twice: the result would be undefined."""
    if ids.size > 1:
        ordered = np.sort(ids)  # a quarter of np.unique's cost (which also builds the set)
        if np.count_nonzero(ordered[1:] == ordered[:-1]):  # cheaper than .any() (a reduction)
            raise ValueError(f"{what} names the same block more than once")
