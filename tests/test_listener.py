"""The handshake listener under hostile input (issue #3, peer lifecycle under failure).

The engines under test run in an anyio event loop in a portal thread (asyncio and trio, from
the ``anyio_backend`` fixture); the hostile clients are plain synchronous pyzmq sockets and
raw TCP sockets in the test's own thread, so their blocking calls (always with a timeout)
never stall the engines. After every kind of abuse a real ``connect()`` from a second engine
must still work and move the right bytes in both directions, and the listener must hold no
NIXL state for peers it refused.

Several tests here began as repros of engine bugs found while writing them (impostor
metadata, name reuse, NIXL's partial state after a failed load, deep nesting, unbounded log
lines); their docstrings say what each guards against.
"""

from __future__ import annotations

import logging
import os
import random
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import anyio
import msgspec
import numpy as np
import pytest
import zmq
from anyio.from_thread import BlockingPortal, start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import aionixl
import aionixl.lowlevel
from aionixl import _protocol as proto
from aionixl.testing import RemoteEngine, assert_blocks_equal

from .helpers import numpy_cache, unique, zero_resources
from .recording import record_hello

#: max_handshake_bytes of the engines here: small, so that oversized frames are cheap.
LIMIT = 64 * 1024
#: The listener's zmq MAXMSGSIZE: a bigger frame makes zmq drop the connection, no reply.
OVER = LIMIT + 4096
BLOCKS, BLOCK_BYTES, REGIONS = 16, 512, 2
REPLY_WAIT = 5.0  # seconds a client waits for a reply that must come
BIG = 1 << 30  # decode limit for replies we inspect (a Reject may echo a big request)


# ---- harness ------------------------------------------------------------------------------


class Harness:
    """A listening engine and a good client engine, both driven by one portal's event loop."""

    def __init__(self, portal: BlockingPortal, stack: ExitStack) -> None:
        self.portal = portal
        self._stack = stack
        self.config = aionixl.EngineConfig()
        self.tuning = aionixl.lowlevel.Tuning(max_handshake_bytes=LIMIT)
        self.src = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS, seed=42)
        self.dst = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
        self.engines: list[aionixl.Engine] = []
        self.listener = self.open_engine("lsn", self.src, listen="tcp://127.0.0.1:0")
        self.good = self.open_engine("good", self.dst, listen=None)
        assert self.listener.address is not None
        self.address: str = self.listener.address
        self.rounds = 0

    def open_engine(self, prefix: str, cache: list[np.ndarray], listen: str | None) -> aionixl.Engine:
        config, tuning = self.config, self.tuning
        engine = self.portal.call(lambda: aionixl.Engine(unique(prefix), cache, listen=listen,
                                                         config=config, tuning=tuning))
        self._stack.enter_context(self.portal.wrap_async_context_manager(engine))
        self.engines.append(engine)
        return engine

    def resources(self) -> dict[str, int]:
        return self.portal.call(self.listener.live_resources)

    def assert_no_stray_peers(self, legit: int = 0) -> None:
        """The listener holds NIXL state for exactly ``legit`` real peers, nothing else."""
        res = self.resources()
        peers = self.portal.call(lambda: dict(self.listener.peers))
        assert len(peers) == legit, f"listener admitted peers it should not have: {sorted(peers)}"
        assert res["remote_agents"] == legit, f"stray NIXL remote agents on the listener: {res}"
        # Ours, and two a peer: its blocks' and its staging slots'.
        assert res["dlists"] == 1 + 2 * legit, f"stray descriptor lists on the listener: {res}"
        assert res["transfer_handles"] == 0 and res["in_flight"] == 0, res

    def roundtrip(self, fresh: bool = True, timeout: float = 10.0) -> float:
        """A real handshake from the good engine, then bytes both ways, checked.

        Returns the seconds ``connect()`` took.
        """
        return float(self.portal.call(self._roundtrip, fresh, timeout))

    async def _roundtrip(self, fresh: bool, timeout: float) -> float:
        good, listener = self.good, self.listener
        if fresh:
            for p in list(good.peers.values()):
                await good.disconnect(p)
        self.rounds += 1
        k = self.rounds
        local = [(k + i) % BLOCKS for i in range(3)]
        remote = [(5 * k + 2 * i + 1) % BLOCKS for i in range(3)]
        for r in self.dst:
            r[local] = 0
        start = anyio.current_time()
        peer = await good.connect(self.address, timeout=timeout)
        took = anyio.current_time() - start
        assert peer.connected and peer.name == listener.name
        await good.transfer_blocks(peer, local, remote, op="read", timeout=timeout)
        for s, d in zip(self.src, self.dst, strict=True):
            assert np.array_equal(d[local], s[remote]), "read returned the wrong bytes"
        # The other direction, over the listener's inbound peer.
        inbound = listener.peers[good.name]
        target, source = (k + 7) % BLOCKS, (3 * k) % BLOCKS
        for r in self.dst:
            r[target] = 0
        await listener.transfer_blocks(inbound, [source], [target], op="write", timeout=timeout)
        for s, d in zip(self.src, self.dst, strict=True):
            assert np.array_equal(d[target], s[source]), "write delivered the wrong bytes"
        return took

    def hello(self, **over: Any) -> proto.Hello:
        """A Hello with the right geometry for the listener; override any field."""
        regions = [proto.RegionInfo.of(r) for r in self.good.regions]
        compat = dict(self.config.compat)
        fields: dict[str, Any] = {
            "version": proto.PROTOCOL_VERSION, "name": "phantom", "agent_metadata": b"not nixl metadata",
            "regions": regions, "compat": compat,
            "compat_hash": proto.compat_hash(self.good.regions, compat),
        }
        fields.update(over)
        return proto.Hello(**fields)

    def captured_hello(self, engine: aionixl.Engine) -> proto.Hello:
        """The Hello ``engine`` really sends, recorded by a fake listener (as a sniffer would)."""
        return record_hello(self.portal, engine, BIG)


