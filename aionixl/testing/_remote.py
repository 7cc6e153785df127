"""An :class:`aionixl.Engine` in a child process that a test can pause, resume, kill and
restart: the parent side of the control channel (the child side is ``_child``).

PYTEST_DONT_REWRITE
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable, Generator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from types import TracebackType
from typing import IO, TYPE_CHECKING, Any, NoReturn, Self, TypeVar

import anyio
import anyio.abc
import msgspec
from anyio.streams.buffered import BufferedByteReceiveStream

from aionixl import AionixlError, EngineConfig, EtcdDiscovery, Notification, _lines
from aionixl._checks import check_text, check_timeout
from aionixl._config import effective_tuning
from aionixl.lowlevel import Tuning

from ._caches import (
    DEFAULT_BLOCK_SHAPE,
    DEFAULT_DTYPES,
    DEFAULT_NUM_BLOCKS,
    check_geometry,
    make_caches,
    region_bytes,
    unique_name,
)
from ._child import BOOTSTRAP, LISTEN_FAILED, DiscoverySpec, Spec

if TYPE_CHECKING:
    import torch


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


class RemoteEngineStopError(RemoteEngineError):
    """A graceful stop of a :class:`RemoteEngine` went wrong: the child exited with a non-zero
    status (or had to be terminated), did not report its engine's close, reported NIXL
    resources its engine still held after closing, or had more OS threads after the close
    than before the engine opened.

    ``resources`` is what the child reported (its engine's ``live_resources()`` after the
    close; every count 0 when clean), or None when it reported nothing; ``threads_left``
    how many threads more than before the engine it still had (0 when clean). Raised on leaving
    ``async with``, by :meth:`RemoteEngine.restart` and at the ``aionixl_remote`` fixture's
    teardown; :meth:`RemoteEngine.aclose` returns it.
    """

    def __init__(self, message: str, *, resources: dict[str, int] | None, returncode: int | None = None,
                 stderr_tail: str = "", threads_left: int = 0) -> None:
        super().__init__(message, returncode=returncode, stderr_tail=stderr_tail)
        self.resources = resources
        self.threads_left = threads_left


_START_TIMEOUT = 60.0  # NIXL start-up is slow on a loaded machine
_CONTROL_TIMEOUT = 30.0  # margin on every control request
_STOP_TIMEOUT = 15.0  # a graceful stop; the engine's own close is bounded by close_timeout
KILL_TIMEOUT = 10.0  # for a killed process to be reaped (TwoHosts uses it too)
_RESTART_LISTEN_TIMEOUT = 10.0  # how long restart() retries a port that is not free yet
_TAIL_BYTES = 4000

_T = TypeVar("_T")


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
    resources: dict[str, int] | None = None  # event "stopped": live_resources() after the close
    threads_before: int = 0  # event "stopped": OS threads before the engine opened
    threads_after: int = 0  # ... and after it closed (settled)
    thread_names: list[str] = []  # ... their names then


class RemoteEngine:
    """An :class:`aionixl.Engine` over ``make_caches(seed, ...)`` in a child process.

    Use it as an async context manager (or ``await remote.start()`` /
    ``await remote.aclose()``): the child is started on entry and stopped and reaped on
    exit whatever happened (a graceful close, then SIGTERM, then SIGKILL, all bounded).
    ``listen`` with port 0 picks a port on the first start; :meth:`restart` reuses it.
    ``env`` is added to the child's environment (``{"UCX_TLS": "tcp"}``, say); ``config``
    and ``tuning`` (``aionixl.lowlevel.Tuning``) are sent to the child. ``backend`` is the
    child's event loop ("asyncio" or "trio").
    ``discovery``: an :class:`aionixl.EtcdDiscovery` whose endpoints, prefix and ttl the
    child's engine registers with (the object itself stays unused here). ``workload``
    (``"module:function"``) runs in the child beside its engine, ``await
    function(engine, workload_args)``, until the child stops; :meth:`call` runs such a
    function once and returns its (JSON-able) result.

    :meth:`live_resources` and :meth:`wait_notification` are answered by the child over
    its own control pipe, not through the engine under test. They keep waiting while the
    child is paused. A child that died on its own is reported by any method that talks to
    it, and on exit, as :class:`RemoteEngineError` with its exit status and stderr tail.
    A graceful stop (on exit, :meth:`aclose`, :meth:`restart`) is checked too: a child
    that exits non-zero, has to be terminated, or reports NIXL resources left after its
    engine's close is reported as :class:`RemoteEngineStopError`.
    """

    def __init__(self, name: str | None = None, *, seed: int, num_blocks: int = DEFAULT_NUM_BLOCKS,
                 block_shape: Sequence[int] = DEFAULT_BLOCK_SHAPE, dtypes: Sequence[str] = DEFAULT_DTYPES,
                 listen: str = "tcp://127.0.0.1:0", env: Mapping[str, str] | None = None,
                 config: EngineConfig | None = None, backend: str = "asyncio",
                 command_prefix: Sequence[str] = (), discovery: EtcdDiscovery | None = None,
                 workload: str | None = None, workload_args: bytes = b"",
                 tuning: Tuning | None = None) -> None:
        self._block_shape = check_geometry(seed, num_blocks, block_shape, dtypes)
        if config is not None and not isinstance(config, EngineConfig):
            raise TypeError(f"config must be an aionixl.EngineConfig, got {type(config).__name__}")
        if tuning is not None and not isinstance(tuning, Tuning):
            raise TypeError(f"tuning must be an aionixl.lowlevel.Tuning, got {type(tuning).__name__}")
        if backend not in ("asyncio", "trio"):
            raise ValueError(f"backend must be 'asyncio' or 'trio', got {backend!r}")
        if discovery is not None and not isinstance(discovery, EtcdDiscovery):
            raise TypeError(f"discovery must be an aionixl.EtcdDiscovery, got {type(discovery).__name__}")
        if workload is not None:
            _check_target(workload, "workload")
        if not isinstance(workload_args, bytes):
            raise TypeError("workload_args must be bytes")
        if name is not None:
            check_text(name, "name")
        check_text(listen, "listen")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in (env or {}).items()):
            raise TypeError("env must map str to str")
        if isinstance(command_prefix, str) or not all(isinstance(p, str) for p in command_prefix):
            raise TypeError("command_prefix must be a sequence of str (argv words), not one str")
        self.name: str = name if name is not None else unique_name("remote")
        self.seed: int = seed
        self.num_blocks = num_blocks
        self.dtypes: tuple[str, ...] = tuple(dtypes)
        self._listen = listen
        self._address: str | None = None
        self._env = dict(env or {})
        self._config = config
        # (with what the config was given under names that moved to Tuning)
        self._tuning = tuning if config is None else effective_tuning(config, tuning)
        self._backend = backend
        self._prefix = tuple(command_prefix)
        self._discovery = (DiscoverySpec(tuple(discovery.endpoints), discovery.prefix, float(discovery.ttl))
                           if discovery is not None else None)
        self._workload = workload
        self._workload_args = workload_args
        self._proc: anyio.abc.Process | None = None
        self._pid: int | None = None
        self._control: BufferedByteReceiveStream | None = None
        self._stderr: IO[bytes] | None = None
        self._read_lock = anyio.Lock()
        self._write_lock = anyio.Lock()
        self._replies: dict[int, _Reply] = {}
        self._ids = itertools.count(1)
        self._expected_exit = False  # we killed or stopped it, or its death was reported
        self._stopped: _Reply | None = None  # the current child's "stopped" event, once read

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
        if died is not None:
            if exc is None:
                raise died
            exc.add_note(f"and on stopping the remote engine: {died}")

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
        child that had died on its own and was not reported yet, or of a graceful stop that
        went wrong (:class:`RemoteEngineStopError`); None when all was well."""
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
            with anyio.fail_after(KILL_TIMEOUT):
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
            check_geometry(seed, self.num_blocks, self._block_shape, self.dtypes)
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
        check_timeout(timeout, "timeout")
        reply = await self._call("connect", extra_time=timeout, address=address, timeout=float(timeout))
        return str(reply.value)

    async def connect_to(self, name: str, timeout: float = 10.0) -> str:
        """Make the child engine ``connect_to(name)`` through its discovery; returns the
        name of the peer it reached."""
        check_timeout(timeout, "timeout")
        reply = await self._call("connect_to", extra_time=timeout, name=name, timeout=float(timeout))
        return str(reply.value)

    async def call(self, function: str, args: bytes = b"", timeout: float = 60.0) -> Any:
        """Run ``await function(engine, args)`` in the child (``"module:function"``, imported
        there) and return its result, which must be JSON-able. An exception in the child is
        raised here as :class:`RemoteEngineError` naming it; ``TimeoutError`` after ``timeout``."""
        _check_target(function, "function")
        if not isinstance(args, bytes):
            raise TypeError("args must be bytes")
        with anyio.fail_after(timeout):
            reply = await self._call("call", extra_time=timeout, function=function, args=args)
        return reply.value

    async def wait_notification(self, message: bytes, timeout: float) -> Notification:
        """The child engine's ``wait_notification(message, timeout=timeout)``: the
        notification, or ``TimeoutError``."""
        if not isinstance(message, bytes):
            raise TypeError("message must be bytes")
        check_timeout(timeout, "timeout")
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
                if (exc.returncode != LISTEN_FAILED or self._address is None
                        or anyio.current_time() + pause > retry_until):
                    raise
            await anyio.sleep(pause)  # the old incarnation's port is not free yet
            pause = min(pause * 2, 1.0)

    async def _spawn_once(self, listen: str) -> None:
        spec = Spec(
            name=self.name, seed=self.seed, num_blocks=self.num_blocks, block_shape=self._block_shape,
            dtypes=self.dtypes, region_bytes=region_bytes(self._block_shape, self.dtypes), listen=listen,
            backend=self._backend,
            config=msgspec.msgpack.encode(self._config) if self._config is not None else None,
            tuning=msgspec.msgpack.encode(self._tuning) if self._tuning is not None else None,
            discovery=self._discovery, workload=self._workload, workload_args=self._workload_args)
        argv = [*self._prefix, sys.executable, "-c", BOOTSTRAP,
                msgspec.msgpack.encode(spec).hex()]
        if self._stderr is not None:
            self._stderr.close()
        # Kept open (for the tail in reports) until the next start or aclose.
        self._stderr = tempfile.TemporaryFile(prefix="aionixl-remote-")  # noqa: SIM115
        self._replies.clear()
        self._expected_exit = False
        self._stopped = None
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
            # Cancelled (or the reply unreadable) before the child was ready: it may still be
            # importing, and a graceful stop would wait for its engine to start and close.
            with anyio.CancelScope(shield=True):
                await self._stop(graceful=False)
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
            fields = _lines.decode_line(line)
            if fields is not None:  # anything else is not ours (the child's stdout is stderr)
                message = msgspec.convert(fields, _Reply)
                if message.event == "stopped":
                    self._stopped = message  # whoever reads it: the graceful stop looks here
                return message

    async def _read_until_stopped(self) -> None:
        """Read control lines until the child's "stopped" event or the end of its stdout
        (replies read meanwhile are kept for whoever waits for them)."""
        while self._stopped is None:
            async with self._read_lock:
                if self._stopped is not None:
                    return
                message = await self._next_message()
                if message is None:
                    return
                if message.id is not None:
                    self._replies[message.id] = message

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
        line = _lines.encode_line({"id": request_id, "op": op, **args})
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
        stopping = graceful and proc.returncode is None  # checked below
        exited = False  # on its own, after its stdin closed
        try:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)  # in case it is paused
                if graceful:
                    with contextlib.suppress(Exception):
                        assert proc.stdin is not None
                        await proc.stdin.aclose()  # EOF: the child closes its engine and exits
                    with anyio.move_on_after(_STOP_TIMEOUT):
                        await self._read_until_stopped()  # its report on the close
                        await proc.wait()
                    exited = proc.returncode is not None
                for signum, wait in ((signal.SIGTERM, 2.0), (signal.SIGKILL, KILL_TIMEOUT)):
                    if proc.returncode is not None:
                        break
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(proc.pid, signum)
                    with anyio.move_on_after(wait):
                        await proc.wait()
            else:
                with anyio.move_on_after(KILL_TIMEOUT):
                    await proc.wait()
        finally:
            await self._release()
        if died is None and proc.returncode is None:
            died = RemoteEngineError(f"{self.name}: the child process could not be reaped")
        if died is None and stopping:
            died = self._stop_problem(exited)
        return died

    def _stop_problem(self, exited: bool) -> RemoteEngineStopError | None:
        """What went wrong with a graceful stop that has just ended, if anything."""
        proc = self._proc
        assert proc is not None
        report = self._stopped
        resources = ({str(k): int(v) for k, v in report.resources.items()}
                     if report is not None and report.resources is not None else None)
        if not exited:
            why = f"the child did not exit within {_STOP_TIMEOUT:g} s and was terminated"
        elif proc.returncode != 0:
            why = "the child exited with a non-zero status"
        elif resources is None:
            why = "the child exited without reporting its engine's close"
        elif any(resources.values()):
            left = ", ".join(f"{k}={v}" for k, v in sorted(resources.items()) if v)
            why = f"the child's engine still held NIXL resources after closing: {left}"
        elif report is not None and report.threads_after > report.threads_before:
            why = (f"the child had {report.threads_after} OS threads after its engine closed, "
                   f"{report.threads_before} before it opened ({', '.join(report.thread_names)})")
        else:
            return None
        threads_left = max(0, report.threads_after - report.threads_before) if report is not None else 0
        return RemoteEngineStopError(f"{self.name}: the graceful stop failed: {why}", resources=resources,
                                     returncode=proc.returncode, stderr_tail=self.stderr_tail(),
                                     threads_left=threads_left)

    async def _release(self) -> None:
        """Close the pipes of a child that is gone."""
        proc = self._proc
        if proc is not None and proc.returncode is not None:
            with anyio.move_on_after(1), contextlib.suppress(Exception):
                await proc.aclose()


async def each_at_most(at_most: int, function: Callable[[_T], Awaitable[object]],
                       items: Iterable[_T]) -> None:
    """``await function(item)`` for every item, concurrently, but at most ``at_most`` at once:
    starting or stopping many remote engines at once would push some past their start (or
    graceful stop) timeout, each start or exit costing its process seconds of CPU."""
    limiter = anyio.CapacityLimiter(at_most)

    async def limited(item: _T) -> None:
        async with limiter:
            await function(item)

    async with anyio.create_task_group() as tg:
        for item in items:
            tg.start_soon(limited, item)


def _check_target(target: str, what: str) -> None:
    if not isinstance(target, str) or target.count(":") != 1 or not all(target.split(":")):
        raise ValueError(f"{what} must name an async function as 'module:function', got {target!r}")


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
