"""CUDA regions register as VRAM and move like DRAM ones. Skipped where no GPU is present."""

from __future__ import annotations

import pytest
import torch

import aionixl

from .helpers import engine_pair

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_vram_to_vram_and_host_to_device(anyio_backend: str) -> None:
    src = torch.randn(2, 8, 16, 64, device="cuda", dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    async with engine_pair([src[0], src[1]], [dst[0], dst[1]]) as (listener, eng, peer):
        assert {r.mem_type for r in eng.regions} == {"VRAM"}
        await eng.transfer_blocks(peer, [0, 1], [6, 7])
        torch.cuda.synchronize()
        assert torch.equal(dst[:, :2], src[:, 6:8])
    host = torch.zeros(2, 8, 16, 64, dtype=torch.bfloat16)
    async with engine_pair([src[0], src[1]], [host[0], host[1]]) as (_, eng, peer):
        await eng.transfer_blocks(peer, [3], [5])
        assert torch.equal(host[:, 3], src[:, 5].cpu())
    assert isinstance(listener, aionixl.Engine)
