"""``aionixl.vllm.serve``: vLLM's side channel answered from the event loop, without vLLM.

The client here is aionixl's own vLLM client (``aionixl.vllm.connect``: the same request frame, the
same reply decoding a vLLM decode worker uses), so a real aionixl reader reads real blocks
through it; the real vLLM decode worker is in ``tests_vllm/test_vllm_serve.py``. The
listener is fuzzed with raw zmq clients: nothing they send stops it.
"""

from __future__ import annotations

import math
import os
import re
import time

import anyio
import msgspec
import numpy as np
import pytest
import zmq

import aionixl
import aionixl.lowlevel
import aionixl.vllm
from aionixl import _vllm_wire as wire
from aionixl._nixl import metadata_agent_name

from .helpers import numpy_cache, zero_resources

pytestmark = pytest.mark.anyio

BLOCKS, BLOCK_BYTES, REGIONS = 32, 4096, 2
SERVE = {"engine_id": "prefill-0", "compat_hash": "c0ffee" * 8, "block_size": 16,
         "kv_cache_layout": "LBHNC", "attn_backend_name": "CPU_ATTN"}


async def read_and_release(decode: aionixl.Engine, peer: aionixl.Peer, lease: aionixl.Lease,
                           dst_cache: list[np.ndarray], src_cache: list[np.ndarray]) -> None:
    """Read the prefill's blocks 4-6 into 0-2 with the read-done of ``lease`` ("req-1"): the
    lease ends, and the bytes are the prefill's."""
    await decode.transfer_blocks(peer, [0, 1, 2], [4, 5, 6], notify=aionixl.vllm.read_notification("req-1"))
    with anyio.fail_after(10):
        await lease.wait()
    assert all(np.array_equal(d[[0, 1, 2]], s[[4, 5, 6]]) for d, s in zip(dst_cache, src_cache, strict=True))


async def test_an_aionixl_reader_reads_through_the_vllm_side_channel_and_releases_the_lease() -> None:
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=3)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with aionixl.Engine("p", src_cache, listen=None) as prefill, \
            aionixl.Engine("d", dst_cache, listen=None) as decode:
        address = await aionixl.vllm.serve(prefill, **SERVE)
        assert address.startswith("tcp://127.0.0.1:")
        lease = prefill.lease("req-1", [4, 5, 6], duration=30)
        peer = await aionixl.vllm.connect(decode, address, expect_compat_hash=SERVE["compat_hash"],
                                          timeout=10)
        assert [r.block_bytes for r in peer.regions] == [BLOCK_BYTES] * REGIONS
        await aionixl.vllm.heartbeat(decode, peer, ["req-1"])
        await read_and_release(decode, peer, lease, dst_cache, src_cache)
        assert prefill.metrics().vllm_requests_answered == 1
        assert prefill.metrics().leases_released == 1
    assert zero_resources(prefill) and zero_resources(decode)


async def test_the_reply_describes_the_engine_as_a_vllm_prefill() -> None:
    cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    names = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    async with aionixl.Engine("p", cache, listen=None) as prefill:
        before = time.perf_counter()
        address = await aionixl.vllm.serve(prefill, **SERVE, tp_rank=3, layer_names=names)
        reply = await aionixl.vllm.fetch_metadata(address, tp_rank=3, timeout=10)
        md = reply.metadata
        assert reply.compatibility_hash == SERVE["compat_hash"]
        assert md.engine_id == aionixl.vllm.engine_id(prefill)
        assert re.fullmatch(r"prefill-0~[0-9a-f]{8}", md.engine_id)  # this start's own (docs/vllm.md)
        assert md.block_size == 16 and md.kv_cache_layout == "LBHNC"
        assert md.attn_backend_name == "CPU_ATTN" and md.region_names == names
        assert md.kv_caches_base_addr == [r.base for r in prefill.regions]
        assert md.block_lens == md.block_strides == [BLOCK_BYTES] * REGIONS
        assert md.num_blocks == BLOCKS and md.region_mem_types == ["DRAM"] * REGIONS
        # A serving agent of its own over the same memory: never the engine's own agent
        # (an unauthenticated client could otherwise message it in a peer's name).
        assert md.agent_metadata != aionixl.lowlevel.nixl_metadata(prefill)
        assert metadata_agent_name(md.agent_metadata) == f"p-vllm-{md.engine_id.rsplit('~', 1)[1]}"
        assert reply.remote_clock is not None and before <= reply.remote_clock <= time.perf_counter()


