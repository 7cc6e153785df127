"""The prefill side of ``aionixl bench``: serves a KV cache filled with a known pattern.

Started by the benchmark as a child process, not by hand. It hosts ``--peers`` units on one
shared cache; each unit is an aionixl Engine (the real product, with its handshake listener)
plus a metadata listener thread (the prefill side of the threaded-connector model) that
serves that engine's NIXL agent metadata. The bare-NIXL contender reads from unit 0 with
the metadata printed in the ready message.

Progress: with NIXL's progress thread off, a target must keep calling into NIXL or
transfers stall (the first after a connect always needs it; over UCX tcp every transfer
does). An engine left alone polls only every ``idle_poll_interval`` (100 ms) when idle,
which would distort every latency. So while **spinning**, this process calls each unit's
NIXL progress (``get_notifs``) on every event-loop turn; while **resting** it leaves the
engines to their own polling (used while connect latency and idle CPU are measured, so
that a busy target does not starve the listener threads of the GIL).

Protocol: a JSON ready message on the file descriptor ``--fd``; then commands on stdin,
one per line (``spin``, ``rest``), each acknowledged on ``--fd`` with ``ack <command>``.
End of stdin stops it.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from functools import partial
from pathlib import Path
from typing import Any

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "baselines"))

from threaded_connector import MetadataListener, encode_metadata

import aionixl
from aionixl._bench._memory import KVMemory
from aionixl._peers import RESERVED


def _engine_agent(engine: aionixl.Engine) -> Any:
    """The engine's NIXL agent wrapper (private; the benchmark needs its progress call)."""
    agent = getattr(engine, "_agent", None)
    if agent is None or not hasattr(agent, "get_notifs") or not hasattr(agent, "metadata"):
        raise SystemExit("bench target: aionixl.Engine no longer exposes _agent.get_notifs() and "
                         "_agent.metadata(); update benchmarks/contenders/target.py")
    return agent


def _progress(engine: aionixl.Engine, agent: Any) -> None:
    """One NIXL progress call. The engine's own messages (push-read requests, probes,
    goodbyes) that it returns go to the engine as its drainer would hand them over."""
    for name, messages in agent.get_notifs().items():
        for message in messages:
            if message.startswith(RESERVED):
                engine._peers.heard(name, message)


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


async def commands(out: Any, state: State) -> None:
    fd = sys.stdin.fileno()
    buf = b""
    while True:
        await anyio.wait_readable(fd)
        chunk = os.read(fd, 4096)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            cmd = line.decode().strip()
            if cmd in ("spin", "rest"):
                state.spinning = cmd == "spin"
                state.changed.set()
            out.write(f"ack {cmd}\n")
            out.flush()


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--block-bytes", type=int, required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--peers", type=int, default=8)
    args = p.parse_args()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    out = os.fdopen(args.fd, "w")
    memory = KVMemory(2 * args.layers, args.blocks, args.block_bytes, args.device)
    memory.fill_pattern()
    layout = memory.layout()
    state = State()
    listeners: list[MetadataListener] = []
    try:
        async with AsyncExitStack() as stack:
            units = []
            progress = []
            for i in range(args.peers):
                engine = await stack.enter_async_context(
                    aionixl.Engine(f"bench-prefill-{os.getpid()}-{i}", memory.regions,
                                   listen="tcp://127.0.0.1:0"))
                agent = _engine_agent(engine)
                metadata = agent.metadata()
                listener = MetadataListener(encode_metadata(metadata, layout),
                                            name=f"prefill-{i}-listener")
                listeners.append(listener)
                progress.append(partial(_progress, engine, agent))
                units.append({"name": engine.name, "address": engine.address,
                              "meta_address": listener.address,
                              "metadata": base64.b64encode(metadata).decode()})
            out.write(json.dumps({"ready": {"pid": os.getpid(), "layout": layout, "units": units}}) + "\n")
            out.flush()
            async with anyio.create_task_group() as tg:
                tg.start_soon(spin, progress, state)
                await commands(out, state)
                tg.cancel_scope.cancel()
    finally:
        for listener in listeners:
            listener.request_stop()
        for listener in listeners:
            listener.close()


if __name__ == "__main__":
    anyio.run(main)
