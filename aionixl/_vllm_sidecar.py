"""A child process that serves vLLM decoders' reads, so that UCX aborting it spares the engine.

Over UCX TCP a vLLM decode's READ is emulated: the target sends the data back, and UCX
aborts the target process when that send meets a decode that died mid-read (docs/vllm.md).
With ``aionixl.vllm.serve(..., isolate=True)`` the target is this child: it maps the engine's regions
(:func:`aionixl._shared.shared_dram` memory), registers them with a NIXL agent of its own,
reports that agent's metadata, and relays the notifications decoders send it (read-dones,
heartbeats) to the engine. The engine side (:class:`Sidecar`) keeps one running: a child
that dies is counted, logged and replaced by a new one, with a new agent.

    python -c "from aionixl._vllm_sidecar import main; main()" SPEC_JSON

Messages (:mod:`aionixl._lines`) on the child's stdout, which is its own: NIXL and UCX log
to stderr here. ``{"ready": {"metadata": b64, "bases": [...]}}`` once registered, then
``{"notifs": [[agent, b64], ...]}``. End of stdin releases everything and exits; the
engine's process dying, however it dies, kills it (Linux's parent-death signal).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import logging
import mmap
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import anyio.abc
import msgspec
import numpy as np

from ._errors import AionixlError
from ._lines import LineReader, write_fd
from ._nixl import NixlAgent
from ._notifications import Notification
from ._protocol import RegionInfo
from ._ratelimit import RateLimitedLog
from ._regions import Region, registration_spans
from ._shared import SharedSpan

#: How long a new child may take to register the regions and report.
START_TIMEOUT = 60.0
#: Waits before starting a replacement: the first, doubling after failed starts up to the last.
RESTART_DELAY = (0.2, 5.0)
#: The child's NIXL progress thread's idle timeout (NIXL rounds it up to 1 ms; 0 would spin a
#: core). Not the in-process serving agent's 10 ms (``_nixl.SERVING_PROGRESS_DELAY_US``): with
#: 10 ms here, two CI runs in a row let a 2 s lease expire although the relayed heartbeats
#: left the decode on time; with this value that test passed in three CI runs and failed
#: once (a child stalled for 10 s). Not understood; idle, the child costs ~2.5 % of a core
#: more for it.
PROGRESS_DELAY_US = 100
#: The engine pings a serving child this often and replaces one that does not answer within
#: the deadline (stopped, or stuck in UCX: it would never exit by itself). Generous: under a
#: loaded CI run a serving child once left a ping unanswered for over 10 s while serving its
#: first read (cause not found), and a false kill fails the reads under way.
PING_INTERVAL = 0.5
PING_DEADLINE = 30.0


def agent_suffix() -> str:
    """The end of a new serving agent's name, and of the engine id it announces: 8 random
    hex digits, new for each agent (see ``Served``)."""
    return secrets.token_hex(4)


@dataclass(frozen=True, slots=True)
class Served:
    """What a running child serves: its agent's metadata, the regions at its addresses,
    its generation (0 for the first child, counting replacements) and the suffix of its
    agent's name, new for each child (a decode that read from an earlier one still holds
    that agent's name: NIXL would refuse to load another under it)."""

    metadata: bytes
    regions: list[RegionInfo]
    generation: int
    suffix: str


