"""Functions tests/test_hostile.py runs inside a RemoteEngine child, the attacked engine,
by name (``"tests.hostile_ops:..."``): what its process alone measures of itself."""

from __future__ import annotations

import os

import anyio

import aionixl

_TICK = 0.005


class _Watch:
    """The longest the child's event loop went without running the ticking workload
    (seconds late), and its highest RSS since the last ``report``."""

    longest_stall = 0.0
    rss_peak = 0


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


async def watch(engine: aionixl.Engine, args: bytes) -> None:
    """A workload: tick every 5 ms, noting how late each tick ran and the RSS."""
    while True:
        start = anyio.current_time()
        await anyio.sleep(_TICK)
        _Watch.longest_stall = max(_Watch.longest_stall, anyio.current_time() - start - _TICK)
        _Watch.rss_peak = max(_Watch.rss_peak, _rss())


async def report(engine: aionixl.Engine, args: bytes) -> dict[str, object]:
    """A call: the watch's findings since the last report (then starting over), the RSS
    now, the engine's refusals and whether it is closed."""
    found = {"longest_stall": _Watch.longest_stall, "rss_peak": max(_Watch.rss_peak, _rss()),
             "rss": _rss(), "refused": dict(engine.metrics().messages_refused), "closed": engine.closed}
    _Watch.longest_stall, _Watch.rss_peak = 0.0, 0
    return found
