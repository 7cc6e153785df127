"""Argument checks and deadlines that every layer uses."""

from __future__ import annotations

import math
import sys
from contextlib import AbstractContextManager as ContextManager

import anyio


def deadline(seconds: float) -> ContextManager[anyio.CancelScope]:
    """``fail_after`` for a validated positive limit, where ``math.inf`` means none."""
    return anyio.fail_after(seconds if math.isfinite(seconds) else None)


#: The largest number of seconds a deadline can hold (an int past it overflows a float).
MAX_SECONDS = sys.float_info.max


def check_timeout(value: object, what: str) -> None:
    """``value`` is a positive number of seconds, ``math.inf`` for no limit; else ValueError
    (NaN, and an int too large for a float, included)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= math.inf \
            or (isinstance(value, int) and value > MAX_SECONDS):
        raise ValueError(f"{what} must be a positive number of seconds, got {_shown(value)}")


def _shown(value: object) -> str:
    """``value`` for an error message: an int too long to print (Python refuses past 4300
    digits) by its size, any repr clipped to 40 characters."""
    if isinstance(value, int) and value.bit_length() > 128:
        return f"an int of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
