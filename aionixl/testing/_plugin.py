"""The fixtures of ``pytest_plugins = ["aionixl.testing"]`` (private; pytest registers this
module because ``aionixl.testing`` names it in its own ``pytest_plugins``, so importing
aionixl.testing never imports pytest, and nothing imports this module but pytest and tests).

One fixture has to work under two async plugins that run async fixtures differently:

- anyio's plugin runs a plain ``async def`` fixture when the test uses ``anyio_backend``
  (asyncio or trio), setup, test and teardown in one runner task;
- pytest-asyncio (strict mode) runs only fixtures marked with ``pytest_asyncio.fixture``,
  and runs setup and teardown as two separate tasks of the test's loop.

So each public fixture is a plain synchronous fixture that looks at the test and asks for
the matching private variant. The pytest-asyncio variant of ``aionixl_pair`` enters the
engines in a task of its own that lives until teardown: an engine's anyio task group must
be exited by the task that entered it, which setup and teardown tasks are not.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import asyncio
import importlib.util
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, TypeVar

import pytest

from ._pair import Pair, engine_pair
from ._remote import RemoteEngine, RemoteEngineError

HAVE_PYTEST_ASYNCIO = importlib.util.find_spec("pytest_asyncio") is not None

T = TypeVar("T")

PAIR_MARKER = "aionixl_pair"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{PAIR_MARKER}(**kwargs): arguments for aionixl.testing.engine_pair "
                   "used by the aionixl_pair fixture (seed, num_blocks, block_shape, dtypes, config)")


class RemoteEngineFactory:
    """What the ``aionixl_remote`` fixture yields: ``factory(name=None, **kwargs)`` makes a
    :class:`RemoteEngine` (same arguments), not started yet. Start it with
    ``async with factory(seed=1) as remote:`` or ``remote = await factory(seed=1)``; every
    one made is stopped and reaped at teardown, and one that died on its own without
    being reported fails the teardown."""

    def __init__(self) -> None:
        self.made: list[RemoteEngine] = []

    def __call__(self, name: str | None = None, **kwargs: Any) -> RemoteEngine:
        remote = RemoteEngine(name, **kwargs)
        self.made.append(remote)
        return remote

    async def aclose(self) -> None:
        deaths: list[RemoteEngineError] = []
        for remote in self.made:
            died = await remote.aclose()
            if died is not None:
                deaths.append(died)
        if deaths:
            raise deaths[0]


def _variant(request: pytest.FixtureRequest, fixture: str) -> str:
    """The private fixture that runs ``fixture`` under the plugin running this test."""
    if "anyio_backend" in request.fixturenames:
        return f"_{fixture}_anyio"
    if HAVE_PYTEST_ASYNCIO and request.config.pluginmanager.has_plugin("asyncio"):
        return f"_{fixture}_asyncio"
    raise pytest.UsageError(
        f"{fixture} needs an async test run by anyio's pytest plugin (@pytest.mark.anyio) "
        "or by pytest-asyncio (@pytest.mark.asyncio)")


def _pair_kwargs(request: pytest.FixtureRequest) -> dict[str, Any]:
    marker = request.node.get_closest_marker(PAIR_MARKER)
    return dict(marker.kwargs) if marker is not None else {}


@pytest.fixture
def aionixl_remote(request: pytest.FixtureRequest) -> RemoteEngineFactory:
    """A factory of :class:`aionixl.testing.RemoteEngine`; all of them stopped at teardown."""
    factory: RemoteEngineFactory = request.getfixturevalue(_variant(request, "aionixl_remote"))
    return factory


@pytest.fixture
def aionixl_pair(request: pytest.FixtureRequest) -> Pair:
    """An :func:`aionixl.testing.engine_pair` (arguments from ``@pytest.mark.aionixl_pair``),
    open for the test and closed at teardown."""
    pair: Pair = request.getfixturevalue(_variant(request, "aionixl_pair"))
    return pair


# -- anyio (asyncio and trio): plain async fixtures

@pytest.fixture
async def _aionixl_remote_anyio() -> AsyncIterator[RemoteEngineFactory]:
    factory = RemoteEngineFactory()
    try:
        yield factory
    finally:
        await factory.aclose()


@pytest.fixture
async def _aionixl_pair_anyio(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
    async with engine_pair(**_pair_kwargs(request)) as pair:
        yield pair


# -- pytest-asyncio (strict or auto mode, function-scoped loop)

@asynccontextmanager
async def _hosted(make: Callable[[], AbstractAsyncContextManager[T]]) -> AsyncIterator[T]:
    """Enter ``make()`` in a task of its own and leave it there on exit."""
    entered: asyncio.Future[T] = asyncio.get_running_loop().create_future()
    leave = asyncio.Event()

    async def host() -> None:
        try:
            async with make() as value:
                entered.set_result(value)
                await leave.wait()
        except BaseException as exc:
            if not entered.done():
                if isinstance(exc, asyncio.CancelledError):
                    entered.cancel()
                else:
                    entered.set_exception(exc)
                return
            raise

    task = asyncio.create_task(host())
    try:
        value = await entered
    except BaseException:
        leave.set()
        await asyncio.gather(task, return_exceptions=True)
        raise
    try:
        yield value
    finally:
        leave.set()
        await task


if HAVE_PYTEST_ASYNCIO:
    import pytest_asyncio

    @pytest_asyncio.fixture(loop_scope="function")
    async def _aionixl_remote_asyncio() -> AsyncIterator[RemoteEngineFactory]:
        factory = RemoteEngineFactory()
        try:
            yield factory
        finally:
            await factory.aclose()

    @pytest_asyncio.fixture(loop_scope="function")
    async def _aionixl_pair_asyncio(request: pytest.FixtureRequest) -> AsyncIterator[Pair]:
        kwargs = _pair_kwargs(request)
        async with _hosted(lambda: engine_pair(**kwargs)) as pair:
            yield pair
