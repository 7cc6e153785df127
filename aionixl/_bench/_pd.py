"""``aionixl bench --workload pd``: open-loop P/D requests, latency against load.

The method (benchmarks/README.md has the long form):

1. A prefill child process (``aionixl_contenders.target``, progressed on every loop turn)
   holds a KV cache of :class:`~._pdwork.PdSpec`'s geometry; this process holds one of the
   same shape (:class:`~._pdwork.PdMemory`).
2. **Saturation**: every contender runs the same closed loop (``sat_concurrency`` requests
   outstanding); bare NIXL's median request rate is the 100 % load.
3. **Loads**: for each load (a fraction of that rate, the last one an overload), every
   contender gets the same requests at the same Poisson arrival times (scaled by 1 / rate),
   ``repeats`` times, contenders interleaved in rotating order so that a drifting machine
   hits all of them alike. A request's latency runs from its *scheduled* arrival to the
   moment its caller sees it done, so a backed-up sender does not hide queueing. Bare NIXL
   runs a second time in every repeat as a control (:data:`CONTROL`): the run's noise floor.
4. CPU: this process's CPU time (all threads, ``getrusage``) over the step / GB moved.
"""

from __future__ import annotations

import gc
import math
import sys
import traceback
from collections.abc import Callable
from dataclasses import asdict, replace
from typing import Any

import numpy as np

from ._context import Context, Progress
from ._pdwork import BlockPool, PdMemory, PdSpec, StepRecorder, StepResult, make_requests
from ._report import target_cell
from ._spec import Spec
from ._target import Target

#: P/D contender names (the JSON's), in table order, and their labels.
PD_ORDER = ["bare", "aionixl-asyncio", "aionixl-trio", "aionixl-uvloop", "threaded", "vllm"]
#: Bare NIXL's loop a second time in every repeat (one more slot in the rotating order, after
#: the last contender: most repeats run it just before bare NIXL), not a contender: its
#: ratios to bare NIXL are what the same code reads against itself in this run, the noise
#: floor under every other ratio. Kept out of the ``"pd"`` rows (``PdSpec.control``).
CONTROL = "bare-control"
PD_LABELS = {"bare": "bare NIXL", "aionixl-asyncio": "aionixl asyncio", "aionixl-trio": "aionixl trio",
             "aionixl-uvloop": "aionixl uvloop", "threaded": "threaded model", "vllm": "vLLM connector",
             CONTROL: "bare NIXL, again"}
#: The bench's contender names (``--contenders``) -> P/D names.
PD_NAMES = {"bare": "bare", "asyncio": "aionixl-asyncio", "trio": "aionixl-trio",
            "uvloop": "aionixl-uvloop", "threaded": "threaded", "vllm": "vllm"}
AIONIXL = ("aionixl-asyncio", "aionixl-trio", "aionixl-uvloop")
P99_LIMIT, SAT_LIMIT, CPU_LIMIT = 1.05, 0.97, 1.10


class _Aionixl:
    def __init__(self, ctx: Context, name: str) -> None:
        self.ctx, self.name = ctx, name
        self.checked = 0

    def step(self, rec: StepRecorder, reqs: list[Any], concurrency: int | None = None) -> None:
        from . import _pd_aionixl

        self.checked += _pd_aionixl.step(self.ctx, self.name, rec, reqs, concurrency)

    def verify(self) -> int:
        return 0  # every step checked the verify set before and after (counted in .checked)

    def close(self) -> None:
        pass


def _open(name: str, ctx: Context, spec: Spec) -> Any:
    if name in ("bare", CONTROL):
        from aionixl_contenders.bare_nixl import BarePd

        return BarePd(ctx)
    if name == "threaded":
        from aionixl_contenders.threaded import ThreadedPd

        return ThreadedPd(ctx, spec.step_s)
    if name == "vllm":
        from aionixl_contenders import vllm_contender

        return vllm_contender.VllmPd(ctx, spec.step_s)
    return _Aionixl(ctx, name)


