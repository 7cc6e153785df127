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
