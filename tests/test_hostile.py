"""A hostile peer: one that completed a valid, signed handshake and then sends raw reserved
messages. Nothing it sends may end the engine, stall its loop, grow its memory without
bound, or touch another peer's blocks; what the engine cannot use is refused and counted
(``metrics().messages_refused``). An honest peer reads beside it, every byte checked.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest

import aionixl
import aionixl.lowlevel
import aionixl.vllm
from aionixl import _wire
from aionixl._nixl import NixlAgent, metadata_agent_name
from aionixl.testing import RemoteEngine, assert_blocks_equal

from .helpers import numpy_cache, send_raw, unique

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 512, 8192, 2  # 8 MiB a cache, as in the reproductions
SECRET = b"a secret of at least 16 bytes"
DEEP = b"\x91" * 100_000 + b"\xc0"  # one element nested far past the recursion limit


@pytest.fixture(params=[pytest.param("asyncio", id="asyncio"), pytest.param("trio", id="trio")])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@dataclass
class Scene:
    target: aionixl.Engine  # attacked; serves the honest reader's push reads
    hostile: aionixl.Engine  # admitted with a valid, signed handshake
    honest: aionixl.Engine
    honest_peer: aionixl.Peer  # the target, as the honest engine sees it
    target_cache: list[np.ndarray]
    honest_cache: list[np.ndarray]

    def send(self, message: bytes) -> None:
        """The hostile peer sends ``message`` as it is to the target."""
        send_raw(self.hostile, self.target.name, message)

    async def read_exactly(self, rng: np.random.Generator, n: int = 8) -> None:
        """One honest read of ``n`` random blocks, every byte compared."""
        src = rng.choice(BLOCKS, n, replace=False)
        dst = rng.choice(BLOCKS, n, replace=False)
        await self.honest.transfer_blocks(self.honest_peer, dst.tolist(), src.tolist(), timeout=30)
        for r in range(REGIONS):
            assert np.array_equal(self.honest_cache[r][dst], self.target_cache[r][src]), f"region {r}"

    def refused(self, kind: str) -> int:
        return self.target.metrics().messages_refused[kind]


@asynccontextmanager
async def scene(target_config: aionixl.EngineConfig | None = None) -> AsyncIterator[Scene]:
    """Three engines in this process, all with the secret: the target listens, the hostile
    engine and the honest one (push reads: the target serves them) connect to it."""
    config = target_config or aionixl.EngineConfig(handshake_secret=SECRET)
    target_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=1)
    honest_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    peers = aionixl.EngineConfig(handshake_secret=SECRET, read_mode="push")
    async with aionixl.Engine(unique("target"), target_cache, config=config) as target, \
            aionixl.Engine(unique("hostile"), numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None,
                           config=peers) as hostile, \
            aionixl.Engine(unique("honest"), honest_cache, listen=None, config=peers) as honest:
        assert target.address is not None
        await hostile.connect(target.address, timeout=30)
        honest_peer = await honest.connect(target.address, timeout=30)
        yield Scene(target, hostile, honest, honest_peer, target_cache, honest_cache)


async def until(condition: Callable[[], bool], what: str, limit: float = 30.0) -> None:
    with anyio.fail_after(limit):
        while not condition():
            await anyio.sleep(0.005)


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Watch:
    """While entered: the longest the event loop went without running a ticking task
    (seconds late), and the highest RSS seen (sampled at each tick)."""

    def __init__(self) -> None:
        self.longest_stall = 0.0
        self.rss_before = rss_bytes()
        self.rss_peak = self.rss_before

    async def run(self) -> None:
        while True:
            start = anyio.current_time()
            await anyio.sleep(0.005)
            self.longest_stall = max(self.longest_stall, anyio.current_time() - start - 0.005)
            self.rss_peak = max(self.rss_peak, rss_bytes())

    @property
    def rss_growth(self) -> int:
        return self.rss_peak - self.rss_before


@asynccontextmanager
async def watched() -> AsyncIterator[Watch]:
    watch = Watch()
    async with anyio.create_task_group() as tg:
        tg.start_soon(watch.run)
        yield watch
        tg.cancel_scope.cancel()


def push_request(rid: int = 1, n: int = 2, **fields: Any) -> _wire.PushRequest:
    ids = np.arange(n, dtype="<i4").tobytes()
    return _wire.PushRequest(rid, ids, ids, 5.0, **fields)


def one_more_nested(prefix: bytes, struct: msgspec.Struct) -> bytes:
    """``struct``'s valid encoding whose array header announces one element more, that
    element nested 100,000 deep: the shape of the reproduction."""
    encoded = msgspec.msgpack.encode(struct)
    assert 0x90 <= encoded[0] < 0x9F, "a fixarray header"
    return prefix + bytes([encoded[0] + 1]) + encoded[1:] + DEEP


NESTED = {
    "push": one_more_nested(_wire.PUSH, push_request()),
    "perr": one_more_nested(_wire.PERR, _wire.PushError(1, "no")),
    "plost": one_more_nested(_wire.PLOST, _wire.PushError(1, "no")),
    "tagged": _wire.TAGGED + b"\x93\x07\x90" + DEEP,
    "multi": _wire.MULTI + b"\x91" + DEEP,
}


@pytest.mark.parametrize("kind", list(NESTED))
async def test_a_message_nested_past_the_recursion_limit_is_refused_and_the_engine_serves_on(
        kind: str) -> None:
    rng = np.random.default_rng(0)
    async with scene() as s:
        await s.read_exactly(rng)
        s.send(NESTED[kind])
        await until(lambda: s.refused(kind) == 1, f"the {kind} refused")
        await s.read_exactly(rng)
        assert not s.target.closed
        assert s.target.metrics().messages_refused == {**dict.fromkeys(_wire.REFUSAL_KINDS, 0), kind: 1}


async def test_an_unauthenticated_side_channel_client_cannot_reach_the_engines_own_handling() -> None:
    """vLLM's side channel has no authentication: a bare NIXL agent that asked it for
    metadata gets a serving agent's, never the engine's, and the reserved messages it sends
    there (in an admitted peer's very name) are refused, whatever they are."""
    rng = np.random.default_rng(1)
    async with scene() as s:
        address = await aionixl.vllm.serve(s.target, engine_id="prefill-0", compat_hash="c0ffee" * 8,
                                           block_size=16, kv_cache_layout="LBHNC",
                                           attn_backend_name="CPU_ATTN")
        reply = await aionixl.vllm.fetch_metadata(address, timeout=10)
        served = reply.metadata.agent_metadata
        assert served != aionixl.lowlevel.nixl_metadata(s.target)
        served_name = metadata_agent_name(served)
        assert served_name is not None and served_name != s.target.name
        # The intruder names its agent after the honest peer: NIXL takes a sender's word.
        intruder = NixlAgent(s.honest.name, ("UCX",), progress_thread=False)
        try:
            intruder.add_remote(served, served_name)
            messages = [*NESTED.values(), _wire.goodbye(aionixl.lowlevel.nixl_metadata(s.honest)),
                        _wire.PDONE + _wire.rid_bytes(1), _wire.push_error(1, "stop", lost=True),
                        _wire.push_request(push_request())]
            for message in messages:
                intruder.send_notif(served_name, message)
            # (an initiator's sends move while it calls into NIXL)
            await until(lambda: not intruder.get_notifs() and s.refused("relayed") == len(messages),
                        "every message refused")
        finally:
            intruder.remove_remote(served_name)
            intruder.destroy()
        await s.read_exactly(rng)
        assert not s.target.closed and s.honest_peer.connected  # the goodbye did not drop it
        assert sum(s.target.metrics().messages_refused.values()) == len(messages)


async def test_a_push_request_for_parts_of_too_many_segments_is_refused_before_anything_is_prepared(
        ) -> None:
    """``(0, 2, 4096)`` on 8 KiB blocks cuts each into 4096 one-byte segments: descriptor
    rows of blocks x regions x 4096 (hundreds of MiB). Refused from the geometry first."""
    rng = np.random.default_rng(2)
    async with scene() as s:
        dlists = s.target.live_resources()["dlists"]
        async with watched() as watch:
            s.send(_wire.push_request(push_request(n=BLOCKS, dst_part=(0, 2, 4096), src_part=(0, 2, 4096))))
            await until(lambda: s.refused("push") == 1, "the request refused")
            await s.read_exactly(rng)
        assert s.target.live_resources()["dlists"] == dlists
        assert s.target.metrics().pushes_refused == 1
        assert watch.rss_growth < 32 << 20, watch.rss_growth


async def test_running_out_of_memory_for_a_peers_request_refuses_that_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from aionixl import _peers

    def no_memory(*args: object) -> object:
        raise MemoryError

    rng = np.random.default_rng(3)
    async with scene() as s:
        monkeypatch.setattr(_peers, "part_descriptors", no_memory)
        s.send(_wire.push_request(push_request(dst_part=(0, 2, 1), src_part=(1, 2, 1))))
        await until(lambda: s.refused("push") == 1, "the request refused")
        monkeypatch.undo()
        await s.read_exactly(rng)
        assert not s.target.closed


async def test_one_packed_notification_of_900000_messages_is_refused_before_it_is_unpacked() -> None:
    rng = np.random.default_rng(4)
    async with scene() as s:
        flood = _wire.pack_notifications([b"%04d" % (i % 10_000) for i in range(900_000)])
        assert len(flood) > 3_600_000
        async with watched() as watch:
            s.send(flood)
            await until(lambda: s.refused("multi") == 1, "the flood refused")
            await s.read_exactly(rng)
        assert watch.longest_stall < 1.0, watch.longest_stall
        assert s.target.metrics().notifications_dropped == 0  # nothing of it was delivered


async def test_a_flood_of_packed_notifications_is_delivered_in_slices_and_drops_in_constant_time(
        caplog: pytest.LogCaptureFixture) -> None:
    """Packed notifications at their bound, 8 x 65,536 tiny messages: delivered with loop
    turns in between, the mailbox keeping its newest 4,096 and dropping the rest with a
    warning at most every 10 s (it logged one per 1,000 before)."""
    rng = np.random.default_rng(5)
    n = _wire.MAX_PACKED_MESSAGES
    async with scene() as s:
        async with watched() as watch:
            for k in range(8):
                s.send(_wire.pack_tagged(k, [b"m%d" % (i % 97) for i in range(n)]))
            reader = anyio.Event()

            async def read_meanwhile() -> None:
                await s.read_exactly(rng)
                reader.set()

            with caplog.at_level(logging.WARNING, logger="aionixl"):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(read_meanwhile)
                    await until(lambda: s.target.metrics().notifications_dropped == 8 * n - 4096,
                                "the flood dropped", 60)
        assert reader.is_set()
        assert s.target.metrics().notifications_kept == 4096
        assert watch.longest_stall < 1.0, watch.longest_stall
        assert watch.rss_growth < 64 << 20, watch.rss_growth
        full = [r for r in caplog.records if "notification buffer full" in r.getMessage()]
        assert 1 <= len(full) <= 2, len(full)


async def test_a_read_done_from_any_admitted_peer_releases_a_lease_as_vllms_does() -> None:
    """The decision (docs/vllm.md, "Leases"): a lease trusts every engine that may message
    this one, as a vLLM prefill trusts its decoders: any admitted peer can read and write
    every registered block anyway. The hostile engine never read these blocks."""
    async with scene() as s:
        lease = s.target.lease("req-1", [1, 2, 3])
        s.send(aionixl.read_done("req-1"))
        with anyio.fail_after(10):
            await lease.wait()
        assert s.target.metrics().leases_released == 1


async def test_a_heartbeat_over_its_bound_is_refused_and_one_within_it_extends_the_lease() -> None:
    async with scene() as s:
        lease = s.target.lease("req-1", [1], duration=5.0)
        s.send(b"HB:" + b"," * (2 << 20))  # two million empty ids: refused unread
        await until(lambda: s.refused("heartbeat") == 1, "the heartbeat refused")
        expires = lease.expires_at
        await anyio.sleep(0.05)
        s.send(b"HB:req-1," + b"x" * 1000)
        await until(lambda: lease.expires_at > expires, "the lease extended")


# ---- the fuzz ---------------------------------------------------------------------------------


def fuzz(rng: np.random.Generator, count: int, incarnation: bytes) -> Iterator[bytes]:
    """``count`` messages of every kind a peer may send: structured with random and
    out-of-range values, truncated, extended, nested, oversized or random bytes."""
    prefixes = [*_wire.KINDS, _wire.RESERVED + b"bogus\x00", b"HB:", b""]

    def ids(n: int) -> bytes:
        return rng.integers(-3, BLOCKS + 3, n).astype("<i4").tobytes()

    def part() -> tuple[int, int, int] | None:
        return None if rng.random() < 0.5 else tuple(int(x) for x in rng.choice(
            [0, 1, 2, 3, 4, 64, 4096, -1, 2**31, 2**62], 3))  # type: ignore[return-value]

    def structured(prefix: bytes) -> bytes:
        n = int(rng.integers(0, 40))
        rid = int(rng.choice([0, 1, 2, 7, 2**63 - 1, -1, int(rng.integers(0, 2**62))]))
        if prefix == _wire.PUSH:
            valid = rng.random() < 0.05  # a few the target serves: into the hostile's blocks
            return msgspec.msgpack.encode(_wire.PushRequest(
                rid, np.arange(n or 1, dtype="<i4").tobytes() if valid else ids(n),
                np.arange(n or 1, dtype="<i4").tobytes() if valid else ids(int(rng.integers(0, 40))),
                float(rng.choice([5.0, 0.5, 0.0, -1.0, np.nan, np.inf, 1e300])) if not valid else 5.0,
                rng.bytes(int(rng.integers(0, 32))) if rng.random() < 0.8 else _wire.RESERVED,
                None if valid else part(), None if valid else part(), bool(rng.random() < 0.3),
                incarnation if rng.random() < 0.7 else rng.bytes(8)))
        if prefix in (_wire.PERR, _wire.PLOST):
            return msgspec.msgpack.encode(_wire.PushError(rid, "x" * int(rng.integers(0, 5000))))
        if prefix in (_wire.PDONE, _wire.PGONE, _wire.PCANCEL):
            return _wire.rid_bytes(rid & (2**64 - 1)) + (incarnation if rng.random() < 0.3 else b"")
        if prefix == _wire.MULTI:
            return msgspec.msgpack.encode([rng.bytes(int(rng.integers(0, 9))) for _ in range(n)]
                                          + [_wire.PROBE] * int(rng.random() < 0.2))
        if prefix == _wire.TAGGED:
            return msgspec.msgpack.encode((rid, [rng.bytes(4) for _ in range(n)]))
        if prefix == b"HB:":
            return ",".join(f"req-{int(rng.integers(0, 9))}" for _ in range(n)).encode()
        if prefix == b"":
            return f"req-{int(rng.integers(0, 9))}:{int(rng.integers(-2, 5))}".encode()
        return rng.bytes(16)  # probe, goodbye, bogus

    for _ in range(count):
        prefix = prefixes[int(rng.integers(0, len(prefixes)))]
        body = structured(prefix)
        shape = rng.random()
        if shape < 0.1:  # truncated
            body = body[:int(rng.integers(0, len(body) + 1))]
        elif shape < 0.2:  # trailing bytes
            body = body + rng.bytes(int(rng.integers(1, 32)))
        elif shape < 0.3:  # one element more, nested (past the recursion limit, or not)
            depth = int(rng.choice([10, 900, 1500, 20_000]))
            head = body[0] + 1 if body[:1] and 0x90 <= body[0] < 0x9F else 0x91
            body = bytes([head]) + body[1:] + b"\x91" * depth + b"\xc0"
        elif shape < 0.31:  # oversized
            body = rng.bytes(int(rng.integers(1 << 16, 1 << 21)))
        elif shape < 0.4:  # random
            body = rng.bytes(int(rng.integers(0, 64)))
        yield prefix + body


async def test_a_seeded_fuzz_of_every_kind_leaves_the_engine_serving_byte_exact_and_bounded(
        anyio_backend_name: str) -> None:
    """10,500 messages of every kind from the hostile peer to an engine in a child process
    while the honest peer reads from it, each read checked; then that engine is open, every
    one of its blocks reads as it was, it refused (and counted) messages of every kind it
    refuses, its RSS grew less than 64 MiB and its loop never stalled for a second."""
    rng = np.random.default_rng(2026)
    geometry: dict[str, Any] = {"num_blocks": BLOCKS, "block_shape": (BLOCK_BYTES,),
                                "dtypes": ("uint8",) * REGIONS}
    honest_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    peers = aionixl.EngineConfig(handshake_secret=SECRET, read_mode="push")
    async with RemoteEngine(seed=11, **geometry, config=aionixl.EngineConfig(handshake_secret=SECRET),
                            backend=anyio_backend_name, workload="tests.hostile_ops:watch") as target, \
            aionixl.Engine(unique("hostile"), numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None,
                           config=peers) as hostile, \
            aionixl.Engine(unique("honest"), honest_cache, listen=None, config=peers) as honest:
        await hostile.connect(target.address, timeout=30)
        peer = await honest.connect(target.address, timeout=30)
        incarnation = _wire.incarnation(aionixl.lowlevel.nixl_metadata(hostile))

        async def read_exactly(src: list[int]) -> None:
            dst = rng.choice(BLOCKS, len(src), replace=False).tolist()
            await honest.transfer_blocks(peer, dst, src, timeout=30)
            assert_blocks_equal(honest_cache, dst, target.seed, src, **geometry)

        await read_exactly(list(range(16)))
        before = await target.call("tests.hostile_ops:report")
        reads = 0
        done = anyio.Event()

        async def honest_reader() -> None:
            nonlocal reads
            while not done.is_set():
                await read_exactly(rng.choice(BLOCKS, int(rng.integers(1, 16)), replace=False).tolist())
                reads += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(honest_reader)
            for i, message in enumerate(fuzz(np.random.default_rng(7), 10_500, incarnation)):
                send_raw(hostile, target.name, message)
                if i % 50 == 0:
                    await anyio.sleep(0.001)
            send_raw(hostile, target.name, b"fuzz-end")  # one sender's messages arrive in order
            await target.wait_notification(b"fuzz-end", timeout=120)
            done.set()
        after = await target.call("tests.hostile_ops:report")
        assert reads > 0 and not after["closed"]
        for first in range(0, BLOCKS, 64):  # every block of the target, as it was
            await read_exactly(list(range(first, first + 64)))
        refused = after["refused"]
        assert all(refused[kind] > 0 for kind in ("push", "perr", "plost", "pdone", "pgone", "pcancel",
                                                  "multi", "tagged", "goodbye", "reserved")), refused
        assert after["rss_peak"] - before["rss"] < 64 << 20, (before, after)
        assert after["longest_stall"] < 1.0, after
