"""Load on the prefill/decode example through its OpenAI API, then a prefill crash (SIGKILL).

The servers are the ones ``python -m examples.serve`` runs: prefill, decode and the P/D
proxy. Requests are streamed ``POST /v1/completions`` (server-sent events, with
``stream_options.include_usage`` and vLLM's ``return_token_ids``), sent to the proxy
(``--via proxy``, the default) or straight to the decode server (``--via decode``).

Phase 1 sends ``--requests`` requests, ``--concurrency`` at a time, and reports the client's
time to first token (TTFT), its parts as the servers measured them (the ``x-aionixl-timing``
header), and the share of it spent reading the KV blocks. Every answer is checked token for
token against a single-process run of the model, and its usage counts.

Phase 2 keeps the same concurrency going, SIGKILLs the prefill server, restarts it on the
same port after ``--down`` seconds, and reports what the in-flight and later requests got
(HTTP status and the OpenAI error's code), the slowest failure (nothing may hang), whether
the decode server survived, and how long until requests succeed again.

Usage: .venv/bin/python benchmarks/load_example.py [--requests 200] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script: make the examples package importable
    sys.path.insert(0, str(ROOT))

from examples import launch  # noqa: E402
from examples.common import TIMING_HEADER  # noqa: E402
from examples.model import (  # noqa: E402
    ModelConfig,
    TinyDecoder,
    generate_reference,
    pick_device,
    setup_torch,
)


@dataclass
class Outcome:
    """One request as the client saw it; times are perf_counter() seconds."""

    prompt: int
    start: float
    end: float = 0.0
    first_token: float | None = None
    status: int = 0  # 0: no HTTP answer at all
    error: str = ""
    tokens: list[int] = field(default_factory=list)
    timing: dict[str, float] = field(default_factory=dict)
    correct: bool = False
    done: bool = False  # the stream ended with data: [DONE]

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.correct

    @property
    def kind(self) -> str:
        if self.ok:
            return "200 ok"
        if self.status == 200:
            return "200 WRONG TOKENS" if self.tokens else f"200 broken stream ({self.error})"
        return f"{self.status or 'no answer'} {self.error}"


async def one_request(client: httpx.AsyncClient, index: int, prompt: list[int], max_new: int,
                      reference: list[int]) -> Outcome:
    """One streamed completion, parsed as an OpenAI client would, checked against ``reference``."""
    out = Outcome(index, time.perf_counter())
    body = {"model": "aionixl-tiny-bytes", "prompt": prompt, "max_tokens": max_new, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    usage: dict[str, int] = {}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as reply:
            out.status = reply.status_code
            if reply.status_code != 200:
                text = (await reply.aread()).decode(errors="replace")
                try:
                    out.error = str(json.loads(text)["error"]["code"])
                except (ValueError, KeyError, TypeError):
                    out.error = f"non-OpenAI error body {text[:60]!r}"
                return out
            with suppress(ValueError):
                out.timing = json.loads(reply.headers.get(TIMING_HEADER, "{}"))
            async for line in reply.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out.done = True
                    break
                chunk = json.loads(line[6:])
                if chunk["choices"]:
                    out.first_token = out.first_token or time.perf_counter()
                    out.tokens += chunk["choices"][0]["token_ids"]
                if chunk.get("usage"):
                    usage = chunk["usage"]
            out.correct = (out.done and out.tokens == reference
                           and usage == {"prompt_tokens": len(prompt), "completion_tokens": max_new,
                                         "total_tokens": len(prompt) + max_new})
            if not out.done:
                out.error = "no [DONE]"
    except httpx.HTTPError as exc:
        out.error = type(exc).__name__
    finally:
        out.end = time.perf_counter()
    return out


WINDOWS = ("before the first kill", "in flight at a kill", "started while it was dead",
           "started while it restarted", "started after it was ready")


def window(r: Outcome, rounds: list[tuple[float, float, float, str]]) -> str:
    """Which part of the kill/restart timeline a request belongs to (exactly one)."""
    if any(r.start < t_kill <= r.end for t_kill, _, _, _ in rounds):
        return WINDOWS[1]
    last = [rd for rd in rounds if rd[0] <= r.start]
    if not last:
        return WINDOWS[0]
    _, t_restart, t_ready, _ = last[-1]
    return WINDOWS[2] if r.start < t_restart else WINDOWS[3] if r.start < t_ready else WINDOWS[4]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def row(label: str, values: list[float], unit: str = "ms") -> str:
    if not values:
        return f"  {label:<30} (none)"
    return (f"  {label:<30} {statistics.median(values):8.2f} {pct(values, 0.9):8.2f} "
            f"{max(values):8.2f}  {unit}")


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = str(pick_device(args.device))
        setup_torch()
        model = TinyDecoder(ModelConfig(), self.device)
        rng = random.Random(args.seed)
        self.prompts = [[rng.randrange(32, 127) for _ in range(rng.randint(args.min_len, args.max_len))]
                        for _ in range(64)]
        self.references = [generate_reference(model, p, args.max_new_tokens) for p in self.prompts]
        self.blocks = [model.blocks_for(len(p)) for p in self.prompts]
        self.logs = Path(tempfile.mkdtemp(prefix="aionixl-load-"))
        self.prefill_port = launch.free_port()
        self.prefill: launch.ServerProcess | None = None
        self.decode: launch.ServerProcess | None = None
        self.proxy: launch.ServerProcess | None = None

    def prefill_spec(self) -> tuple[str, list[str], Path]:
        args = ["--port", str(self.prefill_port), "--device", self.device]
        return "prefill", args, self.logs / "prefill.log"

    def start_prefill(self) -> launch.ServerProcess:
        self.prefill = launch.start(*self.prefill_spec())
        return self.prefill

    def start_servers(self) -> None:
        """Prefill and decode at once (decode needs only the prefill URL), then the proxy."""
        a = self.args
        prefill_url = f"http://127.0.0.1:{self.prefill_port}"
        self.prefill, self.decode = launch.start_all([self.prefill_spec(), ("decode", [
            "--port", "0", "--device", self.device, "--prefill-url", prefill_url,
            "--connect-timeout", str(a.connect_timeout), "--transfer-timeout", str(a.transfer_timeout),
            "--notify", a.notify], self.logs / "decode.log")])
        self.proxy = launch.start("proxy", ["--port", "0", "--prefill-url", prefill_url,
                                            "--decode-url", self.decode.url], self.logs / "proxy.log")

    async def request(self, client: httpx.AsyncClient, n: int) -> Outcome:
        i = n % len(self.prompts)
        return await one_request(client, i, self.prompts[i], self.args.max_new_tokens, self.references[i])

    async def phase_load(self, client: httpx.AsyncClient) -> None:
        a = self.args
        first = await self.request(client, 0)  # the handshake happens here
        ttft_first = (first.first_token - first.start) * 1e3 if first.first_token else 0.0
        print(f"first request: {first.kind}; connect (handshake) {first.timing.get('connect_ms', 0):.1f} ms "
              f"of client TTFT {ttft_first:.1f} ms")
        gate = asyncio.Semaphore(a.concurrency)

        async def limited(n: int) -> Outcome:
            async with gate:
                return await self.request(client, n)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(limited(n) for n in range(1, a.requests + 1)))
        wall = time.perf_counter() - t0
        good = [r for r in results if r.ok]
        kinds = Counter(r.kind for r in results)
        print(f"\nphase 1: {a.requests} requests, {a.concurrency} concurrent, {a.max_new_tokens} new tokens "
              f"each, prompts of {a.min_len}..{a.max_len} tokens ({min(self.blocks)}..{max(self.blocks)} "
              f"blocks x 4 regions x 4 KiB)")
        print(f"  outcomes: {dict(kinds)}; token-identical to the single-process reference: "
              f"{len(good)}/{len(results)}")
        print(f"  {wall:.2f} s: {len(good) / wall:.1f} requests/s, "
              f"{len(good) * a.max_new_tokens / wall:.0f} tokens/s")
        print(f"  {'':<30} {'median':>8} {'p90':>8} {'max':>8}")
        ttft = [(r.first_token - r.start) * 1e3 for r in good if r.first_token is not None]
        print(row("client TTFT", ttft))
        if a.via == "proxy":
            stages = [("proxy_ttft_ms", "  proxy, to decode's headers"),
                      ("proxy_prefill_ms", "    prefill call (max_tokens=1)"),
                      ("prefill_compute_ms", "      of it model prefill"),
                      ("ttft_ms", "    decode server, to 1st token"),
                      ("connect_ms", "      engine.connect"), ("transfer_ms", "      transfer_blocks")]
        else:
            stages = [("ttft_ms", "  decode server, to 1st token"),
                      ("prefill_ms", "    prefill call (max_tokens=1)"),
                      ("prefill_compute_ms", "      of it model prefill"),
                      ("connect_ms", "    engine.connect"), ("transfer_ms", "    transfer_blocks")]
        for key, label in stages:
            print(row(label, [r.timing[key] for r in good if key in r.timing]))
        print(row("transfer share of client TTFT",
                  [100 * r.timing["transfer_ms"] / ((r.first_token - r.start) * 1e3)
                   for r in good if r.first_token is not None and "transfer_ms" in r.timing], "%"))
        print(row("client total", [(r.end - r.start) * 1e3 for r in good]))

    async def phase_kill(self, client: httpx.AsyncClient) -> None:
        a = self.args
        assert self.prefill is not None and self.decode is not None
        results: list[Outcome] = []
        stop = asyncio.Event()
        counter = iter(range(10**9))

        async def worker() -> None:
            while not stop.is_set():
                out = await self.request(client, next(counter))
                results.append(out)
                if not out.ok:
                    await asyncio.sleep(0.05)  # a down server is not a reason to spin

        print(f"\nphase 2: {a.concurrency} clients in a loop; {a.rounds} rounds of: {a.before_kill} s load, "
              f"SIGKILL the prefill server, {a.down} s down, restart it on port {self.prefill_port}")
        workers = [asyncio.create_task(worker()) for _ in range(a.concurrency)]
        rounds: list[tuple[float, float, float, str]] = []
        try:
            for _ in range(a.rounds):
                await asyncio.sleep(a.before_kill)
                old_engine = self.prefill.info["engine_address"]
                t_kill = time.perf_counter()
                self.prefill.kill()
                await asyncio.sleep(a.down)
                t_restart = time.perf_counter()
                await asyncio.to_thread(self.start_prefill)
                t_ready = time.perf_counter()
                new_engine = self.prefill.info["engine_address"]
                rounds.append((t_kill, t_restart, t_ready, f"{old_engine} -> {new_engine}"))
                deadline = t_ready + a.recovery_deadline
                while time.perf_counter() < deadline and not any(r.ok and r.start > t_kill for r in results):
                    await asyncio.sleep(0.05)
            await asyncio.sleep(a.after_recovery)
        finally:
            stop.set()
            await asyncio.gather(*workers)

        windows = {label: Counter[str]() for label in WINDOWS}
        slowest = dict.fromkeys(WINDOWS, 0.0)
        for r in results:
            label = window(r, rounds)
            windows[label][r.kind] += 1
            slowest[label] = max(slowest[label], (r.end - r.start) * 1e3)
        for n, (t_kill, t_restart, t_ready, engines) in enumerate(rounds, 1):
            t_next = rounds[n][0] if n < len(rounds) else math.inf
            later_ok = sorted(r.end for r in results if r.ok and t_kill <= r.start < t_next)
            recovered = "NOT recovered"
            if later_ok:
                recovered = (f"first success {(later_ok[0] - t_kill) * 1e3:.0f} ms after the kill "
                             f"({(later_ok[0] - t_ready) * 1e3:+.0f} ms from ready)")
            print(f"  round {n}: restart took {(t_ready - t_restart) * 1e3:.0f} ms; {recovered}")
            print(f"           prefill engine {engines}")
        for label, kinds in windows.items():
            print(f"  {label:<27} {sum(kinds.values()):4d} requests, slowest {slowest[label]:7.1f} ms: "
                  + ", ".join(f"{k} x{c}" for k, c in kinds.most_common()))
        failed = [r for r in results if not r.ok]
        print(f"  all failures: {dict(Counter(r.kind for r in failed))}; slowest "
              f"{max(((r.end - r.start) * 1e3 for r in failed), default=0.0):.1f} ms "
              f"(deadlines: connect {a.connect_timeout} s, transfer {a.transfer_timeout} s)")
        wrong = [r for r in results if r.status == 200 and not r.correct]
        print(f"  answered 200 with wrong or broken tokens: {len(wrong)} of {len(results)} requests")
        alive = self.decode.alive()
        async with httpx.AsyncClient(base_url=self.decode.url, timeout=5) as direct:
            health = (await direct.get("/health")).status_code if alive else 0
            stats = (await direct.get("/stats")).json() if alive else {}
        engine = stats.get("engine") or {}
        print(f"  decode server: {'alive' if alive else 'DEAD'}, /health {health}, free blocks "
              f"{stats.get('free_blocks')}/{stats.get('num_blocks')}, outcomes {stats.get('outcomes')}")
        print(f"  decode engine: peers_evicted {engine.get('peers_evicted')}, peers still listed "
              f"{[p['address'] for p in engine.get('peers', [])]}")
        async with httpx.AsyncClient(timeout=5) as plain:
            pstats = (await plain.get(f"{self.prefill.url}/stats")).json()
        print(f"  last prefill server: free blocks {pstats['free_blocks']}/{pstats['num_blocks']} "
              f"(active leases {pstats['active_leases']}), freed on notification "
              f"{pstats['freed_on_notification']}, on lease timeout {pstats['freed_on_lease_timeout']}")

    async def run(self) -> int:
        a = self.args
        print(f"servers' logs: {self.logs}; device {self.device}; requests via the {a.via}; "
              f"decode --notify {a.notify}")
        try:
            self.start_servers()
            target = self.proxy if a.via == "proxy" else self.decode
            assert target is not None
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
            async with httpx.AsyncClient(base_url=target.url, timeout=a.client_timeout,
                                         limits=limits) as client:
                await self.phase_load(client)
                if not a.no_kill:
                    await self.phase_kill(client)
        finally:
            for server in (self.proxy, self.decode, self.prefill):
                if server is not None:
                    server.stop()
        return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--min-len", type=int, default=16)
    p.add_argument("--max-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--via", choices=["proxy", "decode"], default="proxy",
                   help="send requests to the P/D proxy (vLLM's flow) or straight to the decode server")
    p.add_argument("--notify", choices=["attached", "separate"], default="attached")
    p.add_argument("--connect-timeout", type=float, default=5.0)
    p.add_argument("--transfer-timeout", type=float, default=5.0)
    p.add_argument("--client-timeout", type=float, default=30.0, help="httpx timeout; a hang shows as one")
    p.add_argument("--rounds", type=int, default=3, help="kill/restart rounds")
    p.add_argument("--before-kill", type=float, default=1.0, help="seconds of load before each SIGKILL")
    p.add_argument("--down", type=float, default=1.0, help="seconds the prefill server stays dead")
    p.add_argument("--recovery-deadline", type=float, default=20.0)
    p.add_argument("--after-recovery", type=float, default=1.0, help="seconds of load after the last round")
    p.add_argument("--no-kill", action="store_true", help="phase 1 only")
    p.add_argument("--device", default="auto")
    return asyncio.run(Bench(p.parse_args()).run())


if __name__ == "__main__":
    raise SystemExit(main())
