"""Push reads (issue 13): the serving engine writes a read's blocks into the reader.

The read-mode rule, push reads in one process (bytes, notify, validation on both sides),
no late bytes after a cancelled or timed-out read in both modes, and the issue's scenario:
readers that leave mid-read in five ways must never take the serving process down.
"""

from __future__ import annotations

import os
import signal
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl import _hostfacts, _nixl, _push, _wire
from aionixl.testing import RemoteEngine

from .helpers import engine_pair, numpy_cache, unique, zero_resources
from .leaving import WAYS, check_server, run_reader, start_server, ucx_noise

pytestmark = pytest.mark.anyio

PUSH = aionixl.EngineConfig(read_mode="push")
#: Pushes written in chunks of 64 KiB (with ``PUSH``).
SMALL_CHUNKS = aionixl.lowlevel.Tuning(push_chunk_bytes=64 << 10)


# ---- the rule ------------------------------------------------------------------------------

def test_read_mode_rule() -> None:
    same = {"node": "n1", "ucx_tls": "", "rdma": "0"}
    feats = frozenset({_wire.PUSH_FEATURE})
    assert _hostfacts.choose_read_mode("auto", feats, same, same) == "get"  # one host, shm allowed
    tcp = {**same, "ucx_tls": "tcp"}
    assert _hostfacts.choose_read_mode("auto", feats, same, tcp) == "push"  # shm not allowed on one side
    assert _hostfacts.choose_read_mode("auto", feats, tcp, same) == "push"
    other = {**same, "node": "n2"}
    assert _hostfacts.choose_read_mode("auto", feats, same, other) == "push"  # two hosts, no RDMA
    rdma_a, rdma_b = {**same, "rdma": "1"}, {**other, "rdma": "1"}
    assert _hostfacts.choose_read_mode("auto", feats, rdma_a, rdma_b) == "get"  # RDMA on both
    assert _hostfacts.choose_read_mode("auto", feats, rdma_a, other) == "push"
    assert _hostfacts.choose_read_mode("auto", frozenset(), same, other) == "get"  # an older peer
    assert _hostfacts.choose_read_mode("push", frozenset(), same, same) == "get"
    assert _hostfacts.choose_read_mode("push", feats, same, same) == "push"
    assert _hostfacts.choose_read_mode("get", feats, same, other) == "get"
    assert _hostfacts.shm_allowed("") and _hostfacts.shm_allowed("all") and _hostfacts.shm_allowed("tcp,cma")
    assert not _hostfacts.shm_allowed("tcp") and not _hostfacts.shm_allowed("^sm")
    assert _hostfacts.shm_allowed("^cma") and not _hostfacts.shm_allowed("^posix,sysv,cma,knem,xpmem,sm,shm")
    assert _hostfacts.rdma_allowed("rc,sm") and not _hostfacts.rdma_allowed("tcp")
    assert not _hostfacts.rdma_allowed("^ib")
    with pytest.raises(ValueError, match="read_mode"):
        aionixl.EngineConfig(read_mode="pull")  # type: ignore[arg-type]


@pytest.mark.parametrize("tls", ["", "tcp"])
async def test_auto_mode_per_peer(monkeypatch: pytest.MonkeyPatch, tls: str) -> None:
    """Two engines in one process: GET over shared memory, push where UCX_TLS is TCP only."""
    if tls:
        monkeypatch.setenv("UCX_TLS", tls)
    else:
        monkeypatch.delenv("UCX_TLS", raising=False)
    src_cache = numpy_cache(8, 4096, 2, seed=3)
    dst_cache = numpy_cache(8, 4096, 2)
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        want = "push" if tls else "get"
        assert peer.read_mode == want and src.peers[dst.name].read_mode == want
        assert "push-read" in peer.features
        await dst.transfer_blocks(peer, [0, 5], [7, 2], timeout=20)
        for mine, theirs in zip(dst_cache, src_cache, strict=True):
            assert np.array_equal(mine[[0, 5]], theirs[[7, 2]])
        with anyio.fail_after(5):  # the server counts it once its last write is seen DONE
            while src.metrics().pushes_served < (1 if tls else 0):
                await anyio.sleep(0.01)
        assert src.metrics().pushes_served == (1 if tls else 0)


# ---- push reads in one process -------------------------------------------------------------

