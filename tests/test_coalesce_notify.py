"""Coalesced transfers and notifications: each arrives once and after its data, also
when a merged write is posted again (tags), and a peer without tags gets no merged
notifications."""

from __future__ import annotations

import random
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
from aionixl import _nixl

from .helpers import (
    BLOCK_BYTES,
    BLOCKS,
    REGIONS,
    STAND_IN,
    TOGETHER,
    engine_pair,
    gathering_next,
    merged,
    numpy_cache,
    together,
)

pytestmark = pytest.mark.anyio


@pytest.mark.parametrize("warm", [False, True], ids=["first-calls", "fast-path"])
async def test_each_notification_arrives_once_and_after_its_data(warm: bool) -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=3)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=4)
    async with engine_pair(src_cache, dst_cache, tuning=TOGETHER) as (src, dst, peer):
        if warm:
            # Every block below seen once (crosswise, so that no data is in place yet): the
            # one-block calls then join on the fast path, notifications and all.
            for i in range(16):
                await dst.transfer_blocks(peer, [i], [32 + i])
                await dst.transfer_blocks(peer, [32 + i], [i])
        dst_before = [r.copy() for r in dst_cache]
        seen: list[bytes] = []

        async def write(i: int) -> None:
            await dst.transfer_blocks(peer, [i], [i], op="write", notify=b"w-%d" % i)

        async def read(i: int) -> None:
            await dst.transfer_blocks(peer, [32 + i], [32 + i], op="read", notify=b"r-%d" % i)

        async def watch(i: int) -> None:
            note = await src.wait_notification(b"w-%d" % i, timeout=30)
            # The target sees the notification only once this caller's block is in place.
            for region in range(REGIONS):
                assert np.array_equal(src_cache[region][i], dst_before[region][i])
            seen.append(note.message)

        async with anyio.create_task_group() as tg:
            for i in range(16):
                tg.start_soon(watch, i)
            await anyio.sleep(0.05)
            for i in range(16):
                tg.start_soon(write, i)
                tg.start_soon(read, i)
        for i in range(16):
            note = await src.wait_notification(b"r-%d" % i, timeout=30)
            assert note.peer == dst.name
        assert sorted(seen) == sorted(b"w-%d" % i for i in range(16))
        requests, calls = merged(dst)
        assert requests >= 1 and calls > requests
        # Exactly once: nothing left over, nothing else arrives.
        await anyio.sleep(0.1)
        assert src.metrics().notifications_kept == 0
        with pytest.raises(TimeoutError):
            await src.wait_notification(b"w-0", timeout=0.2)


async def _notify_writes_with_one_post_stuck(src: aionixl.Engine, dst: aionixl.Engine,
                                              peer: aionixl.Peer) -> tuple[list[bytes], dict[int, object]]:
    """Writes of blocks 1 (timeout 0.5 s), 3 and 4 (15 s), each with ``notify=b"n-<block>"``,
    called together. Every post finishes (data and notification) inside it, but the first
    that carries ``n-1`` is reported running for ever, so that its callers time out or
    leave. Returns the notifications posted, in order, and each call's result or
    ``TransferTimeoutError``."""
    agent, real_start, real_check = await gathering_next(src, dst, peer)
    stuck = STAND_IN
    posts: list[bytes] = []

    def start_xfer(op: str, local: int, local_idx: Any, remote: int, remote_idx: Any,
                   notify: bytes, polls: int) -> Any:
        posts.append(notify)
        handle, state = real_start(op, local, local_idx, remote, remote_idx, notify, polls)
        assert (handle, state) == (_nixl.NO_HANDLE, _nixl.DONE)
        if b"n-1" in notify and sum(b"n-1" in p for p in posts) == 1:
            return stuck, _nixl.PROC
        return handle, state

    def check(handle: int) -> Any:
        return _nixl.PROC if handle == stuck else real_check(handle)

    agent.start_xfer = start_xfer  # type: ignore[method-assign]
    agent.check = check  # type: ignore[method-assign]
    outcomes = await together(lambda block, timeout: dst.transfer_blocks(
        peer, [block], [block], "write", notify=b"n-%d" % block, timeout=timeout), {1: 0.5, 3: 15, 4: 15})
    assert isinstance(outcomes[1], aionixl.TransferTimeoutError), outcomes
    assert all(isinstance(outcomes[b], aionixl.TransferResult) for b in (3, 4)), outcomes
    return posts, outcomes


