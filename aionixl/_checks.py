"""Argument checks and deadlines that every layer uses."""

from __future__ import annotations

import math
from contextlib import AbstractContextManager as ContextManager

import anyio


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
