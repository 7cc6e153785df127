"""Command line: ``aionixl demo`` and ``aionixl bench``."""

from __future__ import annotations

import argparse
import sys

import anyio


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
    if args.command == "_demo-serve":
        anyio.run(_demo.serve, args.layers, args.blocks, args.block_bytes, args.seed)
        return 0
    for name in ("layers", "blocks", "block_bytes", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    code: int = anyio.run(_demo.run, args.layers, args.blocks, args.block_bytes, args.rounds,
                          args.backend, backend=args.backend)
    return code


if __name__ == "__main__":
    sys.exit(main())
