"""The one boundary with NIXL, as a protocol: what the engine asks of a NIXL agent.

:class:`aionixl._nixl.NixlAgent` implements it over NIXL's bindings; the tests' in-memory
fake (``tests/fake_agent.py``) implements it over ``memmove``, with transfer states
scripted, so that the engine's state machines can be driven without timing. An engine
makes its agents through ``Tuning.agent_factory`` (default: ``NixlAgent``).

Transfer states are NIXL's: :data:`DONE`, :data:`PROC` (in progress), :data:`ERR`. Handles
are ints; :data:`NO_HANDLE` stands for a request that finished inside its post (already
released). Errors are the public ones (``aionixl._errors``): ``PeerDisconnectedError`` for
a peer that is gone, ``TransferError`` for a failed transfer, ``AionixlError`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal, Protocol

import numpy as np
import numpy.typing as npt

DONE: Literal[0] = 0
PROC: Literal[1] = 1
ERR: Literal[2] = 2
Status = Literal[0, 1, 2]
NO_HANDLE = -1
#: Descriptor indices as NIXL takes them: an int32 array or a plain list of ints.
Indices = npt.NDArray[np.int32] | list[int]


class Agent(Protocol):
    """A NIXL agent plus the account of what it holds (``Engine.live_resources``)."""

    name: str
    #: ``time.perf_counter()`` when the last :meth:`start_xfer`'s post returned.
    posted: float
    #: With telemetry: NIXL's (post seconds, transfer seconds, descriptors) of the last
    #: transfer seen done; None without it.
    telemetry: tuple[float, float, int] | None
    #: Handles of the transfers posted and not released yet.
    xfers: set[int]

    def register(self, spans: npt.NDArray[np.uint64], mem_type: str) -> None:
        """Register (address, length, device) rows of ``mem_type`` ("DRAM", "VRAM")."""

    def deregister_all(self) -> None: ...

    def metadata(self) -> bytes:
        """What a peer loads to reach this agent (it starts with NIXL's header and the
        agent's name: ``aionixl._nixl.metadata_agent_name`` reads it)."""

    def add_remote(self, metadata: bytes, name: str) -> None: ...

    def make_connection(self, remote: str) -> None: ...

    def remove_remote(self, remote: str) -> None: ...

    def prep_dlist(self, remote: str | None, descs: npt.NDArray[np.uint64], mem_type: str) -> int:
        """Prepare a descriptor list: local when ``remote`` is None, else the peer's."""

    def release_dlist(self, handle: int) -> None: ...

    def start_xfer(self, op: str, local: int, local_idx: Indices, remote: int, remote_idx: Indices,
                   notify: bytes, polls: int) -> tuple[int, Status]:
        """Create and post a transfer, checking it ``polls`` more times right away:
        ``(NO_HANDLE, DONE)`` when it finished (released), else ``(handle, PROC)``."""

    def completed(self, handle: int, status: Status) -> None:
        """A transfer finished through the poller (its telemetry is read here)."""

    def check(self, handle: int) -> Status:
        """Progress and report the state; raises the mapped error on failure."""

    def release_xfer(self, handle: int) -> bool:
        """Release (cancelling if still active); False when refused for now."""

    def get_notifs(self) -> Mapping[str, list[bytes]]:
        """Progress and take the notifications that arrived, by sender."""

    def send_notif(self, remote: str, message: bytes) -> None: ...

    def live(self) -> dict[str, int]:
        """Handles held: ``transfer_handles``, ``dlists``, ``remote_agents``, ``registrations``."""

    def destroy(self) -> bool:
        """Drop the agent; False (logged) when something still holds it."""


#: Makes an agent: (name, backends, NIXL progress thread, telemetry).
AgentFactory = Callable[[str, tuple[str, ...], bool, bool], Agent]
