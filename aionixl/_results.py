"""What a transfer call returns, and the ops it takes."""

from __future__ import annotations

from typing import Literal, NamedTuple

Op = Literal["read", "write"]


class TransferResult(NamedTuple):
    """What one ``transfer_blocks`` call moved."""

    blocks: int
    nbytes: int
    seconds: float
    #: Creating and posting the NIXL request (NIXL's telemetry with ``nixl_telemetry``).
    post_seconds: float = 0.0
    #: From the post until completion was seen (NIXL's telemetry with ``nixl_telemetry``).
    transfer_seconds: float = 0.0
    #: NIXL descriptors (after NIXL merged contiguous ones, with ``nixl_telemetry``;
    #: blocks x regions otherwise).
    descriptors: int = 0
