"""The loop tools the transfer path parks and wakes callers with (asyncio and trio)."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from aionixl import _parking

pytestmark = pytest.mark.anyio


@pytest.fixture(params=["fast", "public"])
def tools(request: pytest.FixtureRequest, anyio_backend_name: str,
          monkeypatch: pytest.MonkeyPatch) -> str:
    """On trio, both trio's internals ("fast": the prebuilt wait message, the run's own
    scheduler) and its public functions (the fallback for a trio without those)."""
    if request.param == "public":
        if anyio_backend_name != "trio":
            pytest.skip("only trio has a fallback")
        monkeypatch.setattr(_parking, "_trio_sleep", lambda abort: None)
        monkeypatch.setattr(_parking, "_trio_run_context", lambda: None)
    return str(request.param)


def bound(_: str) -> _parking.LoopTools:
    """The tools of the running loop."""
    return _parking.loop_tools()


async def test_unpark_all_wakes_every_sleeper_once(tools: str) -> None:
    t = bound(tools)
    waiters: list[Any] = []
    woke: list[int] = []

    async def sleeper(i: int) -> None:
        await t.park(waiters)
        woke.append(i)

    async with anyio.create_task_group() as tg:
        for i in range(5):
            tg.start_soon(sleeper, i)
        while len(waiters) < 5:
            await anyio.sleep(0)
        assert t.unpark_all(waiters) == 5
        assert waiters == []
        assert t.unpark_all(waiters) == 0
    assert sorted(woke) == [0, 1, 2, 3, 4]


async def test_a_cancelled_sleeper_leaves_alone_and_is_not_woken_again(tools: str) -> None:
    t = bound(tools)
    waiters: list[Any] = []
    woke: list[int] = []
    cancelled: list[int] = []

    async def sleeper(i: int, scope: anyio.CancelScope) -> None:
        with scope:
            try:
                await t.park(waiters)
            except anyio.get_cancelled_exc_class():
                cancelled.append(i)
                raise
            woke.append(i)

    scopes = [anyio.CancelScope() for _ in range(4)]
    async with anyio.create_task_group() as tg:
        for i, scope in enumerate(scopes):
            tg.start_soon(sleeper, i, scope)
        while len(waiters) < 4:
            await anyio.sleep(0)
        scopes[1].cancel()
        # Woken at once, before the cancelled task has even run: it must not be woken twice.
        assert t.unpark_all(waiters) == 3
    assert sorted(woke) == [0, 2, 3]
    assert cancelled == [1]


async def test_a_sleeper_woken_and_parked_again_is_woken_by_the_next_call(tools: str) -> None:
    t = bound(tools)
    waiters: list[Any] = []
    rounds = 0

    async def sleeper() -> None:
        nonlocal rounds
        for _ in range(3):
            await t.park(waiters)
            rounds += 1

    async with anyio.create_task_group() as tg:
        tg.start_soon(sleeper)
        for expected in range(3):
            while not waiters:
                await anyio.sleep(0)
            assert rounds == expected
            assert t.unpark_all(waiters) == 1
    assert rounds == 3


async def test_a_sleeper_listed_twice_is_woken_once(tools: str) -> None:
    """A cancelled sleeper stays listed; if it parks on the same list again it is listed twice."""
    t = bound(tools)
    waiters: list[Any] = []
    woke = 0

    async def sleeper(scope: anyio.CancelScope) -> None:
        nonlocal woke
        with scope:
            await t.park(waiters)
        await t.park(waiters)  # the cancelled park left it listed
        woke += 1

    scope = anyio.CancelScope()
    async with anyio.create_task_group() as tg:
        tg.start_soon(sleeper, scope)
        while not waiters:
            await anyio.sleep(0)
        scope.cancel()
        while len(waiters) < 2:
            await anyio.sleep(0)
        assert t.unpark_all(waiters) == 1
    assert woke == 1



async def test_unpark_all_with_a_limit_wakes_that_many_from_the_front(tools: str) -> None:
    t = bound(tools)
    waiters: list[Any] = []
    woke: list[int] = []

    async def sleeper(i: int, scope: anyio.CancelScope) -> None:
        with scope:
            await t.park(waiters)
            woke.append(i)

    scopes = [anyio.CancelScope() for _ in range(6)]
    async with anyio.create_task_group() as tg:
        for i, scope in enumerate(scopes):
            tg.start_soon(sleeper, i, scope)
            while len(waiters) <= i:  # parked in this order
                await anyio.sleep(0)
        scopes[1].cancel()
        assert t.unpark_all(waiters, 2) == 2  # 0 and 2: the cancelled 1 does not count
        assert len(waiters) == 3
        await anyio.sleep(0.01)
        assert sorted(woke) == [0, 2]
        assert t.unpark_all(waiters, 2) == 2
        assert t.unpark_all(waiters, 2) == 1
        assert waiters == []
    assert sorted(woke) == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_recancel_on_asyncio_raises_the_same_cancellation_at_the_next_await() -> None:
    """A task that absorbed a CancelledError hands it to ``recancel``: its next await raises
    one with the same message, and ``Task.cancelling()`` counts it once, as before."""
    import asyncio

    tools = _parking.loop_tools()
    assert tools.redelivers_cancel
    seen: list[tuple[str, Any, int]] = []
    parked = asyncio.Event()

    async def absorber() -> None:
        task = asyncio.current_task()
        assert task is not None
        try:
            parked.set()
            await asyncio.Event().wait()
        except asyncio.CancelledError as exc:
            seen.append(("absorbed", exc.args, task.cancelling()))
            tools.recancel(exc)
        try:
            await asyncio.sleep(0)
        except asyncio.CancelledError as exc:
            seen.append(("raised", exc.args, task.cancelling()))
            raise
        seen.append(("went on", (), task.cancelling()))

    task = asyncio.create_task(absorber())
    await parked.wait()
    task.cancel("why")
    with pytest.raises(asyncio.CancelledError):
        await task
    assert seen == [("absorbed", ("why",), 1), ("raised", ("why",), 1)]


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_recancel_on_trio_leaves_the_cancellation_to_trio() -> None:
    """Trio raises an absorbed cancellation again by itself (the scope stays cancelled)."""
    import trio

    tools = _parking.loop_tools()
    assert tools.redelivers_cancel
    seen: list[str] = []
    with trio.CancelScope() as scope:
        scope.cancel()
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled as exc:
            seen.append("absorbed")
            tools.recancel(exc)
        try:
            await trio.lowlevel.checkpoint()
        except trio.Cancelled:
            seen.append("raised")
            raise
    assert seen == ["absorbed", "raised"] and scope.cancelled_caught


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_on_trio_the_fast_tools_find_the_internals_they_use() -> None:
    """The fast trio tools read trio's run state and prebuilt wait message; if a trio
    release renames them the tools fall back to the public functions quietly, slower. This
    says so out loud."""
    import trio

    run_context = _parking._trio_run_context()
    assert run_context is not None
    assert run_context.task is trio.lowlevel.current_task()
    assert _parking._trio_sleep(lambda _: trio.lowlevel.Abort.SUCCEEDED) is not None


def test_on_an_asyncio_loop_with_its_own_futures_park_uses_them() -> None:
    """Parking builds asyncio's Future directly only on asyncio's own loops; a loop class
    with a create_future of its own (uvloop has one) gets its futures from it."""
    import asyncio

    made: list[asyncio.Future[Any]] = []

    class Loop(asyncio.SelectorEventLoop):
        def create_future(self) -> asyncio.Future[Any]:
            future = super().create_future()
            made.append(future)
            return future

    async def park_once() -> list[Any]:
        t = _parking.loop_tools()
        waiters: list[Any] = []
        sleeper = asyncio.ensure_future(t.park(waiters))
        while not waiters:
            await asyncio.sleep(0)
        assert t.unpark_all(waiters) == 1
        await sleeper
        return waiters

    for loop_class, expected in ((Loop, 1), (asyncio.SelectorEventLoop, 0)):
        made.clear()
        loop = loop_class()
        try:
            assert loop.run_until_complete(park_once()) == []
        finally:
            loop.close()
        assert len(made) == expected
