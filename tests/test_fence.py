"""The fence after an aborted read, over UCX TCP between processes (issue 28, item 4).

- GET (``read_mode="get"`` forced over TCP, where every byte of a GET needs the serving
  process to run): a read aborted while the server is stopped is held until its fence
  confirmed the aborted GET ended; no byte of it lands after the call returned.
- A lone GET whose fence cannot finish (the server stays stopped) evicts the peer at
  ``push_cancel_timeout``: typed error, every record released.
- ``max_pushes_per_peer``: a push read past the cap is refused with a typed error; the
  serving side's counters are back to zero once the reads ended.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl._nixl import Indices
from aionixl.testing import RemoteEngine

from .helpers import engine_pair, numpy_cache, unique, zero_resources

pytestmark = pytest.mark.anyio

#: GET over UCX TCP is emulated and slow here (~50 MB/s): 16 MiB reads.
BLOCKS, BLOCK_BYTES = 16, 1 << 20
GEOMETRY: dict[str, Any] = {"num_blocks": BLOCKS, "block_shape": (BLOCK_BYTES,), "dtypes": ("uint8",)}
TCP = {"UCX_TLS": "tcp"}


def _late(cache: list[np.ndarray], pattern: int) -> int:
    return sum(int(np.count_nonzero(r != pattern)) for r in cache)


def _records(eng: aionixl.Engine) -> dict[str, int]:
    """The white-box tables a transfer, a fence or a push read occupies while it lasts."""
    return {"inflight": len(eng._inflight.records), "parked": len(eng._inflight.parked),
            "peers": len(eng._peers.by_name), "push_reads": len(eng._push.reads),
            "push_jobs": len(eng._push.jobs)}


async def test_get_fence_over_tcp_holds_the_call_until_the_aborted_read_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GET forced over UCX TCP. The server is stopped before a 16 MiB read, which times out
    with nothing moved; its fence (one more small READ on the same endpoint) cannot finish
    before the aborted GET did, so the call returns only after the server ran again and
    the whole aborted read landed. The caller overwrites its blocks at once on return:
    nothing more lands. Without the fence (checked by disabling it) the call returns at its
    deadline and the whole 16 MiB land afterwards."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    local = numpy_cache(BLOCKS, BLOCK_BYTES, 1)
    ids = list(range(BLOCKS))
    config = aionixl.EngineConfig(read_mode="get")
    tuning = aionixl.lowlevel.Tuning(push_cancel_timeout=20.0)
    async with RemoteEngine(seed=4321, env=TCP, **GEOMETRY) as child, \
            aionixl.Engine(unique("dec"), local, listen=None, config=config, tuning=tuning) as eng:
        peer = await eng.connect(child.address, timeout=30)
        assert peer.read_mode == "get"
        await eng.transfer_blocks(peer, ids, ids, timeout=30)  # the connection is wired up
        local[0][:] = 0
        errors: list[BaseException] = []
        returned: list[float] = []

        async def read() -> None:
            try:
                await eng.transfer_blocks(peer, ids, ids, timeout=0.3)
            except aionixl.TransferTimeoutError as exc:
                errors.append(exc)
            local[0][:] = 0x5A  # no checkpoint between the return and this
            returned.append(anyio.current_time())

        try:
            async with anyio.create_task_group() as tg:
                await child.pause()
                tg.start_soon(read)
                await anyio.sleep(1.0)  # the deadline passed; the fence is waiting
                held = not returned
                resumed = anyio.current_time()
                await child.resume()
        finally:
            await child.resume()
        await anyio.sleep(1.0)  # the engine keeps progressing meanwhile
        late = _late(local, 0x5A)
        assert len(errors) == 1 and isinstance(errors[0], aionixl.TransferTimeoutError), errors
        assert late == 0, f"{late} bytes landed after the aborted read returned"
        assert held and returned[0] >= resumed, "the call returned before its fence could end"
        assert peer.connected and eng.metrics().fence_evictions == 0
        assert _records(eng) == {"inflight": 0, "parked": 0, "peers": 1, "push_reads": 0,
                                 "push_jobs": 0}
        assert eng.live_resources()["transfer_handles"] == 0
        await eng.transfer_blocks(peer, ids, ids, timeout=30)
        assert np.array_equal(local[0], child.expected()[0].numpy())
        assert child.running
    assert zero_resources(eng)


async def test_a_lone_get_whose_fence_times_out_evicts_the_peer(monkeypatch: pytest.MonkeyPatch) -> None:
    """GET forced over UCX TCP; the server is stopped and stays so. A lone read times out,
    and its fence cannot finish: at push_cancel_timeout the peer is evicted (its NIXL
    connection, which the aborted read would write over, is closed). The caller gets the
    typed timeout, within the deadline plus push_cancel_timeout; the aborted read's and the
    fence's records and handles are released, and the peer is gone from the tables."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    local = numpy_cache(BLOCKS, BLOCK_BYTES, 1)
    ids = list(range(BLOCKS))
    config = aionixl.EngineConfig(read_mode="get")
    tuning = aionixl.lowlevel.Tuning(push_cancel_timeout=0.5)
    async with RemoteEngine(seed=4322, env=TCP, **GEOMETRY) as child, \
            aionixl.Engine(unique("dec"), local, listen=None, config=config, tuning=tuning) as eng:
        peer = await eng.connect(child.address, timeout=30)
        assert peer.read_mode == "get"
        await eng.transfer_blocks(peer, [0, 1], [0, 1], timeout=30)
        assert _records(eng) == {"inflight": 0, "parked": 0, "peers": 1, "push_reads": 0,
                                 "push_jobs": 0}
        await child.pause()
        try:
            fenced: list[int] = []
            real_fence = eng._direct.fence

            async def fence(peer: aionixl.Peer, local_idx: Indices, remote_idx: Indices,
                            parts: Any = None) -> None:
                fenced.append(len(eng._inflight.records))
                await real_fence(peer, local_idx, remote_idx, parts)

            eng._direct.fence = fence  # type: ignore[method-assign]
            start = time.perf_counter()  # the engine's clock (uvloop's moves in whole ms)
            with anyio.fail_after(10), pytest.raises(aionixl.TransferTimeoutError) as info:
                await eng.transfer_blocks(peer, ids, ids, timeout=0.3)
            elapsed = time.perf_counter() - start
            assert "did not finish within 0.3 s" in str(info.value)
            assert fenced == [0], fenced  # fenced once, after the read's record was taken out
            assert 0.75 <= elapsed < 4.0, elapsed  # the deadline (0.3 s), then push_cancel_timeout
            assert not peer.connected and eng.peers.get(peer.name) is None
            metrics = eng.metrics()
            assert metrics.fence_evictions == 1 and metrics.peers_evicted == 1
            assert eng.metrics().evictions.get("transfer_error") == 1, eng.metrics().evictions
            with anyio.fail_after(5):  # a handle NIXL would not release yet is retried
                while eng._inflight.parked:
                    await anyio.sleep(0.01)
            assert _records(eng) == {"inflight": 0, "parked": 0, "peers": 0, "push_reads": 0,
                                     "push_jobs": 0}
            live = eng.live_resources()
            assert live["transfer_handles"] == 0 and live["in_flight"] == 0, live
        finally:
            # Stopped, it answers nothing: killed rather than resumed (over TCP, a GET
            # server whose reader went mid-read may abort: docs/read-modes.md).
            await child.kill()
    assert zero_resources(eng)


