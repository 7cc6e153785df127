"""Discovery through a real etcd (``aionixl.EtcdDiscovery``): registration, ``connect_to``
by name, leases (closed and SIGKILLed engines), watches, and etcd failing.

Each test module run starts its own etcd (``/usr/bin/etcd``, Debian's ``etcd-server``) on
free ports with a temporary data dir; the tests that stop and restart etcd start one of
their own. Without an etcd binary the tests skip, saying so.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

import aionixl
from aionixl import EngineRecord, EtcdDiscovery

from .etcd_server import ETCD, TTL, EtcdServer
from .helpers import HERE, free_port, numpy_cache, unique, zero_resources

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not os.access(ETCD, os.X_OK),
                       reason="no etcd binary (install Debian's etcd-server: apt-get install etcd-server)"),
]

@pytest.fixture
def own_etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """An etcd of this test's own, to stop and restart."""
    server = EtcdServer(tmp_path)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def prefix() -> str:
    """A key prefix of one test's own (tests share the module's etcd)."""
    return f"/aionixl-test/{unique('p')}/"


def discovery(server: EtcdServer | str, pfx: str, ttl: float = TTL, **kw: Any) -> EtcdDiscovery:
    url = server if isinstance(server, str) else server.url
    return EtcdDiscovery([url], prefix=pfx, ttl=ttl, **kw)


async def registered(server: EtcdServer, pfx: str) -> dict[str, EngineRecord]:
    """What etcd holds under ``pfx`` now (read by a discovery of its own)."""
    async with discovery(server, pfx) as d:
        return await d.records()


async def wait_until(predicate: Any, timeout: float, step: float = 0.05) -> float:
    """Await ``predicate()`` until it is true; returns the seconds it took."""
    start = time.monotonic()
    with anyio.fail_after(timeout):
        while not await predicate():
            await anyio.sleep(step)
    return time.monotonic() - start


# ---- registering, resolving, connecting -------------------------------------------------------


async def test_register_connect_to_by_name_and_transfer(anyio_backend: Any, etcd: EtcdServer) -> None:
    pfx = prefix()
    src_cache, dst_cache = numpy_cache(16, 4096, 2, seed=11), numpy_cache(16, 4096, 2)
    prefill_name, decode_name = unique("prefill"), unique("decode")
    with anyio.fail_after(60):
        async with aionixl.Engine(prefill_name, src_cache, discovery=discovery(etcd, pfx)) as prefill:
            records = await registered(etcd, pfx)
            assert list(records) == [prefill_name]
            record = records[prefill_name]
            assert record.address == prefill.address
            assert record.num_blocks == 16 and record.bytes_per_block == (4096, 4096)
            assert record.region_count == 2 and record.mem_type == "DRAM" and record.features
            assert prefill.metrics().discovery_registrations == 1
            m = prefill.metrics()
            assert (m.discovery_registered, m.discovery_registrations, m.discovery_keepalive_failures) == (
                True, 1, 0)
            assert prefill.discovery is not None and prefill.discovery.registered
            # An engine without a listener registers nothing, but resolves names.
            async with aionixl.Engine(decode_name, dst_cache, listen=None,
                                      discovery=discovery(etcd, pfx)) as decode:
                assert list(await registered(etcd, pfx)) == [prefill_name]
                peer = await decode.connect_to(prefill_name, timeout=10)
                assert peer.name == prefill_name
                assert await decode.connect_to(prefill_name) is peer  # idempotent, like connect
                result = await decode.transfer_blocks(peer, [0, 1, 2], [5, 9, 15], op="read")
                assert result.blocks == 3
                for src, dst in zip(src_cache, dst_cache, strict=True):
                    assert np.array_equal(dst[[0, 1, 2]], src[[5, 9, 15]])
                    assert not dst[3:].any()
                assert decode.metrics().discovery_registrations == 0
            # A closed engine's key is gone at once (its lease revoked in the close).
            await prefill.aclose()
            assert await registered(etcd, pfx) == {}
            assert zero_resources(prefill)


async def test_an_engine_on_a_wildcard_registers_the_address_it_advertises(anyio_backend: Any,
                                                                            etcd: EtcdServer) -> None:
    pfx, name = prefix(), unique("wild")
    cache = numpy_cache(16, 4096, 2)
    secret = aionixl.EngineConfig(handshake_secret=b"wildcards need a secret")  # (protected mode)
    with anyio.fail_after(60):
        with pytest.raises(aionixl.DiscoveryError, match="wildcard"):  # peers could not use it
            async with aionixl.Engine(name, cache, listen="tcp://0.0.0.0:0", config=secret,
                                      discovery=discovery(etcd, pfx)):
                pass
        assert await registered(etcd, pfx) == {}
        async with aionixl.Engine(name, cache, listen="tcp://0.0.0.0:0", config=secret,
                                  discovery=discovery(etcd, pfx, advertise="127.0.0.1")) as engine, \
                aionixl.Engine(unique("d"), numpy_cache(16, 4096, 2), listen=None, config=secret,
                               discovery=discovery(etcd, pfx)) as other:
            port = (engine.address or "").rsplit(":", 1)[1]
            assert (await registered(etcd, pfx))[name].address == f"tcp://127.0.0.1:{port}"
            assert (await other.connect_to(name, timeout=10)).name == name
    assert zero_resources(engine) and zero_resources(other)


