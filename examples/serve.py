"""Run the example: prefill server, decode server and the P/D proxy, until Ctrl-C or SIGTERM.

    .venv/bin/python -m examples.serve

Once all three serve, the last line on stdout is ``base_url: http://127.0.0.1:PORT/v1``:
point any OpenAI client there (``openai.OpenAI(base_url=..., api_key="x")``). The proxy
listens on ``--port`` (8000) or, when that is taken, on a free port; the prefill and decode
servers on free ports unless told otherwise. The decode server also answers directly (it
then calls the prefill server itself).
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from . import launch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8000, help="the proxy's port (a free one if taken)")
    parser.add_argument("--prefill-port", type=int, default=0, help="0 picks a free one")
    parser.add_argument("--decode-port", type=int, default=0, help="0 picks a free one")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    parser.add_argument("--logs", type=Path, default=None,
                        help="directory for prefill.log, decode.log and proxy.log (default: a new temp dir)")
    args = parser.parse_args(argv)
    logs = args.logs or Path(tempfile.mkdtemp(prefix="aionixl-example-"))

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    dev = ["--device", args.device]
    started: list[launch.ServerProcess] = []
    try:
        # The decode server needs only the prefill server's URL, not a running prefill server:
        # both start at once.
        prefill_port = args.prefill_port or launch.free_port()
        prefill_url = f"http://127.0.0.1:{prefill_port}"
        prefill, decode = launch.start_all([
            ("prefill", ["--port", str(prefill_port), *dev], logs / "prefill.log"),
            ("decode", ["--port", str(args.decode_port), "--prefill-url", prefill_url, *dev],
             logs / "decode.log")])
        started += [prefill, decode]
        proxy = launch.start("proxy", ["--port", str(args.port), "--any-port-if-busy",
                                       "--prefill-url", prefill.url, "--decode-url", decode.url],
                             logs / "proxy.log")
        started.append(proxy)
        print(f"prefill server {prefill.url} (aionixl engine {prefill.info['engine_address']})\n"
              f"decode server  {decode.url} (also answers /v1/completions directly)\n"
              f"proxy          {proxy.url}\n"
              f"logs in {logs}; Ctrl-C stops all three\n"
              f"base_url: {proxy.url}/v1", flush=True)
        while all(server.alive() for server in started):
            time.sleep(0.5)
        for server in started:
            if not server.alive():
                print(f"{server.role} server exited ({server.proc.returncode}):\n{server.log_tail()}",
                      file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for server in reversed(started):
            server.stop()


if __name__ == "__main__":
    raise SystemExit(main())
