"""A real vLLM NixlConnector decode worker (pull role: READ), for ``aionixl bench --with-vllm``.

Runs under a venv with vLLM (``./run vllm-setup``), as
``python -m aionixl_contenders.vllm_decode``, beside a prefill worker
(:mod:`.vllm_worker`). It builds what a vLLM decode instance would (``VllmSide`` in the
consumer role: a WORKER-role connector that registers the KV cache, and a SCHEDULER-role
connector whose side-channel listener serves this worker's metadata) and then plays vLLM's
engine loop, as the bench asks:

- a read is what vLLM's scheduler hands its workers: ``NixlConnectorMetadata`` with one
  ``reqs_to_recv`` entry built by ``add_new_req_to_recv`` from the prefill's
  ``kv_transfer_params`` (remote engine id, host, port, block ids, request id);
  ``bind_connector_metadata`` + ``start_load_kv`` post it, and ``get_transfer_results``
  (what ``get_finished`` wraps) is called in a loop until it reports the request: no
  forward pass between the calls, so this is the connector's own floor;
- the handshake is vLLM's own: the first read for an unknown engine starts it on the
  connector's handshake thread, and the read is posted by the next ``start_load_kv`` after
  it finished. To handshake again, the engine is dropped the way vLLM's TTL eviction does
  it (``_cleanup_remote_engine``).

Protocol (:mod:`aionixl._lines` messages): ``ready`` on ``--fd``; then one command per
line on stdin, each answered by one message on ``--fd`` (``{"error": ...}`` when it failed):
``connect``, ``reads``, ``verify``, ``idle``, ``close``, ``pd`` for the bench; ``target``, ``post``
and ``heartbeat`` for the tests of an aionixl prefill serving vLLM (``tests_vllm/``). End of stdin
shuts the connectors down and exits. Bytes are checked against the prefill's pattern
(``expected_words``) by the ``verify`` command.
"""

from __future__ import annotations

import argparse
import gc
import os
import resource
import sys
import time
import traceback
from typing import Any

import numpy as np

from aionixl._bench._memory import expected_words
from aionixl._lines import decode_line, write_file

