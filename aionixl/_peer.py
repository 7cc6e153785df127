"""The :class:`Peer`: one remote engine, as every component sees it.

Only data lives here (its NIXL descriptor list, geometry, what it announced, whether it is
still usable); admitting, evicting and probing peers is :mod:`aionixl._peers`' job.
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


class Peer:
    """A remote engine this engine can move blocks to and from.

    Returned by :meth:`Engine.connect`; peers that connected to us appear in
    :attr:`Engine.peers` too (with ``address`` None). A peer object stays valid until
    :meth:`Engine.disconnect` or the engine closes; ``connected`` then turns False. A peer
    whose transfers fail (it died, the link broke) is evicted the same way: its transfers
    then raise ``PeerDisconnectedError`` until ``connect()`` makes a new one.
    """

    __slots__ = ("name", "address", "regions", "num_blocks", "features", "host", "_dlist", "_offsets",
                 "_offset_list", "_metadata", "_owner", "_connected", "_lost", "_one_block", "_foreign",
                 "read_mode", "_push", "_revive", "_unequal", "_parts", "_staging", "_incarnation")

    def __init__(self, owner: object, name: str, address: str | None,
                 regions: list[Region], dlist: int, metadata: bytes,
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
        self._dlist = dlist
        self._offsets = region_offsets(len(regions), self.num_blocks)
        self._offset_list: list[int] = self._offsets.ravel().tolist()
        self._metadata = metadata
        #: Which process of its name this is (``aionixl._wire.incarnation``).
        self._incarnation = incarnation(metadata)
        self._owner = owner  # the peer table (of one engine) that admitted it
        self._connected = True
        self._lost: BaseException | None = None  # why it was evicted, if it was
        self._one_block: dict[int, IndexArray] = {}  # block id -> its descriptor indices
        #: Not an aionixl engine (a vLLM prefill): it gets no probe and no goodbye, which
        #: it would take for a request's notification.
        self._foreign = False
        #: Evicted only to fence an unconfirmed cancelled read (the peer itself may be
        #: fine): the next transfer with this object reconnects to ``address`` and reuses it.
        self._revive = False
        #: How reads from this peer move data: "get" (one-sided NIXL READ) or "push" (the
        #: peer's engine writes into our blocks); chosen at the handshake (EngineConfig.read_mode).
        self.read_mode = read_mode
        self._push = read_mode == "push"  # for the hot path
        #: Some region's blocks differ in size from ours (set by the peer table at
        #: admission): whole-block transfers are refused, block parts may fit.
        self._unequal = False
        #: Descriptor lists prepared for transfers of block parts with this peer, by
        #: (local part, remote part, into its staging slots); owned by the peer table,
        #: released when it drops us.
        self._parts: dict[tuple[BlockPart | None, BlockPart | None, bool], PartLists] = {}
        #: The peer's staging slots, as we push into them (None: it announced none).
        self._staging: RemoteSlots | None = None

    @property
    def bytes_per_block(self) -> tuple[int, ...]:
        """The size of one block of each of the peer's regions, in bytes (it may differ
        from ours: transfers of :class:`aionixl.BlockPart` move parts of blocks)."""
        return tuple(r.block_bytes for r in self.regions)

    @property
    def connected(self) -> bool:
        return self._connected

    def __repr__(self) -> str:
        state = "connected" if self._connected else "disconnected"
        return f"<Peer {self.name!r} at {self.address or '(inbound)'} {state}>"
