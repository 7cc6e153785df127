"""Real engines, peers in child processes and fault injection for your own test suites.

Everything here runs real NIXL agents and real transfers; nothing is faked.

- :func:`make_caches` builds KV-cache regions whose every block is a deterministic function
  of ``(seed, region, block)``, so a test can recompute what any block must hold, and
  :func:`assert_blocks_equal` checks blocks read against that rule.
- :class:`RemoteEngine` runs an :class:`aionixl.Engine` in a child process that a test can
  pause (SIGSTOP), resume, kill (SIGKILL) and restart on the same address with new content.
- :func:`engine_pair` gives two connected engines in this process.
- :class:`TwoHosts` gives two network namespaces joined by a veth pair whose link a test
  can cut (root only).
- As a pytest plugin (``pytest_plugins = ["aionixl.testing"]``) it adds the fixtures
  ``aionixl_remote`` and ``aionixl_pair``; they work under anyio's pytest plugin (asyncio
  and trio) and under pytest-asyncio. Importing this module does not import pytest.

PYTEST_DONT_REWRITE: the assertions here raise AssertionError with their own messages.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, NamedTuple, NoReturn, Self

import anyio
import anyio.abc
import msgspec
import numpy as np
import torch
from anyio.streams.buffered import BufferedByteReceiveStream

from . import _testing_child
from ._config import EngineConfig
from ._engine import Engine, Peer
from ._errors import AionixlError
from ._notifications import Notification

if TYPE_CHECKING:
    import pytest

__all__ = [
    "DEFAULT_BLOCK_SHAPE",
    "DEFAULT_DTYPES",
    "DEFAULT_NUM_BLOCKS",
    "Pair",
    "RemoteEngine",
    "RemoteEngineError",
    "TwoHosts",
    "TwoHostsError",
    "Host",
    "assert_blocks_equal",
    "assert_no_resources",
    "block_bytes",
    "engine_pair",
    "make_caches",
    "unique_name",
]

DEFAULT_NUM_BLOCKS = 64
DEFAULT_BLOCK_SHAPE: tuple[int, ...] = (16, 8, 64)
DEFAULT_DTYPES: tuple[str, ...] = ("float16", "bfloat16")

_names = itertools.count()


def unique_name(prefix: str = "aionixl-test") -> str:
    """A NIXL agent name unique in this run (agents that meet must have distinct names)."""
    return f"{prefix}-{os.getpid()}-{next(_names)}"


# ---- deterministic caches ---------------------------------------------------------------


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype) or dtype == torch.bool:
        raise ValueError(f"{name!r} is not a torch dtype make_caches can fill (bool is refused)")
    return dtype


def _check_geometry(seed: int, num_blocks: int, block_shape: Sequence[int],
                    dtypes: Sequence[str]) -> tuple[int, ...]:
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
        raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
    shape = tuple(block_shape)
    if not shape or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape):
        raise ValueError(f"block_shape must be a non-empty tuple of positive ints, got {block_shape!r}")
    if isinstance(dtypes, str) or not dtypes:
        raise ValueError(f"dtypes must be a non-empty sequence of dtype names, got {dtypes!r}")
    for name in dtypes:
        _torch_dtype(name)
    return shape


def block_bytes(seed: int, region: int, block: int, nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes block ``block`` of region ``region`` holds in ``make_caches(seed, ...)``.

    A numpy Generator seeded with ``[seed, region, block]`` draws ``nbytes`` bytes, so any
    block can be recomputed on its own, cheaply, without building the whole cache.
    """
    rng = np.random.default_rng([seed, region, block])
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def make_caches(seed: int, num_blocks: int = DEFAULT_NUM_BLOCKS,
                block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE,
                dtypes: Sequence[str] = DEFAULT_DTYPES) -> list[torch.Tensor]:
    """One CPU tensor per dtype, shape ``(num_blocks, *block_shape)``, filled from ``seed``.

    Block ``b`` of region ``r`` holds ``block_bytes(seed, r, b, nbytes)`` bit for bit (the
    bytes are written through an integer view, so float regions may hold NaNs and
    infinities: compare them with :func:`assert_blocks_equal`, not with ``==``).
    """
    shape = _check_geometry(seed, num_blocks, block_shape, dtypes)
    caches: list[torch.Tensor] = []
    for region, name in enumerate(dtypes):
        tensor = torch.empty((num_blocks, *shape), dtype=_torch_dtype(name))
        raw = tensor.view(-1).view(torch.uint8).view(num_blocks, -1).numpy()
        for block in range(num_blocks):
            raw[block] = block_bytes(seed, region, block, raw.shape[1])
        caches.append(tensor)
    return caches


