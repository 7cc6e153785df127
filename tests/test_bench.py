"""``aionixl bench``: one --quick run checked for the shape of its JSON and its PNG.

No timings are asserted: the numbers depend on the machine. What must hold is that every
contender ran, verified its bytes (a count of blocks compared, never a flag it sets itself),
and produced finite numbers where it has the measure. The host<->device rows of ``--device
cuda`` run here on a DRAM stand-in for the host cache (there is no GPU): their writes must put
a pattern the prefill side never held and read it back.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
from aionixl._bench import UnverifiedError, mark_verified
from aionixl._bench._context import Context, Progress
from aionixl._bench._memory import WRITE_SALT, KVMemory
from aionixl._bench._spec import quick_spec
from aionixl._bench._target import Target

CONTENDERS = {"bare", "threaded", "memcpy", "asyncio", "trio"}
NIXL = {"bare", "threaded", "asyncio", "trio"}
AIONIXL = {"asyncio", "trio"}
#: measure -> contenders that must have it (others must show None, the table's "-").
EXPECTED: dict[str, set[str]] = {
    "seq_1": CONTENDERS, "seq_16": CONTENDERS, "seq_256": CONTENDERS,
    "seq_1_raw": {"bare"},
    "seq_1_part": {"bare", "asyncio", "trio"},
    "seq_1_push": AIONIXL, "bulk_push": AIONIXL,
    "scattered_16": CONTENDERS, "scattered_256": CONTENDERS,
    "inflight_64": NIXL, "inflight_256": NIXL, "inflight_1024": NIXL,
    "inflight_64_spawn": AIONIXL, "inflight_64_notify": AIONIXL, "inflight_mixed": AIONIXL,
    "growth_1024": NIXL,
    "bulk": CONTENDERS,
    "wake": AIONIXL,
    "connect": NIXL,
    "close": {"threaded", "asyncio", "trio"},
    "idle_cpu": {"threaded", "asyncio", "trio"},
    "lag_idle": AIONIXL, "lag_64": AIONIXL, "lag_64_tcp": AIONIXL,
}
#: Lateness can be ~0 either way; idle CPU can be 0. Everything else is a positive quantity.
MAY_BE_ZERO_OR_NEGATIVE = {"lag_idle", "lag_64", "lag_64_tcp"}
MAY_BE_ZERO = {"idle_cpu"}


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    return subprocess.run([sys.executable, "-m", "aionixl", "bench", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=Path(__file__).parent.parent)


@pytest.fixture(scope="module")
def quick_run() -> Iterator[tuple[subprocess.CompletedProcess[str], Path, Path]]:
    """One --quick run for the whole module (it takes ~15 s); its files are removed after."""
    with tempfile.TemporaryDirectory(prefix="aionixl-bench-test-") as tmp:
        json_path, png_path = Path(tmp) / "bench.json", Path(tmp) / "bench.png"
        proc = _bench("--quick", "--workload", "micro", "--no-progress", "--json", str(json_path),
                      "--plot", str(png_path))
        yield proc, json_path, png_path


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_quick_run_writes_json_of_the_right_shape(quick_run: Any) -> None:
    proc, json_path, _ = quick_run
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(json_path.read_text())
    for key in ("schema", "headline", "machine", "config", "contenders", "measures", "targets", "info",
                "elapsed_s"):
        assert key in report, key
    assert report["schema"] == "aionixl-bench/1"
    assert set(report["contenders"]) == CONTENDERS
    for name, c in report["contenders"].items():
        assert c["ok"] and c["error"] is None, name
        info = report["info"][name]
        # At least the checks before and after the timed loops, 64 block ids each, all passed.
        assert info["verified"] is True and info["verified_blocks"] >= 2 * 64, (name, info)
    assert report["config"]["quick"] is True
    measures = report["measures"]
    assert set(EXPECTED) <= set(measures)
    for key, want in EXPECTED.items():
        m = measures[key]
        assert m["title"] and m["unit"] and _finite(m["scale"])
        assert set(m["results"]) == CONTENDERS, key
        for contender, summary in m["results"].items():
            if contender not in want:
                assert summary is None, (key, contender)
                continue
            assert summary is not None, (key, contender)
            for stat in ("median", "min", "max", "p10", "p90"):
                v = summary[stat]
                assert _finite(v), (key, contender, stat, v)
                if key in MAY_BE_ZERO:
                    assert v >= 0, (key, contender, stat, v)
                elif key not in MAY_BE_ZERO_OR_NEGATIVE:
                    assert v > 0, (key, contender, stat, v)
            assert summary["min"] <= summary["median"] <= summary["max"]
            assert summary["n"] >= 1
    # Every target is evaluated for both aionixl backends.
    assert len(report["targets"]) >= 8
    for t in report["targets"]:
        assert t["op"] in ("<=", ">=") and _finite(t["limit"]) and t["limit"] > 0
        for backend in AIONIXL:
            r = t["results"][backend]
            assert _finite(r["value"]) and r["value"] >= 0, (t["key"], backend)
            assert isinstance(r["met"], bool)
    # Transfers really were in flight when the engines were closed.
    for backend in AIONIXL:
        metrics = report["info"][backend]["metrics"]
        assert metrics["transfers"]["read"]["ok"] > 0 and metrics["transferred_bytes"]["read"] > 0
        assert metrics["transfers"]["read"]["ok"] == sum(metrics["transfer_seconds"]["read"]["counts"])
        assert min(report["info"][backend]["close_in_flight"]) > 0
        assert report["info"][backend]["close_resources_left"] == [0]
    assert "bytes verified for every contender" in proc.stdout
    # bare NIXL: the verify set three times whole, twice as half-block parts (64 block ids each).
    assert "compared with the expected pattern: bare NIXL 320," in proc.stdout
    # The half-head slice row: a diagnostic, its ratio paired with bare NIXL's loop on its own
    # part-granular descriptor lists, repeat by repeat.
    part = next(t for t in report["targets"] if t["key"] == "seq_1_part_vs_bare")
    assert part["headline"] is False and part["title"] == "1 block half-head slices / bare NIXL"
    assert measures["seq_1_part"]["title"] == "1 block, half-head slices, seq."
    for backend in AIONIXL:
        assert part["results"][backend]["method"] == "paired", part
        ratios = report["info"][backend]["paired"]["seq_1_part_vs_bare"]
        assert len(ratios) == report["config"]["repeats"] and all(_finite(r) and r > 0 for r in ratios)
    assert report["config"]["tp_ratio"] == 2
    assert "1 block, half-head slices, seq." in proc.stdout
    # The table went to stdout.
    assert "Targets" in proc.stdout and "bare NIXL" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_quick_run_writes_a_png(quick_run: Any) -> None:
    proc, _, png_path = quick_run
    assert proc.returncode == 0, proc.stderr
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


PD_CONTENDERS = {"bare", "aionixl-asyncio", "aionixl-trio", "aionixl-uvloop", "threaded"}
PD_ROW_KEYS = {"contender", "load", "p50_us", "p99_us", "p999_us", "gbps", "cpu_s_per_gb", "requests",
               "verified"}


@pytest.fixture(scope="module")
def pd_run() -> Iterator[tuple[subprocess.CompletedProcess[str], Path, Path]]:
    """One ``--workload pd --quick`` run (about a minute and a half here), with only --json:
    the latency-versus-load plot goes beside it."""
    with tempfile.TemporaryDirectory(prefix="aionixl-bench-pd-test-") as tmp:
        json_path = Path(tmp) / "pd.json"
        proc = _bench("--workload", "pd", "--quick", "--no-progress", "--json", str(json_path), timeout=400)
        yield proc, json_path, json_path.with_suffix(".png")


def test_pd_quick_run_writes_json_of_the_right_shape(pd_run: Any) -> None:
    proc, json_path, _ = pd_run
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(json_path.read_text())
    rows = report["pd"]
    assert isinstance(rows, list) and rows
    loads = sorted({r["load"] for r in rows})
    assert [ld for ld in loads if ld <= 1.0] == [0.25, 0.5, 0.75, 0.9, 1.0] and max(loads) > 1.0
    assert {r["contender"] for r in rows} == PD_CONTENDERS
    assert len(rows) == len(loads) * len(PD_CONTENDERS)
    for r in rows:
        assert set(r) == PD_ROW_KEYS, r
        for key in ("p50_us", "p99_us", "p999_us", "gbps", "cpu_s_per_gb"):
            assert _finite(r[key]) and r[key] > 0, (r["contender"], r["load"], key)
        assert r["p50_us"] <= r["p99_us"] <= r["p999_us"]
        assert isinstance(r["requests"], int) and r["requests"] > 0
        # Every request's bytes were checked, and counted by the harness.
        assert r["verified"] == r["requests"], r
    sat = report["pd_saturation_gbps"]
    assert set(sat) == PD_CONTENDERS and all(_finite(v) and v > 0 for v in sat.values())
    keys = [t["key"] for t in report["pd_targets"]]
    assert keys == ["p99_0.25", "p99_0.5", "p99_0.75", "p99_0.9", "saturation", "cpu_per_gb"]
    for t in report["pd_targets"]:
        for name in ("aionixl-asyncio", "aionixl-trio", "aionixl-uvloop"):
            assert _finite(t["results"][name]["value"]) and isinstance(t["results"][name]["met"], bool)
        # The noise floor: bare NIXL's loop against itself, paired the same way; a control,
        # so never a "pd" row or a saturation entry (both checked above).
        floor = t["results"]["bare-control"]
        assert floor["method"] == "paired" and floor["paired_min"] <= floor["value"] <= floor["paired_max"]
    assert all(n > 0 for n in report["pd_verified_blocks"].values())
    # Every contender here says when it called: each p50 splits at the call, both parts real.
    for d in report["pd_detail"]["loads"]:
        assert _finite(d["to_call_p50_us"]) and d["to_call_p50_us"] >= 0, d
        assert _finite(d["after_call_p50_us"]) and d["after_call_p50_us"] > 0, d
    assert "P/D targets" in proc.stdout and "bare NIXL, again" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_pd_quick_run_writes_its_plot_beside_the_json(pd_run: Any) -> None:
    proc, _, png_path = pd_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_pd_requests_are_seeded_long_tailed_and_distinct() -> None:
    from aionixl._bench._pdwork import BlockPool, PdMemory, default_pd, make_requests

    pd = default_pd()
    a, b = make_requests(pd, 500, salt=3), make_requests(pd, 500, salt=3)
    assert [r.tokens for r in a] == [r.tokens for r in b] and [r.at for r in a] == [r.at for r in b]
    tokens = np.array([r.tokens for r in a])
    assert tokens.min() >= pd.min_tokens and tokens.max() <= pd.max_tokens
    assert np.median(tokens) < tokens.mean()  # long-tailed: most prompts are short
    for r in a:
        assert len(set(r.remote.tolist())) == r.nblocks == -(-r.tokens // pd.block_tokens)
    assert (np.diff([r.at for r in a]) > 0).all()
    pool = BlockPool(64, 1)
    ids = pool.take(40)
    assert ids is not None and len(set(ids.tolist())) == 40 and pool.take(30) is None
    pool.give(ids)
    assert pool.free == 64
    mem = PdMemory(2, 8, 64)
    local, remote = np.array([1, 2, 3]), np.array([5, 6, 7])
    assert not mem.check_sample(local, remote)
    for r in range(2):
        mem.words[r, local] = np.array([[((5 + i) << 24 | w | r << 48) ^ 0x5A17 for w in range(8)]
                                        for i in range(3)], dtype=np.uint64)
    assert mem.check_sample(local, remote)
    mem.clear_sample(local)
    assert not mem.check_sample(local, remote)


def test_pd_latency_splits_at_the_transfer_call_only_where_every_request_says_when() -> None:
    from aionixl._bench._pd import _split
    from aionixl._bench._pdwork import StepResult

    a = StepResult(latencies=[0.010, 0.020, 0.030], to_call=[0.001, 0.002, 0.009])
    b = StepResult(latencies=[0.040, 0.050], to_call=[0.004, 0.005])
    before, after = _split([a, b])
    assert before == pytest.approx(4000.0) and after == pytest.approx(21000.0)
    # A step measured elsewhere (the vLLM connector) says nothing of its calls: no split.
    assert _split([a, StepResult(latencies=[0.1])]) == (None, None)
    assert _split([StepResult(latencies=[0.1, 0.2], to_call=[0.01])]) == (None, None)


def test_pd_closed_loop_clock_starts_when_the_step_does() -> None:
    # A closed loop posts at once: a clock started ahead would not count its first requests
    # (bare NIXL's loop was credited 2 ms a step that way). An open loop's first arrival is
    # due a fixed lead after the start, the same for every contender.
    import time

    from aionixl._bench._pdwork import BlockPool, PdMemory, StepRecorder, default_pd

    pd = default_pd()
    for rate, lead in ((None, 0.0), (100.0, 0.002)):
        rec = StepRecorder(PdMemory(1, 8, 64), BlockPool(8, 1), pd, rate)
        before = time.perf_counter()
        t0 = rec.start()
        after = time.perf_counter()
        assert before + lead <= t0 <= after + lead


def test_pd_step_cpu_stops_at_the_last_request_not_at_the_contenders_teardown() -> None:
    from aionixl._bench._pdwork import BlockPool, PdMemory, StepRecorder, default_pd, process_cpu

    rec = StepRecorder(PdMemory(1, 8, 64), BlockPool(8, 1), default_pd(), None)
    rec.start()
    rec.stop()
    burn_until = process_cpu() + 0.1  # a teardown that takes 0.1 s of CPU
    while process_cpu() < burn_until:
        pass
    assert rec.finish().cpu_s < 0.05


def test_on_a_gpu_the_default_workload_runs_the_micro_measures_and_says_pd_is_left_out() -> None:
    from aionixl._bench import workloads

    assert workloads("all", "cpu") == (True, True, [])
    run_micro, run_pd, notes = workloads("all", "cuda")
    assert (run_micro, run_pd) == (True, False) and "DRAM only" in notes[0]
    assert workloads("pd", "cuda")[:2] == (False, True)  # asked for by name: refused later, clearly
    assert workloads("micro", "cuda") == (True, False, [])


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = _bench("--device", "cuda", timeout=60)
    assert proc.returncode == 2
    assert "--device cuda needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


@pytest.mark.parametrize("args", [
    ["--layers", "0"], ["--block-bytes", "0"], ["--repeats", "0"], ["--step-ms", "nan"],
    ["--step-ms", "inf"], ["--json", "/nonexistent-dir/x.json"], ["--workload", "pd", "--pd-requests", "0"],
    ["--workload", "pd", "--pd-repeats", "-1"]], ids=" ".join)
def test_bad_options_are_refused_before_anything_runs(args: list[str]) -> None:
    proc = _bench(*args, timeout=60)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("aionixl bench: ") and "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_uvloop_alone_without_the_pd_workload_is_refused() -> None:
    proc = _bench("--workload", "micro", "--contenders", "uvloop", timeout=60)
    assert proc.returncode == 2
    assert "runs in the P/D workload only" in proc.stderr and "Traceback" not in proc.stderr


def test_unknown_contender_is_refused() -> None:
    proc = _bench("--contenders", "bare,nope", timeout=60)
    assert proc.returncode == 2
    assert "unknown contender" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is importable here")
def test_with_vllm_without_vllm_is_a_clear_error() -> None:
    proc = _bench("--with-vllm", "--quick", "--no-progress", timeout=60)
    assert proc.returncode == 2
    assert "--with-vllm needs vLLM importable" in proc.stderr
    assert "./run vllm-bench" in proc.stderr
    assert proc.stdout == ""


def test_vllm_contender_needs_with_vllm() -> None:
    proc = _bench("--contenders", "asyncio,vllm", "--quick", "--no-progress", timeout=60)
    assert proc.returncode == 2
    assert "needs --with-vllm" in proc.stderr


def test_default_contenders_leave_trio_out_only_when_it_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    from aionixl._bench import choose_contenders

    assert choose_contenders("asyncio, trio", False) == (["asyncio", "trio"], [])
    if importlib.util.find_spec("trio") is not None:
        assert choose_contenders(None, False) == (["bare", "threaded", "memcpy", "asyncio", "trio"], [])
    assert choose_contenders("aionixl-uvloop,bare", False) == (["uvloop", "bare"], [])
    monkeypatch.setitem(sys.modules, "trio", None)  # import trio fails, as where it is not installed
    chosen, notes = choose_contenders(None, True)
    assert chosen == ["bare", "threaded", "memcpy", "asyncio", "vllm"]
    assert len(notes) == 1 and "trio is not installed" in notes[0]
    assert choose_contenders("trio", False) == (["trio"], [])  # asked for by name: refused later


def test_children_start_as_modules_of_this_aionixl() -> None:
    import aionixl
    from aionixl._bench._child import module_command

    argv, env = module_command("aionixl_contenders.target", "--peers", "1",
                               env={"PYTHONPATH": os.pathsep.join(["/elsewhere", ""])})
    assert argv == [sys.executable, "-m", "aionixl_contenders.target", "--peers", "1"]
    root = str(Path(aionixl.__file__).resolve().parent.parent)
    assert env["PYTHONPATH"].split(os.pathsep) == [root, "/elsewhere"]


def test_verified_comes_only_from_a_positive_count_of_blocks_compared() -> None:
    for info in ({}, {"verified": True}, {"verified_blocks": 0}, {"verified_blocks": True},
                 {"verified_blocks": "64"}):
        result: dict[str, Any] = {"seq_1": [1e-6], "info": dict(info)}
        with pytest.raises(UnverifiedError, match="compared none of the bytes"):
            mark_verified(result)
        assert result["info"]["verified"] is False, info
    result = {"info": {"verified_blocks": 64}}
    assert mark_verified(result) == 64 and result["info"]["verified"] is True
    with pytest.raises(UnverifiedError):
        mark_verified({})  # no info at all


# ---- host<->device rows on a DRAM stand-in (the --device cuda code paths, without a GPU)

HOST_SPEC = replace(quick_spec(), layers=1, blocks=64, block_bytes=4096, peers=1, bulk_bytes=16 * 8192,
                    bulk_count=2, repeats=1, seq={1: 2, 16: 2}, scattered=(16,), inflight=(16,),
                    lag_workers=16)


@pytest.fixture(scope="module")
def host_ctx() -> Iterator[Context]:
    """A real prefill process (one unit, DRAM) and a Context whose ``host`` is a second DRAM
    cache: what ``--device cuda`` gives the contenders, with DRAM where VRAM would be."""
    spec = HOST_SPEC
    assert spec.bulk_blocks == 16 and not spec.problems()
    target = Target(spec.layers, spec.blocks, spec.block_bytes, "cpu", spec.peers)
    try:
        target.wait_ready()
        local = KVMemory(spec.regions, spec.blocks, spec.block_bytes)
        host = KVMemory(spec.regions, spec.blocks, spec.block_bytes)
        yield Context(spec, local, target, Progress(False), host)
    finally:
        target.stop()


@pytest.mark.parametrize("name", ["aionixl-asyncio", "aionixl-trio"])
def test_pd_aionixl_requests_that_find_the_pool_empty_wait_for_blocks_and_all_finish(
        host_ctx: Context, name: str) -> None:
    # 24 requests of 24-32 blocks against a pool of 64: in a closed loop of 4, the third
    # caller in flight must wait for blocks to come back. An open loop whose requests all
    # arrive at once may or may not wait (a read often ends inside its post), but finishes.
    from aionixl._bench import _pd_aionixl
    from aionixl._bench._pdwork import BlockPool, PdMemory, StepRecorder, default_pd, make_requests

    spec = HOST_SPEC
    pd = replace(default_pd(), layers=spec.layers, block_bytes=spec.block_bytes, blocks=spec.blocks,
                 min_tokens=384, max_tokens=512)
    memory = PdMemory(spec.regions, spec.blocks, spec.block_bytes)
    ctx = Context(spec, memory, host_ctx.target, Progress(False))
    reqs = make_requests(pd, 24, salt=7)
    for rate, concurrency in ((None, 4), (1e6, None)):
        pool = BlockPool(pd.blocks, pd.seed)
        rec = StepRecorder(memory, pool, pd, rate)
        checked = _pd_aionixl.step(ctx, name, rec, reqs, concurrency)
        res = rec.finish()
        assert res.requests == res.verified == len(reqs) == len(res.to_call)
        assert res.waited_for_blocks > 0 or rate is not None
        assert pool.free == pd.blocks  # every request gave its blocks back
        assert checked == 2 * ctx.verify_blocks  # the verify set read before and after


def _prefill_intact(ctx: Context, salt: int = 0) -> bool:
    """Whether the prefill blocks the write rows write hold the pattern with ``salt``
    (read back into our cleared blocks by bare NIXL, a path independent of aionixl)."""
    from aionixl_contenders.bare_nixl import BareNixl

    loc, rem = ctx.write_pair()
    bare = BareNixl(ctx, ctx.unique("check"), ctx.local)
    try:
        ctx.local.clear(loc)
        bare.one(ctx.local_indices(loc), ctx.remote_indices(rem))
        return ctx.local.check(loc, rem, salt)
    finally:
        bare.close()


def _rows_ok(rows: dict[str, list[float]], spec: Any) -> None:
    assert set(rows) == {"bulk_d2h", "bulk_h2d"}
    for key, values in rows.items():
        assert len(values) == spec.repeats and all(_finite(v) and v > 0 for v in values), (key, values)


def test_write_pair_and_salted_pattern(host_ctx: Context) -> None:
    loc, rem = host_ctx.write_pair()
    assert len(loc) == len(rem) == HOST_SPEC.bulk_blocks and loc == list(range(loc[0], loc[0] + 16))
    assert _prefill_intact(host_ctx) and not _prefill_intact(host_ctx, WRITE_SALT)
    memory = KVMemory(2, 4, 64)
    memory.fill_expected([0, 1], [2, 3], WRITE_SALT)
    assert memory.check([0, 1], [2, 3], WRITE_SALT)
    assert not memory.check([0, 1], [2, 3]) and not memory.check([0, 1], [2, 3], WRITE_SALT ^ 1)


def test_aionixl_host_device_rows_write_a_new_pattern_and_read_it_back(host_ctx: Context) -> None:
    from aionixl._bench import _aionixl

    rows, checked = anyio.run(_aionixl._host_device, host_ctx, "aionixl test")
    _rows_ok(rows, HOST_SPEC)
    # Two checks of the 64-block verify set, the written pattern and the restored one (16 each).
    assert checked == 2 * 64 + 2 * 16
    assert _prefill_intact(host_ctx)  # restored for whoever reads next


def test_aionixl_host_to_device_writes_that_move_nothing_fail_verification(
        host_ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    from aionixl._bench import _aionixl
    from aionixl._transfers import Transfers

    real = Transfers.transfer_blocks

    async def writes_move_nothing(self: Transfers, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("op") == "write":
            return None  # "done", and nothing moved
        return await real(self, *args, **kwargs)

    # Engine binds its transfer_blocks to this class's method when it is created.
    monkeypatch.setattr(Transfers, "transfer_blocks", writes_move_nothing)
    with pytest.raises(RuntimeError, match="do not hold the distinct pattern written"):
        anyio.run(_aionixl._host_device, host_ctx, "aionixl test")
    monkeypatch.undo()
    assert _prefill_intact(host_ctx)


def test_bare_nixl_host_device_rows_write_a_new_pattern_and_read_it_back(host_ctx: Context) -> None:
    from aionixl_contenders.bare_nixl import host_device

    rows, checked = host_device(host_ctx)
    _rows_ok(rows, HOST_SPEC)
    assert checked == 2 * 64 + 2 * 16
    assert _prefill_intact(host_ctx)


def test_memcpy_host_device_rows_copy_a_new_pattern_and_check_it(host_ctx: Context) -> None:
    from aionixl._bench._memcpy import host_device

    spec = HOST_SPEC
    source = KVMemory(spec.regions, spec.blocks, spec.block_bytes)
    source.fill_pattern()
    rows, checked = host_device(host_ctx, source)
    _rows_ok(rows, spec)
    assert checked == 64 + 16
    every = list(range(spec.blocks))
    assert source.check(every, every)  # its pattern back for the bulk reference


# ---- the half-head slice rows: part reads checked in place, nothing else changed ---------


def test_part_check_sees_a_part_out_of_place_or_any_other_byte_changed() -> None:
    from aionixl._bench._memory import expected_words

    memory = KVMemory(2, 8, 64)
    calls = [([1, 4], [6, 2], 0), ([5], [3], 1)]
    words, half = 8, 4

    def put(block: int, remote: int, index: int, region: int | None = None) -> None:
        for r in range(2) if region is None else (region,):
            lo = index * half
            memory.regions[r].view(np.uint64)[block, lo:lo + half] = \
                expected_words(r, np.array([remote]), words)[0, lo:lo + half]

    def fill() -> None:
        memory.clear_all()
        for loc, rem, index in calls:
            for b, rb in zip(loc, rem, strict=True):
                put(b, rb, index)

    fill()
    assert memory.check_parts(calls, 2)
    memory.clear_all()
    assert not memory.check_parts(calls, 2)  # nothing read
    fill()
    put(5, 3, 0)  # the other half of block 5 written too (as a whole-block read would)
    assert not memory.check_parts(calls, 2)
    fill()
    put(0, 6, 1, region=1)  # a block no call reads, one region
    assert not memory.check_parts(calls, 2)
    fill()
    memory.regions[0][1, 0] ^= 1  # one byte of a part
    assert not memory.check_parts(calls, 2)
    memory.clear_all()
    put(1, 6, 1)  # block 1's part landed in the wrong half
    put(4, 2, 0)
    put(5, 3, 1)
    assert not memory.check_parts(calls, 2)


def test_part_descriptors_cut_every_block_into_its_part() -> None:
    from aionixl._bench._memory import block_descriptors, part_descriptors

    memory = KVMemory(2, 4, 64)
    layout = memory.layout()
    whole = block_descriptors(layout)
    for index in (0, 1):
        rows = part_descriptors(layout, index, 2)
        assert rows.shape == whole.shape  # one row per block and region, indexed alike
        assert (rows[:, 0] == whole[:, 0] + index * 32).all() and (rows[:, 1] == 32).all()
        assert (rows[:, 2] == whole[:, 2]).all()


def test_part_verify_calls_take_turns_over_the_verify_set(host_ctx: Context) -> None:
    calls = host_ctx.part_verify_calls
    loc, rem = host_ctx.verify_set
    assert [c[2] for c in calls] == [0, 1]
    assert sorted(x for c in calls for x in c[0]) == sorted(int(x) for x in loc)
    assert {(a, b) for c in calls for a, b in zip(c[0], c[1], strict=True)} == \
        {(int(a), int(b)) for a, b in zip(loc, rem, strict=True)}
    parts = host_ctx.part_workload()
    assert [p[:2] for p in parts] == host_ctx.workload("contiguous", 1)
    assert [p[2] for p in parts[:4]] == [0, 1, 0, 1]


def test_part_reads_land_in_their_place_for_aionixl_and_bare_nixl(host_ctx: Context) -> None:
    from aionixl._bench import _aionixl
    from aionixl_contenders.bare_nixl import BareNixl, _verify_parts

    async def aionixl_parts() -> int:
        async with aionixl.Engine(host_ctx.unique("parts"), host_ctx.local.regions, listen=None) as eng:
            peer = await eng.connect(host_ctx.units[0].address, timeout=30)
            return await _aionixl._verify_parts(host_ctx, eng, peer, "test")

    assert anyio.run(aionixl_parts) == 64
    bare = BareNixl(host_ctx, host_ctx.unique("parts-bare"), host_ctx.local)
    try:
        assert _verify_parts(host_ctx, bare) == 64
    finally:
        bare.close()


def test_part_reads_that_move_whole_blocks_fail_verification(
        host_ctx: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    from aionixl._bench import _aionixl
    from aionixl._transfers import Transfers

    real = Transfers.transfer_blocks

    async def whole_blocks(self: Transfers, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("local_part", None)
        kwargs.pop("remote_part", None)
        return await real(self, *args, **kwargs)  # the right half, and the other one too

    monkeypatch.setattr(Transfers, "transfer_blocks", whole_blocks)

    async def aionixl_parts() -> int:
        async with aionixl.Engine(host_ctx.unique("parts"), host_ctx.local.regions, listen=None) as eng:
            peer = await eng.connect(host_ctx.units[0].address, timeout=30)
            return await _aionixl._verify_parts(host_ctx, eng, peer, "test")

    with pytest.raises(RuntimeError, match="block parts read are not where they belong"):
        anyio.run(aionixl_parts)
