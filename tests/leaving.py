"""Issue 13's scenario, shared by its CI test and ``tests/stress/leaving_readers.py``.

A serving engine in a child process (``aionixl.testing.RemoteEngine``) with ``UCX_TLS=tcp`` and one
large region; rounds of fresh reader processes (``tests/leaving_reader.py``) that start a
read of all of it and leave mid-read in one of five ways. After every reader, the server
must still run, and a read by this process must return its exact bytes.
"""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np

import aionixl
from aionixl._lines import decode_line
from aionixl.testing import RemoteEngine

from .helpers import HERE, unique

WAYS = ("aclose", "disconnect", "cancel", "timeout", "kill")
UCX_NOISE = ("UCX  WARN", "UCX  ERROR", "UCX  FATAL", "Assertion", "Fatal:")


def ucx_noise(text: str) -> list[str]:
    return [line for line in text.splitlines() if any(word in line for word in UCX_NOISE)]


@dataclass
class Round:
    way: str
    returncode: int
    report: dict[str, Any]
    noise: list[str]
    output: str


@dataclass
class Server:
    """The serving child (its stderr, where the child's UCX logs go, is kept in a file)."""

    child: RemoteEngine
    blocks: int
    block_bytes: int
    expected: np.ndarray[Any, np.dtype[np.uint8]]

    def output(self) -> str:
        return self.child.stderr_tail(1 << 24)


async def start_server(blocks: int, block_bytes: int, seed: int = 77) -> Server:
    child = RemoteEngine(unique("server"), seed=seed, num_blocks=blocks, block_shape=(block_bytes,),
                         dtypes=("uint8",), env={"UCX_TLS": "tcp"})
    await child.start()
    return Server(child, blocks, block_bytes, child.expected()[0].numpy())


def run_reader(server: Server, way: str, *, backend: str, seed: int, timeout: float = 180,
               read_mode: str = "auto") -> Round:
    argv = [sys.executable, "-m", "tests.leaving_reader", "--address", server.child.address,
            "--way", way, "--blocks", str(server.blocks), "--block-bytes", str(server.block_bytes),
            "--backend", backend, "--seed", str(seed), "--read-mode", read_mode]
    env = {**os.environ, "UCX_TLS": "tcp"}
    run = subprocess.run(argv, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=timeout)
    output = run.stdout + run.stderr
    # split("\n"), not splitlines(): that also splits at the control prefix's \x1e.
    reports = [m for m in map(decode_line, run.stdout.split("\n")) if m is not None]
    return Round(way, run.returncode, reports[-1] if reports else {}, ucx_noise(output), output)


async def check_server(server: Server, engine: aionixl.Engine, local: list[np.ndarray]) -> None:
    """The server is alive and serves its exact bytes (a fresh connection each time)."""
    assert server.child.running, f"the serving process died ({server.child.returncode})"
    peer = await engine.connect(server.child.address, timeout=30)
    ids = list(range(server.blocks))
    local[0][:] = 0
    await engine.transfer_blocks(peer, ids, ids, timeout=120)
    assert np.array_equal(local[0], server.expected), "the server served wrong bytes"
    await engine.disconnect(peer)