async def test_without_its_progress_thread_the_serving_agent_costs_one_thread_less_and_still_serves() -> None:
    """``progress_thread=False``: the engine's drainer progresses the serving agent; a read
    through it lands exact and releases the lease all the same."""
    def threads() -> int:
        return len(os.listdir("/proc/self/task"))

    added = {}
    for progress_thread in (True, False):
        src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=11)
        dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
        async with aionixl.Engine("p", src_cache, listen=None) as prefill, \
                aionixl.Engine("d", dst_cache, listen=None) as decode:
            before = threads()
            address = await aionixl.vllm.serve(prefill, **SERVE, progress_thread=progress_thread)
            added[progress_thread] = threads() - before
            lease = prefill.lease("req-1", [7, 8], duration=30)
            peer = await aionixl.vllm.connect(decode, address, timeout=10)
            await decode.transfer_blocks(peer, [1, 2], [7, 8], notify=aionixl.vllm.read_notification("req-1"))
            with anyio.fail_after(10):
                await lease.wait()
            pairs = zip(dst_cache, src_cache, strict=True)
            assert all(np.array_equal(d[[1, 2]], s[[7, 8]]) for d, s in pairs)
        assert zero_resources(prefill)
    assert added[False] == added[True] - 1, added  # NIXL's progress thread, and nothing else
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill:
        with pytest.raises(ValueError, match="progress_thread must be a bool"):
            await aionixl.vllm.serve(prefill, **SERVE, progress_thread=None)  # type: ignore[arg-type]


async def test_garbage_never_stops_the_listener_and_requests_it_cannot_serve_are_refused() -> None:
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill:
        address = await aionixl.vllm.serve(prefill, **SERVE)
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        rng = np.random.default_rng(7)
        try:
            cases = [[rng.bytes(int(n))] for n in rng.integers(0, 200, 40)]
            cases += [[b""], [b"", b"", b""], [wire.encode_request(0, 0), b"extra"],
                      [msgspec.msgpack.encode([b"get_meta_msg", -1, 0])],
                      [msgspec.msgpack.encode([b"get_meta_msg", 0, 1])],
                      [msgspec.msgpack.encode(["get_meta_msg", 0, 0])],
                      [msgspec.msgpack.encode([b"other", 0, 0])], [b"\x00" * 1000]]
            for frames in cases:  # a REQ client: each gets a refusal it can read
                with ctx.socket(zmq.REQ) as sock:
                    sock.setsockopt(zmq.LINGER, 0)
                    sock.connect(address)
                    sock.send_multipart(frames)
                    reply = await _recv(sock)
                    with pytest.raises(wire.VllmRefused):
                        wire.decode_reply(reply, 1 << 20)
            with ctx.socket(zmq.DEALER) as sock:  # no envelope delimiter; an oversized message
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(address)
                sock.send_multipart([b"junk"])
                with pytest.raises(wire.VllmRefused):
                    wire.decode_reply(await _recv(sock), 1 << 20)
                sock.send(os.urandom(1 << 20))  # over the socket's limit: zmq drops the client
            refused = prefill.metrics().vllm_requests_refused
            assert refused == len(cases) + 1
            reply = await aionixl.vllm.fetch_metadata(address, timeout=10)  # still serving
            assert reply.metadata.engine_id == aionixl.vllm.engine_id(prefill)
            assert prefill.metrics().vllm_requests_answered == 1
        finally:
            ctx.destroy(linger=0)


async def _recv(sock: zmq.Socket[bytes]) -> list[bytes]:
    with anyio.fail_after(10):
        while True:
            try:
                return sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                await anyio.sleep(0.002)


