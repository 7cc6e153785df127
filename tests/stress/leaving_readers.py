"""Issue 13's held-out check, reproduced: rounds of readers leaving mid-read (not in CI).

    .venv/bin/python -m tests.stress.leaving_readers --rounds 25 --mib 512

A serving engine in a child process (UCX over TCP, default EngineConfig) holds one region
of ``--mib`` MiB; each round runs five fresh reader processes, each leaving a read of all
of it in one way (aclose, disconnect, cancelled caller, timeout, SIGKILL). After every
reader this script checks that the server is alive and reads all of its bytes back
correctly, and counts UCX warnings on the readers' side and on the server's. Prints a
JSON summary; exits 1 on any failure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from typing import Any

import anyio

import aionixl

from ..helpers import numpy_cache, unique
from ..leaving import WAYS, check_server, run_reader, start_server, ucx_noise


async def main(args: argparse.Namespace) -> int:
    os.environ["UCX_TLS"] = "tcp"
    block_bytes = 1 << 20
    blocks = args.mib
    server = await start_server(blocks, block_bytes)
    failures: list[str] = []
    outcomes: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    reader_noise = 0
    late = 0
    mid_read = 0
    started = time.monotonic()
    local = numpy_cache(blocks, block_bytes, 1)
    async with aionixl.Engine(unique("checker"), local, listen=None) as checker:
        for n in range(args.rounds):
            for way in WAYS:
                r = run_reader(server, way, backend=args.backend, seed=n * 10 + WAYS.index(way),
                               read_mode=args.read_mode)
                outcomes[f"{way}:{r.report.get('outcome', 'killed' if way == 'kill' else '?')}"] += 1
                modes[r.report.get("read_mode", "?")] += 1
                reader_noise += len(r.noise)
                late += int(r.report.get("late_bytes", 0))
                if not r.report.get("finished_before_leaving", False):
                    mid_read += 1
                expected_rc = -9 if way == "kill" else 0
                if r.returncode != expected_rc:
                    failures.append(f"round {n} {way}: reader exit {r.returncode}: {r.output[-2000:]}")
                if r.noise:
                    failures.append(f"round {n} {way}: reader UCX noise: {r.noise[:3]}")
                try:
                    await check_server(server, checker, local)
                except AssertionError as exc:
                    failures.append(f"round {n} {way}: {exc}")
                    break
            else:
                print(f"round {n + 1}/{args.rounds} ok ({time.monotonic() - started:.0f} s)",
                      file=sys.stderr, flush=True)
                continue
            break
    alive = server.child.running
    server_out = server.output()
    failure = await server.child.aclose()
    code = server.child.returncode if failure is None else f"{failure}"
    summary: dict[str, Any] = {
        "rounds": args.rounds, "mib": args.mib, "backend": args.backend, "read_mode": args.read_mode,
        "server_alive_at_end": alive, "server_exit": code,
        "readers": sum(outcomes.values()), "left_mid_read": mid_read,
        "read_modes": dict(modes), "outcomes": dict(sorted(outcomes.items())),
        "reader_ucx_warnings": reader_noise, "late_bytes": late,
        "server_ucx_warnings": len(ucx_noise(server_out)),
        "server_warning_samples": ucx_noise(server_out)[:5],
        "failures": failures[:10], "seconds": round(time.monotonic() - started, 1),
    }
    print(json.dumps(summary, indent=1))
    return 1 if failures or late or not alive else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--backend", default="asyncio", choices=["asyncio", "trio"])
    parser.add_argument("--read-mode", default="auto", choices=["auto", "get", "push"],
                        help="the readers' EngineConfig.read_mode (get: the control experiment)")
    sys.exit(anyio.run(main, parser.parse_args()))
