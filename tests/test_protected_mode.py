"""Protected mode: no unauthenticated listener that other hosts can reach. An engine whose
listener binds such an address without a handshake secret refuses to start, naming both
fixes; ``EngineConfig(allow_unauthenticated=True)`` opts out for trusted networks. vLLM's
side channel cannot be signed: it serves other hosts only with the opt-out."""

from __future__ import annotations

import pytest

import aionixl
import aionixl.vllm
from aionixl._zmq import exposed

from .helpers import numpy_cache, unique

pytestmark = pytest.mark.anyio

SECRET = b"a shared secret of 16+ bytes"
SERVE = {"engine_id": "prefill-0", "compat_hash": "c0ffee" * 8, "block_size": 16,
         "kv_cache_layout": "LBHNC", "attn_backend_name": "CPU_ATTN"}


@pytest.mark.parametrize(("endpoint", "reachable"), [
    ("tcp://127.0.0.1:0", False), ("tcp://127.3.2.1:5555", False), ("tcp://localhost:0", False),
    ("tcp://[::1]:0", False), ("ipc:///tmp/aionixl.sock", False), ("inproc://engine", False),
    ("bogus://nowhere", False),  # zmq's bind refuses it (ListenError)
    ("tcp://0.0.0.0:0", True), ("tcp://*:5555", True), ("tcp://10.1.2.3:5555", True),
    ("tcp://[::]:0", True), ("tcp://prefill-host:5555", True), ("ws://10.1.2.3:80", True),
])
def test_only_network_transports_beyond_loopback_count_as_reachable_from_other_hosts(
        endpoint: str, reachable: bool) -> None:
    assert exposed(endpoint) is reachable


@pytest.mark.parametrize("listen", ["tcp://0.0.0.0:0", "tcp://*:0", "tcp://10.1.2.3:5555"])
def test_a_listener_other_hosts_can_reach_needs_a_secret_and_the_error_names_both_fixes(listen: str) -> None:
    with pytest.raises(aionixl.UnprotectedListenerError) as refused:
        aionixl.Engine(unique("open"), numpy_cache(4, 64, 1), listen=listen)
    # A caller catching ValueError (a bad argument) or ListenError (no listener) sees it.
    assert isinstance(refused.value, ValueError) and isinstance(refused.value, aionixl.ListenError)
    text = str(refused.value)
    assert listen in text and "handshake_secret" in text and "allow_unauthenticated=True" in text


async def test_a_wildcard_listener_opens_with_a_secret_or_the_opt_out_and_serves_its_peers() -> None:
    for config in (aionixl.EngineConfig(handshake_secret=SECRET),
                   aionixl.EngineConfig(allow_unauthenticated=True)):
        async with aionixl.Engine(unique("wild"), numpy_cache(4, 64, 1, seed=1), listen="tcp://0.0.0.0:0",
                                  config=config) as server, \
                aionixl.Engine(unique("client"), numpy_cache(4, 64, 1), listen=None, config=config) as client:
            assert server.address is not None
            port = server.address.rsplit(":", 1)[1]
            peer = await client.connect(f"tcp://127.0.0.1:{port}", timeout=10)
            await client.transfer_blocks(peer, [0], [1])


async def test_loopback_needs_no_secret() -> None:
    async with aionixl.Engine(unique("local"), numpy_cache(4, 64, 1), listen="tcp://127.0.0.1:0") as engine:
        assert engine.address is not None and engine.address.startswith("tcp://127.0.0.1:")


async def test_vllm_decoders_are_served_beyond_loopback_only_with_the_opt_out() -> None:
    async with aionixl.Engine(unique("p"), numpy_cache(4, 64, 1), listen=None,
                              config=aionixl.EngineConfig(handshake_secret=SECRET)) as secured:
        with pytest.raises(aionixl.UnprotectedListenerError, match=r"no authentication.*unauthenticated"):
            await aionixl.vllm.serve(secured, "tcp://0.0.0.0:0", **SERVE)
        assert aionixl.vllm.engine_id(secured) is None
        address = await aionixl.vllm.serve(secured, "tcp://127.0.0.1:0", **SERVE)  # loopback: served
        assert (await aionixl.vllm.fetch_metadata(address, timeout=10)).metadata.engine_id \
            == aionixl.vllm.engine_id(secured)
    async with aionixl.Engine(unique("p"), numpy_cache(4, 64, 1), listen=None,
                              config=aionixl.EngineConfig(allow_unauthenticated=True)) as trusting:
        address = await aionixl.vllm.serve(trusting, "tcp://0.0.0.0:0", **SERVE)
        port = address.rsplit(":", 1)[1]
        assert (await aionixl.vllm.fetch_metadata(f"tcp://127.0.0.1:{port}", timeout=10)).metadata.engine_id \
            == aionixl.vllm.engine_id(trusting)


def test_allow_unauthenticated_is_a_bool() -> None:
    with pytest.raises(ValueError, match="allow_unauthenticated must be a bool"):
        aionixl.EngineConfig(allow_unauthenticated=1)  # type: ignore[arg-type]
