"""``aionixl bench --workload vllm-pairs``: real vLLM P/D pairs, vLLM's NixlConnector against
aionixl's AionixlConnector, on the same requests under the same open-loop load.

Each pair is two ``AsyncLLM`` instances (the engine behind vLLM's API server) in child
processes (:mod:`aionixl_contenders.vllm_pair`): a prefill (``kv_producer``, OpenMP on CPU 0)
and a decode (``kv_consumer``, CPU 1), with a tiny Llama of seeded random weights. A request
goes as vLLM's disaggregation proxies send it: to the prefill with ``do_remote_decode`` (one
token), then to the decode with the ``kv_transfer_params`` the prefill answered. Requests
arrive at seeded Poisson times, whatever is still running (open loop); both connectors get
the same arrival times and prompts. The decode is given prompt B with the KV of prompt A (same
length and last token, different elsewhere): its first token equals the prefill's only if it
attended over A's KV, which is the check every request must pass (``verified``).

One pair runs at a time (an idle NixlConnector worker spins a core: two pairs side by side
would measure each other); rounds alternate which connector goes first, and each load's
ratio aionixl / NixlConnector is taken per round, the median reported.
"""

from __future__ import annotations

import contextlib
import random
import select
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from aionixl._bench._child import cpu_seconds
from aionixl._bench._context import Progress

#: Bench name -> (vLLM's kv_connector, module path), in the order a round's first pair takes.
CONNECTORS: dict[str, tuple[str, str | None]] = {
    "nixl": ("NixlConnector", None),
    "aionixl": ("AionixlConnector", "aionixl.vllm_connector"),
}
LABELS = {"nixl": "vLLM NixlConnector", "aionixl": "AionixlConnector"}
VOCAB = 512  # the tiny Llama's


@dataclass(frozen=True)
class PairsSpec:
    loads_rps: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)  # Poisson arrival rates, requests/s
    requests: int = 24  # per load, round and connector
    rounds: int = 3
    prompt_tokens: int = 256  # 8 blocks of 32 tokens
    max_tokens: int = 16  # the decode's (the prefill makes 1)
    warmup: int = 4  # requests one at a time before measuring, not counted
    idle_s: float = 5.0  # the idle CPU window, from 2 s after the last request
    seed: int = 0
    quick: bool = False

    def problems(self) -> list[str]:
        out = []
        if not self.loads_rps or min(self.loads_rps) <= 0:
            out.append("vllm-pairs: every load must be a positive rate")
        if self.requests < 1 or self.rounds < 1:
            out.append("vllm-pairs: requests and rounds must be at least 1")
        if not 2 <= self.prompt_tokens <= 1000 or self.max_tokens < 1:
            out.append("vllm-pairs: prompts of 2-1000 tokens, at least 1 token decoded")
        return out


def quick_pairs() -> PairsSpec:
    return PairsSpec(loads_rps=(1.0, 4.0), requests=8, rounds=1, warmup=2, idle_s=2.0, quick=True)


@dataclass
class Request:
    """One request's prompts (A for the prefill, B for the decode) and what became of it."""

    request_id: str
    arrival: float  # seconds after the load's start
    a: list[int]
    b: list[int]
    arrived_at: float = 0.0  # time.monotonic, as every timestamp below
    prefilled_at: float | None = None
    prefill_token: int | None = None
    first_token_at: float | None = None
    done_at: float | None = None
    tokens: list[int] | None = None
    error: str | None = None


def make_requests(spec: PairsSpec, load: int, rate: float, tag: str) -> list[Request]:
    """The load's requests, the same for every connector: seeded by (seed, load) alone."""
    rng = random.Random(f"{spec.seed}-{load}")
    at, out = 0.0, []
    for i in range(spec.requests):
        at += rng.expovariate(rate)
        a = [rng.randrange(VOCAB) for _ in range(spec.prompt_tokens)]
        b = [rng.randrange(VOCAB) for _ in range(spec.prompt_tokens - 1)] + [a[-1]]
        out.append(Request(f"{tag}-{load}-{i}", at, a, b))
    return out