async def test_connect_to_waits_for_a_late_registration(anyio_backend: Any, etcd: EtcdServer) -> None:
    pfx = prefix()
    late = unique("late")
    with anyio.fail_after(60):
        async with aionixl.Engine(unique("decode"), numpy_cache(), listen=None,
                                  discovery=discovery(etcd, pfx)) as decode:
            peers: list[aionixl.Peer] = []

            async def connect() -> None:
                peers.append(await decode.connect_to(late, timeout=20))

            async with anyio.create_task_group() as tg:
                tg.start_soon(connect)
                await anyio.sleep(0.5)
                async with aionixl.Engine(late, numpy_cache(), discovery=discovery(etcd, pfx)):
                    with anyio.fail_after(20):
                        while not peers:
                            await anyio.sleep(0.02)
            assert peers[0].name == late


async def test_connect_to_an_unknown_name_fails_within_its_timeout(anyio_backend: Any,
                                                                   etcd: EtcdServer) -> None:
    pfx = prefix()
    with anyio.fail_after(60):
        async with aionixl.Engine(unique("decode"), numpy_cache(), listen=None,
                                  discovery=discovery(etcd, pfx)) as decode:
            start = time.monotonic()
            with pytest.raises(aionixl.DiscoveryError, match="no engine named 'nobody' registered"):
                await decode.connect_to("nobody", timeout=0.5)
            assert 0.4 <= time.monotonic() - start < 1.5
            with pytest.raises(ValueError, match="own name"):
                await decode.connect_to(decode.name)
        async with aionixl.Engine(unique("plain"), numpy_cache(), listen=None) as plain:
            assert plain.discovery is None
            with pytest.raises(RuntimeError, match="no discovery"):
                await plain.connect_to("nobody")


async def test_a_duplicate_live_name_is_refused(anyio_backend: Any, etcd: EtcdServer) -> None:
    pfx = prefix()
    name = unique("twin")
    with anyio.fail_after(60):
        async with aionixl.Engine(name, numpy_cache(), discovery=discovery(etcd, pfx)) as first:
            second = aionixl.Engine(name, numpy_cache(), discovery=discovery(etcd, pfx))
            with pytest.raises(aionixl.DiscoveryError, match="registered in etcd already") as info:
                async with second:
                    pytest.fail("a second engine of the same name opened")
            assert first.address is not None and first.address in str(info.value)
            assert second.closed and zero_resources(second)
            # The first engine's registration is untouched.
            assert (await registered(etcd, pfx))[name].address == first.address
        # Once it closed, the name is free.
        async with aionixl.Engine(name, numpy_cache(), discovery=discovery(etcd, pfx)) as third:
            assert (await registered(etcd, pfx))[name].address == third.address


# ---- leases: a crashed engine's key lapses -------------------------------------------------------


async def test_a_sigkilled_engines_key_is_gone_within_ttl(anyio_backend: Any,
                                                          etcd: EtcdServer, request: pytest.FixtureRequest,
                                                          ) -> None:
    pfx = prefix()
    name = unique("doomed")
    backend = request.node.callspec.id.split("-")[0]  # asyncio, trio or uvloop: the child's too
    with anyio.fail_after(90):
        async with await anyio.open_process(
                [sys.executable, "-m", "tests.discovery_child", etcd.url, pfx, name, str(TTL), backend],
                cwd=HERE.parent, stderr=subprocess.DEVNULL) as child:
            try:
                assert child.stdout is not None
                line = b""
                with anyio.fail_after(60):
                    async for chunk in child.stdout:
                        line += chunk
                        if b"\n" in line:
                            break
                address = json.loads(line)["address"]
                records = await registered(etcd, pfx)
                assert records[name].address == address
                # Still there after more than one ttl: the child keeps its lease alive.
                await anyio.sleep(TTL * 1.5)
                assert name in await registered(etcd, pfx)
            finally:  # also when a check above failed: leaving the block waits for the child
                child.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await child.wait()

            async def gone() -> bool:
                return name not in await registered(etcd, pfx)

            await wait_until(gone, TTL + 5)
            assert time.monotonic() - killed <= TTL + 1, time.monotonic() - killed


# ---- watching -------------------------------------------------------------------------------------


