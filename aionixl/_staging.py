"""Staging slots: where a push read's bytes land before they are the caller's.

Why: UCX cannot stop a WRITE already posted, and over UCX tcp an evicted peer's socket
still delivers (docs/read-modes.md). A server stopped or cut off mid-chunk could then land
the rest of that chunk in the caller's blocks after the read had failed. So a reader asks
the server to write into slots of its own, copies them into the caller's blocks only once
the server said the read is complete, and frees a slot only when the server confirmed that
nothing more of its read will land. A slot whose read ended unconfirmed is stranded: late
bytes can land there and nowhere else. It comes back when the server confirms late (it
does once the chunk it had under way ended), when an engine of its name handshakes anew,
or, once the server is no longer connected, ``Tuning.stranded_slot_ttl`` after its read ended
(15 min by default: past TCP's retransmission lifetime, tcp_retries2's ~924 s, so the
policy assumes a vanished server that long silent never sends the rest of a chunk; one
stopped that long and then resumed could). And one server strands at most three quarters
of the slots (the others keep a quarter at least): past that its push reads wait for its
late word (refused at their deadline), the others' go on.

The slots mirror this engine's regions (one block of each region per slot), so the server
addresses them as it would our blocks; they live in one DRAM buffer the engine registers
with NIXL and announces in its handshake.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

import anyio
import numpy as np
import numpy.typing as npt

from ._config import Tuning
from ._parts import BlockPart
from ._regions import Region, block_view

Ids = npt.NDArray[np.int64]

#: The most slots an engine has: reads of more blocks go in rounds.
MAX_SLOTS = 4096


class Staging:
    """An engine's staging slots for push reads, and the blocks they are copied into.

    ``budget`` bytes of slots: at least one, at most as many as the engine has blocks or
    ``MAX_SLOTS`` (each peer prepares a descriptor per slot and region). Only for engines
    whose regions are all DRAM: the copy out is a host memcpy.
    """

    def __init__(self, regions: Sequence[Region], budget: int, ttl: float = Tuning.stranded_slot_ttl,
                 clock: Callable[[], float] = time.monotonic) -> None:
        per_slot = sum(r.block_bytes for r in regions)
        self.slots = max(1, min(budget // per_slot, regions[0].num_blocks, MAX_SLOTS))
        #: The most slots one server may strand: three quarters of them (at least one).
        self.server_share = max(1, self.slots * 3 // 4)
        self._buffer = np.zeros(self.slots * per_slot, dtype=np.uint8)
        base = self._buffer.ctypes.data
        self.regions: tuple[Region, ...] = ()
        self._views: list[npt.NDArray[np.uint8]] = []
        offset = 0
        for r in regions:
            size = self.slots * r.block_bytes
            self.regions += (Region(base + offset, r.block_bytes, r.block_bytes, self.slots, "DRAM", 0),)
            self._views.append(self._buffer[offset:offset + size].reshape(self.slots, r.block_bytes))
            offset += size
        self._targets = [block_view(r) for r in regions]
        self._free: list[int] = list(range(self.slots - 1, -1, -1))
        #: Slots of rounds that ended unconfirmed, by (server name, request id), with the
        #: server's process then (``_wire.incarnation``: which process of a name it is) and
        #: when (``clock``).
        self._stranded: dict[tuple[str, int], tuple[Ids, bytes, float]] = {}
        self._ttl = ttl  # Tuning.stranded_slot_ttl
        self._clock = clock
        #: Each server's process as last admitted.
        self._processes: dict[str, bytes] = {}
        self.reclaimed = 0  # slots given back by a late confirmation, a server's restart or the ttl
        self.expired = 0  # of those, the ones given back by the ttl
        self.closed = False
        self._queue: deque[object] = deque()  # readers waiting for slots, in arrival order
        self._changed = anyio.Event()

    @property
    def stranded(self) -> int:
        """Slots out of use until their server confirms."""
        return sum(int(slots.size) for slots, _, _ in self._stranded.values())

    def room_for(self, server: str) -> int:
        """Slots ``server``'s next round may strand at most: its :attr:`server_share`, less its
        own stranded ones (so one vanished or lossy server never takes them all)."""
        own = sum(int(slots.size) for (name, _), (slots, _, _) in self._stranded.items() if name == server)
        return max(0, self.server_share - own)

    def expire(self, gone: Callable[[str], bool]) -> None:
        """Give back the slots stranded more than the ttl ago by servers that are ``gone``
        (no longer connected peers)."""
        if not self._stranded:
            return
        old = self._clock() - self._ttl
        for key in [k for k, (_, _, when) in self._stranded.items() if when <= old and gone(k[0])]:
            slots = self._stranded.pop(key)[0]
            self.expired += int(slots.size)
            self._reclaim(slots)

    @property
    def usable(self) -> int:
        """Slots not stranded."""
        return self.slots - self.stranded

    @property
    def free(self) -> int:
        return len(self._free)

    async def acquire(self, n: int) -> Ids | None:
        """``n`` free slots, first come first served (a large read is not starved by small
        ones); None when fewer than ``n`` are usable any more (stranded meanwhile) or the
        engine is closing."""
        if not self._queue and len(self._free) >= n and not self.closed:
            return self._take(n)
        turn = object()
        self._queue.append(turn)
        try:
            while self._queue[0] is not turn or len(self._free) < n:
                if n > self.usable or self.closed:
                    return None
                changed = self._changed
                await changed.wait()
            return self._take(n)
        finally:
            self._queue.remove(turn)
            self._wake()  # the next in line may go now

    async def changed(self) -> None:
        """Until slots are given back, stranded, taken, or the engine closes."""
        await self._changed.wait()

    def _take(self, n: int) -> Ids:
        taken = self._free[-n:]
        del self._free[-n:]
        return np.array(taken, dtype=np.int64)

    def close(self) -> None:
        """The engine is closing: readers waiting for slots give up."""
        self.closed = True
        self._wake()

    def settle(self, slots: Ids, confirmed: bool, server: str, rid: int, process: bytes) -> None:
        """Round ``rid`` from ``server`` (of process ``process`` when asked) ended: its
        slots are free again if the server confirmed that nothing more of it will land,
        else stranded until it does."""
        if confirmed:
            self._give_back(slots)
        elif self._processes.get(server, process) != process:
            self._reclaim(slots)  # a new process of that name was admitted meanwhile
        else:
            self._stranded[(server, rid)] = (slots, process, self._clock())
            self._wake()  # fewer usable: a reader waiting for more than are left gives up

    def confirmed_late(self, server: str, rid: int) -> None:
        """The server confirmed round ``rid`` after the reader had given up on it."""
        entry = self._stranded.pop((server, rid), None)
        if entry is not None:
            self._reclaim(entry[0])

    def admitted(self, server: str, process: bytes) -> None:
        """An engine of ``server``'s name handshook from ``process``. Another process than
        the one a round was stranded by means the old one is gone (a name is one engine at
        a time). What it had sent has almost always landed by then; not if it was killed
        while its link was cut and its kernel resends the rest once the link is back, after
        its successor handshook (a race no test has produced)."""
        self._processes[server] = process
        for key in [k for k, (_, was, _) in self._stranded.items() if k[0] == server and was != process]:
            self._reclaim(self._stranded.pop(key)[0])

    def _reclaim(self, slots: Ids) -> None:
        self.reclaimed += int(slots.size)
        self._give_back(slots)

    def _give_back(self, slots: Ids) -> None:
        self._free.extend(slots.tolist())
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = anyio.Event()

    def copy_out(self, slots: Ids, ids: Ids, part: BlockPart | None) -> None:
        """Slots ``slots`` into our blocks ``ids``: every region's block, or ``part`` of it."""
        for view, target in zip(self._views, self._targets, strict=True):
            if part is None:
                target[ids] = view[slots]
            else:
                for start, length in part.runs(view.shape[1], "staging"):
                    end = start + length
                    target[ids, start:end] = view[slots, start:end]
