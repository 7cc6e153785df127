"""Turning samples into the table, the targets, the JSON file and the plot."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

CONTENDERS: dict[str, tuple[str, str]] = {
    "bare": ("bare NIXL", "synchronous loops on NIXL's Python API, progress thread off, the "
             "ceiling; sequential rows use make_prepped_xfer/transfer/check_xfer_state/release one "
             "at a time, in-flight rows the batched loop (post N, then poll all)"),
    "threaded": ("threaded model", "a MODEL of the thread-based connector design (listener "
                 "thread on a zmq ROUTER with a 1 s receive timeout, one-worker handshake executor, "
                 "transfers polled once per engine step); aionixl_contenders/threaded_connector.py"),
    "memcpy": ("numpy.copyto", "copies of the same bytes inside this process, no NIXL: the "
               "memory-bandwidth limit"),
    "asyncio": ("aionixl asyncio", "aionixl.Engine with its default config, on asyncio"),
    "trio": ("aionixl trio", "aionixl.Engine with its default config, on trio"),
    "vllm": ("vLLM connector", "vLLM's real NixlConnector (pull/READ) in a decode worker process "
             "reading from a vLLM prefill worker process (aionixl_contenders/vllm_decode.py, "
             "vllm_worker.py); --with-vllm only"),
}
ORDER = ["bare", "threaded", "memcpy", "asyncio", "trio", "vllm"]


@dataclass(frozen=True, slots=True)
class Measure:
    key: str
    title: str
    unit: str  # display unit
    scale: float  # SI value * scale = display value
    spread: str  # "minmax" (over repeats) or "p10p90" (over events)
    note: str = ""
    higher_is_better: bool = False


def measures(spec: Any) -> list[Measure]:
    ms: list[Measure] = []
    for n in spec.seq:
        ms.append(Measure(f"seq_{n}", f"{n} block{'s' if n > 1 else ''}, sequential", "us", 1e6, "minmax",
                          f"time per transfer of {n} block id(s) (every region), contiguous ids, "
                          "one at a time"))
    ms.append(Measure("seq_1_push", "1 block, seq., push mode", "us", 1e6, "minmax",
                      "aionixl only: as 1 block sequential, read_mode=\"push\" (the peer writes the "
                      "block into ours and notifies; what auto picks over UCX TCP)"))
    ms.append(Measure("seq_1_raw", "1 block, seq., raw bindings", "us", 1e6, "minmax",
                      "bare NIXL's one-block loop on the bound nixlAgent (no wrapper objects): the "
                      "calls aionixl makes"))
    ms.append(Measure("seq_1_part", _part_title(spec), "us", 1e6, "minmax",
                      f"as 1 block sequential, each read moving 1/{spec.tp_ratio} of the block id "
                      f"(part r of {spec.tp_ratio} equal consecutive parts of every region's block, "
                      f"r taking turns: a decode rank's heads at TP ratio {spec.tp_ratio}) into the "
                      "same part of ours; aionixl: transfer_blocks(local_part=BlockPart(r, "
                      f"{spec.tp_ratio}), remote_part=BlockPart(r, {spec.tp_ratio})); bare NIXL: its "
                      "sequential loop on descriptor lists it prepares at part granularity (one "
                      "descriptor per region per block part, as aionixl posts)"))
    for n in spec.scattered:
        ms.append(Measure(f"scattered_{n}", f"{n} blocks, scattered ids", "us", 1e6, "minmax",
                          f"as {n} blocks sequential, with random distinct block ids on both sides"))
    for n in spec.inflight:
        ms.append(Measure(f"inflight_{n}", f"{n} in flight, 1 block each", "us", 1e6, "minmax",
                          f"{n} one-block reads started together, time until all are done / {n}; "
                          "aionixl: one task per read, already waiting for the start signal; "
                          "threaded: posted in one engine step; bare: the batched loop"))
    ms.append(Measure("inflight_64_spawn", "64 in flight, new task each", "us", 1e6, "minmax",
                      "aionixl only: as 64 in flight, but each transfer in a task created inside "
                      "the timing (the in-flight rows above use tasks that already wait)"))
    ms.append(Measure("inflight_64_notify", "64 in flight, notify each", "us", 1e6, "minmax",
                      "aionixl only: as 64 in flight, each read carrying its own notification "
                      "(coalesced reads pack them into one)"))
    ms.append(Measure("inflight_mixed", "mixed 1/16/256 blocks in flight", "us", 1e6, "minmax",
                      "aionixl only: 9 reads started together, three each of 1, 16 and 256 blocks; "
                      "time until all are done / 9"))
    last = max(spec.inflight)
    ms.append(Measure(f"growth_{last}", f"cost {last} in flight / 1 seq.", "x", 1.0, "minmax",
                      f"median per-transfer time at {last} in flight / median one-block sequential"))
    ms.append(Measure("bulk", f"{spec.bulk_bytes >> 20} MiB transfers", "GB/s", 1e-9, "minmax",
                      "throughput of one-at-a-time transfers of that many bytes", higher_is_better=True))
    ms.append(Measure("bulk_push", f"{spec.bulk_bytes >> 20} MiB, push mode", "GB/s", 1e-9, "minmax",
                      "aionixl only: as above, read_mode=\"push\"", higher_is_better=True))
    if spec.device == "cuda":
        ms.append(Measure("bulk_d2h", f"{spec.bulk_bytes >> 20} MiB device->host", "GB/s", 1e-9,
                          "minmax", "reads from the prefill side's VRAM into DRAM here", True))
        ms.append(Measure("bulk_h2d", f"{spec.bulk_bytes >> 20} MiB host->device", "GB/s", 1e-9,
                          "minmax", "writes from DRAM here into the prefill side's VRAM", True))
    ms += [
        Measure("wake", "completion-to-wake (tcp)", "us", 1e6, "p10p90",
                "from the poller seeing DONE to the awaiting task running (Engine.trace_wakeups); "
                "one-block reads over UCX tcp so that they reach the poller"),
        Measure("connect", "connect()", "ms", 1e3, "p10p90",
                "aionixl: disconnect, then connect() again; threaded: handshake on the executor until "
                "the engine loop sees it; bare: add_remote_agent+prep_xfer_dlist+make_connection with "
                "the metadata in hand; prefill side resting"),
        Measure("close", f"close, {spec.peers} peers + {spec.close_inflight} in flight", "ms", 1e3,
                "minmax", f"shutdown with {spec.peers} peers connected and {spec.close_inflight} "
                f"transfers of {spec.close_blocks} blocks in flight (UCX tcp)"),
        Measure("idle_cpu", "idle CPU, open engine", "% core", 100.0, "minmax",
                "CPU time of this whole process / wall time while one connected engine sits idle"),
        *(_vllm_measures(spec) if getattr(spec, "with_vllm", False) else []),
        Measure("lag_idle", "loop lag p99, idle loop", "ms", 1e3, "minmax",
                f"p99 lateness of a {spec.lag_tick_s * 1e3:g} ms sleep with nothing else running"),
        Measure("lag_64", f"loop lag p99, {spec.lag_workers} workers", "ms", 1e3, "minmax",
                f"{spec.lag_workers} tasks each reading one block in a loop, default transport"),
        Measure("lag_64_tcp", f"loop lag p99, {spec.lag_workers} tcp", "ms", 1e3, "minmax",
                f"{spec.lag_workers} tasks each reading one block in a loop over UCX tcp (truly in flight)"),
    ]
    return ms


def _part_name(spec: Any) -> str:
    """What the head-slice rows read of each block id: half of its heads at TP ratio 2."""
    ratio = getattr(spec, "tp_ratio", 2)
    return "half-head slices" if ratio == 2 else f"1/{ratio}-head slices"


def _part_title(spec: Any) -> str:
    return f"1 block, {_part_name(spec)}, seq."


def _vllm_measures(spec: Any) -> list[Measure]:
    """The rows a --with-vllm run adds (every contender that can measures them)."""
    out = [Measure(f"lat_1_p{q}", f"1-block read, p{q} per read", "us", 1e6, "minmax",
                   f"p{q} of {spec.lat_count} one-block reads timed one by one (vLLM: from "
                   "start_load_kv to the get_finished call that reports it), per repeat")
           for q in (50, 90, 99)]
    out += [
        Measure("close_1", f"close, 1 peer + {spec.close_inflight} in flight", "ms", 1e3, "minmax",
                f"as the close row, with one peer (vLLM: worker shutdown + its side-channel "
                f"listener's shutdown), {spec.close_inflight} reads of {spec.close_blocks} blocks "
                "in flight over UCX tcp"),
        Measure("threads_open", "OS threads added, open", "threads", 1.0, "minmax",
                "threads of the process with the engine/connector open and connected to 1 peer, "
                "minus before it was created"),
        Measure("threads_closed", "OS threads left after close", "threads", 1.0, "minmax",
                "threads of the process right after close/shutdown (no gc), minus before it was "
                "created"),
    ]
    gap = f"{spec.spaced_gap_s * 1e3:g} ms"
    for key, prefill in (("vllm", "a vLLM prefill"), ("served", "an aionixl prefill, aionixl.vllm.serve"),
                         ("isolated", "an aionixl prefill, aionixl.vllm.serve(isolate=True)")):
        out.append(Measure(f"spaced_1_p50_{key}", f"vLLM decode reads {key}, p50", "us", 1e6, "minmax",
                           f"vLLM column only: p50 of {spec.spaced_count} one-block reads {gap} apart by "
                           f"the vLLM decode from {prefill} (each held by a lease), per repeat; "
                           "the prefill on one CPU, the decode on another, as on two hosts"))
    for key, what in (("served", "its process"), ("isolated", "its process and its serving child")):
        out.append(Measure(f"idle_cpu_{key}", f"idle CPU, aionixl {key} prefill", "% core", 100.0,
                           "minmax", f"vLLM column only: CPU of the aionixl prefill serving vLLM "
                           f"decoders ({what}) / wall time, idle after the reads"))
    return out


def summarize(values: list[float]) -> dict[str, float] | None:
    vals = [float(v) for v in values if math.isfinite(v)]
    if not vals:
        return None
    a = np.asarray(vals)
    return {"median": float(np.median(a)), "min": float(a.min()), "max": float(a.max()),
            "p10": float(np.percentile(a, 10)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "n": len(vals)}


def build_measures(spec: Any, raw: dict[str, dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    last = max(spec.inflight)
    columns = [c for c in ORDER if c != "vllm" or getattr(spec, "with_vllm", False)]
    for m in measures(spec):
        results: dict[str, Any] = {}
        for c in columns:
            samples = raw.get(c, {})
            if m.key == f"growth_{last}":
                a, b = samples.get(f"inflight_{last}"), samples.get("seq_1")
                results[c] = None if not a or not b else summarize(
                    [v / float(np.median(b)) for v in a])
            else:
                vals = samples.get(m.key)
                results[c] = summarize(vals) if vals else None
        out[m.key] = {"title": m.title, "unit": m.unit, "scale": m.scale, "spread": m.spread,
                      "note": m.note, "higher_is_better": m.higher_is_better, "results": results}
    return out


@dataclass(frozen=True, slots=True)
class Target:
    key: str
    title: str
    op: str  # "<=" or ">="
    limit: float
    unit: str
    scale: float
    value: Callable[[dict[str, Any], str], float | None]
    #: For ratio targets: the key of aionixl's paired ratios (alternating repeats).
    paired: str | None = None
    #: False: a diagnostic, retired from the headline targets (issue 32: N one-block reads
    #: at once are a shape a serving fleet rarely makes; the P/D workload's targets say what
    #: a serving user gets). Its row stays in the tables and the JSON, marked so.
    headline: bool = True


def _med(ms: dict[str, Any], key: str, contender: str) -> float | None:
    m = ms.get(key)
    r = None if m is None else m["results"].get(contender)
    return None if r is None else float(r["median"])


def _ratio(ms: dict[str, Any], key: str, contender: str, base_key: str, base: str) -> float | None:
    a, b = _med(ms, key, contender), _med(ms, base_key, base)
    return None if a is None or b is None or b == 0 else a / b


def targets(spec: Any) -> list[Target]:
    last = max(spec.inflight)
    return [
        Target("seq_1_vs_bare", "1 block sequential / bare NIXL", "<=", 1.05, "x", 1.0,
               lambda ms, c: _ratio(ms, "seq_1", c, "seq_1", "bare"), "seq_1_vs_bare"),
        Target("seq_1_vs_bare_raw", "1 block seq. / bare raw bindings (stricter)", "<=", 1.10, "x", 1.0,
               lambda ms, c: _ratio(ms, "seq_1", c, "seq_1_raw", "bare"), "seq_1_vs_bare_raw"),
        Target("seq_1_part_vs_bare", f"1 block {_part_name(spec)} / bare NIXL", "<=", 1.05, "x",
               1.0, lambda ms, c: _ratio(ms, "seq_1_part", c, "seq_1_part", "bare"), "seq_1_part_vs_bare",
               headline=False),
        Target("inflight_64_vs_bare", "64 in flight / bare batched loop", "<=", 0.60, "x", 1.0,
               lambda ms, c: _ratio(ms, "inflight_64", c, "inflight_64", "bare"), "inflight_64_vs_bare",
               headline=False),
        Target(f"inflight_{last}_vs_bare", f"{last} in flight / bare batched loop", "<=", 0.60, "x", 1.0,
               lambda ms, c: _ratio(ms, f"inflight_{last}", c, f"inflight_{last}", "bare"), headline=False),
        Target("bulk_vs_memcpy", f"{spec.bulk_bytes >> 20} MiB throughput / numpy.copyto", ">=", 0.80, "x",
               1.0, lambda ms, c: _ratio(ms, "bulk", c, "bulk", "memcpy"), "bulk_vs_memcpy"),
        Target("idle_cpu", "idle CPU, open engine", "<=", 0.01, "% core", 100.0,
               lambda ms, c: _med(ms, "idle_cpu", c)),
        Target("close", f"close, {spec.peers} peers + {spec.close_inflight} in flight", "<=", 0.100, "ms",
               1e3, lambda ms, c: _med(ms, "close", c)),
        Target("wake_p50", "completion-to-wake p50", "<=", 20e-6, "us", 1e6,
               lambda ms, c: _med(ms, "wake", c)),
        Target("connect_p50", "connect() p50", "<=", 5e-3, "ms", 1e3,
               lambda ms, c: _med(ms, "connect", c)),
        Target(f"growth_{last}", f"cost at {last} in flight / at 1", "<=", 1.2, "x", 1.0,
               lambda ms, c: _med(ms, f"growth_{last}", c), headline=False),
        Target("lag_64", f"loop lag p99, {spec.lag_workers} busy callers", "<=", 5e-3, "ms", 1e3,
               lambda ms, c: _med(ms, "lag_64", c)),
    ]


def build_targets(spec: Any, ms: dict[str, Any],
                  paired: dict[str, dict[str, list[float]]] | None = None) -> list[dict[str, Any]]:
    """Each target for each aionixl backend (and the threaded model for reference).

    Ratio targets use aionixl's paired ratios (median over repeats that alternated with the
    reference in the same time window) where the run has them, else the ratio of medians.
    """
    out = []
    for t in targets(spec):
        results: dict[str, Any] = {}
        for c in ("asyncio", "trio", "threaded", *(("vllm",) if getattr(spec, "with_vllm", False) else ())):
            unpaired = t.value(ms, c)
            ratios = (paired or {}).get(c, {}).get(t.paired or "", [])
            v = float(np.median(ratios)) if ratios else unpaired
            met = None if v is None else (v <= t.limit if t.op == "<=" else v >= t.limit)
            results[c] = {"value": v, "met": met, "method": "paired" if ratios else "medians",
                          "ratio_of_medians": unpaired if t.paired else None,
                          "paired_min": min(ratios) if ratios else None,
                          "paired_max": max(ratios) if ratios else None}
        out.append({"key": t.key, "title": t.title, "op": t.op, "limit": t.limit, "unit": t.unit,
                    "scale": t.scale, "headline": t.headline, "results": results})
    return out


# ---- text -------------------------------------------------------------------------------


def _num(v: float) -> str:
    a = abs(v)
    if a >= 1000:
        return f"{v:.0f}"
    if a >= 100:
        return f"{v:.1f}"
    if a >= 10:
        return f"{v:.2f}"
    return f"{v:.3f}"


def _cell(v: float | None, ratio: float | None) -> str:
    if v is None:
        return "-"
    return _num(v) if ratio is None else f"{_num(v)} ({ratio:.2f}x)"


def tables(report: dict[str, Any]) -> str:
    ms = report["measures"]
    cols = [c for c in ORDER if c in report["contenders"]]
    labels = [CONTENDERS[c][0] for c in cols]
    w0, wu, wc = 36, 7, 18
    lines = []
    head = f"{'measure':<{w0}}{'unit':<{wu}}" + "".join(f"{lab:>{wc}}" for lab in labels)
    lines += ["Medians (ratio to bare NIXL where it has the measure; bare's in-flight rows are its "
              "batched loop)", head, "-" * len(head)]
    for key, m in ms.items():
        row = f"{m['title']:<{w0}}{m['unit']:<{wu}}"
        base = m["results"].get("bare")
        for c in cols:
            r = m["results"].get(c)
            if r is None:
                row += f"{'-':>{wc}}"
                continue
            v = r["median"] * m["scale"]
            ratio = None
            if base is not None and c != "bare" and not key.startswith("growth") and base["median"]:
                ratio = r["median"] / base["median"]
            row += f"{_cell(v, ratio):>{wc}}"
        lines.append(row)
    lines += ["", "Spread (min-max over repeats, or p10-p90 over events for connect and wake), same units",
              head, "-" * len(head)]
    for m in ms.values():
        row = f"{m['title'] + (' [p10-p90]' if m['spread'] == 'p10p90' else ''):<{w0}}{m['unit']:<{wu}}"
        for c in cols:
            r = m["results"].get(c)
            if r is None:
                row += f"{'-':>{wc}}"
                continue
            lo, hi = (r["min"], r["max"]) if m["spread"] == "minmax" else (r["p10"], r["p90"])
            row += f"{_num(lo * m['scale']) + '-' + _num(hi * m['scale']):>{wc}}"
        lines.append(row)
    refs = [("threaded", "threaded model")]
    if "vllm" in report["contenders"]:
        refs.append(("vllm", "vLLM connector"))
    lines += ["", "Targets (aionixl, same run; ratios marked * are paired: median over repeats that "
              f"alternated with the reference loop; {' and '.join(r[1] for r in refs)} shown for reference)"]
    th = (f"{'target':<44}{'limit':>12}{'aionixl asyncio':>22}{'aionixl trio':>22}"
          + "".join(f"{label:>16}" for _, label in refs))
    lines += [th, "-" * len(th)]
    headline = [t for t in report["targets"] if t.get("headline", True)]
    retired = [t for t in report["targets"] if not t.get("headline", True)]
    for t in headline + ([None] if retired else []) + retired:
        if t is None:
            lines += ["", "Diagnostics (not headline targets: block-part reads; one-block reads N wide, "
                      "retired; their limits kept for the record)", th, "-" * len(th)]
            continue
        limit = f"{t['op']} {_num(t['limit'] * t['scale'])} {t['unit']}"
        row = f"{t['title']:<44}{limit:>12}"
        for c, width in (("asyncio", 22), ("trio", 22), *((c, 16) for c, _ in refs)):
            cell = target_cell(t["results"][c], partial(_scaled, t["scale"]), f" {t['unit']}",
                               c in ("asyncio", "trio"))
            row += f"{cell:>{width}}"
        lines.append(row)
    return "\n".join(lines)


def _scaled(scale: float, value: float) -> str:
    return _num(value * scale)


def target_cell(result: dict[str, Any], number: Callable[[float], str], unit: str, judged: bool) -> str:
    """One contender's result for one target, as a table cell: the value (``*`` where it is
    a paired ratio), and for the contenders a target judges whether it was met; ``-``
    without a value."""
    value = result.get("value")
    if value is None:
        return "-"
    cell = number(value) + ("*" if result.get("method") == "paired" else "") + unit
    return cell + (("  met" if result["met"] else "  NOT met") if judged else "")


# ---- plot -------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ms = report["measures"]
    spec = report["config"]
    cols = [c for c in ORDER if c in report["contenders"]]
    colors = {"bare": "#444444", "threaded": "#d62728", "memcpy": "#7f7f7f", "asyncio": "#1f77b4",
              "trio": "#2ca02c", "vllm": "#9467bd"}
    fig, axes = plt.subplots(2, 3, figsize=(18, 9.5))

    def med(key: str, c: str) -> float | None:
        m = ms.get(key)
        r = None if m is None else m["results"].get(c)
        return None if r is None else float(r["median"])

    ax = axes[0][0]
    sizes = [int(n) for n in spec["seq"]]
    for c in cols:
        pts = [(n, med(f"seq_{n}", c)) for n in sizes]
        xs = [n for n, v in pts if v is not None]
        ys = [v * 1e6 for _, v in pts if v is not None]
        if xs:
            ax.plot(xs, ys, "o-", label=CONTENDERS[c][0], color=colors[c])
    ax.set(xscale="log", yscale="log", xlabel="blocks per transfer", ylabel="us per transfer",
           title="sequential transfers (contiguous ids)")
    ax.legend(fontsize=8)

    ax = axes[0][1]
    counts = [1, *spec["inflight"]]
    for c in cols:
        pts = [(n, med("seq_1" if n == 1 else f"inflight_{n}", c)) for n in counts]
        xs = [n for n, v in pts if v is not None]
        ys = [v * 1e6 for _, v in pts if v is not None]
        if len(xs) > 1:
            ax.plot(xs, ys, "o-", label=CONTENDERS[c][0], color=colors[c])
    ax.set(xscale="log", yscale="log", xlabel="transfers in flight (1 block each)",
           ylabel="us per transfer", title="per-transfer cost vs. in-flight count")
    ax.legend(fontsize=8)

    def bars(ax: Any, key: str, scale: float, ylabel: str, title: str, log: bool = False) -> None:
        names, vals, cs = [], [], []
        for c in cols:
            v = med(key, c)
            if v is not None:
                names.append(CONTENDERS[c][0].replace(" ", "\n", 1))
                vals.append(v * scale)
                cs.append(colors[c])
        ax.bar(names, vals, color=cs)
        ax.set(ylabel=ylabel, title=title)
        if log:
            ax.set_yscale("log")
        ax.tick_params(axis="x", labelsize=8)

    bars(axes[0][2], "bulk", 1e-9, "GB/s", f"{spec['bulk_bytes'] >> 20} MiB transfers (higher is better)")
    bars(axes[1][0], "connect", 1e3, "ms (median)", "connect latency", log=True)
    bars(axes[1][1], "close", 1e3, "ms (median)",
         f"close, {spec['peers']} peers + {spec['close_inflight']} in flight", log=True)

    ax = axes[1][2]
    labels, ratios, cs = [], [], []
    for t in report["targets"]:
        if not t.get("headline", True):
            continue  # a retired target: its row is in the tables
        for c in ("asyncio", "trio"):
            r = t["results"][c]
            if r["value"] is None:
                continue
            ratio = r["value"] / t["limit"] if t["op"] == "<=" else t["limit"] / r["value"]
            labels.append(f"{t['title']} ({c})")
            ratios.append(ratio)
            cs.append("#2ca02c" if r["met"] else "#d62728")
    ax.barh(labels, ratios, color=cs)
    ax.axvline(1.0, color="black", lw=1)
    ax.set(xscale="log", xlabel="measured / limit (< 1 meets the target)", title="targets")
    ax.tick_params(axis="y", labelsize=7)
    ax.invert_yaxis()

    fig.suptitle(report["headline"], fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
