"""The soak's report: the workers' events files, the faults and the orchestrator's own
findings in, the soak JSON and a plot out.

:func:`summarize` reads every events file (one per engine, each with one incarnation per
start of that engine: a SIGKILLed one may have left a torn last line, which is skipped and
counted) and returns the JSON-ready summary; ``"violations"`` is a top-level integer, the
count of violation records in the events plus the orchestrator's ``extra_violations``
(``{"kind": "engine_died", ...}``, ``{"kind": "resources_left", ...}``...). :func:`plot` draws
it (matplotlib, the ``bench`` extra, imported when called).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

#: Operations that move blocks (connects are counted apart; other records are checks).
TRANSFER_OPS = frozenset({"read", "write", "readback"})
#: How many violations the summary spells out.
MAX_DETAILS = 50

_START = '{"event":"start"'


def read_events(path: str | Path) -> dict[str, Any]:
    """One events file: ``{"path", "index", "name", "records" (operation and check lines, each
    with "incarnation" added), "events" (start, end, pause, crash lines), "incarnations",
    "partial_lines"}``. A line that does not parse (a killed incarnation's last) is skipped
    and counted; a start line glued to one is recovered."""
    records: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    partial = 0
    incarnation = 0
    index: int | None = None
    name: str | None = None
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().split("\n")
    for line in lines:
        line = line.strip()
        if not line:
            continue
        try:
            item = json.loads(line)
        except ValueError:
            item = None
        if not isinstance(item, dict):
            partial += 1
            at = line.rfind(_START)
            if at <= 0:
                continue
            try:
                item = json.loads(line[at:])
            except ValueError:
                continue
            if not isinstance(item, dict):
                continue
        if "event" in item:
            if item["event"] == "start":
                incarnation += 1
                index = item.get("index", index)
                name = item.get("name", name)
            events.append({**item, "incarnation": incarnation})
        elif "op" in item:
            records.append({**item, "incarnation": incarnation})
    return {"path": str(path), "index": index, "name": name, "records": records, "events": events,
            "incarnations": incarnation, "partial_lines": partial}


def _num(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def summarize(event_files: Iterable[str | Path], faults: Sequence[dict[str, Any]],
              extra_violations: Sequence[dict[str, Any]], duration: float) -> dict[str, Any]:
    """The soak JSON (see the module docstring; keys listed in the code)."""
    files = [read_events(p) for p in event_files]
    starts = [_num(e.get("t")) for f in files for e in f["events"] if e.get("event") == "start"]
    fault_times = [_num(x.get("t")) for x in faults]
    t0 = min(starts) if starts else (min(fault_times) if fault_times else 0.0)

    transfers = ok = connects = connects_ok = paused = pauses = checked = 0
    bytes_verified = 0
    errors: Counter[str] = Counter()
    connect_errors: Counter[str] = Counter()
    violation_kinds: Counter[str] = Counter()
    details: list[dict[str, Any]] = []
    worst_over: float | None = None
    worst_ratio: float | None = None
    worst_connect: float | None = None
    buckets: dict[int, dict[str, int]] = {}

    def bucket(t: float) -> dict[str, int]:
        second = max(0, int(t - t0))
        found = buckets.get(second)
        if found is None:
            found = buckets[second] = {"ok": 0, "errors": 0, "bytes": 0, "faults": 0}
        return found

    def violation(kind: str, item: dict[str, Any], engine: Any) -> None:
        violation_kinds[kind] += 1
        if len(details) < MAX_DETAILS:
            details.append({"kind": kind, "engine": engine, **{k: item[k] for k in (
                "t", "op", "peer", "blocks", "deadline", "elapsed", "error", "detail", "incarnation")
                if k in item}})

    for f in files:
        engine = f["name"] if f["name"] is not None else f["path"]
        for e in f["events"]:
            if e.get("event") == "pause":
                pauses += 1
            elif e.get("event") == "end":
                checked += int(_num(e.get("quarantine_checked")))
            elif e.get("event") == "crash":
                violation("worker_crash", {**e, "op": "worker"}, engine)
        for r in f["records"]:
            op = r.get("op")
            good = bool(r.get("ok"))
            elapsed, deadline = _num(r.get("elapsed")), _num(r.get("deadline"))
            if op in TRANSFER_OPS:
                transfers += 1
                paused += bool(r.get("self_paused"))
                bytes_verified += int(_num(r.get("verified_bytes")))
                slot = bucket(_num(r.get("t")) + elapsed)
                if good:
                    ok += 1
                    slot["ok"] += 1
                    slot["bytes"] += int(_num(r.get("verified_bytes")))
                else:
                    errors[str(r.get("error"))] += 1
                    slot["errors"] += 1
                    if not r.get("self_paused"):
                        over = elapsed - deadline
                        worst_over = over if worst_over is None else max(over, worst_over)
                        if deadline > 0:
                            ratio = elapsed / deadline
                            worst_ratio = ratio if worst_ratio is None else max(ratio, worst_ratio)
            elif op == "connect":
                connects += 1
                if good:
                    connects_ok += 1
                else:
                    connect_errors[str(r.get("error"))] += 1
                    if not r.get("self_paused"):
                        over = elapsed - deadline
                        worst_connect = over if worst_connect is None else max(over, worst_connect)
            if r.get("violation"):
                violation(str(r["violation"]), r, engine)

    for v in extra_violations:
        kind = str(v.get("kind", "orchestrator"))
        violation_kinds[kind] += 1
        if len(details) < MAX_DETAILS:
            details.append({**v, "kind": kind})

    spans = []
    for x in faults:
        t = _num(x.get("t"))
        bucket(t)["faults"] += 1
        spans.append({"t": round(t - t0, 3), "kind": str(x.get("kind")), "target": str(x.get("target", "")),
                      "duration": _num(x.get("duration"))})
    # Up to the last thing that happened (the workers' ends included), or the duration.
    ends = [_num(e.get("t")) for f in files for e in f["events"] if e.get("event") == "end"]
    last = max([*buckets, *(max(0, int(t - t0)) for t in ends)], default=None)
    seconds = math.ceil(duration) if last is None else last + 1
    timeline = [{"t": s, **buckets.get(s, {"ok": 0, "errors": 0, "bytes": 0, "faults": 0})}
                for s in range(seconds)]
    return {
        "duration_s": duration,
        "t0": t0,
        "engines": len({f["index"] if f["index"] is not None else f["path"] for f in files}),
        "incarnations": sum(f["incarnations"] for f in files),
        "transfers": transfers,
        "transfers_ok": ok,
        "connects": connects,
        "connects_ok": connects_ok,
        "bytes_verified": bytes_verified,
        "errors_by_type": dict(errors.most_common()),
        "connect_errors_by_type": dict(connect_errors.most_common()),
        "faults_by_kind": dict(Counter(str(x.get("kind")) for x in faults).most_common()),
        "worst_time_to_error_s": worst_over,
        "worst_error_to_deadline_ratio": worst_ratio,
        "worst_connect_time_to_error_s": worst_connect,
        "self_paused_transfers": paused,
        "pauses": pauses,
        "quarantine_checked": checked,
        "partial_lines": sum(f["partial_lines"] for f in files),
        "violations": sum(violation_kinds.values()),
        "violations_by_kind": dict(violation_kinds.most_common()),
        "violation_details": details,
        "faults": spans,
        "timeline": timeline,
    }


#: Fault kinds and their colours in the plot.
FAULT_COLOURS = {"sigkill": "#d62728", "sigstop": "#ff7f0e", "link_cut": "#9467bd", "etcd_restart": "#8c564b"}


def plot(summary: dict[str, Any], path: str | Path) -> None:
    """A PNG of transfers ok and failed per second, with the faults as spans (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timeline = summary["timeline"]
    xs = [b["t"] + 0.5 for b in timeline]
    fig, ax = plt.subplots(figsize=(14, 5.5))
    ax.plot(xs, [b["ok"] for b in timeline], "-", color="#2ca02c", label="transfers ok/s")
    ax.plot(xs, [b["errors"] for b in timeline], "-", color="#1f77b4", label="errors/s")
    seen: set[str] = set()
    for fault in summary.get("faults", ()):
        kind = fault["kind"]
        colour = FAULT_COLOURS.get(kind, "#7f7f7f")
        label = None if kind in seen else kind
        seen.add(kind)
        if fault["duration"] > 0:
            ax.axvspan(fault["t"], fault["t"] + fault["duration"], color=colour, alpha=0.15, label=label)
        else:
            ax.axvline(fault["t"], color=colour, alpha=0.6, linewidth=1, label=label)
    ax.set(xlabel="seconds", ylabel="per second", xlim=(0, max(len(timeline), 1)))
    ax.legend(loc="upper right", fontsize=8)
    worst = summary.get("worst_time_to_error_s")
    ax.set_title(f"aionixl soak: {summary['violations']} violations; {summary['transfers']} transfers "
                 f"({summary['transfers_ok']} ok), {summary['bytes_verified'] / 1e6:.1f} MB verified, "
                 f"{sum(summary['faults_by_kind'].values())} faults"
                 + ("" if worst is None else f"; worst time past deadline {worst:.2f} s"))
    fig.tight_layout()
    fig.savefig(str(path), dpi=100)
    plt.close(fig)
