"""An engine's settings: user policy (:class:`EngineConfig`) and performance tunables
(:class:`Tuning`, public as ``aionixl.lowlevel.Tuning``), with defaults that suit a server
on one host."""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from ._agent import AgentFactory


def _mapping() -> Mapping[str, str]:
    return {}


#: The largest ``coalesce_max_blocks``: a merged request's packed notification carries a
#: message per member at most, and receivers refuse one of more messages than this
#: (``aionixl._wire.MAX_PACKED_MESSAGES``).
MAX_COALESCE_BLOCKS = 1 << 16


def _check_seconds(values: Mapping[str, object], *, finite: tuple[str, ...] = ()) -> None:
    for name, value in values.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if name in finite and math.isinf(value):
            raise ValueError(f"{name} must be finite")


def _check_ints(values: Mapping[str, object], least: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name} must be an int >= {least}, got {value!r}")


def _check_bools(values: Mapping[str, object]) -> None:
    for name, value in values.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be a bool, got {value!r}")


@dataclass(frozen=True, kw_only=True)
class Tuning:
    """Performance tunables and test seams (``aionixl.lowlevel.Tuning``; pass it as
    ``Engine(..., tuning=)``). The defaults are measured ones (docs/progress-and-idle-cpu.md,
    docs/coalescing.md, docs/read-modes.md); these names may change between releases,
    unlike :class:`EngineConfig`'s. All times are in seconds.

    The polling intervals trade idle CPU for latency: the engine polls NIXL every event-loop
    turn while transfers are in flight, and backs off to ``notification_poll_interval``
    while someone waits for a notification, and to ``idle_poll_interval`` when nothing at
    all is happening.
    """

    #: Let NIXL run its own progress thread. Off by default: the engine drives progress.
    nixl_progress_thread: bool = False
    #: Create the agent with NIXL's per-request telemetry and take ``TransferResult``'s
    #: ``post_seconds``, ``transfer_seconds`` and ``descriptors`` from it (NIXL's own timing,
    #: descriptors counted after merging). Off by default: reading it costs about 1.5 us per
    #: transfer (measured; docs/metrics.md); the engine's clock stands in.
    nixl_telemetry: bool = False
    #: How long ``aclose()`` lets this engine's transfers under way finish before it
    #: cancels them (their callers then get ``EngineClosedError``); within ``close_timeout``.
    close_grace: float = 0.5
    #: Notifications kept for nobody-waiting-yet; past it the oldest one is dropped.
    max_pending_notifications: int = 4096
    #: Largest handshake message accepted or sent.
    max_handshake_bytes: int = 16 * 1024 * 1024
    #: The pause between ``connect()`` attempts (``EngineConfig.connect_retries``) starts at
    #: ``connect_backoff`` and doubles up to 1 s; an attempt waits ``connect_attempt_timeout``
    #: for an answer.
    connect_backoff: float = 0.05
    connect_attempt_timeout: float = 2.0
    idle_poll_interval: float = 0.1
    #: How often the engine checks that its peers are still alive (one small NIXL
    #: notification each; a peer NIXL reports gone is evicted). ``math.inf`` disables it.
    peer_probe_interval: float = 5.0
    notification_poll_interval: float = 0.002
    #: ``check_xfer_state`` calls made inline right after a post, before handing the
    #: transfer to the poller task. Saves a trip through the event loop for short transfers.
    inline_polls: int = 4
    #: The most blocks one merged request carries; callers beyond it start another (at
    #: most 65536).
    coalesce_max_blocks: int = 4096
    #: Calls that move more bytes than this post alone, never in a merged request. Merging
    #: saves a caller its own post, state checks and wake, most of a small call's cost but
    #: little of a large one's, while every member of a merged request waits for all of
    #: its bytes (measured in docs/coalescing.md).
    coalesce_max_call_bytes: int = 512 << 10
    #: Calls from different tasks closer together than this "arrive together": the later
    #: one gathers a merged request (one trip through the event loop) instead of posting
    #: alone. A caller looping on its own never gathers, whatever the window.
    coalesce_window: float = 0.001
    #: A push is written in NIXL WRITEs of about this many bytes, one after another: how
    #: long a cancelled push may keep writing before the server confirms it stopped.
    push_chunk_bytes: int = 8 << 20
    #: How long a read that was cancelled or timed out waits for the peer to confirm that
    #: nothing more of it will land (push) or for a fencing read (GET); without it in time
    #: the peer is evicted. A timed-out read raises at most this long after its deadline
    #: (0.5 s: a typed error within the deadline + 1 s, scheduling included).
    push_cancel_timeout: float = 0.5
    #: Push reads one peer may have open on this engine (as the serving side); more are
    #: refused with a TransferError at the reader.
    max_pushes_per_peer: int = 1024
    #: The most descriptors (one per region and block) this engine prepares for one list of
    #: a peer's: its blocks, its staging slots, or its side of a pair of block parts. A peer
    #: announcing more is refused at the handshake (``IncompatiblePeerError``, ``.field``
    #: ``"num_blocks"`` or ``"staging"``) before anything is allocated; parts needing more
    #: raise ``ValueError``. 2**24 fits a 70B model's cache at TP 1 with room to spare
    #: (80 layers with K and V apart: 160 regions of up to 104,857 blocks); each descriptor
    #: passes ~70 bytes through memory while a list is prepared.
    max_peer_descriptors: int = 1 << 24
    #: Staging slots stranded by a push read whose server never confirmed it stopped come
    #: back this long after the read ended, once that server is no longer connected (a late
    #: confirmation or the server's restart gives them back sooner). The default, 15 min,
    #: is past TCP's retransmission lifetime: a vanished server silent that long is taken
    #: never to send the rest of its chunk (docs/read-modes.md).
    stranded_slot_ttl: float = 900.0
    #: Makes the engine's NIXL agents (``aionixl._agent.Agent``): None is NIXL's own. A test
    #: seam: the tests' in-memory fake agent comes in here. Not sent to remote engines.
    agent_factory: AgentFactory | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        _check_bools({"nixl_progress_thread": self.nixl_progress_thread,
                      "nixl_telemetry": self.nixl_telemetry})
        _check_seconds({"close_grace": self.close_grace, "connect_backoff": self.connect_backoff,
                        "connect_attempt_timeout": self.connect_attempt_timeout,
                        "idle_poll_interval": self.idle_poll_interval,
                        "peer_probe_interval": self.peer_probe_interval,
                        "notification_poll_interval": self.notification_poll_interval,
                        "push_cancel_timeout": self.push_cancel_timeout,
                        "stranded_slot_ttl": self.stranded_slot_ttl},
                       finite=("push_cancel_timeout",))
        _check_ints({"max_pending_notifications": self.max_pending_notifications,
                     "max_handshake_bytes": self.max_handshake_bytes,
                     "coalesce_max_blocks": self.coalesce_max_blocks,
                     "coalesce_max_call_bytes": self.coalesce_max_call_bytes,
                     "push_chunk_bytes": self.push_chunk_bytes,
                     "max_pushes_per_peer": self.max_pushes_per_peer,
                     "max_peer_descriptors": self.max_peer_descriptors}, 1)
        _check_ints({"inline_polls": self.inline_polls}, 0)
        if self.coalesce_max_blocks > MAX_COALESCE_BLOCKS:
            raise ValueError(f"coalesce_max_blocks must be at most {MAX_COALESCE_BLOCKS}, "
                             f"got {self.coalesce_max_blocks!r}")
        if self.agent_factory is not None and not callable(self.agent_factory):
            raise ValueError(f"agent_factory must be callable or None, got {self.agent_factory!r}")
        window = self.coalesce_window
        if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 <= window < math.inf:
            raise ValueError(f"coalesce_window must be a finite number of seconds >= 0, got {window!r}")