def run(spec: Spec, pd: PdSpec, names: list[str], progress: Progress,
        errors: dict[str, str]) -> dict[str, Any]:
    """Run the workload for ``names`` (P/D names); failures go to ``errors``."""
    if "vllm" in names and not _has_vllm_pd():
        names = [n for n in names if n != "vllm"]
        progress("P/D: the vLLM connector does not run the P/D workload in this build: left out")
    sub = replace(spec, layers=pd.layers, blocks=pd.blocks, block_bytes=pd.block_bytes, peers=1)
    progress(f"P/D: starting the prefill process ({pd.regions} regions x {pd.blocks} blocks x "
             f"{pd.block_bytes // 1024} KiB = {pd.regions * pd.blocks * pd.block_bytes >> 20} MiB)")
    target = Target(sub.layers, sub.blocks, sub.block_bytes, "cpu", 1)
    samples: dict[tuple[str, float], list[StepResult]] = {}
    sat: dict[str, list[StepResult]] = {}
    checked: dict[str, int] = {}
    opened: dict[str, Any] = {}
    rate = rate_bps = 0.0
    if pd.control and "bare" in names:
        names = [*names, CONTROL]
    try:
        memory = PdMemory(pd.regions, pd.blocks, pd.block_bytes)
        target.wait_ready()
        ctx = Context(sub, memory, target, progress)
        ctx.spin()
        for name in names:
            try:
                progress(f"P/D: opening {PD_LABELS[name]}")
                opened[name] = _open(name, ctx, spec)
                checked[name] = opened[name].verify()
            except Exception as exc:
                _failed(name, exc, errors, progress)
        order = [n for n in names if n in opened]

        def one_round(label: str, reqs: list[Any], rate: float | None, r: int,
                      store: Callable[[str, StepResult], None]) -> None:
            live = [n for n in order if n not in errors]
            k = r % max(1, len(live))
            for name in live[k:] + live[:k]:
                progress(f"P/D: {label}, {PD_LABELS[name]} (repeat {r + 1}/{pd.repeats})")
                rec = StepRecorder(memory, BlockPool(pd.blocks, pd.seed), pd, rate)
                try:
                    opened[name].step(rec, reqs, None if rate else pd.sat_concurrency)
                    store(name, rec.finish())
                except Exception as exc:
                    _failed(name, exc, errors, progress)
                gc.collect()

        sat_reqs = make_requests(pd, pd.sat_requests, salt=1)
        for r in range(pd.repeats):
            one_round(f"saturation (closed loop, {pd.sat_concurrency} outstanding)", sat_reqs, None, r,
                      lambda n, s: sat.setdefault(n, []).append(s))
        rate_bps = _sat_bps(sat.get("bare") or next(iter(sat.values()), []))
        if not rate_bps:
            raise RuntimeError("no contender finished the saturation runs")
        load_reqs = [make_requests(pd, pd.requests, salt=10 + r) for r in range(pd.repeats)]
        # A load is a fraction of bare NIXL's saturation *bandwidth*: each repeat's requests
        # arrive at that many bytes per second (its own mean request size sets the rate).
        mean_bytes = [float(np.mean([q.nblocks for q in reqs])) * pd.bytes_per_block_id for reqs in load_reqs]
        rate = rate_bps / float(np.mean(mean_bytes))
        for load in pd.loads:
            def store(n: str, s: StepResult, ld: float = load) -> None:
                samples.setdefault((n, ld), []).append(s)

            for r in range(pd.repeats):
                one_round(f"load {load:.0%} ({load * rate_bps / mean_bytes[r]:.0f} req/s)", load_reqs[r],
                          load * rate_bps / mean_bytes[r], r, store)
        for name in order:
            if name not in errors:
                try:
                    checked[name] += opened[name].verify()
                except Exception as exc:
                    _failed(name, exc, errors, progress)
    finally:
        for name, c in opened.items():
            try:
                c.close()
            except Exception as exc:
                _failed(name, exc, errors, progress)
        target.stop()
    for name, c in opened.items():
        checked[name] = checked.get(name, 0) + int(getattr(c, "checked", 0))
    return _summary(pd, spec, names, samples, sat, rate, rate_bps, checked, errors)


def _has_vllm_pd() -> bool:
    try:
        from aionixl_contenders import vllm_contender
    except ImportError:
        return False
    return hasattr(vllm_contender, "VllmPd")


def _failed(name: str, exc: BaseException, errors: dict[str, str], progress: Progress) -> None:
    errors.setdefault(name, f"{type(exc).__name__}: {exc}")
    progress.done()
    print(f"aionixl bench: the P/D {PD_LABELS[name]} contender failed:", file=sys.stderr)
    traceback.print_exception(exc)


def _sat_bps(results: list[StepResult]) -> float:
    rates = [r.nbytes / r.wall_s for r in results if r.wall_s > 0]
    return float(np.median(rates)) if rates else 0.0


def _pct(lat: list[float], q: float) -> float:
    return float(np.percentile(lat, q)) * 1e6 if lat else float("nan")


