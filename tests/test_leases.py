"""Leases: a prefill holds a request's blocks until its readers say they are done
(vLLM's ``"<id>:<readers>"``), heartbeats (vLLM's ``"HB:<id>,..."``) keep them alive, and
a lease whose readers vanish expires at its duration. Real engines, real transfers."""

from __future__ import annotations

import time

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
import aionixl.vllm
from aionixl._vllm_wire import parse_notification

from .helpers import engine_pair, numpy_cache, zero_resources

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 32, 4096, 2


def caches() -> tuple[list[np.ndarray], list[np.ndarray]]:
    return numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=5), numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)


def same_blocks(dst: list[np.ndarray], src: list[np.ndarray], ids: list[int]) -> bool:
    return all(np.array_equal(d[ids], s[ids]) for d, s in zip(dst, src, strict=True))


async def test_a_read_with_read_done_releases_the_lease_and_is_not_delivered_as_a_notification(
        ) -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        lease = src.lease("req-1", [3, 4, 5])
        assert src.leases["req-1"] is lease and not lease.done and lease.readers_done == 0
        assert lease.block_ids == (3, 4, 5) and lease.request_id == "req-1"
        assert lease.expires_at > time.monotonic() + 29
        await dst.transfer_blocks(peer, [0, 1, 2], [3, 4, 5], notify=aionixl.read_done("req-1"))
        with anyio.fail_after(10):
            await lease.wait()
        assert lease.done and lease.readers_done == 1 and "req-1" not in src.leases
        assert all(np.array_equal(d[[0, 1, 2]], s[[3, 4, 5]])
                   for d, s in zip(dst_cache, src_cache, strict=True))
        with pytest.raises(TimeoutError):  # the lease took it
            await src.wait_notification(b"req-1:1", timeout=0.2)
        m = src.metrics()
        assert (m.leases_active, m.leases_released, m.leases_expired) == (0, 1, 0)
    assert zero_resources(src) and zero_resources(dst)


async def test_a_lease_for_two_readers_waits_for_both() -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        lease = src.lease("req-2", [7], readers=2)
        await dst.transfer_blocks(peer, [7], [7], notify=aionixl.read_done("req-2", 2))
        with anyio.move_on_after(0.5):
            await lease.wait()
        assert lease.readers_done == 1 and not lease.done and "req-2" in src.leases
        await dst.transfer_blocks(peer, [8], [7], notify=aionixl.read_done("req-2", 2))
        with anyio.fail_after(10):
            await lease.wait()
        assert lease.done and lease.readers_done == 2
        assert src.metrics().leases_released == 1


async def test_a_read_done_that_counts_more_readers_holds_the_lease_for_them_all() -> None:
    """vLLM's decode at twice the prefill's TP reads with two ranks, each sending
    ``"<id>:2"``: a lease made for one reader waits for both, as a vLLM prefill would."""
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        lease = src.lease("req-tp", [9])
        await dst.transfer_blocks(peer, [9], [9], notify=aionixl.read_done("req-tp", 2))
        with anyio.move_on_after(0.5):
            await lease.wait()
        assert (lease.readers_done, lease.readers, lease.done) == (1, 2, False), lease
        await dst.transfer_blocks(peer, [10], [9], notify=aionixl.read_done("req-tp", 2))
        with anyio.fail_after(10):
            await lease.wait()
        assert lease.done and lease.readers_done == 2 and "req-tp" not in src.leases


async def test_a_lease_whose_reader_never_comes_expires_at_its_duration() -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, _dst, _peer):
        start = time.monotonic()  # before the lease: its duration counts from its creation
        lease = src.lease("req-3", [1, 2], duration=0.3)
        with pytest.raises(aionixl.LeaseExpiredError, match="req-3"):
            await lease.wait()
        elapsed = time.monotonic() - start
        assert 0.3 <= elapsed < 0.3 + 0.25, elapsed
        assert lease.done and "req-3" not in src.leases
        with pytest.raises(aionixl.LeaseExpiredError):  # again, for any later waiter
            await lease.wait()
        m = src.metrics()
        assert (m.leases_active, m.leases_released, m.leases_expired) == (0, 0, 1)
        src.lease("req-3", [1, 2])  # the id is free again