@pytest.fixture
def harness(anyio_backend_name: str, anyio_backend_options: dict[str, Any]) -> Iterator[Harness]:
    with start_blocking_portal(anyio_backend_name, anyio_backend_options) as portal:
        with ExitStack() as stack:
            h = Harness(portal, stack)
            yield h
        for engine in h.engines:
            assert engine.closed and zero_resources(engine), engine.live_resources()


class RawClient:
    """A hand-driven zmq DEALER: sends whatever it is told, reads only when asked."""

    def __init__(self, address: str, *, rcvhwm: int | None = None, linger: int = 0) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, linger)
        if rcvhwm is not None:
            self.sock.setsockopt(zmq.RCVHWM, rcvhwm)
        self.sock.connect(address)

    def send(self, frames: list[bytes]) -> None:
        self.sock.send_multipart(frames)

    def recv(self, timeout: float) -> list[bytes] | None:
        if self.sock.poll(int(timeout * 1000)):
            frames: list[bytes] = self.sock.recv_multipart()
            return frames
        return None

    def close(self) -> None:
        self.sock.close()


def as_reject(reply: list[bytes] | None) -> proto.Reject:
    assert reply is not None, "the listener did not answer"
    assert len(reply) in (1, 2), f"a reply is one frame (and a tag, with a secret), got {len(reply)}"
    message = proto.decode_reply(reply[0], BIG)
    assert isinstance(message, proto.Reject), f"hostile input was welcomed: {message!r}"
    assert message.version == proto.PROTOCOL_VERSION and message.reason
    return message


def ask(address: str, frames: list[bytes]) -> proto.Reject:
    client = RawClient(address)
    try:
        client.send(frames)
        return as_reject(client.recv(REPLY_WAIT))
    finally:
        client.close()


def pack(obj: object) -> bytes:
    return msgspec.msgpack.encode(obj)


def nested_arrays(depth: int) -> bytes:
    """``{"type": "hello", "version": 1, "x": [[[...]]]}``: depth nested one-element arrays."""
    return b"\x83" + pack("type") + pack("hello") + pack("version") + b"\x01" + pack("x") \
        + b"\x91" * depth + b"\xc0"


def aionixl_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if (r.name == "aionixl" or r.name.startswith("aionixl.")) and r.levelno >= logging.WARNING]


# ---- strategies for arbitrary requests ----------------------------------------------------

