"""Deterministic KV-cache regions and the checks on them (the lowest layer of
:mod:`aionixl.testing`: it imports nothing else of the package).

Block ``b`` of region ``r`` of ``make_caches(seed, ...)`` is a function of ``(seed, r, b)``
alone, so a test (or a child process) can recompute what any block must hold. torch is
imported where a torch dtype or tensor is needed, not on import.

PYTEST_DONT_REWRITE: the assertions here raise AssertionError with their own messages.
"""

from __future__ import annotations

import itertools
import math
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from aionixl import Engine

if TYPE_CHECKING:
    import torch

DEFAULT_NUM_BLOCKS = 64
DEFAULT_BLOCK_SHAPE: tuple[int, ...] = (16, 8, 64)
DEFAULT_DTYPES: tuple[str, ...] = ("float16", "bfloat16")

_names = itertools.count()


def unique_name(prefix: str = "aionixl-test") -> str:
    """A NIXL agent name unique in this run (agents that meet must have distinct names)."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (imports torch); ``ValueError`` for one that
    :func:`make_caches` cannot fill."""
    import torch

    dtype = getattr(torch, name, None)
    quantized = {getattr(torch, q) for q in ("qint8", "quint8", "qint32", "quint4x2", "quint2x4")
                 if hasattr(torch, q)}  # filling these crashes the interpreter
    if not isinstance(dtype, torch.dtype) or dtype == torch.bool or dtype in quantized:
        raise ValueError(f"{name!r} is not a torch dtype make_caches can fill (bool and quantized "
                         "dtypes are refused)")
    return dtype


def check_geometry(seed: int, num_blocks: int, block_shape: Sequence[int],
                   dtypes: Sequence[str]) -> tuple[int, ...]:
    """Validate a seed and a cache geometry; returns ``block_shape`` as a tuple."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise ValueError(f"seed must be an int from 0 to 2**63 - 1, got {seed!r}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    shape = tuple(block_shape)
    if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(f"block_shape must be a non-empty tuple of positive ints, got {block_shape!r}")
    if isinstance(dtypes, str) or not dtypes:
        raise ValueError(f"dtypes must be a non-empty sequence of dtype names, got {dtypes!r}")
    for name in dtypes:
        torch_dtype(name)
    return shape


def block_bytes(seed: int, region: int, block: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes block ``block`` of region ``region`` holds in ``make_caches(seed, ...)``.

    A numpy Generator seeded with ``[seed, region, block]`` draws ``nbytes`` bytes, so any
    block can be recomputed on its own, cheaply, without building the whole cache.
    """
    rng = np.random.default_rng([seed, region, block])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def make_caches(seed: int, num_blocks: int = DEFAULT_NUM_BLOCKS,
                block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE,
                dtypes: Sequence[str] = DEFAULT_DTYPES) -> list[torch.Tensor]:
    """One CPU tensor per dtype, shape ``(num_blocks, *block_shape)``, filled from ``seed``.

    Block ``b`` of region ``r`` holds ``block_bytes(seed, r, b, nbytes)`` bit for bit (the
    bytes are written through an integer view, so float regions may hold NaNs and
    infinities: compare them with :func:`assert_blocks_equal`, not with ``==``).
    """
    import torch

    shape = check_geometry(seed, num_blocks, block_shape, dtypes)
    caches: list[torch.Tensor] = []
    for region, name in enumerate(dtypes):
        tensor = torch.empty((num_blocks, *shape), dtype=torch_dtype(name))
        raw = tensor.view(-1).view(torch.uint8).view(num_blocks, -1).numpy()
        for block in range(num_blocks):
            raw[block] = block_bytes(seed, region, block, raw.shape[1])
        caches.append(tensor)
    return caches


def region_bytes(block_shape: Sequence[int], dtypes: Sequence[str]) -> tuple[int, ...]:
    """The bytes of one block of each region of ``make_caches(..., block_shape, dtypes)``."""
    return tuple(math.prod(block_shape) * torch_dtype(name).itemsize for name in dtypes)