def _block_view(region: Any, block: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes of ``region[block]`` (a torch tensor on any device, or a numpy array)."""
    if isinstance(region, torch.Tensor):
        item = region[block].detach().to("cpu").contiguous()
        return item.view(-1).view(torch.uint8).numpy()
    item_np = np.ascontiguousarray(np.asarray(region)[block])
    return item_np.reshape(-1).view(np.uint8)


def assert_blocks_equal(local_caches: Sequence[Any], local_ids: Sequence[int], remote_seed: int,
                        remote_ids: Sequence[int], *, num_blocks: int = DEFAULT_NUM_BLOCKS,
                        block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE,
                        dtypes: Sequence[str] = DEFAULT_DTYPES) -> None:
    """Assert that ``local_caches[r][local_ids[i]]`` holds, byte for byte, what block
    ``remote_ids[i]`` of region ``r`` holds in ``make_caches(remote_seed, num_blocks,
    block_shape, dtypes)``, for every region ``r``.

    ``local_caches`` are torch tensors or numpy arrays of any dtype with the same bytes per
    block. Raises ``AssertionError`` naming the first region and block that differ.
    """
    shape = _check_geometry(remote_seed, num_blocks, block_shape, dtypes)
    local_list, remote_list = [int(i) for i in local_ids], [int(i) for i in remote_ids]
    if len(local_list) != len(remote_list):
        raise ValueError(f"{len(local_list)} local ids but {len(remote_list)} remote ids")
    if len(local_caches) != len(dtypes):
        raise AssertionError(f"{len(local_caches)} local regions, but the remote geometry has "
                             f"{len(dtypes)} ({', '.join(dtypes)})")
    for block in remote_list:
        if not 0 <= block < num_blocks:
            raise ValueError(f"remote block {block} out of range for num_blocks={num_blocks}")
    elements = math.prod(shape)
    for region, name in enumerate(dtypes):
        nbytes = elements * _torch_dtype(name).itemsize
        for local, remote in zip(local_list, remote_list, strict=True):
            actual = _block_view(local_caches[region], local)
            if actual.size != nbytes:
                raise AssertionError(f"region {region}: local block {local} has {actual.size} bytes, "
                                     f"the remote geometry {nbytes} ({shape} x {name})")
            expected = block_bytes(remote_seed, region, remote, nbytes)
            if not np.array_equal(actual, expected):
                differ = np.flatnonzero(actual != expected)
                raise AssertionError(
                    f"region {region} ({name}): local block {local} differs from remote block "
                    f"{remote} of seed {remote_seed}: {differ.size} of {nbytes} bytes differ, the "
                    f"first at byte {int(differ[0])} ({int(actual[differ[0]]):#04x} != "
                    f"{int(expected[differ[0]]):#04x})")


def assert_no_resources(engine: Engine) -> None:
    """Assert that every count in ``engine.live_resources()`` is zero (after close, say)."""
    counts = engine.live_resources()
    left = {name: n for name, n in counts.items() if n != 0}
    if left:
        listed = ", ".join(f"{name}={n}" for name, n in sorted(left.items()))
        raise AssertionError(f"engine {engine.name!r} still holds NIXL resources: {listed}")


# ---- two engines in this process ---------------------------------------------------------


class Pair(NamedTuple):
    """Two connected engines: ``a`` connected to ``b`` (which listens); ``peer`` is ``b`` as
    ``a`` sees it. ``a_caches``/``b_caches`` are their regions."""

    a: Engine
    b: Engine
    peer: Peer
    a_caches: list[Any]
    b_caches: list[Any]


@asynccontextmanager
async def engine_pair(*, seed: int = 0, num_blocks: int = DEFAULT_NUM_BLOCKS,
                      block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE,
                      dtypes: Sequence[str] = DEFAULT_DTYPES, config: EngineConfig | None = None,
                      a_caches: Sequence[Any] | None = None, b_caches: Sequence[Any] | None = None,
                      ) -> AsyncIterator[Pair]:
    """Two engines in this process: ``a`` over ``make_caches(seed, ...)``, ``b`` over
    ``make_caches(seed + 1, ...)``, ``b`` listening on loopback and ``a`` connected to it.

    ``a_caches``/``b_caches`` replace the generated regions (any layout the engine takes);
    both engines are closed on exit.
    """
    a_regions = list(a_caches) if a_caches is not None else make_caches(seed, num_blocks, block_shape, dtypes)
    b_regions = (list(b_caches) if b_caches is not None
                 else make_caches(seed + 1, num_blocks, block_shape, dtypes))
    async with Engine(unique_name("pair-b"), b_regions, listen="tcp://127.0.0.1:0", config=config) as b, \
            Engine(unique_name("pair-a"), a_regions, listen=None, config=config) as a:
        assert b.address is not None
        peer = await a.connect(b.address, timeout=30)
        yield Pair(a, b, peer, a_regions, b_regions)


# ---- an engine in a child process ---------------------------------------------------------


class RemoteEngineError(AionixlError):
    """The child process of a :class:`RemoteEngine` died, would not start, or did not answer.

    ``returncode`` is its exit status (negative: the signal that ended it) when known;
    ``stderr_tail`` the end of what it wrote to stderr (NIXL's and UCX's output included).
    """

    def __init__(self, message: str, *, returncode: int | None = None, stderr_tail: str = "") -> None:
        detail = message
        if returncode is not None:
            detail += f" (exit status {returncode})"
        if stderr_tail:
            detail += "\n--- end of its stderr ---\n" + stderr_tail
        super().__init__(detail)
        self.returncode = returncode
        self.stderr_tail = stderr_tail


_START_TIMEOUT = 60.0  # NIXL start-up is slow on a loaded machine
_CONTROL_TIMEOUT = 30.0  # margin on every control request
_STOP_TIMEOUT = 15.0  # a graceful stop; the engine's own close is bounded by close_timeout
_KILL_TIMEOUT = 10.0
_RESTART_LISTEN_TIMEOUT = 10.0  # how long restart() retries a port that is not free yet
_TAIL_BYTES = 4000


class _Reply(msgspec.Struct, frozen=True):
    id: int | None = None
    event: str | None = None
    ok: bool = True
    value: Any = None
    error: str = ""
    message: str = ""
    name: str = ""
    address: str | None = None
    pid: int = 0


class RemoteEngine:
    """An :class:`aionixl.Engine` over ``make_caches(seed, ...)`` in a child process.

    Use it as an async context manager (or ``await remote.start()`` /
    ``await remote.aclose()``): the child is started on entry and stopped and reaped on
    exit whatever happened (a graceful close, then SIGTERM, then SIGKILL, all bounded).
    ``listen`` with port 0 picks a port on the first start; :meth:`restart` reuses it.
    ``env`` is added to the child's environment (``{"UCX_TLS": "tcp"}``, say); ``config``
    is sent to the child. ``backend`` is the child's event loop ("asyncio" or "trio").

    :meth:`live_resources` and :meth:`wait_notification` are answered by the child over
    its own control pipe, not through the engine under test. They keep waiting while the
    child is paused. A child that died on its own is reported by any method that talks to
    it, and on exit, as :class:`RemoteEngineError` with its exit status and stderr tail.
    """

    def __init__(self, name: str | None = None, *, seed: int, num_blocks: int = DEFAULT_NUM_BLOCKS,
                 block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE, dtypes: Sequence[str] = DEFAULT_DTYPES,
                 listen: str = "tcp://127.0.0.1:0", env: Mapping[str, str] | None = None,
                 config: EngineConfig | None = None, backend: str = "asyncio",
                 command_prefix: Sequence[str] = ()) -> None:
        self._block_shape = _check_geometry(seed, num_blocks, block_shape, dtypes)
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an aionixl.EngineConfig, got {type(config).__name__}")
        if backend not in ("asyncio", "trio"):
            raise ValueError(f"backend must be 'asyncio' or 'trio', got {backend!r}")
        self.name: str = name if name is not None else unique_name("remote")
        self.seed: int = seed
        self.num_blocks = num_blocks
        self.dtypes: tuple[str, ...] = tuple(dtypes)
        self._listen = listen
        self._address: str | None = None
        self._env = dict(env or {})
        self._config = config
        self._backend = backend
        self._prefix = tuple(command_prefix)
        self._proc: anyio.abc.Process | None = None
        self._pid: int | None = None
        self._control: BufferedByteReceiveStream | None = None
        self._stderr: IO[bytes] | None = None
        self._read_lock = anyio.Lock()
        self._write_lock = anyio.Lock()
        self._replies: dict[int, _Reply] = {}
        self._ids = itertools.count(1)
        self._expected_exit = False  # we killed or stopped it, or its death was reported

    # -- what a test needs to know

    @property
    def address(self) -> str:
        """The handshake endpoint it listens on (the same across restarts)."""
        if self._address is None:
            raise RuntimeError("the remote engine has not started yet")
        return self._address

    @property
    def pid(self) -> int:
        """The current child's process id."""
        if self._pid is None:
            raise RuntimeError("the remote engine has not started yet")
        return self._pid

    @property
    def block_shape(self) -> tuple[int, ...]:
        return self._block_shape

    @property
    def geometry(self) -> dict[str, Any]:
        """``num_blocks``, ``block_shape`` and ``dtypes``, as :func:`make_caches` and
        :func:`assert_blocks_equal` take them."""
        return {"num_blocks": self.num_blocks, "block_shape": self._block_shape, "dtypes": self.dtypes}

    def expected(self) -> list[torch.Tensor]:
        """What its regions hold now: ``make_caches(self.seed, ...)`` (before any write)."""
        return make_caches(self.seed, **self.geometry)

    @property
    def returncode(self) -> int | None:
        """The current child's exit status once it has exited (negative: killed by that signal)."""
        return self._proc.returncode if self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the current child process has not exited."""
        return self._proc is not None and self._proc.returncode is None

    # -- life cycle

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        died = await self.aclose()
        if died is not None and exc is None:
            raise died

    def __await__(self) -> Generator[Any, None, Self]:
        """``remote = await RemoteEngine(...)`` starts it (stop it with :meth:`aclose`)."""
        return self._started().__await__()

    async def _started(self) -> Self:
        await self.start()
        return self

    async def start(self) -> None:
        """Start the child and wait until its engine listens."""
        if self._proc is not None:
            raise RuntimeError("already started; use restart()")
        await self._spawn()

    async def aclose(self) -> RemoteEngineError | None:
        """Stop and reap the child (idempotent). Returns, rather than raises, the report of a
        child that had died on its own and was not reported yet."""
        died: RemoteEngineError | None = None
        with anyio.CancelScope(shield=True):
            died = await self._stop()
        return died

    async def pause(self) -> None:
        """SIGSTOP the child; returns once it is stopped. Its engine answers nothing."""
        pid = self._signal(signal.SIGSTOP)
        with anyio.move_on_after(2):
            while _proc_state(pid) not in ("T", "t", None):
                await anyio.sleep(0.005)

    async def resume(self) -> None:
        """SIGCONT the child."""
        self._signal(signal.SIGCONT)

    @asynccontextmanager
    async def paused(self) -> AsyncIterator[None]:
        """``async with remote.paused():`` the child is stopped inside the block."""
        await self.pause()
        try:
            yield
        finally:
            if self.running:
                with anyio.CancelScope(shield=True):
                    await self.resume()

    async def kill(self) -> None:
        """SIGKILL the child; returns once the process is gone (reaped)."""
        proc = self._proc
        if proc is None:
            raise RuntimeError("the remote engine has not started yet")
        self._expected_exit = True
        with anyio.CancelScope(shield=True):
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            with anyio.fail_after(_KILL_TIMEOUT):
                await proc.wait()
            await self._release()

    async def restart(self, seed: int | None = None) -> None:
        """A new child under the same name on the same address; with ``seed``, new content.

        A child still running is stopped gracefully first (its peers get a goodbye); one
        killed before just leaves its port. A port that is not free yet is retried for a
        while.
        """
        if self._proc is None:
            raise RuntimeError("the remote engine has not started yet")
        if seed is not None:
            _check_geometry(seed, self.num_blocks, self._block_shape, self.dtypes)
        died = await self.aclose()
        if died is not None:
            raise died
        if seed is not None:
            self.seed = seed
        await self._spawn()

    # -- asked of the child

    async def live_resources(self) -> dict[str, int]:
        """The child engine's ``live_resources()``."""
        reply = await self._call("live_resources")
        return {str(k): int(v) for k, v in reply.value.items()}

    async def stats(self) -> dict[str, int]:
        """The child engine's ``stats()``."""
        reply = await self._call("stats")
        return {str(k): int(v) for k, v in reply.value.items()}

    async def connect(self, address: str, timeout: float = 10.0) -> str:
        """Make the child engine connect to ``address`` (an engine of the test, say, so that
        it sees the child as an inbound peer); returns the name of the peer it reached."""
        reply = await self._call("connect", extra_time=timeout, address=address, timeout=float(timeout))
        return str(reply.value)

    async def wait_notification(self, message: bytes, timeout: float) -> Notification:
        """The child engine's ``wait_notification(message, timeout=timeout)``: the
        notification, or ``TimeoutError``."""
        if not isinstance(message, bytes):
            raise TypeError("message must be bytes")
        reply = await self._call("wait_notification", extra_time=timeout, message=message,
                                 timeout=float(timeout))
        return Notification(peer=reply.value["peer"], message=msgspec.convert(
            reply.value["message"], bytes))

    # -- internals

    def _signal(self, signum: int) -> int:
        proc = self._proc
        if proc is None:
            raise RuntimeError("the remote engine has not started yet")
        if proc.returncode is not None:
            self._raise_died("the remote engine's process has exited")
        os.kill(proc.pid, signum)
        return proc.pid

    def stderr_tail(self, nbytes: int = _TAIL_BYTES) -> str:
        """The last ``nbytes`` the current (or last) child wrote to stderr; its stdout goes
        there too, so NIXL's and UCX's messages are in it."""
        if self._stderr is None or self._stderr.closed:
            return ""
        fd = self._stderr.fileno()
        size = os.fstat(fd).st_size
        start = max(0, size - nbytes)
        return os.pread(fd, size - start, start).decode(errors="replace")

    def __del__(self) -> None:
        stderr = getattr(self, "_stderr", None)
        if stderr is not None:
            stderr.close()

    def _raise_died(self, message: str) -> NoReturn:
        proc = self._proc
        self._expected_exit = True  # reported now: exit will not report it again
        raise RemoteEngineError(f"{self.name}: {message}",
                                returncode=proc.returncode if proc is not None else None,
                                stderr_tail=self.stderr_tail())

    async def _spawn(self) -> None:
        listen = self._address if self._address is not None else self._listen
        retry_until = anyio.current_time() + _RESTART_LISTEN_TIMEOUT
        pause = 0.05
        while True:
            try:
                await self._spawn_once(listen)
                return
            except RemoteEngineError as exc:
                if (exc.returncode != _testing_child.LISTEN_FAILED or self._address is None
                        or anyio.current_time() + pause > retry_until):
                    raise
            await anyio.sleep(pause)  # the old incarnation's port is not free yet
            pause = min(pause * 2, 1.0)

    async def _spawn_once(self, listen: str) -> None:
        spec = _testing_child.Spec(
            name=self.name, seed=self.seed, num_blocks=self.num_blocks, block_shape=self._block_shape,
            dtypes=self.dtypes, listen=listen, backend=self._backend,
            config=msgspec.msgpack.encode(self._config) if self._config is not None else None)
        argv = [*self._prefix, sys.executable, "-c", _testing_child.BOOTSTRAP,
                msgspec.msgpack.encode(spec).hex()]
        if self._stderr is not None:
            self._stderr.close()
        # Kept open (for the tail in reports) until the next start or aclose.
        self._stderr = tempfile.TemporaryFile(prefix="aionixl-remote-")  # noqa: SIM115
        self._replies.clear()
        self._expected_exit = False
        proc = await anyio.open_process(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self._stderr, env={**os.environ, **self._env})
        self._proc, self._pid = proc, proc.pid
        assert proc.stdout is not None
        self._control = BufferedByteReceiveStream(proc.stdout)
        ready: _Reply | None = None
        try:
            with anyio.move_on_after(_START_TIMEOUT):
                ready = await self._next_message()
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._stop()
            raise
        if ready is None or ready.event != "ready":
            with anyio.CancelScope(shield=True):
                await self._stop(graceful=ready is not None)
            why = "did not start" if ready is None else f"failed to start: {ready.error}: {ready.message}"
            raise RemoteEngineError(f"{self.name}: the remote engine {why}",
                                    returncode=proc.returncode, stderr_tail=self.stderr_tail())
        assert ready.address is not None
        self._address = ready.address

    async def _next_message(self) -> _Reply | None:
        """The next control line from the child, or None when its stdout closed."""
        control = self._control
        assert control is not None
        while True:
            try:
                line = await control.receive_until(b"\n", 1 << 24)
            except (anyio.EndOfStream, anyio.IncompleteRead, anyio.ClosedResourceError,
                    anyio.BrokenResourceError):
                return None
            if line.startswith(_testing_child.CONTROL_PREFIX):
                return msgspec.json.decode(line[len(_testing_child.CONTROL_PREFIX):], type=_Reply)

    async def _call(self, op: str, extra_time: float = 0.0, **args: Any) -> _Reply:
        proc = self._proc
        if proc is None:
            raise RuntimeError("the remote engine has not started yet")
        if proc.returncode is not None and not self._expected_exit:
            await self._reap_briefly()
            self._raise_died("the remote engine's process died")
        if proc.returncode is not None:
            raise RemoteEngineError(f"{self.name}: the remote engine is not running (killed or stopped)",
                                    returncode=proc.returncode)
        request_id = next(self._ids)
        line = msgspec.json.encode({"id": request_id, "op": op, **args}) + b"\n"
        assert proc.stdin is not None
        with anyio.fail_after(_CONTROL_TIMEOUT + extra_time):
            try:
                async with self._write_lock:
                    await proc.stdin.send(line)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, BrokenPipeError):
                await self._reap_briefly()
                self._raise_died("the remote engine's process died")
            while request_id not in self._replies:
                async with self._read_lock:
                    if request_id in self._replies:
                        break
                    message = await self._next_message()
                    if message is None:
                        await self._reap_briefly()
                        self._raise_died("the remote engine's process died")
                    if message.id is not None:
                        self._replies[message.id] = message
            reply = self._replies.pop(request_id)
        if not reply.ok:
            if reply.error == "TimeoutError":
                raise TimeoutError(reply.message)
            raise RemoteEngineError(f"{self.name}: {op} failed in the child: {reply.error}: {reply.message}")
        return reply

    async def _reap_briefly(self) -> None:
        """Give a dying child a moment to be reaped, so its exit status can be reported."""
        if self._proc is not None:
            with anyio.move_on_after(2):
                await self._proc.wait()

    async def _stop(self, graceful: bool = True) -> RemoteEngineError | None:
        proc = self._proc
        if proc is None:
            return None
        died: RemoteEngineError | None = None
        if proc.returncode is not None and not self._expected_exit:
            died = RemoteEngineError(f"{self.name}: the remote engine's process died",
                                     returncode=proc.returncode, stderr_tail=self.stderr_tail())
        self._expected_exit = True
        try:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # in case it is paused
                if graceful:
                    with contextlib.suppress(Exception):
                        assert proc.stdin is not None
                        await proc.stdin.aclose()  # EOF: the child closes its engine and exits
                    with anyio.move_on_after(_STOP_TIMEOUT):
                        await proc.wait()
                for signum, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, _KILL_TIMEOUT)):
                    if proc.returncode is not None:
                        break
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signum)
                    with anyio.move_on_after(wait):
                        await proc.wait()
            else:
                with anyio.move_on_after(_KILL_TIMEOUT):
                    await proc.wait()
        finally:
            await self._release()
        if died is None and proc.returncode is None:
            died = RemoteEngineError(f"{self.name}: the child process could not be reaped")
        return died

    async def _release(self) -> None:
        """Close the pipes of a child that is gone."""
        proc = self._proc
        if proc is not None and proc.returncode is not None:
            with anyio.move_on_after(1), contextlib.suppress(Exception):
                await proc.aclose()


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


