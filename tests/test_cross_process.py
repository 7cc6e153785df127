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
import time
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl.testing import RemoteEngine, assert_blocks_equal, assert_no_resources
from aionixl.testing._plugin import RemoteEngineFactory

from .helpers import HERE, numpy_cache, unique

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 32, 8192, 2


def geometry(num_blocks: int, block_bytes: int, regions: int) -> dict[str, Any]:
    """RemoteEngine/assert_blocks_equal geometry of ``numpy_cache(num_blocks, block_bytes, regions)``."""
    return {"num_blocks": num_blocks, "block_shape": (block_bytes,), "dtypes": ("uint8",) * regions}


async def test_read_and_write_across_processes(aionixl_remote: RemoteEngineFactory) -> None:
    child = await aionixl_remote(seed=1234, **geometry(BLOCKS, BLOCK_BYTES, REGIONS))
    local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await eng.connect(child.address, timeout=30)
        assert peer.name == child.name and peer.num_blocks == BLOCKS
        await eng.transfer_blocks(peer, list(range(10)), [31 - i for i in range(10)], notify=b"done")
        assert_blocks_equal(local, range(10), child.seed, [31 - i for i in range(10)], **child.geometry)
        assert (await child.wait_notification(b"done", timeout=10)).peer == eng.name
        # Write a fresh pattern into the child's block 3, read it back into block 20.
        for r in local:
            r[11] = np.arange(BLOCK_BYTES, dtype=np.uint8)
        await eng.transfer_blocks(peer, [11], [3], op="write")
        await eng.transfer_blocks(peer, [20], [3], op="read")
        for r in local:
            assert np.array_equal(r[20], np.arange(BLOCK_BYTES, dtype=np.uint8))
    assert_no_resources(eng)
    assert await child.aclose() is None
    assert child.returncode == 0


