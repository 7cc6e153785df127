"""``aionixl bench --with-vllm --quick``: vLLM's real connector beside aionixl, checked for shape.

No timings are asserted. What must hold: both contenders ran and verified their bytes, and
every row a --with-vllm run adds has finite numbers for both, in a consistent order
(p50 <= p90 <= p99 per repeat), the close ran with reads posted, and threads were counted.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHARED = ["seq_1", "bulk", "connect", "idle_cpu", "lat_1_p50", "lat_1_p90", "lat_1_p99", "close_1",
          "threads_open", "threads_closed"]


def test_bench_with_vllm_quick_shape(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    proc = subprocess.run([sys.executable, "-m", "aionixl", "bench", "--with-vllm", "--quick",
                           "--contenders", "asyncio,vllm", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["contenders"]) == {"asyncio", "vllm"}
    assert report["config"]["with_vllm"] is True
    for name in ("asyncio", "vllm"):
        assert report["contenders"][name]["ok"], report["contenders"][name]
        assert report["info"][name]["verified"] is True
    measures = report["measures"]
    for key in SHARED:
        for name in ("asyncio", "vllm"):
            r = measures[key]["results"][name]
            assert r is not None, (key, name)
            assert all(math.isfinite(r[k]) for k in ("median", "min", "max")), (key, name)
    for name in ("asyncio", "vllm"):
        p = [measures[f"lat_1_p{q}"]["results"][name]["median"] for q in (50, 90, 99)]
        assert 0 < p[0] <= p[1] <= p[2], (name, p)
        assert measures["threads_open"]["results"][name]["min"] >= 0
    # The vLLM decode reading from vLLM's prefill and from aionixl's serving it (bytes
    # verified by the contender, which fails otherwise); only the vLLM column has them.
    for key in ("spaced_1_p50_vllm", "spaced_1_p50_served", "spaced_1_p50_isolated", "idle_cpu_served",
                "idle_cpu_isolated"):
        r = measures[key]["results"]
        assert r["asyncio"] is None and r["vllm"] is not None, key
        assert all(math.isfinite(r["vllm"][k]) and r["vllm"][k] >= 0 for k in ("median", "min", "max")), key
        if key.startswith("spaced"):
            assert r["vllm"]["n"] == report["config"]["repeats"], key
    info = report["info"]["vllm"]
    geometry = info["geometry"]
    assert geometry["page_bytes"] == report["config"]["block_bytes"]
    assert geometry["layers (regions)"] == report["config"]["regions"]
    for close in info["close"]:
        assert 0 <= close["in_flight"] <= report["config"]["close_inflight"]
        assert close["threads_open"] > close["threads_base"]  # vLLM's agent and helpers
    assert "vLLM connector" in proc.stdout
    assert "1-block read, p99 per read" in proc.stdout
    assert "vLLM decode reads served, p50" in proc.stdout
