"""Fixtures only: both anyio backends, and aionixl.testing's plugin (``aionixl_remote``,
``aionixl_pair``). What tests share besides fixtures is in ``helpers.py``."""

from __future__ import annotations

import pytest

pytest_plugins = ["aionixl.testing"]  # aionixl_remote, aionixl_pair


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