async def test_watch_sees_joins_and_leaves_and_ends_with_the_engine(anyio_backend: Any,
                                                                   etcd: EtcdServer) -> None:
    pfx = prefix()
    before, joiner = unique("before"), unique("joiner")
    with anyio.fail_after(60):
        async with aionixl.Engine(before, numpy_cache(), discovery=discovery(etcd, pfx)) as early:
            # A short watch_idle: the stream is re-opened (and re-listed) several times.
            watcher = aionixl.Engine(unique("watcher"), numpy_cache(), listen=None,
                                     discovery=discovery(etcd, pfx, watch_idle=0.3))
            async with watcher:
                assert watcher.discovery is not None
                events: list[aionixl.DiscoveryEvent] = []
                ended = anyio.Event()

                async def follow() -> None:
                    assert watcher.discovery is not None
                    async with aclosing(watcher.discovery.watch()) as stream:
                        async for event in stream:
                            events.append(event)
                    ended.set()

                async def seen(n: int) -> bool:
                    return len(events) >= n

                async with anyio.create_task_group() as tg:
                    tg.start_soon(follow)
                    await wait_until(lambda: seen(1), 10)  # the engine registered before
                    assert events[0] == aionixl.DiscoveryEvent(before, "join", events[0].record)
                    assert events[0].record is not None and events[0].record.address == early.address
                    await anyio.sleep(1.0)
                    assert watcher.discovery.watch_reconnects >= 2 and len(events) == 1, events
                    async with aionixl.Engine(joiner, numpy_cache(), discovery=discovery(etcd, pfx)) as eng:
                        await wait_until(lambda: seen(2), 10)
                        assert events[1].name == joiner and events[1].kind == "join"
                        assert events[1].record is not None and events[1].record.address == eng.address
                    await wait_until(lambda: seen(3), 10)
                    assert events[2] == aionixl.DiscoveryEvent(joiner, "leave", None)
                    # The caller leaves a second watch: it ends at once.
                    async with aclosing(watcher.discovery.watch(existing=True)) as stream:
                        async for event in stream:
                            assert event.name == before
                            break
                    # A caller that just breaks out (the generator is finalized when dropped).
                    async for event in watcher.discovery.watch():
                        assert event.name == before
                        break
                    await wait_until(lambda: _watching(watcher, 1), 5)  # its task ended
                    async with watcher.discovery.watch() as stream:
                        assert (await stream.__anext__()).name == before
                    await wait_until(lambda: _watching(watcher, 1), 5)
                    # The engine closes: the first watch ends.
                    await watcher.aclose()
                    with anyio.fail_after(5):
                        await ended.wait()
                assert len(events) == 3
            assert zero_resources(watcher)


async def _watching(engine: aionixl.Engine, n: int) -> bool:
    return engine.discovery is not None and len(engine.discovery._watch_scopes) == n


async def test_watch_on_a_discovery_of_its_own(anyio_backend: Any, etcd: EtcdServer) -> None:
    pfx = prefix()
    name = unique("solo")
    with anyio.fail_after(30):
        d = discovery(etcd, pfx)
        with pytest.raises(RuntimeError, match="not open"):
            d.watch()
        async with d:
            events = d.watch(existing=False)
            async with aionixl.Engine(name, numpy_cache(), discovery=discovery(etcd, pfx)):
                event = await events.__anext__()
                assert (event.name, event.kind) == (name, "join")
                assert (await d.lookup(name)).name == name
            assert await events.__anext__() == aionixl.DiscoveryEvent(name, "leave")
        # The discovery closed: the watch ended, and a new one is over at once.
        assert [e async for e in events] == []
        assert [e async for e in d.watch()] == []


# ---- etcd failing -----------------------------------------------------------------------------


async def test_etcd_unreachable_at_start_is_a_discovery_error(anyio_backend: Any) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    # A listener that never answers: the request's deadline ends it.
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        mute = f"http://127.0.0.1:{silent.getsockname()[1]}"
        for url, bound in ((nobody, 2.0), (mute, 1.0 + 2.0)):
            engine = aionixl.Engine(unique("lonely"), numpy_cache(),
                                    discovery=discovery(url, prefix(), request_timeout=1.0))
            start = time.monotonic()
            with pytest.raises(aionixl.DiscoveryError, match="etcd unreachable"):
                async with engine:
                    pytest.fail("the engine opened without etcd")
            assert time.monotonic() - start < bound
            assert engine.closed and zero_resources(engine)
            assert engine.discovery is not None and not engine.discovery.registered


