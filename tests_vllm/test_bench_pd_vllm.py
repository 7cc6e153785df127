"""``aionixl bench --workload pd --with-vllm --quick``: vLLM's real connector on the P/D
request workload, beside bare NIXL and aionixl, checked for shape (no timings asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEYS = {"contender", "load", "p50_us", "p99_us", "p999_us", "gbps", "cpu_s_per_gb", "requests", "verified"}


def test_bench_pd_with_vllm_quick_shape(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    proc = subprocess.run([sys.executable, "-m", "aionixl", "bench", "--workload", "pd", "--with-vllm",
                           "--quick", "--pd-repeats", "1", "--no-pd-control",  # shape, not timings
                           "--contenders", "bare,asyncio,vllm", "--no-progress",
                           "--json", str(out)], capture_output=True, text=True, timeout=1200, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["pd"]
    assert {r["contender"] for r in rows} == {"bare", "aionixl-asyncio", "vllm"}
    vllm = [r for r in rows if r["contender"] == "vllm"]
    assert len(vllm) == len({r["load"] for r in rows}) >= 6
    for r in rows:
        assert set(r) == KEYS
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in ("p50_us", "p99_us", "gbps", "cpu_s_per_gb"))
        assert r["verified"] == r["requests"] > 0, r
    assert report["pd_saturation_gbps"]["vllm"] > 0
    p99 = next(t for t in report["pd_targets"] if t["key"] == "p99_0.25")
    assert math.isfinite(p99["results"]["vllm"]["value"])
    assert report["pd_verified_blocks"]["vllm"] > 0
    # Every contender's p50 splits at the call (vLLM's: the step that hands a request over).
    for d in report["pd_detail"]["loads"]:
        assert math.isfinite(d["to_call_p50_us"]) and d["to_call_p50_us"] >= 0, d
        assert math.isfinite(d["after_call_p50_us"]) and d["after_call_p50_us"] > 0, d
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"  # the plot, beside the JSON