def byte_caches(seed: int, num_blocks: int,
                sizes: Sequence[int]) -> list[np.ndarray[Any, np.dtype[np.uint8]]]:
    """``make_caches``' bytes without torch: one ``uint8`` array ``(num_blocks, sizes[r])``
    per region, block ``b`` of region ``r`` holding ``block_bytes(seed, r, b, sizes[r])``.

    An engine cares only for the bytes of its blocks, so a child process serves these (and
    never imports torch, which costs it about a second of CPU and 140 MiB)."""
    caches = []
    for region, nbytes in enumerate(sizes):
        array = np.empty((num_blocks, nbytes), dtype=np.uint8)
        for block in range(num_blocks):
            array[block] = block_bytes(seed, region, block, nbytes)
        caches.append(array)
    return caches


def _block_view(region: Any, block: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes of ``region[block]`` (a torch tensor on any device, or a numpy array)."""
    torch = sys.modules.get("torch")  # a torch tensor means torch is imported already
    if torch is not None and isinstance(region, torch.Tensor):
        item = region[block].detach().to("cpu").contiguous()
        return item.view(-1).view(torch.uint8).numpy()  # type: ignore[no-any-return]
    item_np = np.ascontiguousarray(np.asarray(region)[block])
    return item_np.reshape(-1).view(np.uint8)


def assert_blocks_equal(local_caches: Sequence[Any], local_ids: Sequence[int], remote_seed: int,
                        remote_ids: Sequence[int], *, num_blocks: int = DEFAULT_NUM_BLOCKS,
                        block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE,
                        dtypes: Sequence[str] = DEFAULT_DTYPES) -> None:
    """Assert that ``local_caches[r][local_ids[i]]`` holds, byte for byte, what block
    ``remote_ids[i]`` of region ``r`` holds in ``make_caches(remote_seed, num_blocks,
    block_shape, dtypes)``, for every region ``r``.

    ``local_caches`` are torch tensors or numpy arrays of any dtype with the same bytes per
    block. Raises ``AssertionError`` naming the first region and block that differ.
    """
    shape = check_geometry(remote_seed, num_blocks, block_shape, dtypes)
    local_list, remote_list = [int(i) for i in local_ids], [int(i) for i in remote_ids]
    if len(local_list) != len(remote_list):
        raise ValueError(f"{len(local_list)} local ids but {len(remote_list)} remote ids")
    if len(local_caches) != len(dtypes):
        raise AssertionError(f"{len(local_caches)} local regions, but the remote geometry has "
                             f"{len(dtypes)} ({', '.join(dtypes)})")
    for block in remote_list:
        if not 0 <= block < num_blocks:
            raise ValueError(f"remote block {block} out of range for num_blocks={num_blocks}")
    elements = math.prod(shape)
    for region, name in enumerate(dtypes):
        nbytes = elements * torch_dtype(name).itemsize
        for local, remote in zip(local_list, remote_list, strict=True):
            actual = _block_view(local_caches[region], local)
            if actual.size != nbytes:
                raise AssertionError(f"region {region}: local block {local} has {actual.size} bytes, "
                                     f"the remote geometry {nbytes} ({shape} x {name})")
            expected = block_bytes(remote_seed, region, remote, nbytes)
            if not np.array_equal(actual, expected):
                differ = np.flatnonzero(actual != expected)
                raise AssertionError(
                    f"region {region} ({name}): local block {local} differs from remote block "
                    f"{remote} of seed {remote_seed}: {differ.size} of {nbytes} bytes differ, the "
                    f"first at byte {int(differ[0])} ({int(actual[differ[0]]):#04x} != "
                    f"{int(expected[differ[0]]):#04x})")


def assert_no_resources(engine: Engine) -> None:
    """Assert that every count in ``engine.live_resources()`` is zero (after close, say)."""
    counts = engine.live_resources()
    left = {name: n for name, n in counts.items() if n != 0}
    if left:
        listed = ", ".join(f"{name}={n}" for name, n in sorted(left.items()))
        raise AssertionError(f"engine {engine.name!r} still holds NIXL resources: {listed}")
