"""Throw many hostile handshake requests at one engine's listener; check it keeps serving.

    .venv/bin/python tests/stress/fuzz_listener.py                 # 10,000 messages
    .venv/bin/python tests/stress/fuzz_listener.py --messages 50000 --every 500 --seed 3
    .venv/bin/python tests/stress/fuzz_listener.py --nixl-metadata  # also corrupt real NIXL metadata

The listener is an engine in a child process (``tests/netns_peer.py --role prefill``, on
loopback), so that a crash shows up as a dead process rather than killing this script.
Messages of many kinds (random bytes, damaged valid hellos, wrong versions and types, huge
declared lengths, deep nesting, oversized and multi-frame messages, clients that never read
or vanish, raw TCP garbage) go out over plain zmq DEALER sockets; every ``--every`` messages
a good engine in this process disconnects, connects again and reads blocks, checking every
byte. At the end it prints what it sent, the replies by Reject code, the drops, the good
connects and the listener's state, then closes the listener and checks it released all.

Exit status: 0 all well; 1 the listener died or a good connect failed; 2 anything else
unexpected (a request welcomed, a request that should have been answered was not, the
listener's NIXL state does not match its peers, resources left after close).

Not collected by pytest (the file name does not match test_*.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import queue
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from contextlib import ExitStack, suppress
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
import zmq
from anyio.from_thread import BlockingPortal, start_blocking_portal

import aionixl
import aionixl.lowlevel
from aionixl import _protocol as proto
from aionixl._lines import decode_line, write_file
from aionixl.testing import make_caches

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
from recording import record_hello  # noqa: E402  (tests/ is not a package on the script's path)

BLOCKS, BLOCK_BYTES, REGIONS, SEED = 16, 4096, 2, 11
REPLY_WAIT = 5.0
BIG = 1 << 30


def seeded(seed: int) -> list[np.ndarray]:
    """What the listener serves: ``netns_peer.py --seed`` fills its blocks with make_caches."""
    return [t.numpy() for t in make_caches(seed, BLOCKS, (BLOCK_BYTES,), ("uint8",) * REGIONS)]


# ---- the listener, in a child process -----------------------------------------------------


class ListenerProcess:
    def __init__(self, limit: int, backend: str) -> None:
        argv = [sys.executable, str(TESTS / "netns_peer.py"), "--role", "prefill",
                "--name", f"fuzz-listener-{os.getpid()}", "--listen", "tcp://127.0.0.1:0",
                "--seed", str(SEED), "--blocks", str(BLOCKS), "--block-bytes", str(BLOCK_BYTES),
                "--regions", str(REGIONS), "--max-handshake-bytes", str(limit)]
        env = {**os.environ, "NETNS_PEER_BACKEND": backend}
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, text=True, env=env)
        self.messages: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        ready = self.next(60)
        if ready is None or ready.get("event") != "ready":
            raise RuntimeError(f"listener did not start: {ready}")
        self.address: str = ready["address"]
        self.name: str = ready["name"]

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            message = decode_line(line)
            if message is not None:
                self.messages.put(message)
        self.messages.put(None)

    def next(self, timeout: float) -> dict[str, Any] | None:
        try:
            return self.messages.get(timeout=timeout)
        except queue.Empty:
            return None

    def alive(self) -> bool:
        return self.proc.poll() is None

    def call(self, **cmd: Any) -> dict[str, Any] | None:
        if not self.alive():
            return None
        assert self.proc.stdin is not None
        try:
            write_file(self.proc.stdin, cmd)
        except OSError:
            return None
        return self.next(30)

    def stop(self) -> int:
        if self.alive():
            assert self.proc.stdin is not None
            with suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


# ---- the good engine, in this process ------------------------------------------------------


class GoodClient:
    def __init__(self, portal: BlockingPortal, stack: ExitStack, address: str, limit: int) -> None:
        self.portal, self.address = portal, address
        self.cache = [np.zeros((BLOCKS, BLOCK_BYTES), np.uint8) for _ in range(REGIONS)]
        self.expected = seeded(SEED)
        tuning = aionixl.lowlevel.Tuning(max_handshake_bytes=limit)
        self.engine = portal.call(lambda: aionixl.Engine(f"fuzz-good-{os.getpid()}", self.cache,
                                                         listen=None, tuning=tuning))
        stack.enter_context(portal.wrap_async_context_manager(self.engine))
        self.rounds = 0
        self.ok = 0
        self.failures: list[str] = []
        self.connect_seconds: list[float] = []

    def roundtrip(self, listener: ListenerProcess) -> bool:
        """Disconnect, connect, read 3 blocks; then the listener writes one block back to us
        over its inbound peer. Every byte is checked both ways."""
        try:
            took = float(self.portal.call(self._roundtrip))
            k = self.rounds
            source, target = (5 * k) % BLOCKS, (k + 9) % BLOCKS
            for r in self.cache:
                r[target] = 0
            pushed = listener.call(op="push", peer=self.engine.name, local=[source], remote=[target])
            if pushed is None or not pushed.get("ok"):
                raise AssertionError(f"the listener could not write to us: {pushed}")
            for mine, theirs in zip(self.cache, self.expected, strict=True):
                if not np.array_equal(mine[target], theirs[source]):
                    raise AssertionError("the listener wrote the wrong bytes")
        except Exception as exc:
            self.failures.append(f"{type(exc).__name__}: {str(exc)[:160]}")
            return False
        self.connect_seconds.append(took)
        self.ok += 1
        return True

    async def _roundtrip(self) -> float:
        for p in list(self.engine.peers.values()):
            await self.engine.disconnect(p)
        self.rounds += 1
        k = self.rounds
        local = [(k + i) % BLOCKS for i in range(3)]
        remote = [(7 * k + 2 * i + 1) % BLOCKS for i in range(3)]
        for r in self.cache:
            r[local] = 0
        start = time.monotonic()
        peer = await self.engine.connect(self.address, timeout=10)
        took = time.monotonic() - start
        await self.engine.transfer_blocks(peer, local, remote, timeout=10)
        for mine, theirs in zip(self.cache, self.expected, strict=True):
            if not np.array_equal(mine[local], theirs[remote]):
                raise AssertionError("read the wrong bytes")
        return took

    def hello(self, **over: Any) -> proto.Hello:
        regions = [proto.RegionInfo.of(r) for r in self.engine.regions]
        fields: dict[str, Any] = {
            "version": proto.PROTOCOL_VERSION, "name": "phantom", "agent_metadata": b"not nixl",
            "regions": regions, "compat": {}, "compat_hash": proto.compat_hash(self.engine.regions, {}),
        }
        fields.update(over)
        return proto.Hello(**fields)

    def real_metadata(self) -> bytes:
        """Our agent's metadata, as it goes over the wire (recorded by a fake listener)."""
        return record_hello(self.portal, self.engine, BIG).agent_metadata


