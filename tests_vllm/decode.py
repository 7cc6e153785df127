"""Starts and steers ``python -m aionixl_contenders.vllm_decode``: a real vLLM decode worker.

Its commands are answered without blocking the event loop: the aionixl prefill it reads
from runs in the test's own loop and must answer vLLM's handshake meanwhile.
"""

from __future__ import annotations

import os
import select
import subprocess
from typing import IO, Any

import anyio

from aionixl._bench._child import module_command
from aionixl._lines import LineReader, encode_line

from .prefill import stop_child


class VllmDecode:
    """A vLLM decode worker (the NixlConnector in the consumer role) in a child process."""

    def __init__(self, layers: int, blocks: int, env: dict[str, str] | None = None,
                 log: IO[bytes] | None = None) -> None:
        read_fd, write_fd = os.pipe()
        try:
            argv, child_env = module_command("aionixl_contenders.vllm_decode", "--fd", str(write_fd),
                                             "--layers", str(layers), "--blocks", str(blocks),
                                             "--kv-heads", "4", env=env)
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log or subprocess.DEVNULL,
                                         stderr=log, pass_fds=(write_fd,), env=child_env)
        finally:
            os.close(write_fd)
        self._fd = read_fd
        self._reader = LineReader()
        self.ready: dict[str, Any] = {}

    async def _line(self, timeout: float) -> dict[str, Any]:
        with anyio.fail_after(timeout):
            while True:
                msg = self._reader.pop()
                if msg is not None:
                    if msg.get("error"):
                        raise RuntimeError(f"vLLM decode: {msg['error']}")
                    return msg
                ready, _, _ = select.select([self._fd], [], [], 0)
                if not ready:
                    await anyio.sleep(0.005)
                    continue
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"the vLLM decode exited (code {self.proc.wait()})")
                self._reader.feed(chunk)

    async def start(self, timeout: float = 240.0) -> VllmDecode:
        self.ready = (await self._line(timeout))["ready"]
        return self

    async def ask(self, cmd: dict[str, Any], timeout: float = 90.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_line(cmd))
        self.proc.stdin.flush()
        return await self._line(timeout)

    def stop(self) -> int | None:
        return stop_child(self.proc, self._fd)