async def test_push_read_moves_exact_bytes_and_notifies_after_the_data() -> None:
    src_cache = numpy_cache(64, 16384, 2, seed=11)
    dst_cache = numpy_cache(48, 16384, 2)
    async with engine_pair(src_cache, dst_cache, config=PUSH, tuning=SMALL_CHUNKS) as (src, dst, peer):
        assert peer.read_mode == "push"
        local = list(range(40))
        remote = [63 - 3 * i % 64 for i in range(40)]
        result = await dst.transfer_blocks(peer, local, remote, notify=b"req-1", timeout=20)
        assert result.blocks == 40 and result.nbytes == 40 * 2 * 16384
        for mine, theirs in zip(dst_cache, src_cache, strict=True):
            assert np.array_equal(mine[:40], theirs[remote])  # 40 x 32 KiB: ten 64 KiB chunks
        note = await src.wait_notification(b"req-1", timeout=10)
        assert note.peer == dst.name
        # One block, numpy ids, and many at once.
        await dst.transfer_blocks(peer, [47], [0])
        await dst.transfer_blocks(peer, np.array([1, 2]), np.array([5, 6]))
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(dst.transfer_blocks, peer, [i + 16], [i + 20])
        for mine, theirs in zip(dst_cache, src_cache, strict=True):
            assert np.array_equal(mine[47], theirs[0]) and np.array_equal(mine[1:3], theirs[5:7])
            assert np.array_equal(mine[16:32], theirs[20:36])
        # Refused before anything is sent.
        for bad in (([0, 0], [1, 2]), ([48], [0]), ([0], [64]), ([0, 1], [0])):
            with pytest.raises(ValueError):
                await dst.transfer_blocks(peer, *bad)
        with pytest.raises(ValueError):
            await dst.transfer_blocks(peer, [0], [0], notify=b"\x00aionixl-x")
        assert src.metrics().pushes_refused == 0
        assert src.live_resources()["in_flight"] == 0 and not src._push.jobs and not dst._push.reads
    assert zero_resources(src) and zero_resources(dst)


async def test_the_server_validates_every_request() -> None:
    """Defence in depth: requests that skip the reader's checks get a prompt refusal."""
    async with engine_pair(numpy_cache(8, 4096, 1, seed=1), numpy_cache(4, 4096, 1),
                           config=PUSH, tuning=SMALL_CHUNKS) as (src, dst, peer):
        assert dst._local.agent is not None

        def ids(*v: int) -> bytes:
            return np.array(v, dtype="<i4").tobytes()

        cases = {
            "destination block id out of range": _wire.PushRequest(101, ids(4), ids(0), 5.0),
            "source block id out of range": _wire.PushRequest(102, ids(0), ids(8), 5.0),
            "same block more than once": _wire.PushRequest(103, ids(1, 1), ids(0, 1), 5.0),
            "empty, unequal": _wire.PushRequest(104, ids(1, 2), ids(0), 5.0),
            "bad timeout": _wire.PushRequest(105, ids(1), ids(0), float("nan")),
            "reserved": _wire.PushRequest(106, ids(1), ids(0), 5.0, b"\x00aionixl-probe"),
        }
        records = {}
        for reason, request in cases.items():
            rec = _push._Read(peer, request.rid)
            dst._push.reads[request.rid] = rec
            records[reason] = rec
            dst._local.agent.send_notif(peer.name, _wire.push_request(request))
        dst._wake_drainer()
        with anyio.fail_after(10):
            for rec in records.values():
                await rec.event.wait()
        for reason, rec in records.items():
            assert rec.state == _push.ReadState.FAILED and reason in str(rec.error), (reason, rec.error)
        dst._push.reads.clear()
        assert src.metrics().pushes_refused == len(cases)
        # It still serves good requests from that peer.
        await dst.transfer_blocks(peer, [0], [7], timeout=10)


async def test_a_push_request_from_another_process_of_the_readers_name_is_ignored() -> None:
    """NIXL names a notification's sender by name only, so a request sent by an earlier
    process of the reader's name and delivered late (its link was cut when it died) would be
    served into the process now admitted under that name, or refused to it. Requests carry
    the reader's incarnation: the server ignores one that is not the admitted process's, and
    serves the same request with the right one."""
    src_cache, dst_cache = numpy_cache(8, 4096, 1, seed=1), numpy_cache(4, 4096, 1)
    async with engine_pair(src_cache, dst_cache, config=PUSH, tuning=SMALL_CHUNKS) as (src, dst, peer):
        agent = dst._local.agent
        assert agent is not None
        before = dst_cache[0][1].copy()
        own = _wire.incarnation(aionixl.lowlevel.nixl_metadata(dst))
        assert own != b"\x01" * 8

        def request(rid: int, dst_block: int, src_block: int, reader: bytes) -> bytes:
            ids = [np.array([b], dtype="<i4").tobytes() for b in (dst_block, src_block)]
            return _wire.push_request(_wire.PushRequest(rid, ids[0], ids[1], 5.0, reader=reader))

        agent.send_notif(peer.name, request(201, 1, 5, b"\x01" * 8))  # another process's
        agent.send_notif(peer.name, request(202, 3, 6, own))  # ours, handled after it
        dst._wake_drainer()
        with anyio.fail_after(10):  # (the server counts the push once it saw the write end)
            while not np.array_equal(dst_cache[0][3], src_cache[0][6]) or src.metrics().pushes_served < 1:
                await anyio.sleep(0.01)
        assert np.array_equal(dst_cache[0][1], before)
        assert src.metrics().pushes_served == 1 and src.metrics().pushes_refused == 0