class Sidecar:
    """Keeps one serving child for an engine, from :meth:`run` until cancelled."""

    def __init__(self, name: str, regions: Sequence[Region], spans: Sequence[SharedSpan], *,
                 backends: tuple[str, ...], poll_interval: float, stop_timeout: float,
                 deliver: Callable[[Notification], None], on_ready: Callable[[Served], None],
                 on_down: Callable[[], None], noisy: RateLimitedLog) -> None:
        self._name = name
        self._regions = list(regions)
        self._spans = list(spans)
        self._backends = backends
        self._poll_interval = poll_interval
        self._stop_timeout = stop_timeout
        self._deliver = deliver
        self._on_ready = on_ready
        self._on_down = on_down
        self._noisy = noisy
        self._scope: anyio.CancelScope | None = None
        #: Children that ended after serving without being told to (each one is replaced).
        self.restarts = 0
        #: Of those, the ones killed for not answering a liveness ping in time.
        self.unresponsive = 0
        #: The running child's process id; None between children.
        self.pid: int | None = None

    def stop(self) -> None:
        """End :meth:`run`, also while its first child is starting (the child is stopped
        within the stop timeout plus a second)."""
        if self._scope is not None:
            self._scope.cancel()

    async def run(self, *, task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Start the first child and report once it serves (its start failing raises
        ``AionixlError``), then replace every child that ends, until cancelled."""
        with anyio.CancelScope() as self._scope:
            await self._child(0, task_status)
            generation, delay = 1, RESTART_DELAY[0]
            while True:
                self._on_down()
                await anyio.sleep(delay)
                try:
                    await self._child(generation, None)
                    delay = RESTART_DELAY[0]
                except Exception as exc:  # whatever went wrong, the engine keeps trying
                    self._noisy.log(logging.ERROR, "sidecar-start", "%s", exc)
                    delay = min(delay * 2, RESTART_DELAY[1])
                generation += 1

    async def _child(self, generation: int, task_status: anyio.abc.TaskStatus[None] | None) -> None:
        """Run one child until it ends; raises ``AionixlError`` if it never served."""
        suffix = agent_suffix()
        spec = {"name": f"{self._name}-vllm-{suffix}", "backends": list(self._backends),
                "poll_interval": self._poll_interval, "parent": os.getpid(),
                "regions": [[s.fd, s.offset, r.stride, r.block_bytes, r.num_blocks]
                            for r, s in zip(self._regions, self._spans, strict=True)]}
        # -P: nothing from the working directory shadows the modules the child imports.
        argv = [sys.executable, "-P", "-c", "from aionixl._vllm_sidecar import main; main()",
                msgspec.json.encode(spec).decode()]
        try:  # Popen, not anyio.open_process: asyncio watches a child with a thread on 3.11
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=_child_env(),
                                    pass_fds=sorted({s.fd for s in self._spans}),
                                    start_new_session=True)  # a terminal's ^C is the engine's to handle
        except (OSError, ValueError) as exc:
            raise AionixlError(f"cannot start the vLLM serving process: {exc}") from exc
        try:
            child = _Child(proc, self._stop_timeout)
        except OSError as exc:  # no pidfd (Linux < 5.3)
            proc.kill()
            for pipe in (proc.stdin, proc.stdout):
                if pipe is not None:
                    pipe.close()
            proc.wait()  # just killed: returns at once
            raise AionixlError(f"cannot watch the vLLM serving process: {exc}") from exc
        self.pid = proc.pid
        try:
            try:
                ready: dict[str, Any] | None = None
                with anyio.move_on_after(START_TIMEOUT):
                    ready = await child.receive()
                served = None if ready is None else self._served(ready.get("ready"), generation, suffix)
            except ValueError as exc:  # a malformed line or report
                raise AionixlError(f"the vLLM serving process (pid {proc.pid}) did not start: "
                                   f"bad report: {exc}") from exc
            if served is None:
                code = await child.wait(1.0)
                why = f"it exited with code {code}" if code is not None \
                    else f"no report within {START_TIMEOUT:g} s"
                raise AionixlError(f"the vLLM serving process (pid {proc.pid}) did not start: {why}")
            self._on_ready(served)
            if task_status is not None:
                task_status.started()
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._watch, child)
                why = await self._relay(child)
                tg.cancel_scope.cancel()
            self.restarts += 1
            self._noisy.log(logging.ERROR, "sidecar-exit", "the vLLM serving process (pid %d) %s; "
                            "starting another", proc.pid, why)
        finally:
            self.pid = None
            with anyio.CancelScope(shield=True):
                await child.stop()

    async def _relay(self, child: _Child) -> str:
        """Deliver what ``child`` relays, and note its pongs, until it ends; why it ended."""
        try:
            while (message := await child.receive()) is not None:
                for agent, text in message.get("notifs", ()):
                    self._deliver(Notification(agent, base64.b64decode(text)))
                if "pong" in message:
                    child.ponged(int(message["pong"]))
        except (ValueError, TypeError) as exc:  # it spoke nonsense: it is stopped after
            return f"sent a bad message ({exc}); stopped"
        if child.unresponsive:
            return f"did not answer a liveness ping within {PING_DEADLINE:g} s; killed"
        return f"ended with code {await child.wait(1.0)}"

    async def _watch(self, child: _Child) -> None:
        """Ping ``child`` every ``PING_INTERVAL``; kill it (its stdout then ends, and it is
        replaced as a crashed one is) when a ping goes unanswered for ``PING_DEADLINE``."""
        n = 0
        while True:
            await anyio.sleep(PING_INTERVAL)
            n += 1
            if child.ping(n):
                with anyio.move_on_after(PING_DEADLINE):
                    await child.answered(n)
                # Past the deadline, one more look: had this loop itself stalled, the pong
                # may sit unread in the pipe, and the relay reads it now.
                with anyio.move_on_after(PING_INTERVAL):
                    await child.answered(n)
            if child.pong < n:
                self.unresponsive += 1
                child.kill_unresponsive()
                return

    def _served(self, report: Any, generation: int, suffix: str) -> Served | None:
        """What a ready report says; ``ValueError`` for a malformed one."""
        if report is None:
            return None
        try:
            bases = report["bases"]
            metadata = base64.b64decode(report["metadata"], validate=True)
        except (KeyError, TypeError) as exc:
            raise ValueError(f"no {exc}") from exc
        if not isinstance(bases, list) or len(bases) != len(self._regions) \
                or not all(type(b) is int and b > 0 for b in bases):
            raise ValueError(f"bases {bases!r}")
        regions = [RegionInfo(base, r.stride, r.block_bytes, r.num_blocks, "DRAM", 0)
                   for base, r in zip(bases, self._regions, strict=True)]
        return Served(metadata, regions, generation, suffix)


def _child_env() -> dict[str, str]:
    """The engine's environment, with this aionixl's folder on PYTHONPATH when the
    interpreter would not find it by itself (a path added at run time)."""
    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    if root not in sys.path:
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


class _Child:
    """One child process driven from the event loop: its messages (stdout, non-blocking)
    and its end (a pidfd, readable once it exited)."""

    def __init__(self, proc: subprocess.Popen[bytes], stop_timeout: float) -> None:
        assert proc.stdout is not None
        self._pidfd = os.pidfd_open(proc.pid)
        self._proc = proc
        self._stop_timeout = stop_timeout
        self._out = proc.stdout.fileno()
        os.set_blocking(self._out, False)
        assert proc.stdin is not None
        self._in = proc.stdin.fileno()
        os.set_blocking(self._in, False)
        self._reader = LineReader()
        #: The last liveness ping it answered; whether it was killed for not answering one.
        self.pong = 0
        self._pong_event = anyio.Event()
        self.unresponsive = False

    def ping(self, n: int) -> bool:
        """Send ping ``n`` (False when its stdin takes nothing: it is not reading)."""
        try:
            return os.write(self._in, b"ping %d\n" % n) > 0
        except (BlockingIOError, BrokenPipeError):
            return False

    def ponged(self, n: int) -> None:
        self.pong = max(self.pong, n)
        self._pong_event.set()

    async def answered(self, n: int) -> None:
        """Until ping ``n`` is answered."""
        while self.pong < n:
            self._pong_event = anyio.Event()
            await self._pong_event.wait()

    def kill_unresponsive(self) -> None:
        self.unresponsive = True
        with contextlib.suppress(ProcessLookupError):  # its group: it leads a session of its own
            os.killpg(self._proc.pid, signal.SIGKILL)

    async def receive(self) -> dict[str, Any] | None:
        """The next message; None once the child's stdout closed."""
        while (message := self._reader.pop()) is None:
            await anyio.wait_readable(self._out)
            try:
                chunk = os.read(self._out, 1 << 16)
            except BlockingIOError:
                continue
            if not chunk:
                return None
            self._reader.feed(chunk)
        return message

    async def wait(self, limit: float) -> int | None:
        """The exit code once the child ended (reaped), or None if it still runs after ``limit``."""
        with anyio.move_on_after(limit):
            await anyio.wait_readable(self._pidfd)
        return self._proc.poll()

    async def stop(self) -> None:
        """Tell the child to exit (end of its stdin), wait up to the stop timeout, kill it,
        release all."""
        assert self._proc.stdin is not None
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        if await self.wait(self._stop_timeout) is None:
            with contextlib.suppress(ProcessLookupError):  # its group: it leads a session of its own
                os.killpg(self._proc.pid, signal.SIGKILL)
            await self.wait(1.0)  # SIGKILL: ends it unless the kernel holds it
        for fd in (self._out, self._pidfd):
            anyio.notify_closing(fd)
        assert self._proc.stdout is not None
        self._proc.stdout.close()
        os.close(self._pidfd)


# ---- the child ---------------------------------------------------------------------------

def _map_regions(rows: list[list[int]]) -> tuple[list[Region], list[Any]]:
    """The engine's regions at this process's addresses, and the mappings that hold them."""
    maps: dict[int, np.ndarray] = {}
    regions = []
    for fd, offset, stride, block_bytes, num_blocks in rows:
        if fd not in maps:
            mapping = mmap.mmap(fd, os.fstat(fd).st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            maps[fd] = np.frombuffer(mapping, dtype=np.uint8)
        regions.append(Region(int(maps[fd].ctypes.data) + offset, stride, block_bytes, num_blocks, "DRAM", 0))
    return regions, list(maps.values())


async def _serve(spec: dict[str, Any], ctl: int) -> None:
    regions, keep = _map_regions(spec["regions"])
    agent = NixlAgent(spec["name"], tuple(spec["backends"]), progress_thread=True,
                      progress_delay_us=PROGRESS_DELAY_US)
    try:
        agent.register(registration_spans(regions), "DRAM")
        write_fd(ctl, {"ready": {"metadata": base64.b64encode(agent.metadata()).decode(),
                                 "bases": [r.base for r in regions]}})
        async with anyio.create_task_group() as tg:
            tg.start_soon(_relay, agent, ctl, float(spec["poll_interval"]))
            await _answer_until_stdin_ends(ctl)
            tg.cancel_scope.cancel()
    finally:
        agent.deregister_all()
        agent.destroy()
        del keep


async def _relay(agent: NixlAgent, ctl: int, cap: float) -> None:
    """Poll NIXL for notifications and pass them on: every loop turn while they arrive,
    backing off (doubling) to ``cap`` while none do."""
    interval = 0.0
    while True:
        notifs = agent.get_notifs()
        batch = [[name, base64.b64encode(m).decode()] for name, ms in notifs.items() for m in ms]
        if batch:
            write_fd(ctl, {"notifs": batch})
            interval = 0.0
        else:
            interval = min(cap, max(interval * 2.0, 20e-6))
        await anyio.sleep(interval)


async def _answer_until_stdin_ends(ctl: int) -> None:
    """Answer the engine's liveness pings (``ping N`` lines on stdin: ``{"pong": N}``) until
    stdin ends."""
    os.set_blocking(0, False)
    pending = b""
    while True:
        await anyio.wait_readable(0)
        try:
            chunk = os.read(0, 4096)
        except BlockingIOError:
            continue
        if not chunk:
            return
        *lines, pending = (pending + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"ping "):
                write_fd(ctl, {"pong": int(line[5:])})


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies, however it dies (Linux's
    parent-death signal): a SIGKILLed engine never closes our stdin, and a child stopped or
    stuck in UCX would not read it anyway."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # it died before the signal was armed
        os._exit(1)


_PR_SET_PDEATHSIG = 1


def main() -> None:
    spec = msgspec.json.decode(sys.argv[1])
    _die_with(int(spec["parent"]))
    ctl = os.dup(1)
    os.dup2(2, 1)  # NIXL and UCX log to stdout: stdout is the parent's channel here
    anyio.run(_serve, spec, ctl)

