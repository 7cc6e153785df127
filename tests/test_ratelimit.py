"""The rate-limited log that keeps peer-triggered warnings from flooding."""

from __future__ import annotations

import logging

import pytest

from aionixl._ratelimit import RateLimitedLog


def test_one_record_per_key_per_interval_and_the_count_of_the_rest(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [100.0]
    monkeypatch.setattr("aionixl._ratelimit.time.monotonic", lambda: clock[0])
    limited = RateLimitedLog(logging.getLogger("aionixl.test"), interval=10.0)
    with caplog.at_level(logging.WARNING, logger="aionixl.test"):
        results = [limited.log(logging.WARNING, "bad", "bad input %d", i) for i in range(500)]
        assert results.count(True) == 1 and limited.suppressed("bad") == 499
        assert limited.log(logging.WARNING, "other", "another kind")  # keys are independent
        clock[0] += 10.5
        assert limited.log(logging.WARNING, "bad", "bad input %d", 500)
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["bad input 0", "another kind",
                        "bad input 500 (499 similar message(s) suppressed in the last 10 s)"]
    assert limited.suppressed("bad") == 0
