"""Hosts on one machine, as network namespaces (root and iproute2 only): :class:`TwoHosts`,
two joined by a veth pair whose link a test can cut, and :class:`FleetHosts`, several on one
bridge with a real etcd beside them.

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any, NoReturn, Self

import anyio

from aionixl import EngineConfig
from aionixl._config import effective_tuning

from ._etcd import Etcd
from ._remote import KILL_TIMEOUT, RemoteEngine

if TYPE_CHECKING:
    from aionixl import EtcdDiscovery


class TwoHostsError(RuntimeError):
    """Network namespaces cannot be made here, or an ``ip`` command failed."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=20)
    if check and result.returncode != 0:
        raise TwoHostsError(f"ip {' '.join(args)}: {result.stderr.strip() or result.returncode}")
    return result


def _netns_unavailable() -> str | None:
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


def _skip_or_raise(reason: str) -> NoReturn:
    """``pytest.skip`` under pytest, a :class:`TwoHostsError` elsewhere."""
    if "pytest" in sys.modules:
        import pytest

        pytest.skip(f"TwoHosts: {reason}")
    raise TwoHostsError(reason)


def _make_or_skip(create: Callable[[], None], remove: Callable[[], None], what: str) -> None:
    """Run ``create``; where namespaces cannot be made here, or it fails for want of them,
    undo with ``remove`` and skip (under pytest) or raise :class:`TwoHostsError`."""
    reason = _netns_unavailable()
    if reason is not None:
        _skip_or_raise(reason)
    try:
        create()
    except TwoHostsError as exc:
        remove()
        _skip_or_raise(f"cannot make {what} here: {exc}")
    except BaseException:
        remove()
        raise


def _kill_and_reap(procs: list[subprocess.Popen[Any]]) -> None:
    """Kill (a stopped one too) and reap every process still running, then forget them all."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=KILL_TIMEOUT)
    procs.clear()


#: The first port :meth:`Host.listen_address` hands out. Below a namespace's ephemeral range
#: (32768-60999 unless changed), so no socket bound to port 0 in that namespace (a UCX
#: listener, a connection's own end) can take it while a killed engine restarts there.
_FIRST_LISTEN_PORT = 20000


@dataclass(frozen=True)
class Host:
    """One end of :class:`TwoHosts` (or a host of :class:`FleetHosts`): a namespace, its veth
    device, its IPv4 address, and the handshake secret its engines share with the other
    hosts' (made for the pair or the fleet: engines listening on a host's address cross
    hosts, and an engine does so only with a secret)."""

    ns: str
    dev: str
    addr: str
    secret: bytes = field(default=b"", repr=False, compare=False)
    _ports: Iterator[int] = field(default_factory=lambda: itertools.count(_FIRST_LISTEN_PORT),
                                  init=False, repr=False, compare=False)

    def listen_address(self) -> str:
        """A ``tcp://`` address on this host that no engine started here was given before.

        Its port is outside the ephemeral range: an engine restarted on the address of one
        that was killed finds it free (a port 0 listen would be taken from that range, and
        any socket of the other engines there could hold it by then)."""
        return f"tcp://{self.addr}:{next(self._ports)}"

    def remote_engine(self, name: str | None = None, **kwargs: Any) -> RemoteEngine:
        """A :class:`RemoteEngine` (same arguments) run inside this namespace, listening on
        :meth:`listen_address` unless given ``listen=``, with UCX on TCP over this host's
        device (``env=`` adds to that), and this host's :attr:`secret` unless its ``config``
        has a secret of its own or opts out (``allow_unauthenticated``)."""
        if "listen" not in kwargs:
            kwargs["listen"] = self.listen_address()
        config: EngineConfig | None = kwargs.get("config")
        if self.secret and (config is None or (config.handshake_secret is None
                                               and not config.allow_unauthenticated)):
            if config is not None:  # (with what it was given under names that moved to Tuning)
                kwargs["tuning"] = effective_tuning(config, kwargs.get("tuning"))
            kwargs["config"] = dataclasses.replace(config or EngineConfig(), handshake_secret=self.secret)
        kwargs["env"] = {**self.ucx_env(), **kwargs.get("env", {})}
        return RemoteEngine(name, command_prefix=self.command([]), **kwargs)

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this namespace."""
        return ["ip", "netns", "exec", self.ns, *argv]

    def link(self, up: bool) -> None:
        """Bring this end's veth device up or down."""
        _ip("-n", self.ns, "link", "set", self.dev, "up" if up else "down")

    def ucx_env(self) -> dict[str, str]:
        """Environment that keeps UCX on TCP over this host's veth device."""
        return {"UCX_TLS": "tcp", "UCX_NET_DEVICES": self.dev}


_pairs = itertools.count()


