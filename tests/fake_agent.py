"""An in-memory NIXL agent (``aionixl._agent.Agent``) whose transfers do what a test scripts.

Engines in one process built with ``tuning=Tuning(agent_factory=fakes.factory)`` (one
:class:`FakeNixl` per test) talk through these agents: descriptor rows are real addresses,
a transfer copies its bytes with ``memmove`` when it completes, notifications go to the
target agent's inbox. What a transfer does is scripted per agent with :meth:`FakeAgent.script`
(the next transfers it posts, in order; unscripted ones finish inside their post, as a
small transfer in one process does):

- ``Outcome(checks=n)``: in progress for ``n`` checks (inline polls included), then done;
- ``Outcome(stuck=True)``: in progress until released (``lands_after_release``: its bytes
  land when it is released, as a UCX GET under way may);
- ``Outcome(fail=True)``: its check raises ``TransferError`` (NIXL reported it failed);
- ``Outcome(gone=True)``: the post raises ``PeerDisconnectedError`` (the peer's process died).

So a state machine (the poller, a deadline, a fence, an eviction, a close) is driven by the
script, not by how fast a machine is. The wire itself is tested on real NIXL agents.
"""

from __future__ import annotations

import ctypes
import itertools
import secrets
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from aionixl import PeerDisconnectedError, TransferError
from aionixl._agent import DONE, NO_HANDLE, PROC, Agent, Indices, Status

_HEADER = b"nixlSerDes|Agent"


@dataclass(frozen=True)
class Outcome:
    """What one transfer does (see the module docstring)."""

    checks: int = 0
    stuck: bool = False
    lands_after_release: bool = False
    fail: bool = False
    gone: bool = False


@dataclass
class _Transfer:
    outcome: Outcome
    pairs: list[tuple[int, int, int]]  # (destination, source, bytes) per descriptor
    target: str
    notify: bytes
    left: int  # checks until done
    released: int = 0


class FakeNixl:
    """The agents of one test, by name: where transfers find their peers."""

    def __init__(self) -> None:
        self.agents: dict[str, FakeAgent] = {}

    def factory(self, name: str, backends: tuple[str, ...], progress_thread: bool,
                telemetry: bool) -> Agent:
        """``Tuning.agent_factory``."""
        agent = FakeAgent(self, name)
        self.agents[name] = agent
        return agent


