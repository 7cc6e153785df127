"""The soak worker (``aionixl._soak._worker``) and its report (``aionixl._soak._report``):
real engines in this process, found through a real etcd, reading and writing random blocks
with random deadlines; and the checks that must flag what goes wrong: an untyped error, an
error past its deadline + 1 s, bytes that land after an error, an operation during which
this process was stopped (not judged on time), a torn last line of a killed incarnation."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import aionixl
from aionixl import EtcdDiscovery, TransferTimeoutError
from aionixl._soak import _worker, plot, read_events, summarize
from aionixl._soak._worker import (
    Events,
    PauseClock,
    Quarantine,
    Truth,
    Worker,
    WorkerSpec,
    byte_views,
    fill_canary,
    record,
)
from aionixl.testing import assert_no_resources, make_caches

from .etcd_server import ETCD, TTL, EtcdServer
from .helpers import unique

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(not os.access(ETCD, os.X_OK),
                       reason="no etcd binary (install Debian's etcd-server: apt-get install etcd-server)"),
]

SHAPE = (4, 8, 16)  # 1 KiB per block per region in float16
DTYPES = ("float16", "bfloat16")
SOURCE, SLOT = 8, 4


def specs(names: list[str], tmp: Path, **kw: Any) -> list[WorkerSpec]:
    n = len(names)
    base: dict[str, Any] = {
        "names": names, "seeds": [100 + i for i in range(n)], "num_blocks": SOURCE + n * SLOT + 24,
        "block_shape": list(SHAPE), "dtypes": list(DTYPES), "source_blocks": SOURCE, "slot_blocks": SLOT,
        "rate": 25.0, "concurrency": 2, "deadline_min": 0.5, "deadline_max": 2.0, "max_blocks": 4,
        "quarantine_s": 0.3, "rng_seed": 7}
    base.update(kw)
    return [WorkerSpec(index=i, events_path=str(tmp / f"events-{i}.jsonl"), **base) for i in range(n)]


@asynccontextmanager
async def fleet(etcd: EtcdServer, spec_list: list[WorkerSpec]) -> AsyncIterator[list[aionixl.Engine]]:
    """One engine per spec, each over make_caches(its seed) and registered in etcd; all
    closed (with zero NIXL resources left) on the way out."""
    pfx = f"/aionixl-soak/{unique('p')}/"
    engines: list[aionixl.Engine] = []
    async with AsyncExitStack() as stack:
        for spec in spec_list:
            caches = make_caches(spec.seeds[spec.index], spec.num_blocks, spec.block_shape, spec.dtypes)
            engine = aionixl.Engine(spec.names[spec.index], caches,
                                    discovery=EtcdDiscovery([etcd.url], prefix=pfx, ttl=TTL))
            engines.append(await stack.enter_async_context(engine))
        yield engines
    for engine in engines:
        assert_no_resources(engine)


# ---- the worker on a fleet of three ------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_three_engines_read_write_and_verify_with_no_violation(anyio_backend: Any, etcd: EtcdServer,
                                                                      tmp_path: Path) -> None:
    names = [unique(f"soak{i}") for i in range(3)]
    spec_list = specs(names, tmp_path)
    started = time.time()
    with anyio.fail_after(40):
        async with fleet(etcd, spec_list) as engines, anyio.create_task_group() as tg:
            for engine, spec in zip(engines, spec_list, strict=True):
                tg.start_soon(_worker.main, engine, spec.encode())
            await anyio.sleep(3.5)
            tg.cancel_scope.cancel()
    files = [spec.events_path for spec in spec_list]
    summary = summarize(files, [], [], time.time() - started)
    assert summary["violations"] == 0, summary["violation_details"]
    assert summary["engines"] == 3 and summary["incarnations"] == 3 and summary["partial_lines"] == 0
    assert summary["transfers"] >= 60, summary
    assert summary["transfers_ok"] == summary["transfers"], summary["errors_by_type"]
    assert summary["connects"] >= 6 and summary["connects_ok"] == summary["connects"]
    assert summary["bytes_verified"] > 0
    ops: dict[str, int] = {}
    for path in files:
        mine: dict[str, int] = {}
        lines = [json.loads(line) for line in Path(path).read_text().splitlines()]
        assert lines[0]["event"] == "start" and lines[0]["pid"] == os.getpid()
        assert lines[-1]["event"] == "end" and lines[-1]["violations"] == 0
        for rec in lines:
            if "op" not in rec:
                continue
            assert list(rec) == list(_worker.RECORD_KEYS)
            ops[rec["op"]] = ops.get(rec["op"], 0) + 1
            mine[rec["op"]] = mine.get(rec["op"], 0) + 1
            if rec["op"] in ("read", "readback"):
                assert rec["ok"] and rec["verified_bytes"] == rec["bytes"] == rec["blocks"] * 2048 > 0
                assert rec["elapsed"] <= rec["deadline"] + 1
        # Every write is read back, but for those whose readback the fleet's cancellation
        # cut short: at most one per peer (one write per peer at a time).
        assert 0 <= mine.get("write", 0) - mine.get("readback", 0) <= len(spec_list) - 1, mine
    assert ops.get("read", 0) > 10 and ops.get("write", 0) > 3 and ops.get("readback", 0) > 3
    assert sum(b["ok"] for b in summary["timeline"]) == summary["transfers_ok"]


# ---- the checks flag what goes wrong ---------------------------------------------------------------


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_an_untyped_error_a_late_error_and_late_bytes_are_violations_a_pause_is_not(
        anyio_backend: Any, etcd: EtcdServer, tmp_path: Path) -> None:
    """The engine's transfer_blocks is wrapped: its first reads raise a RuntimeError, fail
    1.3 s past their deadline, fail after this process "stopped" 1.7 s (a blocking sleep), and
    fail while bytes land 0.1 s later; every later call is real."""
    names = [unique("faulty"), unique("server")]
    spec_list = specs(names, tmp_path, concurrency=1, rate=20.0, deadline_min=0.3, deadline_max=0.5,
                      write_fraction=0.0, quarantine_s=0.5)
    injected: list[str] = []
    with anyio.fail_after(40):
        async with fleet(etcd, spec_list) as (faulty, _server), anyio.create_task_group() as tg:
            worker = Worker(faulty, spec_list[0])
            real = faulty.transfer_blocks

            async def late_bytes(local: list[int]) -> None:
                await anyio.sleep(0.1)
                for view in worker.views:
                    view[local[-1], :3] ^= 0xFF

            async def wrapped(peer: aionixl.Peer, local: list[int], remote: list[int], op: str = "read",
                              notify: bytes | None = None, timeout: float | None = None,
                              **kw: Any) -> aionixl.TransferResult:
                assert timeout is not None
                step = len(injected)
                if op == "read" and step < 4:
                    injected.append(["untyped", "late", "paused", "late bytes"][step])
                    if step == 0:
                        raise RuntimeError("injected: not an AionixlError")
                    if step == 1:
                        await anyio.sleep(timeout + 1.3)
                    elif step == 2:
                        time.sleep(1.7)  # this process does not run: as under SIGSTOP
                    else:
                        tg.start_soon(late_bytes, local)
                    raise TransferTimeoutError(f"injected: {injected[-1]}")
                return await real(peer, local, remote, op, notify, timeout, **kw)

            faulty.transfer_blocks = wrapped  # type: ignore[method-assign]
            tg.start_soon(worker.run)
            while len(injected) < 4 or worker.counts["ok"] < 10:
                await anyio.sleep(0.1)
            await anyio.sleep(0.6)  # the quarantine's check of the late bytes
            tg.cancel_scope.cancel()
    summary = summarize([spec_list[0].events_path], [], [], 5.0)
    assert summary["violations_by_kind"] == {"untyped_error": 1, "late_error": 1, "late_bytes": 1}, \
        summary["violation_details"]
    assert summary["violations"] == 3
    assert summary["self_paused_transfers"] == 1 and summary["pauses"] >= 1
    assert summary["errors_by_type"] == {"RuntimeError": 1, "TransferTimeoutError": 3}
    assert 1.2 < summary["worst_time_to_error_s"] < 2.0  # not the paused one (1.7 s)
    by_kind = {d["kind"]: d for d in summary["violation_details"]}
    assert "injected: not an AionixlError" in by_kind["untyped_error"]["detail"]
    assert "6 bytes had changed" in by_kind["late_bytes"]["detail"]  # 3 bytes in each of 2 regions
    paused = [r for r in read_events(spec_list[0].events_path)["records"] if r["self_paused"]]
    assert len(paused) == 1 and paused[0]["elapsed"] > paused[0]["deadline"] + 1
    assert paused[0]["violation"] is None


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_quarantine_flags_bytes_that_change_after_an_error(anyio_backend: Any) -> None:
    caches = make_caches(3, 12, SHAPE, DTYPES)
    views = byte_views(caches)
    truth = Truth([v.shape[1] for v in views], 4)
    released: list[int] = []
    found: list[dict[str, Any]] = []
    q = Quarantine(views, truth, 0.0, released.extend, found.append)
    q.hold([8, 9], op="read", peer="p", seed=5, expect=[1, 2], deadline=0.1, error="TransferTimeoutError")
    q.hold([10, 11], op="read", peer="p", seed=5, expect=[0, 3], deadline=0.1, error="TransferTimeoutError")
    # Late bytes in block 9 (through the tensor), none in 8; in block 10 the peer's very bytes,
    # in block 11 the first half of its first region's (a chunk that landed in part).
    caches[1][9].view(-1)[5] += 1
    for r, view in enumerate(views):
        view[10] = truth.expected(5, r, 0)
    half = views[0].shape[1] // 2
    views[0][11][:half] = truth.expected(5, 0, 3)[:half]
    q.check_due(anyio.current_time())
    assert sorted(released) == [8, 9, 10, 11] and q.checked == 2 and q.late == 2
    assert [f["violation"] for f in found] == ["late_bytes", "late_bytes"]
    assert found[0]["blocks"] == 1 and 1 <= found[0]["bytes"] <= 2 and "blocks [9]" in found[0]["detail"]
    assert f"{_worker.NOT_THEIRS} [2]" in found[0]["detail"]
    assert f"{_worker.THEIRS} [0, 3]" in found[1]["detail"] and found[1]["blocks"] == 2
    # Nothing changed: nothing flagged.
    q.hold([8], op="read", peer="p", seed=5, expect=[1], deadline=0.1, error="TransferTimeoutError")
    q.check_all(anyio.current_time())
    assert q.checked == 3 and len(found) == 2


def test_a_verification_flags_a_wrong_byte() -> None:
    caches = make_caches(9, 6, SHAPE, DTYPES)
    views = byte_views(caches)
    truth = Truth([v.shape[1] for v in views], 6)
    assert truth.check(views, [0, 1, 5], 9, [0, 1, 5]) == []
    assert truth.check(views, [0], 9, [1]) != []
    views[1][5][100] ^= 1
    assert truth.check(views, [0, 5], 9, [0, 5]) == [(5, 5, 1, 1)]


def test_a_block_that_does_not_verify_is_named_by_what_it_holds() -> None:
    caches = make_caches(9, 6, SHAPE, DTYPES)
    views = byte_views(caches)
    truth = Truth([v.shape[1] for v in views], 4)
    views[0][4] = truth.expected(7, 0, 2)  # another engine's source block 2
    fill_canary(views, [5])
    views[0][5][:3] = 0  # a canary partly overwritten
    assert truth.identify([9, 7], 0, views[0][4]) == "seed 7 block 2"
    assert truth.identify([9, 7], 1, views[1][5]) == "canary"
    assert truth.identify([9, 7], 0, views[0][5]) == f"neither ({views[0].shape[1] - 3} canary bytes)"
    assert truth.identify([9], 0, views[0][4]).startswith("neither")


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_the_pause_clock_marks_operations_overlapping_a_stop(anyio_backend: Any) -> None:
    seen: list[tuple[float, float, float]] = []
    clock = PauseClock(on_pause=lambda *p: seen.append(p))
    async with anyio.create_task_group() as tg:
        tg.start_soon(clock.run)
        await anyio.sleep(0.2)
        before = anyio.current_time()
        await anyio.sleep(0.1)
        start = anyio.current_time()
        clock.tick(start)  # an operation starts
        time.sleep(0.8)  # the event loop does not run: as under SIGSTOP
        # Judged when it returns, before the ticker ran again: the gap counts.
        end = anyio.current_time()
        assert clock.paused_during(start, end)
        await anyio.sleep(0.2)
        after = anyio.current_time()
        tg.cancel_scope.cancel()
    assert len(seen) == 1 and 0.75 < seen[0][1] - seen[0][0] < 1.2 and seen[0][2] < 0.2  # no CPU spent
    assert clock.overlaps(before, after) and clock.overlaps(start, end)
    assert not clock.overlaps(before, start)  # all before the pause
    assert not clock.overlaps(end, after)  # after it
    # An operation that starts right after a pause the ticker has not seen is not in it.
    fake = PauseClock()
    for t in (0.0, 0.05, 0.1, 1.0, 1.05):
        fake.tick(t)
    assert list(fake.pauses) == [(0.1, 1.0)]
    assert fake.overlaps(0.05, 0.2) and not fake.overlaps(1.01, 1.04) and not fake.overlaps(0.0, 0.09)
    fake.tick(2.0)  # an operation starts 0.95 s after the last tick: that gap was a pause
    assert not fake.paused_during(2.0, 2.1) and fake.paused_during(1.9, 2.1)


# ---- the report ------------------------------------------------------------------------------------


def _op(t: float, op: str = "read", ok: bool = True, elapsed: float = 0.01, deadline: float = 1.0,
        error: BaseException | None = None, **kw: Any) -> dict[str, Any]:
    rec = record(op, "peer", 2, 4096, deadline, t, elapsed, None if ok else (error or TransferTimeoutError()),
                 verified=4096 if ok and op != "write" else 0)
    rec.update(kw)
    return rec


def test_the_report_skips_a_torn_last_line_and_counts_incarnations(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = Events(str(path))
    events.open({"event": "start", "index": 4, "name": "e4", "pid": 1, "t": 1000.0})
    events.write(_op(1000.5))
    events.write(_op(1001.5, ok=False, elapsed=1.5, deadline=1.0))
    events.close()
    with open(path, "a") as f:
        f.write('{"t":1002.0,"op":"read","peer":"pe')  # SIGKILLed mid-line
    events = Events(str(path))  # the restarted engine ends that line before its own
    events.open({"event": "start", "index": 4, "name": "e4", "pid": 2, "t": 1003.0})
    events.write(_op(1003.5, op="write"))
    events.write(_op(1003.6, op="readback"))
    events.close()
    with open(path, "a") as f:
        f.write('{"t":1004.0,"op":"write","pee')  # killed again: a torn very last line
    glued = tmp_path / "glued.jsonl"  # an older writer that did not end the torn line
    glued.write_text('{"event":"start","index":5,"name":"e5","pid":3,"t":1000.0}\n{"t":1000.1,"op":"re'
                     '{"event":"start","index":5,"name":"e5","pid":4,"t":1002.0}\n'
                     + json.dumps(_op(1002.5)) + "\n")
    parsed = read_events(path)
    assert (parsed["incarnations"], parsed["partial_lines"], parsed["index"]) == (2, 2, 4)
    assert [r["incarnation"] for r in parsed["records"]] == [1, 1, 2, 2]
    assert read_events(glued)["incarnations"] == 2
    faults = [{"t": 1001.2, "kind": "sigkill", "target": "e4", "duration": 0.0},
              {"t": 1002.2, "kind": "sigstop", "target": "e5", "duration": 1.5}]
    summary = summarize([path, glued], faults, [{"kind": "threads_left", "engine": "e4", "count": 2}], 6.0)
    assert summary["engines"] == 2 and summary["incarnations"] == 4 and summary["partial_lines"] == 3
    assert (summary["transfers"], summary["transfers_ok"]) == (5, 4)
    assert summary["bytes_verified"] == 3 * 4096
    assert summary["errors_by_type"] == {"TransferTimeoutError": 1}
    assert summary["faults_by_kind"] == {"sigkill": 1, "sigstop": 1}
    assert summary["worst_time_to_error_s"] == pytest.approx(0.5)
    assert summary["worst_error_to_deadline_ratio"] == pytest.approx(1.5)
    assert summary["violations"] == 1 and summary["violations_by_kind"] == {"threads_left": 1}
    timeline = summary["timeline"]
    assert len(timeline) == 4 and [b["faults"] for b in timeline] == [0, 1, 1, 0]  # to the last event
    assert [b["ok"] for b in timeline] == [1, 0, 1, 2] and timeline[1]["errors"] == 0
    assert timeline[3]["errors"] == 1  # it failed at 1001.5 + 1.5 s
    plot(summary, tmp_path / "soak.png")
    assert (tmp_path / "soak.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_report_counts_every_violation_record_and_spares_paused_ones(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    events = Events(str(path))
    events.open({"event": "start", "index": 0, "name": "e0", "pid": 1, "t": 50.0})
    events.write(_op(50.1, ok=False, error=ValueError("x"), violation="untyped_error"))
    events.write(_op(50.2, ok=False, elapsed=9.0, deadline=1.0, self_paused=True))  # stopped: not judged
    events.write(_op(50.3, ok=False, elapsed=2.5, deadline=1.0, violation="late_error"))
    events.write(_op(50.4, violation="bad_bytes"))
    events.write(_op(50.5, op="connect", ok=False, elapsed=0.2, deadline=5.0))
    events.write({"event": "end", "t": 55.0, "quarantine_checked": 3})
    events.close()
    summary = summarize([path], [], [{"kind": "engine_died", "engine": "e1"}], 5.0)
    assert summary["violations"] == 4
    assert summary["violations_by_kind"] == {"untyped_error": 1, "late_error": 1, "bad_bytes": 1,
                                             "engine_died": 1}
    assert [d["kind"] for d in summary["violation_details"]] == ["untyped_error", "late_error", "bad_bytes",
                                                                 "engine_died"]
    assert summary["self_paused_transfers"] == 1 and summary["transfers"] == 4
    assert summary["connects"] == 1 and summary["connect_errors_by_type"] == {"TransferTimeoutError": 1}
    assert summary["worst_time_to_error_s"] == pytest.approx(1.5)  # not the paused 8 s
    assert summary["quarantine_checked"] == 3
    json.dumps(summary)  # JSON-ready


@pytest.mark.parametrize("change", [
    {"duration": math.inf}, {"rate": math.nan}, {"deadline_max": math.inf}, {"fault_interval": math.inf},
    {"seed": -5}, {"hosts": 201}], ids=str)
def test_soak_options_that_could_only_fail_later_are_refused_at_once(change: dict[str, Any]) -> None:
    from aionixl._soak._run import SoakOptions

    SoakOptions().check()
    with pytest.raises(ValueError):
        SoakOptions(**change).check()


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGINT"])
async def test_a_sigterm_or_ctrl_c_cancels_the_soak_so_that_its_clean_up_runs(signum: str) -> None:
    """``aionixl soak`` killed with SIGTERM (``timeout``, a service manager) left its network
    namespaces and etcd behind, and Ctrl-C printed a traceback; it now runs under
    _until_signalled, which turns either into a cancellation: the soak's finally blocks
    (hosts, etcd) run, also when the signal comes again meanwhile, and the caller learns
    which signal it was."""
    import signal

    from aionixl._cli import _until_signalled

    cleaned: list[str] = []
    number = int(signal.Signals[signum])

    async def soak_like(name: str) -> str:
        try:
            await anyio.sleep(0.2)
            os.kill(os.getpid(), number)
            await anyio.sleep(30)
            return name
        finally:
            with anyio.CancelScope(shield=True):  # a clean-up that takes a while,
                os.kill(os.getpid(), number)  # and the signal again meanwhile
                await anyio.sleep(0.2)
            cleaned.append(name)

    started = time.monotonic()
    with anyio.fail_after(10):
        assert await _until_signalled(soak_like, "soak") == (None, number)
    assert cleaned == ["soak"] and time.monotonic() - started < 5
    assert await _until_signalled(anyio.sleep, 0) == (None, 0)  # a run that ends returns its result
    assert await _until_signalled(_echo, "done") == ("done", 0)


async def _echo(value: str) -> str:
    await anyio.sleep(0)
    return value


def test_soak_refuses_a_json_path_it_could_not_write_before_it_starts() -> None:
    proc = subprocess.run([sys.executable, "-m", "aionixl", "soak", "--json", "/nonexistent-dir/soak.json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no such directory" in proc.stderr and "Traceback" not in proc.stderr


def test_a_spec_that_cannot_work_is_refused() -> None:
    good = specs(["a", "b"], Path("/tmp"))[0]
    good.check()
    assert WorkerSpec.decode(good.encode()) == good
    with pytest.raises(ValueError, match="destination pool"):
        specs(["a", "b"], Path("/tmp"), num_blocks=SOURCE + 2 * SLOT + 1)[0].check()
    with pytest.raises(ValueError, match="deadline"):
        specs(["a", "b"], Path("/tmp"), deadline_min=2.0, deadline_max=1.0)[0].check()


def test_the_injector_never_signals_an_engine_whose_restart_failed_or_that_is_under_a_fault(
        tmp_path: Path) -> None:
    from aionixl._soak._run import Soak, SoakOptions
    from aionixl.testing import RemoteEngine

    soak = Soak(SoakOptions(hosts=2, engines=2), tmp_path, lambda line: None)
    soak._engines = [RemoteEngine(name, seed=i, num_blocks=2) for i, name in enumerate(soak.names)]
    assert soak._faultable_engines() == [0, 1, 2, 3]
    soak._down.add(1)  # killed, its restart failed: it stays down
    soak._busy.add(soak.names[2])  # paused now
    assert soak._faultable_engines() == [0, 3]
