"""The one module that calls into NIXL.

Everything NIXL-specific stays here: which calls exist, what they return, which of their
exceptions mean what. The rest of aionixl sees small Python objects, plain ints for
transfer handles, and exceptions from ``aionixl._errors``; :func:`translate` is the one
place that maps NIXL exceptions onto that hierarchy.

Setup calls (registration, metadata, descriptor lists) go through NIXL's public Python
wrapper. The per-transfer calls go straight to its bound ``nixlAgent`` with integer
handles: the wrapper's per-call object and ``__del__`` bookkeeping would cost about as
much as the transfer itself, and this class keeps its own account of every live handle.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextlib import suppress
from typing import Any, Literal

import nixl._bindings as _bind
import numpy as np
import numpy.typing as npt
from nixl._api import nixl_agent, nixl_agent_config

from ._errors import (
    AionixlError,
    HandshakeError,
    PeerDisconnectedError,
    TransferError,
)

log = logging.getLogger("aionixl")

DONE: Literal[0] = 0
PROC: Literal[1] = 1
ERR: Literal[2] = 2
Status = Literal[0, 1, 2]
NO_HANDLE = -1
Indices = npt.NDArray[np.int32] | list[int]

_SUCCESS = _bind.NIXL_SUCCESS
_IN_PROG = _bind.NIXL_IN_PROG
_OPS = {"read": _bind.NIXL_READ, "write": _bind.NIXL_WRITE}
_NIXL_ERRORS: tuple[type[BaseException], ...] = tuple(
    getattr(_bind, n) for n in dir(_bind) if n.startswith("nixl") and n.endswith("Error")
)
_CREATE_ERRORS: tuple[type[BaseException], ...] = (*_NIXL_ERRORS, RuntimeError)
_DISCONNECT = _bind.nixlRemoteDisconnectError
_perf = time.perf_counter
_ALL_BACKENDS: tuple[int, ...] = ()  # let NIXL choose the backend

Kind = Literal["transfer", "handshake", "setup"]


def is_nixl_error(exc: BaseException) -> bool:
    return isinstance(exc, _NIXL_ERRORS)


def translate(exc: BaseException, kind: Kind, what: str) -> AionixlError:
    """Map a NIXL exception raised while doing ``what`` to the public hierarchy."""
    detail = f"{what}: {type(exc).__name__}: {exc}"
    if isinstance(exc, _DISCONNECT):
        return PeerDisconnectedError(detail)
    if kind == "transfer":
        return TransferError(detail)
    if kind == "handshake":
        return HandshakeError(detail)
    return AionixlError(detail)


_MD_HEADER = b"nixlSerDes|Agent"
_MAX_NAME = 1024


def metadata_agent_name(metadata: bytes) -> str | None:
    """The agent name NIXL's serialized metadata carries, or None if it has none.

    Read without NIXL, before loading: loading someone else's metadata under a claimed name
    would replace that agent's state, and a name that is not UTF-8 could not be removed.
    """
    if not metadata.startswith(_MD_HEADER) or len(metadata) < len(_MD_HEADER) + 8:
        return None
    start = len(_MD_HEADER) + 8
    size = int.from_bytes(metadata[len(_MD_HEADER):start], "little")
    if not 0 < size <= _MAX_NAME or len(metadata) < start + size:
        return None
    try:
        return metadata[start:start + size].decode("utf-8")
    except UnicodeDecodeError:
        return None


class Agent:
    """A NIXL agent plus the account of what it holds.

    The counters are what ``Engine.live_resources()`` reports; they move only when a NIXL
    call succeeded, so a failed release still shows as live.
    """

    def __init__(self, name: str, backends: tuple[str, ...], progress_thread: bool,
                 telemetry: bool = False) -> None:
        config = nixl_agent_config(enable_prog_thread=progress_thread, backends=list(backends),
                                   capture_telemetry=telemetry)
        try:
            self._agent: Any = nixl_agent(name, config)
        except _CREATE_ERRORS as exc:
            raise translate(exc, "setup", f"creating NIXL agent {name!r}") from exc
        missing = [b for b in backends if b not in self._agent.backends]
        if missing:
            self._agent = None
            raise AionixlError(f"NIXL backend(s) {missing} are not available here")
        self._raw: Any = self._agent.agent
        self.name = name
        self.registrations: list[Any] = []
        self.dlists: set[int] = set()
        self.xfers: set[int] = set()
        self.remote_agents: set[str] = set()
        #: perf_counter() when the last start_xfer's post returned.
        self.posted = 0.0
        #: With ``telemetry``: NIXL's (post seconds, transfer seconds, descriptors) of the
        #: last transfer seen done (by start_xfer or :meth:`completed`); None without it.
        self.telemetry: tuple[float, float, int] | None = None
        self._capture = telemetry

    # ---- memory -------------------------------------------------------------------------

    def register(self, spans: npt.NDArray[np.uint64], mem_type: str) -> None:
        try:
            reg = self._agent.register_memory(spans, mem_type)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "setup", "registering KV-cache memory") from exc
        self.registrations.append(reg)

    def deregister_all(self) -> None:
        while self.registrations:
            reg = self.registrations[-1]
            try:
                self._agent.deregister_memory(reg)
            except _NIXL_ERRORS as exc:
                raise translate(exc, "setup", "deregistering KV-cache memory") from exc
            self.registrations.pop()

    # ---- metadata and peers -------------------------------------------------------------

    def metadata(self) -> bytes:
        md: bytes = self._agent.get_agent_metadata()
        return md

    def add_remote(self, metadata: bytes, name: str) -> None:
        """Load a peer's metadata; ``name`` is what :func:`metadata_agent_name` read from it.

        A load that fails can leave NIXL holding part of the agent, which makes every later
        load of that name fail (NIXL_ERR_NOT_ALLOWED); such leftovers are removed here.
        """
        try:
            self._agent.add_remote_agent(metadata)
        except _NIXL_ERRORS as exc:
            if name not in self.remote_agents:
                with suppress(*_NIXL_ERRORS):
                    self._raw.invalidateRemoteMD(name)
            raise translate(exc, "handshake", "loading the peer's NIXL metadata") from exc
        self.remote_agents.add(name)

    def make_connection(self, remote: str) -> None:
        try:
            self._agent.make_connection(remote)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "handshake", f"connecting to {remote!r}") from exc

    def remove_remote(self, remote: str) -> None:
        if remote not in self.remote_agents:
            return
        try:
            self._agent.remove_remote_agent(remote)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "setup", f"removing peer {remote!r}") from exc
        self.remote_agents.discard(remote)

    # ---- descriptor lists ---------------------------------------------------------------

    def prep_dlist(self, remote: str | None, descs: npt.NDArray[np.uint64], mem_type: str) -> int:
        """Prepare a descriptor list: local when ``remote`` is None, else the peer's."""
        target = "NIXL_INIT_AGENT" if remote is None else remote
        try:
            handle = self._agent.prep_xfer_dlist(target, descs, mem_type)
        except _NIXL_ERRORS as exc:
            kind: Kind = "setup" if remote is None else "handshake"
            raise translate(exc, kind, "preparing a descriptor list") from exc
        # Own the raw handle; the wrapper must not release it again from __del__.
        raw = int(handle._handle)
        handle._released = True
        self.dlists.add(raw)
        return raw

    def release_dlist(self, handle: int) -> None:
        if handle not in self.dlists:
            return
        try:
            self._raw.releasedDlistH(handle)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "setup", "releasing a descriptor list") from exc
        self.dlists.discard(handle)

    # ---- transfers (hot path) -----------------------------------------------------------

    def start_xfer(self, op: str, local: int, local_idx: Indices, remote: int,
                   remote_idx: Indices, notify: bytes, polls: int) -> tuple[int, Status]:
        """Create and post a transfer, checking it ``polls`` more times right away.

        Returns ``(NO_HANDLE, DONE)`` when it finished (the handle is already released),
        else ``(handle, PROC)`` or ``(handle, ERR)`` with the handle live and accounted.
        One call for the whole fast path: a short transfer costs one Python frame here.
        """
        raw = self._raw
        try:
            handle: int = raw.makeXferReq(_OPS[op], local, local_idx, remote, remote_idx,
                                          notify, _ALL_BACKENDS, False)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "transfer", "creating a transfer") from exc
        try:
            status = raw.postXferReq(handle, b"")
            self.posted = _perf()
            while status == _IN_PROG and polls:
                status = raw.getXferStatus(handle)
                polls -= 1
        except _NIXL_ERRORS as exc:
            # A post that fails (say, the peer is gone) still leaves a request to release.
            self.xfers.add(handle)
            self.release_xfer(handle)
            raise translate(exc, "transfer", "posting a transfer") from exc
        if status == _SUCCESS:
            if self._capture:
                self._read_telemetry(handle)
            try:
                raw.releaseXferReq(handle)
            except _NIXL_ERRORS:
                self.xfers.add(handle)
                return handle, DONE
            return NO_HANDLE, DONE
        self.xfers.add(handle)
        return handle, PROC if status == _IN_PROG else ERR

    def completed(self, handle: int, status: Status) -> None:
        """A transfer finished through the poller: keep its telemetry before release."""
        if self._capture and status == DONE:
            self._read_telemetry(handle)

    def _read_telemetry(self, handle: int) -> None:
        try:
            t = self._raw.getXferTelemetry(handle)
            self.telemetry = (t.postDuration * 1e-6, t.xferDuration * 1e-6, int(t.descCount))
        except _NIXL_ERRORS:
            self.telemetry = None  # the engine's own clock stands in

    def check(self, handle: int) -> Status:
        """Progress NIXL and report the state; raises the mapped error on failure."""
        try:
            status = self._raw.getXferStatus(handle)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "transfer", "checking a transfer") from exc
        return DONE if status == _SUCCESS else PROC if status == _IN_PROG else ERR

    def release_xfer(self, handle: int) -> bool:
        """Release (cancelling if still active). False when NIXL refuses for now."""
        if handle == NO_HANDLE or handle not in self.xfers:
            return True
        try:
            self._raw.releaseXferReq(handle)
        except _NIXL_ERRORS as exc:
            log.debug("NIXL refused to release transfer 0x%x for now: %r", handle, exc)
            return False
        self.xfers.discard(handle)
        return True

    # ---- notifications ------------------------------------------------------------------

    def get_notifs(self) -> Mapping[str, list[bytes]]:
        """Progress NIXL and take the notifications that arrived since the last call."""
        try:
            notifs: Mapping[str, list[bytes]] = self._raw.getNotifs({}, [])
        except _NIXL_ERRORS as exc:
            raise translate(exc, "transfer", "reading notifications") from exc
        return notifs

    def send_notif(self, remote: str, message: bytes) -> None:
        try:
            self._raw.genNotif(remote, message)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "transfer", f"sending a notification to {remote!r}") from exc

    # ---- teardown -----------------------------------------------------------------------

    def live(self) -> dict[str, int]:
        return {
            "transfer_handles": len(self.xfers),
            "dlists": len(self.dlists),
            "remote_agents": len(self.remote_agents),
            "registrations": len(self.registrations),
        }

    def destroy(self) -> None:
        """Drop the agent; NIXL tears down its backends (and their threads) here."""
        self._raw = None
        self._agent = None