#: The names ``EngineConfig`` took before they moved to :class:`Tuning` (0.1.0); they
#: still work there, with a ``DeprecationWarning``, until 0.3.
MOVED_TO_TUNING: frozenset[str] = frozenset(f.name for f in dataclasses.fields(Tuning))


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What an engine lets in, how long it waits, and what it may hold. All times are in
    seconds. Performance tunables are ``aionixl.lowlevel.Tuning``'s.

    ``transfer_timeout`` is the deadline a ``transfer_blocks`` call gets when it passes
    ``timeout=None``; ``math.inf`` disables it.
    """

    backends: tuple[str, ...] = ("UCX",)
    #: Extra compatibility keys (model, dtype, layout...) that must match on both sides.
    compat: Mapping[str, str] = field(default_factory=_mapping)
    #: Refuse peers (``connect``, the listener, ``aionixl.vllm.connect``) whose bytes per block
    #: differ from ours in any region, with ``IncompatiblePeerError`` (``.field``
    #: ``"bytes_per_block[i]"``). Off by default: such peers are admitted, and parts of
    #: blocks (``aionixl.BlockPart``) move between them; whole blocks of different sizes are
    #: refused per transfer. The region count must match either way.
    require_equal_geometry: bool = False
    transfer_timeout: float = 60.0
    #: How long ``aclose()`` may spend releasing NIXL resources before it reports leaks.
    close_timeout: float = 5.0
    #: The bytes the messages of notifications kept for nobody-waiting-yet may hold
    #: together, so that a peer sending large ones cannot grow memory past it; past it the
    #: oldest are dropped (the newest is always kept).
    max_pending_notification_bytes: int = 16 << 20
    #: A secret shared by the engines that may connect to each other. When set, every
    #: handshake message carries an HMAC-SHA256 tag of it and messages without the right
    #: tag are refused before anything in them reaches NIXL (whoever completes a handshake
    #: can read and write every registered block, and NIXL/UCX can crash the process on
    #: crafted metadata). An engine listening beyond loopback needs one, or
    #: ``allow_unauthenticated``.
    handshake_secret: bytes | None = field(default=None, repr=False)
    #: Opt out of protected mode, for trusted networks only: without it, an engine whose
    #: listener binds an address other hosts can reach (not loopback, ``ipc://`` or
    #: ``inproc://``) refuses to start without a ``handshake_secret``, and
    #: ``aionixl.vllm.serve`` (vLLM's side channel cannot be signed) serves loopback only.
    allow_unauthenticated: bool = False
    #: Extra handshake attempts ``connect()`` makes after one fails (no answer in time, a
    #: NIXL connection error, a peer that is busy or draining), all within the call's
    #: ``timeout``. Refusals that cannot change (incompatible, wrong version, not aionixl)
    #: are never retried.
    connect_retries: int = 0
    #: Merge concurrent ``transfer_blocks`` calls to one peer with the same op into one
    #: NIXL request when they arrive together (see docs/coalescing.md). A lone
    #: caller never waits for company.
    coalesce: bool = True
    #: How ``transfer_blocks(op="read")`` moves data: ``"get"`` (a one-sided NIXL READ),
    #: ``"push"`` (the peer's engine WRITEs the blocks into ours; see docs/read-modes.md),
    #: or ``"auto"``: GET where the path supports it natively (one host with shared memory
    #: allowed on both sides, or RDMA on both), push otherwise (UCX over TCP). Decided per
    #: peer at the handshake; ``Peer.read_mode`` says what was chosen.
    read_mode: Literal["auto", "get", "push"] = "auto"
    #: Bytes of staging slots for push reads (one block of every region per slot; at
    #: least one slot, at most 4096 and the engine's blocks; DRAM engines only; 0: none).
    #: A push read lands in these slots and is copied into the caller's blocks once
    #: complete, so no byte of a read that failed can land in them later
    #: (docs/read-modes.md). A round takes at most half of the slots, so larger reads go
    #: in rounds; concurrent push reads share them, first come first served.
    push_staging_bytes: int = 64 << 20

    if not TYPE_CHECKING:  # (type checkers see the fields only)
        def __getattr__(self, name: str) -> Any:
            """A name that moved to :class:`Tuning`, read here: its value, with a warning."""
            if name not in MOVED_TO_TUNING:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            _warn_moved(name, stacklevel=3)
            return self.__dict__.get("_moved", {}).get(name, _TUNING_DEFAULTS[name])

    def __post_init__(self) -> None:
        if not self.backends or not all(isinstance(b, str) and b for b in self.backends):
            raise ValueError("backends must be a non-empty tuple of backend names")
        object.__setattr__(self, "backends", tuple(self.backends))
        for key, text in self.compat.items():
            if not isinstance(key, str) or not isinstance(text, str):
                raise ValueError("compat must map str to str")
        object.__setattr__(self, "compat", dict(self.compat))
        _check_seconds({"transfer_timeout": self.transfer_timeout, "close_timeout": self.close_timeout})
        if math.isinf(self.close_timeout):
            raise ValueError("close_timeout must be finite: aclose() is always bounded")
        _check_ints({"max_pending_notification_bytes": self.max_pending_notification_bytes}, 1)
        _check_ints({"push_staging_bytes": self.push_staging_bytes,
                     "connect_retries": self.connect_retries}, 0)
        if self.handshake_secret is not None and (
                not isinstance(self.handshake_secret, bytes) or len(self.handshake_secret) < 16):
            raise ValueError("handshake_secret must be bytes of at least 16 bytes, or None")
        _check_bools({"require_equal_geometry": self.require_equal_geometry, "coalesce": self.coalesce,
                      "allow_unauthenticated": self.allow_unauthenticated})
        if self.read_mode not in ("auto", "get", "push"):
            raise ValueError(f"read_mode must be 'auto', 'get' or 'push', got {self.read_mode!r}")



def effective_tuning(config: EngineConfig, tuning: Tuning | None) -> Tuning:
    """``tuning`` (default ``Tuning()``) with the values ``config`` was given under names
    that moved to :class:`Tuning` (deprecated), which win."""
    moved: dict[str, Any] = config.__dict__.get("_moved", {})
    base = Tuning() if tuning is None else tuning
    return dataclasses.replace(base, **moved) if moved else base


_TUNING_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(Tuning)}


def _warn_moved(name: str, stacklevel: int) -> None:
    warnings.warn(f"EngineConfig.{name} moved to aionixl.lowlevel.Tuning: pass "
                  f"Engine(..., tuning=aionixl.lowlevel.Tuning({name}=...)); the EngineConfig name "
                  "goes in 0.3", DeprecationWarning, stacklevel=stacklevel)


def _accepting_moved_names(init: Callable[..., None]) -> Callable[..., None]:
    """``EngineConfig(...)`` still takes the names that moved to :class:`Tuning` (with a
    ``DeprecationWarning``); their values are checked by ``Tuning`` and kept aside."""

    @functools.wraps(init)
    def __init__(self: EngineConfig, **kwargs: Any) -> None:
        moved = {name: kwargs.pop(name) for name in [k for k in kwargs if k in MOVED_TO_TUNING]}
        init(self, **kwargs)
        if moved:
            for name in moved:
                _warn_moved(name, stacklevel=3)
            Tuning(**moved)  # checks them now, as the fields were checked
            object.__setattr__(self, "_moved", moved)

    return __init__


EngineConfig.__init__ = _accepting_moved_names(EngineConfig.__init__)  # type: ignore[method-assign]