# ---- message kinds ------------------------------------------------------------------------

HEADERS = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
           b"\xdf\xff\xff\xff\xff", b"\xda\xff\xff", b"\xc5\xff\xff", b"\xdc\xff\xff", b"\xde\xff\xff"]
KEYS = ["type", "version", "name", "agent_metadata", "regions", "compat", "compat_hash"]


class Kinds:
    """Generators: each returns (frames, how), how in {"reply", "drop", "deaf", "vanish", "tcp"}."""

    def __init__(self, rng: random.Random, good: GoodClient, listener_name: str, limit: int,
                 nixl_metadata: bool, without: list[str]) -> None:
        self.rng, self.good, self.limit = rng, good, limit
        self.over = limit + 4096
        self.base = proto.encode(good.hello())
        self.real_md = good.real_metadata()
        self.listener_name = listener_name
        self.table: dict[str, tuple[int, Callable[[], tuple[list[bytes], str]]]] = {
            "random-bytes": (12, self.random_bytes),
            "empty-frame": (2, lambda: ([b""], "reply")),
            "multi-frame": (6, self.multi_frame),
            "flipped-hello": (12, self.flipped),
            "truncated-hello": (6, self.truncated),
            "extended-hello": (5, self.extended),
            "spliced-header": (6, self.spliced_header),
            "wrong-version": (6, self.wrong_version),
            "wrong-types": (8, self.wrong_types),
            "random-msgpack": (6, self.random_msgpack),
            "bad-geometry": (4, self.bad_geometry),
            "own-name": (1, lambda: ([proto.encode(good.hello(name=self.listener_name))], "reply")),
            "deep-nesting": (1, self.nested),
            "near-limit": (2, self.near_limit),
            "oversized": (1, self.oversized),
            "impostor-real-md": (1, self.impostor),
            "peer-name-reuse": (1, self.name_reuse),
            "never-reads": (3, self.deaf),
            "vanishes": (3, self.vanish),
            "raw-tcp": (1, lambda: ([self.rand(self.rng.randrange(1, 300))], "tcp")),
        }
        if nixl_metadata:
            self.table["mutated-nixl-md"] = (6, self.mutated_metadata)
        for kind in without:
            if kind not in self.table:
                raise SystemExit(f"unknown kind {kind!r}; kinds: {', '.join(self.table)}")
            del self.table[kind]
        self.names = list(self.table)
        self.weights = [self.table[n][0] for n in self.names]

    def pick(self) -> tuple[str, list[bytes], str]:
        kind = self.rng.choices(self.names, self.weights)[0]
        frames, how = self.table[kind][1]()
        return kind, frames, how

    def rand(self, n: int) -> bytes:
        return self.rng.randbytes(n)

    def value(self, depth: int = 0) -> Any:
        """A random msgpack-able value (nested a little)."""
        rng = self.rng
        scalars: list[Callable[[], Any]] = [
            lambda: None, lambda: True, lambda: rng.randrange(-(2**63), 2**64),
            lambda: rng.random() * 1e300, lambda: self.rand(rng.randrange(20)).hex(),
            lambda: self.rand(rng.randrange(20)), lambda: rng.choice(["hello", "welcome", "reject", ""]),
        ]
        nested: list[Callable[[], Any]] = [
            lambda: [self.value(depth + 1) for _ in range(rng.randrange(4))],
            lambda: {self.rand(3).hex(): self.value(depth + 1) for _ in range(rng.randrange(3))},
            lambda: {k: self.value(depth + 1) for k in rng.sample(KEYS, rng.randrange(len(KEYS)))},
        ]
        choices = scalars + nested if depth < 3 else scalars
        return rng.choice(choices)()

    def random_bytes(self) -> tuple[list[bytes], str]:
        return [self.rand(self.rng.choice([1, 2, 8, 64, 512, 4096]))], "reply"

    def multi_frame(self) -> tuple[list[bytes], str]:
        frames = [self.rng.choice([b"", self.base, self.rand(self.rng.randrange(64))])
                  for _ in range(self.rng.randrange(2, 7))]
        return frames, "reply"

    def flipped(self) -> tuple[list[bytes], str]:
        data = bytearray(self.base)
        for _ in range(self.rng.randrange(1, 5)):
            data[self.rng.randrange(len(data))] ^= self.rng.randrange(1, 256)
        return [bytes(data)], "reply"

    def truncated(self) -> tuple[list[bytes], str]:
        return [self.base[: self.rng.randrange(len(self.base))]], "reply"

    def extended(self) -> tuple[list[bytes], str]:
        return [self.base + self.rand(self.rng.randrange(1, 200))], "reply"

    def spliced_header(self) -> tuple[list[bytes], str]:
        at = self.rng.randrange(len(self.base))
        return [self.base[:at] + self.rng.choice(HEADERS) + self.base[at:]], "reply"

    def wrong_version(self) -> tuple[list[bytes], str]:
        version = self.rng.choice([0, 2, -1, 99, 2**31, 2**63 - 1, -(2**63)])
        if self.rng.random() < 0.5:
            return [proto.encode(self.good.hello(version=version))], "reply"
        return [msgspec.msgpack.encode({"type": "hello", "version": version, "x": self.value()})], "reply"

    def wrong_types(self) -> tuple[list[bytes], str]:
        doc = msgspec.to_builtins(self.good.hello())
        doc["type"] = "hello"
        doc[self.rng.choice(KEYS[1:])] = self.value()
        return [msgspec.msgpack.encode(doc)], "reply"

    def random_msgpack(self) -> tuple[list[bytes], str]:
        return [msgspec.msgpack.encode(self.value())], "reply"

    def bad_geometry(self) -> tuple[list[bytes], str]:
        regions = [proto.RegionInfo.of(r) for r in self.good.engine.regions]
        r = regions[0]
        choice = self.rng.randrange(4)
        if choice == 0:
            regions = [*regions, r]
        elif choice == 1:
            regions = [proto.RegionInfo(r.base, r.stride * 2, r.block_bytes * 2, r.num_blocks, "DRAM", 0)] * 2
        elif choice == 2:
            regions = [proto.RegionInfo(r.base, 1, r.block_bytes, r.num_blocks, "DRAM", 0)] * 2
        else:
            regions = []
        return [proto.encode(self.good.hello(regions=regions))], "reply"

    def nested(self) -> tuple[list[bytes], str]:
        depth = self.rng.choice([100, 1000, 10_000])
        data = b"\x82" + msgspec.msgpack.encode("version") + b"\x01" + msgspec.msgpack.encode("x")
        return [data + b"\x91" * depth + b"\xc0"], "reply"

    def near_limit(self) -> tuple[list[bytes], str]:
        n = self.rng.choice([self.limit, self.limit + 1, self.over - 1, self.over])
        return [(self.base + b"\x00" * n)[:n]], "reply"

    def oversized(self) -> tuple[list[bytes], str]:
        return [b"\x00" * (self.over + self.rng.choice([1, 1000]))], "drop"

    def impostor(self) -> tuple[list[bytes], str]:
        return [proto.encode(self.good.hello(name=f"impostor-{self.rng.randrange(1000)}",
                                             agent_metadata=self.real_md))], "reply"

    def name_reuse(self) -> tuple[list[bytes], str]:
        return [proto.encode(self.good.hello(name=self.good.engine.name, agent_metadata=b"junk"))], "reply"

    def deaf(self) -> tuple[list[bytes], str]:
        return [self.rng.choice([self.base, self.rand(16)])], "deaf"

    def vanish(self) -> tuple[list[bytes], str]:
        return [self.rng.choice([self.base, self.rand(16)])], "vanish"

    def mutated_metadata(self) -> tuple[list[bytes], str]:
        md = bytearray(self.real_md)
        for _ in range(self.rng.randrange(1, 4)):
            md[self.rng.randrange(len(md))] = self.rng.randrange(256)
        name = f"mut-{self.rng.randrange(10**6)}"
        return [proto.encode(self.good.hello(name=name, agent_metadata=bytes(md)))], "reply"


