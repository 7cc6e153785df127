"""The public exception hierarchy.

Flat and specific: callers catch the class that names what went wrong. Low-level
errors (NIXL, zmq, msgspec) never escape raw; they ride along as ``__cause__``.
The mapping from NIXL's exceptions to these classes lives in ``_nixl``.
"""

from __future__ import annotations


class AionixlError(Exception):
    """Base class of every error aionixl raises on purpose."""


class ListenError(AionixlError):
    """The handshake endpoint could not be bound."""


class UnprotectedListenerError(ListenError, ValueError):
    """Refused before binding: a listener other hosts could reach, without authentication
    (protected mode). A ``ValueError`` (the arguments are the cause) and a ``ListenError``
    (the listener did not start), so callers catching either see it."""


class HandshakeError(AionixlError):
    """Connecting to a peer failed: nobody answered in time, or the reply was unusable."""


class IncompatiblePeerError(HandshakeError):
    """The peer answered, but its KV-cache geometry or compat settings differ from ours.

    ``field`` names what differs (for example ``"region_count"`` or ``"bytes_per_block[2]"``).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class TransferError(AionixlError):
    """A block transfer failed."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A block transfer did not finish before its deadline; its NIXL handle was released."""


class PeerDisconnectedError(TransferError):
    """The peer went away (NIXL reported a disconnect) while or before we talked to it."""


class EngineClosedError(AionixlError):
    """The engine is closed, or closed while the call was waiting."""


class DiscoveryError(AionixlError):
    """Discovery failed: the registry (etcd) did not answer in time or refused, no engine of
    that name registered in time, or the name is held by a live engine already."""


def same_kind(error: BaseException, message: str) -> Exception:
    """A fresh error of the same public kind, for callers that shared a failed handshake."""
    if isinstance(error, IncompatiblePeerError):
        return IncompatiblePeerError(message, field=error.field)
    if isinstance(error, ValueError):
        return ValueError(message)
    if isinstance(error, EngineClosedError):
        return EngineClosedError(message)
    return HandshakeError(message)
