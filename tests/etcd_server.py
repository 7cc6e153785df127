"""A real etcd for the tests that need one (Debian's ``etcd-server``): one member on free
loopback ports with a temporary data dir, started and stopped synchronously. The module-wide
``etcd`` fixture (tests/conftest.py) and tests/test_discovery.py's ``own_etcd`` use it."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import httpx

from .helpers import free_port

ETCD = shutil.which("etcd") or "/usr/bin/etcd"

#: etcd's smallest lease TTL with its default timing (a 1 s TTL is raised to it).
TTL = 2.0


class EtcdServer:
    """One etcd member on free loopback ports, with its data dir under ``root``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.client_port, self.peer_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.client_port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def start(self, *, fresh: bool = False) -> None:
        """Start it (on the same ports again after a stop); ``fresh``: with an empty data dir,
        as an etcd that lost its state."""
        assert self.proc is None
        data = self.root / "data"
        if fresh:
            shutil.rmtree(data, ignore_errors=True)
        peer = f"http://127.0.0.1:{self.peer_port}"
        self.starts += 1
        log = open(self.root / f"etcd-{self.starts}.log", "wb")  # noqa: SIM115 - kept by the process
        self.proc = subprocess.Popen(
            [ETCD, "--name", "default", "--data-dir", str(data),
             "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
             "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
             "--initial-cluster", f"default={peer}"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                text = (self.root / f"etcd-{self.starts}.log").read_text()
                raise RuntimeError(f"etcd exited: {text[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).json().get("health") == "true":
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(0.05)
        raise RuntimeError("etcd did not become healthy within 30 s")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