from .vllm_worker import VllmSide, free_port, thread_count


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Decode:
    """The engine loop of a vLLM decode instance, reduced to what its connector sees."""

    def __init__(self, side: VllmSide, listen_port: int) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

        self.side = side
        self._meta_cls = NixlConnectorMetadata
        self.worker = side.worker
        self.listener = side.new_listener(self.worker, listen_port)
        self.remote: dict[str, Any] = {}

    def _inner(self, worker: Any | None = None) -> Any:
        return (worker or self.worker).connector_worker

    # ---- one request, as the scheduler would hand it over ----------------------------------

    def post(self, worker: Any, req: str, local: list[int], remote: list[int], tp_size: int = 1) -> None:
        meta = self._meta_cls()
        params = {"remote_block_ids": (list(remote),), "remote_engine_id": self.remote["engine_id"],
                  "remote_request_id": req, "remote_host": self.remote["host"],
                  "remote_port": self.remote["port"], "tp_size": tp_size}
        meta.add_new_req_to_recv(request_id=f"d-{req}", local_block_ids=(list(local),),
                                 kv_transfer_params=params, awaiting_kvs=True)
        self._step(worker, meta)

    def _step(self, worker: Any, meta: Any | None = None) -> None:
        worker.bind_connector_metadata(meta if meta is not None else self._meta_cls())
        worker.start_load_kv(None)
        worker.clear_connector_metadata()

    def until_done(self, worker: Any, reqs: set[str], limit_s: float = 60.0) -> None:
        """Engine steps (start_load_kv, then get_finished) until every request is reported."""
        want = {f"d-{r}" for r in reqs}
        deadline = time.perf_counter() + limit_s
        while want:
            results = worker.get_transfer_results(set())
            if results.failed_recving & want:
                raise RuntimeError(f"vLLM reported failed reads: {sorted(results.failed_recving)[:4]}")
            want -= results.finished_recving
            if not want:
                return
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{len(want)} vLLM reads did not finish within {limit_s} s")
            self._step(worker)  # posts reads whose handshake has finished meanwhile

    def read(self, req: str, local: list[int], remote: list[int]) -> float:
        t = time.perf_counter()
        self.post(self.worker, req, local, remote)
        self.until_done(self.worker, {req})
        return time.perf_counter() - t

    # ---- commands ----------------------------------------------------------------------

    def handshake(self, worker: Any, req: str) -> float:
        """Seconds from a read to an unknown engine until the connector holds that engine."""
        engine = self.remote["engine_id"]
        inner = self._inner(worker)
        t = time.perf_counter()
        self.post(worker, req, [0], [0])
        while True:
            with inner._handshake_lock:
                if engine in inner._remote_agents:
                    break
                if engine not in inner._handshake_futures:
                    raise RuntimeError("the vLLM handshake failed (the reason is in the vLLM log)")
            if time.perf_counter() - t > 30:
                raise RuntimeError("the vLLM handshake did not finish within 30 s")
            time.sleep(20e-6)  # the handshake runs on the connector's thread
        seconds = time.perf_counter() - t
        self.until_done(worker, {req})
        return seconds

    def forget(self, worker: Any) -> None:
        inner = self._inner(worker)
        engine = self.remote["engine_id"]
        if engine in inner._remote_agents:
            inner._cleanup_remote_engine(engine, log_eviction=False)

    def cmd_connect(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.remote = {"engine_id": cmd["engine_id"], "host": cmd["host"], "port": int(cmd["port"])}
        times = []
        for i, req in enumerate(cmd["reqs"]):
            if i:
                self.forget(self.worker)
            times.append(self.handshake(self.worker, req))
        return {"connect": times, "threads": thread_count()}

    def cmd_target(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Read from this prefill from now on; vLLM handshakes at the first read, as in service."""
        self.remote = {"engine_id": cmd["engine_id"], "host": cmd["host"], "port": int(cmd["port"])}
        return {"target": self.remote}

    def cmd_post(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Post one read, then run engine steps for ``spin_s`` seconds or until it is done
        (what is under way, and progressing, when this process is killed)."""
        self.post(self.worker, cmd["req"], list(cmd["local"]), list(cmd["remote"]), cmd.get("tp_size", 1))
        key, done = f"d-{cmd['req']}", False
        deadline = time.perf_counter() + float(cmd.get("spin_s", 0.0))
        while not done and time.perf_counter() < deadline:
            done = key in self.worker.get_transfer_results(set()).finished_recving
            self._step(self.worker)
        return {"posted": cmd["req"], "done": done}

    def cmd_heartbeat(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One engine step whose scheduler metadata asks for heartbeats of ``reqs`` (vLLM's
        ``"HB:id1,id2"``, sent by the worker to the prefill's agent)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import HeartbeatInfo

        meta = self._meta_cls()
        meta.heartbeat_by_engine[self.remote["engine_id"]] = HeartbeatInfo(
            req_ids=set(cmd["reqs"]), host=self.remote["host"], port=self.remote["port"], tp_size=1)
        self._step(self.worker, meta)
        return {"heartbeat": sorted(cmd["reqs"])}

    def cmd_reads(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Reads one after another, each timed; ``gap_s`` apart if given (a prefill that
        progresses only when polled then shows what its polling costs a reader)."""
        pairs, gap = cmd["pairs"], float(cmd.get("gap_s", 0.0))
        times = []
        for i, req in enumerate(cmd["reqs"]):
            if gap and i:
                time.sleep(gap)
            times.append(self.read(req, *pairs[i % len(pairs)]))
        return {"seconds": times}

    def cmd_pd(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One step of the P/D workload (:class:`aionixl_contenders.vllm_contender.VllmPd`):
        vLLM's engine loop, each step handing the connector every request that has arrived
        (``start_load_kv``), a forward pass of ``step_s``, then ``get_finished``. Latency
        from each request's scheduled arrival to the step that reports it done."""
        from aionixl._bench._pdwork import (
            BlockPool,
            StepResult,
            check_words,
            process_cpu,
            region_words,
            start_lead,
        )

        words = self.side.words
        rw = region_words(words.shape[0], words.shape[2])
        reqs = cmd["reqs"]
        rate, limit = cmd["rate"], cmd["concurrency"] or len(reqs)
        step_s, spin_s, per_block = float(cmd["step_s"]), float(cmd["spin_s"]), int(cmd["bytes_per_block_id"])
        pool = BlockPool(self.side.blocks, int(cmd["seed"]))
        worker = self.worker
        pending: dict[str, tuple[dict[str, Any], Any, Any, float, float]] = {}
        lat: list[float] = []
        to_call: list[float] = []  # arrival -> handed to the connector (the step's start_load_kv)
        nbytes = verified = waited = 0
        n, i = len(reqs), 0
        last = 0.0
        cpu0 = process_cpu()
        t0 = time.perf_counter() + start_lead(rate)
        while i < n or pending:
            now = time.perf_counter()
            meta = self._meta_cls()
            handed: list[tuple[str, tuple[dict[str, Any], Any, Any, float]]] = []
            while i < n and len(pending) + len(handed) < limit:  # what the scheduler hands over this step
                r = reqs[i]
                due = t0 + r["at"] / rate if rate else now
                if due > now:
                    break
                ids = pool.take(len(r["remote"]))
                if ids is None:
                    waited += 1
                    break
                remote = np.asarray(r["remote"], dtype=np.int32)
                words[:, ids[[0, -1]], :] = 0
                params = {"remote_block_ids": (r["remote"],), "remote_engine_id": self.remote["engine_id"],
                          "remote_request_id": r["req"], "remote_host": self.remote["host"],
                          "remote_port": self.remote["port"], "tp_size": 1}
                meta.add_new_req_to_recv(request_id=f"d-{r['req']}", local_block_ids=([int(x) for x in ids],),
                                         kv_transfer_params=params, awaiting_kvs=True)
                handed.append((f"d-{r['req']}", (r, ids, remote, due)))
                i += 1
            called = time.perf_counter()
            for key, item in handed:
                pending[key] = (*item, called)
            self._step(worker, meta)
            if step_s > 0:
                time.sleep(step_s)  # the forward pass
            elif not pending and i < n:
                wait = t0 + reqs[i]["at"] / rate - time.perf_counter() - spin_s if rate else 0.0
                if wait > 0:
                    time.sleep(wait)
            results = worker.get_transfer_results(set())
            if results.failed_recving & set(pending):
                raise RuntimeError(f"vLLM reported failed reads: {sorted(results.failed_recving)[:4]}")
            t = time.perf_counter()
            for key in results.finished_recving:
                if key not in pending:
                    continue
                r, ids, remote, due, called = pending.pop(key)
                lat.append(t - due)
                to_call.append(called - due)
                last = t
                nbytes += len(ids) * per_block
                if not check_words(words, ids[[0, -1]], remote[[0, -1]], rw):
                    raise RuntimeError(f"request {r['req']}: the bytes read do not match the prefill pattern")
                verified += 1
                pool.give(ids)
        return StepResult(latencies=lat, to_call=to_call, nbytes=nbytes, cpu_s=process_cpu() - cpu0,
                          wall_s=max(last - t0, 1e-9), verified=verified, requests=len(lat),
                          waited_for_blocks=waited).as_dict()

    def cmd_verify(self, cmd: dict[str, Any]) -> dict[str, Any]:
        local = np.asarray(cmd["local"], dtype=np.int64)
        remote = np.asarray(cmd["remote"], dtype=np.int64)
        words = self.side.words
        words[:, local] = 0
        self.read(cmd["req"], [int(x) for x in local], [int(x) for x in remote])
        ok = all(np.array_equal(words[layer, local], expected_words(layer, remote, words.shape[2]))
                 for layer in range(words.shape[0]))
        return {"ok": ok, "blocks": len(local) if ok else 0}  # block ids compared (every layer)

    def cmd_idle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """CPU of this whole process while the engine loop is blocked, as an idle engine's is."""
        time.sleep(float(cmd["settle_s"]))
        out = []
        for _ in range(int(cmd["windows"])):
            c0, t0 = cpu_seconds(), time.perf_counter()
            time.sleep(float(cmd["window_s"]))
            out.append((cpu_seconds() - c0) / (time.perf_counter() - t0))
        return {"idle_cpu": out}

    def cmd_close(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A fresh connector pair over UCX tcp: handshake, ``inflight`` reads of ``blocks``
        blocks posted, then shutdown (worker, then the listener), timed."""
        base = thread_count()
        old = os.environ.get("UCX_TLS")
        os.environ["UCX_TLS"] = cmd["ucx_tls"]
        try:
            worker = self.side.new_worker()
        finally:
            if old is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = old
        listener = self.side.new_listener(worker, free_port())  # picked as it is bound
        reqs = list(cmd["reqs"])
        self.handshake(worker, reqs.pop())
        open_threads = thread_count()
        n, blocks = int(cmd["inflight"]), int(cmd["blocks"])
        total = self.side.blocks
        for i in range(n):
            first = (i * blocks) % (total - blocks + 1)
            ids = list(range(first, first + blocks))
            self.post(worker, reqs[i], ids, ids)
        inner = self._inner(worker)
        in_flight = sum(1 for handles in inner._recving_transfers.values() for h in handles
                        if inner.nixl_wrapper.check_xfer_state(h) == "PROC")
        error = None
        t = time.perf_counter()
        try:
            worker.shutdown()
        except Exception as exc:  # what vLLM's shutdown does with reads in flight
            error = f"{type(exc).__name__}: {exc}"
        t_worker = time.perf_counter()
        listener.shutdown()
        t_end = time.perf_counter()
        after = thread_count()
        del worker, listener, inner
        gc.collect()
        return {"worker_s": t_worker - t, "listener_s": t_end - t_worker, "in_flight": in_flight,
                "threads_base": base, "threads_open": open_threads, "threads_after": after,
                "threads_after_gc": thread_count(), "shutdown_error": error}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--port", type=int, default=0,
                   help="this decode's vLLM side-channel port (0: pick one)")
    p.add_argument("--dist-port", type=int, default=0, help="gloo rendezvous port (0: pick one)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=32, help="tokens per block")
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--engine-id", default=f"vllm-decode-{os.getpid()}")
    p.add_argument("--unpin", action="store_true",
                   help="let every thread run on any CPU again after vLLM's connector pinned it")
    args = p.parse_args()
    out = os.fdopen(args.fd, "w")

    def emit(obj: dict[str, Any]) -> None:
        write_file(out, obj)

    side = VllmSide("decode", args.engine_id, args.port, args.layers, args.blocks, args.block_size,
                    args.kv_heads, args.head_dim, 30, args.dist_port, unpin=args.unpin)
    decode = Decode(side, side.port)
    emit({"ready": {"pid": os.getpid(), "page_bytes": side.page_bytes, "layers": side.layers,
                    "compat_hash": side.handshake.compatibility_hash, "block_size": args.block_size,
                    "attn_backend": side.worker.connector_worker.backend_name,
                    "layer_names": side.layer_names,
                    "blocks": side.blocks, "threads_base": side.threads_base,
                    "threads_open": thread_count(), "vllm_affinity": side.affinity,
                    "affinity": sorted(os.sched_getaffinity(0))}})
    handlers = {"connect": decode.cmd_connect, "reads": decode.cmd_reads, "verify": decode.cmd_verify,
                "idle": decode.cmd_idle, "close": decode.cmd_close, "pd": decode.cmd_pd,
                "target": decode.cmd_target, "post": decode.cmd_post, "heartbeat": decode.cmd_heartbeat}
    try:
        for line in sys.stdin:
            cmd = decode_line(line)
            if cmd is None:
                continue
            try:
                emit(handlers[cmd["op"]](cmd))
            except Exception as exc:
                traceback.print_exc()
                emit({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        decode.listener.shutdown()
        side.shutdown()


if __name__ == "__main__":
    main()
