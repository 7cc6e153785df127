"""Bare NIXL, the ceiling: synchronous loops straight on NIXL's Python API.

One agent with the progress thread off, the same memory as every other contender, reading
from prefill unit 0 (which the benchmark's target process keeps progressed). Sequential:
``make_prepped_xfer`` / ``transfer`` / ``check_xfer_state`` until DONE /
``release_xfer_handle``, one transfer at a time. Batched (the in-flight measures): post N,
then poll all of them until every one is DONE, then release them. Index arrays are built
before the clock starts. One extra row, ``seq_1_raw``, runs the one-block loop on the bound
``nixlAgent`` itself (makeXferReq / postXferReq / getXferStatus / releaseXferReq), without
the wrapper's per-call handle objects: that is what aionixl calls, so it is the true floor.
The head-slice row, ``seq_1_part``, runs the sequential loop on descriptor lists this module
prepares itself at part granularity (one descriptor per region per block part, part ``r`` of
``spec.tp_ratio`` of each block: the descriptors aionixl's part transfers post).
Run by ``aionixl bench``; ``run(ctx)`` returns samples per measure.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from aionixl._bench._memory import WRITE_SALT, block_descriptors, part_descriptors, registration_spans

try:
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError as exc:  # pragma: no cover - reported by the harness
    raise ImportError(f"the bare-NIXL contender needs nixl: {exc}") from exc


class BareNixl:
    def __init__(self, ctx: Any, name: str, memory: Any, ucx_tls: str | None = None) -> None:
        with ctx.ucx_env(ucx_tls):
            self.agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
        self.ctx = ctx
        self.memory = memory
        layout = memory.layout()
        self._block_descriptors = block_descriptors
        self._reg = self.agent.register_memory(registration_spans(layout), layout["mem_type"])
        self.local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descriptors(layout),
                                                layout["mem_type"])
        self.unit = ctx.units[0]
        self.remote_name = ""
        self.remote: Any = None
        #: Part index -> (local list, remote list) at part granularity, prepared on first use.
        self._parts: dict[int, tuple[Any, Any]] = {}
        self._connect()

    def _connect(self) -> None:
        name = self.agent.add_remote_agent(self.unit.metadata)
        self.remote_name = name.decode() if isinstance(name, bytes) else str(name)
        layout = self.ctx.remote_layout
        self.remote = self.agent.prep_xfer_dlist(self.remote_name, self._block_descriptors(layout),
                                                 layout["mem_type"])
        self.agent.make_connection(self.remote_name)

    def _disconnect(self) -> None:
        for local, remote in self._parts.values():
            remote.release()
            local.release()
        self._parts = {}
        self.remote.release()
        self.agent.remove_remote_agent(self.remote_name)

    def reconnect_seconds(self) -> float:
        """Disconnect, then time add_remote_agent + prep_xfer_dlist + make_connection
        (the metadata is already in hand: no handshake at all)."""
        self._disconnect()
        t = time.perf_counter()
        self._connect()
        return time.perf_counter() - t

    def part_lists(self, index: int) -> tuple[Any, Any]:
        """(local, remote) descriptor lists of part ``index`` of ``spec.tp_ratio`` equal
        parts of every block, indexed as the whole-block lists are (``r * blocks + b``)."""
        lists = self._parts.get(index)
        if lists is None:
            count = self.ctx.spec.tp_ratio
            layout = self.memory.layout()
            local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", part_descriptors(layout, index, count),
                                               layout["mem_type"])
            remote_layout = self.ctx.remote_layout
            remote = self.agent.prep_xfer_dlist(self.remote_name,
                                                part_descriptors(remote_layout, index, count),
                                                remote_layout["mem_type"])
            lists = self._parts[index] = (local, remote)
        return lists

    def one_part(self, local_idx: np.ndarray, remote_idx: np.ndarray, index: int) -> None:
        self.one(local_idx, remote_idx, lists=self.part_lists(index))

    def seq_parts(self, pairs: list[tuple[np.ndarray, np.ndarray, int]], n: int) -> float:
        """As :meth:`seq`, each transfer moving the part its pair names (on that part's
        lists): mean seconds per transfer."""
        agent = self.agent
        prepared = [(*self.part_lists(index), li, ri) for li, ri, index in pairs]
        k = len(prepared)
        t = time.perf_counter()
        for i in range(n):
            local, remote, li, ri = prepared[i % k]
            handle = agent.make_prepped_xfer("READ", local, li, remote, ri)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"bare NIXL part transfer failed: {state}")
            agent.release_xfer_handle(handle)
        return (time.perf_counter() - t) / n

    def one(self, local_idx: np.ndarray, remote_idx: np.ndarray, op: str = "READ",
            lists: tuple[Any, Any] | None = None) -> None:
        """One transfer, polled to its end: on the whole-block lists, or on ``lists``
        (a part's, :meth:`part_lists`)."""
        agent = self.agent
        local, remote = (self.local, self.remote) if lists is None else lists
        handle = agent.make_prepped_xfer(op, local, local_idx, remote, remote_idx)
        state = agent.transfer(handle)
        while state == "PROC":
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"bare NIXL transfer failed: {state}")
        agent.release_xfer_handle(handle)

    def seq(self, pairs: list[tuple[np.ndarray, np.ndarray]], n: int, op: str = "READ") -> float:
        """Mean seconds per transfer over ``n`` sequential transfers cycling through ``pairs``."""
        agent, local, remote = self.agent, self.local, self.remote
        k = len(pairs)
        t = time.perf_counter()
        for i in range(n):
            li, ri = pairs[i % k]
            handle = agent.make_prepped_xfer(op, local, li, remote, ri)
            state = agent.transfer(handle)
            while state == "PROC":
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"bare NIXL transfer failed: {state}")
            agent.release_xfer_handle(handle)
        return (time.perf_counter() - t) / n

    def latencies(self, pairs: list[tuple[np.ndarray, np.ndarray]], n: int) -> list[float]:
        """Seconds of each of ``n`` sequential transfers, timed one by one."""
        k = len(pairs)
        out = []
        for i in range(n):
            li, ri = pairs[i % k]
            t = time.perf_counter()
            self.one(li, ri)
            out.append(time.perf_counter() - t)
        return out

    def seq_raw(self, pairs: list[tuple[np.ndarray, np.ndarray]], n: int) -> float:
        """As :meth:`seq`, straight on the bound ``nixlAgent`` (no wrapper objects per call):
        the four calls aionixl itself makes per short transfer."""
        from nixl._bindings import NIXL_IN_PROG, NIXL_READ, NIXL_SUCCESS

        raw = self.agent.agent
        local, remote = self.local._handle, self.remote._handle
        k = len(pairs)
        t = time.perf_counter()
        for i in range(n):
            li, ri = pairs[i % k]
            handle = raw.makeXferReq(NIXL_READ, local, li, remote, ri, b"", [], False)
            status = raw.postXferReq(handle, b"")
            while status == NIXL_IN_PROG:
                status = raw.getXferStatus(handle)
            if status != NIXL_SUCCESS:
                raise RuntimeError(f"bare NIXL (raw) transfer failed: {status}")
            raw.releaseXferReq(handle)
        return (time.perf_counter() - t) / n

    def batched(self, pairs: list[tuple[np.ndarray, np.ndarray]]) -> float:
        """Post every transfer, poll them all until DONE, release: mean seconds per transfer."""
        agent, local, remote = self.agent, self.local, self.remote
        t = time.perf_counter()
        handles = []
        pending = []
        for li, ri in pairs:
            handle = agent.make_prepped_xfer("READ", local, li, remote, ri)
            state = agent.transfer(handle)
            handles.append(handle)
            if state == "PROC":
                pending.append(handle)
            elif state != "DONE":
                raise RuntimeError(f"bare NIXL transfer failed: {state}")
        while pending:
            still = []
            for handle in pending:
                state = agent.check_xfer_state(handle)
                if state == "PROC":
                    still.append(handle)
                elif state != "DONE":
                    raise RuntimeError(f"bare NIXL transfer failed: {state}")
            pending = still
        for handle in handles:
            agent.release_xfer_handle(handle)
        return (time.perf_counter() - t) / len(pairs)

    def close(self) -> None:
        self._disconnect()
        self.local.release()
        self.agent.deregister_memory(self._reg)
        self.agent = None