@pytest.fixture
async def tcp_peer(aionixl_remote: RemoteEngineFactory, monkeypatch: pytest.MonkeyPatch) -> RemoteEngine:
    """A TCP-only child engine (``paused()`` keeps our transfers to it in flight)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    return await aionixl_remote(seed=1234, env={"UCX_TLS": "tcp"}, **geometry(8, 4 << 20, 1))


async def _connected(eng: aionixl.Engine, child: RemoteEngine) -> aionixl.Peer:
    peer = await eng.connect(child.address, timeout=30)
    await eng.transfer_blocks(peer, [0], [0], timeout=30)  # wire-up done while it runs
    return peer


#: How early, against perf_counter, an event loop's timer may fire (uvloop's clock).
LOOP_CLOCK_SLACK = 0.002


async def test_timeout_aborts_and_releases_the_handle(tcp_peer: RemoteEngine) -> None:
    """A stopped peer cannot confirm that nothing more of the read will land (push mode, the
    default over TCP), so the reader evicts it push_cancel_timeout after the deadline."""
    child = tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    tuning = aionixl.lowlevel.Tuning(push_cancel_timeout=0.3)
    async with aionixl.Engine(unique("dec"), local, listen=None, tuning=tuning) as eng:
        peer = await _connected(eng, child)
        assert peer.read_mode == "push"
        async with child.paused():
            start = time.perf_counter()
            with pytest.raises(aionixl.TransferTimeoutError) as info:
                await eng.transfer_blocks(peer, [1, 2, 3, 4], [1, 2, 3, 4], timeout=0.3)
            elapsed = time.perf_counter() - start
            assert isinstance(info.value, TimeoutError)
            # The deadline, then push_cancel_timeout, each timed by the event loop's clock:
            # uvloop's is in whole ms and read once a loop turn, so against perf_counter its
            # timers may fire up to a ms early (0.59976 s seen in CI).
            assert 0.6 - LOOP_CLOCK_SLACK <= elapsed < 2.5
            assert eng.live_resources()["transfer_handles"] == 0
            assert eng.live_resources()["in_flight"] == 0
            assert not peer.connected and eng.metrics().fence_evictions == 1
        # The peer is alive again: connect() reaches it and reads work.
        peer = await eng.connect(child.address, timeout=30)
        await eng.transfer_blocks(peer, [5], [5], timeout=30)
        assert_blocks_equal(local, [5], child.seed, [5], **child.geometry)
    assert_no_resources(eng)


async def test_cancellation_aborts_and_releases_the_handle(tcp_peer: RemoteEngine) -> None:
    child = tcp_peer
    async with aionixl.Engine(unique("dec"), numpy_cache(8, 4 << 20, 1), listen=None) as eng:
        peer = await _connected(eng, child)
        async with child.paused():
            with anyio.move_on_after(0.2) as scope:
                await eng.transfer_blocks(peer, [1, 2, 3, 4], [1, 2, 3, 4])
            assert scope.cancelled_caught
            assert eng.live_resources()["transfer_handles"] == 0
            assert eng.live_resources()["in_flight"] == 0
            assert not peer.connected  # unconfirmed: evicted (see the test above)
        peer = await _connected(eng, child)
        async with child.paused():
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
                assert 1 <= eng.live_resources()["in_flight"] <= 2  # they may share a request
            assert outcome == {"1": "timeout", "2": "timeout"}
            assert eng.live_resources()["transfer_handles"] == 0
    assert_no_resources(eng)


async def test_close_with_transfers_in_flight(tcp_peer: RemoteEngine) -> None:
    child = tcp_peer
    eng = aionixl.Engine(unique("dec"), numpy_cache(8, 4 << 20, 1), listen=None)
    errors: list[BaseException] = []
    async with eng:
        peer = await _connected(eng, child)
        async with child.paused():
            async def transfer(i: int) -> None:
                try:
                    await eng.transfer_blocks(peer, [i], [i], timeout=60)
                except aionixl.EngineClosedError as exc:
                    errors.append(exc)

            async with anyio.create_task_group() as tg:
                for i in range(1, 7):
                    tg.start_soon(transfer, i)
                await anyio.sleep(0.1)
                # Six callers, in one to six NIXL requests (concurrent calls coalesce).
                assert 1 <= eng.live_resources()["in_flight"] <= 6
                start = anyio.current_time()
                async with anyio.create_task_group() as closers:
                    closers.start_soon(eng.aclose)
                    closers.start_soon(eng.aclose)
                assert anyio.current_time() - start < 5
    assert len(errors) == 6
    assert_no_resources(eng)


async def test_a_read_that_finishes_within_the_close_grace_returns_its_result(tcp_peer: RemoteEngine) -> None:
    """aclose() gives reads under way close_grace to finish: one that does returns its
    result, its blocks in place. (Its caller used to get EngineClosedError at the start of
    the close, and the read's bytes landed after that.)"""
    child = tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    eng = aionixl.Engine(unique("dec"), local, listen=None, config=aionixl.EngineConfig(read_mode="get"))
    results: list[aionixl.TransferResult] = []
    async with eng:
        peer = await _connected(eng, child)
        await child.pause()

        async def read() -> None:
            results.append(await eng.transfer_blocks(peer, [5], [5], timeout=60))

        async def answer_within_the_grace() -> None:
            await anyio.sleep(0.15)  # close_grace is 0.5 s
            await child.resume()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.1)
            assert eng.live_resources()["in_flight"] == 1
            tg.start_soon(answer_within_the_grace)
            await eng.aclose()
    assert len(results) == 1 and results[0].nbytes == 4 << 20
    assert_blocks_equal(local, [5], child.seed, [5], **child.geometry)
    assert_no_resources(eng)
    assert child.running


async def test_a_read_that_close_fails_is_told_only_once_its_peer_is_removed(tcp_peer: RemoteEngine) -> None:
    """A GET the close cancels may still land its bytes (UCX does not stop a GET under way
    when its handle is released) until the peer is removed: its caller hears only then.
    The server stays stopped and is killed: a UCX-TCP server answering a GET whose reader
    left aborts (why TCP reads are pushed by default)."""
    child = tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    eng = aionixl.Engine(unique("dec"), local, listen=None, config=aionixl.EngineConfig(read_mode="get"))
    heard: list[bool] = []
    async with eng:
        peer = await _connected(eng, child)
        await child.pause()

        async def read() -> None:
            with pytest.raises(aionixl.EngineClosedError):
                await eng.transfer_blocks(peer, [5], [5], timeout=60)
            heard.append(peer.connected)

        async def look_during_the_grace() -> None:
            await anyio.sleep(0.3)  # the close began at 0.1 s; its grace is 0.5 s
            during.append((eng.metrics().in_flight, eng.live_resources()["in_flight"]))

        during: list[tuple[int, int]] = []
        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.1)
            assert eng.live_resources()["in_flight"] == 1
            tg.start_soon(look_during_the_grace)
            await eng.aclose()
    await child.kill()
    assert during == [(1, 1)], "the gauges lost the read the close took over"
    assert heard == [False], "the caller heard while its read could still land"
    assert not local[0][5].any()
    assert_no_resources(eng)


