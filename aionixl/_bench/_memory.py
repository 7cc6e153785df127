"""KV-cache-shaped memory for the benchmark: regions, a checkable byte pattern, descriptors.

A cache is ``2 * layers`` regions (K and V per layer), each ``[blocks, block_bytes]`` bytes,
in DRAM (numpy) or VRAM (torch on CUDA). The prefill side fills block ``b`` of region ``r``
with 64-bit words that encode ``(r, b, word index)``, so a block read into the wrong place,
or not at all, fails :meth:`KVMemory.check`. A ``salt`` gives a second pattern of the same
shape that the prefill side never holds on its own (:data:`WRITE_SALT`): the host->device rows
write it there and read it back, so a write that moved nothing fails the check as well.

Nothing here calls NIXL; the bare-NIXL and threaded contenders get plain descriptor arrays
from :func:`block_descriptors` and :func:`registration_spans` (and, for the half-head slice
rows, :func:`part_descriptors`). :meth:`KVMemory.check_parts` checks part reads against the
whole cache: each part in its place, every other byte still zero.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

U64 = npt.NDArray[np.uint64]
_SEED = 0x5A17  # mixed into every word so that zeroed memory never passes
#: XORed into every word of the pattern that the host->device rows write to the prefill
#: side: every word differs from the one the prefill process filled in.
WRITE_SALT = 0xC0DE_0000_0000_BEEF


def _torch() -> Any:
    return importlib.import_module("torch")


def cuda_problem() -> str | None:
    """Why ``--device cuda`` cannot run here, or None when it can."""
    try:
        torch = _torch()
    except ImportError as exc:
        return f"torch is not importable ({exc})"
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def expected_words(region: int, blocks: npt.NDArray[np.int64], words: int, salt: int = 0) -> U64:
    """The pattern words of ``blocks`` of ``region``: shape ``[len(blocks), words]``; a
    non-zero ``salt`` (a 64-bit int) changes every word."""
    b = blocks.astype(np.uint64).reshape(-1, 1) << np.uint64(24)
    w = np.arange(words, dtype=np.uint64).reshape(1, -1)
    return (b | w | (np.uint64(region) << np.uint64(48))) ^ np.uint64(_SEED ^ salt)


class KVMemory:
    """The regions of one side, on ``device`` ("cpu" or "cuda")."""

    def __init__(self, regions: int, blocks: int, block_bytes: int, device: str = "cpu") -> None:
        if block_bytes % 8:
            raise ValueError("block_bytes must be a multiple of 8")
        self.num_regions = regions
        self.num_blocks = blocks
        self.block_bytes = block_bytes
        self.device = device
        self.regions: list[Any]
        if device == "cpu":
            # Written once so that every page is mapped before anything is timed (np.zeros
            # would leave the first contender to pay the page faults).
            self.regions = [np.empty((blocks, block_bytes), np.uint8) for _ in range(regions)]
            for region in self.regions:
                region.fill(0)
            self.mem_type = "DRAM"
            self.device_id = 0
        elif device == "cuda":
            torch = _torch()
            self.regions = [torch.zeros((blocks, block_bytes), dtype=torch.uint8, device="cuda")
                            for _ in range(regions)]
            self.mem_type = "VRAM"
            self.device_id = int(torch.cuda.current_device())
        else:
            raise ValueError(f"unknown device {device!r} (cpu or cuda)")

    @property
    def bytes_per_block_id(self) -> int:
        return self.num_regions * self.block_bytes

    @property
    def nbytes(self) -> int:
        return self.num_regions * self.num_blocks * self.block_bytes

    def bases(self) -> list[int]:
        if self.device == "cpu":
            return [int(r.ctypes.data) for r in self.regions]
        return [int(r.data_ptr()) for r in self.regions]

    def layout(self) -> dict[str, Any]:
        """Where the blocks are, as JSON-able data (what a handshake would carry)."""
        return {"bases": self.bases(), "stride": self.block_bytes, "block_bytes": self.block_bytes,
                "num_blocks": self.num_blocks, "mem_type": self.mem_type, "device": self.device_id}

    def sync(self) -> None:
        if self.device == "cuda":
            _torch().cuda.synchronize()

    # ---- the pattern --------------------------------------------------------------------

    def fill_pattern(self) -> None:
        words = self.block_bytes // 8
        every = np.arange(self.num_blocks, dtype=np.int64)
        for r, region in enumerate(self.regions):
            values = expected_words(r, every, words)
            if self.device == "cpu":
                region.view(np.uint64)[:] = values
            else:
                torch = _torch()
                region.view(torch.int64).copy_(torch.from_numpy(values.view(np.int64)))
        self.sync()

    def clear(self, ids: Sequence[int] | npt.NDArray[np.integer[Any]]) -> None:
        index = np.asarray(ids, dtype=np.int64)
        for region in self.regions:
            if self.device == "cpu":
                region[index] = 0
            else:
                region[_torch().from_numpy(index).to(region.device)] = 0
        self.sync()

    def check(self, local_ids: Sequence[int] | npt.NDArray[np.integer[Any]],
              remote_ids: Sequence[int] | npt.NDArray[np.integer[Any]], salt: int = 0) -> bool:
        """True when our blocks ``local_ids`` hold the prefill pattern of ``remote_ids``
        (with ``salt``: that variant of it), in every region."""
        local = np.asarray(local_ids, dtype=np.int64)
        remote = np.asarray(remote_ids, dtype=np.int64)
        words = self.block_bytes // 8
        self.sync()
        for r, region in enumerate(self.regions):
            want = expected_words(r, remote, words, salt)
            if self.device == "cpu":
                got = region[local].view(np.uint64)
            else:
                torch = _torch()
                got = region[torch.from_numpy(local).to(region.device)].cpu().numpy().view(np.uint64)
            if not np.array_equal(got, want):
                return False
        return True

    def clear_all(self) -> None:
        """Zero every block of every region (before a check of the whole cache)."""
        for region in self.regions:
            if self.device == "cpu":
                region.fill(0)
            else:
                region.zero_()
        self.sync()

    def check_parts(self, calls: Sequence[tuple[Sequence[int], Sequence[int], int]], count: int) -> bool:
        """After :meth:`clear_all` and the part reads ``calls`` ((local ids, remote ids,
        index): part ``index`` of ``count`` equal consecutive parts of each remote block read
        into the same part of the local block): True when every region holds exactly that,
        part ``index`` of each local block the prefill pattern of its remote block's part
        ``index``, and every other byte of the whole cache still zero (the rest of those
        blocks, every other block)."""
        words = self.block_bytes // 8
        size = words // count
        self.sync()
        for r, region in enumerate(self.regions):
            want = np.zeros((self.num_blocks, words), dtype=np.uint64)
            for loc, rem, index in calls:
                lo = index * size
                pattern = expected_words(r, np.asarray(rem, dtype=np.int64), words)
                want[np.asarray(loc, dtype=np.int64), lo:lo + size] = pattern[:, lo:lo + size]
            got = region.view(np.uint64) if self.device == "cpu" else \
                region.cpu().numpy().view(np.uint64)
            if not np.array_equal(got, want):
                return False
        return True

    def fill_expected(self, local_ids: Sequence[int], remote_ids: Sequence[int], salt: int = 0) -> None:
        """Put the prefill pattern of ``remote_ids`` (with ``salt``: that variant of it) into
        our ``local_ids``: what a write from these blocks must leave on the prefill side."""
        words = self.block_bytes // 8
        remote = np.asarray(remote_ids, dtype=np.int64)
        for r, region in enumerate(self.regions):
            values = expected_words(r, remote, words, salt)
            for i, b in enumerate(local_ids):
                if self.device == "cpu":
                    region[b].view(np.uint64)[:] = values[i]
                else:
                    torch = _torch()
                    region[b].view(torch.int64).copy_(torch.from_numpy(values[i].view(np.int64)))
        self.sync()


def block_descriptors(layout: dict[str, Any]) -> U64:
    """One (address, length, device) row per block, region-major: row ``r * blocks + b``."""
    blocks = int(layout["num_blocks"])
    rows = []
    for base in layout["bases"]:
        d = np.empty((blocks, 3), dtype=np.uint64)
        d[:, 0] = np.uint64(base) + np.arange(blocks, dtype=np.uint64) * np.uint64(layout["stride"])
        d[:, 1] = layout["block_bytes"]
        d[:, 2] = layout["device"]
        rows.append(d)
    return np.concatenate(rows)


def part_descriptors(layout: dict[str, Any], index: int, count: int) -> U64:
    """As :func:`block_descriptors`, for part ``index`` of ``count`` equal consecutive parts
    of each block: one (address, length, device) row per block and region, region-major
    (row ``r * blocks + b``), so :func:`descriptor_indices` indexes it as it does whole blocks."""
    part = int(layout["block_bytes"]) // count
    rows = block_descriptors(layout)
    rows[:, 0] += np.uint64(index * part)
    rows[:, 1] = part
    return rows


def registration_spans(layout: dict[str, Any]) -> U64:
    """One (address, length, device) row per region, for ``register_memory``."""
    size = int(layout["num_blocks"]) * int(layout["stride"])
    return np.array([[base, size, layout["device"]] for base in layout["bases"]], dtype=np.uint64)


def descriptor_indices(ids: Sequence[int] | npt.NDArray[np.integer[Any]], num_regions: int,
                       num_blocks: int) -> npt.NDArray[np.int32]:
    """Descriptor indices of block ``ids`` in every region, region-major, as int32."""
    arr = np.asarray(ids, dtype=np.int32).reshape(1, -1)
    offsets = (np.arange(num_regions, dtype=np.int32) * np.int32(num_blocks)).reshape(-1, 1)
    return (offsets + arr).ravel()
