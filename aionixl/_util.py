"""Small helpers the engine's components share: deadlines and argument checks."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager

import anyio

#: Engine states. Only an OPEN engine takes new transfers and peers; a DRAINING one
#: finishes what it has; CLOSING/CLOSED refuse everything.
NEW, OPEN, DRAINING, CLOSING, CLOSED = "new", "open", "draining", "closing", "closed"


def current_task_getter() -> Callable[[], object]:
    """A cheap function naming the running task, for the event loop we are called in.

    anyio's own ``get_current_task()`` builds an info object per call; the backends'
    functions cost a fraction of that, which matters on the transfer hot path.
    """
    try:
        import trio.lowlevel

        trio.lowlevel.current_task()  # raises RuntimeError outside a trio run
        return trio.lowlevel.current_task
    except (ImportError, RuntimeError):
        import asyncio

        return asyncio.current_task


def deadline(seconds: float) -> ContextManager[anyio.CancelScope]:
    """``fail_after`` for a validated positive limit, where ``math.inf`` means none."""
    return anyio.fail_after(seconds if math.isfinite(seconds) else None)


def check_timeout(value: object, what: str) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or math.isnan(value) \
            or value <= 0:
        raise ValueError(f"{what} must be a positive number of seconds, got {value!r}")


def single_leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