async def test_a_push_read_past_max_pushes_per_peer_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two engines in one process over UCX TCP (push reads), the server capped at two open
    pushes per peer and writing one 16 KiB block per chunk. With two long reads under way
    (the server counts both), a third is refused at once with a plain TransferError that
    says why; the two finish with exact bytes; then the server's per-peer count, its jobs
    and the reader's open reads are all back to zero, and the next read is served."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    blocks, block_bytes = 256, 16 << 10
    src_cache = numpy_cache(blocks, block_bytes, 1, seed=5)
    dst_cache = numpy_cache(blocks, block_bytes, 1)
    # No staging slots: the two reads would take all 256 (as many as the engine has
    # blocks), and the reader would hold the third back itself, never asking the server.
    config = aionixl.EngineConfig(read_mode="push", push_staging_bytes=0)
    tuning = aionixl.lowlevel.Tuning(push_chunk_bytes=block_bytes, max_pushes_per_peer=2, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, config, tuning=tuning) as (src, dst, peer):
        assert peer.read_mode == "push"
        await dst.transfer_blocks(peer, [0, 1], [0, 1], timeout=20)  # wired up
        half = blocks // 2
        first, second = list(range(half)), list(range(half, blocks))
        results: list[aionixl.TransferResult] = []

        async def read(ids: list[int]) -> None:
            results.append(await dst.transfer_blocks(peer, ids, ids[::-1], timeout=30))

        async with anyio.create_task_group() as tg:
            tg.start_soon(read, first)
            tg.start_soon(read, second)
            with anyio.fail_after(10):
                while src._push._per_peer.get(dst.name, 0) < 2:
                    await anyio.sleep(0)
            assert src._push._per_peer == {dst.name: 2} and len(src._push.jobs) == 2
            with anyio.fail_after(10), pytest.raises(aionixl.TransferError) as info:
                await dst.transfer_blocks(peer, [0, 1], [2, 3], timeout=20)
            assert type(info.value) is aionixl.TransferError, repr(info.value)
            assert "busy: 2 reads of this peer are already under way" in str(info.value)
            assert src.metrics().pushes_refused == 1
            assert not results, "a read ended before the third was refused: the cap was not full"
        assert len(results) == 2 and all(r.blocks == half for r in results)
        assert np.array_equal(dst_cache[0][:half], src_cache[0][:half][::-1])
        assert np.array_equal(dst_cache[0][half:], src_cache[0][half:][::-1])
        with anyio.fail_after(5):  # the server counts a push out once its last write is DONE
            while src._push._per_peer or src._push.jobs:
                await anyio.sleep(0.01)
        assert src._push._per_peer == {} and src._push.jobs == {} and dst._push.reads == {}
        assert src.metrics().pushes_served == 3  # the wire-up read and the two
        assert src.live_resources()["in_flight"] == 0 and dst.live_resources()["in_flight"] == 0
        await dst.transfer_blocks(peer, [0, 1], [2, 3], timeout=20)  # served again
        assert np.array_equal(dst_cache[0][:2], src_cache[0][2:4])
    assert zero_resources(src) and zero_resources(dst)
