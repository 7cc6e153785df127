"""``aionixl.vllm.serve(isolate=True)``: vLLM decoders read from a child process, so that UCX
aborting the process that serves a dead reader's READ (over UCX TCP) spares the engine.

The readers here are aionixl's own vLLM client (the same handshake a vLLM decode worker
makes, real NIXL reads from the child's agent); the real vLLM decode killed mid-read is in
``tests_vllm/test_vllm_serve.py``. The child is killed here with SIGABRT, the signal UCX's
abort raises.
"""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
import aionixl.vllm
from aionixl import _shared, _vllm_sidecar
from aionixl._hostfacts import host_facts
from aionixl._regions import describe_region

from .helpers import numpy_cache, zero_resources

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 32, 4096, 2
SERVE = {"engine_id": "prefill-0", "compat_hash": "c0ffee" * 8, "block_size": 16,
         "kv_cache_layout": "LBHNC", "attn_backend_name": "CPU_ATTN"}


def shared_cache(seed: int) -> list[np.ndarray]:
    """Two regions in one shared buffer (the second at an offset), filled from ``seed``."""
    buf = aionixl.shared_dram(REGIONS * BLOCKS * BLOCK_BYTES)
    buf[:] = np.random.default_rng(seed).integers(0, 256, buf.size, dtype=np.uint8)
    return [buf[i * BLOCKS * BLOCK_BYTES:(i + 1) * BLOCKS * BLOCK_BYTES].reshape(BLOCKS, BLOCK_BYTES)
            for i in range(REGIONS)]


async def read_through(address: str, src: list[np.ndarray], lease: aionixl.Lease, remote: list[int]) -> None:
    """A new aionixl reader reads ``remote`` through the side channel at ``address``;
    bytes compared, and its read-done releases ``lease``."""
    dst = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with aionixl.Engine("reader", dst, listen=None) as decode:
        peer = await aionixl.vllm.connect(decode, address, timeout=10)
        local = list(range(len(remote)))
        done = aionixl.vllm.read_notification(lease.request_id)
        await decode.transfer_blocks(peer, local, remote, notify=done, timeout=10)
        with anyio.fail_after(10):
            await lease.wait()
        assert all(np.array_equal(d[local], s[remote]) for d, s in zip(dst, src, strict=True))
    assert zero_resources(decode)


def gone(pid: int) -> bool:
    """Whether the process ``pid`` and its process group (it leads one) are gone, within
    2 s (a killed grandchild is reaped by init, a moment later)."""
    for _ in range(200):
        try:
            os.killpg(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.01)
    return False


async def test_an_isolated_server_serves_reads_from_a_child_process_and_relays_its_read_done() -> None:
    src = shared_cache(seed=5)
    async with aionixl.Engine("p", src, listen=None) as prefill:
        before = {t.ident for t in threading.enumerate()}
        address = await aionixl.vllm.serve(prefill, **SERVE, isolate=True)
        sidecar = prefill._vllm_server.sidecar
        assert sidecar is not None and sidecar.pid is not None
        pid = sidecar.pid
        reply = await aionixl.vllm.fetch_metadata(address, timeout=10)
        new = [t.name for t in threading.enumerate() if t.ident not in before]
        assert all(name.startswith("Trio thread") for name in new), new  # (the test runner's
        # trio guest mode): the child is watched from the event loop, where asyncio would
        # have watched it with a thread of its own on 3.11
        assert reply.metadata.engine_id == aionixl.vllm.engine_id(prefill)
        assert re.fullmatch(r"prefill-0~[0-9a-f]{8}", reply.metadata.engine_id)
        assert reply.metadata.agent_metadata != aionixl.lowlevel.nixl_metadata(prefill)  # the child's agent
        assert reply.metadata.kv_caches_base_addr != [r.base for r in prefill.regions]
        await read_through(address, src, prefill.lease("req-1", [3, 9, 4]), [3, 9, 4])
        assert prefill.metrics().leases_released == 1
        assert prefill.metrics().vllm_serving_restarts == 0
    assert zero_resources(prefill)
    assert gone(pid)  # stopped and reaped with the engine


async def test_an_aborted_serving_process_is_replaced_under_a_new_engine_id_and_the_engine_goes_on() -> None:
    src = shared_cache(seed=6)
    async with aionixl.Engine("p", src, listen=None) as prefill:
        address = await aionixl.vllm.serve(prefill, **SERVE, isolate=True)
        await read_through(address, src, prefill.lease("before", [1]), [1])
        sidecar = prefill._vllm_server.sidecar
        assert sidecar is not None and sidecar.pid is not None
        first, first_id = sidecar.pid, aionixl.vllm.engine_id(prefill)
        orphan = prefill.lease("orphan", [2], duration=0.5)  # its reader goes with the child
        os.kill(first, signal.SIGABRT)
        with anyio.fail_after(2 * _vllm_sidecar.PING_DEADLINE + 20):
            while aionixl.vllm.engine_id(prefill) in (first_id, None):
                await anyio.sleep(0.01)
        new_id = aionixl.vllm.engine_id(prefill)
        assert new_id is not None and new_id.startswith("prefill-0~")
        assert prefill.metrics().vllm_serving_restarts == 1 and sidecar.pid not in (None, first)
        assert gone(first)
        with pytest.raises(aionixl.LeaseExpiredError):
            await orphan.wait()
        await read_through(address, src, prefill.lease("after", [30, 31]), [30, 31])
        reply = await aionixl.vllm.fetch_metadata(address, timeout=10)
        assert reply.metadata.engine_id == new_id
    assert zero_resources(prefill)


