"""The one module that calls into NIXL.

Everything NIXL-specific stays here: which calls exist, what they return, which of their
exceptions mean what. The rest of aionixl sees small Python objects, plain ints for
transfer handles, and exceptions from ``aionixl._errors``; :func:`translate` is the one
place that maps NIXL exceptions onto that hierarchy.

Every call goes straight to NIXL's compiled bindings (``nixl_cu13._bindings`` or
``nixl_cu12._bindings``, picked as the ``nixl`` package would pick them), never through
the ``nixl`` package itself: that package's CUDA detection imports torch (about a second
and 240 MB per process) where torch has no CUDA build, and its Python wrapper's per-call
handle objects and ``__del__`` bookkeeping would cost about as much as a short transfer.
:class:`Agent` does what ``nixl._api.nixl_agent`` does for the calls it makes (agent
configuration, backend creation, descriptor lists from Nx3 arrays) and keeps its own
account of every live handle.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import logging
import pathlib
import sys
import time
import weakref
from collections.abc import Mapping
from contextlib import suppress
from types import ModuleType
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from ._agent import DONE, ERR, NO_HANDLE, PROC, Indices, Status
from ._errors import (
    AionixlError,
    HandshakeError,
    PeerDisconnectedError,
    TransferError,
)

log = logging.getLogger("aionixl")

#: The packages that carry NIXL's bindings, in the order the ``nixl`` package tries them
#: when no CUDA stack tells it which one to use.
_BINDING_PACKAGES = ("nixl_cu13", "nixl_cu12", "nixl_rocm")


def _cuda_major() -> int | None:
    """The CUDA major version that selects the bindings package, as ``nixl`` finds it
    (``nixl_meta_utils.detect_cuda_major``), except that torch is never imported for it:
    a CUDA stack already imported, else torch's build version read off disk."""

    def major(version: object) -> int | None:
        return int(str(version).split(".")[0]) if version else None

    torch = sys.modules.get("torch")
    if torch is not None:
        found = major(getattr(getattr(torch, "version", None), "cuda", None))
        if found is not None:
            return found
    cuda_bindings = sys.modules.get("cuda.bindings")
    if cuda_bindings is not None:
        found = major(getattr(cuda_bindings, "__version__", None))
        if found is not None:
            return found
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        with suppress(Exception):
            return int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    return major(_torch_cuda_on_disk())


