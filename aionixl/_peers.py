"""Peers: who this engine may move blocks with, how they are admitted, evicted and probed.

The :class:`PeerTable` owns every peer's NIXL state (its loaded agent metadata and its
descriptor list). Admission loads a peer's metadata after checking that it names that
peer; eviction (a transfer or probe found the peer gone) and disconnection both go
through :meth:`PeerTable.drop`, which fails the peer's transfers under way (through the
``on_drop`` callable it was built with), releases its descriptors and removes the remote
agent. Engines also tell each other things through reserved notifications
(:mod:`aionixl._wire`): a liveness probe, and a goodbye when one closes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from typing import Any

import anyio

from . import _protocol as proto
from ._errors import AionixlError, PeerDisconnectedError, TransferError
from ._hostfacts import choose_read_mode
from ._inflight import progress_quietly
from ._lifecycle import Lifecycle, LocalSide
from ._metrics import EVICTION_CAUSES, eviction_cause
from ._nixl import metadata_agent_name
from ._parts import BlockPart, PartLists, check_list_size, part_descriptors, plan_parts
from ._peer import Peer, PeerLink, RemoteSlots
from ._ratelimit import RateLimitedLog
from ._regions import block_descriptors
from ._wire import FEATURES, GOODBYE, GOODBYE_BYTES, PROBE, WireError, goodbye

log = logging.getLogger("aionixl")

#: Told when a peer is dropped (evicted or disconnected), with the error its transfers get.
OnDrop = Callable[[Peer, AionixlError], None]

#: The most pairs of block parts one peer may have descriptor lists prepared for (each pair
#: is two lists over every block, kept until the peer goes; a peer asking for push reads
#: of parts chooses the pairs on the serving side).
MAX_PART_LAYOUTS = 64


class PeerTable:
    """The live peers of one engine, by name and by address, and their NIXL state."""

    def __init__(self, local: LocalSide, life: Lifecycle, noisy: RateLimitedLog, *, read_mode: str,
                 host: Mapping[str, str], max_descriptors: int, on_admit: Callable[[], None],
                 on_drop: OnDrop) -> None:
        self._local = local
        self._life = life
        self._read_mode = read_mode  # EngineConfig.read_mode
        self._host = host  # where this engine runs (_hostfacts.host_facts)
        self._max_descriptors = max_descriptors  # in one list of a peer's (Tuning)
        self.by_name: dict[str, Peer] = {}
        self.by_address: dict[str, Peer] = {}
        #: Peers evicted to fence a read, by address: a handshake with the same engine
        #: there brings the same Peer object back, with a new link (see PeerLink.revive).
        self.revivable: dict[str, Peer] = {}
        self.evicted = 0
        self.evictions = dict.fromkeys(EVICTION_CAUSES, 0)  # by cause; sums to evicted
        self.fenced_evictions = 0  # peers evicted because an aborted read went unconfirmed
        self.noisy = self._noisy = noisy
        self._on_admit = on_admit
        self._on_drop = on_drop

    def __bool__(self) -> bool:
        return bool(self.by_name)

    # ---- who is a peer ------------------------------------------------------------------

    def own(self, peer: object) -> Peer:
        """``peer`` if it is one of ours (live or not); ValueError otherwise."""
        if not isinstance(peer, Peer) or peer.link.owner is not self:
            raise ValueError(f"unknown peer {peer!r}: not a Peer of this engine")
        return peer

    def live(self, peer: object) -> Peer:
        """``peer`` if transfers may use it; the error its caller should see otherwise."""
        p = self.own(peer)
        lost = p.link.lost
        if lost is not None:
            raise PeerDisconnectedError(f"peer {p.name!r} was evicted after a failure ({lost}); "
                                        "connect() to it again") from lost
        if not p.connected:
            raise ValueError(f"unknown peer {p.name!r}: it was disconnected")
        return p

    def still_usable(self, peer: Peer) -> None:
        """For a call that awaited since its checks (slots, an owed cancel, a round): the
        engine not closing (a draining one finishes the calls it took) and the peer still
        connected, since a dropped peer's descriptor lists are released and a message sent
        by name would reach whatever process has that name now."""
        if not self._life.usable:
            self._life.check_open(draining_ok=True)
        self.live(peer)

    # ---- admission ----------------------------------------------------------------------

    def admit(self, name: str, metadata: bytes, regions: Sequence[proto.RegionInfo],
              address: str | None, features: Sequence[str] = (),
              host: dict[str, str] | None = None,
              staging: Sequence[proto.RegionInfo] = ()) -> Peer:
        """Load a peer's metadata (or reuse what is loaded) and prepare its descriptors
        (for its blocks, and for its staging slots if it has them)."""
        agent = self._local.agent
        assert agent is not None
        existing = self.by_name.get(name)
        if existing is not None and existing.link.metadata == metadata:
            if address is not None and existing.address is None:
                existing.address = address
                self.by_address[address] = existing
            return existing
        # Checked before NIXL sees the metadata: loading another agent's metadata would
        # replace that agent's state under our feet.
        proto.check_staging(regions, staging)
        embedded = metadata_agent_name(metadata)
        if embedded != name:
            raise proto.ProtocolError(
                f"the NIXL metadata of {proto.clip(name, 80)!r} is not an agent of that name "
                f"(it names {proto.clip(embedded, 80) if embedded else 'no readable agent'})")
        if existing is not None:  # same name, new incarnation
            self.drop(existing, None, PeerDisconnectedError(f"peer {name!r} restarted; connect() again"))
        remote = [r.to_region() for r in regions]
        slots = [r.to_region() for r in staging]
        # Built before NIXL loads the peer: nothing between add_remote and the peer's entry
        # in by_name may fail without releasing what was loaded (no Peer would own it).
        descriptors = block_descriptors(remote)
        slot_descriptors = block_descriptors(slots) if slots else None
        known = frozenset(f for f in features if f in FEATURES)
        mode = choose_read_mode(self._read_mode, known, self._host, dict(host or {}))
        agent.add_remote(metadata, name)
        dlist = slot_dlist = -1
        try:
            dlist = agent.prep_dlist(name, descriptors, regions[0].mem_type)
            if slot_descriptors is not None:
                slot_dlist = agent.prep_dlist(name, slot_descriptors, "DRAM")
        except BaseException:
            for prepared in (slot_dlist, dlist):
                if prepared != -1:
                    _attempt(agent.release_dlist, prepared, [])
            _attempt(agent.remove_remote, name, [])
            raise
        unequal = [r.block_bytes for r in remote] != [r.block_bytes for r in self._local.regions]
        link = PeerLink(self, remote, dlist, metadata, push=mode == "push", unequal=unequal,
                        staging=RemoteSlots(slots, slot_dlist) if slots else None)
        old = self.revivable.pop(address, None) if address is not None else None
        if old is not None and old.name == name and old.link.incarnation == link.incarnation:
            # The same process, evicted only to fence a read: the same Peer, a new link.
            old.link, old.features, old.host, old.read_mode = link, known, dict(host or {}), mode
            peer = old
        else:
            peer = Peer(name, address, remote, link, known, host, mode)
        if self._local.staging is not None:  # once admitted: a refused impostor frees nothing
            self._local.staging.admitted(name, link.incarnation)
        self.by_name[name] = peer
        if address is not None:
            self.by_address[address] = peer
        self._on_admit()
        return peer

    def admit_foreign(self, name: str, metadata: bytes, regions: Sequence[proto.RegionInfo],
                      address: str) -> Peer:
        """Admit and connect a peer that is not an aionixl engine (a vLLM prefill, checked by
        the caller): it gets no probe and no goodbye."""
        peer = self.admit(name, metadata, regions, address)
        peer.link.foreign = True
        agent = self._local.agent
        assert agent is not None
        try:
            agent.make_connection(peer.name)
        except AionixlError:
            self.drop(peer, None)
            raise
        return peer

    # ---- descriptor lists for block parts --------------------------------------------------

    def part_lists(self, peer: Peer, local_part: BlockPart | None,
                   remote_part: BlockPart | None, staged: bool = False) -> PartLists:
        """The descriptor lists for moving ``local_part`` of our blocks to or from
        ``remote_part`` of ``peer``'s (of its staging slots if ``staged``: the caller
        checked it has them), prepared on first use and kept until the peer is dropped.
        ``ValueError`` (before anything is prepared) for parts that do not fit the two
        geometries (see :func:`aionixl._parts.plan_parts`) or one pair too many."""
        key = (local_part, remote_part, staged)
        link = peer.link
        lists = link.parts.get(key)
        if lists is not None:
            return lists
        local = self._local
        plan = plan_parts([r.block_bytes for r in local.regions], local_part,
                          [r.block_bytes for r in peer.regions], remote_part)
        if len(link.parts) >= MAX_PART_LAYOUTS:
            raise ValueError(f"peer {peer.name!r} already has descriptor lists for "
                             f"{MAX_PART_LAYOUTS} pairs of block parts; no more are prepared")
        target = link.staging if staged else None
        remote, remote_blocks = (peer.regions, peer.num_blocks) if target is None \
            else (target.regions, target.num_blocks)
        check_list_size(local.num_blocks, plan.local, "local_part")
        check_list_size(remote_blocks, plan.remote, "remote_part", self._max_descriptors)
        agent = local.agent
        assert agent is not None
        mine_descs = part_descriptors(local.regions, plan.local)
        their_descs = part_descriptors(remote, plan.remote)
        mine = agent.prep_dlist(None, mine_descs, local.mem_type)
        try:
            theirs = agent.prep_dlist(peer.name, their_descs, remote[0].mem_type)
        except BaseException:
            _attempt(agent.release_dlist, mine, [])
            raise
        lists = link.parts[key] = PartLists(plan, mine, local.num_blocks, theirs, remote_blocks)
        return lists

    # ---- losing peers -------------------------------------------------------------------

    def evict(self, peer: Peer, cause: BaseException, why: str | None = None) -> PeerDisconnectedError:
        """Forget a peer NIXL reported failing; returns the error its callers get.

        ``why`` is the eviction cause counted in metrics (default: from ``cause``).
        """
        error = PeerDisconnectedError(f"peer {peer.name!r} is unreachable and was evicted: {cause}")
        error.__cause__ = cause
        if peer.link.connected:
            why = why or eviction_cause(cause)
            self._noisy.log(logging.WARNING, "evict", "evicting peer %r (%s): %s", peer.name, why, cause,
                            extra={"peer": peer.name, "cause": why, "error": str(cause)})
            peer.link.lost = cause
            self.evicted += 1
            self.evictions[why] += 1
            self.drop(peer, None, error)
        return error

    def evict_unfenced(self, peer: Peer, reason: str) -> None:
        """An aborted read was not confirmed stopped: close the connection it may still write
        over (the peer itself may be fine: the next transfer with it reconnects)."""
        if peer.connected:
            self.fenced_evictions += 1
            peer.link.revive = True
            self.evict(peer, TransferError(reason))

    def drop(self, peer: Peer, problems: list[str] | None, error: AionixlError | None = None) -> None:
        """Fail the peer's transfers, release its descriptors, disconnect in NIXL.

        With ``error`` the peer was lost (not disconnected on purpose): its transfers fail
        with it, and later calls with this Peer raise PeerDisconnectedError.
        """
        link = peer.link
        link.connected = False
        if error is not None and link.lost is None:
            link.lost = error
        if link.revive and peer.address is not None and not link.foreign:
            self.revivable[peer.address] = peer
        if self.by_name.get(peer.name) is peer:
            del self.by_name[peer.name]
        if peer.address is not None and self.by_address.get(peer.address) is peer:
            del self.by_address[peer.address]
        agent = self._local.agent
        if agent is None:
            return
        self._on_drop(peer, error or PeerDisconnectedError(f"peer {peer.name!r} was disconnected"))
        sink: list[str] = [] if problems is None else problems
        for lists in link.parts.values():
            _attempt(agent.release_dlist, lists.local, sink)
            _attempt(agent.release_dlist, lists.remote, sink)
        link.parts.clear()
        if link.staging is not None:
            _attempt(agent.release_dlist, link.staging.dlist, sink)
        _attempt(agent.release_dlist, link.dlist, sink)
        _attempt(agent.remove_remote, peer.name, sink)
        if problems is None and sink:
            self._noisy.log(logging.WARNING, "drop", "dropping peer %r: %s", peer.name, "; ".join(sink))

    def drop_all(self, problems: list[str]) -> None:
        for peer in list(self.by_name.values()):
            self.drop(peer, problems)

    def heard(self, name: str, message: bytes) -> None:
        """A reserved notification from ``name`` (not a push message): a goodbye drops that
        incarnation. ``WireError`` for a malformed goodbye or a reserved message of no
        kind we know."""
        if message.startswith(PROBE):
            return  # its arrival is all it had to do
        if not message.startswith(GOODBYE):
            raise WireError("a reserved message of no known kind")
        if len(message) != GOODBYE_BYTES:
            raise WireError(f"malformed goodbye: {len(message)} bytes")
        peer = self.by_name.get(name)
        # Only for the incarnation that said it: a restarted peer of the same name may
        # have been admitted before the old one's goodbye was read.
        if peer is not None and goodbye(peer.link.metadata) == message:
            log.info("peer %r closed", name)
            self.drop(peer, None, PeerDisconnectedError(f"peer {name!r} closed its engine"))

    def probe(self) -> None:
        """Find peers that died while idle: NIXL fails a notification to a peer that is gone."""
        agent = self._local.agent
        assert agent is not None
        for peer in list(self.by_name.values()):
            if peer.link.foreign:
                continue
            try:
                agent.send_notif(peer.name, PROBE)
            except PeerDisconnectedError as exc:
                self.evict(peer, exc, "probe")
            except AionixlError as exc:
                self._noisy.log(logging.INFO, "probe", "probing peer %r: %s", peer.name, exc)

    async def say_goodbye(self, deadline: float) -> None:
        """Tell every peer we are going, so it drops us now instead of finding out later."""
        agent = self._local.agent
        if not self.by_name or agent is None:
            return
        message = goodbye(self._local.metadata)
        for peer in self.by_name.values():
            if peer.link.foreign:
                continue
            with suppress(AionixlError):
                agent.send_notif(peer.name, message)
        for _ in range(5):  # let the messages leave before the connections close
            if anyio.current_time() >= deadline:
                break
            progress_quietly(agent)
            await anyio.sleep(0.0005)


def _attempt(fn: Callable[[Any], object], arg: Any, problems: list[str]) -> None:
    try:
        fn(arg)
    except AionixlError as exc:
        problems.append(str(exc))
