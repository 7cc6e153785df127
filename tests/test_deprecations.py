"""The names that moved in 0.2 keep working until 0.3, each with a DeprecationWarning that
names the new spelling (pyproject's filterwarnings makes them errors everywhere else, so
no other test uses them)."""

from __future__ import annotations

import dataclasses

import pytest

import aionixl
import aionixl.lowlevel
import aionixl.vllm
from aionixl.lowlevel import Tuning

from .helpers import engine_pair, numpy_cache

pytestmark = pytest.mark.anyio

SERVE = {"engine_id": "prefill-0", "compat_hash": "c0ffee" * 8, "block_size": 16,
         "kv_cache_layout": "LBHNC", "attn_backend_name": "CPU_ATTN"}


def test_the_public_surface_is_cut_to_what_users_need() -> None:
    deprecated = {"stats", "nixl_metadata", "poll_nixl", "trace_wakeups", "connect_vllm", "serve_vllm",
                  "heartbeat", "vllm_engine_id"}
    public = {n for n in dir(aionixl.Engine) if not n.startswith("_")}
    assert deprecated <= public
    assert len(public - deprecated) <= 20, sorted(public - deprecated)
    assert len(dataclasses.fields(aionixl.EngineConfig)) <= 12


@pytest.mark.parametrize("name", sorted({f.name for f in dataclasses.fields(Tuning)} - {"agent_factory"}))
def test_every_name_that_moved_to_tuning_still_configures_the_engine(name: str) -> None:
    value = getattr(Tuning(), name)
    with pytest.warns(DeprecationWarning, match=rf"EngineConfig.{name} moved to aionixl.lowlevel.Tuning"):
        config = aionixl.EngineConfig(**{name: value})
    with pytest.warns(DeprecationWarning, match=rf"Tuning\({name}="):
        assert getattr(config, name) == value


async def test_the_moved_values_reach_the_engine_and_win_over_its_tuning() -> None:
    with pytest.warns(DeprecationWarning):
        config = aionixl.EngineConfig(coalesce_window=0.25, transfer_timeout=7.0)
    engine = aionixl.Engine("moved", numpy_cache(2, 64, 1), config=config,
                            tuning=Tuning(coalesce_window=0.5, inline_polls=2))
    assert engine._tuning.coalesce_window == 0.25 and engine._tuning.inline_polls == 2
    assert engine.config.transfer_timeout == 7.0


async def test_the_deprecated_engine_members_warn_and_do_what_their_new_spelling_does() -> None:
    async with engine_pair(numpy_cache(4, 256, 1, seed=1), numpy_cache(4, 256, 1)) as (src, dst, peer):
        await dst.transfer_blocks(peer, [0], [1])
        with pytest.warns(DeprecationWarning, match=r"Engine.stats\(\) is deprecated: use Engine.metrics"):
            stats = dst.stats()
        metrics = dst.metrics()
        assert stats == {key: int(getattr(metrics, key)) for key in stats}
        assert "pushes_refused" in stats and "vllm_serving_restarts" in stats
        with pytest.warns(DeprecationWarning, match="aionixl.lowlevel.nixl_metadata"):
            assert src.nixl_metadata() == aionixl.lowlevel.nixl_metadata(src) != b""
        with pytest.warns(DeprecationWarning, match="aionixl.lowlevel.poll_nixl"):
            assert src.poll_nixl() == []
        trace: list[int] = []
        with pytest.warns(DeprecationWarning, match="aionixl.lowlevel.trace_wakeups"):
            dst.trace_wakeups(trace)
        with pytest.warns(DeprecationWarning, match="aionixl.vllm.heartbeat"):
            await dst.heartbeat(peer, ["req-1"])
        with pytest.warns(DeprecationWarning, match="aionixl.vllm.engine_id"):
            assert src.vllm_engine_id is None
        with pytest.warns(DeprecationWarning, match="aionixl.vllm.serve"):
            address = await src.serve_vllm(**SERVE)
        served_id = aionixl.vllm.engine_id(src)
        assert served_id is not None and served_id.startswith("prefill-0~")
        with pytest.warns(DeprecationWarning, match="aionixl.vllm.engine_id"):
            assert src.vllm_engine_id == served_id
        reply = await aionixl.vllm.fetch_metadata(address, timeout=10)
        assert reply.metadata.engine_id == served_id