def _indexed(ctx: Any, pairs: list[tuple[Any, Any]]) -> list[tuple[np.ndarray, np.ndarray]]:
    return [(ctx.local_indices(l_ids), ctx.remote_indices(r_ids)) for l_ids, r_ids in pairs]


def _indexed_parts(ctx: Any, pairs: list[tuple[Any, Any, int]]) -> list[tuple[np.ndarray, np.ndarray, int]]:
    return [(ctx.local_indices(l_ids), ctx.remote_indices(r_ids), index) for l_ids, r_ids, index in pairs]


def _verify_parts(ctx: Any, bare: BareNixl) -> int:
    """Zero our cache, read the verify set's block parts (one transfer per part index), and
    check that each part landed in its place and nothing else changed; raises on a mismatch,
    else returns the block ids compared."""
    ctx.clear_for_parts()
    for li, ri, index in _indexed_parts(ctx, ctx.part_verify_calls):
        bare.one_part(li, ri, index)
    if not ctx.check_part_verify():
        raise RuntimeError("bare NIXL: the block parts read are not where they belong (or other "
                           "bytes changed)")
    return int(ctx.verify_blocks)


def _verify(ctx: Any, bare: BareNixl, memory: Any = None) -> int:
    """Read the verify set into cleared blocks of ``memory`` (ours by default) and compare
    its bytes with the prefill pattern; raises on a mismatch, else the block ids compared."""
    ctx.clear_verify_set(memory)
    loc, rem = ctx.verify_set
    bare.one(ctx.local_indices(loc), ctx.remote_indices(rem))
    if not ctx.check_verify_set(memory):
        raise RuntimeError("bare NIXL: the bytes read do not match the prefill pattern")
    return int(ctx.verify_blocks)