async def _heard_once(src: aionixl.Engine, dst: aionixl.Engine, blocks: tuple[int, ...]) -> None:
    """Each of ``blocks``' notifications reached ``src`` once, nothing is kept unclaimed."""
    for block in blocks:
        assert (await src.wait_notification(b"n-%d" % block, timeout=10)).peer == dst.name
    await anyio.sleep(0.2)
    assert src.metrics().notifications_kept == 0
    for block in blocks:
        with pytest.raises(TimeoutError):
            await src.wait_notification(b"n-%d" % block, timeout=0.2)
    live = dst.live_resources()
    assert live["in_flight"] == 0 and live["transfer_handles"] == 0


async def test_a_merged_write_posted_again_after_a_member_left_notifies_the_others_once() -> None:
    """A member leaves a merged write with notifications that NIXL already finished (its
    notification delivered) but the engine still saw running: the request is aborted and
    posted again for the rest. The target must hear each remaining caller once, not once
    per post: the re-post carries the first post's tag, and the target drops a tag it has
    already delivered (both sides announce "tagged-notify")."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=35)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=36)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (src, dst, peer):
        assert "tagged-notify" in peer.features
        posts, _ = await _notify_writes_with_one_post_stuck(src, dst, peer)
        assert len(posts) == 2 and merged(dst) == (1, 3) and dst.metrics().reposts == 1, posts
        for block in (3, 4):
            for region in range(REGIONS):
                assert np.array_equal(src_cache[region][block], dst_cache[region][block])
        # The first post's own notifications, the leaver's included, arrived with it.
        await _heard_once(src, dst, (1, 3, 4))


async def test_calls_with_notify_to_a_peer_without_tags_post_alone() -> None:
    """A peer that unpacks merged notifications but does not drop repeated tags (an engine
    from before "tagged-notify") could hear a caller twice if a merged request were aborted
    and posted again. So calls with ``notify`` to it are not merged: here the write carrying
    ``n-1`` is reported running after it finished, times out and is aborted, and the other
    two callers' notifications still arrive exactly once."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=37)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=38)
    tuning = aionixl.lowlevel.Tuning(coalesce_window=5.0, inline_polls=0)
    async with engine_pair(src_cache, dst_cache, tuning=tuning) as (src, dst, peer):
        peer.features = peer.features - {"tagged-notify"}
        posts, _ = await _notify_writes_with_one_post_stuck(src, dst, peer)
        assert sorted(posts) == [b"n-1", b"n-3", b"n-4"] and merged(dst) == (0, 0), posts
        for block in (3, 4):
            for region in range(REGIONS):
                assert np.array_equal(src_cache[region][block], dst_cache[region][block])
        # The aborted lone write of block 1 had finished: its notification came, once.
        await _heard_once(src, dst, (1, 3, 4))


async def test_notification_tags_of_an_engine_do_not_repeat_after_random_seed() -> None:
    """A receiver drops a tag it has seen from that sender's name; a sender started again
    under the same name after ``random.seed(0)`` (reproducible ML runs do that) must not
    repeat its predecessor's tags, or its merged notifications would be dropped."""
    starts = []
    for _ in range(2):
        random.seed(0)
        async with aionixl.Engine("same-name", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS),
                                  listen=None) as engine:
            starts.append(next(engine._coalescer._tags))
    assert starts[0] != starts[1]