async def test_heartbeats_keep_a_lease_alive_past_several_durations() -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        lease = src.lease("req-4", [9], duration=0.3)
        before = lease.expires_at
        start = time.monotonic()
        while time.monotonic() - start < 1.0:  # more than three durations
            await aionixl.vllm.heartbeat(dst, peer, ["req-4", "someone-elses"])
            with anyio.move_on_after(0.1):
                await lease.wait()
            assert not lease.done, "expired although heartbeats kept coming"
        assert lease.expires_at > before + 0.5
        assert src._leases.unknown >= 5  # the other id, counted and dropped
        await dst.transfer_blocks(peer, [9], [9], notify=aionixl.read_done("req-4"))
        with anyio.fail_after(10):
            await lease.wait()
        assert src.metrics().leases_expired == 0


async def test_closing_the_engine_ends_every_lease() -> None:
    src_cache, dst_cache = caches()
    errors: list[BaseException] = []
    async with engine_pair(src_cache, dst_cache) as (src, _dst, _peer):
        lease = src.lease("req-5", [0])

        async def waiter() -> None:
            try:
                await lease.wait()
            except aionixl.EngineClosedError as exc:
                errors.append(exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(waiter)
            await anyio.sleep(0.05)
            await src.aclose()
    assert len(errors) == 1 and lease.done and not src.leases
    with pytest.raises(aionixl.EngineClosedError):
        src.lease("req-6", [0])


async def test_cancel_ends_a_lease_and_its_waiters_hear_why() -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, _dst, _peer):
        lease = src.lease("req-7", [0, 1])
        lease.cancel()
        lease.cancel()  # idempotent
        with pytest.raises(aionixl.LeaseCancelledError):
            await lease.wait()
        assert lease.done and "req-7" not in src.leases


async def test_bad_input_is_refused_before_anything_is_held() -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, _dst, _peer):
        src.lease("live", [0])
        for kwargs, match in (
                ({"request_id": "", "block_ids": [0]}, "non-empty"),
                ({"request_id": "live", "block_ids": [1]}, "already live"),
                ({"request_id": "HB:x", "block_ids": [1]}, "HB:"),
                ({"request_id": "a,b", "block_ids": [1]}, "','"),
                ({"request_id": "r", "block_ids": [BLOCKS]}, "outside the cache"),
                ({"request_id": "r", "block_ids": [-1]}, "outside the cache"),
                ({"request_id": "r", "block_ids": [True]}, "ints"),
                ({"request_id": "r", "block_ids": [0], "readers": 0}, "readers"),
                ({"request_id": "r", "block_ids": [0], "duration": 0}, "duration"),
                ({"request_id": "r", "block_ids": [0], "duration": float("inf")}, "duration"),
                ({"request_id": "r", "block_ids": [0], "duration": 2**2000}, "duration"),
                ({"request_id": "r", "block_ids": 5}, "iterable of ints"),
                ({"request_id": "r", "block_ids": None}, "iterable of ints")):
            with pytest.raises(ValueError, match=match):
                src.lease(**kwargs)  # type: ignore[arg-type]
        assert list(src.leases) == ["live"]


async def test_a_lease_id_with_the_reserved_prefix_is_refused_since_no_read_done_could_name_it(
        ) -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        rid = "\x00aionixl-job"
        with pytest.raises(ValueError, match="reserved"):  # what its reader would have to send
            await dst.transfer_blocks(peer, [0], [0], notify=aionixl.read_done(rid))
        with pytest.raises(ValueError, match="reserved prefix"):
            src.lease(rid, [0])
        assert not src.leases


async def test_drain_waits_for_a_live_lease_until_its_reader_is_done() -> None:
    """A prefill drains before it exits so that decoders are not cut off mid-read: a live
    lease is such a decoder."""
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        lease = src.lease("req-drain", [2, 3])
        drained: list[bool] = []

        async def drain() -> None:
            drained.append(await src.drain(timeout=10))

        async with anyio.create_task_group() as tg:
            tg.start_soon(drain)
            await anyio.sleep(0.3)
            assert not drained and not lease.done  # its reader has not read yet
            await dst.transfer_blocks(peer, [0, 1], [2, 3], notify=aionixl.read_done("req-drain"))
        assert drained == [True] and lease.done and lease.readers_done == 1
        assert all(np.array_equal(d[[0, 1]], s[[2, 3]]) for d, s in zip(dst_cache, src_cache, strict=True))


