"""Against a peer engine in another process: real cross-process transfers, and a peer that
stops answering (SIGSTOP) to exercise deadlines, cancellation and closing mid-transfer.

With ``UCX_TLS=tcp`` every transfer needs the target to make progress, so a stopped peer
leaves our transfer in flight for as long as it stays stopped.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl

from .conftest import HERE, PeerProcess, numpy_cache, unique, zero_resources

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
    """A stopped peer cannot confirm that nothing more of the read will land (push mode, the
    default over TCP), so the reader evicts it push_cancel_timeout after the deadline."""
    child, frozen = stopped_tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    config = aionixl.EngineConfig(push_cancel_timeout=0.3)
    async with aionixl.Engine(unique("dec"), local, listen=None, config=config) as eng:
        peer = await _connected(eng, child)
        assert peer.read_mode == "push"
        with frozen():
            start = anyio.current_time()
            with pytest.raises(aionixl.TransferTimeoutError) as info:
                await eng.transfer_blocks(peer, [1, 2, 3, 4], [1, 2, 3, 4], timeout=0.3)
            elapsed = anyio.current_time() - start
            assert isinstance(info.value, TimeoutError)
            assert 0.6 <= elapsed < 2.5
            assert eng.live_resources()["transfer_handles"] == 0
            assert eng.live_resources()["in_flight"] == 0
            assert not peer.connected and eng.stats()["fence_evictions"] == 1
        # The peer is alive again: connect() reaches it and reads work.
        peer = await eng.connect(child.address, timeout=30)
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
            assert eng.live_resources()["in_flight"] == 0
            assert not peer.connected  # unconfirmed: evicted (see the test above)
        peer = await _connected(eng, child)
        with frozen():
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


async def test_killed_peer_is_evicted_and_a_restart_on_its_port_is_reachable(
        peer_process_factory: Any) -> None:
    """SIGKILL the peer mid-read: typed error within a second, the peer evicted with all its
    NIXL state, other peers unaffected; the peer restarts (same name, same port, other data)
    and a new connect() reads the new incarnation's bytes."""
    name = unique("prefill")
    shape = {"num_blocks": BLOCKS, "block_bytes": 1 << 16, "regions": REGIONS}
    first: PeerProcess = peer_process_factory(seed=1, name=name, **shape)
    bystander: PeerProcess = peer_process_factory(seed=3, **shape)
    local = numpy_cache(BLOCKS, 1 << 16, REGIONS)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await eng.connect(first.address, timeout=30)
        other = await eng.connect(bystander.address, timeout=30)
        failures: list[tuple[BaseException, float]] = []
        killed_at: list[float] = []

        async def keep_reading(worker: int) -> None:
            ids = list(range(worker * 8, worker * 8 + 8))
            try:
                while True:
                    await eng.transfer_blocks(peer, ids, ids, timeout=10)
            except Exception as exc:
                failures.append((exc, anyio.current_time()))

        async with anyio.create_task_group() as tg:
            for worker in range(4):
                tg.start_soon(keep_reading, worker)
            await anyio.sleep(0.3)
            killed_at.append(anyio.current_time())
            first.proc.kill()
        assert first.proc.wait() == -signal.SIGKILL
        assert len(failures) == 4
        for exc, when in failures:
            assert isinstance(exc, aionixl.PeerDisconnectedError), repr(exc)
            assert when - killed_at[0] < 1.0
        # Evicted: gone from peers, its descriptors and remote agent released.
        assert not peer.connected and name not in eng.peers
        live = eng.live_resources()
        assert live["remote_agents"] == 1 and live["dlists"] == 2  # ours + the bystander's
        assert live["transfer_handles"] == 0 and live["in_flight"] == 0
        assert eng.stats()["peers_evicted"] == 1
        with pytest.raises(aionixl.PeerDisconnectedError, match="connect"):
            await eng.transfer_blocks(peer, [0], [0])
        # Everyone else carries on.
        await eng.transfer_blocks(other, [0, 1], [5, 6])
        assert np.array_equal(local[1][:2], bystander.expected()[1][5:7])

        second: PeerProcess = peer_process_factory(seed=2, name=name, listen=first.address, **shape)
        again = await eng.connect(first.address, timeout=30)
        assert again is not peer and again.connected and eng.peers[name] is again
        await eng.transfer_blocks(again, list(range(BLOCKS)), list(range(BLOCKS)))
        for mine, theirs in zip(local, second.expected(), strict=True):
            assert np.array_equal(mine, theirs)
        assert eng.live_resources()["remote_agents"] == 2
    assert zero_resources(eng)


