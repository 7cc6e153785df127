"""aionixl as the decode side of a real vLLM NixlConnector prefill worker.

The prefill is vLLM's own connector (``aionixl_contenders.vllm_worker``, a child
process driving it like vLLM's engine loop): its side-channel listener, its NIXL agent, its
lease and notification handling. Bytes are checked against the pattern the worker wrote;
what the prefill saw (notifications, freed requests, lease moves) comes from its events.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
import aionixl.vllm

from .prefill import VllmPrefill, region_matches

pytestmark = pytest.mark.anyio

LAYERS, BLOCKS, PAGE = 4, 64, 32 * 1024  # the worker's defaults: 32 tokens x 4 heads x 64 x K/V x bf16
_ids = itertools.count()


def unique(prefix: str) -> str:
    return f"{prefix}-{os.getpid()}-{next(_ids)}"


def decode_cache(blocks: int = 32, regions: int = LAYERS, page: int = PAGE) -> list[np.ndarray]:
    """One [blocks, page] region per vLLM layer: vLLM's region order and bytes per block."""
    return [np.zeros((blocks, page), dtype=np.uint8) for _ in range(regions)]


@pytest.fixture(scope="module")
def prefill() -> Iterator[VllmPrefill]:
    worker = VllmPrefill(LAYERS, BLOCKS, lease_s=30).start()
    try:
        yield worker
    finally:
        assert worker.stop() == 0


def _no_aionixl_housekeeping(events: list[dict[str, Any]]) -> bool:
    return not any(e.get("event") == "notif" and "aionixl" in e["msg"] for e in events)


async def test_read_from_vllm_prefill_verifies_bytes_and_frees_blocks(prefill: VllmPrefill,
                                                                      anyio_backend: str) -> None:
    req = unique("req")
    prefill.hold(req, lease_s=60)
    local = decode_cache()
    tuning = aionixl.lowlevel.Tuning(peer_probe_interval=0.05)
    async with aionixl.Engine(unique("dec"), local, listen=None, tuning=tuning) as engine:
        peer = await aionixl.vllm.connect(engine, prefill.address, timeout=30)
        assert peer is await aionixl.vllm.connect(engine, prefill.address)  # idempotent
        assert len(peer.regions) == LAYERS and peer.num_blocks == BLOCKS
        remote = [5, 9, 10, 11, 63]
        result = await engine.transfer_blocks(peer, [0, 1, 2, 3, 4], remote, op="read",
                                              notify=aionixl.vllm.read_notification(req))
        assert result.nbytes == 5 * LAYERS * PAGE
        for layer in range(LAYERS):
            assert region_matches(local[layer], layer, [0, 1, 2, 3, 4], remote)
        freed = await prefill.until(lambda e: e.get("event") == "freed" and e["req"] == req, 30)
        assert freed["reason"] == "notified"
        assert any(e.get("event") == "notif" and e["msg"] == f"{req}:1" for e in prefill.events)
        await anyio.sleep(0.3)  # several probe intervals: the vLLM peer must get no probe
    prefill.hold(unique("after-close"), lease_s=60)  # a round trip: the worker read what came
    assert _no_aionixl_housekeeping(prefill.events)  # neither probes nor the goodbye
    assert all(v == 0 for v in engine.live_resources().values())


