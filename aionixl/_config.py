"""Every tunable of an engine, with defaults that suit a server on one host."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal


def _mapping() -> Mapping[str, str]:
    return {}


#: The largest ``coalesce_max_blocks``: a merged request's packed notification carries a
#: message per member at most, and receivers refuse one of more messages than this
#: (``aionixl._wire.MAX_PACKED_MESSAGES``).
MAX_COALESCE_BLOCKS = 1 << 16


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineConfig:
    """Engine settings. All times are in seconds.

    ``transfer_timeout`` is the deadline a ``transfer_blocks`` call gets when it passes
    ``timeout=None``; ``math.inf`` disables it. The polling intervals trade idle CPU for
    latency: the engine polls NIXL every event-loop turn while transfers are in flight, and
    backs off to ``notification_poll_interval`` while someone waits for a notification, and
    to ``idle_poll_interval`` when nothing at all is happening.
    """

    backends: tuple[str, ...] = ("UCX",)
    #: Let NIXL run its own progress thread. Off by default: the engine drives progress.
    nixl_progress_thread: bool = False
    #: Create the agent with NIXL's per-request telemetry and take ``TransferResult``'s
    #: ``post_seconds``, ``transfer_seconds`` and ``descriptors`` from it (NIXL's own timing,
    #: descriptors counted after merging). Off by default: reading it costs about 1.5 us per
    #: transfer (measured; docs/metrics.md); the engine's clock stands in.
    nixl_telemetry: bool = False
    #: Extra compatibility keys (model, dtype, layout...) that must match on both sides.
    compat: Mapping[str, str] = field(default_factory=_mapping)
    #: Refuse peers (``connect``, the listener, ``connect_vllm``) whose bytes per block
    #: differ from ours in any region, with ``IncompatiblePeerError`` (``.field``
    #: ``"bytes_per_block[i]"``). Off by default: such peers are admitted, and parts of
    #: blocks (``aionixl.BlockPart``) move between them; whole blocks of different sizes are
    #: refused per transfer. The region count must match either way.
    require_equal_geometry: bool = False
    transfer_timeout: float = 60.0
    #: How long ``aclose()`` may spend releasing NIXL resources before it reports leaks.
    close_timeout: float = 5.0
    #: How long ``aclose()`` lets this engine's transfers under way finish before it
    #: cancels them (their callers then get ``EngineClosedError``); within ``close_timeout``.
    close_grace: float = 0.5
    #: Notifications kept for nobody-waiting-yet; past it the oldest one is dropped.
    max_pending_notifications: int = 4096
    #: The bytes their messages may hold together, so that a peer sending large ones cannot
    #: grow memory past it; past it the oldest are dropped (the newest is always kept).
    max_pending_notification_bytes: int = 16 << 20
    #: A secret shared by the engines that may connect to each other. When set, every
    #: handshake message carries an HMAC-SHA256 tag of it and messages without the right
    #: tag are refused before anything in them reaches NIXL. Set it wherever untrusted
    #: hosts can reach the listener: NIXL/UCX can crash the process on crafted metadata.
    handshake_secret: bytes | None = field(default=None, repr=False)
    #: Largest handshake message accepted or sent.
    max_handshake_bytes: int = 16 * 1024 * 1024
    #: Extra handshake attempts ``connect()`` makes after one fails (no answer within
    #: ``connect_attempt_timeout``, a NIXL connection error, a peer that is busy or
    #: draining), all within the call's ``timeout``; the pause between attempts starts at
    #: ``connect_backoff`` and doubles up to 1 s. Refusals that cannot change
    #: (incompatible, wrong version, not aionixl) are never retried.
    connect_retries: int = 0
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
    #: Merge concurrent ``transfer_blocks`` calls to one peer with the same op into one
    #: NIXL request when they arrive together (see docs/coalescing.md). A lone
    #: caller never waits for company.
    coalesce: bool = True
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
    #: How ``transfer_blocks(op="read")`` moves data: ``"get"`` (a one-sided NIXL READ),
    #: ``"push"`` (the peer's engine WRITEs the blocks into ours; see docs/read-modes.md),
    #: or ``"auto"``: GET where the path supports it natively (one host with shared memory
    #: allowed on both sides, or RDMA on both), push otherwise (UCX over TCP). Decided per
    #: peer at the handshake; ``Peer.read_mode`` says what was chosen.
    read_mode: Literal["auto", "get", "push"] = "auto"
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
    #: Bytes of staging slots for push reads (one block of every region per slot; at
    #: least one slot, at most 4096 and the engine's blocks; DRAM engines only; 0: none).
    #: A push read lands in these slots and is copied into the caller's blocks once
    #: complete, so no byte of a read that failed can land in them later
    #: (docs/read-modes.md). A round takes at most half of the slots, so larger reads go
    #: in rounds; concurrent push reads share them, first come first served.
    push_staging_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        if not self.backends or not all(isinstance(b, str) and b for b in self.backends):
            raise ValueError("backends must be a non-empty tuple of backend names")
        object.__setattr__(self, "backends", tuple(self.backends))
        for key, text in self.compat.items():
            if not isinstance(key, str) or not isinstance(text, str):
                raise ValueError("compat must map str to str")
        object.__setattr__(self, "compat", dict(self.compat))
        positive: dict[str, float] = {
            "transfer_timeout": self.transfer_timeout,
            "close_timeout": self.close_timeout,
            "close_grace": self.close_grace,
            "idle_poll_interval": self.idle_poll_interval,
            "notification_poll_interval": self.notification_poll_interval,
            "connect_backoff": self.connect_backoff,
            "peer_probe_interval": self.peer_probe_interval,
            "connect_attempt_timeout": self.connect_attempt_timeout,
            "push_cancel_timeout": self.push_cancel_timeout,
        }
        for name, value in positive.items():
            if not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if math.isinf(self.close_timeout):
            raise ValueError("close_timeout must be finite: aclose() is always bounded")
        counts: dict[str, int] = {
            "max_pending_notifications": self.max_pending_notifications,
            "max_pending_notification_bytes": self.max_pending_notification_bytes,
            "max_handshake_bytes": self.max_handshake_bytes,
            "coalesce_max_blocks": self.coalesce_max_blocks,
            "coalesce_max_call_bytes": self.coalesce_max_call_bytes,
            "push_chunk_bytes": self.push_chunk_bytes,
            "max_pushes_per_peer": self.max_pushes_per_peer,
        }
        for name, value in counts.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.coalesce_max_blocks > MAX_COALESCE_BLOCKS:
            raise ValueError(f"coalesce_max_blocks must be at most {MAX_COALESCE_BLOCKS}, "
                             f"got {self.coalesce_max_blocks!r}")
        if not isinstance(self.push_staging_bytes, int) or isinstance(self.push_staging_bytes, bool) \
                or self.push_staging_bytes < 0:
            raise ValueError(f"push_staging_bytes must be an int >= 0, got {self.push_staging_bytes!r}")
        if not isinstance(self.connect_retries, int) or isinstance(self.connect_retries, bool) \
                or self.connect_retries < 0:
            raise ValueError(f"connect_retries must be an int >= 0, got {self.connect_retries!r}")
        if self.handshake_secret is not None and (
                not isinstance(self.handshake_secret, bytes) or len(self.handshake_secret) < 16):
            raise ValueError("handshake_secret must be bytes of at least 16 bytes, or None")
        if not isinstance(self.coalesce_window, (int, float)) or isinstance(self.coalesce_window, bool) \
                or not 0 <= self.coalesce_window < math.inf:
            raise ValueError(f"coalesce_window must be a finite number of seconds >= 0, "
                             f"got {self.coalesce_window!r}")
        if not isinstance(self.require_equal_geometry, bool):
            raise ValueError(f"require_equal_geometry must be a bool, got {self.require_equal_geometry!r}")
        if not isinstance(self.coalesce, bool):
            raise ValueError(f"coalesce must be a bool, got {self.coalesce!r}")
        if self.read_mode not in ("auto", "get", "push"):
            raise ValueError(f"read_mode must be 'auto', 'get' or 'push', got {self.read_mode!r}")
        if math.isinf(self.push_cancel_timeout):
            raise ValueError("push_cancel_timeout must be finite")
        if not isinstance(self.inline_polls, int) or self.inline_polls < 0:
            raise ValueError(f"inline_polls must be an int >= 0, got {self.inline_polls!r}")
