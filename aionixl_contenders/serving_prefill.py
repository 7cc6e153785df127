"""An aionixl prefill serving vLLM decoders (``aionixl.vllm.serve``), in a child process of
its own: for ``aionixl bench --with-vllm`` (a vLLM decode reads from it) and for the tests
that kill its reader (if the prefill died, the test process must not die with it).

    python -m aionixl_contenders.serving_prefill --fd FD --layers L --blocks B --page P \\
        --compat-hash H --block-size S --attn-backend A [--progress-thread] [--isolate]

Its blocks hold the pattern the vLLM decode checks (``expected_words``). Messages
(:mod:`aionixl._lines`): ``ready`` on ``--fd``; commands on stdin, one per line:
``{"op": "lease", "req": ID, "blocks": [...], "duration": S}`` (answered ``{"leased": ID}``,
then ``{"lease": ID, "outcome": "released" | "expired" | ...}`` when it ends) and
``{"op": "hold_many", "reqs": [...], "blocks": [...], "duration": S}`` (leases, their ends
not reported; answered ``{"held_many": N}``), ``{"op": "idle", "settle_s": S, "windows": N,
"window_s": S}`` (CPU share of this process, and of its serving child with ``--isolate``,
per window: ``{"idle_cpu": [...]}``),
``{"op": "stats"}`` (``{"stats": ..., "resources": ..., "engine_id": ...}``),
``{"op": "abort-serving-child"}`` (SIGABRT to the ``isolate`` child; ``{"aborted": pid}``). End of
stdin closes the engine and reports ``{"closed": live_resources}``.
"""

from __future__ import annotations

import argparse
import os
import signal
import time
from typing import Any

import anyio
import anyio.abc
import numpy as np

import aionixl
import aionixl.lowlevel
import aionixl.vllm
from aionixl._bench._child import cpu_seconds
from aionixl._bench._memory import expected_words
from aionixl._lines import LineReader, write_file


def cache(layers: int, blocks: int, page: int, shared: bool) -> list[np.ndarray]:
    """The pattern, in ``aionixl.shared_dram`` memory with ``shared`` (for ``isolate``)."""
    ids = np.arange(blocks, dtype=np.int64)
    regions = [expected_words(layer, ids, page // 8).view(np.uint8).reshape(blocks, page)
               for layer in range(layers)]
    if not shared:
        return [r.copy() for r in regions]
    buf = aionixl.shared_dram(layers * blocks * page).reshape(layers, blocks, page)
    buf[:] = regions
    return list(buf)


async def idle_cpu(engine: aionixl.Engine, cmd: dict[str, Any]) -> list[float]:
    """CPU share of this process (and of the serving child, when isolated) per window,
    with nothing to serve."""
    sidecar = engine._vllm_server.sidecar
    pids = [os.getpid()] + ([sidecar.pid] if sidecar is not None and sidecar.pid is not None else [])
    await anyio.sleep(float(cmd["settle_s"]))
    out = []
    for _ in range(int(cmd["windows"])):
        c0, t0 = sum(map(cpu_seconds, pids)), time.perf_counter()
        await anyio.sleep(float(cmd["window_s"]))
        out.append((sum(map(cpu_seconds, pids)) - c0) / (time.perf_counter() - t0))
    return out


async def serve(args: argparse.Namespace) -> None:
    out = os.fdopen(args.fd, "w")

    def emit(obj: dict[str, Any]) -> None:
        write_file(out, obj)

    tuning = aionixl.lowlevel.Tuning(nixl_progress_thread=args.progress_thread)
    engine_id = f"serving-prefill-{os.getpid()}"
    kv = cache(args.layers, args.blocks, args.page, args.isolate)
    async with aionixl.Engine(engine_id, kv, listen=None, tuning=tuning) as engine, \
            anyio.create_task_group() as tg:
        address = await aionixl.vllm.serve(engine, "tcp://127.0.0.1:0", engine_id=engine_id,
                                           compat_hash=args.compat_hash, block_size=args.block_size,
                                           kv_cache_layout="LBHNC", attn_backend_name=args.attn_backend,
                                           isolate=args.isolate)
        emit({"ready": {"pid": os.getpid(), "address": address, "engine_id": aionixl.vllm.engine_id(engine)}})

        async def watch(lease: aionixl.Lease) -> None:
            try:
                await lease.wait()
                outcome = "released"
            except aionixl.LeaseExpiredError:
                outcome = "expired"
            except aionixl.AionixlError as exc:
                outcome = type(exc).__name__
            emit({"lease": lease.request_id, "outcome": outcome})

        reader = LineReader()
        os.set_blocking(0, False)
        while True:
            await anyio.wait_readable(0)
            chunk = os.read(0, 65536)
            if not chunk:
                break
            reader.feed(chunk)
            while (cmd := reader.pop()) is not None:
                if cmd["op"] == "lease":
                    lease = engine.lease(cmd["req"], cmd["blocks"], duration=float(cmd["duration"]))
                    tg.start_soon(watch, lease)
                    emit({"leased": cmd["req"]})
                elif cmd["op"] == "hold_many":
                    for req in cmd["reqs"]:
                        engine.lease(req, cmd["blocks"], duration=float(cmd["duration"]))
                    emit({"held_many": len(cmd["reqs"])})
                elif cmd["op"] == "idle":
                    emit({"idle_cpu": await idle_cpu(engine, cmd)})
                elif cmd["op"] == "abort-serving-child":  # as UCX's abort would (isolate)
                    sidecar = engine._vllm_server.sidecar
                    assert sidecar is not None and sidecar.pid is not None
                    os.kill(sidecar.pid, signal.SIGABRT)
                    emit({"aborted": sidecar.pid})
                elif cmd["op"] == "stats":
                    counts = {k: v for k, v in engine.metrics().as_dict().items()
                              if isinstance(v, (int, bool))}
                    emit({"stats": counts, "resources": engine.live_resources(),
                          "engine_id": aionixl.vllm.engine_id(engine)})
        tg.cancel_scope.cancel()
    emit({"closed": engine.live_resources()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--layers", type=int, required=True)
    p.add_argument("--blocks", type=int, required=True)
    p.add_argument("--page", type=int, required=True)
    p.add_argument("--compat-hash", required=True)
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--attn-backend", required=True)
    p.add_argument("--progress-thread", action="store_true")
    p.add_argument("--isolate", action="store_true", help="aionixl.vllm.serve(isolate=True)")
    p.add_argument("--backend", default="asyncio", choices=("asyncio", "trio"))
    p.add_argument("--cpus", help="comma-separated CPUs this process (and its serving child) runs on")
    args = p.parse_args()
    if args.cpus:  # before any thread or child exists: they all inherit it
        os.sched_setaffinity(0, {int(c) for c in args.cpus.split(",")})
    anyio.run(serve, args, backend=args.backend)


if __name__ == "__main__":
    main()