async def test_geometry_and_compat_hash_are_checked(prefill: VllmPrefill, anyio_backend: str) -> None:
    strict = aionixl.EngineConfig(require_equal_geometry=True)
    cases = [(decode_cache(regions=LAYERS - 1), "region_count", None),
             (decode_cache(page=PAGE // 2), "bytes_per_block[0]", strict)]
    for cache, field, config in cases:
        async with aionixl.Engine(unique("dec"), cache, listen=None, config=config) as engine:
            with pytest.raises(aionixl.IncompatiblePeerError) as info:
                await aionixl.vllm.connect(engine, prefill.address, timeout=30)
            assert info.value.field == field
            assert not engine.peers
    async with aionixl.Engine(unique("dec"), decode_cache(page=PAGE // 2), listen=None) as engine:
        peer = await aionixl.vllm.connect(engine, prefill.address, timeout=30)  # other pages: parts move
        assert peer.bytes_per_block == (PAGE,) * LAYERS
    async with aionixl.Engine(unique("dec"), decode_cache(), listen=None) as engine:
        with pytest.raises(aionixl.IncompatiblePeerError) as info:
            await aionixl.vllm.connect(engine, prefill.address, expect_compat_hash="0" * 64, timeout=30)
        assert info.value.field == "compat_hash"
        peer = await aionixl.vllm.connect(engine, prefill.address, timeout=30,
                                          expect_compat_hash=prefill.ready["compat_hash"])
        assert peer.connected


async def test_nobody_listening_is_a_handshake_error(anyio_backend: str) -> None:
    from .prefill import free_port

    async with aionixl.Engine(unique("dec"), decode_cache(), listen=None) as engine:
        with pytest.raises(aionixl.HandshakeError, match="did not answer"):
            await aionixl.vllm.connect(engine, f"127.0.0.1:{free_port()}", timeout=0.5)


async def test_heartbeat_extends_the_lease(prefill: VllmPrefill, anyio_backend: str) -> None:
    kept, lapsed = unique("kept"), unique("lapsed")
    prefill.hold(kept, lease_s=5)
    prefill.hold(lapsed, lease_s=1)
    async with aionixl.Engine(unique("dec"), decode_cache(), listen=None) as engine:
        peer = await aionixl.vllm.connect(engine, prefill.address, timeout=30)
        await aionixl.vllm.heartbeat(engine, peer, [kept])
        # vLLM moves the lease to now + 2/3 of kv_lease_duration (30 s): about 20 s.
        moved = await prefill.until(lambda e: e.get("event") == "lease" and e["req"] == kept, 30)
        assert moved["remaining_s"] > 10
        assert any(e.get("event") == "notif" and e["msg"] == f"HB:{kept}" for e in prefill.events)
        expired = await prefill.until(lambda e: e.get("event") == "freed" and e["req"] == lapsed, 30)
        assert expired["reason"] == "expired"
        assert not any(e.get("event") == "freed" and e["req"] == kept for e in prefill.events)
        await engine.transfer_blocks(peer, [0], [1], notify=aionixl.vllm.read_notification(kept))
        freed = await prefill.until(lambda e: e.get("event") == "freed" and e["req"] == kept, 30)
        assert freed["reason"] == "notified"


async def test_prefill_killed_mid_read_raises_peer_disconnected(anyio_backend: str) -> None:
    worker = VllmPrefill(LAYERS, BLOCKS).start()
    local = decode_cache()
    try:
        async with aionixl.Engine(unique("dec"), local, listen=None) as engine:
            peer = await aionixl.vllm.connect(engine, worker.address, timeout=30)
            await engine.transfer_blocks(peer, [0, 1], [2, 3])
            assert region_matches(local[2], 2, [0, 1], [2, 3])
            failures: list[BaseException] = []

            async def keep_reading(n: int) -> None:
                ids = list(range(n * 8, n * 8 + 8))
                try:
                    while True:
                        await engine.transfer_blocks(peer, ids, ids, timeout=10)
                except Exception as exc:
                    failures.append(exc)

            async with anyio.create_task_group() as tg:
                for n in range(4):
                    tg.start_soon(keep_reading, n)
                await anyio.sleep(0.3)
                worker.proc.kill()
            assert worker.proc.wait() == -signal.SIGKILL
            assert len(failures) == 4
            assert all(isinstance(f, aionixl.PeerDisconnectedError) for f in failures), failures
            assert not peer.connected
            with pytest.raises(aionixl.PeerDisconnectedError):
                await engine.transfer_blocks(peer, [0], [0])
        assert all(v == 0 for v in engine.live_resources().values())
    finally:
        worker.stop()


async def test_two_decode_ranks_at_tp2_each_read_their_half_of_the_heads_from_a_tp1_prefill(
        prefill: VllmPrefill, anyio_backend: str) -> None:
    """vLLM's LBHNC page is head-major ([heads, tokens, K/V x dim]), so a decode rank at
    twice the prefill's TP reads one contiguous half of every page: what
    ``aionixl.layouts.tp_reads`` says, moved with ``remote_part``."""
    from aionixl._bench._memory import expected_words
    from aionixl.layouts import tp_reads

    req = unique("tp2")
    prefill.hold(req, lease_s=60)
    remote, local = [3, 8, 40, 63], [0, 1, 2, 3]
    halves = [decode_cache(page=PAGE // 2), decode_cache(page=PAGE // 2)]
    async with aionixl.Engine(unique("dec-r0"), halves[0], listen=None) as rank0, \
            aionixl.Engine(unique("dec-r1"), halves[1], listen=None) as rank1:
        for rank, engine in enumerate((rank0, rank1)):
            peer = await aionixl.vllm.connect(engine, prefill.address, timeout=30)
            assert peer.bytes_per_block == (PAGE,) * LAYERS  # admitted with its larger pages
            [read] = tp_reads(1, 2, rank, kv_heads=4, layout="HND")
            assert read.remote_rank == 0 and read.local_part is None
            await engine.transfer_blocks(peer, local, remote, remote_part=read.remote_part,
                                         notify=aionixl.vllm.read_notification(req, consumers=2))
    words = PAGE // 8
    for rank, cache in enumerate(halves):
        for layer in range(LAYERS):
            want = expected_words(layer, np.asarray(remote, dtype=np.int64), words)
            got = cache[layer].view(np.uint64)[local]
            np.testing.assert_array_equal(got, want[:, rank * words // 2:(rank + 1) * words // 2])
    freed = await prefill.until(lambda e: e.get("event") == "freed" and e["req"] == req, 30)
    assert freed["reason"] == "notified"  # after both ranks' notifications
    assert sum(e.get("event") == "notif" and e["msg"] == f"{req}:2" for e in prefill.events) == 2