def test_lost_reads_are_never_forgotten_only_folded_into_a_watermark() -> None:
    lost = _push.LostReads(per_reader=3, readers=2)
    for rid in (5, 6, 7, 9):
        lost.add("r", b"A", rid)
    assert all(lost.holds("r", b"A", rid) for rid in (4, 5, 6, 7, 9))  # 5 folded: <= 5 lost
    assert not lost.holds("r", b"A", 8) and not lost.holds("r", b"A", 10)
    assert not lost.holds("r", b"B", 9)  # another process of that name
    lost.add("r", b"B", 2)
    lost.keep_only("r", b"B")  # B is the process admitted as "r" now: A's cancels are ignored
    assert not lost.holds("r", b"A", 9) and lost.holds("r", b"B", 2)
    lost.add("q", b"C", 1)
    lost.add("p", b"D", 1)  # past two entries: the one lost from longest ago goes
    assert not lost.holds("r", b"B", 2) and lost.holds("q", b"C", 1) and lost.holds("p", b"D", 1)


# ---- staging slots -----------------------------------------------------------------------

async def test_a_read_larger_than_the_staging_slots_lands_in_rounds() -> None:
    """Four slots: a 40-block read goes in rounds of two (half the slots: one stuck round
    never strands them all), sixteen one-block reads share them, every byte lands where it
    was asked to, and the notify comes once, at the end."""
    src_cache = numpy_cache(64, 16384, 2, seed=12)
    dst_cache = numpy_cache(48, 16384, 2)
    config = aionixl.EngineConfig(read_mode="push", push_staging_bytes=4 * 2 * 16384)
    tuning = aionixl.lowlevel.Tuning(push_chunk_bytes=64 << 10)
    async with engine_pair(src_cache, dst_cache, config=config, tuning=tuning) as (src, dst, peer):
        assert dst.metrics().staging_slots == 4 and _wire.STAGED_FEATURE in peer.features
        remote = [63 - 3 * i % 64 for i in range(40)]
        result = await dst.transfer_blocks(peer, list(range(40)), remote, notify=b"req-r", timeout=20)
        assert result.blocks == 40 and result.nbytes == 40 * 2 * 16384
        await src.wait_notification(b"req-r", timeout=10)
        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(dst.transfer_blocks, peer, [i + 40 if i < 8 else i - 8], [i])
        for mine, theirs in zip(dst_cache, src_cache, strict=True):
            assert np.array_equal(mine[8:40], theirs[remote[8:]])
            assert np.array_equal(mine[40:48], theirs[:8]) and np.array_equal(mine[:8], theirs[8:16])
        with anyio.fail_after(5):
            while src.metrics().pushes_served < 20 + 16:  # 40 blocks in 20 rounds
                await anyio.sleep(0.01)
        assert src.metrics().pushes_served == 20 + 16
        with pytest.raises(TimeoutError):  # the notify came once
            await src.wait_notification(b"req-r", timeout=0.2)
        metrics = dst.metrics()
        assert metrics.staging_stranded == 0 and metrics.staging_exhausted == 0
        assert dst._local.staging is not None and dst._local.staging.free == 4
    assert zero_resources(src) and zero_resources(dst)


async def test_with_every_slot_stranded_a_push_read_is_refused_until_one_comes_back() -> None:
    """Never into the caller's blocks directly: a read whose slots could take a late write
    is worse than a clear error."""
    src_cache = numpy_cache(8, 4096, 1, seed=4)
    dst_cache = numpy_cache(8, 4096, 1)
    config = aionixl.EngineConfig(read_mode="push", push_staging_bytes=2 * 4096)
    async with engine_pair(src_cache, dst_cache, config=config) as (src, dst, peer):
        staging = dst._local.staging
        assert staging is not None
        slots = await staging.acquire(2)
        assert slots is not None
        staging.settle(slots, False, "gone", 7, b"proc")  # as a read that ended unconfirmed
        with pytest.raises(aionixl.TransferError, match="no staging slot is usable"):
            await dst.transfer_blocks(peer, [0, 1], [5, 6], timeout=10)
        assert dst.metrics().staging_exhausted == 1 and dst.metrics().staging_stranded == 2
        assert not dst_cache[0][:2].any() and src.metrics().pushes_served == 0  # nothing asked
        staging.confirmed_late("gone", 7)
        await dst.transfer_blocks(peer, [2, 3], [1, 2], timeout=10)
        assert dst.metrics().staging_reclaimed == 2 and dst.metrics().staging_stranded == 0
        assert np.array_equal(dst_cache[0][2:4], src_cache[0][[1, 2]])


