"""aionixl.testing itself: deterministic caches, pairs, remote engines in child processes
(read, kill, restart, pause, notifications, deaths) and its pytest fixtures under anyio's
plugin and under pytest-asyncio. Every test checks that it leaves no child process behind."""

from __future__ import annotations

import glob
import math
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest
import torch

import aionixl
import aionixl.lowlevel
from aionixl.testing import (
    Pair,
    RemoteEngine,
    RemoteEngineError,
    RemoteEngineStopError,
    assert_blocks_equal,
    assert_no_resources,
    block_bytes,
    engine_pair,
    make_caches,
    unique_name,
)
from aionixl.testing._plugin import RemoteEngineFactory

from .helpers import HERE

GEOMETRY = {"num_blocks": 16, "block_shape": (16, 8, 64), "dtypes": ("float16", "bfloat16")}


def children() -> set[int]:
    pids: set[int] = set()
    for path in glob.glob("/proc/self/task/*/children"):
        try:
            with open(path) as f:
                pids.update(int(p) for p in f.read().split())
        except FileNotFoundError:
            pass  # that thread ended after the listing (a thread of NIXL's or zmq's)
    return pids


def gone(pid: int) -> bool:
    return not os.path.exists(f"/proc/{pid}")


@pytest.fixture(autouse=True)
def no_child_left_behind() -> Iterator[None]:
    before = children()
    yield
    assert children() - before == set(), "a child process outlived its test"


# ---- caches and assertions (no engine)


def test_make_caches_is_a_cheap_deterministic_function_of_seed_region_block() -> None:
    caches = make_caches(7, **GEOMETRY)
    assert [c.dtype for c in caches] == [torch.float16, torch.bfloat16]
    assert all(c.shape == (16, 16, 8, 64) and c.device.type == "cpu" for c in caches)
    again = make_caches(7, **GEOMETRY)
    for mine, other in zip(caches, again, strict=True):
        assert torch.equal(mine.view(torch.int16), other.view(torch.int16))
    # Any block can be recomputed on its own, bit for bit.
    raw = caches[1][5].view(torch.int16).numpy().view(np.uint8).reshape(-1)
    assert np.array_equal(raw, block_bytes(7, 1, 5, raw.size))
    # Different seeds, regions and blocks differ.
    other_seed = make_caches(8, **GEOMETRY)
    assert not torch.equal(caches[0].view(torch.int16), other_seed[0].view(torch.int16))
    assert not np.array_equal(block_bytes(7, 0, 5, 64), block_bytes(7, 1, 5, 64))
    assert not np.array_equal(block_bytes(7, 0, 5, 64), block_bytes(7, 0, 6, 64))
    # The default geometry is the documented one; other dtypes work too.
    assert [tuple(c.shape) for c in make_caches(0)] == [(64, 16, 8, 64)] * 2
    assert make_caches(1, 4, (32,), ("uint8", "float32"))[1].shape == (4, 32)
    for bad in ({"seed": -1}, {"seed": 2**80}, {"seed": 0, "num_blocks": 0}, {"seed": 0, "block_shape": ()},
                {"seed": 0, "dtypes": ("nonsense",)}, {"seed": 0, "dtypes": ("bool",)},
                {"seed": 0, "dtypes": ("quint4x2",)}, {"seed": 0, "dtypes": ("qint8",)}):  # these crashed
        with pytest.raises(ValueError):
            make_caches(**bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [{"name": ""}, {"name": 5}, {"listen": None}, {"env": {"A": 1}},
                                 {"command_prefix": "ip netns exec x"}, {"seed": 2**80}], ids=str)
def test_remote_engine_arguments_that_would_fail_only_in_the_child_are_refused_here(
        bad: dict[str, Any]) -> None:
    with pytest.raises((ValueError, TypeError)):
        RemoteEngine(**{"seed": 1, **bad})


