"""Fixtures only: the anyio backends (asyncio, trio, and asyncio on uvloop), the forced
fallback from asyncio's private task table, and aionixl.testing's plugin (``aionixl_remote``,
``aionixl_pair``). What tests share besides fixtures is in ``helpers.py``."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from aionixl import _parking

from .etcd_server import EtcdServer

pytest_plugins = ["aionixl.testing"]  # aionixl_remote, aionixl_pair

try:
    import uvloop  # noqa: F401  # the test extra installs it; without it the param skips
    HAVE_UVLOOP = True
except ImportError:
    HAVE_UVLOOP = False

#: The backends every async test runs on; a test names one with ``anyio_backend_name``
#: (anyio's fixture), never by comparing ``anyio_backend`` (uvloop's is a tuple).
BACKENDS = [
    pytest.param("asyncio", id="asyncio"),
    pytest.param("trio", id="trio"),
    pytest.param(("asyncio", {"use_uvloop": True}), id="uvloop",
                 marks=pytest.mark.skipif(not HAVE_UVLOOP, reason="uvloop is not installed")),
]


#: The modules whose async tests run on uvloop too: those whose subject is how the engine
#: rides the event loop (parking and loop turns, coalescing, the poller and the drainer, zmq
#: sockets through the loop's reader, the state machines on the fake agent). The others run
#: on asyncio and trio: uvloop is asyncio's API over another loop, and a third run of them
#: cost CI over a minute of two cores (docs/testing.md).
UVLOOP_MODULES = frozenset({
    "test_engine", "test_push", "test_fence", "test_portability", "test_asyncio_server", "test_listener",
    "test_vllm_serve", "test_fake_agent", "test_coalesce_merging", "test_coalesce_leaving",
    "test_coalesce_failures", "test_coalesce_notify", "test_coalesce_wakeups",
})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """uvloop only for :data:`UVLOOP_MODULES`."""
    def on_uvloop_elsewhere(item: pytest.Item) -> bool:
        spec, module = getattr(item, "callspec", None), getattr(item, "module", None)
        return spec is not None and "anyio_backend" in spec.params and "uvloop" in spec.id.split("-") \
            and module is not None and module.__name__.rpartition(".")[2] not in UVLOOP_MODULES

    off = [item for item in items if on_uvloop_elsewhere(item)]
    if off:
        config.hook.pytest_deselected(items=off)
        dropped = set(map(id, off))
        items[:] = [item for item in items if id(item) not in dropped]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--hide-asyncio-task-table", action="store_true",
        help="engines see asyncio's private task table empty, as on Python 3.14+ (whose C tasks "
             "no longer fill it), and fall back to asyncio.current_task")


@pytest.fixture(params=BACKENDS)
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(autouse=True)
def _hidden_task_table(request: pytest.FixtureRequest) -> Iterator[None]:
    if not request.config.getoption("--hide-asyncio-task-table"):
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        hide_task_table(mp)
        yield


def hide_task_table(mp: pytest.MonkeyPatch) -> None:
    """Engines opened from now on find asyncio's private task table empty, as on Python 3.14.

    Where asyncio.current_task is the C function (3.12+), the table itself is emptied, for
    everyone, exactly as 3.14 leaves it. On 3.11 asyncio.current_task (and anyio) read that
    very table, so only the engine's look at it is emptied."""
    if asyncio.current_task.__module__ == "_asyncio":
        mp.setattr(asyncio.tasks, "_current_tasks", {})
    else:
        mp.setattr(_parking, "_private_task_table", lambda asyncio: {})


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdServer]:
    """One real etcd per test module (tests/etcd_server.py)."""
    server = EtcdServer(tmp_path_factory.mktemp("etcd"))
    server.start()
    try:
        yield server
    finally:
        server.stop()