def run(ctx: Any) -> dict[str, Any]:
    spec = ctx.spec
    out: dict[str, Any] = {}
    checked = 0  # block ids whose bytes were compared with the prefill pattern
    ctx.spin()
    ctx.progress("bare NIXL: agent, connection")
    bare = BareNixl(ctx, ctx.unique("bare"), ctx.local)
    try:
        bare.one(ctx.local_indices([0]), ctx.remote_indices([0]))  # wire-up
        checked += _verify(ctx, bare)
        for nblocks, count in spec.seq.items():
            pairs = _indexed(ctx, ctx.workload("contiguous", nblocks))
            out[f"seq_{nblocks}"] = ctx.timed_repeats(
                f"bare NIXL: {nblocks}-block reads", lambda p=pairs, n=count: bare.seq(p, n))
        one = _indexed(ctx, ctx.workload("contiguous", 1))
        out["seq_1_raw"] = ctx.timed_repeats(
            "bare NIXL: 1-block reads on the raw bindings", lambda: bare.seq_raw(one, spec.seq[1]))
        checked += _verify_parts(ctx, bare)  # also prepares the part lists
        parts = _indexed_parts(ctx, ctx.part_workload())
        out["seq_1_part"] = ctx.timed_repeats(
            f"bare NIXL: 1-block reads of 1/{spec.tp_ratio} of a block (head slices)",
            lambda: bare.seq_parts(parts, spec.seq[1]))
        checked += _verify_parts(ctx, bare)
        if spec.with_vllm:
            out.update(ctx.latency_rows(ctx.timed_repeats(
                "bare NIXL: one-block reads timed one by one", lambda: bare.latencies(one, spec.lat_count))))
        for nblocks in spec.scattered:
            pairs = _indexed(ctx, ctx.workload("scattered", nblocks))
            count = spec.seq.get(nblocks, 10)
            out[f"scattered_{nblocks}"] = ctx.timed_repeats(
                f"bare NIXL: {nblocks} scattered blocks", lambda p=pairs, n=count: bare.seq(p, n))
        for count in spec.inflight:
            pairs = _indexed(ctx, ctx.one_block_pairs(count))
            out[f"inflight_{count}"] = ctx.timed_repeats(
                f"bare NIXL: {count} in flight (batched loop)", lambda p=pairs: bare.batched(p))
        bulk = _indexed(ctx, ctx.workload("contiguous", spec.bulk_blocks))
        nbytes = spec.bulk_blocks * spec.bytes_per_block_id
        out["bulk"] = [nbytes / s for s in ctx.timed_repeats(
            "bare NIXL: 16 MiB reads", lambda: bare.seq(bulk, spec.bulk_count))]
        checked += _verify(ctx, bare)
        ctx.rest()
        ctx.progress("bare NIXL: reconnects")
        out["connect"] = [bare.reconnect_seconds() for _ in range(spec.connect_count)]
        ctx.spin()
        bare.one(ctx.local_indices([0]), ctx.remote_indices([0]))
        checked += _verify(ctx, bare)
    finally:
        bare.close()
    if ctx.host is not None:
        rows, host_checked = host_device(ctx)
        out.update(rows)
        checked += host_checked
    out["info"] = {"verified_blocks": checked}
    return out


def host_device(ctx: Any) -> tuple[dict[str, list[float]], int]:
    """--device cuda: DRAM here <-> VRAM on the prefill side, 16 MiB at a time. Returns the
    rows and the block ids verified. The writes carry a pattern the prefill side never holds
    on its own (``WRITE_SALT``), read back and checked; then the prefill pattern is written
    back (checked the same way) for the contenders after this one."""
    spec = ctx.spec
    host = ctx.host
    bare = BareNixl(ctx, ctx.unique("bare-host"), host)
    who = "bare NIXL (host<->device)"
    out: dict[str, list[float]] = {}
    try:
        bare.one(ctx.local_indices([0]), ctx.remote_indices([0]))
        checked = _verify(ctx, bare, host)
        nbytes = spec.bulk_blocks * spec.bytes_per_block_id
        indexed = _indexed(ctx, ctx.workload("contiguous", spec.bulk_blocks))
        out["bulk_d2h"] = [nbytes / s for s in ctx.timed_repeats(
            "bare NIXL: 16 MiB device->host reads", lambda: bare.seq(indexed, spec.bulk_count))]
        checked += _verify(ctx, bare, host)
        loc, rem = ctx.write_pair()
        write = _indexed(ctx, [(loc, rem)])

        def read_back(salt: int) -> int:
            host.clear(loc)
            bare.one(*write[0])
            return int(ctx.check_read_back(loc, rem, salt, who))

        host.fill_expected(loc, rem, WRITE_SALT)
        out["bulk_h2d"] = [nbytes / s for s in ctx.timed_repeats(
            "bare NIXL: 16 MiB host->device writes", lambda: bare.seq(write, spec.bulk_count, "WRITE"))]
        checked += read_back(WRITE_SALT)
        host.fill_expected(loc, rem)  # the prefill pattern back, for the contenders after this one
        bare.one(*write[0], op="WRITE")
        checked += read_back(0)
    finally:
        bare.close()
    return out, checked