def test_assert_blocks_equal_names_the_first_region_and_block_that_differ() -> None:
    remote = make_caches(3, **GEOMETRY)
    local = [torch.zeros_like(r) for r in remote]
    for theirs, mine in zip(remote, local, strict=True):
        mine[[0, 1, 2]] = theirs[[9, 4, 4]]
    assert_blocks_equal(local, [0, 1, 2], 3, [9, 4, 4], **GEOMETRY)
    # numpy regions of another dtype with the same bytes per block are compared by bytes.
    as_bytes = [r.view(-1).view(torch.uint8).view(16, -1).numpy() for r in local]
    assert_blocks_equal(as_bytes, [0, 1, 2], 3, [9, 4, 4], **GEOMETRY)
    with pytest.raises(AssertionError, match=r"region 0 \(float16\): local block 0 differs from remote "
                                             r"block 8 of seed 3"):
        assert_blocks_equal(local, [0, 1], 3, [8, 4], **GEOMETRY)
    with pytest.raises(AssertionError, match="of seed 4"):
        assert_blocks_equal(local, [0], 4, [9], **GEOMETRY)
    local[1][2].view(torch.int16)[3, 2, 1] += 1  # one element of one block of region 1
    with pytest.raises(AssertionError, match=r"region 1 \(bfloat16\): local block 2 differs from remote "
                                             r"block 4 .* 1 of 16384 bytes differ"):
        assert_blocks_equal(local, [0, 1, 2], 3, [9, 4, 4], **GEOMETRY)
    with pytest.raises(AssertionError, match="bytes"):  # another geometry
        assert_blocks_equal(local, [0], 3, [9], num_blocks=16, block_shape=(8,), dtypes=GEOMETRY["dtypes"])
    with pytest.raises(AssertionError, match="1 local regions"):
        assert_blocks_equal(local[:1], [0], 3, [9], **GEOMETRY)
    with pytest.raises(ValueError):
        assert_blocks_equal(local, [0, 1], 3, [9], **GEOMETRY)


def test_importing_aionixl_or_aionixl_testing_does_not_import_pytest() -> None:
    code = ("import sys; import aionixl; assert 'pytest' not in sys.modules; "
            "import aionixl.testing; assert 'pytest' not in sys.modules; print('clean')")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "clean" in run.stdout, run.stderr[-2000:]


# ---- engines


@pytest.mark.anyio
async def test_pair_reads_are_checked_block_by_block(aionixl_pair: Pair) -> None:
    pair = aionixl_pair
    assert pair.peer.name == pair.b.name and pair.b.address is not None
    await pair.a.transfer_blocks(pair.peer, [0, 1, 2], [63, 10, 10])
    assert_blocks_equal(pair.a_caches, [0, 1, 2], 1, [63, 10, 10])  # b holds seed + 1
    assert_blocks_equal(pair.a_caches, [3], 0, [3])  # untouched: still a's own seed
    with pytest.raises(AssertionError, match=r"region 0 .* local block 1 differs from remote block 11"):
        assert_blocks_equal(pair.a_caches, [0, 1], 1, [63, 11])
    await pair.a.transfer_blocks(pair.peer, [5], [6], op="write")
    assert_blocks_equal(pair.b_caches, [6], 0, [5])


@pytest.mark.anyio
async def test_engine_pair_closes_both_engines() -> None:
    async with engine_pair(seed=4, num_blocks=4, block_shape=(256,), dtypes=("uint8",)) as pair:
        assert [tuple(c.shape) for c in pair.a_caches] == [(4, 256)]
        await pair.a.transfer_blocks(pair.peer, [0], [3])
        assert_blocks_equal(pair.a_caches, [0], 5, [3], num_blocks=4, block_shape=(256,), dtypes=("uint8",))
        assert pair.b.live_resources()["remote_agents"] == 1
    assert pair.a.closed and pair.b.closed
    assert_no_resources(pair.a)
    assert_no_resources(pair.b)


@pytest.mark.anyio
async def test_assert_no_resources_lists_what_is_still_held() -> None:
    async with engine_pair(num_blocks=2, block_shape=(64,), dtypes=("uint8",)) as pair:
        with pytest.raises(AssertionError, match=r"still holds NIXL resources: .*dlists=3.*registrations=2"):
            assert_no_resources(pair.a)


