"""Start the example servers (prefill, decode, proxy) as child processes and wait until they
serve, with a deadline.

Used by ``examples.serve``, the test and the load script. Each child's stdout and stderr go
to one log file; the child prints a JSON ``ready`` line there once it accepts requests.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODULES = {"prefill": "examples.prefill_server", "decode": "examples.decode_server",
           "proxy": "examples.proxy"}


@dataclass
class ServerProcess:
    """One running example server."""

    role: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.info["url"])

    @property
    def port(self) -> int:
        return int(self.info["port"])

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown code runs in the child."""
        if self.alive():
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)

    def stop(self, grace: float = 8.0) -> int:
        """SIGTERM (uvicorn shuts down, the engine closes), SIGKILL after ``grace`` seconds."""
        if self.alive():
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        return self.proc.returncode

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


def start(role: str, args: list[str], log_path: Path, ready_timeout: float = 60.0,
          env: dict[str, str] | None = None) -> ServerProcess:
    """Run the role's module (``python -m examples.prefill_server ARGS``...) and wait for its ready line.

    Raises RuntimeError, with the log's tail, if it exits or is not ready in time; the
    child is killed then.
    """
    [server] = start_all([(role, args, log_path)], ready_timeout, env)
    return server


def start_all(specs: list[tuple[str, list[str], Path]], ready_timeout: float = 60.0,
              env: dict[str, str] | None = None) -> list[ServerProcess]:
    """Start several servers at once (each is seconds of imports and engine set-up) and wait
    until all are ready; on any failure every one of them is killed."""
    child_env = dict(os.environ if env is None else env)
    child_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), child_env.get("PYTHONPATH")]))
    child_env.setdefault("PYTHONUNBUFFERED", "1")
    servers: list[tuple[ServerProcess, int]] = []
    try:
        for role, args, log_path in specs:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            with log_path.open("ab") as log:
                offset = log.seek(0, os.SEEK_END)  # a restarted server appends to its old log
                proc = subprocess.Popen([sys.executable, "-m", MODULES[role], *args], cwd=ROOT,
                                        stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                        env=child_env)
            servers.append((ServerProcess(role, proc, log_path), offset))
        deadline = time.monotonic() + ready_timeout
        for server, offset in servers:
            server.info = _wait_ready(server, offset, deadline)
    except BaseException:
        for server, _ in servers:
            server.kill()
        raise
    return [server for server, _ in servers]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (for a server another one must know in advance)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _wait_ready(server: ServerProcess, offset: int, deadline: float) -> dict[str, Any]:
    while True:
        with server.log_path.open("rb") as log:
            log.seek(offset)
            text = log.read().decode(errors="replace")
        for line in reversed(text.splitlines()):
            if line.startswith('{"ready"'):
                info: dict[str, Any] = json.loads(line)
                if info.get("role") == server.role:
                    return info
        if not server.alive():
            raise RuntimeError(f"{server.role} server exited with {server.proc.returncode}:\n"
                               f"{server.log_tail()}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{server.role} server not ready in time:\n{server.log_tail()}")
        time.sleep(0.05)
