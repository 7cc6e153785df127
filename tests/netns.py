"""Two network namespaces joined by a veth pair: two "hosts" on one machine, for tests.

Needs root and iproute2. Names and addresses are unique per process and per pair, and
everything created is removed on exit from :func:`veth_pair`, also when the body fails.
:func:`unavailable` says why it cannot work here (None when it can).
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

_pairs = itertools.count()


class NetnsError(RuntimeError):
    pass


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise NetnsError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2 ('ip') is not installed"
    probe = f"aionixl-probe-{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass(frozen=True)
class Host:
    """One end: a namespace, its veth device and that device's IPv4 address."""

    ns: str
    dev: str
    addr: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def link(self, up: bool) -> None:
        _ip("-n", self.ns, "link", "set", self.dev, "up" if up else "down")


@contextmanager
def veth_pair() -> Iterator[tuple[Host, Host]]:
    n = next(_pairs)
    pid = os.getpid()
    tag = f"{pid % 100000}x{n % 100}"
    ns_a, ns_b = f"aionixl-{tag}-a", f"aionixl-{tag}-b"
    dev_a, dev_b = f"anx{tag}a", f"anx{tag}b"  # at most 15 characters (IFNAMSIZ)
    # A /30 inside 10.231.0.0/16 chosen from the pid and the pair number; it only ever
    # exists inside the two namespaces made here.
    slot = (pid * 7 + n) % (256 * 64)
    third, fourth = slot // 64, (slot % 64) * 4
    addr_a, addr_b = f"10.231.{third}.{fourth + 1}", f"10.231.{third}.{fourth + 2}"
    made: list[str] = []
    try:
        for ns in (ns_a, ns_b):
            _ip("netns", "add", ns)
            made.append(ns)
        _ip("link", "add", dev_a, "netns", ns_a, "type", "veth", "peer", "name", dev_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, dev_a, addr_a), (ns_b, dev_b, addr_b)):
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield Host(ns_a, dev_a, addr_a), Host(ns_b, dev_b, addr_b)
    finally:
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        for ns in made:
            _ip("netns", "del", ns, check=False)
        leftover = _ip("link", "show", dev_a, check=False)
        if leftover.returncode == 0:  # only if the pair was created outside the namespaces
            _ip("link", "del", dev_a, check=False)
