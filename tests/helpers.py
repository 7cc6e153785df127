"""What the tests share beyond fixtures, built on :mod:`aionixl.testing`.

``conftest.py`` holds only fixtures; tests import these with ``from .helpers import ...``
(``tests`` is a package, so this works from the repository root with ``python -m pytest``
and for ``python -m tests.<module>`` helper processes alike).

The helpers under "engine internals" reach into an engine's private state (its
``_transfers``, its agent): they import ``aionixl._transfers`` where they run, so that a
change of those internals breaks only the tests that use them, not every test module.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import numpy as np

import aionixl
import aionixl.lowlevel
from aionixl import testing
from aionixl.testing import unique_name
from aionixl.testing._child import threads_by_id

HERE = Path(__file__).parent

#: A NIXL agent name unique in this run (one counter with aionixl.testing's own names).
unique = unique_name


def numpy_cache(num_blocks: int = 16, block_bytes: int = 4096, regions: int = 2,
                seed: int | None = None) -> list[np.ndarray]:
    """``regions`` uint8 arrays of ``num_blocks`` x ``block_bytes``: zeros, or random from ``seed``."""
    if seed is None:
        return [np.zeros((num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (num_blocks, block_bytes), dtype=np.uint8) for _ in range(regions)]


@asynccontextmanager
async def engine_pair(src_cache: list[Any], dst_cache: list[Any],
                      config: aionixl.EngineConfig | None = None, *,
                      tuning: aionixl.lowlevel.Tuning | None = None,
                      ) -> AsyncIterator[tuple[aionixl.Engine, aionixl.Engine, aionixl.Peer]]:
    """:func:`aionixl.testing.engine_pair` over these caches, as (the source engine, which
    listens; the destination engine; the destination's Peer for the source)."""
    async with testing.engine_pair(a_caches=dst_cache, b_caches=src_cache, config=config,
                                   tuning=tuning) as pair:
        yield pair.b, pair.a, pair.peer


def zero_resources(engine: aionixl.Engine) -> bool:
    """Whether every count in ``engine.live_resources()`` is zero (``assert`` it, or use
    :func:`aionixl.testing.assert_no_resources` for a message that lists them)."""
    return all(v == 0 for v in engine.live_resources().values())


threads = threads_by_id  # this process's OS threads, id -> name


def free_port() -> int:
    """A loopback TCP port free at the time of asking."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- engine internals ------------------------------------------------------------------------


def send_raw(engine: aionixl.Engine, agent_name: str, message: bytes) -> None:
    """Send ``message`` as it is, reserved prefix and all, from ``engine``'s NIXL agent to
    the agent ``agent_name`` (one ``engine`` loaded): what a hostile peer can do."""
    agent = engine._local.agent
    assert agent is not None
    agent.send_notif(agent_name, message)


#: A stand-in transfer handle: never NIXL's; release_xfer passes it.
STAND_IN = -1000


def report_inline_ends_as_running(engine: aionixl.Engine) -> set[int]:
    """From now on, a request of ``engine`` that finishes inside its post (in one process,
    often) is reported posted and running instead, under a stand-in handle (never NIXL's;
    ``release_xfer`` passes it), so that the caller waits for it. Returns the stand-ins
    handed out so far: their requests have ended. The test decides what ``check`` says."""
    from aionixl import _nixl

    agent = engine._local.agent
    assert agent is not None
    real_start = agent.start_xfer
    stand_ins = itertools.count(-1000, -1)
    ended: set[int] = set()

    def start_xfer(*args: Any) -> Any:
        handle, state = real_start(*args)
        if state == _nixl.DONE and handle == _nixl.NO_HANDLE:
            handle = next(stand_ins)
            ended.add(handle)
            return handle, _nixl.PROC
        return handle, state

    agent.start_xfer = start_xfer  # type: ignore[method-assign]
    return ended


def finish_inside_posts(engine: aionixl.Engine, target: aionixl.Engine) -> None:
    """From now on the engine's posts return only once their request ended, as an
    in-process read's post usually does by itself: the post polls it, and progresses the
    target's agent too (a small read over shared memory needs its reply), up to a bound.
    What that progress call reads, the target's own next read gets."""
    from aionixl import _nixl

    agent, target_agent = engine._local.agent, target._local.agent
    assert agent is not None and target_agent is not None
    real_start, real_check, real_notifs = agent.start_xfer, agent.check, target_agent.get_notifs
    kept: dict[str, list[bytes]] = {}

    def notifs() -> dict[str, list[bytes]]:
        got = real_notifs()
        for name, messages in kept.items():
            got[name] = messages + got.get(name, [])
        kept.clear()
        return got

    def start_xfer(*args: Any) -> Any:
        handle, state = real_start(*args)
        for _ in range(100_000):
            if state != _nixl.PROC:
                break
            for name, messages in real_notifs().items():
                kept.setdefault(name, []).extend(messages)
            state = real_check(handle)
        if state == _nixl.DONE and handle != _nixl.NO_HANDLE:
            agent.release_xfer(handle)
            return _nixl.NO_HANDLE, _nixl.DONE
        return handle, state

    agent.start_xfer = start_xfer  # type: ignore[method-assign]
    target_agent.get_notifs = notifs  # type: ignore[method-assign]


# ---- coalescing scenarios (tests/test_coalesce_*.py) ---------------------------------------


BLOCKS, BLOCK_BYTES, REGIONS = 64, 1024, 2
#: A window wider than the default: callers a few loop turns apart still arrive together.
TOGETHER = aionixl.lowlevel.Tuning(coalesce_window=0.05)
#: For tests whose first caller must come "together" with the call before it: a window no
#: scheduling pause on a loaded CI machine outlasts (one of 50 ms once made a test's first
#: caller go alone).
TOGETHER_WHATEVER_THE_LOAD = aionixl.lowlevel.Tuning(coalesce_window=5.0)
#: ``RemoteEngine``/``assert_blocks_equal`` geometry of ``numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)``.
GEOMETRY: dict[str, Any] = {"num_blocks": BLOCKS, "block_shape": (BLOCK_BYTES,),
                            "dtypes": ("uint8",) * REGIONS}


def merged(engine: aionixl.Engine) -> tuple[int, int]:
    """The engine's (merged requests, calls they carried) so far."""
    metrics = engine.metrics()
    return metrics.merged_requests, metrics.merged_calls


def posted_requests(engine: aionixl.Engine, side: str) -> list[list[int]]:
    """From now on, each NIXL request the engine posts: its descriptor indices on ``side``
    ("local" or "remote"), in posting order."""
    posted: list[list[int]] = []
    agent = engine._local.agent
    assert agent is not None
    real = agent.start_xfer

    def spy(op: str, local: int, local_idx: Any, remote: int, remote_idx: Any, *rest: Any) -> Any:
        posted.append([int(i) for i in (local_idx if side == "local" else remote_idx)])
        return real(op, local, local_idx, remote, remote_idx, *rest)

    agent.start_xfer = spy  # type: ignore[method-assign, assignment]
    return posted


async def gathering_next(src: aionixl.Engine, dst: aionixl.Engine,
                         peer: aionixl.Peer) -> tuple[Any, Any, Any]:
    """One call from this task, so that the next calls from others gather; from then on
    ``dst``'s posts end inside them (:func:`finish_inside_posts`). Returns its agent and the
    agent's ``start_xfer`` and ``check`` as they are then, for stand-ins to call."""
    await dst.transfer_blocks(peer, [2], [2])
    agent = dst._local.agent
    assert agent is not None
    finish_inside_posts(dst, src)
    return agent, agent.start_xfer, agent.check


@contextlib.asynccontextmanager
async def first_post_reported_running(seed: int) -> AsyncIterator[
        tuple[list[np.ndarray], list[np.ndarray], aionixl.Engine, aionixl.Peer, list[list[int]]]]:
    """An engine pair (``coalesce_window`` 5 s, no inline polls) whose ``dst`` gathers the
    next calls; ``dst``'s first post from then on finishes but is reported running (handle
    ``STAND_IN``, for the test's own ``check`` to answer). Yields the source and destination
    caches, ``dst``, its peer, and every post's local indices, in order."""
    from aionixl import _nixl

    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=seed)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=seed + 1)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (src, dst, peer):
        agent, real_start, _ = await gathering_next(src, dst, peer)
        posts: list[list[int]] = []

        def start_xfer(*args: Any) -> Any:
            posts.append([int(i) for i in args[2]])
            handle, state = real_start(*args)
            return (STAND_IN, _nixl.PROC) if len(posts) == 1 else (handle, state)

        agent.start_xfer = start_xfer  # type: ignore[method-assign]
        yield src_cache, dst_cache, dst, peer, posts


async def together(call: Callable[[int, float], Awaitable[aionixl.TransferResult]],
                   timeouts: dict[int, float]) -> dict[int, object]:
    """``call(key, timeout)`` for every key at once (started in the dict's order); each
    key's ``TransferResult`` or ``TransferTimeoutError``."""
    outcomes: dict[int, object] = {}

    async def one(key: int, timeout: float) -> None:
        try:
            outcomes[key] = await call(key, timeout)
        except aionixl.TransferTimeoutError as exc:
            outcomes[key] = exc

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            for key, timeout in timeouts.items():
                tg.start_soon(one, key, timeout)
    return outcomes