_scalars = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
            | st.text(max_size=12) | st.binary(max_size=24))
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3)
                       | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=10)
_HELLO_KEYS = ["type", "version", "name", "agent_metadata", "regions", "compat", "compat_hash"]
_HEADERS = [b"\xdb\xff\xff\xff\xff", b"\xc6\xff\xff\xff\xff", b"\xdd\xff\xff\xff\xff",
            b"\xdf\xff\xff\xff\xff", b"\xda\xff\xff", b"\xc5\xff\xff", b"\xdc\xff\xff"]


def wrong_schema() -> st.SearchStrategy[bytes]:
    """Valid msgpack that is not a valid Hello: hello keys with any values, or anything."""
    docs = st.fixed_dictionaries(
        {}, optional={k: _values | st.sampled_from(["hello", "welcome", "reject", 1, 2, -1])
                      for k in _HELLO_KEYS})
    return (docs | _values).map(pack)


def mutated(base: bytes) -> st.SearchStrategy[bytes]:
    """A valid request, damaged: flipped bytes, truncated, extended, spliced."""
    @st.composite
    def damage(draw: st.DrawFn) -> bytes:
        data = bytearray(base)
        for _ in range(draw(st.integers(1, 3))):
            kind = draw(st.sampled_from(["flip", "truncate", "extend", "splice", "header"]))
            pos = draw(st.integers(0, max(0, len(data) - 1)))
            if kind == "flip" and data:
                data[pos] ^= draw(st.integers(1, 255))
            elif kind == "truncate":
                del data[pos:]
            elif kind == "extend":
                data += draw(st.binary(min_size=1, max_size=64))
            elif kind == "splice":
                data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
            else:
                data[pos:pos] = draw(st.sampled_from(_HEADERS))
        return bytes(data)

    return damage()


def requests(base: bytes) -> st.SearchStrategy[list[bytes]]:
    """Whole multipart requests of every kind a hostile client might send."""
    one_frame = (st.binary(max_size=256) | wrong_schema() | mutated(base)
                 | st.sampled_from(_HEADERS).flatmap(lambda h: st.binary(max_size=32).map(h.__add__))
                 | st.integers(LIMIT - 8, LIMIT + 8).map(lambda n: (base + b"\xa5" * n)[:n])
                 | st.integers(OVER - 4, OVER + 4).map(lambda n: b"\x5a" * n))
    single = one_frame.map(lambda f: [f])
    multi = st.lists(st.binary(max_size=64) | st.just(base), min_size=2, max_size=5)
    return single | single | single | multi | st.just([b""])


# ---- tests --------------------------------------------------------------------------------


def test_arbitrary_requests_get_a_reject_or_are_dropped(harness: Harness) -> None:
    """Property: any request is answered with a Reject (or, above MAXMSGSIZE, dropped by
    zmq), the listener keeps serving, admits nobody, and a real connect works after."""
    base = proto.encode(harness.hello())
    outcomes: Counter[str] = Counter()

    @settings(max_examples=200, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames=requests(base))
    def one_request(frames: list[bytes]) -> None:
        client = RawClient(harness.address)
        try:
            client.send(frames)
            if max(len(f) for f in frames) > OVER:
                outcomes["dropped"] += 1  # zmq closes that connection; nothing to wait for
                return
            outcomes[as_reject(client.recv(REPLY_WAIT)).code] += 1
        finally:
            client.close()

    one_request()
    assert outcomes["bad-request"] > 0, outcomes
    harness.assert_no_stray_peers()
    harness.roundtrip()
    harness.assert_no_stray_peers(legit=1)


