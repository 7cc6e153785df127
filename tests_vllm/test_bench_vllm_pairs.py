"""``aionixl bench --workload vllm-pairs``: real vLLM P/D pairs with NixlConnector and with
AionixlConnector on the same open-loop requests, checked for shape and correctness (every
request verified, both connectors' tokens equal), never for timings."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LATENCIES = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_rps")


def test_bench_vllm_pairs_holds_both_connectors_rows(tmp_path: Path) -> None:
    out = tmp_path / "pairs.json"
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    proc = subprocess.run([sys.executable, "-m", "aionixl", "bench", "--workload", "vllm-pairs", "--quick",
                           "--pairs-loads", "2", "--pairs-requests", "6", "--no-progress", "--json", str(out)],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    section = json.loads(out.read_text())["vllm_pairs"]
    rows = section["rows"]
    assert sorted(r["connector"] for r in rows) == ["aionixl", "nixl"]
    for r in rows:
        assert r["load_rps"] == 2.0 and r["requests"] == r["completed"] == r["verified"] == 6, r
        assert all(math.isfinite(r[k]) and r[k] > 0 for k in LATENCIES), r
        assert r["ttft_p50_ms"] <= r["e2e_p50_ms"], r
    # The same prompts through both pairs: vLLM decoded the same tokens from either connector's KV.
    assert section["same_tokens_both_connectors"] == 6
    assert set(section["ratios"]["2"]) == set(LATENCIES)
    for connector, c in section["connectors"].items():
        assert c["clean_stops"] == c["pairs"] == 1, (connector, c)
        for role in ("prefill", "decode"):
            assert c["threads"][f"{role}/Worker"] > 0 and c["threads"][f"{role}/EngineCore"] > 0, c
            assert 0 <= c["idle_cpu_cores"][f"{role}/Worker"] < 2.5, c  # a share of this machine's cores
            assert c["shutdown_s"][role] > 0, c
    assert "AionixlConnector" in proc.stdout and "NixlConnector" in proc.stdout  # the table
