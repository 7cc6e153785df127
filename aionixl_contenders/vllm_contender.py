"""vLLM's real NixlConnector as a contender of ``aionixl bench --with-vllm``.

Two child processes under this interpreter (which must have vLLM): a vLLM prefill worker
(``python -m aionixl_contenders.vllm_worker --quiet``: vLLM's connector pair over a
patterned KV cache, its engine loop stepping every 1 ms) and a vLLM decode worker
(``python -m aionixl_contenders.vllm_decode``: vLLM's connector in the pull role,
driven as vLLM's scheduler and engine loop would drive it). This module steers
them and turns their answers into the bench's samples. The same decode then reads from an
aionixl prefill serving it (:mod:`.serving_prefill`, ``aionixl.vllm.serve`` in process and
isolated): the ``spaced_1_p50_*`` and ``idle_cpu_*`` rows of the vLLM column.

Geometry: the vLLM model is chosen so that its KV cache has the bench's shape: one NIXL
region per vLLM layer (layout LBHNC: K and V of a block share one page), as many layers as
the bench has regions, a page of ``--block-bytes`` (32 tokens x KV heads x head dim 64 x K/V
x bf16), ``--blocks`` blocks. Block id b is block b of every region on both sides, as in the
aionixl contenders. Every read carries vLLM's notification for a request the prefill holds
(``hold_many`` before each loop), so the prefill frees blocks as it would in service.
Run by ``aionixl bench``; ``run(ctx)`` returns samples per measure.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

from aionixl._bench._child import module_command, pin_threads
from aionixl._lines import LineReader, encode_line


class Child:
    """A vLLM worker process: :mod:`aionixl._lines` messages in on stdin, out on a pipe of its own
    (its stdout and stderr, vLLM's and NIXL's logs, go to a file)."""

    def __init__(self, module: str, args: list[str], log: Any) -> None:
        read_fd, write_fd = os.pipe()
        try:
            argv, env = module_command(f"{__package__}.{module}", "--fd", str(write_fd), *args)
            self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                         pass_fds=(write_fd,), env=env)
        finally:
            os.close(write_fd)
        self.name = module
        self._fd = read_fd
        self._reader = LineReader()
        self._code: int | None = None
        self._stopped = False

    def line(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            msg = self._reader.pop()
            if msg is not None:
                if msg.get("error"):
                    raise RuntimeError(f"{self.name}: {msg['error']}")
                return msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s")
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                chunk = os.read(self._fd, 1 << 20)
                if not chunk:
                    raise RuntimeError(f"{self.name} exited (code {self.proc.wait()})")
                self._reader.feed(chunk)

    def ask(self, cmd: dict[str, Any], timeout: float = 300.0) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_line(cmd))
        self.proc.stdin.flush()
        return self.line(timeout)

    def stop(self) -> int | None:
        """End of stdin, then the exit code (killed after 30 s); idempotent."""
        if self._stopped:
            return self._code
        self._stopped = True
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        try:
            code = self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        os.close(self._fd)
        self._code = code
        return code


def _verify(ctx: Any, decode: Child, req: str, what: str) -> int:
    """The decode reads ``ctx.verify_set`` under request ``req`` and compares every word with
    the prefill pattern; the blocks it checked (``RuntimeError`` naming ``what`` on a mismatch)."""
    loc, rem = ctx.verify_set
    reply = decode.ask({"op": "verify", "req": req, "local": [int(x) for x in loc],
                        "remote": [int(x) for x in rem]})
    if not reply["ok"]:
        raise RuntimeError(f"{what}: the bytes read do not match the prefill pattern")
    return int(reply["blocks"])


def _lists(pairs: list[tuple[Any, Any]]) -> list[list[list[int]]]:
    return [[[int(x) for x in loc], [int(x) for x in rem]] for loc, rem in pairs]


def run(ctx: Any) -> dict[str, Any]:
    spec = ctx.spec
    out: dict[str, Any] = {}
    geometry = ["--unpin", "--layers", str(spec.regions), "--blocks", str(spec.blocks),
                "--block-size", str(spec.vllm_block_tokens), "--kv-heads", str(spec.vllm_kv_heads),
                "--head-dim", str(spec.vllm_head_dim)]
    log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"aionixl-bench-vllm-{os.getpid()}.log"
    ctx.rest()  # the aionixl prefill side is not involved: leave the CPUs to the vLLM processes
    ctx.progress(f"vLLM connector: starting a vLLM prefill and a vLLM decode worker (log: {log_path})")
    with open(log_path, "ab") as log:
        # Each worker picks its own ports as it binds them (vllm_worker.free_port).
        prefill = Child("vllm_worker", ["--quiet", "--lease-s", "600", *geometry], log)
        decode = Child("vllm_decode", geometry, log)
        try:
            p_ready = prefill.line(300)["ready"]
            d_ready = decode.line(300)["ready"]
            if p_ready["page_bytes"] != spec.block_bytes or d_ready["page_bytes"] != spec.block_bytes:
                raise RuntimeError(f"vLLM pages of {p_ready['page_bytes']} bytes, not {spec.block_bytes}")
            out.update(_measure(ctx, prefill, decode, p_ready))
            out.update(_measure_serving(ctx, prefill, decode, p_ready, d_ready, log))
            out["info"].update(prefill_ready=p_ready, decode_ready=d_ready, log=str(log_path))
        finally:
            codes = {"decode": decode.stop(), "prefill": prefill.stop()}
            ctx.spin()
    if any(codes.values()):
        raise RuntimeError(f"a vLLM worker exited with {codes}; see {log_path}")
    return out


def _measure(ctx: Any, prefill: Child, decode: Child, p_ready: dict[str, Any]) -> dict[str, Any]:
    spec = ctx.spec
    out: dict[str, Any] = {}
    names = itertools.count()

    def held(n: int) -> list[str]:
        """``n`` fresh request ids, each held by the prefill (its blocks wait for a decoder)."""
        reqs = [f"bench-{next(names)}" for _ in range(n)]
        prefill.ask({"op": "hold_many", "reqs": reqs, "lease_s": 600})
        return reqs

    checked = 0  # block ids whose bytes the decode worker compared with the prefill pattern

    def verify(when: str) -> None:
        nonlocal checked
        checked += _verify(ctx, decode, held(1)[0], f"vLLM connector ({when})")

    host, port = p_ready["address"].removeprefix("tcp://").rsplit(":", 1)
    ctx.progress("vLLM connector: handshakes (vLLM's handshake thread; the engine dropped between)")
    connect = decode.ask({"op": "connect", "engine_id": p_ready["engine_id"], "host": host,
                          "port": int(port), "reqs": held(spec.connect_count + 1)})
    out["connect"] = connect["connect"][1:]  # the first one also wires UCX up: reconnects only
    verify("start")

    one = _lists(ctx.workload("contiguous", 1))
    per_repeat = []
    for i in range(spec.repeats):
        ctx.progress(f"vLLM connector: one-block reads, start_load_kv to get_finished "
                     f"({i + 1}/{spec.repeats})")
        per_repeat.append(decode.ask({"op": "reads", "pairs": one, "reqs": held(spec.lat_count)})["seconds"])
    out.update(ctx.latency_rows(per_repeat))
    out["seq_1"] = [sum(r) / len(r) for r in per_repeat]
    bulk = _lists(ctx.workload("contiguous", spec.bulk_blocks))
    nbytes = spec.bulk_blocks * spec.bytes_per_block_id
    bulk_s = []
    for i in range(spec.repeats):
        ctx.progress(f"vLLM connector: 16 MiB reads ({i + 1}/{spec.repeats})")
        seconds = decode.ask({"op": "reads", "pairs": bulk, "reqs": held(spec.bulk_count)})["seconds"]
        bulk_s.append(nbytes / (sum(seconds) / len(seconds)))
    out["bulk"] = bulk_s
    verify("after the timed loops")

    ctx.progress("vLLM connector: idle CPU (decode process, engine loop blocked)")
    out["idle_cpu"] = decode.ask({"op": "idle", "settle_s": spec.idle_settle_s,
                                  "windows": spec.idle_windows, "window_s": spec.idle_window_s})["idle_cpu"]
    verify("after idling")

    closes, opened, after, details = [], [], [], []
    for i in range(spec.close_repeats):
        ctx.progress(f"vLLM connector: close with 1 peer and {spec.close_inflight} reads in flight over "
                     f"UCX tcp ({i + 1}/{spec.close_repeats})")
        r = decode.ask({"op": "close", "ucx_tls": spec.slow_tls,
                        "inflight": spec.close_inflight, "blocks": spec.close_blocks,
                        "reqs": held(spec.close_inflight + 1)})
        closes.append(r["worker_s"] + r["listener_s"])
        opened.append(float(r["threads_open"] - r["threads_base"]))
        after.append(float(r["threads_after"] - r["threads_base"]))
        details.append(r)
    out.update(close_1=closes, threads_open=opened, threads_closed=after)
    verify("after the close runs")
    out["info"] = {"verified_blocks": checked, "close": details, "close_transport": spec.slow_tls,
                   "first_handshake_s": connect["connect"][0],
                   "geometry": {"layers (regions)": spec.regions, "block_tokens": spec.vllm_block_tokens,
                                "kv_heads": spec.vllm_kv_heads, "head_dim": spec.vllm_head_dim,
                                "page_bytes": spec.block_bytes, "blocks": spec.blocks,
                                "kv_cache_layout": "LBHNC"},
                   "completion": "get_transfer_results (what get_finished wraps) called in a loop "
                                 "right after start_load_kv: no forward pass between"}
    return out


def _spaced_p50(ctx: Any, decode: Child, hold: Any) -> list[float]:
    """Per repeat, the p50 of one-block reads ``spaced_gap_s`` apart, each held by ``hold``."""
    spec = ctx.spec
    one = _lists(ctx.workload("contiguous", 1))
    out = []
    for _ in range(spec.repeats):
        seconds = decode.ask({"op": "reads", "pairs": one, "reqs": hold(spec.spaced_count),
                              "gap_s": spec.spaced_gap_s})["seconds"]
        out.append(sorted(seconds)[len(seconds) // 2])
    return out


def _measure_serving(ctx: Any, prefill: Child, decode: Child, p_ready: dict[str, Any],
                     d_ready: dict[str, Any], log: Any) -> dict[str, Any]:
    """The same vLLM decode reading spaced one-block reads from the vLLM prefill, then (the
    vLLM prefill stopped) from an aionixl prefill serving it (:mod:`.serving_prefill`: in
    process, then isolated), bytes verified; the aionixl prefill's idle CPU after."""
    spec = ctx.spec
    names = itertools.count()

    def reqs(n: int) -> list[str]:
        return [f"spaced-{next(names)}" for _ in range(n)]

    def held_by_vllm(n: int) -> list[str]:
        ids = reqs(n)
        prefill.ask({"op": "hold_many", "reqs": ids, "lease_s": 600})
        return ids

    # As on two hosts: the prefill on one CPU, the decode on another (on two CPUs, a decode
    # spinning over both would decide how soon a prefill that sleeps between reads runs).
    cpus = sorted(os.sched_getaffinity(0))
    prefill_cpus = ["--cpus", str(cpus[0])] if len(cpus) > 1 else []
    if prefill_cpus:
        pin_threads(decode.proc.pid, {cpus[-1]})
        pin_threads(prefill.proc.pid, {cpus[0]})
    host, port = p_ready["address"].removeprefix("tcp://").rsplit(":", 1)
    decode.ask({"op": "target", "engine_id": p_ready["engine_id"], "host": host, "port": int(port)})
    ctx.progress(f"vLLM decode: one-block reads {spec.spaced_gap_s * 1e3:g} ms apart from the vLLM prefill")
    out: dict[str, Any] = {"spaced_1_p50_vllm": _spaced_p50(ctx, decode, held_by_vllm)}
    # Each prefill alone with the decode: vLLM's, idle, would still keep a core busy.
    code = prefill.stop()
    if code:
        raise RuntimeError(f"the vLLM prefill exited with {code}")
    geometry = ["--layers", str(spec.regions), "--blocks", str(spec.blocks), "--page", str(spec.block_bytes),
                "--compat-hash", d_ready["compat_hash"], "--block-size", str(d_ready["block_size"]),
                "--attn-backend", d_ready["attn_backend"]]
    for key, flags in (("served", []), ("isolated", ["--isolate"])):
        ctx.progress(f"vLLM decode: the same reads from an aionixl prefill ({key})")
        serving = Child("serving_prefill", [*geometry, *flags, *prefill_cpus], log)
        try:
            ready = serving.line(120)["ready"]
            host, port = ready["address"].removeprefix("tcp://").rsplit(":", 1)
            decode.ask({"op": "target", "engine_id": ready["engine_id"], "host": host, "port": int(port)})

            def held_by_aionixl(n: int, serving: Child = serving) -> list[str]:
                ids = reqs(n)
                serving.ask({"op": "hold_many", "reqs": ids, "blocks": [0], "duration": 600})
                return ids

            _verify(ctx, decode, held_by_aionixl(1)[0], f"vLLM decode from an aionixl prefill ({key})")
            out[f"spaced_1_p50_{key}"] = _spaced_p50(ctx, decode, held_by_aionixl)
            out[f"idle_cpu_{key}"] = serving.ask({"op": "idle", "settle_s": spec.idle_settle_s,
                                                  "windows": spec.idle_windows,
                                                  "window_s": spec.idle_window_s})["idle_cpu"]
        finally:
            code = serving.stop()
        if code:
            raise RuntimeError(f"the aionixl serving prefill ({key}) exited with {code}")
    return out


