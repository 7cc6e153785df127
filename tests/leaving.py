"""Issue 13's scenario, shared by its CI test and ``tests/stress/leaving_readers.py``.

A serving engine in a child process (``tests/peer_main.py``) with ``UCX_TLS=tcp`` and one
large region; rounds of fresh reader processes (``tests/leaving_reader.py``) that start a
read of all of it and leave mid-read in one of five ways. After every reader, the server
must still run, and a read by this process must return its exact bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import aionixl

from .conftest import HERE, PeerProcess, numpy_cache, unique

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
    """The serving child, and what it printed so far."""

    child: PeerProcess
    blocks: int
    block_bytes: int
    expected: list[np.ndarray] = field(default_factory=list)
    output: list[str] = field(default_factory=list)


def start_server(blocks: int, block_bytes: int, seed: int = 77) -> Server:
    """The serving child; a thread keeps reading its output (UCX logs go to stdout)."""
    child = PeerProcess(seed=seed, num_blocks=blocks, block_bytes=block_bytes, regions=1,
                        env={"UCX_TLS": "tcp"}, name=unique("server"), merge_stderr=True)
    server = Server(child, blocks, block_bytes, numpy_cache(blocks, block_bytes, 1, seed=seed))
    stdout = child.proc.stdout
    assert stdout is not None
    threading.Thread(target=lambda: server.output.extend(stdout), daemon=True).start()
    return server


def run_reader(server: Server, way: str, *, backend: str, seed: int, timeout: float = 180,
               read_mode: str = "auto") -> Round:
    argv = [sys.executable, "-m", "tests.leaving_reader", "--address", server.child.address,
            "--way", way, "--blocks", str(server.blocks), "--block-bytes", str(server.block_bytes),
            "--backend", backend, "--seed", str(seed), "--read-mode", read_mode]
    env = {**os.environ, "UCX_TLS": "tcp"}
    run = subprocess.run(argv, cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=timeout)
    output = run.stdout + run.stderr
    reports = [json.loads(line[3:]) for line in run.stdout.splitlines() if line.startswith("@@ ")]
    return Round(way, run.returncode, reports[-1] if reports else {}, ucx_noise(output), output)


async def check_server(server: Server, engine: aionixl.Engine, local: list[np.ndarray]) -> None:
    """The server is alive and serves its exact bytes (a fresh connection each time)."""
    assert server.child.proc.poll() is None, f"the serving process died ({server.child.proc.returncode})"
    peer = await engine.connect(server.child.address, timeout=30)
    ids = list(range(server.blocks))
    local[0][:] = 0
    await engine.transfer_blocks(peer, ids, ids, timeout=120)
    assert np.array_equal(local[0], server.expected[0]), "the server served wrong bytes"
    await engine.disconnect(peer)