def test_each_kind_of_bad_request_gets_the_right_reject(harness: Harness) -> None:
    h, regions = harness, harness.hello().regions
    bigger = [proto.RegionInfo(r.base, r.stride * 2, r.block_bytes * 2, r.num_blocks, r.mem_type,
                               r.device) for r in regions]
    good_hello = proto.encode(h.hello())
    cases: list[tuple[str, list[bytes], str, str | None]] = [
        ("random bytes", [b"\x00\x01 not msgpack \xc1"], "bad-request", None),
        ("one empty frame", [b""], "bad-request", None),
        ("msgpack nil", [b"\xc0"], "bad-request", None),
        ("two frames (a tag, to an engine without a secret)", [good_hello, b"x"], "unauthorized", None),
        ("three frames", [good_hello, b"x", b"y"], "bad-request", None),
        ("three empty frames", [b"", b"", b""], "bad-request", None),
        ("trailing bytes", [good_hello + b"\x00"], "bad-request", None),
        ("truncated hello", [good_hello[: len(good_hello) // 2]], "bad-request", None),
        ("a reply sent as a request", [proto.encode(proto.Reject(1, "internal", "x"))], "bad-request", None),
        ("wrong field types", [pack({"type": "hello", "version": 1, "name": 5, "agent_metadata": "s",
                                     "regions": {}, "compat": [], "compat_hash": None})],
         "bad-request", None),
        ("huge declared string", [b"\x82" + pack("type") + pack("hello") + pack("name")
                                  + b"\xdb\xff\xff\xff\xff" + b"ab"], "bad-request", None),
        ("huge declared array", [b"\x82" + pack("type") + pack("hello") + pack("regions")
                                 + b"\xdd\xff\xff\xff\xff\xc0"], "bad-request", None),
        ("over max_handshake_bytes", [good_hello + b"\x00" * (LIMIT + 1 - len(good_hello))],
         "bad-request", None),
        ("empty name", [proto.encode(h.hello(name=""))], "bad-request", None),
        ("no regions", [proto.encode(h.hello(regions=[]))], "bad-request", None),
        ("empty blocks", [proto.encode(h.hello(regions=[proto.RegionInfo(0, 8, 0, 4, "DRAM", 0)] * 2))],
         "bad-request", None),
        ("future version, new shape", [pack({"type": "hello", "version": 2, "new": [1, 2]})],
         "version", None),
        ("hello v0", [proto.encode(h.hello(version=0))], "version", None),
        ("hello v2**40", [proto.encode(h.hello(version=2**40))], "version", None),
        ("our own name", [proto.encode(h.hello(name=h.listener.name))], "self", None),
        ("region count", [proto.encode(h.hello(regions=[*regions, regions[0]]))], "incompatible",
         "region_count"),
        # Other block sizes pass the geometry check (parts of blocks move between such
        # engines): the fake metadata is what is refused.
        ("block size", [proto.encode(h.hello(regions=bigger))], "internal|bad-request", None),
        ("compat key", [proto.encode(h.hello(compat={"model": "other"}))], "incompatible", "compat[model]"),
        ("compat hash", [proto.encode(h.hello(compat_hash="0" * 32))], "incompatible", "compat_hash"),
        ("not NIXL metadata", [good_hello], "internal|bad-request", None),
    ]
    wrong = []
    for what, frames, code, field in cases:
        reject = ask(h.address, frames)
        if reject.code not in code.split("|") or (field is not None and reject.field != field):
            wrong.append(f"{what}: got {reject.code}/{reject.field} ({reject.reason[:80]})")
    assert not wrong, "\n".join(wrong)
    h.assert_no_stray_peers()
    h.roundtrip()


def test_deeply_nested_message_is_a_bad_request(harness: Harness) -> None:
    """Deeply nested arrays make msgspec raise RecursionError; the decoder must turn that into
    a "bad-request" (not "internal", which the connecting side would retry)."""
    for depth in (1_000, 50_000):
        reject = ask(harness.address, [nested_arrays(depth)])
        assert reject.code == "bad-request", f"depth {depth}: {reject.code}: {reject.reason[:120]}"
    harness.roundtrip()


def test_oversized_frame_is_dropped_and_the_listener_keeps_serving(harness: Harness) -> None:
    client = RawClient(harness.address)
    try:
        client.send([b"\x00" * (OVER + 1)])
        assert client.recv(0.5) is None  # zmq dropped the connection: no reply
        # The same socket reconnects by itself; the next request is answered.
        client.send([b"\xc1"])
        assert as_reject(client.recv(REPLY_WAIT)).code == "bad-request"
    finally:
        client.close()
    # Exactly at MAXMSGSIZE is still read (and refused as too large).
    assert ask(harness.address, [b"\x00" * OVER]).code == "bad-request"
    harness.roundtrip()
    harness.assert_no_stray_peers(legit=1)


def test_clients_that_never_read_do_not_block_a_good_client(harness: Harness) -> None:
    base = proto.encode(harness.hello())
    deaf = [RawClient(harness.address, rcvhwm=1) for _ in range(32)]
    try:
        for client in deaf:
            for i in range(50):
                client.send([base if i % 2 else b"\xc1"])
        took = harness.roundtrip()
        assert took < 5, f"a good connect took {took:.2f} s behind clients that never read"
        # Still serving everybody else, while the deaf clients are connected.
        assert ask(harness.address, [b"\x00"]).code == "bad-request"
        took = harness.roundtrip()
        assert took < 5
    finally:
        for client in deaf:
            client.close()
    harness.assert_no_stray_peers(legit=1)


def test_clients_that_disconnect_right_after_sending(harness: Harness) -> None:
    base = proto.encode(harness.hello())
    for i in range(100):
        # linger so that the request is flushed; the socket is gone before the reply comes.
        client = RawClient(harness.address, linger=200)
        client.send([base if i % 3 == 0 else os.urandom(i % 40)])
        client.close()
    harness.roundtrip()
    assert ask(harness.address, [b"\xc1"]).code == "bad-request"
    harness.assert_no_stray_peers(legit=1)


def test_a_burst_of_1000_one_byte_messages(harness: Harness) -> None:
    client = RawClient(harness.address)
    try:
        rng = random.Random(3)
        for _ in range(1000):
            client.send([bytes([rng.randrange(256)])])
        # A good client connects while the burst is being answered.
        future = harness.portal.start_task_soon(harness._roundtrip, True, 10.0)
        codes: Counter[str] = Counter()
        deadline = time.monotonic() + 30
        while sum(codes.values()) < 1000 and time.monotonic() < deadline:
            codes[as_reject(client.recv(REPLY_WAIT)).code] += 1
        assert sum(codes.values()) == 1000, f"only {sum(codes.values())} replies to 1000 requests"
        assert set(codes) <= {"bad-request", "version"}, codes
        took = future.result(timeout=20)
        assert took < 10
    finally:
        client.close()
    harness.assert_no_stray_peers(legit=1)


def test_raw_tcp_garbage_and_idle_connections(harness: Harness) -> None:
    host, port = harness.address.removeprefix("tcp://").rsplit(":", 1)
    socks: list[socket.socket] = []
    rng = random.Random(5)
    try:
        for i in range(150):
            s = socket.create_connection((host, int(port)), timeout=5)
            socks.append(s)
            if i % 3 == 1:  # not ZMTP at all
                s.sendall(bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200))))
            elif i % 3 == 2:  # the start of a ZMTP greeting, then silence
                s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f\x03")
        took = harness.roundtrip()
        assert took < 5, f"a good connect took {took:.2f} s behind idle/garbage TCP connections"
        assert ask(harness.address, [b"\xc1"]).code == "bad-request"
    finally:
        for s in socks:
            s.close()
    harness.roundtrip()
    harness.assert_no_stray_peers(legit=1)