@pytest.mark.parametrize(("timeout", "close_at", "error"), [
    (60, 0.1, aionixl.EngineClosedError),  # the close fails it
    (0.3, 0.45, aionixl.TransferTimeoutError),  # it timed out and is fencing when the close begins
], ids=["failed-by-close", "fencing-when-close-begins"])
async def test_an_unstaged_push_read_ended_around_a_close_returns_once_its_peer_is_removed(
        tcp_peer: RemoteEngine, timeout: float, close_at: float, error: type[Exception]) -> None:
    """A push read straight into our blocks (no staging slots, as for CUDA regions) from a
    stopped server, which cannot confirm the close's cancel and may still write: the caller
    returns only once the close removed the peer, whether the close failed the read or the
    read had timed out and was waiting (up to 0.5 s) for the server to confirm it stopped,
    with no eviction to follow once the close began. Before, it returned with the peer
    still connected."""
    child = tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    config = aionixl.EngineConfig(read_mode="push", push_staging_bytes=0)
    eng = aionixl.Engine(unique("dec"), local, listen=None, config=config)
    heard: list[bool] = []
    async with eng:
        peer = await _connected(eng, child)
        assert peer.read_mode == "push" and eng.metrics().staging_slots == 0
        async with child.paused():
            async def read() -> None:
                with pytest.raises(error):
                    await eng.transfer_blocks(peer, [5], [5], timeout=timeout)
                heard.append(peer.connected)

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.sleep(close_at)
                assert not heard and len(eng._push.reads) == 1  # asked, not answered
                await eng.aclose()
    assert heard == [False], "the caller returned while its server could still write into its blocks"
    assert not local[0][5].any()
    assert_no_resources(eng)
    await anyio.sleep(0.2)
    assert child.running


async def test_a_read_whose_deadline_passes_during_close_returns_once_its_peer_is_removed(
        tcp_peer: RemoteEngine) -> None:
    """A caller whose own deadline passes during the close's grace cannot be fenced (the
    close is dropping the peers): it raises once they are dropped. Its handle is released
    once, by its caller; the close never asks NIXL about it again (that handle is freed
    memory in NIXL). The server stays stopped and is killed: a UCX-TCP server answering a
    GET whose reader left aborts (why TCP reads are pushed by default)."""
    child = tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    eng = aionixl.Engine(unique("dec"), local, listen=None, config=aionixl.EngineConfig(read_mode="get"))
    heard: list[bool] = []
    released_then_checked: list[int] = []
    async with eng:
        peer = await _connected(eng, child)
        agent = eng._local.agent
        assert agent is not None
        check = agent.check

        def check_held(handle: int) -> Any:
            if handle not in agent.xfers:
                released_then_checked.append(handle)
                raise aionixl.TransferError("asked about a released handle")  # not NIXL's freed memory
            return check(handle)

        agent.check = check_held  # type: ignore[method-assign]
        await child.pause()

        async def read() -> None:
            with pytest.raises(aionixl.TransferTimeoutError):
                await eng.transfer_blocks(peer, [5], [5], timeout=0.35)
            heard.append(peer.connected)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.1)
            await eng.aclose()  # its grace (0.5 s) outlasts the read's deadline
    await child.kill()
    assert heard == [False] and not released_then_checked
    assert not local[0][5].any()
    assert_no_resources(eng)


