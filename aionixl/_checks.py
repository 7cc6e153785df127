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


def check_int(value: object, what: str, low: int) -> int:
    """``value`` if it is an int (not a bool) of at least ``low``, else ``ValueError``."""
    if type(value) is not int or value < low:
        raise ValueError(f"{what} must be an int >= {low}, got {value!r}")
    return value


def check_text(value: object, what: str) -> str:
    """``value`` if it is a non-empty str, else ``ValueError``."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{what} must be a non-empty str, got {value!r}")
    return value


def single_leaf(exc: BaseException) -> BaseException:
    """The one exception inside (nested) exception groups, else ``exc`` itself."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
