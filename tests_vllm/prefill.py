"""Starts and steers ``python -m aionixl_contenders.vllm_worker``: a real vLLM prefill worker."""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import time
from typing import Any

import numpy as np

from aionixl._bench._child import module_command
from aionixl._bench._memory import expected_words
from aionixl._lines import LineReader, encode_line


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_child(proc: subprocess.Popen[bytes], fd: int) -> int | None:
    """End a worker that stops at the end of its stdin (killed after 30 s); its exit code.
    ``fd`` is our end of its message pipe, closed here."""
    if proc.poll() is None and proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        code = proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait()
    os.close(fd)
    return code


class VllmPrefill:
    """A vLLM prefill worker in a child process; its events are collected as they come."""

    def __init__(self, layers: int = 4, blocks: int = 64, lease_s: int = 30) -> None:
        read_fd, write_fd = os.pipe()
        try:
            # The worker picks its own ports as it binds them (vllm_worker.free_port).
            argv, env = module_command("aionixl_contenders.vllm_worker", "--fd", str(write_fd),
                                       "--layers", str(layers), "--blocks", str(blocks),
                                       "--lease-s", str(lease_s))
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                         pass_fds=(write_fd,), env=env)
        finally:
            os.close(write_fd)
        self._fd = read_fd
        self._reader = LineReader()
        self.events: list[dict[str, Any]] = []
        self.ready: dict[str, Any] = {}

    def _pump(self, timeout: float) -> bool:
        ready, _, _ = select.select([self._fd], [], [], timeout)
        if not ready:
            return False
        chunk = os.read(self._fd, 65536)
        if not chunk:
            raise RuntimeError(f"the vLLM prefill exited (code {self.proc.poll()})")
        self._reader.feed(chunk)
        while (event := self._reader.pop()) is not None:
            self.events.append(event)
        return True

    def wait_for(self, predicate: Any, timeout: float) -> dict[str, Any]:
        """The first event (already seen or to come) that satisfies ``predicate``."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no matching event within {timeout} s; saw {self.events[-20:]}")
            self._pump(min(left, 0.5))

    async def until(self, predicate: Any, timeout: float) -> dict[str, Any]:
        """As ``wait_for``, without blocking the event loop: the engines in this process must
        keep making NIXL progress meanwhile (a notification leaves only then)."""
        import anyio

        with anyio.fail_after(timeout):
            seen = 0
            while True:
                for event in self.events[seen:]:
                    if predicate(event):
                        return event
                seen = len(self.events)
                if not self._pump(0):
                    await anyio.sleep(0.01)

    def start(self, timeout: float = 240.0) -> VllmPrefill:
        self.ready = self.wait_for(lambda e: "ready" in e, timeout)["ready"]
        return self

    @property
    def address(self) -> str:
        return str(self.ready["address"])

    def hold(self, req: str, lease_s: float) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_line({"op": "hold", "req": req, "lease_s": lease_s}))
        self.proc.stdin.flush()
        self.wait_for(lambda e: e.get("held") == req, 30.0)

    def stop(self) -> int | None:
        return stop_child(self.proc, self._fd)


def region_matches(region: np.ndarray, layer: int, local: list[int], remote: list[int]) -> bool:
    """Local blocks ``local`` of a [blocks, page] uint8 region hold vLLM's blocks ``remote``."""
    words = region.view(np.uint64)
    want = expected_words(layer, np.asarray(remote, dtype=np.int64), words.shape[1])
    return bool(np.array_equal(words[local], want))