class Reference:
    """Bare-NIXL loops for aionixl to alternate with, repeat by repeat (paired ratios).

    ``pairs`` maps a measure key to a callable returning one sample (seconds per transfer)
    on exactly the workload the aionixl contender runs for that key.
    """

    def __init__(self, ctx: Any) -> None:
        spec = ctx.spec
        self.bare = BareNixl(ctx, ctx.unique("bare-ref"), ctx.local)
        bare = self.bare
        bare.one(ctx.local_indices([0]), ctx.remote_indices([0]))  # wire-up
        _verify(ctx, bare)
        one = _indexed(ctx, ctx.workload("contiguous", 1))
        in64 = _indexed(ctx, ctx.one_block_pairs(64))
        parts = _indexed_parts(ctx, ctx.part_workload())
        for index in range(spec.tp_ratio):
            bare.part_lists(index)  # prepared before any timing
        n1 = spec.seq[1]
        self.pairs = {
            "seq_1": lambda: bare.seq(one, n1),
            "seq_1_raw": lambda: bare.seq_raw(one, n1),
            "seq_1_part": lambda: bare.seq_parts(parts, n1),
            "inflight_64": lambda: bare.batched(in64),
        }

    def close(self) -> None:
        self.bare.close()


def reference(ctx: Any) -> Reference:
    return Reference(ctx)


# ---- the P/D request workload (aionixl bench --workload pd) -----------------------------


class BarePd:
    """Bare NIXL on the P/D workload: one loop that posts each request when its arrival time
    has come (and its blocks are free) and polls every outstanding one; while nothing is
    outstanding it sleeps until shortly before the next arrival, then spins (the pacer every
    contender shares). The best a hand-written client does."""

    name = "bare"

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.bare = BareNixl(ctx, ctx.unique("bare-pd"), ctx.local)
        self.bare.one(ctx.local_indices([0]), ctx.remote_indices([0]))  # wire-up

    def step(self, rec: Any, reqs: list[Any], concurrency: int | None = None) -> None:
        """One step: open loop at ``rec.rate``, or closed loop (``concurrency`` outstanding)."""
        ctx = self.ctx
        agent, local, remote = self.bare.agent, self.bare.local, self.bare.remote
        spin_s = rec.spec.spin_s
        outstanding: list[tuple[Any, Any, Any, float, float]] = []
        n, i = len(reqs), 0
        limit = concurrency or n
        t0 = rec.start()
        while i < n or outstanding:
            now = time.perf_counter()
            # One post per round, then every outstanding request is polled: a backlog of due
            # requests is not all posted before the first of them is seen done.
            if i < n and len(outstanding) < limit:
                req = reqs[i]
                admitted = rec.admit(req, now, concurrency is not None)
            else:
                admitted = None
            if admitted is not None:
                due, ids = admitted
                called = time.perf_counter()
                handle = agent.make_prepped_xfer("READ", local, ctx.local_indices(ids), remote,
                                                 ctx.remote_indices(req.remote), req.notify)
                state = agent.transfer(handle)
                if state == "ERR":
                    raise RuntimeError(f"bare NIXL: posting request {req.index} failed")
                outstanding.append((handle, req, ids, due, called))
                i += 1
            if outstanding:
                still = []
                for item in outstanding:
                    state = agent.check_xfer_state(item[0])
                    if state == "DONE":
                        rec.done(item[1], item[2], item[3], item[4])
                        agent.release_xfer_handle(item[0])
                    elif state == "PROC":
                        still.append(item)
                    else:
                        raise RuntimeError(f"bare NIXL: request {item[1].index} failed: {state}")
                outstanding = still
                continue
            if i < n:
                wait = rec.due(reqs[i]) - time.perf_counter() - spin_s
                if wait > 0:
                    time.sleep(wait)
        del t0

    def verify(self) -> int:
        return _verify(self.ctx, self.bare)

    def close(self) -> None:
        self.bare.close()
