"""The child process behind :class:`aionixl.testing.RemoteEngine` (private).

    python -c BOOTSTRAP SPEC      (BOOTSTRAP: see :data:`BOOTSTRAP`)

``SPEC`` is the hex of a msgpack :class:`Spec` (name, seed, geometry, listen, backend, the
``EngineConfig`` msgpack-encoded, the etcd discovery to register with, and a workload). The
child serves an engine over ``make_caches(seed, ...)``'s bytes (``byte_caches``: numpy, so
the child never imports torch) and answers control requests from
its parent. A workload (``"module:function"``) runs as a task beside the control loop,
``await function(engine, workload_args)``, until the child stops; the ``call`` request runs
``await function(engine, args)`` once and replies with what it returns (JSON-able). Both are
named by string, so that what runs in the child (the soak's worker, the fleet's fan-in) is
imported there and never by this package.

The control channel is this process's stdin (requests) and a private duplicate of the
original stdout (replies), both in the line protocol of :mod:`aionixl._lines`. File
descriptor 1 itself is pointed at stderr before NIXL is loaded, so whatever NIXL, UCX or
Python print cannot corrupt a reply; and the parent ignores any line that is not a
control line anyway.

This module imports only aionixl's public API, :mod:`aionixl._lines` and the cache layer
of :mod:`aionixl.testing`; the parent side (``_remote``) imports it for :class:`Spec`,
:class:`Request`, :data:`BOOTSTRAP` and :data:`LISTEN_FAILED`.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Coroutine
from typing import Any

import anyio
import msgspec

import aionixl
from aionixl import _lines
from aionixl.lowlevel import Tuning

from ._caches import byte_caches

LISTEN_FAILED = 3  # exit status when the listen endpoint could not be bound


#: Run with ``python -c``: keeps the original stdout for control replies and points fd 1
#: at stderr before anything imports aionixl (and with it NIXL).
BOOTSTRAP = ("import os, sys; control = os.dup(1); os.dup2(2, 1); "
             "from aionixl.testing._child import main; main(control, sys.argv[1])")


class DiscoverySpec(msgspec.Struct, frozen=True):
    """What the child needs to build its ``aionixl.EtcdDiscovery``."""

    endpoints: tuple[str, ...]
    prefix: str
    ttl: float


class Spec(msgspec.Struct, frozen=True):
    name: str
    seed: int
    num_blocks: int
    block_shape: tuple[int, ...]
    dtypes: tuple[str, ...]
    listen: str
    backend: str
    config: bytes | None
    tuning: bytes | None
    region_bytes: tuple[int, ...]  # one block of each region (the dtypes' sizes, from the parent)
    discovery: DiscoverySpec | None = None
    workload: str | None = None
    workload_args: bytes = b""


class Request(msgspec.Struct, frozen=True):
    id: int
    op: str
    message: bytes = b""
    timeout: float = 0.0
    address: str = ""
    name: str = ""
    function: str = ""
    args: bytes = b""


def resolve(target: str) -> Callable[[aionixl.Engine, bytes], Coroutine[Any, Any, Any]]:
    """The async function ``"package.module:function"`` names."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"expected 'module:function', got {target!r}")
    function: Callable[[aionixl.Engine, bytes], Coroutine[Any, Any, Any]] = getattr(
        importlib.import_module(module), attr)
    return function


def os_threads() -> int:
    """This process's OS threads (its tasks in /proc)."""
    return len(os.listdir("/proc/self/task"))


def threads_by_id() -> dict[int, str]:
    """This process's OS threads, id -> name (a thread gone mid-read is skipped)."""
    found = {}
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                found[int(task)] = f.read().strip()
        except OSError:
            continue  # it has just exited
    return found


def thread_names() -> list[str]:
    """The names of this process's OS threads (what a report of threads left shows)."""
    return [name for _, name in sorted(threads_by_id().items())]


