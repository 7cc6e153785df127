"""The prefill side of ``aionixl bench``: serves a KV cache filled with a known pattern.

Started by the benchmark as a child process (``python -m aionixl_contenders.target``,
see :class:`aionixl._bench._target.Target`), not by hand. It hosts ``--peers`` units on one
shared cache; each unit is an aionixl Engine (the real product, with its handshake listener)
plus a metadata listener thread (the prefill side of the threaded-connector model) that
serves that engine's NIXL agent metadata. The bare-NIXL contender reads from unit 0 with
the metadata sent in the ready message.

Progress: with NIXL's progress thread off, a target must keep calling into NIXL or
transfers stall (the first after a connect always needs it; over UCX tcp every transfer
does). An engine left alone polls only every ``idle_poll_interval`` (100 ms) when idle,
which would distort every latency. So while **spinning**, this process calls each unit's
NIXL progress (``get_notifs``) on every event-loop turn; while **resting** it leaves the
engines to their own polling (used while connect latency and idle CPU are measured, so
that a busy target does not starve the listener threads of the GIL).

Protocol (:mod:`aionixl._lines`, one message per line): a ``{"ready": ...}`` message on
the file descriptor ``--fd``; then ``{"cmd": "spin"}`` / ``{"cmd": "rest"}`` messages on
stdin, each acknowledged on ``--fd`` with ``{"ack": <command>}``. End of stdin stops it.

Beyond the public API it uses the engine's two hooks for tools that drive NIXL beside it:
``aionixl.lowlevel.nixl_metadata`` and ``aionixl.lowlevel.poll_nixl``.
"""

from __future__ import annotations

import argparse
import base64
import functools
import logging
import os
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio

import aionixl
import aionixl.lowlevel
from aionixl._bench._memory import KVMemory
from aionixl._lines import LineReader, write_fd

from .threaded_connector import MetadataListener, encode_metadata

MODULE = "aionixl_contenders.target"


class State:
    def __init__(self) -> None:
        self.spinning = True
        self.changed = anyio.Event()
        self.turns = 0


async def spin(progress: list[Callable[[], Any]], state: State) -> None:
    while True:
        if not state.spinning:
            state.changed = anyio.Event()
            await state.changed.wait()
            continue
        for fn in progress:
            fn()
        state.turns += 1
        await anyio.sleep(0)


async def commands(fd: int, state: State) -> None:
    stdin = sys.stdin.fileno()
    reader = LineReader()
    while True:
        await anyio.wait_readable(stdin)
        chunk = os.read(stdin, 4096)
        if not chunk:
            return
        reader.feed(chunk)
        while (message := reader.pop()) is not None:
            cmd = str(message.get("cmd"))
            if cmd in ("spin", "rest"):
                state.spinning = cmd == "spin"
                state.changed.set()
            write_fd(fd, {"ack": cmd})


async def serve(args: argparse.Namespace) -> None:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    memory = KVMemory(2 * args.layers, args.blocks, args.block_bytes, args.device)
    memory.fill_pattern()
    layout = memory.layout()
    state = State()
    listeners: list[MetadataListener] = []
    try:
        async with AsyncExitStack() as stack:
            units = []
            progress: list[Callable[[], Any]] = []
            for i in range(args.peers):
                engine = await stack.enter_async_context(
                    aionixl.Engine(f"bench-prefill-{os.getpid()}-{i}", memory.regions,
                                   listen="tcp://127.0.0.1:0"))
                metadata = aionixl.lowlevel.nixl_metadata(engine)
                listener = MetadataListener(encode_metadata(metadata, layout),
                                            name=f"prefill-{i}-listener")
                listeners.append(listener)
                # its notifications: nobody waits for them here
                progress.append(functools.partial(aionixl.lowlevel.poll_nixl, engine))
                units.append({"name": engine.name, "address": engine.address,
                              "meta_address": listener.address,
                              "metadata": base64.b64encode(metadata).decode()})
            write_fd(args.fd, {"ready": {"pid": os.getpid(), "layout": layout, "units": units,
                                         "aionixl": aionixl.__file__}})
            async with anyio.create_task_group() as tg:
                tg.start_soon(spin, progress, state)
                await commands(args.fd, state)
                tg.cancel_scope.cancel()
    finally:
        for listener in listeners:
            listener.request_stop()
        for listener in listeners:
            listener.close()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--block-bytes", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--peers", type=int, default=8)
    anyio.run(serve, p.parse_args(argv))


if __name__ == "__main__":
    main()
