"""Two "hosts" over a real network link: two network namespaces joined by a veth pair.

A prefill engine runs in one namespace and a decode engine in the other, each a child
process (``tests/netns_peer.py``, driven by commands in the line protocol of
:mod:`aionixl._lines`) with UCX restricted to TCP over its veth device. The tests cut the
link with ``ip link set DEV down`` while reads are in flight, restore it, and restart the
prefill side. Needs root and iproute2; skipped otherwise. The children run asyncio in some
tests and trio in others (one backend per test: these are the slow ones).
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from aionixl._lines import decode_line, write_file
from aionixl.testing import Host, TwoHosts

from .helpers import HERE, unique

DEADLINE = 2.0  # the transfer timeout the decode side uses while the link is cut
MARGIN = 1.5  # how late past its deadline a TransferTimeoutError may arrive
CLOSE_LIMIT = 2.0  # seconds an engine close may take, even with the link down


class Child:
    """A netns_peer.py process inside one namespace."""

    def __init__(self, host: Host, role: str, name: str, *, backend: str, seed: int = 7,
                 listen: str | None = None) -> None:
        self.role = role
        argv = [sys.executable, str(HERE / "netns_peer.py"), "--role", role, "--name", name,
                "--seed", str(seed), "--secret", host.secret.hex()]
        if listen is not None:
            argv += ["--listen", listen]
        env = {**os.environ, "UCX_TLS": "tcp", "UCX_NET_DEVICES": host.dev,
               "NETNS_PEER_BACKEND": backend, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(host.command(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env)
        self._messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self._log: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()
        self.ready: dict[str, Any] = {}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._log.append(line)
            message = decode_line(line)
            if message is not None:
                self._messages.put(message)
        self._messages.put(None)

    def tail(self) -> str:
        return "".join(self._log[-15:])

    def next(self, timeout: float) -> dict[str, Any]:
        try:
            message = self._messages.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"{self.role}: nothing within {timeout} s; output:\n{self.tail()}") from None
        if message is None:
            raise AssertionError(f"{self.role} exited ({self.proc.wait()}); output:\n{self.tail()}")
        return message

    def wait_ready(self, timeout: float = 60) -> dict[str, Any]:
        self.ready = self.next(timeout)
        assert self.ready.get("event") == "ready", self.ready
        return self.ready

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        write_file(self.proc.stdin, cmd)

    def reply(self, wait: float = 30) -> dict[str, Any]:
        while True:
            message = self.next(wait)
            if "reply" in message:
                return message

    def call(self, wait: float = 30, **cmd: Any) -> dict[str, Any]:
        """Send one command; return its reply (waiting at most ``wait`` seconds for it)."""
        self.send(**cmd)
        return self.reply(wait)

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=15)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def hosts() -> Iterator[TwoHosts]:
    """Two namespaces joined by a veth pair; skips where that cannot be made."""
    with TwoHosts() as made:
        yield made


@pytest.fixture
def children() -> Iterator[list[Child]]:
    started: list[Child] = []
    yield started
    for child in started:  # before the namespaces go
        child.stop()


def start_pair(hosts: TwoHosts, children: list[Child], backend: str) -> tuple[Child, Child, str]:
    prefill_host, decode_host = hosts.a, hosts.b
    prefill = Child(prefill_host, "prefill", unique("prefill"), backend=backend,
                    listen=prefill_host.listen_address())
    decode = Child(decode_host, "decode", unique("decode"), backend=backend)
    children += [prefill, decode]
    address = prefill.wait_ready()["address"]
    assert address.startswith(f"tcp://{prefill_host.addr}:")
    decode.wait_ready()
    connected = decode.call(op="connect", address=address, timeout=20)
    assert connected["ok"], connected
    return prefill, decode, address


def assert_read_ok(decode: Child, **kw: Any) -> None:
    result = decode.call(op="read", n=4, timeout=10, **kw)
    assert result["ok"], result
    assert result["match"], "the bytes read over the veth differ from the prefill side's"


def assert_closed_fast(child: Child, **kw: Any) -> dict[str, Any]:
    closed = child.call(wait=CLOSE_LIMIT + 20, op="close", **kw)
    assert closed["ok"], closed
    took = closed["close_seconds"]
    assert took < CLOSE_LIMIT, f"{child.role} took {took:.2f} s to close"
    assert all(v == 0 for v in closed["resources"].values()), closed["resources"]
    return closed


def test_link_cut_mid_stream_times_out_then_reconnect_works(hosts: TwoHosts,
                                                             children: list[Child]) -> None:
    """(a) reads over the veth are push reads (UCX over TCP between two hosts) and move the
    right bytes; (b) cutting the link while reads stream gives TransferTimeoutError at the
    deadline (plus the unconfirmed cancel's push_cancel_timeout, after which the peer is
    evicted); (c) no byte of the cut read lands after the link is back; (d) connect works
    again and moves the right bytes."""
    prefill_host = hosts.a
    prefill, decode, address = start_pair(hosts, children, "asyncio")
    assert decode.call(op="connect", address=address, timeout=20)["read_mode"] == "push"
    for _ in range(3):
        assert_read_ok(decode)
    decode.send(op="stream", n=4, timeout=DEADLINE, ready_after=3)
    assert decode.next(30) == {"event": "streaming"}
    hosts.cut(prefill_host)  # the prefill host's NIC goes away
    stopped = decode.reply(wait=DEADLINE + 20)
    assert not stopped["ok"] and stopped["error"] == "TransferTimeoutError", stopped
    assert DEADLINE <= stopped["seconds"] < DEADLINE + MARGIN, stopped
    state = decode.call(op="state")
    assert state["resources"]["transfer_handles"] == 0 and state["resources"]["in_flight"] == 0, state
    assert state["stats"]["fence_evictions"] == 1, state
    assert decode.call(op="fill", value=0x5A)["ok"]
    hosts.restore()
    time.sleep(2.0)  # whatever the prefill side still had to send, it could send now
    assert decode.call(op="count_not", value=0x5A)["count"] == 0, "bytes of the cut read landed late"
    assert decode.call(op="disconnect")["ok"]
    again = decode.call(op="connect", address=address, timeout=20)
    assert again["ok"], again
    for _ in range(3):
        assert_read_ok(decode)
    assert_closed_fast(decode)
    assert_closed_fast(prefill)


def test_close_with_reads_in_flight_over_a_dead_link(hosts: TwoHosts,
                                                     children: list[Child]) -> None:
    """With the link down: a read times out at its deadline (the prefill side cannot confirm
    the cancel: evicted); with the link back, connect again; with it down again, both
    engines close fast (reads still waiting get EngineClosedError) and hold nothing."""
    prefill, decode, address = start_pair(hosts, children, "trio")
    assert_read_ok(decode)
    hosts.cut(hosts.b)  # this time the decode host's own NIC
    start = time.monotonic()
    timed_out = decode.call(op="read", n=4, timeout=DEADLINE)
    assert not timed_out["ok"] and timed_out["error"] == "TransferTimeoutError", timed_out
    assert DEADLINE <= timed_out["seconds"] < DEADLINE + MARGIN, timed_out
    assert time.monotonic() - start < DEADLINE + MARGIN + 1
    assert decode.call(op="state")["stats"]["fence_evictions"] == 1
    hosts.restore()
    assert decode.call(op="connect", address=address, timeout=20)["ok"]
    assert_read_ok(decode)
    hosts.cut(hosts.b)
    closed = assert_closed_fast(decode, inflight=3, inflight_timeout=60)
    assert closed["in_flight_at_close"] == 3, closed
    assert closed["outcomes"] == ["EngineClosedError"] * 3, closed
    assert_closed_fast(prefill)  # its inbound peer is unreachable too


def test_prefill_restart_at_the_same_address(hosts: TwoHosts,
                                             children: list[Child]) -> None:
    """The prefill process dies and a new one (same name, same address, other blocks) takes
    its place: the decode side's reads fail rather than hang past the deadline, and a plain
    ``connect()`` to the address then reaches the new incarnation and reads its bytes."""
    prefill_host = hosts.a
    prefill, decode, address = start_pair(hosts, children, "asyncio")
    assert_read_ok(decode)
    name = prefill.ready["name"]
    os.kill(prefill.proc.pid, signal.SIGKILL)
    prefill.proc.wait(timeout=10)
    failed = decode.call(op="read", n=4, timeout=DEADLINE)
    assert not failed["ok"], failed
    assert failed["error"] in {"TransferTimeoutError", "PeerDisconnectedError", "TransferError"}, failed
    assert failed["seconds"] < DEADLINE + MARGIN, failed
    reborn = Child(prefill_host, "prefill", name, backend="asyncio", seed=8, listen=address)
    children.append(reborn)
    assert reborn.wait_ready()["address"] == address
    assert decode.call(op="expect", seed=8)["ok"]
    again = decode.call(op="connect", address=address, timeout=20)
    assert again["ok"], again
    result = decode.call(op="read", n=4, timeout=10)
    assert result["ok"], f"connect() after the restart gave a peer that does not work: {result}"
    assert result["match"], "read the old incarnation's bytes, or garbage"
    assert_closed_fast(decode)
    assert_closed_fast(reborn)


def test_listen_addresses_a_host_gives_are_its_own_and_outside_its_ephemeral_ports(
        hosts: TwoHosts) -> None:
    """An engine restarted on the address of one that was killed must find it free: a port
    from the namespace's ephemeral range could be held by then by any socket bound to port 0
    there (a UCX listener, a connection's own end)."""
    host = hosts.a
    low, high = map(int, subprocess.run(
        host.command(["cat", "/proc/sys/net/ipv4/ip_local_port_range"]),
        capture_output=True, text=True, check=True).stdout.split())
    addresses = [host.listen_address() for _ in range(3)]
    assert all(a.startswith(f"tcp://{host.addr}:") for a in addresses), addresses
    ports = [int(a.rsplit(":", 1)[1]) for a in addresses]
    assert len(set(ports)) == 3, ports
    assert not any(low <= port <= high for port in ports), (ports, low, high)
    bind = ("import socket, sys\n"
            "for port in sys.argv[1:]:\n"
            f"    socket.socket().bind(('{host.addr}', int(port)))\n")
    subprocess.run(host.command([sys.executable, "-c", bind, *map(str, ports)]), check=True, timeout=30)


def slow_link(host: Host, rate: str = "40mbit") -> None:
    """Limit what ``host`` sends over its veth device (so a chunk is still moving when the
    link goes down)."""
    subprocess.run(host.command(["tc", "qdisc", "add", "dev", host.dev, "root", "tbf", "rate", rate,
                                 "burst", "32kb", "latency", "2s"]), check=True)


def test_a_server_that_dropped_a_reader_mid_chunk_never_says_the_read_is_over(
        hosts: TwoHosts, children: list[Child]) -> None:
    """The server drops the reader while a chunk of a push read is stuck on a cut link: the
    chunk's handle is released, but UCX still delivers its bytes once the link is back. So
    when the reader's read times out and it asks the server (reconnected meanwhile) to stop,
    the server answers that the read is lost, not that nothing more of it will land: the
    reader keeps that round's staging slots out of use (stranded) instead of reusing them
    under the late bytes, and needs no eviction to do so; the slots left serve reads."""
    prefill_host, decode_host = hosts.a, hosts.b
    prefill = Child(prefill_host, "prefill", unique("prefill"), backend="asyncio",
                    listen=prefill_host.listen_address())
    decode = Child(decode_host, "decode", unique("decode"), backend="trio",
                   listen=decode_host.listen_address())
    children += [prefill, decode]
    address = prefill.wait_ready()["address"]
    decode_address = decode.wait_ready()["address"]
    assert decode.call(op="connect", address=address, timeout=20)["read_mode"] == "push"
    assert_read_ok(decode)
    slots = decode.call(op="state")["stats"]["staging_slots"]
    slow_link(prefill_host)  # a round (half the slots: 4 MiB) now takes ~0.8 s to send
    decode.send(op="read", n=slots, timeout=6.0)
    time.sleep(0.3)
    hosts.cut(prefill_host)  # the first round's chunk is stuck
    assert prefill.call(op="disconnect")["ok"]  # drops the reader: the stuck chunk is released
    hosts.restore()
    assert prefill.call(op="connect", address=decode_address, timeout=20)["ok"]
    timed_out = decode.reply(wait=30)
    assert not timed_out["ok"] and timed_out["error"] == "TransferTimeoutError", timed_out
    stats = decode.call(op="state")["stats"]
    assert stats["staging_stranded"] == slots // 2, stats
    assert stats["staging_reclaimed"] == 0 and stats["fence_evictions"] == 0, stats
    assert prefill.call(op="state")["stats"]["pushes_lost"] == 1
    assert_read_ok(decode)  # in rounds of what is left
    assert_closed_fast(decode)
    assert_closed_fast(prefill)
