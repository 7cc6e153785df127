"""Peers: who this engine may move blocks with, how they are admitted, evicted and probed.

The :class:`PeerTable` owns every peer's NIXL state (its loaded agent metadata and its
descriptor list). Admission loads a peer's metadata after checking that it names that
peer; eviction (a transfer or probe found the peer gone) and disconnection both go
through :meth:`PeerTable.drop`, which fails the peer's transfers under way, releases its
descriptors and removes the remote agent. Engines also tell each other things through
reserved notifications: a liveness probe, and a goodbye when one closes.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from contextlib import suppress
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from . import _protocol as proto
from ._errors import AionixlError, PeerDisconnectedError
from ._metrics import EVICTION_CAUSES, eviction_cause
from ._nixl import Agent, metadata_agent_name
from ._ratelimit import RateLimitedLog
from ._regions import Region, block_descriptors, region_offsets

if TYPE_CHECKING:
    from ._push import Pusher
    from ._transfers import Transfers

log = logging.getLogger("aionixl")

#: Notifications engines send each other, never delivered to callers: the liveness probe,
#: and the goodbye of a closing engine (tagged with a digest of its NIXL metadata).
RESERVED = b"\x00aionixl-"
PROBE = RESERVED + b"probe\x00"
GOODBYE = RESERVED + b"goodbye\x00"


#: Features this engine speaks, announced in the handshake. A peer uses one only when the
#: other side announced it too.
FEATURES: frozenset[str] = frozenset({"multi-notify", "push-read", "tagged-notify"})

#: One notification carrying several callers' messages (a coalesced transfer's): the
#: receiving engine unpacks it and delivers each. Engines before "tagged-notify" sent these;
#: this one still unpacks them, and sends only tagged ones (``pack_tagged``).
MULTI_NOTIFY = "multi-notify"
MULTI = RESERVED + b"multi\x00"


def pack_notifications(messages: list[bytes]) -> bytes:
    return MULTI + msgspec.msgpack.encode(messages)


def unpack_notifications(message: bytes) -> list[bytes]:
    """The messages packed by :func:`pack_notifications`; [] for anything malformed."""
    try:
        messages = _decode_messages(memoryview(message)[len(MULTI):])
    except msgspec.DecodeError:
        return []
    return [m for m in messages if not m.startswith(RESERVED)]


_decode_messages = msgspec.msgpack.Decoder(list[bytes]).decode

#: The messages of a merged request that may be posted again (a member left while it ran),
#: with the request's tag: the receiver delivers a tag once. A re-post carries the first
#: post's tag and a subset of its messages, so a tag seen before means every message in it
#: arrived already (NIXL may have delivered the aborted post's notification). Only sent to
#: peers announcing "tagged-notify".
TAGGED_NOTIFY = "tagged-notify"
TAGGED = RESERVED + b"tagged\x00"


def pack_tagged(tag: int, messages: list[bytes]) -> bytes:
    return TAGGED + _encode_tagged((tag, messages))


def unpack_tagged(message: bytes) -> tuple[int, list[bytes]] | None:
    """The tag and messages packed by :func:`pack_tagged`; None for anything malformed."""
    try:
        tag, messages = _decode_tagged(memoryview(message)[len(TAGGED):])
    except msgspec.DecodeError:
        return None
    return tag, [m for m in messages if not m.startswith(RESERVED)]


_encode_tagged = msgspec.msgpack.encode
_decode_tagged = msgspec.msgpack.Decoder(tuple[int, list[bytes]]).decode


class SeenTags:
    """The tags of the tagged notifications delivered lately, per sender (bounded: a re-post
    follows its first post within the leaver's fence, seconds at most)."""

    __slots__ = ("_seen", "_limit")

    def __init__(self, limit: int = 1 << 14) -> None:
        self._seen: dict[tuple[str, int], None] = {}
        self._limit = limit

    def first(self, sender: str, tag: int) -> bool:
        """Whether ``tag`` from ``sender`` is new (then it is remembered)."""
        key = (sender, tag)
        if key in self._seen:
            return False
        if len(self._seen) >= self._limit:
            del self._seen[next(iter(self._seen))]  # the oldest
        self._seen[key] = None
        return True


def goodbye(metadata: bytes) -> bytes:
    return GOODBYE + hashlib.sha256(metadata).digest()[:16]


def user_message(value: object, what: str) -> bytes:
    """A caller's notification as bytes; the engine's own reserved prefix is refused."""
    if not isinstance(value, (bytes, bytearray, memoryview)):
        raise ValueError(f"{what} must be bytes")
    message = bytes(value)
    if message.startswith(RESERVED):
        raise ValueError(f"{what}: messages starting with b'\\x00aionixl-' are reserved for the engine")
    return message


class Peer:
    """A remote engine this engine can move blocks to and from.

    Returned by :meth:`Engine.connect`; peers that connected to us appear in
    :attr:`Engine.peers` too (with ``address`` None). A peer object stays valid until
    :meth:`Engine.disconnect` or the engine closes; ``connected`` then turns False. A peer
    whose transfers fail (it died, the link broke) is evicted the same way: its transfers
    then raise ``PeerDisconnectedError`` until ``connect()`` makes a new one.
    """

    __slots__ = ("name", "address", "regions", "num_blocks", "features", "host", "_dlist", "_offsets",
                 "_offset_list", "_metadata", "_engine", "_connected", "_lost", "_one_block", "_foreign",
                 "read_mode", "_push", "_revive")

    def __init__(self, engine: Any, name: str, address: str | None,
                 regions: list[Region], dlist: int, metadata: bytes,
                 features: frozenset[str] = frozenset(), host: dict[str, str] | None = None) -> None:
        self.name = name
        #: What the peer's engine said it can do (handshake ``features``).
        self.features = features
        #: What the peer's engine said about where it runs (handshake ``host``).
        self.host: dict[str, str] = dict(host or {})
        self.address = address
        self.regions = tuple(regions)
        self.num_blocks = regions[0].num_blocks
        self._dlist = dlist
        self._offsets = region_offsets(len(regions), self.num_blocks)
        self._offset_list: list[int] = self._offsets.ravel().tolist()
        self._metadata = metadata
        self._engine = engine  # the Engine that owns this peer
        self._connected = True
        self._lost: BaseException | None = None  # why it was evicted, if it was
        self._one_block: dict[int, list[int]] = {}  # block id -> its descriptor indices
        #: Not an aionixl engine (a vLLM prefill): it gets no probe and no goodbye, which
        #: it would take for a request's notification.
        self._foreign = False
        #: Evicted only to fence an unconfirmed cancelled read (the peer itself may be
        #: fine): the next transfer with this object reconnects to ``address`` and reuses it.
        self._revive = False
        #: How reads from this peer move data: "get" (one-sided NIXL READ) or "push" (the
        #: peer's engine writes into our blocks); chosen at the handshake (EngineConfig.read_mode).
        self.read_mode: str = "get"
        self._push = False  # read_mode == "push", for the hot path

    @property
    def connected(self) -> bool:
        return self._connected

    def __repr__(self) -> str:
        state = "connected" if self._connected else "disconnected"
        return f"<Peer {self.name!r} at {self.address or '(inbound)'} {state}>"


class PeerTable:
    """The live peers of one engine, by name and by address, and their NIXL state."""

    def __init__(self, owner: Any, noisy: RateLimitedLog, on_admit: Callable[[], None]) -> None:
        self.owner = owner
        self.agent: Agent | None = None  # set once the engine's agent exists
        self.transfers: Transfers | None = None
        self.push: Pusher | None = None  # push reads (_push.py); set by the engine
        self.by_name: dict[str, Peer] = {}
        self.by_address: dict[str, Peer] = {}
        #: Peers evicted to fence a read, by address: a handshake with the same engine
        #: there brings the same Peer object back (see Peer._revive).
        self.revivable: dict[str, Peer] = {}
        self.evicted = 0
        self.evictions = dict.fromkeys(EVICTION_CAUSES, 0)  # by cause; sums to evicted
        self.noisy = self._noisy = noisy
        self._on_admit = on_admit

    def __bool__(self) -> bool:
        return bool(self.by_name)

    # ---- who is a peer ------------------------------------------------------------------

    def own(self, peer: object) -> Peer:
        """``peer`` if it is one of ours (live or not); ValueError otherwise."""
        if not isinstance(peer, Peer) or peer._engine is not self.owner:
            raise ValueError(f"unknown peer {peer!r}: not a Peer of this engine")
        return peer

    def live(self, peer: object) -> Peer:
        """``peer`` if transfers may use it; the error its caller should see otherwise."""
        p = self.own(peer)
        if p._lost is not None:
            raise PeerDisconnectedError(f"peer {p.name!r} was evicted after a failure ({p._lost}); "
                                        "connect() to it again") from p._lost
        if not p.connected:
            raise ValueError(f"unknown peer {p.name!r}: it was disconnected")
        return p

    # ---- admission ----------------------------------------------------------------------

    def admit(self, name: str, metadata: bytes, regions: Sequence[proto.RegionInfo],
              address: str | None, features: Sequence[str] = (),
              host: dict[str, str] | None = None) -> Peer:
        """Load a peer's metadata (or reuse what is loaded) and prepare its descriptors."""
        agent = self.agent
        assert agent is not None
        existing = self.by_name.get(name)
        if existing is not None and existing._metadata == metadata:
            if address is not None and existing.address is None:
                existing.address = address
                self.by_address[address] = existing
            return existing
        # Checked before NIXL sees the metadata: loading another agent's metadata would
        # replace that agent's state under our feet.
        embedded = metadata_agent_name(metadata)
        if embedded != name:
            raise proto.ProtocolError(
                f"the NIXL metadata of {proto.clip(name, 80)!r} is not an agent of that name "
                f"(it names {proto.clip(embedded, 80) if embedded else 'no readable agent'})")
        if existing is not None:  # same name, new incarnation
            self.drop(existing, None, PeerDisconnectedError(f"peer {name!r} restarted; connect() again"))
        agent.add_remote(metadata, name)
        remote = [r.to_region() for r in regions]
        try:
            dlist = agent.prep_dlist(name, block_descriptors(remote), regions[0].mem_type)
        except AionixlError:
            _attempt(agent.remove_remote, name, [])
            raise
        known = frozenset(f for f in features if f in FEATURES)
        old = self.revivable.pop(address, None) if address is not None else None
        if old is not None and old.name == name:
            old.__init__(self.owner, name, address, remote, dlist, metadata, known, host)  # type: ignore[misc]
            peer = old
        else:
            peer = Peer(self.owner, name, address, remote, dlist, metadata, known, host)
        if self.push is not None:
            peer.read_mode = self.push.mode_for(peer.features, peer.host)
            peer._push = peer.read_mode == "push"
        self.by_name[name] = peer
        if address is not None:
            self.by_address[address] = peer
        self._on_admit()
        return peer

    # ---- losing peers -------------------------------------------------------------------

    def evict(self, peer: Peer, cause: BaseException, why: str | None = None) -> PeerDisconnectedError:
        """Forget a peer NIXL reported failing; returns the error its callers get.

        ``why`` is the eviction cause counted in metrics (default: from ``cause``).
        """
        error = PeerDisconnectedError(f"peer {peer.name!r} is unreachable and was evicted: {cause}")
        error.__cause__ = cause
        if peer._connected:
            why = why or eviction_cause(cause)
            self._noisy.log(logging.WARNING, "evict", "evicting peer %r (%s): %s", peer.name, why, cause,
                            extra={"peer": peer.name, "cause": why, "error": str(cause)})
            peer._lost = cause
            self.evicted += 1
            self.evictions[why] += 1
            self.drop(peer, None, error)
        return error

    def drop(self, peer: Peer, problems: list[str] | None, error: AionixlError | None = None) -> None:
        """Fail the peer's transfers, release its descriptors, disconnect in NIXL.

        With ``error`` the peer was lost (not disconnected on purpose): its transfers fail
        with it, and later calls with this Peer raise PeerDisconnectedError.
        """
        peer._connected = False
        if error is not None and peer._lost is None:
            peer._lost = error
        if peer._revive and peer.address is not None and not peer._foreign:
            self.revivable[peer.address] = peer
        if self.by_name.get(peer.name) is peer:
            del self.by_name[peer.name]
        if peer.address is not None and self.by_address.get(peer.address) is peer:
            del self.by_address[peer.address]
        agent = self.agent
        if agent is None:
            return
        lost = error or PeerDisconnectedError(f"peer {peer.name!r} was disconnected")
        if self.transfers is not None:
            self.transfers.fail_peer(peer, lost)
        if self.push is not None:
            self.push.fail_peer(peer, lost)
        sink: list[str] = [] if problems is None else problems
        _attempt(agent.release_dlist, peer._dlist, sink)
        _attempt(agent.remove_remote, peer.name, sink)
        if problems is None and sink:
            self._noisy.log(logging.WARNING, "drop", "dropping peer %r: %s", peer.name, "; ".join(sink))

    def drop_all(self, problems: list[str]) -> None:
        for peer in list(self.by_name.values()):
            self.drop(peer, problems)

    def heard(self, name: str, message: bytes) -> None:
        """A reserved notification from ``name``: a goodbye drops that incarnation."""
        if self.push is not None and self.push.heard(name, message):
            return  # a push-read message (_push.py)
        if not message.startswith(GOODBYE):
            return  # a probe: its arrival is all it had to do
        peer = self.by_name.get(name)
        # Only for the incarnation that said it: a restarted peer of the same name may
        # have been admitted before the old one's goodbye was read.
        if peer is not None and goodbye(peer._metadata) == message:
            log.info("peer %r closed", name)
            self.drop(peer, None, PeerDisconnectedError(f"peer {name!r} closed its engine"))

    def probe(self) -> None:
        """Find peers that died while idle: NIXL fails a notification to a peer that is gone."""
        agent = self.agent
        assert agent is not None
        for peer in list(self.by_name.values()):
            if peer._foreign:
                continue
            try:
                agent.send_notif(peer.name, PROBE)
            except PeerDisconnectedError as exc:
                self.evict(peer, exc, "probe")
            except AionixlError as exc:
                self._noisy.log(logging.INFO, "probe", "probing peer %r: %s", peer.name, exc)

    async def say_goodbye(self, own_metadata: bytes, deadline: float) -> None:
        """Tell every peer we are going, so it drops us now instead of finding out later."""
        agent = self.agent
        if not self.by_name or agent is None:
            return
        message = goodbye(own_metadata)
        for peer in self.by_name.values():
            if peer._foreign:
                continue
            with suppress(AionixlError):
                agent.send_notif(peer.name, message)
        for _ in range(5):  # let the messages leave before the connections close
            if anyio.current_time() >= deadline:
                break
            progress_quietly(agent)
            await anyio.sleep(0.0005)


def progress_quietly(agent: Agent) -> None:
    """One NIXL progress call whose errors (peers already gone) do not matter here."""
    with suppress(AionixlError):
        agent.get_notifs()


def _attempt(fn: Callable[[Any], object], arg: Any, problems: list[str]) -> None:
    try:
        fn(arg)
    except AionixlError as exc:
        problems.append(str(exc))