async def test_bad_arguments_are_value_errors_and_a_second_listener_is_refused() -> None:
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill:
        for change in ({"engine_id": ""}, {"compat_hash": ""}, {"block_size": 0}, {"block_size": True},
                       {"kv_cache_layout": ""}, {"attn_backend_name": 3}, {"tp_rank": -1},
                       {"pp_rank": "0"}, {"layer_names": ["only-one"]}, {"layer_names": "ab"}):
            with pytest.raises(ValueError):
                await aionixl.vllm.serve(prefill, **{**SERVE, **change})
        with pytest.raises(aionixl.ListenError):
            await aionixl.vllm.serve(prefill, "tcp://256.0.0.1:1", **SERVE)
        address = await aionixl.vllm.serve(prefill, **SERVE)  # the failures left nothing behind
        with pytest.raises(RuntimeError, match="serves vLLM decoders already"):
            await aionixl.vllm.serve(prefill, **SERVE)
        assert (await aionixl.vllm.fetch_metadata(address, timeout=10)).metadata.engine_id \
            == aionixl.vllm.engine_id(prefill)
    with pytest.raises(aionixl.EngineClosedError):
        await aionixl.vllm.serve(prefill, **SERVE)


async def test_the_listener_stops_with_the_engine() -> None:
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill:
        address = await aionixl.vllm.serve(prefill, **SERVE)
    with pytest.raises(aionixl.HandshakeError, match="did not answer"):
        await aionixl.vllm.fetch_metadata(address, timeout=0.3)


