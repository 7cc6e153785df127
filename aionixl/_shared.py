"""DRAM that another process can map: KV caches a separate serving process can register.

Over UCX TCP the target of a READ sends the data itself, and UCX aborts the target when
that send meets a reader that died (docs/vllm.md). ``aionixl.vllm.serve(..., isolate=True)`` therefore
lets a child process register the engine's regions and answer vLLM's reads; the child can
only do that for memory it can map, which is what :func:`shared_dram` allocates (a memfd,
mapped shared). Pure memory bookkeeping: no NIXL, no I/O.
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from ._checks import check_int
from ._regions import Region

#: Live buffers by their base address: (memfd, length).
_live: dict[int, tuple[int, int]] = {}


@dataclass(frozen=True, slots=True)
class SharedSpan:
    """Where a region lives in a shared buffer: the buffer's memfd and the byte offset of
    the region's base in it."""

    fd: int
    offset: int


def shared_dram(nbytes: int) -> npt.NDArray[np.uint8]:
    """``nbytes`` of zeroed DRAM (1-D ``uint8``) that a child process can map.

    View it as the KV cache's regions (``torch.from_numpy(buf).view(dtype).reshape(...)``
    or numpy views); the memory lives while any view of it does. Needed only by
    ``aionixl.vllm.serve(engine, isolate=True)``.
    """
    check_int(nbytes, "nbytes", 1)
    fd = os.memfd_create("aionixl-kv", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    buf = np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
    base = int(buf.ctypes.data)
    _live[base] = (fd, nbytes)
    weakref.finalize(mapping, _forget, base, fd)
    return buf


def _forget(base: int, fd: int) -> None:
    _live.pop(base, None)
    os.close(fd)


def locate(region: Region) -> SharedSpan | None:
    """The shared buffer holding all of ``region``, or None when it is not in one."""
    end = region.base + region.span
    for base, (fd, length) in list(_live.items()):  # a collection may run _forget meanwhile
        if base <= region.base and end <= base + length:
            return SharedSpan(fd, region.base - base)
    return None


def locate_all(regions: Sequence[Region]) -> list[SharedSpan]:
    """Where each region lies in :func:`shared_dram` memory; ``ValueError`` naming the
    first that does not (VRAM never does)."""
    spans = []
    for i, region in enumerate(regions):
        span = locate(region) if region.mem_type == "DRAM" else None
        if span is None:
            raise ValueError(f"aionixl.vllm.serve(..., isolate=True) serves DRAM allocated with "
                             f"aionixl.shared_dram only; kv_caches[{i}] is not in such a buffer")
        spans.append(span)
    return spans
