"""Against a peer engine in another process: real cross-process transfers, and a peer that
stops answering (SIGSTOP) to exercise deadlines, cancellation and closing mid-transfer.

With ``UCX_TLS=tcp`` every transfer needs the target to make progress, so a stopped peer
leaves our transfer in flight for as long as it stays stopped.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl

from .conftest import PeerProcess, numpy_cache, unique, zero_resources

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 32, 8192, 2


async def test_read_and_write_across_processes(peer_process_factory: Any) -> None:
    child: PeerProcess = peer_process_factory(num_blocks=BLOCKS, block_bytes=BLOCK_BYTES,
                                              regions=REGIONS)
    expected = child.expected()
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await eng.connect(child.address, timeout=30)
        assert peer.name == child.name and peer.num_blocks == BLOCKS
        await eng.transfer_blocks(peer, list(range(10)), [31 - i for i in range(10)], notify=b"done")
        for mine, theirs in zip(local, expected, strict=True):
            assert np.array_equal(mine[:10], theirs[31:21:-1])
        # Write a fresh pattern into the child's block 3, read it back into block 20.
        for r in local:
            r[11] = np.arange(BLOCK_BYTES, dtype=np.uint8)
        await eng.transfer_blocks(peer, [11], [3], op="write")
        await eng.transfer_blocks(peer, [20], [3], op="read")
        for r in local:
            assert np.array_equal(r[20], np.arange(BLOCK_BYTES, dtype=np.uint8))
    assert zero_resources(eng)
    assert child.stop() == 0


@pytest.fixture
def stopped_tcp_peer(peer_process_factory: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A TCP-only child engine, plus a context manager that SIGSTOPs it for a while."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    child: PeerProcess = peer_process_factory(num_blocks=8, block_bytes=4 << 20, regions=1,
                                              env={"UCX_TLS": "tcp"})

    class Freezer:
        def __enter__(self) -> None:
            os.kill(child.proc.pid, signal.SIGSTOP)

        def __exit__(self, *exc: object) -> None:
            os.kill(child.proc.pid, signal.SIGCONT)

    yield child, Freezer
    os.kill(child.proc.pid, signal.SIGCONT)


async def _connected(eng: aionixl.Engine, child: PeerProcess) -> aionixl.Peer:
    peer = await eng.connect(child.address, timeout=30)
    await eng.transfer_blocks(peer, [0], [0], timeout=30)  # wire-up done while it runs
    return peer


async def test_timeout_aborts_and_releases_the_handle(stopped_tcp_peer: Any) -> None:
    child, frozen = stopped_tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await _connected(eng, child)
        with frozen():
            start = anyio.current_time()
            with pytest.raises(aionixl.TransferTimeoutError) as info:
                await eng.transfer_blocks(peer, [1, 2, 3, 4], [1, 2, 3, 4], timeout=0.3)
            elapsed = anyio.current_time() - start
            assert isinstance(info.value, TimeoutError)
            assert 0.3 <= elapsed < 2
            assert eng.live_resources()["transfer_handles"] == 0
            assert eng.live_resources()["in_flight"] == 0
        # The peer is alive again: the engine still works with it.
        await eng.transfer_blocks(peer, [5], [5], timeout=30)
        assert np.array_equal(local[0][5], child.expected()[0][5])
    assert zero_resources(eng)


async def test_cancellation_aborts_and_releases_the_handle(stopped_tcp_peer: Any) -> None:
    child, frozen = stopped_tcp_peer
    async with aionixl.Engine(unique("dec"), numpy_cache(8, 4 << 20, 1), listen=None) as eng:
        peer = await _connected(eng, child)
        with frozen():
            with anyio.move_on_after(0.2) as scope:
                await eng.transfer_blocks(peer, [1, 2, 3, 4], [1, 2, 3, 4])
            assert scope.cancelled_caught
            assert eng.live_resources()["transfer_handles"] == 0
            # Cancelling one of several leaves the others alone.
            async with anyio.create_task_group() as tg:
                outcome: dict[str, Any] = {}

                async def run(key: str, timeout: float) -> None:
                    try:
                        await eng.transfer_blocks(peer, [int(key)], [int(key)], timeout=timeout)
                        outcome[key] = "done"
                    except aionixl.TransferTimeoutError:
                        outcome[key] = "timeout"

                tg.start_soon(run, "1", 0.2)
                tg.start_soon(run, "2", 0.6)
                await anyio.sleep(0.05)
                assert eng.live_resources()["in_flight"] == 2
            assert outcome == {"1": "timeout", "2": "timeout"}
            assert eng.live_resources()["transfer_handles"] == 0
    assert zero_resources(eng)


async def test_close_with_transfers_in_flight(stopped_tcp_peer: Any) -> None:
    child, frozen = stopped_tcp_peer
    eng = aionixl.Engine(unique("dec"), numpy_cache(8, 4 << 20, 1), listen=None)
    errors: list[BaseException] = []
    async with eng:
        peer = await _connected(eng, child)
        with frozen():
            async def transfer(i: int) -> None:
                try:
                    await eng.transfer_blocks(peer, [i], [i], timeout=60)
                except aionixl.EngineClosedError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                for i in range(1, 7):
                    tg.start_soon(transfer, i)
                await anyio.sleep(0.1)
                assert eng.live_resources()["in_flight"] == 6
                start = anyio.current_time()
                async with anyio.create_task_group() as closers:
                    closers.start_soon(eng.aclose)
                    closers.start_soon(eng.aclose)
                assert anyio.current_time() - start < 5
    assert len(errors) == 6
    assert zero_resources(eng)