@pytest.mark.parametrize("fresh", [True, False], ids=["etcd-lost-its-data", "etcd-kept-its-data"])
async def test_engine_outlives_etcd_and_registers_again(anyio_backend: Any, own_etcd: EtcdServer, fresh: bool,
                                                        caplog: pytest.LogCaptureFixture) -> None:
    pfx = prefix()
    src_cache, dst_cache = numpy_cache(16, 4096, 2, seed=5), numpy_cache(16, 4096, 2)
    prefill_name = unique("prefill")
    caplog.set_level(logging.WARNING, logger="aionixl")
    with anyio.fail_after(90):
        async with (
            aionixl.Engine(prefill_name, src_cache, discovery=discovery(own_etcd, pfx)) as prefill,
            aionixl.Engine(unique("decode"), dst_cache, listen=None,
                           discovery=discovery(own_etcd, pfx)) as decode,
        ):
            peer = await decode.connect_to(prefill_name)
            own_etcd.stop()

            async def failed_twice() -> bool:
                return prefill.metrics().discovery_keepalive_failures >= 2

            await wait_until(failed_twice, 20)
            # The engines keep serving each other meanwhile.
            for block in range(4):
                await decode.transfer_blocks(peer, [block], [15 - block])
                for src, dst in zip(src_cache, dst_cache, strict=True):
                    assert np.array_equal(dst[block], src[15 - block])
            with pytest.raises(aionixl.DiscoveryError):
                await decode.connect_to(prefill_name, timeout=0.5)
            assert any("keep-alive failed" in r.getMessage() for r in caplog.records)
            await anyio.to_thread.run_sync(lambda: own_etcd.start(fresh=fresh))

            async def back() -> bool:
                return prefill_name in await registered(own_etcd, pfx)

            await wait_until(back, 15)
            await wait_until(lambda: _stays_registered(prefill), 10)
            # A lost lease means a new one; a kept one is simply kept alive again.
            assert prefill.metrics().discovery_registrations == (2 if fresh else 1)
            m = prefill.metrics()  # the same figures for a Prometheus scrape
            assert m.discovery_registered and m.discovery_registrations == (2 if fresh else 1)
            assert m.discovery_keepalive_failures == prefill.metrics().discovery_keepalive_failures >= 2
            record = (await registered(own_etcd, pfx))[prefill_name]
            assert record.address == prefill.address
            assert await decode.connect_to(prefill_name) is peer
            await decode.transfer_blocks(peer, [5], [6])
            assert all(np.array_equal(dst[5], src[6]) for src, dst in zip(src_cache, dst_cache, strict=True))
        assert zero_resources(prefill) and zero_resources(decode)


async def _stays_registered(engine: aionixl.Engine) -> bool:
    return engine.discovery is not None and engine.discovery.registered


# ---- the record, the arguments, the extra ------------------------------------------------------------


def test_record_round_trip_and_bad_records() -> None:
    record = EngineRecord("a", "tcp://h:1", 8, (64, 128), "VRAM", ("push",))
    assert EngineRecord.from_json(record.to_json()) == record
    for bad in (b"", b"[]", b'{"name": "a"}', b"\xff"):
        with pytest.raises(ValueError, match="not an aionixl engine record"):
            EngineRecord.from_json(bad)


def test_arguments_are_checked() -> None:
    for endpoints in ([], "http://127.0.0.1:2379", ["127.0.0.1:2379"]):
        with pytest.raises(ValueError, match="endpoints"):
            EtcdDiscovery(endpoints)
    with pytest.raises(ValueError, match="ttl"):
        EtcdDiscovery(["http://127.0.0.1:2379"], ttl=0)
    assert EtcdDiscovery(["http://127.0.0.1:2379"], ttl=2.5).ttl == 3
    for bad in ("", " ", "10.0.0.1 x", 5):
        with pytest.raises(ValueError, match="advertise"):
            EtcdDiscovery(["http://127.0.0.1:2379"], advertise=bad)  # type: ignore[arg-type]
    d = EtcdDiscovery(["http://127.0.0.1:2379"], advertise="10.0.0.5")
    assert d.advertised("tcp://0.0.0.0:5555") == "tcp://10.0.0.5:5555"
    assert EtcdDiscovery(["http://127.0.0.1:2379"], advertise="tcp://h:1").advertised("tcp://0.0.0.0:2") == "tcp://h:1"
    assert EtcdDiscovery(["http://127.0.0.1:2379"]).advertised("tcp://10.1.1.1:7") == "tcp://10.1.1.1:7"
    with pytest.raises(TypeError, match="discovery"):
        aionixl.Engine("x", numpy_cache(), discovery="http://127.0.0.1:2379")  # type: ignore[arg-type]


def test_aionixl_imports_without_httpx_and_names_the_extra() -> None:
    code = ("import sys; sys.modules['httpx'] = None; import aionixl\n"
            "try:\n    aionixl.EtcdDiscovery(['http://127.0.0.1:2379'])\n"
            "except ImportError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert "aionixl[etcd]" in out.stdout, out
