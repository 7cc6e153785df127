"""Two connected engines in this process.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from aionixl import Engine, EngineConfig, Peer
from aionixl.lowlevel import Tuning

from ._caches import DEFAULT_BLOCK_SHAPE, DEFAULT_DTYPES, DEFAULT_NUM_BLOCKS, make_caches, unique_name


class Pair(NamedTuple):
    """Two connected engines: ``a`` connected to ``b`` (which listens); ``peer`` is ``b`` as
    ``a`` sees it. ``a_caches``/``b_caches`` are their regions."""

    a: Engine
    b: Engine
    peer: Peer
    a_caches: list[Any]
    b_caches: list[Any]


@asynccontextmanager
async def engine_pair(*, seed: int = 0, num_blocks: int = DEFAULT_NUM_BLOCKS,
                      block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE,
                      dtypes: Sequence[str] = DEFAULT_DTYPES, config: EngineConfig | None = None,
                      a_caches: Sequence[Any] | None = None, b_caches: Sequence[Any] | None = None,
                      tuning: Tuning | None = None) -> AsyncIterator[Pair]:
    """Two engines in this process: ``a`` over ``make_caches(seed, ...)``, ``b`` over
    ``make_caches(seed + 1, ...)``, ``b`` listening on loopback and ``a`` connected to it.

    ``a_caches``/``b_caches`` replace the generated regions (any layout the engine takes);
    ``config`` and ``tuning`` (``aionixl.lowlevel.Tuning``) go to both; both engines are
    closed on exit.
    """
    a_regions = list(a_caches) if a_caches is not None else make_caches(seed, num_blocks, block_shape, dtypes)
    b_regions = (list(b_caches) if b_caches is not None
                 else make_caches(seed + 1, num_blocks, block_shape, dtypes))
    async with Engine(unique_name("pair-b"), b_regions, listen="tcp://127.0.0.1:0", config=config,
                      tuning=tuning) as b, \
            Engine(unique_name("pair-a"), a_regions, listen=None, config=config, tuning=tuning) as a:
        assert b.address is not None
        peer = await a.connect(b.address, timeout=30)
        yield Pair(a, b, peer, a_regions, b_regions)
