"""Serving vLLM decode workers: vLLM's side channel answered from the event loop.

A vLLM NixlConnector decode worker asks a prefill's side channel for rank (pp, tp)'s
metadata (one REQ frame) before it reads. This listener answers with the metadata of a
NIXL agent that serves them and the regions in vLLM's form
(:func:`aionixl._vllm_wire.serving_metadata`); the decode then reads the blocks itself
(NIXL READ), and its completion notification and heartbeats are relayed to the engine,
where its leases take them. Unlike vLLM's own listener thread, this one never dies on bad
input: a request it cannot serve (another rank, garbage) gets a one-frame refusal, and the
socket refuses oversized messages. It is a task of the engine's task group and stops with it.

The serving agent is never the engine's own. vLLM's side channel has no authentication,
and NIXL names a notification's sender by the name the sending agent chose: a client that
held the engine's own metadata could send it reserved messages in an admitted peer's name
(push, cancel, confirm a read that never landed). So decoders read from a second agent over
the same memory: :class:`ServingAgent` in this process, or a serving child's
(``isolate=True``, :mod:`aionixl._vllm_sidecar`). What reaches either is relayed with its
reserved messages refused, and the engine's own metadata goes only to peers that completed
aionixl's handshake.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Mapping, Sequence

import anyio
import anyio.abc
import anyio.lowlevel
import zmq

from . import _protocol as proto
from . import _zmq
from ._agent import Agent, AgentFactory
from ._checks import check_int
from ._config import EngineConfig, Tuning
from ._errors import AionixlError, ListenError
from ._lifecycle import LocalSide
from ._nixl import serving_agent
from ._notifications import Notification
from ._ratelimit import RateLimitedLog
from ._regions import registration_spans
from ._shared import locate_all
from ._vllm_sidecar import Served, Sidecar, agent_suffix
from ._vllm_wire import (
    MAX_REQUEST_BYTES,
    AionixlRoute,
    VllmWireError,
    decode_request,
    encode_payload,
    encode_refusal,
    encode_reply,
    serving_metadata,
)

log = logging.getLogger("aionixl")

#: The side channels this process serves, for :func:`announced_id`.
_SERVERS: weakref.WeakSet[VllmServer] = weakref.WeakSet()


def announced_id(engine_id: str) -> str:
    """The engine id decoders must be told for ``engine_id``: the id the engine of this
    process serving under that user id announces now, or ``engine_id`` itself (an id
    already announced, or one served elsewhere). ``ValueError`` when two engines of this
    process serve under it: which one is meant is not known."""
    current = [s.engine_id for s in _SERVERS if s.user_engine_id == engine_id and s.engine_id is not None]
    if len(current) > 1:
        raise ValueError(f"{len(current)} engines of this process serve vLLM decoders under engine id "
                         f"{engine_id!r}: name the one meant with aionixl.vllm.engine_id(engine)")
    return current[0] if current else engine_id


class ServingAgent:
    """The NIXL agent that serves vLLM decoders from this process: the engine's regions
    registered with an agent of their own (see the module docstring). Its NIXL progress
    thread serves their reads as they come (over UCX TCP a read waits for its target to
    progress); without one, reads wait for the engine's drainer, which progresses it as it
    collects its notifications (:meth:`poll`)."""

    def __init__(self, local: LocalSide, backends: tuple[str, ...], make: AgentFactory, suffix: str,
                 progress_thread: bool) -> None:
        agent = make(f"{local.name}-vllm-{suffix}", backends, progress_thread, False)
        try:
            agent.register(registration_spans(local.regions), local.mem_type)
        except BaseException:
            agent.destroy()
            raise
        self._agent: Agent | None = agent
        self.metadata = agent.metadata()

    def poll(self) -> Mapping[str, list[bytes]]:
        """The notifications that arrived, by sender (without a progress thread, one NIXL
        progress call first)."""
        return {} if self._agent is None else self._agent.get_notifs()

    def live(self) -> dict[str, int]:
        return {} if self._agent is None else self._agent.live()

    def release(self, problems: list[str]) -> None:
        """Deregister and drop the agent (idempotent); what failed goes to ``problems``."""
        agent, self._agent = self._agent, None
        if agent is None:
            return
        try:
            agent.deregister_all()
        except AionixlError as exc:
            problems.append(str(exc))
        if not agent.destroy():
            problems.append(f"NIXL agent {agent.name!r} outlived its release")


class VllmServer:
    """One engine's vLLM side channel (see :func:`aionixl.vllm.serve`)."""

    def __init__(self, local: LocalSide, config: EngineConfig, tuning: Tuning, noisy: RateLimitedLog,
                 wake_drainer: Callable[[], None], deliver: Callable[[Notification], None],
                 host: Mapping[str, str]) -> None:
        self._local = local
        self._config = config
        self._tuning = tuning
        self._rdma = host.get("rdma") == "1"  # else decodes on other hosts read over UCX TCP
        self._noisy = noisy
        self._wake_drainer = wake_drainer
        self._deliver = deliver  # notifications a serving child relays
        self._payload = b""  # empty while a serving child is (re)starting: requests are refused
        self._rank = (0, 0)
        self._describe: Callable[[str, bytes, list[proto.RegionInfo]], bytes] | None = None
        self._exact_id = False
        #: The engine id :func:`aionixl.vllm.serve` was given.
        self.user_engine_id = ""
        #: The bound endpoint once serving; None before.
        self.address: str | None = None
        #: The engine id decoders must be told now (``aionixl.vllm.engine_id``).
        self.engine_id: str | None = None
        #: True once configured (one side channel per engine).
        self.configured = False
        #: True while decode workers read from this process (not isolated): the drainer
        #: then keeps NIXL progressing even with no peer of our own.
        self.serving = False
        #: Without ``isolate``: the agent decoders read from, in this process.
        self.agent: ServingAgent | None = None
        #: With ``isolate``: the child process decoders read from.
        self.sidecar: Sidecar | None = None
        self.answered = self.refused = 0

    def configure(self, *, engine_id: str, compat_hash: str, block_size: int, kv_cache_layout: str,
                  attn_backend_name: str, pp_rank: int, tp_rank: int,
                  layer_names: Sequence[str] | None, isolate: bool, exact_engine_id: bool,
                  progress_thread: bool, route: AionixlRoute | None = None) -> None:
        """Check the arguments and build the reply (with ``isolate``, the serving child
        that :meth:`Sidecar.run` starts); ``ValueError`` for a bad one, ``RuntimeError``
        when this engine serves vLLM already. ``route``: the engine's own handshake, named
        in every reply for aionixl decoders (``aionixl.vllm.connect``)."""
        if self.configured:
            raise RuntimeError(f"engine {self._local.name!r} serves vLLM decoders already "
                               f"(at {self.address})")
        check_int(pp_rank, "pp_rank", 0)
        check_int(tp_rank, "tp_rank", 0)
        for flag, what in ((isolate, "isolate"), (exact_engine_id, "exact_engine_id"),
                           (progress_thread, "progress_thread")):
            if not isinstance(flag, bool):
                raise ValueError(f"{what} must be a bool, got {flag!r}")
        spans = locate_all(self._local.regions) if isolate else []

        def describe(served_id: str, metadata: bytes, regions: list[proto.RegionInfo]) -> bytes:
            md = serving_metadata(served_id, metadata, regions, block_size=block_size,
                                  kv_cache_layout=kv_cache_layout, attn_backend_name=attn_backend_name,
                                  layer_names=layer_names)
            return encode_payload(compat_hash, md, route)

        ours = [proto.RegionInfo.of(r) for r in self._local.regions]
        payload = describe(engine_id, self._local.metadata, ours)  # checks the arguments
        self._describe, self._rank = describe, (pp_rank, tp_rank)
        self.user_engine_id, self._exact_id = engine_id, exact_engine_id
        if isolate:
            self.sidecar = Sidecar(self._local.name, self._local.regions, spans,
                                   backends=self._config.backends,
                                   poll_interval=self._tuning.notification_poll_interval,
                                   stop_timeout=self._config.close_timeout / 2,
                                   deliver=self._deliver, on_ready=self._served, on_down=self._down,
                                   noisy=self._noisy)
        else:
            suffix = agent_suffix()
            self.agent = ServingAgent(self._local, self._config.backends,
                                      self._tuning.agent_factory or serving_agent, suffix, progress_thread)
            served_id = self._announce(first=True, suffix=suffix)
            payload = describe(served_id, self.agent.metadata, ours)
            self._payload, self.engine_id, self.serving = payload, served_id, True
            if not self._rdma:
                log.warning("engine %r serves vLLM decoders from its own process on a host without "
                            "RDMA: over UCX TCP a decode dying mid-read can make UCX abort this "
                            "process; aionixl.vllm.serve(..., isolate=True) serves them from a child process "
                            "instead (docs/vllm.md)", self._local.name)
        self.configured = True
        _SERVERS.add(self)

    def stop(self) -> None:
        """Closing: a serving child stops now, even one still starting."""
        if self.sidecar is not None:
            self.sidecar.stop()

    def reset(self) -> None:
        """Undo :meth:`configure` after a failed start (a later call may try again)."""
        if self.sidecar is not None:
            self.sidecar.stop()
        problems: list[str] = []
        self.release(problems)  # no reply, no engine id, not announced any more
        if problems:
            log.error("engine %r: releasing its vLLM serving agent: %s", self._local.name,
                      "; ".join(problems))
        self.sidecar = None
        self.configured = self.serving = False

    def live(self) -> dict[str, int]:
        """What the serving agent in this process holds (``Engine.live_resources``)."""
        return {} if self.agent is None else self.agent.live()

    def poll(self) -> Mapping[str, list[bytes]]:
        """What vLLM decoders sent the serving agent in this process since the last call
        (nothing when it serves from a child, whose notifications arrive on its own)."""
        if self.agent is None:
            return {}
        try:
            return self.agent.poll()
        except AionixlError as exc:
            self._noisy.log(logging.WARNING, "vllm-notifs", "reading the vLLM serving agent's "
                            "notifications failed: %s", exc)
            return {}

    def release(self, problems: list[str]) -> None:
        """Closing: the serving agent in this process goes (decoders can no longer read)."""
        self._payload, self.engine_id = b"", None
        _SERVERS.discard(self)
        if self.agent is not None:
            self.agent.release(problems)
            self.agent = None

    def _announce(self, *, first: bool, suffix: str) -> str:
        """The engine id of a new serving agent: the user's with the agent name's suffix
        (random, new for each agent). A vLLM decode keeps a remote agent by engine id,
        and its NIXL refuses a second agent of one name: an agent that replaced another
        under the same id or name, after a restart of the prefill or of its serving
        child, would never be read. With ``exact_engine_id`` the first agent announces the
        user's id as given (an id new at each start already, as vLLM's own)."""
        if first and self._exact_id:
            return self.user_engine_id
        return f"{self.user_engine_id}~{suffix}"

    def _served(self, served: Served) -> None:
        """A serving child is up: answer with its agent and addresses, under an engine id
        of its own (:meth:`_announce`)."""
        assert self._describe is not None
        served_id = self._announce(first=not served.generation, suffix=served.suffix)
        self._payload = self._describe(served_id, served.metadata, served.regions)
        self.engine_id = served_id

    def _down(self) -> None:
        self._payload, self.engine_id = b"", None

    async def listen(self, endpoint: str, *, task_status: anyio.abc.TaskStatus[str]) -> None:
        """Answer metadata requests on ``endpoint`` until cancelled; reports the bound address."""
        zctx = self._local.zctx
        assert zctx is not None
        try:
            sock = _zmq.bind_router(zctx, endpoint, MAX_REQUEST_BYTES + 256, 64)
        except zmq.ZMQError as exc:
            raise ListenError(f"cannot serve vLLM on {endpoint!r}: {exc}") from exc
        try:
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            task_status.started(self.address)
            while True:
                frames = await _zmq.recv_multipart(sock)
                envelope, body = split_envelope(frames)
                if envelope and not _zmq.try_send_multipart(sock, [*envelope, *self.answer(body)]):
                    self._noisy.log(logging.DEBUG, "vllm-reply", "vLLM side-channel reply dropped: "
                                    "the client is gone or not reading")
                self._wake_drainer()
                await anyio.lowlevel.checkpoint()
        finally:
            sock.close(linger=0)

    def answer(self, body: list[bytes]) -> list[bytes]:
        """The reply frames to one request. Never raises for bad input: it refuses."""
        try:
            rank = decode_request(body)
        except VllmWireError as exc:
            return self._refuse(f"not a vLLM metadata request: {exc}")
        if rank != self._rank:
            return self._refuse(f"engine {self._local.name!r} serves pp_rank {self._rank[0]}, "
                                f"tp_rank {self._rank[1]} only; asked for {rank}")
        if not self._payload:
            return self._refuse(f"engine {self._local.name!r}: its vLLM serving process is restarting")
        self.answered += 1
        return encode_reply(self._payload, time.perf_counter())

    def _refuse(self, reason: str) -> list[bytes]:
        self.refused += 1
        self._noisy.log(logging.WARNING, "vllm-refused", "refused a vLLM side-channel request: %s",
                        reason)
        return encode_refusal(proto.clip(reason))


def split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """A ROUTER message as (routing envelope, body): a REQ client's envelope ends with an
    empty delimiter frame, a DEALER's is its routing id alone."""
    for i, frame in enumerate(frames[1:], 1):
        if not frame:
            return frames[:i + 1], frames[i + 1:]
    return frames[:1], frames[1:]