async def settled_threads(at_most: int) -> int:
    """The thread count once exiting threads have left /proc (bounded: 5 s).

    A joined thread (UCX's async thread, zmq's I/O thread) can still be listed for a moment
    after pthread_join returned; one that keeps running keeps the count above ``at_most``.
    """
    count = os_threads()
    with anyio.move_on_after(5):
        while count > at_most:
            await anyio.sleep(0.01)
            count = os_threads()
    return count


async def _answer(engine: aionixl.Engine, request: Request) -> dict[str, Any]:
    if request.op == "live_resources":
        return {"ok": True, "value": engine.live_resources()}
    if request.op == "stats":  # every count and flag of the engine's metrics()
        snapshot = engine.metrics().as_dict()
        return {"ok": True, "value": {k: v for k, v in snapshot.items() if isinstance(v, (int, bool))}}
    if request.op == "wait_notification":
        try:
            note = await engine.wait_notification(request.message, timeout=request.timeout)
        except TimeoutError:
            return {"ok": False, "error": "TimeoutError",
                    "message": f"no notification {request.message!r} within {request.timeout} s"}
        return {"ok": True, "value": {"peer": note.peer, "message": note.message}}
    if request.op == "connect":
        peer = await engine.connect(request.address, timeout=request.timeout)
        return {"ok": True, "value": peer.name}
    if request.op == "connect_to":
        peer = await engine.connect_to(request.name, timeout=request.timeout)
        return {"ok": True, "value": peer.name}
    if request.op == "call":
        return {"ok": True, "value": await resolve(request.function)(engine, request.args)}
    return {"ok": False, "error": "ValueError", "message": f"unknown control op {request.op!r}"}


async def _serve(spec: Spec, control: int) -> None:
    config = (msgspec.msgpack.decode(spec.config, type=aionixl.EngineConfig)
              if spec.config is not None else None)
    tuning = Tuning(**msgspec.msgpack.decode(spec.tuning)) if spec.tuning is not None else None
    caches = byte_caches(spec.seed, spec.num_blocks, spec.region_bytes)
    discovery = (aionixl.EtcdDiscovery(list(spec.discovery.endpoints), prefix=spec.discovery.prefix,
                                       ttl=spec.discovery.ttl)
                 if spec.discovery is not None else None)
    workload = resolve(spec.workload) if spec.workload is not None else None
    threads_before = os_threads()  # after the imports, before the engine
    engine = aionixl.Engine(spec.name, caches, listen=spec.listen, config=config, discovery=discovery,
                            tuning=tuning)
    try:
        await engine.__aenter__()
    except aionixl.ListenError as exc:
        _lines.write_fd(control, {"event": "error", "error": "ListenError", "message": str(exc)})
        raise SystemExit(LISTEN_FAILED) from None
    try:
        _lines.write_fd(control, {"event": "ready", "name": engine.name, "address": engine.address,
                                  "pid": os.getpid()})
        async with anyio.create_task_group() as tg:
            if workload is not None:
                tg.start_soon(workload, engine, spec.workload_args)

            async def handle(request: Request) -> None:
                try:
                    reply = await _answer(engine, request)
                except Exception as exc:  # reported to the parent, which raises it there
                    reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
                _lines.write_fd(control, {"id": request.id, **reply})

            reader = _lines.LineReader()
            stop = False
            while not stop:
                await anyio.wait_readable(0)
                chunk = os.read(0, 65536)
                if not chunk:
                    break  # the parent went away or closed our stdin: stop
                reader.feed(chunk)
                while (fields := reader.pop()) is not None:
                    request = msgspec.convert(fields, Request)
                    if request.op == "stop":
                        stop = True
                        break
                    tg.start_soon(handle, request)
            tg.cancel_scope.cancel()
    finally:
        await engine.__aexit__(None, None, None)
    _lines.write_fd(control, {"event": "stopped", "resources": engine.live_resources(),
                              "threads_before": threads_before,
                              "threads_after": await settled_threads(threads_before),
                              "thread_names": thread_names()})


def main(control: int, spec_hex: str) -> None:
    spec = msgspec.msgpack.decode(bytes.fromhex(spec_hex), type=Spec)
    anyio.run(_serve, spec, control, backend=spec.backend)
