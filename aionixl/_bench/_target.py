"""The prefill-side child process, seen from the benchmark: start, wait, steer, stop.

The child is ``python -m aionixl_contenders.target`` (:func:`._child.module_command`).
It answers over a pipe of its own (its stdout goes to our stderr, so NIXL/UCX log lines
never reach the table); both directions speak :mod:`aionixl._lines`.
"""

from __future__ import annotations

import base64
import contextlib
import os
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO, Any

from .._lines import LineReader, encode_line
from ._child import module_command

#: The child, a module of this package (not imported here: it loads NIXL and the engine).
MODULE = "aionixl_contenders.target"


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
    def __init__(self, layers: int, blocks: int, block_bytes: int, device: str,
                 peers: int, env: dict[str, str] | None = None) -> None:
        read_fd, write_fd = os.pipe()
        try:
            out: Any = sys.stderr.fileno()
        except (AttributeError, OSError, ValueError):
            out = subprocess.DEVNULL
        try:
            argv, child_env = module_command(
                MODULE, "--fd", str(write_fd), "--layers", str(layers), "--blocks", str(blocks),
                "--block-bytes", str(block_bytes), "--device", device, "--peers", str(peers), env=env)
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out, pass_fds=(write_fd,),
                                         env=child_env)
        finally:
            os.close(write_fd)
        self._fd = read_fd
        self._reader = LineReader()
        self.units: list[Unit] = []
        self.layout: dict[str, Any] = {}
        self.aionixl_path = ""
        self.pid = self.proc.pid
        self.spinning = True

    def _message(self, timeout: float) -> dict[str, Any]:
        """The child's next message (lines that are not one are skipped)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                message = self._reader.pop()
            except ValueError as exc:
                raise TargetError(f"the prefill process: {exc}") from None
            if message is not None:
                return message
            left = deadline - time.monotonic()
            if left <= 0:
                raise TargetError(f"the prefill process did not answer within {timeout:.0f} s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                chunk = os.read(self._fd, 65536)
                if not chunk:
                    code = self.proc.poll()
                    raise TargetError(f"the prefill process exited (code {code}); its output is above")
                self._reader.feed(chunk)

    def wait_ready(self, timeout: float = 120.0) -> None:
        message = self._message(timeout)
        if "ready" not in message:
            raise TargetError(f"the prefill process said {message!r} before it was ready")
        msg = message["ready"]
        self.layout = msg["layout"]
        #: Where the child imported aionixl from (the report says so beside our own).
        self.aionixl_path = str(msg.get("aionixl", ""))
        self.units = [Unit(u["name"], u["address"], u["meta_address"], base64.b64decode(u["metadata"]))
                      for u in msg["units"]]

    def _command(self, cmd: str) -> None:
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None
        stdin.write(encode_line({"cmd": cmd}))
        stdin.flush()
        reply = self._message(30.0)
        if reply != {"ack": cmd}:
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