@pytest.mark.anyio
async def test_remote_read_killed_then_restarted_with_new_bytes(aionixl_remote: RemoteEngineFactory) -> None:
    remote = aionixl_remote(seed=11, **GEOMETRY)
    caches = make_caches(99, **GEOMETRY)
    reached_the_end = False
    async with aionixl.Engine(unique_name("reader"), caches, listen=None) as local:
        with pytest.raises(RemoteEngineError, match="died") as died:
            async with remote:
                first_pid, address = remote.pid, remote.address
                peer = await local.connect(remote.address, timeout=30)
                assert peer.name == remote.name
                await local.transfer_blocks(peer, [0, 1], [15, 3])
                assert_blocks_equal(caches, [0, 1], 11, [15, 3], **GEOMETRY)
                await remote.kill()
                assert gone(first_pid) and not remote.running
                with pytest.raises(aionixl.PeerDisconnectedError):
                    await local.transfer_blocks(peer, [2], [2], timeout=10)
                with pytest.raises(RemoteEngineError, match="not running"):
                    await remote.live_resources()
                await remote.restart(seed=12)
                assert remote.address == address and remote.pid != first_pid and remote.seed == 12
                again = await local.connect(remote.address, timeout=30)
                await local.transfer_blocks(again, [4, 5], [15, 3])
                assert_blocks_equal(caches, [4, 5], 12, [15, 3], **GEOMETRY)  # the new bytes
                with pytest.raises(AssertionError):
                    assert_blocks_equal(caches, [4], 11, [15], **GEOMETRY)
                assert (await remote.live_resources())["remote_agents"] == 1
                # Dying on its own (not through kill()) with nobody asking: reported on exit.
                os.kill(remote.pid, signal.SIGKILL)
                with anyio.fail_after(10):
                    while remote.running:
                        await anyio.sleep(0.01)
                reached_the_end = True
    assert reached_the_end and died.value.returncode == -signal.SIGKILL
    assert gone(first_pid) and gone(remote.pid)
    assert_no_resources(local)


