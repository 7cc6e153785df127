"""Run by tests/test_discovery.py as a child process: an engine registered in etcd that
prints one JSON line once it is registered, then serves until it is killed.

    python -m tests.discovery_child ENDPOINT PREFIX NAME TTL BACKEND
"""

from __future__ import annotations

import json
import sys

import anyio

import aionixl

from .helpers import numpy_cache


async def main(endpoint: str, prefix: str, name: str, ttl: float) -> None:
    discovery = aionixl.EtcdDiscovery([endpoint], prefix=prefix, ttl=ttl)
    async with aionixl.Engine(name, numpy_cache(8, 1024, 2, seed=3), discovery=discovery) as engine:
        print(json.dumps({"address": engine.address, "pid_ready": True}), flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    endpoint, prefix, name, ttl, backend = sys.argv[1:6]
    options = {"use_uvloop": True} if backend == "uvloop" else {}
    anyio.run(main, endpoint, prefix, name, float(ttl), backend="asyncio" if backend == "uvloop" else backend,
              backend_options=options)
