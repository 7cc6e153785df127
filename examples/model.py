"""A tiny decoder-only transformer with a paged KV cache, shared by both example servers.

The weights are seeded random numbers: the point is not good text but a model whose output
depends on every cached key and value, so that a block moved to the wrong place, or moved
short, changes the generated tokens. Tokens are bytes (vocabulary of 256), decoding is greedy.

Prefill and each decode step go through one function, :meth:`TinyDecoder.forward`: it
writes the new positions' keys and values into the paged cache, then attends over keys and
values gathered back from the cache in position order. Because the gathered tensor does
not depend on which physical blocks hold the positions, a sequence prefilled in one
process and continued in another computes exactly what a single process computes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of the model and of its KV cache; both servers must use the same one."""

    vocab_size: int = 256
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 2
    d_ff: int = 256
    block_size: int = 16
    max_positions: int = 512
    seed: int = 20261202

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def fingerprint(self) -> str:
        """A compact description that goes into the engines' compat keys."""
        return ",".join(f"{k}={v}" for k, v in asdict(self).items())


def pick_device(name: str = "auto") -> torch.device:
    """``auto``: CUDA when torch sees a GPU, else CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def setup_torch() -> None:
    """One intra-op thread: small ops gain nothing from more, and every process (servers and
    the single-process reference) then computes with the same reduction order."""
    torch.set_num_threads(1)


class TinyDecoder:
    """Pre-norm transformer blocks (attention + GELU MLP), learned positions, untied head."""

    def __init__(self, config: ModelConfig | None = None, device: torch.device | str = "cpu") -> None:
        self.config = cfg = config or ModelConfig()
        if cfg.d_model % cfg.n_heads:
            raise ValueError("d_model must be a multiple of n_heads")
        self.device = torch.device(device)
        # Drawn on the CPU from one seeded generator, then moved: the same weights on any device.
        gen = torch.Generator().manual_seed(cfg.seed)

        def param(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * scale).to(self.device)

        d = cfg.d_model
        self.tok_emb = param(cfg.vocab_size, d, scale=1.0)
        self.pos_emb = param(cfg.max_positions, d, scale=0.5)
        self.layers: list[dict[str, torch.Tensor]] = [
            {
                "wqkv": param(d, 3 * d, scale=1 / math.sqrt(d)),
                "wo": param(d, d, scale=1 / math.sqrt(d)),
                "w1": param(d, cfg.d_ff, scale=1 / math.sqrt(d)),
                "w2": param(cfg.d_ff, d, scale=1 / math.sqrt(cfg.d_ff)),
            }
            for _ in range(cfg.n_layers)
        ]
        self.head = param(d, cfg.vocab_size, scale=1 / math.sqrt(d))

    # ---- the paged cache ----------------------------------------------------------------

    def new_cache(self, num_blocks: int) -> torch.Tensor:
        """[layers, 2 (K, V), num_blocks, block_size, heads, head_dim], float32, zeroed."""
        cfg = self.config
        return torch.zeros(cfg.n_layers, 2, num_blocks, cfg.block_size, cfg.n_heads, cfg.head_dim,
                           dtype=torch.float32, device=self.device)

    @staticmethod
    def cache_regions(cache: torch.Tensor) -> list[torch.Tensor]:
        """One engine region per layer and K/V: views whose first dimension indexes blocks."""
        return [cache[layer, kv] for layer in range(cache.shape[0]) for kv in range(2)]

    def blocks_for(self, positions: int) -> int:
        """Blocks needed to hold ``positions`` cached positions."""
        return -(-positions // self.config.block_size)

    # ---- compute ------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, tokens: Sequence[int], start: int, cache: torch.Tensor,
                blocks: Sequence[int]) -> torch.Tensor:
        """Logits for ``tokens`` at positions ``start...``; caches their K/V in ``blocks``.

        ``blocks[i]`` is the physical block holding positions ``i*block_size`` onwards;
        positions ``0..start-1`` must already be in the cache.
        """
        cfg = self.config
        count = len(tokens)
        end = start + count
        if count == 0 or start < 0 or end > cfg.max_positions:
            raise ValueError(f"positions {start}..{end} outside 0..{cfg.max_positions}")
        if self.blocks_for(end) > len(blocks):
            raise ValueError(f"{len(blocks)} blocks cannot hold {end} positions")
        dev = self.device
        table = torch.tensor(list(blocks), dtype=torch.long, device=dev)
        new_pos = torch.arange(start, end, device=dev)
        all_pos = torch.arange(end, device=dev)
        new_block, new_slot = table[new_pos // cfg.block_size], new_pos % cfg.block_size
        all_block, all_slot = table[all_pos // cfg.block_size], all_pos % cfg.block_size
        visible = all_pos[None, :] <= new_pos[:, None]  # [count, end]: causal
        x = self.tok_emb[torch.tensor(list(tokens), dtype=torch.long, device=dev)] + self.pos_emb[new_pos]
        h, hd = cfg.n_heads, cfg.head_dim
        for i, w in enumerate(self.layers):
            y = F.layer_norm(x, (cfg.d_model,))
            q, k, v = torch.split(y @ w["wqkv"], cfg.d_model, dim=-1)
            k_cache, v_cache = cache[i, 0], cache[i, 1]
            k_cache[new_block, new_slot] = k.reshape(count, h, hd)
            v_cache[new_block, new_slot] = v.reshape(count, h, hd)
            keys = k_cache[all_block, all_slot].transpose(0, 1)  # [heads, end, head_dim]
            values = v_cache[all_block, all_slot].transpose(0, 1)
            scores = q.reshape(count, h, hd).transpose(0, 1) @ keys.transpose(1, 2) / math.sqrt(hd)
            attn = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1) @ values
            x = x + attn.transpose(0, 1).reshape(count, cfg.d_model) @ w["wo"]
            y = F.layer_norm(x, (cfg.d_model,))
            x = x + F.gelu(y @ w["w1"]) @ w["w2"]
        return F.layer_norm(x, (cfg.d_model,)) @ self.head

    def prefill(self, tokens: Sequence[int], cache: torch.Tensor, blocks: Sequence[int]) -> int:
        """Cache the prompt's K/V in ``blocks``; return the first generated token (greedy)."""
        return int(self.forward(tokens, 0, cache, blocks)[-1].argmax())

    def decode_step(self, token: int, position: int, cache: torch.Tensor, blocks: Sequence[int]) -> int:
        """Feed ``token`` at ``position`` (earlier positions cached); return the next token."""
        return int(self.forward([token], position, cache, blocks)[-1].argmax())


def generate_reference(model: TinyDecoder, tokens: Sequence[int], max_new_tokens: int) -> list[int]:
    """The single-process answer the servers must reproduce token for token.

    Uses its own cache, with the blocks in reverse order so that nothing depends on
    physical block ids.
    """
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    nblocks = model.blocks_for(len(tokens) + max_new_tokens - 1)
    cache = model.new_cache(nblocks)
    blocks = list(range(nblocks))[::-1]
    out = [model.prefill(tokens, cache, blocks)]
    for step in range(max_new_tokens - 1):
        out.append(model.decode_step(out[-1], len(tokens) + step, cache, blocks))
    return out


def encode(text: str) -> list[int]:
    """Byte-level tokens."""
    return list(text.encode())


def decode(tokens: Sequence[int]) -> str:
    return bytes(tokens).decode(errors="replace")
