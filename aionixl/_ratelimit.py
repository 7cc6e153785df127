"""Warnings that hostile or failing peers cannot turn into a log flood."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping


class RateLimitedLog:
    """Logs at most one record per ``key`` every ``interval`` seconds.

    Records held back are counted, and the next one that gets through says how many
    similar ones were suppressed, so nothing disappears without a trace.
    """

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, message: str, *args: object,
            extra: Mapping[str, object] | None = None) -> bool:
        """Log unless ``key`` logged within the interval; True when it was logged.

        ``extra`` becomes attributes of the record (structured fields for log handlers).
        """
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return False
        self._last[key] = now
        held = self._suppressed.pop(key, 0)
        if held:
            message += " (%d similar message(s) suppressed in the last %.0f s)"
            args = (*args, held, now - last if last is not None else 0.0)
        self._logger.log(level, message, *args, extra=extra)
        return True

    def suppressed(self, key: str) -> int:
        return self._suppressed.get(key, 0)


class Refusals:
    """Messages from peers that the engine refused (malformed, over a bound, from a sender
    not entitled to them), counted by kind and logged through a :class:`RateLimitedLog`,
    one key per kind: a peer sending millions costs a counter each and a log line every
    interval."""

    def __init__(self, noisy: RateLimitedLog) -> None:
        self._noisy = noisy
        #: kind -> messages refused (``EngineMetrics.messages_refused``).
        self.counts: dict[str, int] = {}

    def refuse(self, kind: str, sender: str, reason: str) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self._noisy.log(logging.WARNING, f"refused-{kind}", "refused a %s message from %r: %s",
                        kind, sender[:80], reason[:300])
