"""Command line: ``aionixl demo``, ``aionixl bench`` and ``aionixl soak``."""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio

_T = TypeVar("_T")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="aionixl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="move KV-cache blocks between two engines in two processes")
    demo.add_argument("--layers", type=int, default=4)
    demo.add_argument("--blocks", type=int, default=64)
    demo.add_argument("--block-bytes", type=int, default=16 * 1024)
    demo.add_argument("--rounds", type=int, default=2000)
    demo.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    bench = sub.add_parser("bench", help="benchmark aionixl against bare NIXL, a threaded-connector "
                           "model and memcpy (two processes on loopback)")
    from ._bench import add_arguments as add_bench_arguments

    add_bench_arguments(bench)
    soak = sub.add_parser("soak", help="chaos soak: engines on network-namespace hosts found through etcd "
                          "move random blocks while engines are killed and stopped, links cut and etcd "
                          "restarted; checks every transfer (root, iproute2 and etcd-server)")
    _add_soak_arguments(soak)
    serve = sub.add_parser("_demo-serve", help=argparse.SUPPRESS)
    for name in ("layers", "blocks", "block_bytes", "seed"):
        serve.add_argument(name, type=int)
    args = parser.parse_args(argv)

    import logging

    from . import _demo

    # NIXL's Python layer logs each agent creation at INFO to stdout; keep the output ours.
    logging.getLogger("nixl").setLevel(logging.WARNING)

    if args.command == "bench":
        from . import _bench

        return _bench.main(args)
    if args.command == "soak":
        return _soak(args)
    if args.command == "_demo-serve":
        anyio.run(_demo.serve, args.layers, args.blocks, args.block_bytes, args.seed)
        return 0
    for name in ("layers", "blocks", "block_bytes", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    code: int = anyio.run(_demo.run, args.layers, args.blocks, args.block_bytes, args.rounds,
                          args.backend, backend=args.backend)
    return code


def _add_soak_arguments(p: argparse.ArgumentParser) -> None:
    from ._soak._run import SoakOptions

    d = SoakOptions()
    p.add_argument("--duration", type=float, default=d.duration, help="seconds of faults (%(default)s)")
    p.add_argument("--hosts", type=int, default=d.hosts, help="network-namespace hosts (%(default)s)")
    p.add_argument("--engines", type=int, default=d.engines, help="engine processes per host (%(default)s)")
    p.add_argument("--json", metavar="PATH", help="write the report here (violations: a top-level integer)")
    p.add_argument("--plot", metavar="PATH", help="write a PNG over time (default: the JSON path with .png)")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the faults and the workload")
    p.add_argument("--rate", type=float, default=d.rate, help="operations per second per engine")
    p.add_argument("--fault-interval", type=float, default=d.fault_interval,
                   help="mean seconds between faults (default %(default)s)")
    p.add_argument("--deadline-min", type=float, default=d.deadline_min)
    p.add_argument("--deadline-max", type=float, default=d.deadline_max)
    p.add_argument("--backend", choices=["asyncio", "trio"], default=d.backend,
                   help="the engines' event loop")
    p.add_argument("--faults", default=",".join(d.faults),
                   help="the fault kinds to inject, comma-separated (default: %(default)s)")
    p.add_argument("--keep-events", action="store_true", help="keep the engines' event files (path printed)")


async def _until_signalled(run: Callable[..., Awaitable[_T]], *args: Any) -> tuple[_T | None, int]:
    """``await run(*args)``; SIGTERM (what ``timeout`` and service managers send) or SIGINT
    (Ctrl-C) cancels it, so that its clean-up runs (the soak's namespaces, etcd) and no
    traceback is printed. The signals stay caught until ``run`` has returned: another one
    during the clean-up cannot cut it short. ``(result, 0)``, or ``(None, the signal)``
    when one cut it short."""
    result: _T | None = None
    got = 0
    run_scope = anyio.CancelScope()
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                nonlocal got
                async for signum in signals:
                    got = got or int(signum)
                    run_scope.cancel()

            tg.start_soon(on_signal)
            with run_scope:
                result = await run(*args)
            tg.cancel_scope.cancel()
    return (None, got) if run_scope.cancelled_caught else (result, 0)


def _soak(args: argparse.Namespace) -> int:
    """Run the soak; 0 without violations, 1 with, 2 when it could not run here."""
    import json

    from ._soak._run import SoakOptions, soak
    from .testing import EtcdError, TwoHostsError

    options = SoakOptions(duration=args.duration, hosts=args.hosts, engines=args.engines, seed=args.seed,
                          rate=args.rate, fault_interval=args.fault_interval, deadline_min=args.deadline_min,
                          deadline_max=args.deadline_max, backend=args.backend,
                          faults=tuple(k.strip() for k in args.faults.split(",") if k.strip()))
    try:
        options.check()
    except ValueError as exc:
        print(f"aionixl soak: {exc}", file=sys.stderr)
        return 2
    for flag in ("json", "plot"):  # found out before the run, not after it
        path = getattr(args, flag)
        if path and not Path(path).resolve().parent.is_dir():
            print(f"aionixl soak: --{flag} {path}: there is no such directory to write it in",
                  file=sys.stderr)
            return 2
    plot = args.plot or (str(Path(args.json).with_suffix(".png")) if args.json else None)
    try:
        summary, signum = anyio.run(_until_signalled, soak, options, args.json, plot, print,
                                    args.keep_events)
    except (TwoHostsError, EtcdError) as exc:
        print(f"aionixl soak: cannot run here: {exc}", file=sys.stderr)
        return 2
    if summary is None:
        print(f"aionixl soak: stopped by {signal.Signals(signum).name}; its hosts and etcd were cleaned up",
              file=sys.stderr)
        return 128 + signum
    brief = {k: summary[k] for k in ("transfers", "transfers_ok", "bytes_verified", "errors_by_type",
                                     "faults_by_kind", "worst_time_to_error_s", "violations",
                                     "violations_by_kind", "engines_closed_clean")}
    print(json.dumps(brief, indent=1))
    return 0 if summary["violations"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