async def test_closing_the_engine_ends_a_vllm_connect_that_waits_for_an_answer() -> None:
    """A side channel that never answers (its prefill closed): closing the engine ends the
    waiting call at once with EngineClosedError, even one with no deadline of its own."""
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill:
        address = await aionixl.vllm.serve(prefill, **SERVE)
    ended: list[float] = []
    async with aionixl.Engine("d", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as decode:

        async def connect(timeout: float) -> None:
            with pytest.raises(aionixl.EngineClosedError):
                await aionixl.vllm.connect(decode, address, timeout=timeout)
            ended.append(time.monotonic())

        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                tg.start_soon(connect, 30.0)
                tg.start_soon(connect, math.inf)
                await anyio.sleep(0.3)
                closing = time.monotonic()
                await decode.aclose()
    assert len(ended) == 2 and max(ended) - closing < 1.0
    assert zero_resources(decode)


async def test_fetch_metadata_and_vllm_connect_refuse_a_timeout_not_a_positive_number_of_seconds() -> None:
    async with aionixl.Engine("d", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as decode:
        for bad in (-1, 0, True, float("nan"), "1", 2**2000):
            with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
                await aionixl.vllm.fetch_metadata("tcp://127.0.0.1:9", timeout=bad)  # type: ignore[arg-type]
            with pytest.raises(ValueError, match="timeout must be a positive number of seconds"):
                await aionixl.vllm.connect(decode, "tcp://127.0.0.1:9", timeout=bad)  # type: ignore[arg-type]


async def test_each_start_announces_an_engine_id_of_its_own_and_transfer_params_name_it() -> None:
    """A vLLM decode keeps a remote agent by engine id: a prefill restarted on the same port
    under the same user id must announce another id, or the decode never asks it again."""
    def params(engine_id: str) -> str:
        return aionixl.vllm.transfer_params("r", [1], num_tokens=4, engine_id=engine_id, host="h",
                                            port=1)["remote_engine_id"]

    port = 0
    announced = []
    for _start in range(2):
        async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill:
            address = await aionixl.vllm.serve(prefill, f"tcp://127.0.0.1:{port}", **SERVE)
            port = int(address.rsplit(":", 1)[1])  # the restart serves on the same port
            served_id = aionixl.vllm.engine_id(prefill)
            assert served_id is not None and re.fullmatch(r"prefill-0~[0-9a-f]{8}", served_id)
            assert (await aionixl.vllm.fetch_metadata(address, timeout=10)).metadata.engine_id == served_id
            assert params("prefill-0") == params(served_id) == served_id  # the user's id, translated
            announced.append(served_id)
        assert aionixl.vllm.engine_id(prefill) is None
        assert params("prefill-0") == "prefill-0"  # nobody here serves it: as given
    assert announced[0] != announced[1]


async def test_exact_engine_id_announces_the_id_as_given_and_two_servers_of_one_id_are_ambiguous() -> None:
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as first, \
            aionixl.Engine("q", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as second:
        with pytest.raises(ValueError, match="exact_engine_id must be a bool"):
            await aionixl.vllm.serve(first, **SERVE, exact_engine_id=1)  # type: ignore[arg-type]
        address = await aionixl.vllm.serve(first, **SERVE, exact_engine_id=True)
        assert aionixl.vllm.engine_id(first) == "prefill-0"
        assert (await aionixl.vllm.fetch_metadata(address, timeout=10)).metadata.engine_id == "prefill-0"
        await aionixl.vllm.serve(second, **SERVE)
        with pytest.raises(ValueError, match="2 engines of this process serve vLLM decoders under"):
            aionixl.vllm.transfer_params("r", [1], num_tokens=4, engine_id="prefill-0", host="h", port=1)
        served_id = aionixl.vllm.engine_id(second)
        assert served_id is not None
        assert aionixl.vllm.transfer_params("r", [1], num_tokens=4, engine_id=served_id, host="h",
                                            port=1)["remote_engine_id"] == served_id


def test_transfer_params_are_what_a_vllm_decode_scheduler_reads() -> None:
    params = aionixl.vllm.transfer_params("req-9", [3, 4], num_tokens=40, engine_id="prefill-0",
                                          host="10.0.0.2", port=5600)
    assert params == {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "prefill-0",
                      "remote_request_id": "req-9", "remote_block_ids": [[3, 4]], "remote_host": "10.0.0.2",
                      "remote_port": 5600, "remote_num_tokens": 40, "tp_size": 1, "dcp_size": 1,
                      "pp_size": 1}
    base = {"num_tokens": 40, "engine_id": "e", "host": "h", "port": 1}
    for rid, ids, change in (("", [1], {}), ("HB:x", [1], {}), ("r", [], {}), ("r", [-1], {}),
                             ("r", [1], {"num_tokens": 0}), ("r", [1], {"port": 70000}),
                             ("r", [1], {"host": ""}), ("r", [1], {"engine_id": ""})):
        with pytest.raises(ValueError):
            aionixl.vllm.transfer_params(rid, ids, **{**base, **change})  # type: ignore[arg-type]


async def test_vllm_connect_expecting_an_engine_id_asks_again_after_a_restart_and_refuses_another() -> None:
    """Block ids name one engine's memory: a reader told engine a's ids must not read them
    from engine b that restarted on a's port (a vLLM decode refuses it too)."""
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    async with aionixl.Engine("d", dst_cache, listen=None) as decode:
        listen, peers, ids = "tcp://127.0.0.1:0", [], []
        for seed in (21, 22):
            src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=seed)
            async with aionixl.Engine("p", src_cache, listen=None) as prefill:
                address = listen = await aionixl.vllm.serve(prefill, listen, **SERVE)
                served_id = aionixl.vllm.engine_id(prefill)
                assert served_id is not None
                peer = await aionixl.vllm.connect(decode, address, expect_engine_id=served_id, timeout=10)
                assert await aionixl.vllm.connect(decode, address, expect_engine_id=served_id) is peer
                await decode.transfer_blocks(peer, [0, 1], [9, 10])
                pairs = zip(dst_cache, src_cache, strict=True)
                assert all(np.array_equal(d[[0, 1]], s[[9, 10]]) for d, s in pairs)  # this engine's bytes
                if ids:  # the restart: a request for the engine before it is refused, not read here
                    with pytest.raises(aionixl.IncompatiblePeerError, match="not the expected engine") as err:
                        await aionixl.vllm.connect(decode, address, expect_engine_id=ids[0], timeout=10)
                    assert err.value.field == "engine_id"
                peers.append(peer)
                ids.append(served_id)
            assert prefill.metrics().vllm_requests_answered == len(peers)  # asked again for the refusal
        assert peers[0] is not peers[1]


async def test_vllm_connect_reuses_a_peer_only_for_its_rank_and_checks_the_hash_again() -> None:
    async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill, \
            aionixl.Engine("d", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as decode:
        address = await aionixl.vllm.serve(prefill, **SERVE)
        peer = await aionixl.vllm.connect(decode, address, timeout=10)
        assert await aionixl.vllm.connect(decode, address, expect_compat_hash=SERVE["compat_hash"]) is peer
        with pytest.raises(aionixl.IncompatiblePeerError) as info:
            await aionixl.vllm.connect(decode, address, expect_compat_hash="0" * 48)  # the live peer's hash
        assert info.value.field == "compat_hash"
        with pytest.raises(aionixl.HandshakeError, match="refused"):
            await aionixl.vllm.connect(decode, address, tp_rank=1, timeout=10)  # another rank: asked again
        assert prefill.metrics().vllm_requests_answered == 1


async def test_a_prefill_with_other_block_sizes_is_admitted_unless_equal_geometry_is_required() -> None:
    half = numpy_cache(BLOCKS, BLOCK_BYTES // 2, REGIONS)
    whole = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=4)
    async with aionixl.Engine("p", whole, listen=None) as prefill:
        address = await aionixl.vllm.serve(prefill, **SERVE)
        async with aionixl.Engine("d", half, listen=None) as decode:
            peer = await aionixl.vllm.connect(decode, address, timeout=10)
            assert peer.bytes_per_block == (BLOCK_BYTES,) * REGIONS
            with pytest.raises(ValueError, match="region 0"):
                await decode.transfer_blocks(peer, [0], [0])  # whole blocks of other sizes
            await decode.transfer_blocks(peer, [0], [9], remote_part=aionixl.BlockPart(1, 2))
            # The second half of the prefill's block 9 fills our block 0, in every region.
            assert all(np.array_equal(h[0], w[9, BLOCK_BYTES // 2:])
                       for h, w in zip(half, whole, strict=True))
        strict = aionixl.EngineConfig(require_equal_geometry=True)
        async with aionixl.Engine("d2", half, listen=None, config=strict) as decode:
            with pytest.raises(aionixl.IncompatiblePeerError) as info:
                await aionixl.vllm.connect(decode, address, timeout=10)
            assert info.value.field == "bytes_per_block[0]"


@pytest.mark.parametrize("read_mode", ["get", "push"])
async def test_a_listening_engine_names_its_handshake_and_an_aionixl_reader_that_prefers_it_reads_by_it(
        read_mode: str) -> None:
    """The side channel's reply names the engine's own handshake; a reader given
    ``prefer_aionixl`` connects there and reads from the engine's agent (not the serving
    agent), in its read mode, and the read-done and heartbeats still drive the lease."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=5)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    config = aionixl.EngineConfig(read_mode=read_mode)  # type: ignore[arg-type]
    async with aionixl.Engine("p", src_cache) as prefill, \
            aionixl.Engine("d", dst_cache, listen=None, config=config) as decode:
        address = await aionixl.vllm.serve(prefill, **SERVE)
        reply = await aionixl.vllm.fetch_metadata(address, timeout=10)
        assert reply.aionixl == aionixl.vllm.AionixlRoute(prefill.address or "", "p")
        lease = prefill.lease("req-1", [4, 5, 6], duration=2)
        peer = await aionixl.vllm.connect(decode, address, expect_engine_id=reply.metadata.engine_id,
                                          timeout=10, prefer_aionixl=True)
        assert peer.name == "p" and peer.features and peer.read_mode == read_mode
        assert await aionixl.vllm.connect(decode, address, prefer_aionixl=True) is peer
        await anyio.sleep(1.5)
        await aionixl.vllm.heartbeat(decode, peer, ["req-1"])  # past its first 2 s: kept alive
        await anyio.sleep(1.0)
        await read_and_release(decode, peer, lease, dst_cache, src_cache)
        metrics = prefill.metrics()
        assert metrics.leases_released == 1 and metrics.leases_expired == 0
        assert metrics.vllm_requests_answered == 2  # the fetch and the connect
        assert prefill.live_resources()["remote_agents"] == 1  # "d", by aionixl's handshake
    assert zero_resources(prefill) and zero_resources(decode)


async def test_a_reader_reads_by_vllms_wire_without_a_named_handshake_or_when_that_handshake_fails(
        caplog: pytest.LogCaptureFixture) -> None:
    """No route (the engine does not listen), no ``prefer_aionixl``, or a route whose
    handshake refuses this reader (another ``compat``): vLLM's wire, whose read works."""
    src_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=6)
    dst_cache = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
    other = aionixl.EngineConfig(compat={"model": "other"})
    for listen, config, prefer in (
            (None, aionixl.EngineConfig(), True),
            ("tcp://127.0.0.1:0", aionixl.EngineConfig(), False),
            ("tcp://127.0.0.1:0", other, True)):
        async with aionixl.Engine("p", src_cache, listen=listen) as prefill, \
                aionixl.Engine("d", dst_cache, listen=None, config=config) as decode:
            address = await aionixl.vllm.serve(prefill, **SERVE)
            reply = await aionixl.vllm.fetch_metadata(address, timeout=10)
            assert (reply.aionixl is None) == (listen is None)
            caplog.clear()
            peer = await aionixl.vllm.connect(decode, address, timeout=10, prefer_aionixl=prefer)
            assert not peer.features and peer.name == metadata_agent_name(reply.metadata.agent_metadata)
            await decode.transfer_blocks(peer, [3], [7])
            assert all(np.array_equal(d[3], s[7]) for d, s in zip(dst_cache, src_cache, strict=True))
            fell_back = [r for r in caplog.records if "reading by vLLM's wire instead" in r.getMessage()]
            assert len(fell_back) == (1 if config is other else 0)
        assert zero_resources(prefill) and zero_resources(decode)


def test_a_wildcard_route_is_reached_at_the_side_channels_host() -> None:
    from aionixl._vllm_connect import _reachable

    assert _reachable("tcp://0.0.0.0:7001", "tcp://10.1.2.3:5600") == "tcp://10.1.2.3:7001"
    assert _reachable("tcp://*:7001", "tcp://prefill-host:5600") == "tcp://prefill-host:7001"
    assert _reachable("tcp://10.9.9.9:7001", "tcp://10.1.2.3:5600") == "tcp://10.9.9.9:7001"


async def test_vllm_connects_that_arrive_together_share_one_handshake_and_its_failure() -> None:
    """Three calls for one side channel at once: it is asked once. Against one that never
    answers all three fail with that one handshake's timeout (a HandshakeError each);
    against a live one all three get the same peer."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with aionixl.Engine("p", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as prefill, \
                aionixl.Engine("d", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None) as decode:
            failures: list[BaseException] = []
            peers: list[aionixl.Peer] = []

            async def connect(address: str) -> None:
                try:
                    peers.append(await aionixl.vllm.connect(decode, address, timeout=1.0))
                except aionixl.HandshakeError as exc:
                    failures.append(exc)

            with anyio.fail_after(10):
                async with anyio.create_task_group() as tg:
                    for _ in range(3):
                        tg.start_soon(connect, f"tcp://127.0.0.1:{port}")
            assert len(failures) == 3 and not peers
            asked = 0
            while silent.poll(0):
                silent.recv_multipart()
                asked += 1
            assert asked == 1
            address = await aionixl.vllm.serve(prefill, **SERVE)
            async with anyio.create_task_group() as tg:
                for _ in range(3):
                    tg.start_soon(connect, address)
            assert len(peers) == 3 and peers[0] is peers[1] is peers[2]
            assert prefill.metrics().vllm_requests_answered == 1
    finally:
        silent.close(linger=0)
        ctx.term()