async def test_a_round_never_sent_strands_no_slot(monkeypatch: pytest.MonkeyPatch) -> None:
    """The request could not be sent: the server was never asked, so the round's slots are
    free again at once."""
    async with engine_pair(numpy_cache(8, 4096, 1, seed=2), numpy_cache(8, 4096, 1),
                           config=PUSH, tuning=SMALL_CHUNKS) as (src, dst, peer):
        staging, agent = dst._local.staging, dst._local.agent
        assert staging is not None and agent is not None

        def refuse(peer: str, message: bytes) -> None:
            raise aionixl.TransferError("injected: the notification could not be sent")

        with monkeypatch.context() as patch:
            patch.setattr(agent, "send_notif", refuse)
            for _ in range(3):
                with pytest.raises(aionixl.TransferError, match="injected"):
                    await dst.transfer_blocks(peer, [0, 1], [0, 1], timeout=10)
        assert dst.metrics().staging_stranded == 0 and staging.free == staging.slots
        assert src.metrics().pushes_served == 0
        await dst.transfer_blocks(peer, [0], [3], timeout=10)


async def test_closing_wakes_a_read_waiting_for_slots() -> None:
    src_cache = numpy_cache(8, 4096, 1, seed=8)
    config = aionixl.EngineConfig(read_mode="push", push_staging_bytes=2 * 4096)
    async with engine_pair(src_cache, numpy_cache(8, 4096, 1), config=config) as (_, dst, peer):
        staging = dst._local.staging
        assert staging is not None
        held = await staging.acquire(2)  # every slot busy
        assert held is not None
        outcome: list[BaseException] = []

        async def read() -> None:
            try:
                await dst.transfer_blocks(peer, [0], [1], timeout=60)
            except BaseException as exc:
                outcome.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(read)
            await anyio.sleep(0.1)
            assert not outcome  # waiting for a slot
            with anyio.fail_after(10):
                await dst.aclose()
        assert len(outcome) == 1 and isinstance(outcome[0], aionixl.EngineClosedError), outcome


async def test_a_read_waiting_for_slots_when_its_server_restarts_fails_instead_of_reading_the_new_one(
        ) -> None:
    """A push read waits for staging slots; meanwhile its server closes and a new engine of
    that name is connected. Once slots are free the read must fail: a request sent by name
    went to the new process, which served its own blocks as the old one's."""
    name = unique("src")
    config = aionixl.EngineConfig(read_mode="push", push_staging_bytes=2 * 4096)
    old_cache, new_cache, dst_cache = numpy_cache(8, 4096, 1, seed=8), numpy_cache(8, 4096, 1, seed=9), \
        numpy_cache(8, 4096, 1)
    before = dst_cache[0][0].copy()
    async with aionixl.Engine(unique("dst"), dst_cache, config=config) as dst:
        staging = dst._local.staging
        assert staging is not None
        outcome: list[object] = []
        async with aionixl.Engine(name, old_cache, listen="tcp://127.0.0.1:0", config=config) as old:
            peer = await dst.connect(old.address, timeout=10)
            held = await staging.acquire(2)  # every slot busy: the read waits
            assert held is not None

            async def read() -> None:
                try:
                    outcome.append(await dst.transfer_blocks(peer, [0], [1], timeout=30))
                except Exception as exc:
                    outcome.append(exc)

            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await anyio.sleep(0.1)
                assert not outcome
                await old.aclose()  # its goodbye drops our peer
                with anyio.fail_after(10):
                    while peer.connected:
                        await anyio.sleep(0.01)
                async with aionixl.Engine(name, new_cache, listen="tcp://127.0.0.1:0", config=config) as new:
                    await dst.connect(new.address, timeout=10)  # that name is another process now
                    staging.settle(held, True, name, 0, b"")  # slots free: the read goes on
                    with anyio.fail_after(10):
                        while not outcome:
                            await anyio.sleep(0.01)
        assert len(outcome) == 1 and isinstance(outcome[0], aionixl.PeerDisconnectedError), outcome
        assert np.array_equal(dst_cache[0][0], before)


async def test_a_reader_without_staging_reads_directly_and_its_staged_requests_are_refused() -> None:
    src_cache = numpy_cache(8, 4096, 1, seed=6)
    dst_cache = numpy_cache(8, 4096, 1)
    async with aionixl.Engine(unique("src"), src_cache, listen="tcp://127.0.0.1:0", config=PUSH,
                              tuning=SMALL_CHUNKS) as src, \
            aionixl.Engine(unique("dst"), dst_cache, listen=None,
                           config=aionixl.EngineConfig(read_mode="push", push_staging_bytes=0)) as dst:
        assert dst.metrics().staging_slots == 0 and src.metrics().staging_slots > 0
        peer = await dst.connect(src.address, timeout=10)
        await dst.transfer_blocks(peer, [0, 1], [3, 4], timeout=10)
        assert np.array_equal(dst_cache[0][:2], src_cache[0][[3, 4]])
        assert dst._local.agent is not None
        rec = _push._Read(peer, 901)
        dst._push.reads[901] = rec
        ids = np.array([2], dtype="<i4").tobytes()
        dst._local.agent.send_notif(peer.name, _wire.push_request(
            _wire.PushRequest(901, ids, ids, 5.0, staged=True)))
        dst._wake_drainer()
        with anyio.fail_after(10):
            await rec.event.wait()
        assert rec.state == _push.ReadState.FAILED and "announced none" in str(rec.error)
        dst._push.reads.clear()


