from __future__ import annotations

import math
from typing import Any

import pytest

import aionixl
import aionixl.lowlevel


@pytest.mark.parametrize("kwargs", [
    {"transfer_timeout": 0}, {"transfer_timeout": -1}, {"close_timeout": math.inf},
    {"max_pending_notification_bytes": 0}, {"max_pending_notification_bytes": 1.5},
    {"backends": ()}, {"compat": {"a": 1}}, {"connect_retries": -1}, {"connect_retries": True},
    {"handshake_secret": b"short"}, {"handshake_secret": "text-secret-16-bytes"}, {"coalesce": 1},
])
def test_bad_config_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        aionixl.EngineConfig(**kwargs)


@pytest.mark.parametrize("kwargs", [
    {"idle_poll_interval": math.nan}, {"max_pending_notifications": 0},
    {"max_handshake_bytes": True}, {"inline_polls": -1},
    {"connect_backoff": 0}, {"connect_attempt_timeout": -2}, {"close_grace": math.nan},
    {"peer_probe_interval": 0}, {"coalesce_max_blocks": 0}, {"coalesce_max_call_bytes": 0},
    {"coalesce_window": -1e-6}, {"coalesce_window": math.inf},
])
def test_bad_tuning_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        aionixl.lowlevel.Tuning(**kwargs)


def test_config_copies_compat() -> None:
    compat = {"model": "x"}
    cfg = aionixl.EngineConfig(compat=compat, transfer_timeout=math.inf)
    compat["model"] = "y"
    assert cfg.compat == {"model": "x"}


def test_engine_arguments_are_checked_up_front() -> None:
    with pytest.raises(ValueError):
        aionixl.Engine("", [])
    with pytest.raises(TypeError):
        aionixl.Engine("x", [bytearray(4)], config={"a": 1})  # type: ignore[arg-type]