@pytest.mark.anyio
async def test_paused_remote_times_out_a_read_and_serves_it_after_resume(
        aionixl_remote: RemoteEngineFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over UCX TCP every transfer needs the target to progress: a stopped one cannot."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    remote = await aionixl_remote(seed=21, env={"UCX_TLS": "tcp"}, **GEOMETRY)
    caches = make_caches(98, **GEOMETRY)
    async with aionixl.Engine(unique_name("reader"), caches, listen=None) as local:
        peer = await local.connect(remote.address, timeout=30)
        await local.transfer_blocks(peer, [0], [0], timeout=30)  # wire-up done while it runs
        await remote.pause()
        try:
            with pytest.raises(aionixl.TransferTimeoutError):
                await local.transfer_blocks(peer, [1, 2, 3, 4], [4, 5, 6, 7], timeout=0.3)
            assert local.live_resources()["in_flight"] == 0
        finally:
            await remote.resume()
        await local.transfer_blocks(peer, [1, 2, 3, 4], [4, 5, 6, 7], timeout=30)
        assert_blocks_equal(caches, [0, 1, 2, 3, 4], 21, [0, 4, 5, 6, 7], **GEOMETRY)
    pid = remote.pid
    assert await remote.aclose() is None  # a clean graceful stop reports nothing
    assert gone(pid)


@pytest.mark.anyio
async def test_wait_notification_is_answered_by_the_child_with_the_config_it_was_given() -> None:
    config = aionixl.EngineConfig(handshake_secret=b"s" * 16)
    tuning = aionixl.lowlevel.Tuning(peer_probe_interval=math.inf)
    async with RemoteEngine(seed=5, config=config, tuning=tuning, **GEOMETRY) as remote, \
            aionixl.Engine(unique_name("reader"), make_caches(6, **GEOMETRY), listen=None,
                           config=config, tuning=tuning) as local, \
            aionixl.Engine(unique_name("unsigned"), make_caches(6, **GEOMETRY), listen=None) as unsigned:
        with pytest.raises(aionixl.HandshakeError):  # the child's engine has the secret
            await unsigned.connect(remote.address, timeout=5)
        peer = await local.connect(remote.address, timeout=30)
        await local.transfer_blocks(peer, [0], [1], notify=b"req-1")
        note = await remote.wait_notification(b"req-1", timeout=10)
        assert note == aionixl.Notification(peer=local.name, message=b"req-1")
        with pytest.raises(TimeoutError):
            await remote.wait_notification(b"req-2", timeout=0.2)
        resources = await remote.live_resources()
        assert resources["remote_agents"] == 1 and resources["in_flight"] == 0
        assert (await remote.stats())["handshakes_accepted"] == 1
    assert gone(remote.pid)


@pytest.mark.anyio
async def test_a_child_that_dies_on_its_own_is_reported_with_status_and_stderr() -> None:
    # faulthandler writes "Fatal Python error: Segmentation fault" to the child's stderr.
    remote = RemoteEngine(seed=1, num_blocks=2, env={"PYTHONFAULTHANDLER": "1"})
    async with remote:  # reported once below: leaving the block does not raise it again
        os.kill(remote.pid, signal.SIGSEGV)
        with pytest.raises(RemoteEngineError) as info:
            await remote.live_resources()
        assert info.value.returncode == -signal.SIGSEGV
        assert "Segmentation fault" in info.value.stderr_tail
        assert f"exit status {-signal.SIGSEGV}" in str(info.value)
        with pytest.raises(RemoteEngineError):
            await remote.pause()
    assert gone(remote.pid)


#: A child that never gets as far as its engine (it sleeps, whatever it is asked to run).
NEVER_READY = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.mark.anyio
async def test_a_start_cancelled_before_the_child_is_ready_kills_it_without_a_graceful_wait() -> None:
    remote = RemoteEngine(seed=1, num_blocks=2, command_prefix=NEVER_READY)
    started = anyio.current_time()
    with anyio.move_on_after(0.5):
        await remote.start()
    took = anyio.current_time() - started
    assert remote.returncode is not None, "the child still runs after the cancelled start"
    # A graceful stop would have waited for the child's report on its close (15 s).
    assert took < 5.0, f"the cancelled start took {took:.1f} s"
    await remote.aclose()


@pytest.mark.anyio
async def test_a_child_that_cannot_start_is_reported() -> None:
    with pytest.raises(RemoteEngineError, match="ListenError") as info:
        async with RemoteEngine(seed=1, num_blocks=2, listen="bogus://nowhere"):
            pass  # pragma: no cover
    assert info.value.returncode == 3


# Real children behind wrappers (RemoteEngine runs ``*command_prefix, python -c BOOTSTRAP SPEC``):
#: runs the child, which stops cleanly, then exits with status 7 itself.
EXIT_7 = ["sh", "-c", '"$@"; exit 7', "sh"]
#: runs the child's own bootstrap in a Python whose ``NixlAgent.deregister_all`` does nothing,
#: so that its engine really closes with its memory registrations still in NIXL.
LEAK_REGISTRATIONS = [sys.executable, "-c", textwrap.dedent("""
    import sys
    from aionixl import _nixl
    _nixl.NixlAgent.deregister_all = lambda self: None
    bootstrap, sys.argv = sys.argv[3], [sys.argv[0], *sys.argv[4:]]
    exec(bootstrap)
""")]


@pytest.mark.anyio
async def test_a_child_that_exits_non_zero_on_a_graceful_stop_fails_the_stop() -> None:
    remote = RemoteEngine(seed=2, command_prefix=EXIT_7, **GEOMETRY)
    caches = make_caches(90, **GEOMETRY)
    with pytest.raises(RemoteEngineStopError, match="graceful stop failed: the child exited with a "
                                                   "non-zero status") as info:
        async with remote, aionixl.Engine(unique_name("reader"), caches, listen=None) as local:
            peer = await local.connect(remote.address, timeout=30)  # it serves as usual
            await local.transfer_blocks(peer, [0], [7])
            assert_blocks_equal(caches, [0], 2, [7], **GEOMETRY)
    assert info.value.returncode == 7 and "(exit status 7)" in str(info.value)
    # The child itself reported a clean close: only the exit status is wrong.
    assert info.value.resources is not None and "registrations" in info.value.resources
    assert not any(info.value.resources.values()), info.value.resources
    assert gone(remote.pid)
    # restart() stops the running child gracefully first: the same failure, raised there.
    again = await RemoteEngine(seed=2, command_prefix=EXIT_7, num_blocks=2)
    first_pid = again.pid
    with pytest.raises(RemoteEngineStopError, match="non-zero status") as info:
        await again.restart()
    assert info.value.returncode == 7 and not again.running and again.pid == first_pid
    assert await again.aclose() is None  # reported once, not again
    assert gone(first_pid)


@pytest.mark.anyio
async def test_a_child_whose_engine_leaves_nixl_resources_fails_the_stop() -> None:
    factory = RemoteEngineFactory()  # what the aionixl_remote fixture tears down
    remote = await factory(seed=3, command_prefix=LEAK_REGISTRATIONS, **GEOMETRY)
    assert (await remote.live_resources())["registrations"] >= 1  # open: registered, as usual
    leak = (r"graceful stop failed: the child's engine still held NIXL resources after closing: "
            r"registrations=\d+")
    with pytest.raises(RemoteEngineStopError, match=leak) as info:
        await factory.aclose()
    resources = info.value.resources
    assert info.value.returncode == 0 and resources is not None
    assert resources["registrations"] >= 1
    assert sum(resources.values()) == resources["registrations"], resources
    assert gone(remote.pid)


# ---- the fixtures under pytest-asyncio alone, in a fresh pytest


PLUGIN_TESTS = {
    "asyncio": """
        import asyncio
        import os
        import pytest
        from aionixl.testing import assert_blocks_equal

        pytest_plugins = ["aionixl.testing"]
        started = []

        @pytest.mark.asyncio
        async def test_fixtures(aionixl_pair, aionixl_remote):
            pair = aionixl_pair
            async with asyncio.timeout(30):
                await pair.a.transfer_blocks(pair.peer, [0, 1], [63, 62])
            assert_blocks_equal(pair.a_caches, [0, 1], 1, [63, 62])
            async with aionixl_remote(seed=9, num_blocks=8) as remote:
                started.append(remote.pid)
                peer = await pair.a.connect(remote.address)
                await pair.a.transfer_blocks(peer, [2], [5])
                assert_blocks_equal(pair.a_caches, [2], 9, [5], num_blocks=8)
            leftover = await aionixl_remote(seed=1, num_blocks=2)  # stopped at teardown
            started.append(leftover.pid)

        def test_teardown_stopped_them():
            assert len(started) == 2 and not [p for p in started if os.path.exists(f"/proc/{p}")]
    """,
}


def test_fixtures_work_under_pytest_asyncio_alone(tmp_path: Path) -> None:
    """aionixl_remote and aionixl_pair in a fresh pytest with pytest-asyncio and without
    anyio's plugin. (In this suite both plugins are loaded: the tests above use the fixtures
    under anyio on asyncio and trio, test_asyncio_server.py under pytest-asyncio.)"""
    plugin, disabled, passed = "asyncio", "anyio", 2
    (tmp_path / "test_plugin.py").write_text(textwrap.dedent(PLUGIN_TESTS[plugin]))
    env = {**os.environ, "PYTHONPATH": str(HERE.parent)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", f"no:{disabled}",
         "-o", "asyncio_mode=strict", "-o", "asyncio_default_fixture_loop_scope=function",
         "-W", "error::pytest.PytestAssertRewriteWarning", "--rootdir", str(tmp_path), str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert f"{passed} passed" in run.stdout, run.stdout[-2000:]


# ---- workloads and calls run in the child by name


@pytest.mark.anyio
async def test_a_workload_runs_beside_the_remote_engine_and_calls_return_their_result() -> None:
    import msgspec

    remote = RemoteEngine(seed=4, num_blocks=4, workload="tests.remote_ops:count",
                          workload_args=msgspec.msgpack.encode(0.01))
    async with remote:
        with anyio.fail_after(20):
            while (result := await remote.call("tests.remote_ops:counted"))["ticks"] < 3:
                await anyio.sleep(0.02)
        assert result["name"] == remote.name
        with pytest.raises(RemoteEngineError, match="call failed in the child: KeyError"):
            await remote.call("tests.remote_ops:fail", b"no such key")
        assert (await remote.call("tests.remote_ops:counted"))["ticks"] >= 3  # still running
        # the child serves make_caches' bytes from numpy: it never imports torch
        assert await remote.call("tests.remote_ops:modules", b"torch,numpy") == ["numpy"]
    with pytest.raises(ValueError, match="module:function"):
        RemoteEngine(seed=4, workload="tests.remote_ops.count")


@pytest.mark.anyio
async def test_a_child_left_with_more_threads_than_before_its_engine_fails_the_stop() -> None:
    remote = await RemoteEngine(seed=5, num_blocks=2)
    assert await remote.call("tests.remote_ops:start_a_thread") >= 2
    died = await remote.aclose()
    assert isinstance(died, RemoteEngineStopError), died
    assert "OS threads after its engine closed" in str(died) and died.threads_left == 1
    assert died.returncode == 0 and died.resources is not None and not any(died.resources.values())
