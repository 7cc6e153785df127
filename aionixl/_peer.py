"""The :class:`Peer`: one remote engine, as users and every component see it.

A ``Peer`` is the user's handle: what the remote engine said about itself, and whether it is
usable. Everything the engine knows about it as a NIXL agent is its :class:`PeerLink`
(``peer.link``): the loaded agent's metadata and incarnation, its descriptor lists and
how to index them, the parts and staging lists prepared for it, and the link's state
(connected, lost, revivable). The peer table (:mod:`aionixl._peers`) makes and ends links;
a peer evicted only to fence a read, and admitted again as the same process, gets a new
link on the same ``Peer``. Only data lives here.
"""

from __future__ import annotations

from ._parts import BlockPart, PartLists
from ._regions import IndexArray, Region, region_offsets
from ._wire import incarnation


class RemoteSlots:
    """A peer's staging slots (``aionixl._staging``) as we write into them: its handshake's
    ``staging`` regions and our descriptor list for them (owned by the peer table)."""

    __slots__ = ("regions", "num_blocks", "dlist", "offsets")

    def __init__(self, regions: list[Region], dlist: int) -> None:
        self.regions = tuple(regions)
        self.num_blocks = regions[0].num_blocks
        self.dlist = dlist
        self.offsets = region_offsets(len(regions), self.num_blocks)


class PeerLink:
    """One admission of a peer's NIXL agent: engine-internal state, made and ended by the
    peer table (``owner``), read by the components that move blocks with the peer."""

    __slots__ = ("owner", "metadata", "incarnation", "dlist", "offsets", "offset_list", "one_block",
                 "push", "unequal", "foreign", "parts", "staging", "connected", "lost", "revive")

    def __init__(self, owner: object, regions: list[Region], dlist: int, metadata: bytes, *,
                 push: bool, unequal: bool, staging: RemoteSlots | None) -> None:
        self.owner = owner  # the peer table (of one engine) that admitted it
        self.metadata = metadata
        #: Which process of its name this is (``aionixl._wire.incarnation``).
        self.incarnation = incarnation(metadata)
        #: Our descriptor list for the peer's blocks, region-major, and its indexing.
        self.dlist = dlist
        self.offsets = region_offsets(len(regions), regions[0].num_blocks)
        self.offset_list: list[int] = self.offsets.ravel().tolist()
        self.one_block: dict[int, IndexArray] = {}  # block id -> its descriptor indices
        #: Reads from this peer are push reads (``Peer.read_mode == "push"``; for the hot path).
        self.push = push
        #: Some region's blocks differ in size from ours: whole-block transfers are refused,
        #: block parts may fit.
        self.unequal = unequal
        #: Not an aionixl engine (a vLLM prefill): it gets no probe and no goodbye, which it
        #: would take for a request's notification.
        self.foreign = False
        #: Descriptor lists prepared for transfers of block parts with this peer, by (local
        #: part, remote part, into its staging slots); released with the link.
        self.parts: dict[tuple[BlockPart | None, BlockPart | None, bool], PartLists] = {}
        #: The peer's staging slots, as we push into them (None: it announced none).
        self.staging = staging
        #: Until the peer table drops the link (evicted, disconnected, the engine closed).
        self.connected = True
        #: Why it was evicted, if it was.
        self.lost: BaseException | None = None
        #: Evicted only to fence an unconfirmed cancelled read (the peer itself may be
        #: fine): the next transfer with this ``Peer`` reconnects to its address.
        self.revive = False


class Peer:
    """A remote engine this engine can move blocks to and from.

    Returned by :meth:`Engine.connect`; peers that connected to us appear in
    :attr:`Engine.peers` too (with ``address`` None). A peer object stays valid until
    :meth:`Engine.disconnect` or the engine closes; ``connected`` then turns False. A peer
    whose transfers fail (it died, the link broke) is evicted the same way: its transfers
    then raise ``PeerDisconnectedError`` until ``connect()`` makes a new one. ``link`` is the
    engine's own state for it (not for applications).
    """

    __slots__ = ("name", "address", "regions", "num_blocks", "features", "host", "read_mode", "link")

    def __init__(self, name: str, address: str | None, regions: list[Region], link: PeerLink,
                 features: frozenset[str] = frozenset(), host: dict[str, str] | None = None,
                 read_mode: str = "get") -> None:
        self.name = name
        #: What the peer's engine said it can do (handshake ``features``).
        self.features = features
        #: What the peer's engine said about where it runs (handshake ``host``).
        self.host: dict[str, str] = dict(host or {})
        self.address = address
        self.regions = tuple(regions)
        self.num_blocks = regions[0].num_blocks
        #: How reads from this peer move data: "get" (one-sided NIXL READ) or "push" (the
        #: peer's engine writes into our blocks); chosen at the handshake (EngineConfig.read_mode).
        self.read_mode = read_mode
        self.link = link

    @property
    def bytes_per_block(self) -> tuple[int, ...]:
        """The size of one block of each of the peer's regions, in bytes (it may differ
        from ours: transfers of :class:`aionixl.BlockPart` move parts of blocks)."""
        return tuple(r.block_bytes for r in self.regions)

    @property
    def connected(self) -> bool:
        return self.link.connected

    def __repr__(self) -> str:
        state = "connected" if self.link.connected else "disconnected"
        return f"<Peer {self.name!r} at {self.address or '(inbound)'} {state}>"
