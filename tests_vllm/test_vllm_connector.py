"""``AionixlConnector``'s worker on its own, without a vLLM instance: its loop-side handling
of vLLM's per-step connector metadata, on a real aionixl engine pair (the prefill engine
holds the leases, the other sends the decode's notifications). Whole vLLM pairs are in
tests_vllm/test_pd_pair.py."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import pytest

import aionixl
from aionixl.testing import engine_pair
from aionixl.vllm_connector import _Worker

pytestmark = pytest.mark.anyio


def step(**fields: Any) -> Any:
    """One step's connector metadata, with the fields the worker reads (empty unless given)."""
    meta = {"reqs_in_batch": set(), "reqs_to_send": {}, "reqs_not_processed": set(), "reqs_to_recv": {},
            "heartbeat_by_engine": {}}
    return SimpleNamespace(**{**meta, **fields})


def producer() -> _Worker:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_producer",
                                           kv_connector_extra_config={"kv_lease_duration": 30}),
        parallel_config=SimpleNamespace(data_parallel_index=0))
    return _Worker(config, "prefill-engine")  # type: ignore[arg-type]


async def test_a_read_done_before_the_schedulers_word_frees_the_blocks_once(anyio_backend: str) -> None:
    """The decode's read-done can arrive between ``reqs_in_batch`` and ``reqs_to_send``: the
    blocks are reported free once, when the scheduler says it holds them, and no second
    lease is opened for them (it would expire 30 s later and report them again)."""
    async with engine_pair() as pair, anyio.create_task_group() as tg:
        decode, prefill, peer = pair.a, pair.b, pair.peer
        worker = producer()
        worker._engine, worker._tg = prefill, tg
        await worker._apply(step(reqs_in_batch={"r1"}))
        assert "r1" in prefill.leases
        await decode.send_notification(peer, aionixl.read_done("r1"))
        with anyio.fail_after(10):
            while "r1" in prefill.leases:
                await anyio.sleep(0.005)
        await anyio.sleep(0)  # the lease's watcher runs
        assert worker.results().finished_sending == set()  # the scheduler has not said so yet
        await worker._apply(step(reqs_to_send={"r1": 0.0}))
        assert worker.results().finished_sending == {"r1"}
        assert "r1" not in prefill.leases
        await worker._apply(step(reqs_in_batch={"r2"}, reqs_to_send={"r2": 0.0}))
        await decode.send_notification(peer, aionixl.read_done("r2"))  # the usual order
        with anyio.fail_after(10):
            while not (done := worker.results().finished_sending):
                await anyio.sleep(0.005)
        assert done == {"r2"} and not prefill.leases
        tg.cancel_scope.cancel()


async def test_a_producer_on_a_host_others_reach_needs_the_trusted_network_opt_out(
        anyio_backend: str) -> None:
    """A producer's engine listens for aionixl's handshake on the side channel's host: beyond
    loopback that is refused before anything binds, with the connector's own way out in the
    message (vLLM's side channel has no authentication either)."""
    import numpy as np

    worker = producer()
    worker._listen = "tcp://10.255.0.1:5600"  # VLLM_NIXL_SIDE_CHANNEL_HOST=10.255.0.1
    regions = [np.zeros((4, 4096), np.uint8)]
    with pytest.raises(aionixl.UnprotectedListenerError, match="aionixl_allow_unauthenticated"):
        await worker._run(regions, ["model.layers.0.self_attn.attn"], "CPU_ATTN", "c0ffee", 32,
                          task_status=anyio.TASK_STATUS_IGNORED)


def consumer() -> _Worker:
    config = SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_role="kv_consumer", kv_connector_extra_config={}),
        parallel_config=SimpleNamespace(data_parallel_index=0))
    return _Worker(config, "decode-engine")  # type: ignore[arg-type]


async def test_requests_waiting_behind_a_handshake_nobody_answers_fail_with_it(anyio_backend: str) -> None:
    """Three requests whose prefill's side channel never answers (the prefill stopped, or gone
    with its port taken): one handshake is tried, and when it times out all three are
    reported failed with their blocks (for vLLM's kv_load_failure_policy), instead of each
    trying in turn (a handshake timeout each)."""
    import numpy as np
    import zmq

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        async with aionixl.Engine("decode", [np.zeros((4, 4096), np.uint8)], listen=None) as engine, \
                anyio.create_task_group() as tg:
            worker = consumer()
            worker._engine, worker._tg, worker._handshake_timeout = engine, tg, 1.0
            remote = {"engine_id": "prefill-engine", "host": "127.0.0.1", "port": port}
            reqs = {f"r{i}": SimpleNamespace(remote=SimpleNamespace(**remote, block_ids=[[i]],
                                                                    request_id=f"p{i}"),
                                             local_block_ids=[[i]], awaiting_kvs=True) for i in range(3)}
            await worker._apply(step(reqs_to_recv=reqs))
            failed: set[str] = set()
            errors: set[int] = set()
            with anyio.fail_after(30):
                while len(failed) < 3:
                    await anyio.sleep(0.05)
                    results = worker.results()
                    assert results.failed_recving <= results.finished_recving  # reported as ended too
                    failed |= results.failed_recving
                    errors |= worker.load_errors()
            assert failed == set(reqs) and errors == {0, 1, 2}
            asked = 0
            while silent.poll(0):
                silent.recv_multipart()
                asked += 1
            assert asked == 1
            tg.cancel_scope.cancel()
    finally:
        silent.close(linger=0)
        ctx.term()
