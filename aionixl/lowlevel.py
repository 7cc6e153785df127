"""The engine's low-level side: performance tunables and hooks for tools that drive NIXL
beside an engine (as ``trio.lowlevel`` is trio's). Nothing here is needed to use an engine,
and these names may change between releases.

- :class:`Tuning`: polling cadences, coalescing thresholds, push chunking, NIXL's progress
  thread and telemetry; ``Engine(..., tuning=Tuning(...))``.
- :func:`nixl_metadata`, :func:`poll_nixl`: for tools that read an engine's registered
  memory through NIXL directly, with no aionixl handshake (the bench's bare-NIXL and
  threaded contenders), and keep NIXL progressing in a busy serving target.
- :func:`trace_wakeups`: the bench's wake-up latency.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ._config import Tuning

if TYPE_CHECKING:
    from ._engine import Engine
    from ._notifications import Notification

__all__ = ["Tuning", "nixl_metadata", "poll_nixl", "trace_wakeups"]


def nixl_metadata(engine: Engine) -> bytes:
    """``engine``'s NIXL agent metadata (b"" unless open)."""
    return engine._nixl_metadata()


def poll_nixl(engine: Engine) -> list[Notification]:
    """Make one NIXL progress call for ``engine`` now, as its drainer does, and return the
    notifications that arrived for callers (taken by the caller: they do not reach
    ``wait_notification``). The engine's own messages, and the read-dones and heartbeats
    of live leases, are handled as usual. For a process that must keep NIXL progressing
    every loop turn (a busy serving target)."""
    return engine._poll_nixl()


def trace_wakeups(engine: Engine, trace: list[int] | None) -> None:
    """From now on append to ``trace``, per transfer ``engine``'s poller saw end, the
    nanoseconds from that moment to its caller running again; None stops it."""
    engine._trace_wakeups(trace)