# ---- the run ------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--every", type=int, default=250, help="a good connect every N messages")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-handshake-bytes", type=int, default=64 * 1024)
    parser.add_argument("--backend", choices=["asyncio", "trio"], default="asyncio")
    parser.add_argument("--without", action="append", default=[], metavar="KIND",
                        help="leave out a kind of message (repeatable), e.g. impostor-real-md")
    parser.add_argument("--nixl-metadata", action="store_true",
                        help="also send real NIXL metadata with random bytes changed (known to crash NIXL)")
    args = parser.parse_args()
    logging.getLogger("nixl").setLevel(logging.WARNING)
    logging.getLogger("aionixl").setLevel(logging.ERROR)
    rng = random.Random(args.seed)
    limit = args.max_handshake_bytes
    started = time.monotonic()
    listener = ListenerProcess(limit, args.backend)
    host, port = listener.address.removeprefix("tcp://").rsplit(":", 1)
    sent: Counter[str] = Counter()
    codes: Counter[str] = Counter()
    by_kind: dict[str, Counter[str]] = {}
    anomalies: list[str] = []
    died_at: int | None = None
    ctx = zmq.Context.instance()
    deaf_pool: list[zmq.Socket[bytes]] = []

    def fresh() -> zmq.Socket[bytes]:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.connect(listener.address)
        return s

    with start_blocking_portal(args.backend) as portal, ExitStack() as stack:
        good = GoodClient(portal, stack, listener.address, limit)
        kinds = Kinds(rng, good, listener.name, limit, args.nixl_metadata, args.without)
        if not good.roundtrip(listener):
            anomalies.append("the first good connect failed")
        main_sock = fresh()
        since: Counter[str] = Counter()  # kinds sent since the last good connect
        for i in range(1, args.messages + 1):
            kind, frames, how = kinds.pick()
            sent[kind] += 1
            since[kind] += 1
            tally = by_kind.setdefault(kind, Counter())
            if how == "reply":
                main_sock.send_multipart(frames)
                if main_sock.poll(int(REPLY_WAIT * 1000)):
                    reply = main_sock.recv_multipart()
                    try:
                        decoded = proto.decode_reply(reply[0], BIG) if len(reply) == 1 else None
                    except proto.ProtocolError:
                        decoded = None
                    if isinstance(decoded, proto.Reject):
                        codes[decoded.code] += 1
                        tally[decoded.code] += 1
                    else:
                        tally["NOT-A-REJECT"] += 1
                        anomalies.append(f"message {i} ({kind}) got {decoded!r:.120}")
                else:
                    tally["no-reply"] += 1
                    if listener.alive():
                        anomalies.append(f"message {i} ({kind}) got no reply within {REPLY_WAIT} s")
                    main_sock.close(0)
                    main_sock = fresh()
            elif how == "drop":
                s = fresh()
                s.send_multipart(frames)
                tally["dropped (no reply)" if not s.poll(50) else "answered"] += 1
                s.close(0)
            elif how == "deaf":
                if len(deaf_pool) < 32:
                    s = fresh()
                    s.setsockopt(zmq.RCVHWM, 1)
                    deaf_pool.append(s)
                with suppress(zmq.Again):
                    rng.choice(deaf_pool).send_multipart(frames, zmq.NOBLOCK)
                tally["sent, never read"] += 1
            elif how == "vanish":
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 100)
                s.connect(listener.address)
                s.send_multipart(frames)
                s.close()
                tally["sent, then gone"] += 1
            else:
                with suppress(OSError), socket.create_connection((host, int(port)), timeout=2) as raw:
                    raw.sendall(frames[0])
                tally["raw bytes, closed"] += 1
            if not listener.alive():
                died_at = i
                break
            if i % args.every == 0:
                if not good.roundtrip(listener):
                    rare = ", ".join(f"{k} x{v}" for k, v in sorted(since.items()) if kinds.table[k][0] <= 3)
                    good.failures[-1] += f" [after message {i}; rare kinds since the last good one: {rare}]"
                since.clear()
        if died_at is None:
            good.roundtrip(listener)
        main_sock.close(0)
        for s in deaf_pool:
            s.close(0)
        state = listener.call(op="state")
        closed = listener.call(op="close") if listener.alive() else None
    status = listener.stop()
    elapsed = time.monotonic() - started

    total = sum(sent.values())
    print(f"fuzz_listener: {total} messages against one listener (seed {args.seed}, "
          f"max_handshake_bytes {limit}, MAXMSGSIZE {limit + 4096}, good engine on {args.backend}, "
          f"nixl-metadata mutation {'ON' if args.nixl_metadata else 'off'})")
    print(f"{'kind':<20} {'sent':>6}  outcomes")
    for kind in sorted(sent, key=lambda k: -sent[k]):
        outcome = ", ".join(f"{k} {v}" for k, v in sorted(by_kind[kind].items(), key=lambda kv: -kv[1]))
        print(f"{kind:<20} {sent[kind]:>6}  {outcome}")
    print("replies by Reject code: " + ", ".join(f"{k} {v}" for k, v in codes.most_common()))
    secs = good.connect_seconds
    timing = (f"; connect median {statistics.median(secs) * 1000:.1f} ms, max {max(secs) * 1000:.1f} ms"
              if secs else "")
    print(f"good connects (connect, read 3 blocks, listener writes 1 back; bytes checked): {good.ok} ok, "
          f"{len(good.failures)} failed{timing}")
    for failure in good.failures[:8]:
        print(f"  failed: {failure}")
    alive_text = "yes" if died_at is None else f"NO: died after message {died_at} (exit status {status})"
    print(f"listener still alive at the end: {alive_text}")
    if state is not None:
        res, peers = state["resources"], state["peers"]
        print(f"listener state: peers {sorted(peers)}; NIXL resources {res}")
        # Ours, and per peer its blocks' and its staging slots' (the good client has both).
        if res["remote_agents"] != len(peers) or res["dlists"] != 1 + 2 * len(peers):
            anomalies.append(f"listener NIXL state does not match its peers: {len(peers)} peer(s), {res}")
    if closed is not None:
        print(f"listener closed in {closed['close_seconds'] * 1000:.1f} ms; "
              f"resources after: {closed['resources']}; exit status {status}")
        if any(closed["resources"].values()):
            anomalies.append(f"resources left after close: {closed['resources']}")
    print(f"elapsed {elapsed:.1f} s ({total / elapsed:.0f} messages/s)")
    for note in anomalies[:20]:
        print(f"ANOMALY: {note}")
    if len(anomalies) > 20:
        print(f"... and {len(anomalies) - 20} more anomalies")
    if died_at is not None or good.failures:
        print("RESULT: FAIL (listener died or a good connect failed)")
        return 1
    if anomalies:
        print("RESULT: the listener survived, with anomalies")
        return 2
    print("RESULT: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