class TwoHosts:
    """Two "hosts" on one machine: network namespaces ``a`` and ``b`` joined by a veth pair.

    A context manager (sync or async). Needs root and iproute2: otherwise entering it calls
    ``pytest.skip`` with the reason under pytest, and raises :class:`TwoHostsError`
    elsewhere. :meth:`run` starts a process in either namespace; :meth:`cut` and
    :meth:`restore` take the link down and up. On exit every process started with
    :meth:`run` is killed and reaped and both namespaces (and with them the pair) are
    deleted, also when the body failed. Names and addresses are unique per process and
    per pair.
    """

    def __init__(self) -> None:
        n = next(_pairs)
        pid = os.getpid()
        tag = f"{pid % 100000}x{n % 100}"
        # A /30 inside 10.231.0.0/16 chosen from the pid and the pair number; it only ever
        # exists inside the two namespaces made here.
        slot = (pid * 7 + n) % (256 * 64)
        third, fourth = slot // 64, (slot % 64) * 4
        #: The handshake secret of the engines on these hosts (:attr:`Host.secret`).
        self.secret = secrets.token_bytes(32)
        self.a = Host(f"aionixl-{tag}-a", f"anx{tag}a", f"10.231.{third}.{fourth + 1}", self.secret)
        self.b = Host(f"aionixl-{tag}-b", f"anx{tag}b", f"10.231.{third}.{fourth + 2}", self.secret)
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> Self:
        _make_or_skip(self._create, self._remove, "a veth pair between namespaces")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._remove()

    async def __aenter__(self) -> Self:
        return self.__enter__()

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(exc_type, exc, tb)

    def host(self, which: Host | str) -> Host:
        """``"a"``, ``"b"`` or one of the two :class:`Host` objects."""
        if isinstance(which, Host) and which in (self.a, self.b):
            return which
        if which == "a":
            return self.a
        if which == "b":
            return self.b
        raise ValueError(f"no host {which!r}: use 'a', 'b', or TwoHosts.a / .b")

    def run(self, host: Host | str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace (``subprocess.Popen`` arguments pass
        through); it is killed and reaped on exit if still running."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.host(host).command(argv), **popen_kwargs)
        self._procs.append(proc)
        return proc

    def remote_engine(self, host: Host | str, name: str | None = None, **kwargs: Any) -> RemoteEngine:
        """A :class:`RemoteEngine` (same arguments) run inside ``host``'s namespace, listening
        on its address, with UCX on TCP over its veth device (:meth:`Host.remote_engine`)."""
        return self.host(host).remote_engine(name, **kwargs)

    def cut(self, host: Host | str = "a") -> None:
        """Take ``host``'s end of the link down (``ip link set DEV down``)."""
        self.host(host).link(up=False)

    def restore(self) -> None:
        """Bring both ends of the link up again."""
        self.a.link(up=True)
        self.b.link(up=True)

    def _create(self) -> None:
        for ns in (self.a.ns, self.b.ns):
            _ip("netns", "add", ns)
            self._made.append(ns)
        _ip("link", "add", self.a.dev, "netns", self.a.ns, "type", "veth",
            "peer", "name", self.b.dev, "netns", self.b.ns)
        for end in (self.a, self.b):
            _ip("-n", end.ns, "link", "set", "lo", "up")
            _ip("-n", end.ns, "addr", "add", f"{end.addr}/30", "dev", end.dev)
            _ip("-n", end.ns, "link", "set", end.dev, "up")

    def _remove(self) -> None:
        _kill_and_reap(self._procs)  # before the namespaces go
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        if _ip("link", "show", self.a.dev, check=False).returncode == 0:
            _ip("link", "del", self.a.dev, check=False)


_fleets = itertools.count()


class FleetHosts:
    """Several "hosts" on one machine: network namespaces on one bridge, with an etcd.

    Each of the ``hosts`` namespaces is joined by a veth pair to a bridge in a "switch"
    namespace of its own, all in one /24 that exists only inside these namespaces; the
    bridge holds the first address, where :attr:`etcd` (a real etcd, started on entry
    unless ``etcd=False``) serves. :meth:`remote_engine` starts an engine on a host,
    registered in that etcd; :meth:`cut` takes a host's link down (its engines lose every
    other host and etcd at once, as with a pulled cable) and :meth:`restore` brings it back.

    An async context manager. Needs root and iproute2 (``pytest.skip`` under pytest,
    :class:`TwoHostsError` elsewhere). On exit every remote engine made here that still runs
    is killed, every process started with :meth:`run` too, etcd is stopped and the
    namespaces (and with them the links and the bridge) are deleted, also when the body
    failed.
    """

    def __init__(self, hosts: int = 4, *, etcd: bool = True) -> None:
        if isinstance(hosts, bool) or not isinstance(hosts, int) or not 1 <= hosts <= 200:
            raise ValueError(f"hosts must be an int from 1 to 200, got {hosts!r}")
        n = next(_fleets)
        pid = os.getpid()
        tag = f"{pid % 100000}f{n % 100}"
        # A /24 inside 10.232.0.0/16 chosen from the pid and the fleet number.
        subnet = f"10.232.{(pid * 7 + n) % 256}"
        self.switch = f"aionixl-{tag}-sw"
        self.gateway = f"{subnet}.1"
        self._bridge = f"anx{tag}br"
        #: The handshake secret of the engines on this fleet's hosts (:attr:`Host.secret`).
        self.secret = secrets.token_bytes(32)
        self.hosts: tuple[Host, ...] = tuple(
            Host(f"aionixl-{tag}-h{i}", f"anx{tag}h{i}", f"{subnet}.{i + 2}", self.secret)
            for i in range(hosts))
        self._ports = [f"anx{tag}s{i}" for i in range(hosts)]  # the bridge's ends of the links
        self._want_etcd = etcd
        self.etcd: Etcd | None = None
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._engines: list[RemoteEngine] = []

    @property
    def etcd_url(self) -> str:
        if self.etcd is None:
            raise RuntimeError("this fleet has no etcd (FleetHosts(etcd=True) starts one)")
        return self.etcd.url

    async def __aenter__(self) -> Self:
        _make_or_skip(self._create, self._remove, "a bridge and veth pairs between namespaces")
        if self._want_etcd:
            try:
                self.etcd = Etcd(self.gateway, 2379, command_prefix=["ip", "netns", "exec", self.switch])
                await self.etcd.start()
            except BaseException:
                await self._aclose()
                raise
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self._aclose()

    def host(self, which: Host | int) -> Host:
        """Host number ``which`` (from 0), or one of :attr:`hosts`."""
        if isinstance(which, Host) and which in self.hosts:
            return which
        if isinstance(which, int) and not isinstance(which, bool) and 0 <= which < len(self.hosts):
            return self.hosts[which]
        raise ValueError(f"no host {which!r}: use 0..{len(self.hosts) - 1} or one of FleetHosts.hosts")

    def discovery(self, prefix: str = "/aionixl/", ttl: float = 10.0) -> EtcdDiscovery:
        """An :class:`aionixl.EtcdDiscovery` on this fleet's etcd (reachable from its hosts)."""
        from aionixl import EtcdDiscovery

        return EtcdDiscovery([self.etcd_url], prefix=prefix, ttl=ttl)

    def remote_engine(self, host: Host | int, name: str | None = None, *, prefix: str = "/aionixl/",
                      ttl: float = 10.0, **kwargs: Any) -> RemoteEngine:
        """A :class:`RemoteEngine` (same arguments) on ``host``: listening on its address, UCX
        on TCP over its link, registered in this fleet's etcd under ``prefix`` (unless
        ``discovery=`` says otherwise). Killed on exit if still running."""
        if "discovery" not in kwargs and self.etcd is not None:
            kwargs["discovery"] = self.discovery(prefix, ttl)
        engine = self.host(host).remote_engine(name, **kwargs)
        self._engines.append(engine)
        return engine

    def run(self, host: Host | int, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``host``'s namespace; killed and reaped on exit."""
        proc: subprocess.Popen[Any] = subprocess.Popen(self.host(host).command(argv), **popen_kwargs)
        self._procs.append(proc)
        return proc

    def cut(self, host: Host | int) -> None:
        """Take ``host``'s link to the bridge down: nothing reaches it, nothing leaves it."""
        self.host(host).link(up=False)

    def restore(self, host: Host | int | None = None) -> None:
        """Bring ``host``'s link (every host's, with None) up again."""
        for where in ([self.host(host)] if host is not None else self.hosts):
            where.link(up=True)

    def _create(self) -> None:
        _ip("netns", "add", self.switch)
        self._made.append(self.switch)
        _ip("-n", self.switch, "link", "set", "lo", "up")
        _ip("-n", self.switch, "link", "add", self._bridge, "type", "bridge")
        _ip("-n", self.switch, "addr", "add", f"{self.gateway}/24", "dev", self._bridge)
        _ip("-n", self.switch, "link", "set", self._bridge, "up")
        for host, port in zip(self.hosts, self._ports, strict=True):
            _ip("netns", "add", host.ns)
            self._made.append(host.ns)
            _ip("link", "add", host.dev, "netns", host.ns, "type", "veth", "peer", "name", port,
                "netns", self.switch)
            _ip("-n", self.switch, "link", "set", port, "master", self._bridge)
            _ip("-n", self.switch, "link", "set", port, "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", host.dev)
            _ip("-n", host.ns, "link", "set", host.dev, "up")

    async def _aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for engine in self._engines:
                if engine.running:
                    with contextlib.suppress(Exception):
                        await engine.kill()
            self._engines.clear()
            if self.etcd is not None:
                with contextlib.suppress(Exception):
                    await self.etcd.aclose()
            self._remove()

    def _remove(self) -> None:
        _kill_and_reap(self._procs)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        self._made.clear()