# ---- no late bytes -----------------------------------------------------------------------

GEOMETRY: dict[str, Any] = {"num_blocks": 16, "block_shape": (4 << 20,), "dtypes": ("uint8",)}

def _late(cache: list[np.ndarray], pattern: int) -> int:
    return sum(int(np.count_nonzero(r != pattern)) for r in cache)


async def _until_bytes_arrive(cache: list[np.ndarray]) -> None:
    with anyio.fail_after(20):
        while not any(r[:, :64].any() for r in cache):
            await anyio.sleep(0)


async def test_no_late_bytes_after_a_cancelled_or_timed_out_get_over_shared_memory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """GET mode where auto picks it (one host, shared memory): after the call returns, the
    caller's blocks keep what it wrote. Here UCX mostly finishes such a GET inside its post
    (64 MiB in ~50 ms, measured), so the 5 ms timeout does not fire and the cancel finds the
    read done: each call is checked for what did happen (a complete read has exact bytes and
    was not fenced; an aborted one was fenced). The fence that has something to wait for is
    tested over UCX TCP in tests/test_fence.py."""
    monkeypatch.delenv("UCX_TLS", raising=False)
    local = numpy_cache(16, 4 << 20, 1)
    ids = list(range(16))
    config = aionixl.EngineConfig(read_mode="get")
    async with RemoteEngine(seed=1234, **GEOMETRY) as child, \
            aionixl.Engine(unique("dec"), local, listen=None, config=config) as eng:
        peer = await eng.connect(child.address, timeout=30)
        assert peer.read_mode == "get"
        await eng.transfer_blocks(peer, ids, ids, timeout=30)
        expected = child.expected()[0].numpy()
        fenced: list[str] = []
        real_fence = eng._direct.fence

        async def fence(peer: aionixl.Peer, local_idx: _nixl.Indices, remote_idx: _nixl.Indices,
                        parts: Any = None) -> None:
            fenced.append(leave)
            await real_fence(peer, local_idx, remote_idx, parts)

        eng._direct.fence = fence  # type: ignore[method-assign]
        outcomes: list[str] = []

        async def read(timeout: float) -> None:
            try:
                await eng.transfer_blocks(peer, ids, ids, timeout=timeout)
            except aionixl.TransferTimeoutError as exc:
                assert f"did not finish within {timeout} s" in str(exc)
                outcomes.append("timed out")
                return
            outcomes.append("done")  # before any checkpoint: a cancel cannot come between

        for leave in ("cancel", "timeout") * 2:
            local[0][:] = 0
            outcomes.clear()
            if leave == "cancel":
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read, 30.0)
                    await _until_bytes_arrive(local)
                    tg.cancel_scope.cancel()
            else:
                await read(0.005)
            outcome = outcomes[0] if outcomes else "cancelled"
            assert outcome in (("done", "cancelled") if leave == "cancel" else ("done", "timed out"))
            if outcome == "done":
                assert np.array_equal(local[0], expected) and leave not in fenced, (leave, fenced)
            else:
                assert fenced.count(leave) == 1, (leave, fenced)  # the aborted read was fenced
            fenced.clear()
            local[0][:] = 0x5A
            await anyio.sleep(0.3)  # the engine keeps progressing meanwhile
            assert _late(local, 0x5A) == 0, (leave, outcome)
            assert eng.live_resources()["transfer_handles"] == 0
        assert peer.connected and eng.metrics().fence_evictions == 0
        await eng.transfer_blocks(peer, ids, ids, timeout=30)
        assert np.array_equal(local[0], expected)
        assert child.running
    assert zero_resources(eng)


#: Stand-in handles of ``_stuck_read_then_fence``: never NIXL's; release_xfer passes them.
READ_HANDLE, FENCE_HANDLE = -1000, -1001