def test_refused_hellos_leave_no_remote_agents(harness: Harness) -> None:
    """Hellos that reach NIXL (real metadata of other agents, our own metadata, a name that
    does not match the metadata) are refused and leave nothing loaded."""
    h = harness
    third = h.open_engine("third", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None)
    third_hello = h.captured_hello(third)
    own_hello = h.captured_hello(h.listener)  # the listener's own metadata, as a Welcome shows it
    hostile = [
        h.hello(name="impostor", agent_metadata=third_hello.agent_metadata),
        h.hello(name="mirror", agent_metadata=own_hello.agent_metadata),
        h.hello(name=h.listener.name, agent_metadata=third_hello.agent_metadata),
        h.hello(name="truncated", agent_metadata=third_hello.agent_metadata[:100]),
        h.hello(name=third.name, agent_metadata=b"nixlSerDes|" + os.urandom(64)),
    ]
    for message in hostile:
        ask(h.address, [proto.encode(message)])
    h.assert_no_stray_peers()
    h.roundtrip()
    h.assert_no_stray_peers(legit=1)


def test_a_hello_announcing_a_billion_blocks_is_refused_before_anything_is_allocated(
        harness: Harness) -> None:
    """The listener would prepare a descriptor per region and block: 2 x 10**9 (tens of GiB).
    Refused as incompatible, naming the field, with the listener's RSS as it was; so is a
    hello announcing as many staging slots."""
    h = harness
    real = h.captured_hello(h.open_engine("big", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None))
    huge = [msgspec.structs.replace(r, num_blocks=10**9) for r in real.regions]
    before = rss_bytes()
    reject = ask(h.address, [proto.encode(msgspec.structs.replace(real, regions=huge))])
    assert (reject.code, reject.field) == ("incompatible", "num_blocks"), reject
    assert "Tuning.max_peer_descriptors" in reject.reason
    slots = [msgspec.structs.replace(r, num_blocks=10**9) for r in real.staging]
    reject = ask(h.address, [proto.encode(msgspec.structs.replace(real, staging=slots))])
    assert (reject.code, reject.field) == ("incompatible", "staging"), reject
    assert rss_bytes() - before < 64 << 20
    h.assert_no_stray_peers()
    h.roundtrip()


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_impostor_hello_does_not_break_a_connected_peer(harness: Harness) -> None:
    """A Hello under a new name carrying a connected peer's real NIXL metadata: loading it
    would replace that peer's NIXL state (and removing it would disconnect the peer), so the
    agent name inside the metadata is checked against the claimed one before NIXL sees it."""
    h = harness
    h.roundtrip()
    good_hello = h.captured_hello(h.good)
    ask(h.address, [proto.encode(h.hello(name="impostor", agent_metadata=good_hello.agent_metadata))])
    h.assert_no_stray_peers(legit=1)
    h.roundtrip(fresh=False)


