"""pyzmq driven from anyio, without pyzmq's asyncio layer, threads or receive timeouts.

A zmq socket exposes one edge-triggered FD that only says "look at EVENTS now". The rule:
try the non-blocking operation first; when it would block, read ``EVENTS`` (which also
re-arms the FD) and wait on the FD only while the wanted flag is still clear. Works on
asyncio and trio alike through ``anyio.wait_readable``. One task owns each socket.
"""

from __future__ import annotations

import ipaddress

import anyio
import anyio.lowlevel
import zmq


async def recv_multipart(sock: zmq.Socket[bytes]) -> list[bytes]:
    """Receive one whole multipart message, waiting for it cooperatively."""
    while True:
        try:
            frames: list[bytes] = sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            await _wait_for(sock, zmq.POLLIN)
        else:
            return frames


def try_send_multipart(sock: zmq.Socket[bytes], frames: list[bytes]) -> bool:
    """Send without waiting; False when the peer is unreachable or its queue is full."""
    try:
        sock.send_multipart(frames, zmq.NOBLOCK)
    except zmq.Again:
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            return False
        raise
    return True


async def send_multipart(sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
    """Send one multipart message, waiting for room cooperatively."""
    while not try_send_multipart(sock, frames):
        await _wait_for(sock, zmq.POLLOUT)


async def _wait_for(sock: zmq.Socket[bytes], flag: int) -> None:
    fd = int(sock.getsockopt(zmq.FD))
    while not int(sock.getsockopt(zmq.EVENTS)) & flag:
        await anyio.wait_readable(fd)
    await anyio.lowlevel.checkpoint()


def connect_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int, address: str, max_bytes: int,
                   what: str) -> zmq.Socket[bytes]:
    """A client socket of ``kind`` connected to ``address``: it closes at once (LINGER 0)
    and refuses messages over ``max_bytes``. ``ValueError`` naming ``what`` for an address
    zmq cannot connect to (the socket is closed then)."""
    sock: zmq.Socket[bytes] = ctx.socket(kind)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        try:
            sock.connect(address)
        except zmq.ZMQError as exc:
            raise ValueError(f"bad {what} address {address!r}: {exc}") from exc
    except BaseException:
        sock.close(linger=0)
        raise
    return sock


def check_tcp_port(endpoint: str, what: str) -> None:
    """``ValueError`` for a ``tcp://`` endpoint whose port is past 65535: zmq takes it modulo
    65536, so ``tcp://host:99999`` would bind, or reach, port 34463."""
    if endpoint.startswith("tcp://"):
        port = endpoint.rpartition(":")[2]
        if port.isdigit() and int(port) > 65535:
            raise ValueError(f"{what} {endpoint!r}: TCP port {port} is past 65535")


#: zmq's transports that cross hosts.
_NETWORK_TRANSPORTS = frozenset({"tcp", "ws", "wss", "udp", "pgm", "epgm", "norm", "tipc", "vmci"})


def exposed(endpoint: str) -> bool:
    """Whether other hosts may reach ``endpoint``: a network transport on anything but a
    loopback address or ``localhost`` (another host name counts: it is not resolved here).
    ``ipc://`` and ``inproc://`` are not; an unknown transport is left to zmq to refuse."""
    scheme, _, rest = endpoint.partition("://")
    if scheme not in _NETWORK_TRANSPORTS:
        return False
    host = rest.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return False
    try:
        return not ipaddress.ip_address(host).is_loopback
    except ValueError:
        return True


def bind_router(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, max_bytes: int,
                backlog: int) -> zmq.Socket[bytes]:
    """A listener's ROUTER socket bound to ``endpoint``: it closes at once (LINGER 0), fails
    a reply to a client that is gone instead of dropping it silently (ROUTER_MANDATORY),
    refuses messages over ``max_bytes`` and queues at most ``backlog`` messages, so a
    flooding client gets its messages dropped by zmq, not buffered. ``zmq.ZMQError`` when
    it cannot bind (the socket is closed then)."""
    sock: zmq.Socket[bytes] = ctx.socket(zmq.ROUTER)
    try:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        sock.setsockopt(zmq.RCVHWM, backlog)
        sock.bind(endpoint)
    except BaseException:
        sock.close(linger=0)
        raise
    return sock