# ---- the P/D request workload (aionixl bench --workload pd --with-vllm) -----------------


class VllmPd:
    """vLLM's real NixlConnector on the P/D workload. The decode worker plays vLLM's engine
    loop (``vllm_decode``'s ``pd`` command): at each step boundary the scheduler hands the
    connector every request that has arrived since (one ``NixlConnectorMetadata`` with a
    ``reqs_to_recv`` entry each; ``start_load_kv``), the forward pass runs for ``step_s``
    (a sleep), then ``get_finished`` (``get_transfer_results``) reports the reads done. The
    prefill worker holds every request's blocks beforehand (``hold_many``) and frees them on
    vLLM's notification. Geometry as every other contender's: one vLLM layer per region
    (LBHNC: a page of ``block_bytes``), the same block ids, the same bytes per request.
    Latency, bytes, CPU (the decode process's) and the byte checks are measured in the
    decode worker, by the same rules (:mod:`aionixl._bench._pdwork`)."""

    name = "vllm"

    def __init__(self, ctx: Any, step_s: float) -> None:
        spec = ctx.spec
        self.ctx, self.step_s = ctx, step_s
        block_tokens, head_dim = spec.vllm_block_tokens, spec.vllm_head_dim
        kv_heads = spec.block_bytes // (block_tokens * head_dim * 4)
        if kv_heads < 1 or spec.block_bytes % (block_tokens * head_dim * 4):
            raise RuntimeError(f"no vLLM page of {spec.block_bytes} bytes with {block_tokens}-token blocks")
        geometry = ["--unpin", "--layers", str(spec.regions), "--blocks", str(spec.blocks),
                    "--block-size", str(block_tokens), "--kv-heads", str(kv_heads),
                    "--head-dim", str(head_dim)]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"aionixl-bench-vllm-pd-{os.getpid()}.log"
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - open for the contender's life
        ctx.rest()
        ctx.progress(f"P/D: vLLM connector: starting a vLLM prefill and decode worker (log: {self.log_path})")
        self.prefill = Child("vllm_worker", ["--quiet", "--lease-s", "600", *geometry], self._log)
        self.decode = Child("vllm_decode", geometry, self._log)
        self._names = itertools.count()
        self.checked = 0
        try:
            p_ready = self.prefill.line(300)["ready"]
            d_ready = self.decode.line(300)["ready"]
            if p_ready["page_bytes"] != spec.block_bytes or d_ready["page_bytes"] != spec.block_bytes:
                raise RuntimeError(f"vLLM pages of {p_ready['page_bytes']} bytes, not {spec.block_bytes}")
            host, port = p_ready["address"].removeprefix("tcp://").rsplit(":", 1)
            self.decode.ask({"op": "connect", "engine_id": p_ready["engine_id"], "host": host,
                             "port": int(port), "reqs": self._held(1)})
            self._pause()
        except BaseException:
            self.close()
            raise
        finally:
            ctx.spin()

    def _pause(self) -> None:
        """Stop both vLLM workers (SIGSTOP) between their own steps: idle, their NIXL
        progress and UCX threads use ~25 % of a core each, which would load the machine under
        the other contenders' steps. They hold no connection to anything else."""
        for child in (self.decode, self.prefill):
            os.kill(child.proc.pid, signal.SIGSTOP)

    def _resume(self) -> None:
        for child in (self.prefill, self.decode):
            os.kill(child.proc.pid, signal.SIGCONT)

    def _held(self, n: int) -> list[str]:
        reqs = [f"pd-{next(self._names)}" for _ in range(n)]
        self.prefill.ask({"op": "hold_many", "reqs": reqs, "lease_s": 600})
        return reqs

    def step(self, rec: Any, reqs: list[Any], concurrency: int | None = None) -> None:
        self._resume()
        names = self._held(len(reqs))
        self.ctx.rest()  # the aionixl prefill side is not involved: leave the CPUs to vLLM's
        try:
            reply = self.decode.ask({
                "op": "pd", "rate": rec.rate, "concurrency": concurrency, "step_s": self.step_s,
                "spin_s": rec.spec.spin_s, "seed": rec.spec.seed, "bytes_per_block_id": rec.block_bytes,
                "reqs": [{"req": name, "at": r.at, "remote": [int(x) for x in r.remote]}
                         for name, r in zip(names, reqs, strict=True)]}, timeout=600)
        finally:
            self.ctx.spin()
            self._pause()
        rec.adopt(reply)

    def verify(self) -> int:
        self._resume()
        try:
            return _verify(self.ctx, self.decode, self._held(1)[0], "vLLM connector (P/D)")
        finally:
            self._pause()

    def close(self) -> None:
        codes = {}
        for child in ("decode", "prefill"):
            if hasattr(self, child):
                with contextlib.suppress(OSError):
                    os.kill(getattr(self, child).proc.pid, signal.SIGCONT)
                codes[child] = getattr(self, child).stop()
        self._log.close()
        if any(codes.values()):
            raise RuntimeError(f"a vLLM worker exited with {codes}; see {self.log_path}")
