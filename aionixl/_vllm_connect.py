"""The vLLM side-channel client: fetch a NixlConnector prefill's metadata, admit its agent.

Speaks vLLM's handshake from the event loop (a REQ socket driven through its FD, no
threads, one deadline), decodes vLLM's metadata (:mod:`aionixl._vllm_wire`), checks the
geometry against this engine's regions and admits the prefill's NIXL agent as a foreign
peer (no probes, no goodbyes: a vLLM prefill would take them for request notifications).
The public face is :func:`aionixl.vllm.connect`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.lowlevel
import zmq

from . import _protocol as proto
from . import _zmq
from ._checks import check_timeout
from ._config import EngineConfig
from ._errors import AionixlError, EngineClosedError, HandshakeError, IncompatiblePeerError, same_kind
from ._lifecycle import Lifecycle, LocalSide
from ._nixl import metadata_agent_name
from ._peer import Peer
from ._peers import PeerTable
from ._protocol import Incompatible
from ._vllm_wire import (
    AionixlRoute,
    VllmHandshake,
    VllmRefused,
    VllmWireError,
    check_geometry,
    decode_reply,
    encode_request,
    regions,
)

#: Replies larger than this are refused (vLLM's are ~1-2 KiB plus ~100 bytes per region).
MAX_REPLY_BYTES = 16 << 20

log = logging.getLogger("aionixl")

#: Connects by aionixl's own handshake (``Handshakes.connect``: address, timeout).
ConnectNative = Callable[[str, float], Awaitable[Peer]]


def _endpoint(address: str) -> str:
    if not isinstance(address, str) or not address:
        raise ValueError("address must be 'tcp://host:port' or 'host:port'")
    endpoint = address if "://" in address else f"tcp://{address}"
    _zmq.check_tcp_port(endpoint, "address")
    return endpoint


async def fetch_metadata(address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                         timeout: float = 10.0) -> VllmHandshake:
    """Ask the vLLM side channel at ``address`` for rank (pp, tp)'s metadata.

    ``HandshakeError`` when nobody answers within ``timeout`` or the reply does not decode;
    ``ValueError`` for a ``timeout`` that is not a positive number of seconds.
    """
    check_timeout(timeout, "timeout")
    endpoint = _endpoint(address)
    request = encode_request(pp_rank, tp_rank)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        sock = _zmq.connect_socket(ctx, zmq.REQ, endpoint, MAX_REPLY_BYTES, "vLLM side-channel")
        try:
            with anyio.move_on_after(timeout) as scope:
                await _zmq.send_multipart(sock, [request])
                frames = await _zmq.recv_multipart(sock)
            if scope.cancelled_caught:
                raise HandshakeError(f"the vLLM side channel at {endpoint} did not answer "
                                     f"within {timeout} s")
        finally:
            sock.close(linger=0)
    finally:
        ctx.term()
    try:
        return decode_reply(frames, MAX_REPLY_BYTES)
    except VllmRefused as exc:
        raise HandshakeError(f"the vLLM side channel at {endpoint} refused: {exc}") from exc
    except VllmWireError as exc:
        raise HandshakeError(f"unusable reply from the vLLM side channel at {endpoint}: {exc}") from exc


class VllmConnector:
    """Connects one engine to vLLM prefill workers (see :func:`aionixl.vllm.connect`)."""

    def __init__(self, local: LocalSide, life: Lifecycle, peers: PeerTable, config: EngineConfig,
                 max_descriptors: int, connect_native: ConnectNative) -> None:
        self._local = local
        self._life = life
        self._peers = peers
        self._connect_native = connect_native
        #: EngineConfig.require_equal_geometry: refuse a prefill whose block sizes differ.
        self._equal_geometry = config.require_equal_geometry
        self._max_descriptors = max_descriptors  # Tuning.max_peer_descriptors
        #: (endpoint, pp_rank, tp_rank) -> the peer admitted for it, vLLM's compat hash and the
        #: engine id it announced: one side channel serves several ranks, each its own agent.
        self._admitted: dict[tuple[str, int, int], tuple[Peer, str, str]] = {}
        #: The handshake under way per (endpoint, pp_rank, tp_rank): callers that arrive
        #: meanwhile wait for it instead of each asking the side channel.
        self._pending: dict[tuple[str, int, int], anyio.Event] = {}
        #: The last failed handshake per key: what it expected (engine id, compat hash) and
        #: why it failed; the callers that waited for it and expected the same share it.
        self._failed: dict[tuple[str, int, int], tuple[tuple[str | None, str | None], Exception]] = {}

    async def connect(self, address: str, *, pp_rank: int = 0, tp_rank: int = 0,
                      expect_compat_hash: str | None = None, expect_engine_id: str | None = None,
                      timeout: float = 10.0, prefer_aionixl: bool = False) -> Peer:
        """Handshake with a vLLM NixlConnector prefill and admit its agent as a peer.

        Idempotent for a live peer at the same address and rank (``expect_compat_hash`` is
        checked then too, against the hash its handshake gave), unless ``expect_engine_id``
        names another engine: then it asks again (the prefill there may have restarted).
        ``IncompatiblePeerError`` (``.field`` says what) when the region count differs from
        the engine's (or the bytes per block, with ``EngineConfig.require_equal_geometry``),
        when vLLM's layout has no one-id-per-block form, when ``expect_compat_hash`` is given
        and differs from vLLM's compatibility hash, or when ``expect_engine_id`` is given and
        the engine there announces another (``field="engine_id"``: block ids meant for that
        engine would read another's memory); ``HandshakeError`` for no answer or a bad reply. A
        prefill whose blocks differ in size (another TP, another block size) is admitted:
        parts of blocks move between the two (``aionixl.BlockPart``).

        ``prefer_aionixl``: when the side channel is an aionixl engine's that names its own
        handshake (:class:`AionixlRoute`), connect by that handshake instead, within half
        of what is left of ``timeout`` (a peer of aionixl's own: read modes, probes,
        goodbyes), and fall back to vLLM's wire when it fails or answers under another name.

        Calls for one address and rank while a handshake with it is under way wait for that
        one; if it fails, those that expected the same engine id and hash fail with it (a
        fresh error of the same kind), instead of each asking again in turn.
        """
        if not isinstance(prefer_aionixl, bool):
            raise ValueError(f"prefer_aionixl must be a bool, got {prefer_aionixl!r}")
        self._life.check_open()
        endpoint = _endpoint(address)
        key = (endpoint, pp_rank, tp_rank)
        expected = (expect_engine_id, expect_compat_hash)
        deadline = None
        while True:
            known = self._admitted.get(key)
            if known is not None and known[0].connected and expect_engine_id in (None, known[2]):
                peer, compat_hash, _ = known
                _check_hash(f"vLLM peer {peer.name!r} at {endpoint}", compat_hash, expect_compat_hash)
                await anyio.lowlevel.checkpoint()
                return peer
            if deadline is None:
                check_timeout(timeout, "timeout")
                deadline = time.monotonic() + timeout
            pending = self._pending.get(key)
            if pending is None:
                break
            with self._life.operation(), anyio.move_on_after(deadline - time.monotonic()) as scope:
                await pending.wait()
            if scope.cancelled_caught:
                raise HandshakeError(f"the handshake with the vLLM side channel at {endpoint} under way "
                                     f"did not end within {timeout} s")
            self._life.check_open()
            failed = self._failed.get(key)
            if failed is not None and failed[0] == expected:
                raise same_kind(failed[1], f"connecting to {endpoint}: {failed[1]}") from failed[1]
        done = self._pending[key] = anyio.Event()
        self._failed.pop(key, None)
        try:
            return await self._handshake(endpoint, key, pp_rank, tp_rank, expect_compat_hash,
                                         expect_engine_id, timeout, deadline, prefer_aionixl)
        except Exception as exc:
            self._failed[key] = (expected, exc)
            raise
        finally:
            del self._pending[key]
            done.set()

    async def _handshake(self, endpoint: str, key: tuple[str, int, int], pp_rank: int, tp_rank: int,
                         expect_compat_hash: str | None, expect_engine_id: str | None, timeout: float,
                         deadline: float, prefer_aionixl: bool) -> Peer:
        """One handshake with the side channel at ``endpoint`` (see :meth:`connect`)."""
        with self._life.operation():  # closing the engine ends the wait with EngineClosedError
            left = deadline - time.monotonic()  # less than timeout after waiting for another's
            if left <= 0:
                raise HandshakeError(f"no time left of {timeout} s to ask the vLLM side channel at "
                                     f"{endpoint}")
            reply = await fetch_metadata(endpoint, pp_rank=pp_rank, tp_rank=tp_rank, timeout=left)
        md = reply.metadata
        where = f"vLLM engine {md.engine_id!r} at {endpoint}"
        _check_hash(where, reply.compatibility_hash, expect_compat_hash)
        if expect_engine_id is not None and md.engine_id != expect_engine_id:
            raise IncompatiblePeerError(f"{where}: not the expected engine {expect_engine_id!r} (it "
                                        "restarted since, or the address is wrong)", field="engine_id")
        if prefer_aionixl and reply.aionixl is not None:
            native = await self._by_aionixl(reply.aionixl, endpoint, where, deadline)
            if native is not None:
                self._remember(key, native, reply)
                return native
        ours = self._local.regions
        try:
            theirs = regions(md, ours[0].mem_type)
            check_geometry(ours, theirs, equal_geometry=self._equal_geometry,
                           max_descriptors=self._max_descriptors)
        except Incompatible as exc:
            raise IncompatiblePeerError(f"{where}: {exc}", field=exc.field) from None
        except VllmWireError as exc:
            raise HandshakeError(f"{where}: {exc}") from exc
        name = metadata_agent_name(md.agent_metadata)
        if name is None:
            raise HandshakeError(f"{where}: its NIXL metadata names no readable agent")
        if time.monotonic() > deadline:
            raise HandshakeError(f"{where}: the handshake ran past its {timeout} s deadline")
        self._life.check_open()
        try:
            peer = self._peers.admit_foreign(name, md.agent_metadata, theirs, endpoint)
        except proto.ProtocolError as exc:
            raise HandshakeError(f"unusable peer metadata from {endpoint}: {exc}") from exc
        self._remember(key, peer, reply)
        await anyio.lowlevel.checkpoint()
        return peer

    def _remember(self, key: tuple[str, int, int], peer: Peer, reply: VllmHandshake) -> None:
        self._admitted = {k: v for k, v in self._admitted.items() if v[0].connected}
        self._admitted[key] = (peer, reply.compatibility_hash, reply.metadata.engine_id)

    async def _by_aionixl(self, route: AionixlRoute, endpoint: str, where: str,
                          deadline: float) -> Peer | None:
        """The peer aionixl's handshake at ``route`` admits, or None (logged) when that
        fails or another agent than the side channel named answers there."""
        address = _reachable(route.address, endpoint)
        budget = (deadline - time.monotonic()) / 2
        if budget <= 0:
            return None
        try:
            peer = await self._connect_native(address, budget)
        except EngineClosedError:
            raise
        except (AionixlError, ValueError) as exc:
            log.warning("%s names aionixl's handshake at %s, which failed (%s); reading by vLLM's "
                        "wire instead", where, address, exc)
            return None
        if peer.name != route.name:
            log.warning("%s names aionixl agent %r at %s, but %r answered there; reading by vLLM's "
                        "wire instead", where, route.name, address, peer.name)
            return None
        return peer


def _reachable(address: str, side_channel: str) -> str:
    """``address`` as this host reaches it: a wildcard host (an engine listening on every
    interface) becomes the side channel's host, which answered from the same machine."""
    scheme, _, rest = address.partition("://")
    host, _, port = rest.rpartition(":")
    if scheme == "tcp" and host.strip("[]") in ("*", "0.0.0.0", "::"):
        side_host = side_channel.partition("://")[2].rpartition(":")[0]
        return f"tcp://{side_host}:{port}"
    return address


def _check_hash(where: str, got: str, expected: str | None) -> None:
    if expected is not None and got != expected:
        raise IncompatiblePeerError(f"{where}: compatibility hash {got[:16]}... is not the expected "
                                    f"{expected[:16]}...", field="compat_hash")
