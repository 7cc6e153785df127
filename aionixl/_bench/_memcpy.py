"""numpy.copyto of the same bytes: the memory-bandwidth limit (no NIXL at all).

Copies from a second cache in this process that holds the prefill pattern into our cache:
contiguous ids as one ``copyto`` per region, scattered ids as one ``copyto`` per block (one
pass over the bytes, as NIXL does; a fancy-index assignment would copy twice). On CUDA the
same with ``Tensor.copy_`` and a synchronize per transfer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

from ._context import Context, Ids, Results
from ._memory import WRITE_SALT, KVMemory, _torch


def _copier(dst: KVMemory, src: KVMemory, loc: Ids, rem: Ids, contiguous: bool) -> Callable[[], None]:
    cuda = dst.device == "cuda" or src.device == "cuda"
    torch: Any = _torch() if cuda else None
    if cuda:

        def as_tensor(region: Any) -> Any:
            return region if isinstance(region, torch.Tensor) else torch.from_numpy(region)

        pairs = [(as_tensor(d), as_tensor(s)) for d, s in zip(dst.regions, src.regions, strict=True)]
    else:
        pairs = list(zip(dst.regions, src.regions, strict=True))
    local = [int(x) for x in loc]
    remote = [int(x) for x in rem]
    if contiguous:
        lo, ro, n = local[0], remote[0], len(local)
        views = [(d[lo:lo + n], s[ro:ro + n]) for d, s in pairs]
    else:
        views = [(d[a], s[b]) for d, s in pairs for a, b in zip(local, remote, strict=True)]
    if cuda:
        sync = torch.cuda.synchronize

        def copy_cuda() -> None:
            for d, s in views:
                d.copy_(s, non_blocking=True)
            sync()

        return copy_cuda
    import numpy as np

    copyto = np.copyto

    def copy() -> None:
        for d, s in views:
            copyto(d, s)

    return copy


def _seq(copies: list[Callable[[], None]], n: int) -> float:
    k = len(copies)
    t = time.perf_counter()
    for i in range(n):
        copies[i % k]()
    return (time.perf_counter() - t) / n


def run(ctx: Context, source: KVMemory) -> dict[str, Any]:
    spec = ctx.spec
    out: dict[str, Any] = {}
    dst = ctx.local

    def copies(kind: str, nblocks: int) -> list[Callable[[], None]]:
        return [_copier(dst, source, loc, rem, kind == "contiguous")
                for loc, rem in ctx.workload(kind, nblocks)]

    checked = _verify(ctx, dst, source)
    results: Results = {}
    for nblocks, count in spec.seq.items():
        c = copies("contiguous", nblocks)
        results[f"seq_{nblocks}"] = ctx.timed_repeats(f"numpy.copyto: {nblocks} blocks",
                                                      partial(_seq, c, count))
    for nblocks in spec.scattered:
        c = copies("scattered", nblocks)
        n = spec.seq.get(nblocks, 10)
        results[f"scattered_{nblocks}"] = ctx.timed_repeats(f"numpy.copyto: {nblocks} scattered blocks",
                                                            partial(_seq, c, n))
    nbytes = spec.bulk_blocks * spec.bytes_per_block_id
    bulk = copies("contiguous", spec.bulk_blocks)
    results["bulk"] = [nbytes / s for s in ctx.timed_repeats(
        "numpy.copyto: 16 MiB", lambda: _seq(bulk, spec.bulk_count))]
    checked += _verify(ctx, dst, source)
    if ctx.host is not None:
        rows, host_checked = host_device(ctx, source)
        results.update(rows)
        checked += host_checked
    out.update(results)
    out["info"] = {"verified_blocks": checked}
    return out


def _verify(ctx: Context, memory: KVMemory, frm: KVMemory) -> int:
    """Copy the verify set from ``frm`` into cleared blocks of ``memory`` and compare the
    bytes with the prefill pattern; raises on a mismatch, else the block ids compared."""
    ctx.clear_verify_set(memory)
    loc, rem = ctx.verify_set
    _copier(memory, frm, loc, rem, contiguous=False)()
    if not ctx.check_verify_set(memory):
        raise RuntimeError("numpy.copyto: the copied bytes do not match the pattern")
    return ctx.verify_blocks


def host_device(ctx: Context, source: KVMemory) -> tuple[Results, int]:
    """--device cuda: ``Tensor.copy_`` between the device cache ``source`` and the host
    cache, 16 MiB at a time; returns the rows and the block ids verified. The host->device
    copies carry a pattern ``source`` never holds on its own (``WRITE_SALT``), checked on
    the device side afterwards; then ``source`` gets its prefill pattern back."""
    spec = ctx.spec
    host = ctx.host
    assert host is not None
    nbytes = spec.bulk_blocks * spec.bytes_per_block_id
    results: Results = {}
    d2h = [_copier(host, source, loc, rem, True) for loc, rem in ctx.workload("contiguous", spec.bulk_blocks)]
    results["bulk_d2h"] = [nbytes / s for s in ctx.timed_repeats(
        "Tensor.copy_: 16 MiB device->host", lambda: _seq(d2h, spec.bulk_count))]
    checked = _verify(ctx, host, source)
    # host blocks `rem` -> device blocks `loc`: the host holds the salted pattern of `loc`.
    loc, rem = ctx.write_pair()
    host.fill_expected(rem, loc, WRITE_SALT)
    h2d = [_copier(source, host, loc, rem, True)]
    results["bulk_h2d"] = [nbytes / s for s in ctx.timed_repeats(
        "Tensor.copy_: 16 MiB host->device", lambda: _seq(h2d, spec.bulk_count))]
    if not source.check(loc, loc, WRITE_SALT):
        raise RuntimeError("Tensor.copy_: the device blocks do not hold the pattern copied from the host")
    checked += len(loc)
    source.fill_pattern()  # the host copies overwrote part of the source
    return results, checked


def bulk_reference(ctx: Context, source: KVMemory) -> Callable[[], float]:
    """The bulk copy loop, for aionixl to alternate with (seconds per transfer)."""
    copies = [_copier(ctx.local, source, loc, rem, True)
              for loc, rem in ctx.workload("contiguous", ctx.spec.bulk_blocks)]
    return partial(_seq, copies, ctx.spec.bulk_count)