async def test_drain_gives_up_on_a_lease_nobody_releases_and_says_so(
        caplog: pytest.LogCaptureFixture) -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, _dst, _peer):
        lease = src.lease("req-stuck", [2])
        assert await src.drain(timeout=0.3) is False
        assert "1 lease(s) live" in caplog.text and not lease.done


async def test_drain_does_not_wait_past_a_leases_expiry() -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, _dst, _peer):
        start = time.monotonic()
        lease = src.lease("req-gone", [2], duration=0.3)
        assert await src.drain(timeout=10) is True
        assert 0.25 <= time.monotonic() - start < 3
        with pytest.raises(aionixl.LeaseExpiredError):
            await lease.wait()


async def test_a_message_shaped_like_read_done_without_a_lease_goes_to_wait_notification() -> None:
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        await dst.transfer_blocks(peer, [0], [0], notify=b"job-9:1")
        note = await src.wait_notification(b"job-9:1", timeout=10)
        assert note.message == b"job-9:1"


def test_the_wire_is_vllms() -> None:
    assert aionixl.read_done("req-1") == b"req-1:1"
    assert parse_notification(aionixl.read_done("a:b", 3)) == ("a:b", 3)
    assert aionixl.read_done("x", 2) == aionixl.vllm.read_notification("x", 2)


@pytest.mark.parametrize("read_mode", ["push", "auto"])
async def test_concurrent_readers_release_their_leases_in_push_and_through_coalescing(
        read_mode: str) -> None:
    """Forty readers at once, each with a lease of its own: merged into shared NIXL requests
    (one process: GET) or served as push reads; every lease released, every byte in place."""
    src_cache, dst_cache = caches()
    config = aionixl.EngineConfig(read_mode=read_mode)  # type: ignore[arg-type]
    tuning = aionixl.lowlevel.Tuning(coalesce_window=0.05)
    async with engine_pair(src_cache, dst_cache, config, tuning=tuning) as (src, dst, peer):
        assert peer.read_mode == ("push" if read_mode == "push" else "get")
        leases = [src.lease(f"r{i}", [i % BLOCKS]) for i in range(40)]

        async def read(i: int) -> None:
            await dst.transfer_blocks(peer, [i % BLOCKS], [i % BLOCKS], timeout=20,
                                      notify=aionixl.read_done(f"r{i}"))

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(40):
                    tg.start_soon(read, i)
            for lease in leases:
                await lease.wait()
        if read_mode == "auto":
            assert dst.metrics().merged_requests >= 1
        assert not src.leases and src.metrics().leases_released == 40
        assert same_blocks(dst_cache, src_cache, list(range(BLOCKS)))


async def test_poll_nixl_leaves_a_live_leases_read_done_to_the_lease() -> None:
    """``aionixl.lowlevel.poll_nixl`` (a serving process that progresses NIXL itself) hands callers what is
    theirs; a live lease's read-done releases the lease, as through the drainer."""
    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        lease = src.lease("req-poll", [11])
        await dst.transfer_blocks(peer, [11], [11], notify=aionixl.read_done("req-poll"))
        notes: list[aionixl.Notification] = []
        for _ in range(100_000):  # no await: the drainer does not run meanwhile
            aionixl.lowlevel.poll_nixl(dst)
            notes += aionixl.lowlevel.poll_nixl(src)
            if lease.done or notes:
                break
        assert lease.done and lease.readers_done == 1, (lease, notes)
        assert notes == []


async def test_a_message_relayed_by_the_vllm_serving_process_cannot_speak_for_a_peer() -> None:
    """vLLM decoders name their own agents: one whose notification the serving process
    relays could pass for an admitted peer. The engine's reserved messages are not taken
    from the relay: a goodbye in a peer's name does not drop it."""
    from aionixl._notifications import Notification
    from aionixl._wire import goodbye

    src_cache, dst_cache = caches()
    async with engine_pair(src_cache, dst_cache) as (src, dst, peer):
        inbound = src.peers[dst.name]
        src._relayed(Notification(dst.name, goodbye(aionixl.lowlevel.nixl_metadata(dst))))
        assert inbound.connected and src.peers[dst.name] is inbound
        await dst.transfer_blocks(peer, [1], [2], timeout=10)
