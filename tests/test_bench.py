"""``aionixl bench``: one --quick run checked for the shape of its JSON and its PNG.

No timings are asserted: the numbers depend on the machine. What must hold is that every
contender ran, verified its bytes, and produced finite numbers where it has the measure.
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
from pathlib import Path
from typing import Any

import pytest

CONTENDERS = {"bare", "threaded", "memcpy", "asyncio", "trio"}
NIXL = {"bare", "threaded", "asyncio", "trio"}
AIONIXL = {"asyncio", "trio"}
#: measure -> contenders that must have it (others must show None, the table's "-").
EXPECTED: dict[str, set[str]] = {
    "seq_1": CONTENDERS, "seq_16": CONTENDERS, "seq_256": CONTENDERS,
    "seq_1_raw": {"bare"},
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
        proc = _bench("--quick", "--no-progress", "--json", str(json_path), "--plot", str(png_path))
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
        assert report["info"][name]["verified"] is True, name
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
    # The table went to stdout.
    assert "Targets" in proc.stdout and "bare NIXL" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_quick_run_writes_a_png(quick_run: Any) -> None:
    proc, _, png_path = quick_run
    assert proc.returncode == 0, proc.stderr
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cuda_without_a_gpu_is_a_clear_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    proc = _bench("--device", "cuda", timeout=60)
    assert proc.returncode == 2
    assert "--device cuda needs a CUDA GPU" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


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