# ---- two hosts: network namespaces joined by a veth pair ------------------------------------


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


@dataclass(frozen=True)
class Host:
    """One end of :class:`TwoHosts`: a namespace, its veth device and its IPv4 address."""

    ns: str
    dev: str
    addr: str

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
        self.a = Host(f"aionixl-{tag}-a", f"anx{tag}a", f"10.231.{third}.{fourth + 1}")
        self.b = Host(f"aionixl-{tag}-b", f"anx{tag}b", f"10.231.{third}.{fourth + 2}")
        self._made: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    def __enter__(self) -> Self:
        reason = _netns_unavailable()
        if reason is not None:
            _skip_or_raise(reason)
        try:
            self._create()
        except TwoHostsError as exc:
            self._remove()
            _skip_or_raise(f"cannot make a veth pair between namespaces here: {exc}")
        except BaseException:
            self._remove()
            raise
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
        on its address, with UCX on TCP over its veth device."""
        where = self.host(host)
        kwargs.setdefault("listen", f"tcp://{where.addr}:0")
        kwargs["env"] = {**where.ucx_env(), **kwargs.get("env", {})}
        return RemoteEngine(name, command_prefix=where.command([]), **kwargs)

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
        for proc in self._procs:  # before the namespaces go
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=_KILL_TIMEOUT)
        self._procs.clear()
        # Deleting a namespace destroys the veth end inside it, and with it the pair.
        for ns in self._made:
            _ip("netns", "del", ns, check=False)
        self._made.clear()
        if _ip("link", "show", self.a.dev, check=False).returncode == 0:
            _ip("link", "del", self.a.dev, check=False)


# ---- pytest plugin --------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    """Register the fixtures ``aionixl_remote`` and ``aionixl_pair`` when pytest loads this
    module as a plugin (``pytest_plugins = ["aionixl.testing"]`` or ``-p aionixl.testing``).

    They live in a private module so that importing aionixl.testing does not import pytest.
    """
    from . import _pytest_plugin

    if not config.pluginmanager.is_registered(_pytest_plugin):
        config.pluginmanager.register(_pytest_plugin, "aionixl.testing.fixtures")
