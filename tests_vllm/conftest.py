"""vLLM interop tests: run under the vLLM venv (``./run vllm-test``); skipped without vLLM."""

from __future__ import annotations

import importlib.util

import pytest

#: Without vLLM (the lean test venv) there is nothing to run here.
collect_ignore_glob = ["test_*.py"] if importlib.util.find_spec("vllm") is None else []


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)