@pytest.mark.parametrize("metadata", ["garbage", "another agent's"])
def test_hello_reusing_a_peer_name_does_not_evict_it(harness: Harness, metadata: str) -> None:
    """A Hello with a connected peer's name but metadata that is not NIXL's (or names another
    agent) is refused before the live peer is dropped as an old incarnation. (Metadata that
    does name that agent replaces it: that is how a restarted peer comes back; only
    ``handshake_secret`` tells a restart from an impostor.)"""
    h = harness
    h.roundtrip()
    if metadata == "garbage":
        md = b"definitely not NIXL metadata"
    else:
        md = h.captured_hello(h.open_engine("third", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS),
                                            listen=None)).agent_metadata
    ask(h.address, [proto.encode(h.hello(name=h.good.name, agent_metadata=md))])
    h.assert_no_stray_peers(legit=1)
    h.roundtrip(fresh=False)


def test_corrupt_metadata_under_a_peers_name_does_not_lock_it_out(harness: Harness) -> None:
    """A Hello carrying a peer's real metadata with one byte changed (the low byte of the UCX
    connection-info length, 5 bytes after "UCX|c", set to 0xff) fails to load with
    NIXL_ERR_MISMATCH and leaves that agent half-registered inside NIXL, which refused every
    later real handshake from that peer (NIXL_ERR_NOT_ALLOWED). The engine now clears what a
    failed load left behind."""
    h = harness
    md = bytearray(h.captured_hello(h.good).agent_metadata)
    at = md.find(b"UCX|c")
    assert at >= 0, "NIXL's metadata format changed; update this repro"
    md[at + 5] = 0xFF
    ask(h.address, [proto.encode(h.hello(name="mangled", agent_metadata=bytes(md)))])
    h.assert_no_stray_peers()
    h.roundtrip()
    h.assert_no_stray_peers(legit=1)


def test_rejection_warnings_are_rate_limited(harness: Harness, caplog: pytest.LogCaptureFixture) -> None:
    """The rate limiting of listener warnings (issue #3): 500 bad requests of four kinds must
    produce at most 20 WARNING records from "aionixl" (and at least one: refusals are not
    silent). Fails on the code before the rate limiting (one warning per request)."""
    caplog.set_level(logging.DEBUG, logger="aionixl")
    h = harness
    kinds: list[Callable[[int], bytes]] = [
        lambda i: bytes([i % 256]),
        lambda i: proto.encode(h.hello(compat={"model": f"m{i}"})),
        lambda i: proto.encode(h.hello(name=f"p{i}")),
        lambda i: proto.encode(h.hello(version=100 + i)),
    ]
    client = RawClient(h.address)
    try:
        for i in range(500):
            client.send([kinds[i % len(kinds)](i)])
        for _ in range(500):
            as_reject(client.recv(REPLY_WAIT))
    finally:
        client.close()
    h.roundtrip()
    records = aionixl_warnings(caplog)
    assert 1 <= len(records) <= 20, f"{len(records)} warnings for 500 bad requests"