async def test_merged_readers_one_of_which_leaves_during_close_are_told_once_the_peer_is_removed(
        aionixl_remote: RemoteEngineFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Four reads in one merged request; one is cancelled during the close's grace. Its
    request is aborted; none of the four callers hears before the peer is removed. (The
    server is killed, not resumed: see the test above.)"""
    monkeypatch.setenv("UCX_TLS", "tcp")
    child = await aionixl_remote(seed=7, env={"UCX_TLS": "tcp"}, **geometry(8, 64 << 10, 1))
    local = numpy_cache(8, 64 << 10, 1)
    config = aionixl.EngineConfig(read_mode="get")
    tuning = aionixl.lowlevel.Tuning(coalesce_window=0.05)
    eng = aionixl.Engine(unique("dec"), local, listen=None, config=config, tuning=tuning)
    heard: dict[int, tuple[str, bool]] = {}
    async with eng:
        peer = await _connected(eng, child)
        await child.pause()
        scopes: dict[int, anyio.CancelScope] = {}

        async def read(i: int) -> None:
            with anyio.CancelScope() as scopes[i]:
                try:
                    await eng.transfer_blocks(peer, [i], [i], timeout=60)
                except aionixl.AionixlError as exc:
                    heard[i] = (type(exc).__name__, peer.connected)
                    return
            heard[i] = ("cancelled", peer.connected)

        async def leave_during_close() -> None:
            await anyio.sleep(0.2)  # the close began at 0.1 s; its grace is 0.5 s
            scopes[1].cancel()

        async with anyio.create_task_group() as tg:
            for i in range(1, 5):
                tg.start_soon(read, i)
            await anyio.sleep(0.1)
            assert eng.metrics().merged_requests >= 1, eng.metrics()
            tg.start_soon(leave_during_close)
            await eng.aclose()
    await child.kill()
    assert heard[1] == ("cancelled", False), heard
    assert {heard[i] for i in (2, 3, 4)} == {("EngineClosedError", False)}, heard
    assert not any(local[0][i].any() for i in range(1, 5))
    assert_no_resources(eng)


async def test_killed_peer_is_evicted_and_a_restart_on_its_port_is_reachable(
        aionixl_remote: RemoteEngineFactory) -> None:
    """SIGKILL the peer mid-read: typed error within a second, the peer evicted with all its
    NIXL state, other peers unaffected; the peer restarts (same name, same port, other data)
    and a new connect() reads the new incarnation's bytes."""
    name = unique("prefill")
    shape = geometry(BLOCKS, 1 << 16, REGIONS)
    first = await aionixl_remote(name, seed=1, **shape)
    bystander = await aionixl_remote(seed=3, **shape)
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
            await first.kill()
        assert first.returncode == -signal.SIGKILL
        assert len(failures) == 4
        for exc, when in failures:
            assert isinstance(exc, aionixl.PeerDisconnectedError), repr(exc)
            assert when - killed_at[0] < 1.0
        # Evicted: gone from peers, its descriptors and remote agent released.
        assert not peer.connected and name not in eng.peers
        live = eng.live_resources()
        # ours, and the bystander's two (its blocks, its staging slots)
        assert live["remote_agents"] == 1 and live["dlists"] == 3
        assert live["transfer_handles"] == 0 and live["in_flight"] == 0
        assert eng.metrics().peers_evicted == 1
        with pytest.raises(aionixl.PeerDisconnectedError, match="connect"):
            await eng.transfer_blocks(peer, [0], [0])
        # Everyone else carries on.
        await eng.transfer_blocks(other, [0, 1], [5, 6])
        assert_blocks_equal(local, [0, 1], bystander.seed, [5, 6], **shape)

        address = first.address
        await first.restart(seed=2)  # same name, same port
        assert first.address == address and first.name == name
        again = await eng.connect(first.address, timeout=30)
        assert again is not peer and again.connected and eng.peers[name] is again
        await eng.transfer_blocks(again, list(range(BLOCKS)), list(range(BLOCKS)))
        assert_blocks_equal(local, range(BLOCKS), 2, range(BLOCKS), **shape)  # the new incarnation's
        assert eng.live_resources()["remote_agents"] == 2
    assert_no_resources(eng)


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


async def test_drain_waits_for_transfers_under_way(tcp_peer: RemoteEngine) -> None:
    child = tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await _connected(eng, child)
        done: list[aionixl.TransferResult] = []
        async with anyio.create_task_group() as tg:
            async with child.paused():
                async def read() -> None:
                    done.append(await eng.transfer_blocks(peer, [2, 3], [6, 7], timeout=30))

                tg.start_soon(read)
                await anyio.sleep(0.1)
                assert await eng.drain(timeout=0.3) is False  # the peer is stopped
                assert eng.live_resources()["in_flight"] == 1
            assert await eng.drain(timeout=20) is True
            assert eng.live_resources()["in_flight"] == 0
        assert len(done) == 1
        assert_blocks_equal(local, [2, 3], child.seed, [6, 7], **child.geometry)
    assert_no_resources(eng)


@pytest.mark.parametrize("direction", ["outbound", "inbound"])
async def test_a_peer_that_dies_while_idle_is_found_by_the_probe(aionixl_remote: RemoteEngineFactory,
                                                                 direction: str) -> None:
    """No transfer needs to fail: the liveness probe notices the death and evicts the peer,
    on the connecting side and on the listening side (where stale peers would pile up)."""
    tuning = aionixl.lowlevel.Tuning(peer_probe_interval=0.2)
    async with aionixl.Engine(unique("eng"), numpy_cache(4, 4096, 1), tuning=tuning) as eng:
        if direction == "outbound":
            child = await aionixl_remote(seed=1234, **geometry(4, 4096, 1))
            await eng.connect(child.address, timeout=30)
        else:
            assert eng.address is not None
            child = await aionixl_remote(seed=1234, **geometry(4, 4096, 1))
            assert await child.connect(eng.address, timeout=30) == eng.name
        with anyio.fail_after(10):
            while child.name not in eng.peers:
                await anyio.sleep(0.01)
        await anyio.sleep(0.5)
        assert child.name in eng.peers  # probes of a live peer change nothing
        assert eng.metrics().notifications_kept == 0  # nor do they reach anyone's mailbox
        await child.kill()
        with anyio.fail_after(5):
            while child.name in eng.peers:
                await anyio.sleep(0.02)
        assert eng.metrics().peers_evicted == 1
        live = eng.live_resources()
        assert live["remote_agents"] == 0 and live["dlists"] == 1  # only our own
    assert_no_resources(eng)


@pytest.mark.parametrize("transport", ["default", "tcp"])
async def test_a_killed_client_restarted_under_its_name_replaces_the_old_one_at_once(
        aionixl_remote: RemoteEngineFactory, transport: str) -> None:
    """The old incarnation died without a goodbye and no probe has run yet: the listener
    drops it and loads the new one in one step (NIXL's remove_remote_agent followed at once
    by add_remote_agent for the same name), and both directions work with the new one."""
    env = {"UCX_TLS": "tcp"} if transport == "tcp" else {}
    tuning = aionixl.lowlevel.Tuning(peer_probe_interval=math.inf)
    name = unique("decoder")
    local = numpy_cache(4, 4096, 1)
    async with aionixl.Engine(unique("pre"), local, tuning=tuning) as pre:
        assert pre.address is not None
        for incarnation, seed in enumerate((11, 12, 13), start=1):
            child = await aionixl_remote(name, seed=seed, env=env, **geometry(4, 4096, 1))
            await child.connect(pre.address, timeout=30)
            with anyio.fail_after(20):
                while pre.metrics().handshakes_accepted < incarnation:
                    await anyio.sleep(0.01)
            peer = pre.peers[name]
            await pre.transfer_blocks(peer, [0, 1, 2, 3], [3, 2, 1, 0], timeout=20)
            assert_blocks_equal(local, [0, 1, 2, 3], seed, [3, 2, 1, 0], **child.geometry)
            assert pre.live_resources()["remote_agents"] == 1
            await child.kill()
        assert pre.metrics().handshakes_accepted == 3


async def test_dropping_a_peer_leaves_a_recycled_handle_of_another_alone(tcp_peer: RemoteEngine) -> None:
    """Dropping a peer releases its handles at once and NIXL may give the same handle value
    to the next transfer; the dropped transfer's caller must not release that one."""
    child = tcp_peer
    other_cache = numpy_cache(8, 4 << 20, 1, seed=5)
    local = numpy_cache(8, 4 << 20, 1)
    async with aionixl.Engine(unique("other"), other_cache) as other, \
            aionixl.Engine(unique("dec"), local, listen=None) as eng:
        assert other.address is not None
        peer = await _connected(eng, child)
        healthy = await eng.connect(other.address, timeout=30)
        await eng.transfer_blocks(healthy, [0], [0], timeout=30)
        outcome: list[BaseException] = []
        async with child.paused():
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


async def test_disconnect_lets_a_transfer_under_way_finish_first(tcp_peer: RemoteEngine) -> None:
    """Closing the connection under a UCX-TCP read that is moving data made the serving
    process abort inside UCX; disconnect() gives such reads close_grace to finish."""
    child = tcp_peer
    local = numpy_cache(8, 4 << 20, 1)
    async with aionixl.Engine(unique("dec"), local, listen=None) as eng:
        peer = await _connected(eng, child)
        results: list[aionixl.TransferResult] = []
        async with anyio.create_task_group() as tg, child.paused():
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
        assert_blocks_equal(local, [6], child.seed, [6], **child.geometry)
        assert eng.live_resources()["remote_agents"] == 0
    assert_no_resources(eng)
    assert child.running  # the serving process survived
