"""The engine on interpreters and loops other than this one's: asyncio without its private
task table (Python 3.14+ leaves it empty), and asyncio on uvloop.

The whole coalescing suite also runs with the table hidden (``--hide-asyncio-task-table``,
a second pass in CI); these tests pin down the detection itself and the two behaviours that
broke without a fallback: callers of other tasks merging, and a cancellation a caller
absorbed being raised again.
"""

from __future__ import annotations

import asyncio
import functools
import types
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
from aionixl import _parking

from .conftest import hide_task_table
from .helpers import BLOCK_BYTES, BLOCKS, REGIONS, engine_pair, merged, numpy_cache, zero_resources

pytestmark = pytest.mark.anyio

asyncio_only = pytest.mark.parametrize("anyio_backend", ["asyncio"])


def _asyncio_like(**tasks: Any) -> Any:
    """A stand-in for the asyncio module: its public ``current_task`` and, if given, a
    ``tasks`` namespace with a private table."""
    return types.SimpleNamespace(current_task=asyncio.current_task,
                                 tasks=types.SimpleNamespace(**tasks))


@asyncio_only
async def test_the_private_task_table_is_used_only_where_it_answers() -> None:
    loop = asyncio.get_running_loop()
    me = asyncio.current_task()
    here = _parking._asyncio_current_task(asyncio, loop)
    table = _parking._private_task_table(asyncio)  # what the engine sees of it
    if table is not None and table.get(loop) is me:  # 3.11-3.13, unless hidden
        assert isinstance(here, functools.partial) and here.func == table.get
    else:  # 3.14+, or this run hides it (--hide-asyncio-task-table)
        assert isinstance(here, functools.partial) and here.func is asyncio.current_task
    assert here() is me
    for stand_in in (_asyncio_like(_current_tasks={}),  # as on 3.14: there but empty
                     _asyncio_like(),  # not there at all
                     _asyncio_like(_current_tasks={loop: object()}),  # answers wrong
                     _asyncio_like(_current_tasks=None)):
        current = _parking._asyncio_current_task(stand_in, loop)
        assert isinstance(current, functools.partial) and current.func is asyncio.current_task
        assert current() is me


@asyncio_only
async def test_with_the_table_hidden_the_loop_tools_still_name_each_task(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hide_task_table(monkeypatch)
    tools = _parking.loop_tools()
    seen: dict[int, object] = {}

    async def who(i: int) -> None:
        await asyncio.sleep(0)
        seen[i] = tools.current_task()

    tasks = [asyncio.create_task(who(i)) for i in range(3)]
    await asyncio.gather(*tasks)
    assert [seen[i] for i in range(3)] == tasks


@asyncio_only
async def test_with_the_table_hidden_two_hundred_concurrent_reads_merge_and_are_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    hide_task_table(monkeypatch)
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=7)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    calls = 200
    async with engine_pair(src_cache, dst_cache) as (_src, dst, peer):
        results: list[aionixl.TransferResult] = []

        async def read(i: int) -> None:
            block = i % BLOCKS
            results.append(await dst.transfer_blocks(peer, [block], [BLOCKS - 1 - block], timeout=30))

        async with anyio.create_task_group() as tg:
            for i in range(calls):
                tg.start_soon(read, i)
        requests, riders = merged(dst)
        assert requests >= 1 and riders > requests, (requests, riders)
        assert len(results) == calls and all(r.blocks == 1 for r in results)
        assert dst.metrics().transfers["read"]["ok"] == calls
        for region in range(REGIONS):
            assert np.array_equal(dst_cache[region], src_cache[region][::-1])
    assert zero_resources(dst)


@asyncio_only
async def test_with_the_table_hidden_an_absorbed_cancellation_is_raised_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``recancel`` names the task that absorbed a cancellation; with no task found it would
    drop the cancellation silently."""
    hide_task_table(monkeypatch)
    tools = _parking.loop_tools()
    parked = asyncio.Event()
    seen: list[str] = []

    async def absorber() -> None:
        try:
            parked.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            seen.append("absorbed")
            tools.recancel(exc)
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError:
            seen.append("raised")
            raise
        seen.append("went on")

    task = asyncio.create_task(absorber())
    await parked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == ["absorbed", "raised"]


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}),
                                                        id="uvloop")])
async def test_the_uvloop_backend_really_runs_uvloop() -> None:
    """The third backend of this suite is what it says (a silent fallback to asyncio's own
    loop would test nothing new)."""
    uvloop = pytest.importorskip("uvloop")
    assert isinstance(asyncio.get_running_loop(), uvloop.Loop)
