"""Handshakes: the listener that admits connecting engines, and ``connect()`` going out.

Both sides speak :mod:`aionixl._protocol` (sans-I/O, msgspec) over zmq through
:mod:`aionixl._zmq`. A handshake exchanges agent metadata and region geometry; each side
checks compatibility, then admits the other in its :class:`~aionixl._peers.PeerTable`.
The listener never raises for bad input: it answers with a rejection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import anyio
import anyio.abc
import anyio.lowlevel
import zmq

from . import _protocol as proto
from . import _zmq
from ._checks import check_timeout, deadline
from ._config import EngineConfig, Tuning
from ._errors import (
    AionixlError,
    EngineClosedError,
    HandshakeError,
    IncompatiblePeerError,
    ListenError,
    same_kind,
)
from ._lifecycle import OPEN, Lifecycle, LocalSide
from ._peer import Peer
from ._peers import PeerTable
from ._ratelimit import RateLimitedLog
from ._wire import FEATURES, PROBE

log = logging.getLogger("aionixl")


class RefusedError(HandshakeError):
    """The peer refused us for a reason another attempt will not change."""


#: Reject codes that a later attempt may not get: the peer is busy or shutting down.
_RETRYABLE_REJECTS = frozenset({"internal", "draining"})


class Handshakes:
    """The listener side and the client side of one engine's handshakes."""

    def __init__(self, local: LocalSide, life: Lifecycle, config: EngineConfig, tuning: Tuning,
                 peers: PeerTable,
                 noisy: RateLimitedLog, host: Mapping[str, str], wake_drainer: Callable[[], None]) -> None:
        self._local = local
        self._life = life
        self._regions = regions = local.regions
        self._config = config
        self._tuning = tuning
        self._peers = peers
        self._noisy = noisy
        self._secret = config.handshake_secret
        self._replay_guard = proto.ReplayGuard()
        self._compat = dict(config.compat)
        self._compat_hash = proto.compat_hash(regions, self._compat)
        self._connecting: dict[str, anyio.Event] = {}
        self._connect_errors: dict[str, BaseException] = {}
        self.accepted = self.rejected = 0
        #: Where this engine runs, told to peers (see ``_protocol._EngineInfo.host``).
        self._host: dict[str, str] = dict(host)
        self._wake_drainer = wake_drainer

    def _info(self) -> tuple[str, bytes, list[proto.RegionInfo], dict[str, str], str]:
        return (self._local.name, self._local.metadata,
                [proto.RegionInfo.of(r) for r in self._regions], self._compat, self._compat_hash)

    def _staging(self) -> list[proto.RegionInfo]:
        slots = self._local.staging
        return [] if slots is None else [proto.RegionInfo.of(r) for r in slots.regions]

    # ---- the listener -------------------------------------------------------------------

    async def listen(self, endpoint: str, *, task_status: anyio.abc.TaskStatus[str]) -> None:
        """Answer handshakes on ``endpoint`` until cancelled; reports the bound address."""
        zctx = self._local.zctx
        assert zctx is not None
        try:
            sock = _zmq.bind_router(zctx, endpoint, self._tuning.max_handshake_bytes + 4096, 16)
        except zmq.ZMQError as exc:
            raise ListenError(f"cannot listen on {endpoint!r}: {exc}") from exc
        try:
            task_status.started(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            while True:
                frames = await _zmq.recv_multipart(sock)
                reply = self.serve(frames[1:])  # frames[0] is the client's routing id
                if isinstance(reply, proto.Reject):
                    self.rejected += 1
                else:
                    self.accepted += 1
                if not _zmq.try_send_multipart(sock, [frames[0], *proto.seal(proto.encode(reply),
                                                                              self._secret)]):
                    log.debug("handshake reply dropped: the client is gone or not reading")
                self._wake_drainer()
                await anyio.lowlevel.checkpoint()
        finally:
            sock.close(linger=0)

    def serve(self, frames: list[bytes]) -> proto.Welcome | proto.Reject:
        """Answer one handshake request. Never raises for bad input: it rejects."""
        version = proto.PROTOCOL_VERSION
        name = self._local.name
        try:
            hello = proto.decode_hello(proto.unseal(frames, self._secret),
                                       self._tuning.max_handshake_bytes)
            if self._secret is not None:
                self._replay_guard.check(hello, time.time())
            if self._life.state != OPEN:
                return proto.Reject(version, "draining", f"engine {name!r} takes no new peers")
            if hello.name == name:
                return proto.Reject(version, "self", f"{proto.clip(hello.name)!r} is this engine's own name")
            proto.check_peer(self._regions, self._compat, self._compat_hash, hello,
                             equal_geometry=self._config.require_equal_geometry,
                             max_descriptors=self._tuning.max_peer_descriptors)
            self._peers.admit(hello.name, hello.agent_metadata, hello.regions, None, hello.features,
                              proto.clip_host(hello.host), hello.staging)
        except proto.ProtocolError as exc:
            self._noisy.log(logging.WARNING, "bad-hello", "rejected a handshake: %s", exc)
            return proto.Reject(version, exc.code, str(exc))
        except proto.Incompatible as exc:
            self._noisy.log(logging.WARNING, "incompatible", "rejected an incompatible peer: %s", exc)
            return proto.Reject(version, "incompatible", str(exc), exc.field)
        except Exception as exc:
            self._noisy.log(logging.WARNING, "admit", "handshake failed on our side: %s",
                            proto.clip(repr(exc)))
            return proto.Reject(version, "internal", proto.clip(str(exc)))
        return proto.Welcome(version, *self._info(), hello.nonce, 0.0, sorted(FEATURES), self._host,
                             self._config.require_equal_geometry, self._staging())

    # ---- connecting out -----------------------------------------------------------------

    async def connect(self, address: str, timeout: float) -> Peer:
        """See :meth:`Engine.connect`."""
        life = self._life
        life.check_open()
        if not isinstance(address, str) or not address:
            raise ValueError("address must be a zmq endpoint string")
        _zmq.check_tcp_port(address, "address")
        check_timeout(timeout, "timeout")
        failed_attempts: list[BaseException] = []
        try:
            with deadline(timeout):
                while True:
                    peer = self._peers.by_address.get(address)
                    if peer is not None and peer.connected:
                        await anyio.lowlevel.checkpoint()
                        return peer
                    pending = self._connecting.get(address)
                    if pending is None:
                        break
                    with life.operation():
                        await pending.wait()
                    life.check_open()
                    error = self._connect_errors.get(address)
                    if error is not None:
                        if self._config.connect_retries and _retryable(error):
                            continue  # the shared attempt gave up; this caller has time left
                        raise same_kind(error, f"connecting to {address}: {error}") from error
                done = anyio.Event()
                self._connecting[address] = done
                self._connect_errors.pop(address, None)
                try:
                    return await self._with_retries(address, failed_attempts)
                except Exception as exc:
                    self._connect_errors[address] = exc
                    raise
                finally:
                    del self._connecting[address]
                    done.set()
        except TimeoutError:
            if failed_attempts:
                last = failed_attempts[-1]
                raise HandshakeError(f"no usable handshake with {address} within {timeout} s after "
                                     f"{len(failed_attempts)} failed attempt(s); last: {last}") from last
            raise HandshakeError(
                f"no handshake answer from {address} within {timeout} s") from None

    async def _with_retries(self, address: str, failed: list[BaseException]) -> Peer:
        """Up to ``1 + connect_retries`` handshakes, pausing with doubling backoff between.

        The caller's deadline bounds them all. Without retries the one attempt may use the
        whole deadline; with retries an unanswered attempt is abandoned after
        ``connect_attempt_timeout`` so that the next one can go out on a fresh socket (a
        peer that restarted mid-handshake never answers the first).
        """
        life = self._life
        retries = self._config.connect_retries
        pause = self._tuning.connect_backoff
        for attempt in range(retries + 1):
            last = attempt == retries
            life.check_open()  # closed or draining during the last backoff: stop here
            try:
                if last:
                    return await self._handshake(address)
                with anyio.fail_after(self._tuning.connect_attempt_timeout):
                    return await self._handshake(address)
            except TimeoutError as exc:
                if last:
                    raise
                failed.append(HandshakeError(f"no answer within {self._tuning.connect_attempt_timeout} s"))
                failed[-1].__cause__ = exc
                self._noisy.log(logging.INFO, "connect-retry", "no handshake answer from %s yet; retrying",
                                address)
            except (RefusedError, IncompatiblePeerError, ValueError, EngineClosedError):
                raise
            except AionixlError as exc:
                if last:
                    raise
                failed.append(exc)
                self._noisy.log(logging.INFO, "connect-retry", "handshake with %s failed (%s); retrying",
                                address, exc)
            with life.operation():  # closing the engine ends the pause with EngineClosedError
                await anyio.sleep(pause)
            pause = min(pause * 2.0, 1.0)
        raise AssertionError("unreachable")

    async def _handshake(self, address: str) -> Peer:
        life, name = self._life, self._local.name
        agent, ctx = self._local.agent, self._local.zctx
        assert agent is not None and ctx is not None
        nonce = proto.new_nonce() if self._secret is not None else b""
        hello = proto.Hello(proto.PROTOCOL_VERSION, *self._info(), nonce, time.time(), sorted(FEATURES),
                            self._host, self._config.require_equal_geometry, self._staging())
        limit = self._tuning.max_handshake_bytes
        with life.operation():
            sock = _zmq.connect_socket(ctx, zmq.DEALER, address, limit, "peer")
            try:
                await _zmq.send_multipart(sock, proto.seal(proto.encode(hello), self._secret))
                frames = await _zmq.recv_multipart(sock)
            finally:
                sock.close(linger=0)
        life.check_open()
        try:
            reply = proto.decode_reply(proto.unseal(frames, self._secret, tag_optional=True), limit)
        except proto.ProtocolError as exc:
            if exc.code == "unauthorized":
                raise RefusedError(f"{address} answered without this engine's secret"
                                   f"{_unsigned_refusal(frames, limit)}") from exc
            raise RefusedError(f"unusable handshake reply from {address}: {exc}") from exc
        if isinstance(reply, proto.Reject):
            reason, code = proto.clip(reply.reason), proto.clip(reply.code, 40)
            if reply.code == "incompatible":
                field = None if reply.field is None else proto.clip(reply.field, 100)
                raise IncompatiblePeerError(f"{address} refused us: {reason}", field=field)
            kind = HandshakeError if reply.code in _RETRYABLE_REJECTS else RefusedError
            raise kind(f"{address} refused the handshake ({code}): {reason}")
        if self._secret is not None and reply.nonce != nonce:
            raise RefusedError(f"{address} sent a signed reply to another handshake (replayed?)")
        if reply.name == name:
            raise RefusedError(f"{address} is this engine ({name!r}) itself")
        try:
            proto.check_peer(self._regions, self._compat, self._compat_hash, reply,
                             equal_geometry=self._config.require_equal_geometry,
                             max_descriptors=self._tuning.max_peer_descriptors)
        except proto.Incompatible as exc:
            raise IncompatiblePeerError(f"peer {reply.name!r} at {address}: {exc}",
                                        field=exc.field) from None
        try:
            peer = self._peers.admit(reply.name, reply.agent_metadata, reply.regions, address,
                                     reply.features, proto.clip_host(reply.host), reply.staging)
        except proto.ProtocolError as exc:
            raise RefusedError(f"unusable handshake reply from {address}: {exc}") from exc
        try:
            agent.make_connection(peer.name)
            agent.send_notif(peer.name, PROBE)
        except AionixlError:
            self._peers.drop(peer, None)
            raise
        return peer


def _retryable(error: BaseException) -> bool:
    return isinstance(error, HandshakeError) and not isinstance(error, (RefusedError,
                                                                         IncompatiblePeerError))


def _unsigned_refusal(frames: list[bytes], limit: int) -> str:
    """What an unauthenticated refusal says, for the error message only (never trusted)."""
    try:
        reply = proto.decode_reply(frames[0], limit)
    except proto.ProtocolError:
        return ""
    if isinstance(reply, proto.Reject):
        return f"; it says: {proto.clip(reply.code, 40)}: {proto.clip(reply.reason)}"
    return ""