def drive(prefill: Any, decode: Any, requests: list[Request], max_tokens: int, timeout: float) -> float:
    """Send ``requests`` at their arrival times (from now) through the pair, each to the decode
    as soon as its prefill answers; returns when every one ended. The load's start, on
    ``time.monotonic``."""
    start = time.monotonic() + 0.05
    by_id = {r.request_id: r for r in requests}
    waiting = sorted(requests, key=lambda r: r.arrival)
    ended = 0
    deadline = start + (requests[-1].arrival if requests else 0) + timeout
    while ended < len(requests):
        now = time.monotonic()
        if now > deadline:
            raise TimeoutError(f"{len(requests) - ended} of {len(requests)} requests still running "
                               f"{timeout:g} s after the last arrival")
        while waiting and start + waiting[0].arrival <= now:
            r = waiting.pop(0)
            r.arrived_at = start + r.arrival
            prefill.submit(r.request_id, r.a, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
        wait = (start + waiting[0].arrival - now) if waiting else 1.0
        readable, _, _ = select.select([prefill, decode], [], [], max(0.0, min(wait, 1.0)))
        for instance in readable:
            for msg in instance.messages():
                r = by_id[msg.get("done", msg.get("failed"))]
                if "failed" in msg:
                    r.error = f"{'prefill' if instance is prefill else 'decode'}: {msg['error']}"
                    ended += 1
                elif instance is prefill:
                    r.prefilled_at, r.prefill_token = msg["done_at"], msg["token_ids"][0]
                    decode.submit(r.request_id, r.b, max_tokens=max_tokens,
                                  kv_transfer_params=msg["kv_transfer_params"])
                else:
                    r.first_token_at, r.done_at = msg["first_token_at"], msg["done_at"]
                    r.tokens = msg["token_ids"]
                    if msg.get("finish_reason") == "error":
                        r.error = "decode: finish_reason error (the KV load failed)"
                    ended += 1
    return start


def _ms(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) * 1e3 if values else float("nan")


def load_row(connector: str, round_: int, rate: float, requests: list[Request], start: float,
             max_tokens: int) -> dict[str, Any]:
    """One connector's results at one load in one round."""
    ok = [r for r in requests if r.error is None and r.done_at is not None and r.first_token_at is not None]
    ttft = [r.first_token_at - r.arrived_at for r in ok if r.first_token_at is not None]
    e2e = [r.done_at - r.arrived_at for r in ok if r.done_at is not None]
    read = [r.first_token_at - r.prefilled_at for r in ok
            if r.first_token_at is not None and r.prefilled_at is not None]
    verified = sum(1 for r in ok
                   if r.tokens and len(r.tokens) == max_tokens and r.tokens[0] == r.prefill_token)
    span = max((r.done_at for r in ok if r.done_at is not None), default=start) - start
    return {
        "connector": connector, "round": round_, "load_rps": rate, "requests": len(requests),
        "completed": len(ok), "failed": len(requests) - len(ok), "verified": verified,
        "ttft_p50_ms": _ms(ttft, 50), "ttft_p99_ms": _ms(ttft, 99),
        "e2e_p50_ms": _ms(e2e, 50), "e2e_p99_ms": _ms(e2e, 99),
        "prefilled_to_first_token_p50_ms": _ms(read, 50),
        "throughput_rps": len(ok) / span if span > 0 else float("nan"),
        "output_tokens_per_s": len(ok) * max_tokens / span if span > 0 else float("nan"),
        "errors": sorted({r.error for r in requests if r.error})[:3],
    }


def processes(instances: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each instance's vLLM processes, keyed ``role/process`` (front end, EngineCore, Worker):
    pid, thread count and the main thread's CPUs."""
    out = {}
    for role, instance in instances.items():
        for p in instance.info():
            name = "front end" if p["pid"] == instance.pid else p["name"].removeprefix("VLLM::")
            if name != "python":  # multiprocessing's resource tracker
                out[f"{role}/{name}"] = p
    return out


def idle_cpu(pids: dict[str, int], window_s: float) -> dict[str, float]:
    """Each process's CPU over ``window_s`` with no request anywhere, in cores; from 2 s after
    the last request (a vLLM worker busy-polls its input queue for 1 s after each read)."""
    time.sleep(2.0)
    before = {key: cpu_seconds(pid) for key, pid in pids.items()}
    started = time.monotonic()
    time.sleep(window_s)
    wall = time.monotonic() - started
    return {key: round((cpu_seconds(pid) - before[key]) / wall, 4) for key, pid in pids.items()}


def run_pair(spec: PairsSpec, connector: str, round_: int, model: Path, log_dir: Path,
             progress: Progress) -> dict[str, Any]:
    """Start one connector's pair, run every load through it, measure it idle, stop it."""
    from aionixl_contenders.vllm_pair import ConnectorSpec, VllmInstance

    kv_connector, module_path = CONNECTORS[connector]
    started = time.monotonic()
    instances: dict[str, Any] = {}
    try:
        for role in ("prefill", "decode"):
            log_path = log_dir / f"{connector}-{round_}-{role}.log"
            instances[role] = VllmInstance(model, role, ConnectorSpec(kv_connector, module_path),
                                           open_loop=True, log_path=log_path)
        progress(f"round {round_ + 1}: starting the {LABELS[connector]} pair")
        for instance in instances.values():
            instance.wait_ready(600)
        start_s = time.monotonic() - started
        prefill, decode = instances["prefill"], instances["decode"]
        warm = make_requests(replace(spec, requests=spec.warmup), -1, 1.0, f"{connector}{round_}w")
        for r in warm:  # one at a time: the first requests pay vLLM's and the connector's warm-up
            r.arrival = 0.0
            drive(prefill, decode, [r], spec.max_tokens, 120)
        rows = []
        for i, rate in enumerate(spec.loads_rps):
            progress(f"round {round_ + 1}: {LABELS[connector]}, {spec.requests} requests at {rate:g}/s")
            requests = make_requests(spec, i, rate, f"{connector}{round_}")
            start = drive(prefill, decode, requests, spec.max_tokens, 120)
            rows.append(load_row(connector, round_, rate, requests, start, spec.max_tokens))
            rows[-1]["tokens"] = [r.tokens for r in requests]
        progress(f"round {round_ + 1}: {LABELS[connector]} idle")
        found = processes(instances)
        counts = {key: p["threads"] for key, p in found.items()}
        compute_cpus = {role: found[f"{role}/Worker"]["cpus"] for role in instances}
        idle = idle_cpu({key: p["pid"] for key, p in found.items()}, spec.idle_s)
        stops = {role: instance.stop() for role, instance in instances.items()}
        return {"connector": connector, "round": round_, "start_s": start_s, "rows": rows,
                "threads": counts, "worker_main_thread_cpus": compute_cpus, "idle_cpu_cores": idle,
                "shutdown_s": {role: s.shutdown_s for role, s in stops.items()},
                "stop_s": {role: s.stop_s for role, s in stops.items()},
                "clean_stop": all(s.exit_code == 0 and not s.killed and not s.leftover_pids
                                  and s.engine_exit_codes == [0] for s in stops.values())}
    finally:
        for instance in instances.values():
            with contextlib.suppress(Exception):
                instance.stop(30)


def run(spec: PairsSpec, progress: Progress) -> dict[str, Any]:
    """Every round's two pairs; the ``vllm_pairs`` section of the bench's JSON."""
    from aionixl_contenders.vllm_pair import write_tiny_llama

    pairs = []
    with tempfile.TemporaryDirectory(prefix="aionixl-vllm-pairs-") as tmp:
        model = write_tiny_llama(Path(tmp) / "model")
        log_dir = Path(tmp)
        for round_ in range(spec.rounds):
            order = list(CONNECTORS) if round_ % 2 == 0 else list(CONNECTORS)[::-1]
            for connector in order:
                pairs.append(run_pair(spec, connector, round_, model, log_dir, progress))
    return summarize(spec, pairs)


def summarize(spec: PairsSpec, pairs: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [row for pair in pairs for row in pair["rows"]]
    # The same requests through both connectors: vLLM computes the same tokens either way.
    tokens: dict[tuple[int, float], dict[str, Any]] = {}
    for row in rows:
        tokens.setdefault((row["round"], row["load_rps"]), {})[row["connector"]] = row.pop("tokens")
    same = sum(sum(1 for x, y in zip(t["nixl"], t["aionixl"], strict=True) if x is not None and x == y)
               for t in tokens.values() if len(t) == 2)
    ratios: dict[str, dict[str, list[float]]] = {}
    keys = ("ttft_p50_ms", "ttft_p99_ms", "e2e_p50_ms", "e2e_p99_ms", "throughput_rps")
    for (round_, rate) in tokens:
        mine = {r["connector"]: r for r in rows if r["round"] == round_ and r["load_rps"] == rate}
        if len(mine) == 2:
            for key in keys:
                ratio = mine["aionixl"][key] / mine["nixl"][key]
                ratios.setdefault(f"{rate:g}", {}).setdefault(key, []).append(ratio)
    per_connector = {}
    for connector in CONNECTORS:
        theirs = [p for p in pairs if p["connector"] == connector]
        per_connector[connector] = {
            "label": LABELS[connector],
            "start_s": statistics.median(p["start_s"] for p in theirs),
            "threads": theirs[-1]["threads"],
            "worker_main_thread_cpus": theirs[-1]["worker_main_thread_cpus"],
            "idle_cpu_cores": {k: statistics.median(p["idle_cpu_cores"][k] for p in theirs)
                               for k in theirs[-1]["idle_cpu_cores"]},
            "shutdown_s": {role: statistics.median(p["shutdown_s"][role] for p in theirs)
                           for role in ("prefill", "decode")},
            "stop_s": {role: statistics.median(p["stop_s"][role] for p in theirs)
                       for role in ("prefill", "decode")},
            "clean_stops": sum(p["clean_stop"] for p in theirs), "pairs": len(theirs),
        }
    return {
        "config": asdict(spec), "rows": rows, "connectors": per_connector,
        "ratios": {load: {key: {"median": statistics.median(v), "min": min(v), "max": max(v), "n": len(v)}
                          for key, v in by_key.items()} for load, by_key in ratios.items()},
        "same_tokens_both_connectors": same,
        "pairs": [{k: v for k, v in p.items() if k != "rows"} for p in pairs],
    }


def _median_row(rows: list[dict[str, Any]], connector: str, rate: float) -> dict[str, float]:
    mine = [r for r in rows if r["connector"] == connector and r["load_rps"] == rate]
    return {k: statistics.median(r[k] for r in mine) for k in mine[0] if isinstance(mine[0][k], float)}


def table(section: dict[str, Any]) -> str:
    """The workload's tables: latency and throughput per load, then each pair at rest."""
    rows, cfg, per = section["rows"], section["config"], section["connectors"]
    lines = [f"Real vLLM P/D pairs, open loop: {cfg['requests']} requests per load, "
             f"{cfg['prompt_tokens']}-token prompts, {cfg['max_tokens']} tokens decoded; medians over "
             f"{cfg['rounds']} round(s); ratio = aionixl / NixlConnector, median of per-round ratios",
             "",
             "| load | connector | TTFT p50 / p99 ms | e2e p50 / p99 ms | throughput req/s | verified |",
             "|---|---|---|---|---|---|"]
    for rate in cfg["loads_rps"]:
        for connector in CONNECTORS:
            mine = [r for r in rows if r["connector"] == connector and r["load_rps"] == rate]
            m = _median_row(rows, connector, rate)
            ok, total = sum(r["verified"] for r in mine), sum(r["requests"] for r in mine)
            lines.append(f"| {rate:g}/s | {LABELS[connector]} | {m['ttft_p50_ms']:.0f} / "
                         f"{m['ttft_p99_ms']:.0f} | {m['e2e_p50_ms']:.0f} / {m['e2e_p99_ms']:.0f} | "
                         f"{m['throughput_rps']:.2f} | {ok}/{total} |")
        if ratio := section["ratios"].get(f"{rate:g}"):
            r = {key: ratio[key]["median"] for key in ratio}
            lines.append(f"| {rate:g}/s | ratio | {r['ttft_p50_ms']:.2f} / {r['ttft_p99_ms']:.2f} | "
                         f"{r['e2e_p50_ms']:.2f} / {r['e2e_p99_ms']:.2f} | {r['throughput_rps']:.2f} | |")
    lines += ["", "| | " + " | ".join(LABELS[c] for c in CONNECTORS) + " |", "|---|---|---|"]

    def row(title: str, cell: Any) -> None:
        lines.append(f"| {title} | " + " | ".join(cell(per[c]) for c in CONNECTORS) + " |")

    for key in per["aionixl"]["idle_cpu_cores"]:
        row(f"idle CPU, {key} (cores)", lambda c, key=key: f"{c['idle_cpu_cores'][key]:.3f}")
    for key in per["aionixl"]["threads"]:
        row(f"OS threads, {key}", lambda c, key=key: str(c["threads"].get(key, "-")))
    row("CPUs of the Worker's main thread, prefill / decode",
        lambda c: " / ".join(",".join(map(str, c["worker_main_thread_cpus"][role]))
                             for role in ("prefill", "decode")))
    row("engine shutdown s, prefill / decode",
        lambda c: f"{c['shutdown_s']['prefill']:.2f} / {c['shutdown_s']['decode']:.2f}")
    row("pair start s", lambda c: f"{c['start_s']:.1f}")
    row("clean stops", lambda c: f"{c['clean_stops']}/{c['pairs']}")
    lines += ["", f"decode tokens equal between the connectors: {section['same_tokens_both_connectors']} "
              "requests"]
    return "\n".join(lines)