class FakeAgent:
    """One agent (see the module docstring); counts what it holds as NIXL's agent does."""

    def __init__(self, world: FakeNixl, name: str) -> None:
        self._world = world
        self.name = name
        self.posted = 0.0
        self.telemetry: tuple[float, float, int] | None = None
        self.xfers: set[int] = set()
        self.registrations: list[npt.NDArray[np.uint64]] = []
        self.dlists: dict[int, tuple[str | None, npt.NDArray[np.uint64]]] = {}
        self.remote_agents: set[str] = set()
        self.inbox: dict[str, list[bytes]] = {}
        self.released: dict[int, int] = {}  # handle -> times released (once, always)
        self._transfers: dict[int, _Transfer] = {}
        self._script: deque[Outcome] = deque()
        self._handles = itertools.count(1)
        self._metadata = (_HEADER + len(name.encode()).to_bytes(8, "little") + name.encode()
                          + b"|fake|" + secrets.token_bytes(8))
        self.destroyed = False

    def script(self, *outcomes: Outcome) -> None:
        """The next transfers this agent posts do these, in order."""
        self._script.extend(outcomes)

    # ---- memory, metadata, peers ----------------------------------------------------------

    def register(self, spans: npt.NDArray[np.uint64], mem_type: str) -> None:
        self.registrations.append(np.array(spans, dtype=np.uint64))

    def deregister_all(self) -> None:
        self.registrations.clear()

    def metadata(self) -> bytes:
        return self._metadata

    def add_remote(self, metadata: bytes, name: str) -> None:
        self.remote_agents.add(name)

    def make_connection(self, remote: str) -> None:
        self._reachable(remote)

    def remove_remote(self, remote: str) -> None:
        self.remote_agents.discard(remote)

    def prep_dlist(self, remote: str | None, descs: npt.NDArray[np.uint64], mem_type: str) -> int:
        handle = next(self._handles)
        self.dlists[handle] = (remote, np.array(descs, dtype=np.uint64).reshape(-1, 3))
        return handle

    def release_dlist(self, handle: int) -> None:
        self.dlists.pop(handle, None)

    # ---- transfers --------------------------------------------------------------------------

    def start_xfer(self, op: str, local: int, local_idx: Indices, remote: int, remote_idx: Indices,
                   notify: bytes, polls: int) -> tuple[int, Status]:
        outcome = self._script.popleft() if self._script else Outcome()
        target, remote_rows = self.dlists[remote]
        assert target is not None, "the remote list of a transfer is a peer's"
        if outcome.gone or not self._reachable(target):
            raise PeerDisconnectedError(f"fake: peer {target!r} is gone")
        mine = self.dlists[local][1][np.asarray(local_idx, dtype=np.int64)]
        theirs = remote_rows[np.asarray(remote_idx, dtype=np.int64)]
        assert (mine[:, 1] == theirs[:, 1]).all(), "descriptor pairs of different lengths"
        into, out_of = (mine, theirs) if op == "read" else (theirs, mine)
        pairs = [(int(d[0]), int(s[0]), int(d[1])) for d, s in zip(into, out_of, strict=True)]
        transfer = _Transfer(outcome, pairs, target, notify, outcome.checks)
        self.posted = time.perf_counter()
        handle = next(self._handles)
        self._transfers[handle] = transfer
        self.xfers.add(handle)
        for _ in range(polls + 1):
            if self._advance(transfer) == DONE:
                self.release_xfer(handle)
                return NO_HANDLE, DONE
        return handle, PROC

    def _advance(self, transfer: _Transfer) -> Status:
        if transfer.outcome.stuck or transfer.outcome.fail:
            return PROC
        if transfer.left > 0:
            transfer.left -= 1
            return PROC
        if transfer.left == 0:
            self._land(transfer)
            transfer.left = -1
        return DONE

    def _land(self, transfer: _Transfer) -> None:
        for dst, src, n in transfer.pairs:
            ctypes.memmove(dst, src, n)
        if transfer.notify:
            self._world.agents[transfer.target].inbox.setdefault(self.name, []).append(transfer.notify)

    def completed(self, handle: int, status: Status) -> None:
        pass

    def check(self, handle: int) -> Status:
        transfer = self._transfers[handle]
        if transfer.outcome.fail:
            raise TransferError("fake: NIXL reported the transfer failed")
        return self._advance(transfer)

    def release_xfer(self, handle: int) -> bool:
        if handle == NO_HANDLE or handle not in self.xfers:
            return True
        self.xfers.discard(handle)
        self.released[handle] = self.released.get(handle, 0) + 1
        transfer = self._transfers.pop(handle)
        if transfer.outcome.lands_after_release:
            self._land(transfer)
        return True

    # ---- notifications ------------------------------------------------------------------------

    def get_notifs(self) -> Mapping[str, list[bytes]]:
        inbox, self.inbox = self.inbox, {}
        return inbox

    def send_notif(self, remote: str, message: bytes) -> None:
        if not self._reachable(remote):
            raise PeerDisconnectedError(f"fake: peer {remote!r} is gone")
        self._world.agents[remote].inbox.setdefault(self.name, []).append(message)

    def _reachable(self, name: str) -> bool:
        agent = self._world.agents.get(name)
        return agent is not None and not agent.destroyed

    # ---- teardown -----------------------------------------------------------------------------

    def live(self) -> dict[str, int]:
        return {"transfer_handles": len(self.xfers), "dlists": len(self.dlists),
                "remote_agents": len(self.remote_agents), "registrations": len(self.registrations)}

    def destroy(self) -> bool:
        self.destroyed = True
        return True