async def test_a_stopped_serving_process_misses_its_liveness_pings_and_is_replaced_within_seconds() -> None:
    """A child that hangs without exiting (SIGSTOP here; stuck in UCX alike) would never be
    noticed by its end: it answers a ping every 0.5 s or is killed and replaced."""
    src = shared_cache(seed=8)
    async with aionixl.Engine("p", src, listen=None) as prefill:
        address = await aionixl.vllm.serve(prefill, **SERVE, isolate=True)
        sidecar = prefill._vllm_server.sidecar
        assert sidecar is not None and sidecar.pid is not None
        first, first_id = sidecar.pid, aionixl.vllm.engine_id(prefill)
        await anyio.sleep(2 * _vllm_sidecar.PING_INTERVAL)  # answering: left alone
        assert sidecar.pid == first and prefill.metrics().vllm_serving_restarts == 0
        os.kill(first, signal.SIGSTOP)
        stopped = anyio.current_time()
        with anyio.fail_after(2 * _vllm_sidecar.PING_DEADLINE + 20):
            while aionixl.vllm.engine_id(prefill) in (first_id, None):
                await anyio.sleep(0.01)
        replaced_in = anyio.current_time() - stopped
        # A ping, its deadline, one more look, then the replacement's start (seconds when loaded).
        assert replaced_in < 2 * _vllm_sidecar.PING_INTERVAL + _vllm_sidecar.PING_DEADLINE + 15, replaced_in
        metrics = prefill.metrics()
        assert metrics.vllm_serving_restarts == 1 and metrics.vllm_serving_unresponsive == 1
        assert gone(first)
        await read_through(address, src, prefill.lease("after", [3]), [3])
    assert zero_resources(prefill)


async def test_closing_while_the_serving_process_starts_stops_it_and_the_call_raises_engine_closed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    slow = tmp_path / "slow-python"  # a child that takes 30 s to start
    slow.write_text(f"#!/bin/sh\nsleep 30\nexec {sys.executable} \"$@\"\n")
    slow.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))
    src = shared_cache(seed=7)
    errors: list[BaseException] = []
    async with anyio.create_task_group() as tg:
        async with aionixl.Engine("p", src, listen=None) as prefill:

            async def serve() -> None:
                try:
                    await aionixl.vllm.serve(prefill, **SERVE, isolate=True)
                except aionixl.EngineClosedError as exc:
                    errors.append(exc)

            tg.start_soon(serve)
            with anyio.fail_after(10):
                while (sidecar := prefill._vllm_server.sidecar) is None or sidecar.pid is None:
                    await anyio.sleep(0.001)
            pid, closing = sidecar.pid, anyio.current_time()
        closed_in = anyio.current_time() - closing
    assert len(errors) == 1 and gone(pid)
    assert closed_in < prefill.config.close_timeout  # half of it for the child, at most
    assert zero_resources(prefill) and aionixl.vllm.engine_id(prefill) is None


async def test_a_serving_child_dies_with_its_engine_process_however_that_dies() -> None:
    """The child is stopped (SIGSTOP: it would never read its stdin's end), then the engine's
    process is SIGKILLed: the kernel's parent-death signal ends the child all the same."""
    here = Path(__file__).resolve().parent.parent
    async with await anyio.open_process([sys.executable, "-m", "tests.isolated_parent"], cwd=here,
                                        stderr=None) as parent:
        assert parent.stdout is not None
        with anyio.fail_after(60):
            line = b""
            while not line.endswith(b"\n"):
                line += await parent.stdout.receive(64)
        child = int(line.split()[-1])
        os.killpg(child, signal.SIGSTOP)  # it runs, in a process group of its own
        parent.kill()
        await parent.wait()
    assert gone(child)


async def test_isolation_needs_shared_dram_and_a_refused_call_leaves_the_engine_free_to_serve(
        caplog: pytest.LogCaptureFixture) -> None:
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill:
        with pytest.raises(ValueError, match=r"shared_dram only; kv_caches\[0\]"):
            await aionixl.vllm.serve(prefill, **SERVE, isolate=True)
        with pytest.raises(ValueError, match="isolate must be a bool"):
            await aionixl.vllm.serve(prefill, **SERVE, isolate=1)  # type: ignore[arg-type]
        assert aionixl.vllm.engine_id(prefill) is None
        with caplog.at_level(logging.WARNING, logger="aionixl"):
            address = await aionixl.vllm.serve(prefill, **SERVE)  # in process
        # On a host without RDMA, decodes elsewhere read over UCX TCP: the log says what to do.
        warned = any("isolate=True" in r.getMessage() for r in caplog.records)
        assert warned == (host_facts()["rdma"] != "1")
        served_id = aionixl.vllm.engine_id(prefill)
        assert served_id is not None and served_id.startswith("prefill-0~")
        assert (await aionixl.vllm.fetch_metadata(address, timeout=10)).metadata.engine_id == served_id


def test_shared_dram_is_zeroed_located_and_forgotten_when_dropped() -> None:
    with pytest.raises(ValueError, match="nbytes"):
        aionixl.shared_dram(0)
    buf = aionixl.shared_dram(1 << 16)
    assert buf.dtype == np.uint8 and buf.shape == (1 << 16,) and not buf.any()
    span = _shared.locate(describe_region(buf.reshape(16, 4096), 0))
    assert span is not None and span.offset == 0
    inner = _shared.locate(describe_region(buf[4096:].reshape(15, 4096), 0))
    assert inner is not None and inner.offset == 4096
    assert _shared.locate(describe_region(numpy_cache(4, 4096, 1)[0], 0)) is None
    base = int(buf.ctypes.data)
    del buf
    gc.collect()
    assert base not in _shared._live