def _stuck_read_then_fence(engine: aionixl.Engine, fence_check: Any) -> list[int]:
    """From now on the engine's next read never ends, and its fence read's state checks
    return (or raise) what ``fence_check()`` does. Returns the posts' descriptor counts."""
    agent = engine._local.agent
    assert agent is not None
    real_start, real_check = agent.start_xfer, agent.check
    posts: list[int] = []

    def start_xfer(*args: Any) -> Any:
        posts.append(len(args[2]))
        handle, state = real_start(*args)
        if len(posts) <= 2:  # the read, then its fence: NIXL's own requests released
            if handle != _nixl.NO_HANDLE:
                agent.release_xfer(handle)
            return -999 - len(posts), _nixl.PROC
        return handle, state

    def check(handle: int) -> Any:
        if handle == READ_HANDLE:
            return _nixl.PROC
        if handle == FENCE_HANDLE:
            return fence_check()
        return real_check(handle)

    agent.start_xfer = start_xfer  # type: ignore[method-assign, assignment]
    agent.check = check  # type: ignore[method-assign]
    return posts


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_cancel_that_cuts_a_push_reads_fence_short_evicts_the_peer() -> None:
    """A push read is cancelled (asyncio's own Task.cancel()); its fence asks the server to
    stop and waits for the answer. A second cancel, which anyio's shield does not hold back
    on asyncio, cuts that wait short: nothing confirmed the server stopped writing into our
    blocks, so the peer is evicted, as when the wait times out."""
    import asyncio

    config = aionixl.EngineConfig(read_mode="push")
    tuning = aionixl.lowlevel.Tuning(push_cancel_timeout=5.0)
    async with engine_pair(numpy_cache(8, 1024, 2, seed=3), numpy_cache(8, 1024, 2), config, tuning=tuning) \
            as (src, dst, peer):
        assert peer.read_mode == "push"
        await dst.transfer_blocks(peer, [0], [0])
        # The server takes push requests and cancels in, and answers none of them.
        src._push.heard = lambda name, message: message.startswith(_wire.PUSH_FAMILY)  # type: ignore[method-assign]
        reader = asyncio.get_running_loop().create_task(dst.transfer_blocks(peer, [1], [1], timeout=30))
        with anyio.fail_after(5):
            while not dst._push.reads:
                await anyio.sleep(0.01)
            reader.cancel()  # leaves the read: its fence asks the server to stop, and waits
            await anyio.sleep(0.2)
            assert not reader.done() and peer.connected
            reader.cancel()
            with pytest.raises(asyncio.CancelledError):
                await reader
        assert not peer.connected and dst.metrics().fence_evictions == 1
        assert dst.live_resources()["in_flight"] == 0


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_on_asyncio_a_cancel_landing_after_the_fence_finished_keeps_the_peer() -> None:
    """A lone GET read is cancelled (asyncio's own Task.cancel(), which anyio's shield does
    not hold back) and fences the aborted read. A second cancel lands after the poller saw
    the fence finish but before the task ran again: the fence did confirm, so the peer is
    not evicted (before, it was, failing its other reads); the caller is still cancelled."""
    import asyncio

    config = aionixl.EngineConfig(read_mode="get")
    tuning = aionixl.lowlevel.Tuning(inline_polls=0)
    async with engine_pair(numpy_cache(8, 1024, 2, seed=3), numpy_cache(8, 1024, 2), config, tuning=tuning) \
            as (_src, dst, peer):
        assert peer.read_mode == "get"
        await dst.transfer_blocks(peer, [0], [0])
        reader: list[asyncio.Task[Any]] = []

        def fence_finished() -> Any:  # ... and the reader is cancelled before it runs
            reader[0].cancel()
            return _nixl.DONE

        posts = _stuck_read_then_fence(dst, fence_finished)

        async def read() -> None:
            await dst.transfer_blocks(peer, [1], [1], timeout=30)

        reader.append(asyncio.get_running_loop().create_task(read()))
        with anyio.fail_after(5):
            while READ_HANDLE not in dst._inflight.records:
                await anyio.sleep(0)
            reader[0].cancel()  # leaves the read: it fences
            with pytest.raises(asyncio.CancelledError):
                await reader[0]
        assert posts == [2, 1], posts  # the read (2 regions), then the fence
        assert peer.connected and dst.metrics().fence_evictions == 0
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0
        await dst.transfer_blocks(peer, [2, 3], [2, 3], timeout=10)  # the peer still serves