def test_closing_with_transfers_in_flight_to_a_live_peer_prints_no_ucx_warnings() -> None:
    """Cancelling UCX transfers that are moving data and destroying the agent at once makes
    UCX warn ("was not returned to mpool", "not flushed"); close lets them finish first."""
    env = {**os.environ, "UCX_TLS": "tcp"}
    run = subprocess.run([sys.executable, "-m", "tests.close_check"], cwd=HERE.parent, env=env,
                         capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    report = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    assert report["in_flight_at_close"] > 0, report  # the close really met transfers under way
    assert sum(report["outcomes"].values()) == 64
    assert all(v == 0 for v in report["resources"].values()), report
    warnings = [line for line in output.splitlines() if "UCX  WARN" in line or "UCX  ERROR" in line]
    assert warnings == []


async def test_drain_waits_for_transfers_under_way(stopped_tcp_peer: Any) -> None:
    child, frozen = stopped_tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await _connected(eng, child)
        done: list[aionixl.TransferResult] = []
        async with anyio.create_task_group() as tg:
            with frozen():
                async def read() -> None:
                    done.append(await eng.transfer_blocks(peer, [2, 3], [6, 7], timeout=30))

                tg.start_soon(read)
                await anyio.sleep(0.1)
                assert await eng.drain(timeout=0.3) is False  # the peer is stopped
                assert eng.live_resources()["in_flight"] == 1
            assert await eng.drain(timeout=20) is True
            assert eng.live_resources()["in_flight"] == 0
        assert len(done) == 1
        assert np.array_equal(local[0][2:4], child.expected()[0][6:8])
    assert zero_resources(eng)


@pytest.mark.parametrize("direction", ["outbound", "inbound"])
async def test_a_peer_that_dies_while_idle_is_found_by_the_probe(peer_process_factory: Any,
                                                                 direction: str) -> None:
    """No transfer needs to fail: the liveness probe notices the death and evicts the peer,
    on the connecting side and on the listening side (where stale peers would pile up)."""
    config = aionixl.EngineConfig(peer_probe_interval=0.2)
    async with aionixl.Engine(unique("eng"), numpy_cache(4, 4096, 1), config=config) as eng:
        if direction == "outbound":
            child: PeerProcess = peer_process_factory(num_blocks=4, block_bytes=4096, regions=1)
            await eng.connect(child.address, timeout=30)
        else:
            assert eng.address is not None
            child = peer_process_factory(num_blocks=4, block_bytes=4096, regions=1,
                                         connect=eng.address)
        with anyio.fail_after(10):
            while child.name not in eng.peers:
                await anyio.sleep(0.01)
        await anyio.sleep(0.5)
        assert child.name in eng.peers  # probes of a live peer change nothing
        assert eng.stats()["notifications_kept"] == 0  # nor do they reach anyone's mailbox
        child.proc.kill()
        child.proc.wait()
        with anyio.fail_after(5):
            while child.name in eng.peers:
                await anyio.sleep(0.02)
        assert eng.stats()["peers_evicted"] == 1
        live = eng.live_resources()
        assert live["remote_agents"] == 0 and live["dlists"] == 1  # only our own
    assert zero_resources(eng)


@pytest.mark.parametrize("transport", ["default", "tcp"])
async def test_a_killed_client_restarted_under_its_name_replaces_the_old_one_at_once(
        peer_process_factory: Any, transport: str) -> None:
    """The old incarnation died without a goodbye and no probe has run yet: the listener
    drops it and loads the new one in one step (NIXL's remove_remote_agent followed at once
    by add_remote_agent for the same name), and both directions work with the new one."""
    env = {"UCX_TLS": "tcp"} if transport == "tcp" else {}
    config = aionixl.EngineConfig(peer_probe_interval=math.inf)
    name = unique("decoder")
    local = numpy_cache(4, 4096, 1)
    async with aionixl.Engine(unique("pre"), local, config=config) as pre:
        assert pre.address is not None
        for incarnation, seed in enumerate((11, 12, 13), start=1):
            child: PeerProcess = peer_process_factory(seed=seed, num_blocks=4, block_bytes=4096,
                                                      regions=1, name=name, connect=pre.address,
                                                      env=env)
            with anyio.fail_after(20):
                while pre.stats()["handshakes_accepted"] < incarnation:
                    await anyio.sleep(0.01)
            peer = pre.peers[name]
            await pre.transfer_blocks(peer, [0, 1, 2, 3], [3, 2, 1, 0], timeout=20)
            assert np.array_equal(local[0], child.expected()[0][::-1])
            assert pre.live_resources()["remote_agents"] == 1
            child.proc.kill()
            child.proc.wait()
        assert pre.stats()["handshakes_accepted"] == 3


async def test_dropping_a_peer_leaves_a_recycled_handle_of_another_alone(stopped_tcp_peer: Any) -> None:
    """Dropping a peer releases its handles at once and NIXL may give the same handle value
    to the next transfer; the dropped transfer's caller must not release that one."""
    child, frozen = stopped_tcp_peer
    other_cache = numpy_cache(8, 4 << 20, 1, seed=5)
    local = numpy_cache(8, 4 << 20, 1)
    async with aionixl.Engine(unique("other"), other_cache) as other, \
            aionixl.Engine(unique("dec"), local, listen=None) as eng:
        assert other.address is not None
        peer = await _connected(eng, child)
        healthy = await eng.connect(other.address, timeout=30)
        await eng.transfer_blocks(healthy, [0], [0], timeout=30)
        outcome: list[BaseException] = []
        with frozen():
            async def stuck_read() -> None:
                try:
                    await eng.transfer_blocks(peer, [1, 2, 3], [1, 2, 3], timeout=30)
                except aionixl.PeerDisconnectedError as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(stuck_read)
                await anyio.sleep(0.1)
                assert eng.live_resources()["in_flight"] == 1
                await eng.disconnect(peer)
                for block in range(4, 8):  # new handles, while the stuck caller cleans up
                    await eng.transfer_blocks(healthy, [block], [block], timeout=5)
            assert len(outcome) == 1
            assert np.array_equal(local[0][4:8], other_cache[0][4:8])
            assert eng.live_resources()["transfer_handles"] == 0


async def test_disconnect_lets_a_transfer_under_way_finish_first(stopped_tcp_peer: Any) -> None:
    """Closing the connection under a UCX-TCP read that is moving data made the serving
    process abort inside UCX; disconnect() gives such reads close_grace to finish."""
    child, frozen = stopped_tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await _connected(eng, child)
        results: list[aionixl.TransferResult] = []
        async with anyio.create_task_group() as tg:
            with frozen():
                async def read() -> None:
                    results.append(await eng.transfer_blocks(peer, [6], [6], timeout=30))

                tg.start_soon(read)
                await anyio.sleep(0.05)
                assert eng.live_resources()["in_flight"] == 1
                tg.start_soon(eng.disconnect, peer)
                await anyio.sleep(0.1)  # disconnect is waiting for the read
                assert peer.connected
            # The child runs again (well within the 0.5 s grace): the read finishes.
        assert len(results) == 1 and not peer.connected
        assert np.array_equal(local[0][6], child.expected()[0][6])
        assert eng.live_resources()["remote_agents"] == 0
    assert zero_resources(eng)
    assert child.proc.poll() is None  # the serving process survived