def _split(steps: list[StepResult]) -> tuple[float | None, float | None]:
    """Median microseconds from scheduled arrival to the transfer call, and from the call to
    completion seen, over every request (None where a step does not say when it called):
    which part of a latency is the harness's (pacing, block pool, task) and which the engine's."""
    if not all(s.to_call and len(s.to_call) == len(s.latencies) for s in steps):
        return None, None
    before = np.concatenate([s.to_call for s in steps])
    after = np.concatenate([s.latencies for s in steps]) - before
    return float(np.median(before)) * 1e6, float(np.median(after)) * 1e6


def _summary(pd: PdSpec, spec: Spec, names: list[str], samples: dict[tuple[str, float], list[StepResult]],
             sat: dict[str, list[StepResult]], rate: float, rate_bps: float, checked: dict[str, int],
             errors: dict[str, str]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    detail: list[dict[str, Any]] = []
    for load in pd.loads:
        for name in [*PD_ORDER, CONTROL]:
            steps = samples.get((name, load))
            if name not in names or not steps:
                continue
            lat = [x for s in steps for x in s.latencies]
            nbytes = sum(s.nbytes for s in steps)
            rows.append({"contender": name, "load": load, "p50_us": _pct(lat, 50), "p99_us": _pct(lat, 99),
                         "p999_us": _pct(lat, 99.9),
                         "gbps": float(np.median([s.nbytes / s.wall_s / 1e9 for s in steps])),
                         "cpu_s_per_gb": sum(s.cpu_s for s in steps) / (nbytes / 1e9),
                         "requests": sum(s.requests for s in steps),
                         "verified": sum(s.verified for s in steps)})
            split = _split(steps)
            detail.append({"contender": name, "load": load,
                           "to_call_p50_us": split[0], "after_call_p50_us": split[1],
                           "p50_us_per_repeat": [_pct(s.latencies, 50) for s in steps],
                           "p99_us_per_repeat": [_pct(s.latencies, 99) for s in steps],
                           "gbps_per_repeat": [s.nbytes / s.wall_s / 1e9 for s in steps],
                           "cpu_s_per_gb_per_repeat": [s.cpu_s / (s.nbytes / 1e9) for s in steps],
                           "waited_for_blocks": sum(s.waited_for_blocks for s in steps)})
    sat_gbps = {n: float(np.median([s.nbytes / s.wall_s / 1e9 for s in sat[n]]))
                for n in [*PD_ORDER, CONTROL] if sat.get(n)}
    sat_detail = {n: {"gbps_per_repeat": [s.nbytes / s.wall_s / 1e9 for s in sat[n]],
                      "requests_per_s_per_repeat": [s.requests / s.wall_s for s in sat[n]],
                      "cpu_s_per_gb_per_repeat": [s.cpu_s / (s.nbytes / 1e9) for s in sat[n]]}
                  for n in [*PD_ORDER, CONTROL] if sat.get(n)}
    mean_tokens = float(np.mean([r.tokens for k in range(pd.repeats)
                                 for r in make_requests(pd, pd.requests, salt=10 + k)]))
    config = asdict(pd)
    config.update(regions=pd.regions, bytes_per_block_id=pd.bytes_per_block_id,
                  saturation_requests_per_s=rate, saturation_gbps_bare=rate_bps / 1e9,
                  mean_prompt_tokens=mean_tokens,
                  step_ms=spec.step_s * 1e3,
                  distribution=f"prompt tokens log-uniform on [{pd.min_tokens}, {pd.max_tokens}] "
                  f"(seeded), {pd.block_tokens} tokens per block; remote block ids random, distinct "
                  "within a request; local ids from a FIFO free list")
    details = {"loads": detail, "saturation": sat_detail}
    targets = pd_targets(rows, sat_gbps, details, pd)
    contenders = [r for r in rows if r["contender"] != CONTROL]  # the control is not one
    sat_gbps.pop(CONTROL, None)
    return {"pd": contenders, "pd_saturation_gbps": sat_gbps, "pd_targets": targets,
            "pd_config": config, "pd_detail": details,
            "pd_verified_blocks": checked,
            "pd_contenders": {n: {"label": PD_LABELS[n], "ok": n not in errors and n in sat_gbps,
                                  "error": errors.get(n)} for n in PD_ORDER if n in names}}


def _row(rows: list[dict[str, Any]], name: str, load: float) -> dict[str, Any] | None:
    return next((r for r in rows if r["contender"] == name and r["load"] == load), None)


def _paired(detail: list[dict[str, Any]], key: str, name: str, load: float) -> list[float]:
    """Per-repeat ratios of ``name``'s ``key`` over bare NIXL's at ``load``: the repeats ran
    side by side (interleaved), so each ratio compares the same window of the machine."""
    mine = next((d for d in detail if d["contender"] == name and d["load"] == load), None)
    base = next((d for d in detail if d["contender"] == "bare" and d["load"] == load), None)
    if mine is None or base is None:
        return []
    return [a / b for a, b in zip(mine[key], base[key], strict=False) if b > 0 and math.isfinite(a)]


def _result(ratios: list[float], op: str, limit: float, pooled: float | None) -> dict[str, Any]:
    v = float(np.median(ratios)) if ratios else pooled
    met = None if v is None else (v <= limit if op == "<=" else v >= limit)
    return {"value": v, "met": met, "method": "paired" if ratios else "pooled", "pooled": pooled,
            "paired_min": min(ratios) if ratios else None, "paired_max": max(ratios) if ratios else None}


def pd_targets(rows: list[dict[str, Any]], sat: dict[str, float], detail: dict[str, Any],
               pd: PdSpec) -> list[dict[str, Any]]:
    """The P/D targets for each aionixl backend (threaded, vLLM and the control for
    reference). Values are paired: the median over repeats of (contender / bare NIXL in the
    same repeat)."""
    out: list[dict[str, Any]] = []
    others = [n for n in [*PD_ORDER, CONTROL] if n != "bare"]
    loads = detail["loads"]
    low = [ld for ld in pd.loads if ld <= 0.9]
    for load in low:
        res: dict[str, Any] = {}
        base = _row(rows, "bare", load)
        for n in others:
            mine = _row(rows, n, load)
            pooled = None if mine is None or base is None else mine["p99_us"] / base["p99_us"]
            res[n] = _result(_paired(loads, "p99_us_per_repeat", n, load) if pooled else [], "<=",
                             P99_LIMIT, pooled)
        out.append({"key": f"p99_{load:g}", "title": f"p99 at {load:.0%} load / bare NIXL", "op": "<=",
                    "limit": P99_LIMIT, "results": res})
    res = {}
    satd = detail["saturation"]
    for n in others:
        pooled = sat[n] / sat["bare"] if n in sat and sat.get("bare") else None
        ratios = ([a / b for a, b in zip(satd[n]["gbps_per_repeat"], satd["bare"]["gbps_per_repeat"],
                                         strict=False)] if pooled else [])
        res[n] = _result(ratios, ">=", SAT_LIMIT, pooled)
    out.append({"key": "saturation", "title": "saturation GB/s / bare NIXL", "op": ">=", "limit": SAT_LIMIT,
                "results": res})
    res = {}
    for n in others:
        mine_rows = [_row(rows, n, ld) for ld in low]
        base_rows = [_row(rows, "bare", ld) for ld in low]
        pooled = None
        if all(r is not None for r in mine_rows + base_rows):
            pooled = float(np.median([m["cpu_s_per_gb"] / b["cpu_s_per_gb"]  # type: ignore[index]
                                      for m, b in zip(mine_rows, base_rows, strict=True)]))
        ratios = [x for ld in low for x in _paired(loads, "cpu_s_per_gb_per_repeat", n, ld)] if pooled else []
        res[n] = _result(ratios, "<=", CPU_LIMIT, pooled)
    out.append({"key": "cpu_per_gb", "title": "CPU s/GB / bare NIXL (loads <= 90%)", "op": "<=",
                "limit": CPU_LIMIT, "results": res})
    return out


def table(report: dict[str, Any]) -> str:
    rows, cfg = report["pd"], report["pd_config"]
    lines = [f"P/D requests, open loop: Poisson arrivals at a fraction of bare NIXL's saturation "
             f"({cfg['saturation_gbps_bare']:.2f} GB/s, {cfg['saturation_requests_per_s']:.0f} req/s), "
             f"{cfg['requests']} requests x "
             f"{cfg['repeats']} repeats per load and contender (interleaved); latency from scheduled "
             "arrival to completion seen by the caller",
             f"  {cfg['distribution']}; mean {cfg['mean_prompt_tokens']:.0f} tokens; "
             f"{cfg['regions']} regions x {cfg['block_bytes'] // 1024} KiB per block "
             f"({cfg['bytes_per_block_id'] // 1024} KiB per block id)",
             "  p50 split at the transfer call: from scheduled arrival to the call (pacing, block pool, "
             "the request's task), and from the call to completion seen (the transfer engine)"]
    head = (f"{'contender':<18}{'load':>6}{'p50 us':>10}{'p99 us':>10}{'p99.9 us':>10}{'GB/s':>8}"
            f"{'CPU s/GB':>10}{'p99/bare':>10}{'requests':>10}{'verified':>10}{'p50 split us':>16}")
    lines += [head, "-" * len(head)]
    detail = report.get("pd_detail", {}).get("loads", [])
    for r in rows:
        base = _row(rows, "bare", r["load"])
        ratio = f"{r['p99_us'] / base['p99_us']:.2f}x" if base and r["contender"] != "bare" else "-"
        d = _row(detail, r["contender"], r["load"]) or {}
        split = (f"{d['to_call_p50_us']:.0f} + {d['after_call_p50_us']:.0f}"
                 if d.get("to_call_p50_us") is not None else "-")
        lines.append(f"{PD_LABELS[r['contender']]:<18}{r['load']:>6.2f}{r['p50_us']:>10.0f}{r['p99_us']:>10.0f}"
                     f"{r['p999_us']:>10.0f}{r['gbps']:>8.2f}{r['cpu_s_per_gb']:>10.3f}{ratio:>10}"
                     f"{r['requests']:>10}{r['verified']:>10}{split:>16}")
    sat = report["pd_saturation_gbps"]
    lines += ["", "saturation (closed loop), GB/s: " + ", ".join(
        f"{PD_LABELS[n]} {v:.2f}" + (f" ({v / sat['bare']:.2f}x)" if n != "bare" and sat.get("bare") else "")
        for n, v in sat.items())]
    names = [n for n in PD_ORDER if n != "bare" and n in report["pd_contenders"]]
    if any(t["results"].get(CONTROL, {}).get("value") is not None for t in report["pd_targets"]):
        names.append(CONTROL)
    th = f"{'P/D target':<46}{'limit':>9}" + "".join(f"{PD_LABELS[n]:>20}" for n in names)
    lines += ["", "P/D targets (aionixl; threaded model and vLLM connector shown for reference; * paired: "
              "median over repeats of the ratio to bare NIXL in the same repeat)"]
    if CONTROL in names:
        lines.append(f"  {PD_LABELS[CONTROL]}: bare NIXL's loop run a second time in each repeat, the "
                     "noise floor: what the same code reads against itself in this run (its repeats' "
                     "lowest-highest ratio in brackets)")
    lines += [th, "-" * len(th)]
    for t in report["pd_targets"]:
        row = f"{t['title']:<46}{t['op'] + ' ' + format(t['limit'], '.2f'):>9}"
        for n in names:
            res = t["results"].get(n) or {}
            cell = target_cell(res, lambda v: f"{v:.3f}", "x", n in AIONIXL)
            if n == CONTROL and res.get("paired_min") is not None:
                cell = f"{res['value']:.2f}* ({res['paired_min']:.2f}-{res['paired_max']:.2f})"
            row += f"{cell:>20}"
        lines.append(row)
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["pd"]
    colors = {"bare": "#444444", "aionixl-asyncio": "#1f77b4", "aionixl-trio": "#2ca02c",
              "aionixl-uvloop": "#17becf", "threaded": "#d62728", "vllm": "#9467bd"}
    fig, axes = plt.subplots(1, 3, figsize=(18, 5.5))
    for name in PD_ORDER:
        rs = [r for r in rows if r["contender"] == name]
        if not rs:
            continue
        xs = [r["load"] for r in rs]
        axes[0].plot(xs, [r["p99_us"] / 1e3 for r in rs], "o-", color=colors[name], label=PD_LABELS[name])
        axes[0].plot(xs, [r["p50_us"] / 1e3 for r in rs], "s:", color=colors[name], alpha=0.6)
        axes[1].plot(xs, [r["gbps"] for r in rs], "o-", color=colors[name], label=PD_LABELS[name])
        axes[2].plot(xs, [r["cpu_s_per_gb"] for r in rs], "o-", color=colors[name], label=PD_LABELS[name])
    axes[0].set(yscale="log", xlabel="load (fraction of bare NIXL's saturation)",
                ylabel="request transfer latency, ms", title="latency vs. load (solid p99, dotted p50)")
    axes[1].set(xlabel="load", ylabel="GB/s achieved", title="throughput")
    axes[2].set(xlabel="load", ylabel="CPU s per GB (decode process)", title="CPU cost")
    for ax in axes:
        ax.axvline(1.0, color="black", lw=0.5)
        ax.legend(fontsize=8)
    fig.suptitle(report.get("headline", "aionixl bench --workload pd"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