async def test_a_fence_that_fails_alone_evicts_the_peer() -> None:
    """A timed-out GET read is fenced, and NIXL fails the fence read itself (its state check
    raises; the poller fails that transfer but keeps the peer). Nothing confirmed the
    aborted read, so the peer is evicted as for a fence that timed out (before, it was
    kept, and the aborted read could still write after the call returned)."""
    config = aionixl.EngineConfig(read_mode="get")
    tuning = aionixl.lowlevel.Tuning(inline_polls=0)
    async with engine_pair(numpy_cache(8, 1024, 2, seed=4), numpy_cache(8, 1024, 2), config, tuning=tuning) \
            as (_src, dst, peer):
        await dst.transfer_blocks(peer, [0], [0])

        def fence_failed() -> Any:
            raise aionixl.TransferError("the fence read failed")

        posts = _stuck_read_then_fence(dst, fence_failed)
        with anyio.fail_after(5), pytest.raises(aionixl.TransferTimeoutError):
            await dst.transfer_blocks(peer, [1], [1], timeout=0.2)
        assert posts == [2, 1], posts  # the read (2 regions), then the fence
        assert not peer.connected and dst.metrics().fence_evictions == 1
        live = dst.live_resources()
        assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_no_late_bytes_after_a_push_read_from_a_stopped_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """The server stops mid-push (SIGSTOP) and cannot confirm the cancel: the reader evicts it
    at the deadline plus push_cancel_timeout. UCX cannot stop the chunk it had under way, and
    once the server runs again the rest of that chunk lands: in the reader's staging slots,
    never in the caller's blocks. Those slots stay out of use until the server confirms the
    chunk ended, then come back (docs/read-modes.md)."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    local = numpy_cache(16, 4 << 20, 1)
    ids = list(range(16))
    tuning = aionixl.lowlevel.Tuning(push_cancel_timeout=0.5)
    async with RemoteEngine(seed=1234, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("dec"), local, listen=None, tuning=tuning) as eng:
        staging = eng._local.staging
        # 16 slots (as many as the engine has blocks): two rounds of 8, half the slots each.
        assert staging is not None and staging.slots == len(ids)
        per_round = len(ids) // 2
        slots = [staging._buffer.reshape(staging.slots, -1)]
        peer = await eng.connect(child.address, timeout=30)
        assert peer.read_mode == "push"
        await eng.transfer_blocks(peer, [0], [0], timeout=30)
        assert np.array_equal(local[0][0], child.expected()[0].numpy()[0])
        local[0][:] = 0
        staging._buffer[:] = 0
        outcome: list[BaseException] = []

        async def read() -> None:
            try:
                await eng.transfer_blocks(peer, ids, ids, timeout=1.0)
            except aionixl.TransferError as exc:
                outcome.append(exc)

        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(read)
                await _until_bytes_arrive(slots)
                await child.pause()
            assert len(outcome) == 1 and isinstance(outcome[0], aionixl.TransferTimeoutError)
            assert not peer.connected and eng.metrics().fence_evictions == 1
            assert eng.metrics().staging_stranded == per_round  # the round under way
            assert _late(local, 0) == 0  # nothing of it reached the caller's blocks
            local[0][:] = 0x5A
        finally:
            await child.resume()
        await anyio.sleep(1.0)
        assert _late(local, 0x5A) == 0, "bytes landed in the caller's blocks after the read failed"
        # Evicted only to fence the read: the same Peer reconnects on its next use; the
        # server, running again, confirms the chunk it had stuck, and the slots come back.
        await eng.transfer_blocks(peer, ids, ids, timeout=30)
        assert peer.connected and eng.peers[peer.name] is peer
        assert np.array_equal(local[0], child.expected()[0].numpy())
        with anyio.fail_after(10):
            while eng.metrics().staging_stranded:
                await anyio.sleep(0.05)
        assert eng.metrics().staging_reclaimed == per_round and eng.metrics().staging_exhausted == 0
        assert child.running
    assert zero_resources(eng)


async def test_a_call_that_first_reconnects_a_fenced_peer_keeps_its_own_deadline(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A peer evicted to fence a timed-out read reconnects inside the next call; that call's
    timeout counts from the call, not from the end of the reconnect: a transfer that then
    stalls raises within the timeout plus push_cancel_timeout, as any timed-out read does."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    tuning = aionixl.lowlevel.Tuning(push_cancel_timeout=0.5)
    async with RemoteEngine(seed=77, env={"UCX_TLS": "tcp"}, **GEOMETRY) as child, \
            aionixl.Engine(unique("dec"), numpy_cache(16, 4 << 20, 1), listen=None, tuning=tuning) as eng:
        peer = await eng.connect(child.address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0], timeout=30)
        async with child.paused():
            with pytest.raises(aionixl.TransferTimeoutError):
                await eng.transfer_blocks(peer, [1], [1], timeout=0.3)
        assert not peer.connected and eng.metrics().fence_evictions == 1
        reconnect = eng._transfers._reconnect

        async def slow_reconnect(address: str, limit: float) -> aionixl.Peer:
            await anyio.sleep(1.0)  # a slow handshake: a second of the call's deadline
            revived = await reconnect(address, limit)
            await child.pause()  # the transfer that follows stalls
            return revived

        monkeypatch.setattr(eng._transfers, "_reconnect", slow_reconnect)
        try:
            started = anyio.current_time()
            with pytest.raises(aionixl.TransferTimeoutError):
                await eng.transfer_blocks(peer, [2], [2], timeout=1.5)
            elapsed = anyio.current_time() - started
        finally:
            await child.resume()
        # The deadline (1.5 s) plus push_cancel_timeout (0.5 s), and scheduling; a fresh
        # 1.5 s after the reconnect's second would make it 3 s or more.
        assert 1.5 <= elapsed < 2.6, elapsed
    assert zero_resources(eng)


async def test_a_fenced_peer_that_came_back_as_another_peer_object_is_read_through_that_one() -> None:
    """A peer evicted to fence a read is kept for reconnecting; if that engine connects to
    us first, its handshake admits a new Peer object, and the reconnect returns that one.
    The next call with the old object goes through the new one (the same process), exact:
    it used to post on the old object's released descriptor list."""
    cache_a, cache_b = numpy_cache(8, 4096, 2), numpy_cache(8, 4096, 2, seed=5)
    async with aionixl.Engine(unique("a"), cache_a, listen="tcp://127.0.0.1:0") as a, \
            aionixl.Engine(unique("b"), cache_b, listen="tcp://127.0.0.1:0") as b:
        old = await a.connect(b.address, timeout=10)
        a._peers.evict_unfenced(old, "a test's unconfirmed cancel")
        assert not old.connected
        await b.connect(a.address, timeout=10)  # b admitted anew on a's side, inbound
        inbound = a.peers[b.name]
        assert inbound is not old and inbound.connected
        await a.transfer_blocks(old, [1, 2], [3, 4], timeout=10)
        for r in range(2):
            assert np.array_equal(cache_a[r][[1, 2]], cache_b[r][[3, 4]])
        assert a.peers[b.name] is inbound and not old.connected
    assert zero_resources(a) and zero_resources(b)


