"""Shared state: where the engine is in its life, and this engine's own side of NIXL.

Components read these instead of the ``Engine``: a component is given the
:class:`Lifecycle` (may new work start? end a waiting call when the engine closes) and the
:class:`LocalSide` (the agent, our descriptor list and geometry) through its constructor.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import anyio
import zmq

from ._agent import Agent
from ._errors import EngineClosedError
from ._regions import Region, region_offsets
from ._staging import Staging

#: Engine states. Only an OPEN engine takes new transfers and peers; a DRAINING one
#: finishes what it has; CLOSING/CLOSED refuse everything.
NEW, OPEN, DRAINING, CLOSING, CLOSED = "new", "open", "draining", "closing", "closed"


class Lifecycle:
    """The engine's state, the failure that stopped it, and the calls to end on close."""

    __slots__ = ("name", "usable", "closed", "_state", "_failure", "_op_scopes")

    def __init__(self, name: str) -> None:
        self.name = name
        #: Open and healthy: the transfer path's one test (kept up to date by the setters).
        self.usable = False
        #: Set once a close ended: every peer dropped, every NIXL resource released.
        self.closed = anyio.Event()
        self._state = NEW
        self._failure: BaseException | None = None
        self._op_scopes: set[anyio.CancelScope] = set()

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        self._state = state
        self.usable = state is OPEN and self._failure is None

    @property
    def failure(self) -> BaseException | None:
        """A background task crashed: new calls are refused with this as the cause."""
        return self._failure

    @failure.setter
    def failure(self, failure: BaseException | None) -> None:
        self._failure = failure
        self.usable = self._state is OPEN and failure is None

    def check_open(self, *, draining_ok: bool = False) -> None:
        """Raise the ``EngineClosedError`` a caller should see, unless new work may start."""
        if self.failure is None and (self.state == OPEN or (draining_ok and self.state == DRAINING)):
            return
        if self.failure is not None:
            raise EngineClosedError(f"engine {self.name!r} stopped after an internal error") \
                from self.failure
        if self.state == NEW:
            raise EngineClosedError("engine not started: use 'async with Engine(...)'")
        if self.state == DRAINING:
            raise EngineClosedError(f"engine {self.name!r} is draining: it takes no new work")
        raise EngineClosedError(f"engine {self.name!r} is closed")

    async def until_closed(self, limit: float) -> None:
        """For a caller that left a read while the engine closes: wait until the close
        dropped every peer (nothing more of the read can land then), shielded, at most
        ``limit`` seconds."""
        with anyio.CancelScope(shield=True), anyio.move_on_after(limit):
            await self.closed.wait()

    @contextmanager
    def operation(self) -> Iterator[None]:
        """Run a waiting call so that closing the engine ends it with EngineClosedError."""
        scope = anyio.CancelScope()
        self._op_scopes.add(scope)
        try:
            with scope:
                yield
        finally:
            self._op_scopes.discard(scope)
        if scope.cancel_called:
            raise EngineClosedError(f"engine {self.name!r} closed")

    def end_operations(self) -> None:
        """Closing: every call inside :meth:`operation` ends with EngineClosedError."""
        for scope in list(self._op_scopes):
            scope.cancel()


class LocalSide:
    """This engine's own NIXL state and geometry: what every component posts from.

    ``agent`` is None before the engine opens and after it closed; ``dlist`` is the local
    descriptor list (-1 without one); ``metadata`` the agent's metadata, sent to peers.
    """

    __slots__ = ("name", "regions", "num_blocks", "mem_type", "offsets", "offset_list",
                 "bytes_per_block", "agent", "dlist", "metadata", "zctx", "staging")

    def __init__(self, name: str, regions: Sequence[Region]) -> None:
        self.name = name
        self.regions = tuple(regions)
        self.num_blocks = regions[0].num_blocks
        self.mem_type = regions[0].mem_type
        self.offsets = region_offsets(len(regions), self.num_blocks)
        self.offset_list: list[int] = self.offsets.ravel().tolist()
        self.bytes_per_block = sum(r.block_bytes for r in regions)
        self.agent: Agent | None = None
        self.dlist = -1
        self.metadata = b""
        #: The zmq context handshakes use (created when the engine opens).
        self.zctx: zmq.Context[zmq.Socket[bytes]] | None = None
        #: Staging slots for push reads (registered when the engine opens; None: none).
        #: Kept after close: UCX may write into them until the agent is gone.
        self.staging: Staging | None = None
