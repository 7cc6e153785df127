"""Functions that tests/test_testing.py runs inside RemoteEngine children, by name
(``"tests.remote_ops:..."``): the child imports this module, the test never calls them."""

from __future__ import annotations

import threading

import anyio
import msgspec

import aionixl

#: What the ``count`` workload has counted, per process (read back by ``counted``).
_ticks = 0


async def count(engine: aionixl.Engine, args: bytes) -> None:
    """A workload: count ticks every ``args`` (msgpack float) seconds until stopped."""
    global _ticks
    period = msgspec.msgpack.decode(args, type=float)
    while True:
        await anyio.sleep(period)
        _ticks += 1


async def counted(engine: aionixl.Engine, args: bytes) -> dict[str, object]:
    """A call: the workload's ticks and the engine's name."""
    return {"ticks": _ticks, "name": engine.name}


async def modules(engine: aionixl.Engine, args: bytes) -> list[str]:
    """A call: which of the modules named in ``args`` (comma-separated) are imported here."""
    import sys

    return [name for name in args.decode().split(",") if name in sys.modules]


async def fail(engine: aionixl.Engine, args: bytes) -> None:
    raise KeyError(args.decode())


async def start_a_thread(engine: aionixl.Engine, args: bytes) -> int:
    """A call that leaves a thread running (daemon: the process still exits)."""
    threading.Thread(target=threading.Event().wait, daemon=True).start()
    return threading.active_count()