def test_rejection_log_lines_are_bounded_in_size(harness: Harness,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Peer-supplied text (compat values, names) is clipped in log lines and replies: one
    20 KB request must not write a 20 KB log line."""
    caplog.set_level(logging.DEBUG, logger="aionixl")
    h = harness
    third = h.captured_hello(h.open_engine("third", numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS), listen=None))
    ask(h.address, [proto.encode(h.hello(compat={"model": "v" * 20_000}))])
    ask(h.address, [proto.encode(h.hello(name="n" * 20_000, agent_metadata=third.agent_metadata))])
    h.roundtrip()
    sizes = [len(r.getMessage()) for r in aionixl_warnings(caplog)]
    assert sizes, "the refusals were not logged at all"
    assert max(sizes) <= 4096, f"log lines of {sizes} characters"


SECRET = b"0123456789abcdef-shared-secret"


@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the listener is a child; one loop is enough
def test_crafted_nixl_metadata_is_refused_before_nixl_with_a_secret(
        harness: Harness) -> None:
    """NIXL/UCX limit, reachable from any listener: a real Hello with ONE byte changed (the
    first byte of the UCX worker address blob, the 14th byte after "UCX|c", set to 0xff)
    trips a UCX assertion inside add_remote_agent and abort()s the whole process (seen with
    NIXL 1.5.1). Nothing short of UCX can validate that blob, so on untrusted networks the
    engines share EngineConfig.handshake_secret: unsigned or wrongly signed hellos are
    refused ("unauthorized") before NIXL sees them. The listener runs in a child process here
    so that the test would see it die."""
    child = RemoteEngine(seed=1234, num_blocks=BLOCKS, block_shape=(BLOCK_BYTES,),
                         dtypes=("uint8",) * REGIONS, config=aionixl.EngineConfig(handshake_secret=SECRET))
    harness.portal.call(child.start)
    try:
        _refuse_crafted_metadata(harness, child)
    finally:
        assert harness.portal.call(child.aclose) is None  # it had not died


def _refuse_crafted_metadata(harness: Harness, child: RemoteEngine) -> None:
    real = harness.captured_hello(harness.good)
    md = bytearray(real.agent_metadata)
    at = md.find(b"UCX|c")
    assert at >= 0, "NIXL's metadata format changed; update this repro"
    md[at + 13] = 0xFF
    crafted = proto.encode(proto.Hello(real.version, real.name, bytes(md), real.regions, real.compat,
                                       real.compat_hash, proto.new_nonce(), time.time()))
    for attempt in ([crafted], proto.seal(crafted, b"not-the-secret-but-16-bytes")):
        client = RawClient(child.address)
        try:
            client.send(attempt)
            reply = client.recv(REPLY_WAIT)
        finally:
            client.close()
        assert child.running, f"the listener died (exit status {child.returncode})"
        assert as_reject(reply).code == "unauthorized"

    async def read_from_child() -> None:
        config = aionixl.EngineConfig(handshake_secret=SECRET)
        local = numpy_cache(BLOCKS, BLOCK_BYTES, REGIONS)
        async with aionixl.Engine(unique("signed"), local, listen=None, config=config) as eng:
            peer = await eng.connect(child.address, timeout=10)
            await eng.transfer_blocks(peer, [0, 1, 2, 3], [8, 9, 10, 11], timeout=10)
            assert_blocks_equal(local, [0, 1, 2, 3], child.seed, [8, 9, 10, 11], **child.geometry)
        # Without the secret, a real engine is refused too, as a final refusal.
        with pytest.raises(aionixl.HandshakeError, match="unauthorized"):
            await harness.good.connect(child.address, timeout=10)

    harness.portal.call(read_from_child)
    assert child.running
