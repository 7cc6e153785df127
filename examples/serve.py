"""Run both example servers (prefill, then decode pointed at it) until Ctrl-C.

    .venv/bin/python -m examples.serve            # prefill on :8100, decode on :8200
"""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from . import launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill-port", type=int, default=8100)
    parser.add_argument("--decode-port", type=int, default=8200)
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    parser.add_argument("--logs", type=Path, default=Path("/tmp/aionixl-example"),
                        help="directory for prefill.log and decode.log")
    args = parser.parse_args(argv)

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    dev = ["--device", args.device]
    prefill = launch.start("prefill", ["--port", str(args.prefill_port), *dev], args.logs / "prefill.log")
    try:
        decode = launch.start("decode", ["--port", str(args.decode_port), "--prefill-url", prefill.url, *dev],
                              args.logs / "decode.log")
        try:
            print(f"prefill server {prefill.url} (engine {prefill.info['engine_address']})\n"
                  f"decode server  {decode.url}   <- send requests here\n"
                  f"logs in {args.logs}; Ctrl-C stops both", flush=True)
            while prefill.alive() and decode.alive():
                time.sleep(0.5)
            for server in (prefill, decode):
                if not server.alive():
                    print(f"{server.role} server exited ({server.proc.returncode}):\n{server.log_tail()}",
                          file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            return 0
        finally:
            decode.stop()
    finally:
        prefill.stop()


if __name__ == "__main__":
    raise SystemExit(main())