def _torch_cuda_on_disk() -> str | None:
    """torch's build CUDA version (``torch/version.py``'s ``cuda``) without importing torch."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    try:
        version_spec = importlib.util.spec_from_file_location(
            "_aionixl_torch_version", pathlib.Path(spec.origin).parent / "version.py")
        if version_spec is None or version_spec.loader is None:
            return None
        module = importlib.util.module_from_spec(version_spec)
        version_spec.loader.exec_module(module)
    except Exception:
        return None
    cuda = getattr(module, "cuda", None)
    return cuda if isinstance(cuda, str) else None


def find_bindings() -> ModuleType:
    """NIXL's compiled bindings module, without importing the ``nixl`` package.

    The same module ``nixl`` would load: the one it already loaded if it was imported
    first, else ``nixl_cu<major>`` for a detected CUDA stack, else the first installed of
    ``nixl_cu13``, ``nixl_cu12``, ``nixl_rocm``. One process must not load two of them.
    """
    loaded = sys.modules.get("nixl._bindings")
    if loaded is not None:
        return loaded
    cuda = _cuda_major()
    candidates = (f"nixl_cu{cuda}",) if cuda is not None else _BINDING_PACKAGES
    for package in candidates:
        try:
            return importlib.import_module(f"{package}._bindings")
        except ModuleNotFoundError as exc:
            if exc.name not in (package, f"{package}._bindings"):
                raise
    if cuda is not None:
        raise ImportError(f"detected CUDA {cuda} but nixl-cu{cuda} is not installed")
    raise ImportError(f"no NIXL bindings found (tried {', '.join(_BINDING_PACKAGES)}): "
                      "pip install nixl")


_bind: Any = find_bindings()


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
_INIT_AGENT = _bind.NIXL_INIT_AGENT
#: Memory type names as ``nixl_agent`` takes them ("cpu" and "cuda" are its old spellings).
_MEMS: dict[str, Any] = {
    "DRAM": _bind.DRAM_SEG, "VRAM": _bind.VRAM_SEG, "FILE": _bind.FILE_SEG,
    "BLOCK": _bind.BLK_SEG, "OBJ": _bind.OBJ_SEG, "cpu": _bind.DRAM_SEG, "cuda": _bind.VRAM_SEG,
}

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


class NixlAgent:
    """A NIXL agent plus the account of what it holds (:class:`aionixl._agent.Agent`).

    The counters are what ``Engine.live_resources()`` reports; they move only when a NIXL
    call succeeded, so a failed release still shows as live.
    """

    def __init__(self, name: str, backends: tuple[str, ...], progress_thread: bool,
                 telemetry: bool = False, progress_delay_us: int = 0) -> None:
        # As nixl_agent(name, nixl_agent_config(enable_prog_thread=progress_thread,
        # backends=list(backends), capture_telemetry=telemetry)) configures and creates it.
        try:
            config = _bind.nixlAgentConfig()
            config.useProgThread = progress_thread
            config.useListenThread = False
            config.listenPort = _bind.DEFAULT_COMM_PORT
            config.syncMode = _bind.NIXL_THREAD_SYNC_NONE
            config.pthrDelay = progress_delay_us  # 0: the progress thread spins (a core)
            config.lthrDelay = 100000
            config.captureTelemetry = telemetry
            raw: Any = _bind.nixlAgent(name, config)
            plugins = raw.getAvailPlugins()
            if not plugins:
                raise RuntimeError("No plugins available for NIXL, cannot start transfers!")
            created = []
            for backend in backends:
                if backend in plugins:
                    raw.createBackend(backend, {})
                    created.append(backend)
        except _CREATE_ERRORS as exc:
            raw = None  # the traceback keeps this frame: it must not keep the agent (see destroy)
            raise translate(exc, "setup", f"creating NIXL agent {name!r}") from exc
        missing = [b for b in backends if b not in created]
        if missing:
            raw = None  # see destroy()
            raise AionixlError(f"NIXL backend(s) {missing} are not available here")
        self._raw: Any = raw
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
        """Register (address, length, device) rows of ``mem_type`` ("DRAM", "VRAM")."""
        try:
            reg = _bind.nixlRegDList(_MEMS[mem_type], spans)
            self._raw.registerMem(reg, [])
        except _NIXL_ERRORS as exc:
            raise translate(exc, "setup", "registering KV-cache memory") from exc
        self.registrations.append(reg)

    def deregister_all(self) -> None:
        while self.registrations:
            reg = self.registrations[-1]
            try:
                self._raw.deregisterMem(reg, [])
            except _NIXL_ERRORS as exc:
                raise translate(exc, "setup", "deregistering KV-cache memory") from exc
            self.registrations.pop()

    # ---- metadata and peers -------------------------------------------------------------

    def metadata(self) -> bytes:
        md: bytes = self._raw.getLocalMD()
        return md

    def add_remote(self, metadata: bytes, name: str) -> None:
        """Load a peer's metadata; ``name`` is what :func:`metadata_agent_name` read from it.

        A load that fails can leave NIXL holding part of the agent, which makes every later
        load of that name fail (NIXL_ERR_NOT_ALLOWED); such leftovers are removed here.
        """
        try:
            self._raw.loadRemoteMD(metadata)
        except _NIXL_ERRORS as exc:
            if name not in self.remote_agents:
                with suppress(*_NIXL_ERRORS):
                    self._raw.invalidateRemoteMD(name)
            raise translate(exc, "handshake", "loading the peer's NIXL metadata") from exc
        self.remote_agents.add(name)

    def make_connection(self, remote: str) -> None:
        try:
            self._raw.makeConnection(remote, [])
        except _NIXL_ERRORS as exc:
            raise translate(exc, "handshake", f"connecting to {remote!r}") from exc

    def remove_remote(self, remote: str) -> None:
        if remote not in self.remote_agents:
            return
        try:
            self._raw.invalidateRemoteMD(remote)
        except _NIXL_ERRORS as exc:
            raise translate(exc, "setup", f"removing peer {remote!r}") from exc
        self.remote_agents.discard(remote)

    # ---- descriptor lists ---------------------------------------------------------------

    def prep_dlist(self, remote: str | None, descs: npt.NDArray[np.uint64], mem_type: str) -> int:
        """Prepare a descriptor list: local when ``remote`` is None, else the peer's."""
        target = _INIT_AGENT if remote is None else remote
        try:
            handle = int(self._raw.prepXferDlist(target, _bind.nixlXferDList(_MEMS[mem_type], descs), []))
        except _NIXL_ERRORS as exc:
            kind: Kind = "setup" if remote is None else "handshake"
            raise translate(exc, kind, "preparing a descriptor list") from exc
        self.dlists.add(handle)
        return handle

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
        else ``(handle, PROC)`` with the handle live and accounted (the poller's
        :meth:`check` says how it ends). One call for the whole fast path: a short transfer
        costs one Python frame here.
        """
        raw = self._raw
        try:
            handle: int = raw.makeXferReq(_OPS[op], local, local_idx, remote, remote_idx,
                                          notify, _ALL_BACKENDS, False)
        except _NIXL_ERRORS as exc:
            raw = None  # see destroy(): a frame in a kept traceback must not hold the agent
            raise translate(exc, "transfer", "creating a transfer") from exc
        try:
            # One comparison per status (a pybind enum's costs ~0.1 us): the bindings raise
            # every error status, so a request not done is in progress, or check() says.
            done = raw.postXferReq(handle, b"") == _SUCCESS
            self.posted = _perf()
            while not done and polls:
                done = raw.getXferStatus(handle) == _SUCCESS
                polls -= 1
        except _NIXL_ERRORS as exc:
            # A post that fails (say, the peer is gone) still leaves a request to release.
            raw = None  # see destroy()
            self.xfers.add(handle)
            self.release_xfer(handle)
            raise translate(exc, "transfer", "posting a transfer") from exc
        if done:
            if self._capture:
                self._read_telemetry(handle)
            try:
                raw.releaseXferReq(handle)
            except _NIXL_ERRORS:
                self.xfers.add(handle)
                return handle, DONE
            return NO_HANDLE, DONE
        self.xfers.add(handle)
        return handle, PROC

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

    def destroy(self) -> bool:
        """Drop the agent; NIXL tears down its backends (and their threads) here.

        Only if this was the last reference: anything else still holding the bindings'
        agent (say, a traceback frame with it as a local, kept through an exception stored
        on an evicted Peer) keeps the UCX worker, its sockets and UCX's "async" thread alive
        for as long as it lives. Returns False (and logs) when the agent outlived this.
        """
        raw, self._raw = self._raw, None
        if raw is None:
            return True
        ref = weakref.ref(raw)
        del raw
        if ref() is None:
            return True
        log.error("NIXL agent %r is still referenced after close (%d referrers): its UCX "
                  "worker and threads stay until they are released", self.name,
                  len(gc.get_referrers(ref())))
        return False


#: The idle period of NIXL's progress thread in the in-process agent that serves readers
#: nobody here polls for (vLLM decoders: over UCX TCP their reads need the target to make
#: progress; a serving child keeps its own, ``_vllm_sidecar.PROGRESS_DELAY_US``).
#: The thread waits on the UCX worker's event fd, so traffic wakes it at once; this is only
#: its timeout (NIXL rounds it up to whole milliseconds; 0 would spin a core). Measured
#: here, serving a real vLLM decode: one-block reads as fast with 10 ms as with 1 ms, the
#: idle process at under 1% of a core instead of 3%.
SERVING_PROGRESS_DELAY_US = 10_000


def serving_agent(name: str, backends: tuple[str, ...], progress_thread: bool,
                  telemetry: bool) -> NixlAgent:
    """A :class:`NixlAgent` for serving readers (an ``AgentFactory``): NIXL's progress
    thread on, idling at ``SERVING_PROGRESS_DELAY_US``."""
    return NixlAgent(name, backends, progress_thread, telemetry,
                     progress_delay_us=SERVING_PROGRESS_DELAY_US)
