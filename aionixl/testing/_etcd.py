"""A real single-member etcd for tests and the soak: Debian's ``etcd-server`` binary, run
here or inside a network namespace, stopped (SIGTERM or SIGKILL) and started again on the
same URLs and data.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

import anyio

#: How long a start may take to answer its health check (etcd starts in well under a
#: second; a loaded machine with dozens of engine processes starting is slower).
START_TIMEOUT = 30.0


class EtcdError(RuntimeError):
    """No etcd binary, or etcd would not start or stop."""


def etcd_binary() -> str | None:
    """The etcd binary (``etcd`` on PATH, or Debian's ``/usr/bin/etcd``), or None."""
    found = shutil.which("etcd")
    if found is None and os.access("/usr/bin/etcd", os.X_OK):
        found = "/usr/bin/etcd"
    return found


class Etcd:
    """One etcd member listening for clients on ``http://host:port``.

    ``command_prefix`` runs it elsewhere (``["ip", "netns", "exec", NS]``): its health is
    checked from the same place, over a plain TCP request made by bash, so that the caller
    needs no route to it. The data dir is a temporary directory of its own, kept across
    :meth:`stop` and :meth:`start` (a restarted etcd keeps its keys; leases run on) and
    removed by :meth:`aclose`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 2379, *, peer_port: int = 2380,
                 command_prefix: Sequence[str] = ()) -> None:
        binary = etcd_binary()
        if binary is None:
            raise EtcdError("no etcd binary: install Debian's etcd-server (apt-get install etcd-server)")
        self._binary = binary
        self.host, self.port, self.peer_port = host, port, peer_port
        self._prefix = tuple(command_prefix)
        self._dir = Path(tempfile.mkdtemp(prefix="aionixl-etcd-"))
        self._proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def url(self) -> str:
        """The client URL, for :class:`aionixl.EtcdDiscovery`."""
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def log_tail(self, nbytes: int = 3000) -> str:
        """The end of the current (or last) run's log."""
        path = self._dir / f"etcd-{self.starts}.log"
        with contextlib.suppress(OSError):
            return path.read_bytes()[-nbytes:].decode(errors="replace")
        return ""

    async def start(self) -> None:
        """Start it and return once it answers its health check."""
        if self.running:
            raise EtcdError("etcd is already running")
        self.starts += 1
        peer = f"http://127.0.0.1:{self.peer_port}"
        with open(self._dir / f"etcd-{self.starts}.log", "wb") as log:
            self._proc = subprocess.Popen(
                [*self._prefix, self._binary, "--name", "default", "--data-dir", str(self._dir / "data"),
                 "--listen-client-urls", self.url, "--advertise-client-urls", self.url,
                 "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
                 "--initial-cluster", f"default={peer}"],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        with anyio.move_on_after(START_TIMEOUT):
            while not await self._healthy():
                if self._proc.poll() is not None:
                    raise EtcdError(f"etcd exited with status {self._proc.returncode}:\n{self.log_tail()}")
                await anyio.sleep(0.1)
            return
        await self.stop(kill=True)
        raise EtcdError(f"etcd did not answer its health check within {START_TIMEOUT:g} s:\n"
                        f"{self.log_tail()}")

    async def stop(self, *, kill: bool = False) -> None:
        """SIGTERM (or with ``kill``, SIGKILL) it and reap it (bounded; SIGKILL after 10 s)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        for signum, wait in ((signal.SIGKILL if kill else signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            if proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)
            with anyio.move_on_after(wait):
                while proc.poll() is None:
                    await anyio.sleep(0.02)
        if proc.poll() is None:
            raise EtcdError(f"etcd (pid {proc.pid}) could not be reaped")

    async def aclose(self) -> None:
        """Stop it and remove its data dir (idempotent)."""
        with anyio.CancelScope(shield=True):
            await self.stop()
        shutil.rmtree(self._dir, ignore_errors=True)

    async def __aenter__(self) -> Etcd:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    async def _healthy(self) -> bool:
        probe = (f"exec 3<>/dev/tcp/{self.host}/{self.port} || exit 1; "
                 "printf 'GET /health HTTP/1.0\\r\\n\\r\\n' >&3; cat <&3")
        with anyio.move_on_after(2):
            result = await anyio.run_process([*self._prefix, "bash", "-c", probe], check=False,
                                             stderr=subprocess.DEVNULL)
            return result.returncode == 0 and b'"health":"true"' in result.stdout
        return False
