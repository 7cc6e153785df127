"""An aionixl engine driven by JSON commands: the multi-host tests run it inside a network
namespace, ``stress/fuzz_listener.py`` runs it as the listener under attack.

    python tests/netns_peer.py --role prefill --name N --listen tcp://10.231.1.1:0 --seed 7
    python tests/netns_peer.py --role decode --name M --seed 7

The prefill role serves blocks filled from ``--seed`` (``aionixl.testing.make_caches``);
the decode role starts with zeros and checks every block it reads against that rule.
Both ways, messages are lines of :mod:`aionixl._lines` (a JSON object behind its control
prefix: NIXL and UCX print to stdout too, and a reader skips any other line). Commands come
on stdin; each gets exactly one reply with ``"reply": <op>``; ``stream`` also sends an
``{"event": "streaming"}`` message once it is under way. EOF on stdin closes the engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any

import anyio
import numpy as np

import aionixl
import aionixl.lowlevel
from aionixl._lines import LineReader, write_file
from aionixl.testing import make_caches


def seeded(seed: int, blocks: int, block_bytes: int, regions: int) -> list[np.ndarray]:
    """``aionixl.testing.make_caches`` blocks of ``block_bytes`` bytes, as numpy arrays."""
    return [t.numpy() for t in make_caches(seed, blocks, (block_bytes,), ("uint8",) * regions)]


class Driver:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        shape = (args.seed, args.blocks, args.block_bytes, args.regions)
        self.expected = seeded(*shape)
        if args.role == "prefill":
            self.cache = seeded(*shape)
        else:
            self.cache = [np.zeros((args.blocks, args.block_bytes), np.uint8) for _ in range(args.regions)]
        self.engine: aionixl.Engine | None = None
        self.address: str | None = None
        self.rounds = 0

    # -- helpers

    def peer(self) -> aionixl.Peer:
        assert self.engine is not None
        for p in self.engine.peers.values():
            if p.address == self.address:
                return p
        raise LookupError("not connected")

    def blocks(self, n: int) -> tuple[list[int], list[int]]:
        self.rounds += 1
        total = self.args.blocks
        local = [(self.rounds + i) % total for i in range(n)]
        remote = [(3 * self.rounds + i) % total for i in range(n)]
        return local, remote

    def matches(self, local: list[int], remote: list[int]) -> bool:
        pairs = zip(self.cache, self.expected, strict=True)
        return all(np.array_equal(c[local], e[remote]) for c, e in pairs)

    async def read(self, n: int, timeout: float) -> dict[str, Any]:
        assert self.engine is not None
        local, remote = self.blocks(n)
        for c in self.cache:
            c[local] = 0
        start = time.monotonic()
        try:
            await self.engine.transfer_blocks(self.peer(), local, remote, op="read", timeout=timeout)
        except Exception as exc:
            return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300],
                    "seconds": time.monotonic() - start}
        return {"ok": True, "match": self.matches(local, remote), "seconds": time.monotonic() - start}

    # -- commands

    async def run(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        engine = self.engine
        assert engine is not None
        if op == "connect":
            self.address = cmd["address"]
            start = time.monotonic()
            try:
                peer = await engine.connect(cmd["address"], timeout=cmd.get("timeout", 10.0))
            except Exception as exc:
                return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300],
                        "seconds": time.monotonic() - start}
            return {"ok": True, "peer": peer.name, "read_mode": peer.read_mode,
                    "seconds": time.monotonic() - start}
        if op == "read":
            return await self.read(cmd.get("n", 4), cmd.get("timeout", 10.0))
        if op == "stream":
            count = 0
            while count < cmd.get("max", 100_000):
                result = await self.read(cmd.get("n", 4), cmd["timeout"])
                if not result["ok"] or not result["match"]:
                    return {**result, "count": count}
                count += 1
                if count == cmd.get("ready_after", 3):
                    write_file(sys.stdout, {"event": "streaming"})
            return {"ok": True, "count": count}
        if op == "expect":  # the peer now serves blocks from another seed (it restarted)
            a = self.args
            self.expected = seeded(cmd["seed"], a.blocks, a.block_bytes, a.regions)
            return {"ok": True}
        if op == "push":  # write our blocks into a peer's (an inbound one, say), by peer name
            peer = engine.peers[cmd["peer"]]
            start = time.monotonic()
            try:
                await engine.transfer_blocks(peer, cmd["local"], cmd["remote"], op="write",
                                             timeout=cmd.get("timeout", 10.0))
            except Exception as exc:
                return {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300],
                        "seconds": time.monotonic() - start}
            return {"ok": True, "seconds": time.monotonic() - start}
        if op == "disconnect":
            for p in list(engine.peers.values()):
                await engine.disconnect(p)
            return {"ok": True}
        if op == "fill":  # our blocks all hold one byte value (to catch late writes)
            for c in self.cache:
                c[:] = cmd["value"]
            return {"ok": True}
        if op == "count_not":  # how many bytes differ from that value
            return {"ok": True, "count": int(sum(int(np.count_nonzero(c != cmd["value"]))
                                                for c in self.cache))}
        if op == "state":
            counts = {k: v for k, v in engine.metrics().as_dict().items() if isinstance(v, (int, bool))}
            return {"ok": True, "peers": {n: p.connected for n, p in engine.peers.items()},
                    "resources": engine.live_resources(), "stats": counts}
        if op == "close":
            return await self.close(cmd.get("inflight", 0), cmd.get("inflight_timeout", 60.0))
        raise ValueError(f"unknown op {op!r}")

    async def close(self, inflight: int, inflight_timeout: float) -> dict[str, Any]:
        """Close, optionally with ``inflight`` reads still waiting (they should get EngineClosedError)."""
        engine = self.engine
        assert engine is not None
        outcomes: list[str] = []

        async def stuck_read(i: int) -> None:
            try:
                await engine.transfer_blocks(self.peer(), [i], [i], timeout=inflight_timeout)
                outcomes.append("done")
            except Exception as exc:
                outcomes.append(type(exc).__name__)

        async with anyio.create_task_group() as tg:
            for i in range(inflight):
                tg.start_soon(stuck_read, i)
            with anyio.move_on_after(5):
                while engine.live_resources()["in_flight"] < inflight and len(outcomes) < inflight:
                    await anyio.sleep(0.01)
            in_flight = engine.live_resources()["in_flight"]
            start = time.monotonic()
            await engine.aclose()
            seconds = time.monotonic() - start
        return {"ok": True, "close_seconds": seconds, "in_flight_at_close": in_flight,
                "outcomes": sorted(outcomes), "resources": engine.live_resources()}


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["prefill", "decode"], required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--listen", default=None)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--block-bytes", type=int, default=256 * 1024)
    parser.add_argument("--regions", type=int, default=2)
    parser.add_argument("--max-handshake-bytes", type=int, default=16 * 1024 * 1024)
    parser.add_argument("--secret", default=None, help="the hosts' handshake secret, in hex")
    args = parser.parse_args()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    driver = Driver(args)
    tuning = aionixl.lowlevel.Tuning(idle_poll_interval=0.01, max_handshake_bytes=args.max_handshake_bytes,
                                     push_cancel_timeout=0.5)
    config = aionixl.EngineConfig(handshake_secret=bytes.fromhex(args.secret) if args.secret else None)
    async with aionixl.Engine(args.name, driver.cache, listen=args.listen, config=config,
                              tuning=tuning) as engine:
        driver.engine = engine
        write_file(sys.stdout, {"event": "ready", "name": engine.name, "address": engine.address})
        fd = sys.stdin.fileno()
        reader = LineReader()
        while True:
            await anyio.wait_readable(fd)
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            reader.feed(chunk)
            while (cmd := reader.pop()) is not None:
                try:
                    reply = await driver.run(cmd)
                except Exception as exc:
                    reply = {"ok": False, "error": type(exc).__name__, "message": str(exc)[:300]}
                write_file(sys.stdout, {"reply": cmd["op"], **reply})
                if cmd["op"] == "close":
                    return


if __name__ == "__main__":
    anyio.run(main, backend=os.environ.get("NETNS_PEER_BACKEND", "asyncio"))