async def test_a_fenced_peer_whose_engine_restarted_meanwhile_is_not_read_from() -> None:
    """A peer evicted to fence a read reconnects on its next use only if the same process
    answers at its address: a restarted engine of that name has other blocks (a KV cache
    that started over), so the old Peer's calls raise PeerDisconnectedError and its
    blocks are never read as the old process's."""
    cache_a = numpy_cache(8, 4096, 2)
    async with aionixl.Engine(unique("a"), cache_a, listen="tcp://127.0.0.1:0") as a:
        name = unique("b")
        async with aionixl.Engine(name, numpy_cache(8, 4096, 2, seed=5),
                                  listen="tcp://127.0.0.1:0") as b:
            assert b.address is not None
            address = b.address
            old = await a.connect(address, timeout=10)
            a._peers.evict_unfenced(old, "a test's unconfirmed cancel")
        cache_again = numpy_cache(8, 4096, 2, seed=9)
        async with aionixl.Engine(name, cache_again, listen=address):
            with pytest.raises(aionixl.PeerDisconnectedError, match="restarted"):
                await a.transfer_blocks(old, [1], [3], timeout=10)
            with pytest.raises(aionixl.PeerDisconnectedError):  # and again, without reconnecting
                await a.transfer_blocks(old, [1], [3], timeout=10)
            assert not cache_a[0][1].any() and not old.connected
            new = await a.connect(address, timeout=10)  # connecting anew is how to use it
            assert new is not old
            await a.transfer_blocks(new, [1], [3], timeout=10)
            assert all(np.array_equal(cache_a[r][1], cache_again[r][3]) for r in range(2))
    assert zero_resources(a)


# ---- the scenario ----------------------------------------------------------------

#: Region size for the scenario; the held-out check uses 512 (tests/stress/leaving_readers.py).
LEAVE_MIB = int(os.environ.get("AIONIXL_LEAVE_MIB", "64"))


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])  # the readers' loops: no uvloop there
async def test_readers_leaving_mid_read_never_take_the_server_down(
        anyio_backend_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving engine over UCX TCP; one fresh reader process per way of leaving mid-read
    (aclose, disconnect, cancelled caller, timeout, SIGKILL), default configuration, readers on
    this test's backend. After each: the server is alive and serves exact bytes, the reader
    printed no UCX warning, and no byte of the abandoned read landed after the call returned."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    server = await start_server(LEAVE_MIB, 1 << 20)
    local = numpy_cache(LEAVE_MIB, 1 << 20, 1)
    try:
        async with aionixl.Engine(unique("checker"), local, listen=None) as checker:
            for n, way in enumerate(WAYS):
                r = run_reader(server, way, backend=anyio_backend_name, seed=n)
                assert r.returncode == (-signal.SIGKILL if way == "kill" else 0), r.output[-3000:]
                assert r.report.get("read_mode") == "push", r.report
                assert r.noise == [], (way, r.noise)
                assert r.report.get("late_bytes", 0) == 0, r.report
                if way != "kill":
                    assert all(v == 0 for v in r.report["resources"].values()), r.report
                await check_server(server, checker, local)
        assert ucx_noise(server.output()) == []
    finally:
        failure = await server.child.aclose()
    assert failure is None, failure
