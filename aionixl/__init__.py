"""aionixl: an asyncio/trio-native KV-cache block transfer engine over NVIDIA NIXL.

    async with aionixl.Engine("decode-0", kv_caches=[k, v]) as engine:
        peer = await engine.connect("tcp://prefill-host:5555")
        await engine.transfer_blocks(peer, [0, 1], [7, 8], op="read", notify=b"req-7")
"""

from ._config import EngineConfig
from ._discovery import Discovery, DiscoveryEvent, EngineRecord, EtcdDiscovery
from ._engine import Engine, Peer, TransferResult
from ._errors import (
    AionixlError,
    DiscoveryError,
    EngineClosedError,
    HandshakeError,
    IncompatiblePeerError,
    ListenError,
    PeerDisconnectedError,
    TransferError,
    TransferTimeoutError,
    UnprotectedListenerError,
)
from ._leases import Lease, LeaseCancelledError, LeaseExpiredError, read_done
from ._notifications import Notification
from ._parts import BlockPart
from ._regions import Region
from ._shared import shared_dram

__all__ = [
    "AionixlError",
    "BlockPart",
    "Discovery",
    "DiscoveryError",
    "DiscoveryEvent",
    "Engine",
    "EngineClosedError",
    "EngineConfig",
    "EngineRecord",
    "EtcdDiscovery",
    "HandshakeError",
    "IncompatiblePeerError",
    "Lease",
    "LeaseCancelledError",
    "LeaseExpiredError",
    "ListenError",
    "Notification",
    "Peer",
    "PeerDisconnectedError",
    "Region",
    "TransferError",
    "TransferResult",
    "TransferTimeoutError",
    "UnprotectedListenerError",
    "read_done",
    "shared_dram",
]

__version__ = "0.1.0"
