"""The prefill-side child process, seen from the benchmark: start, wait, steer, stop.

The child is ``benchmarks/contenders/target.py`` from the checkout. It talks over a pipe
of its own (its stdout goes to our stderr, so NIXL/UCX log lines never reach the table).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any


class TargetError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Unit:
    """One prefill engine: its aionixl listen address, its metadata listener, its agent."""

    name: str
    address: str
    meta_address: str
    metadata: bytes


class Target:
    def __init__(self, script: Path, layers: int, blocks: int, block_bytes: int, device: str,
                 peers: int, env: dict[str, str] | None = None) -> None:
        read_fd, write_fd = os.pipe()
        try:
            out: Any = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            out = subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), "--fd", str(write_fd), "--layers", str(layers),
                 "--blocks", str(blocks), "--block-bytes", str(block_bytes), "--device", device,
                 "--peers", str(peers)],
                stdin=subprocess.PIPE, stdout=out, pass_fds=(write_fd,), env=env)
        finally:
            os.close(write_fd)
        self._fd = read_fd
        self._buf = b""
        self.units: list[Unit] = []
        self.layout: dict[str, Any] = {}
        self.pid = self.proc.pid
        self.spinning = True

    def _line(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TargetError(f"the prefill process did not answer within {timeout:.0f} s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    code = self.proc.poll()
                    raise TargetError(f"the prefill process exited (code {code}); its output is above")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode()

    def wait_ready(self, timeout: float = 120.0) -> None:
        msg = json.loads(self._line(timeout))["ready"]
        self.layout = msg["layout"]
        self.units = [Unit(u["name"], u["address"], u["meta_address"], base64.b64decode(u["metadata"]))
                      for u in msg["units"]]

    def _command(self, cmd: str) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(f"{cmd}\n".encode())
        stdin.flush()
        reply = self._line(30.0)
        if reply != f"ack {cmd}":
            raise TargetError(f"unexpected reply from the prefill process: {reply!r}")

    def spin(self) -> None:
        """Progress every unit's NIXL agent on every loop turn (measurements)."""
        if not self.spinning:
            self._command("spin")
            self.spinning = True

    def rest(self) -> None:
        """Leave the units to their engines' own polling (connect latency, idle CPU)."""
        if self.spinning:
            self._command("rest")
            self.spinning = False

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        os.close(self._fd)
        return code
