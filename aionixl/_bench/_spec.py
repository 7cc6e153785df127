"""What one ``aionixl bench`` run measures, and how much of it: the default and ``--quick``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

MiB = 1 << 20


def _seq_default() -> dict[int, int]:
    return {1: 3000, 16: 300, 256: 12}


class KVShape:
    """A cache of ``layers`` x K and V regions of ``block_bytes`` per block (both workloads)."""

    __slots__ = ()
    layers: int
    block_bytes: int

    @property
    def regions(self) -> int:
        return 2 * self.layers

    @property
    def bytes_per_block_id(self) -> int:
        return self.regions * self.block_bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class Spec(KVShape):
    """Sizes and counts. Times in seconds."""

    layers: int = 4
    blocks: int = 1024
    block_bytes: int = 16 * 1024
    device: str = "cpu"
    #: Repeats of each timed loop; medians and spread are over these.
    repeats: int = 9
    #: Transfers per repeat for each sequential size (blocks per transfer -> count).
    seq: dict[int, int] = field(default_factory=_seq_default)
    #: Sizes also measured with scattered (random, distinct) block ids.
    scattered: tuple[int, ...] = (16, 256)
    inflight: tuple[int, ...] = (64, 256, 1024)
    #: The head-slice rows (``seq_1_part``): each read moves part ``r`` of ``tp_ratio``
    #: equal parts of one block id (a decode rank's heads at that TP ratio), ``spec.seq[1]``
    #: reads per repeat.
    tp_ratio: int = 2
    bulk_bytes: int = 16 * MiB
    bulk_count: int = 20
    connect_count: int = 20
    peers: int = 8
    close_inflight: int = 64
    close_blocks: int = 16  # blocks per transfer in flight at close
    close_repeats: int = 3
    wake_count: int = 200
    idle_windows: int = 3
    idle_window_s: float = 0.5
    idle_settle_s: float = 0.5
    lag_workers: int = 64
    lag_window_s: float = 0.4
    lag_windows: int = 3
    lag_tick_s: float = 0.001
    #: The threaded model's engine step (its transfers are polled once per step).
    step_s: float = 0.001
    #: Per repeat, the threaded model runs at most this long in a sequential loop.
    threaded_repeat_budget_s: float = 0.1
    #: One-block reads timed one by one per repeat (p50/p90/p99 rows; --with-vllm runs).
    lat_count: int = 500
    #: --with-vllm: one-block reads per repeat by the vLLM decode, ``spaced_gap_s`` apart,
    #: from each prefill that serves it (vLLM's own, aionixl.vllm.serve in process, isolated).
    spaced_count: int = 60
    spaced_gap_s: float = 0.01
    #: --with-vllm: vLLM's real NixlConnector as a contender (and the rows only it has).
    with_vllm: bool = False
    #: Tokens per vLLM block (vLLM's CPU attention backend needs a multiple of 32).
    vllm_block_tokens: int = 32
    #: The vLLM model's head dimension; its KV heads follow from --block-bytes.
    vllm_head_dim: int = 64
    quick: bool = False

    @property
    def slow_tls(self) -> str:
        """UCX_TLS for the measures that need transfers to stay in flight (close, wake):
        tcp only, plus cuda_copy on GPUs so that VRAM can be staged through the host."""
        return "tcp,cuda_copy" if self.device == "cuda" else "tcp"

    @property
    def vllm_kv_heads(self) -> int:
        """KV heads of the vLLM model whose page (K and V of one block, bf16) is
        ``block_bytes``: block_bytes = tokens x heads x head_dim x 2 (K, V) x 2 bytes."""
        return self.block_bytes // (self.vllm_block_tokens * self.vllm_head_dim * 4)

    @property
    def bulk_blocks(self) -> int:
        return max(1, self.bulk_bytes // self.bytes_per_block_id)

    def problems(self) -> list[str]:
        out = []
        if self.layers < 1 or self.blocks < 1 or self.block_bytes < 8 or self.block_bytes % 8:
            # Every other check divides by these.
            return ["--layers and --blocks must be >= 1, --block-bytes a multiple of 8"]
        if self.repeats < 1:
            out.append("--repeats must be at least 1")
        if self.tp_ratio < 1 or self.block_bytes % (8 * self.tp_ratio):
            out.append(f"--block-bytes must be a multiple of {8 * max(1, self.tp_ratio)} "
                       f"(the head-slice rows read 1/{self.tp_ratio} of a block)")
        need = max([*self.seq, *self.scattered, *self.inflight, self.bulk_blocks, self.close_blocks,
                    self.lag_workers])
        if self.blocks < need:
            out.append(f"--blocks must be at least {need} for this run (1024 in flight, 256-block "
                       "transfers, 16 MiB transfers)")
        if self.peers < 1:
            out.append("--peers must be at least 1")
        if not 0 <= self.step_s < math.inf:
            out.append("--step-ms must be a finite number >= 0")
        if self.with_vllm:
            unit = self.vllm_block_tokens * self.vllm_head_dim * 4
            if self.block_bytes % unit or self.vllm_kv_heads < 1:
                out.append(f"--with-vllm needs --block-bytes a multiple of {unit} (vLLM's page: "
                           f"{self.vllm_block_tokens} tokens x KV heads x head dim "
                           f"{self.vllm_head_dim} x K/V x bf16)")
            if self.device != "cpu":
                out.append("--with-vllm runs vLLM's CPU build: DRAM only (no --device cuda)")
        return out


def default_spec() -> Spec:
    return Spec()


def quick_spec() -> Spec:
    """CI-sized: same shapes and measures, fewer repeats and shorter windows."""
    return replace(Spec(), repeats=3, seq={1: 600, 16: 60, 256: 4}, bulk_count=6, connect_count=8,
                   close_repeats=1, wake_count=60, idle_windows=2, idle_window_s=0.25,
                   idle_settle_s=0.3, lag_window_s=0.2, lag_windows=1,
                   threaded_repeat_budget_s=0.04, lat_count=150, spaced_count=30, quick=True)
