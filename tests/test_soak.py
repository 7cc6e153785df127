"""``aionixl soak``, CI-sized: 60 s of faults over 4 network-namespace hosts x 8 engines.

The command runs as a user runs it (``python -m aionixl soak --duration 60 --hosts 4
--engines 8 --json PATH``): it starts its own etcd, hosts and engines, injects SIGKILLs,
SIGSTOPs, link cuts and etcd restarts, and tears everything down. The test reads the JSON:
the work done, the faults of every kind, and the violations, which the command's exit status
mirrors. Root, iproute2 and an etcd binary only (skipped otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from aionixl.testing._etcd import etcd_binary

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="the soak's hosts are network namespaces: root only"),
    pytest.mark.skipif(etcd_binary() is None, reason="no etcd binary (apt-get install etcd-server)"),
]

FAULT_KINDS = {"sigkill", "sigstop", "link_cut", "etcd_restart"}


def test_a_60_second_soak_of_32_engines_under_every_fault_kind_keeps_every_invariant(tmp_path: Path) -> None:
    report = tmp_path / "soak.json"
    argv = [sys.executable, "-m", "aionixl", "soak", "--duration", "60", "--hosts", "4", "--engines", "8",
            "--json", str(report), "--seed", "1", "--fault-interval", "1.5"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=600)
    assert report.exists(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(report.read_text())
    details = json.dumps(summary["violation_details"], indent=1)[:6000]

    # the work: 32 engines moved blocks the whole time, and every byte that landed was checked
    assert summary["engines"] == 32 and summary["duration_s"] >= 60
    assert summary["transfers_ok"] > 2000, summary
    assert summary["bytes_verified"] > 10 * 1024 * 1024
    assert summary["connects_ok"] >= 32
    # the faults: every kind, and the killed engines came back
    assert set(summary["faults_by_kind"]) == FAULT_KINDS, summary["faults_by_kind"]
    assert summary["engine_restarts"] == summary["faults_by_kind"]["sigkill"]
    # errors were typed and came in time (the worst is also in the violations, if any)
    assert summary["worst_time_to_error_s"] is not None and summary["worst_time_to_error_s"] <= 1.0, details
    # the invariants: violations is the top-level integer, the exit status says the same
    assert isinstance(summary["violations"], int)
    assert summary["violations"] == sum(summary["violations_by_kind"].values())
    assert done.returncode == (1 if summary["violations"] else 0), done.stderr[-3000:]
    # None at all: an engine that died or could not restart, an untyped error, an error later
    # than its deadline + 1 s, bytes that do not verify, late bytes in a block after its read
    # failed (push reads land in staging slots first: docs/read-modes.md), resources or
    # threads left after a close.
    assert summary["violations"] == 0, details
    assert summary["staging_exhausted"] == 0, summary  # no read refused for want of slots
    assert summary["engines_closed_clean"] == 32
    plot = report.with_suffix(".png")
    assert plot.exists() and plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
