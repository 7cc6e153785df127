"""A MODEL of the thread-based KV-connector pattern, for ``aionixl bench``.

This is not vLLM's NixlConnector, nor code taken from it. It is a small, independent
re-creation of the parts of that design that decide latency, CPU use and shutdown time, so
the benchmark can measure the pattern on the same memory and the same NIXL build:

* Every connector runs a **listener thread** with a zmq ROUTER socket that hands out its NIXL
  agent metadata and memory layout. The thread blocks in ``recv`` with a **1 s receive
  timeout** and checks a **stop event** between waits; ``shutdown()`` sets the event and
  **joins** the thread, so shutting down takes up to one receive timeout.
* **Handshakes** (fetch the peer's metadata over zmq, ``add_remote_agent``, prepare its
  descriptor list) run on a ``ThreadPoolExecutor`` with **one worker**. A finished
  handshake is queued and picked up by the engine loop at its **next step**.
* Transfers are posted by the engine loop and **polled once per engine step**
  (:meth:`ThreadedConnector.get_finished`); between steps the engine thread is busy with the
  model's forward pass, modelled by :func:`engine_step` as a sleep of the step interval.
* NIXL's progress thread is off (as for the other contenders): NIXL makes progress only
  when the engine loop polls. The agent is used from two threads (engine loop and handshake
  worker), so it is created with NIXL's strict thread-sync mode where the binding offers it.

Only the decode (reading) side is modelled in full; the prefill side of the benchmark uses
:class:`MetadataListener` to serve its agents' metadata the same way.
"""

from __future__ import annotations

import base64
import contextlib
import json
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import zmq

from aionixl._bench._context import Context
from aionixl._bench._memory import block_descriptors

GET_METADATA = b"get-metadata"
RECV_TIMEOUT_MS = 1000
HANDSHAKE_TIMEOUT_MS = 10_000


def encode_metadata(agent_metadata: bytes, layout: dict[str, Any]) -> bytes:
    return json.dumps({"agent": base64.b64encode(agent_metadata).decode(), "layout": layout}).encode()


def decode_metadata(payload: bytes) -> tuple[bytes, dict[str, Any]]:
    msg = json.loads(payload)
    return base64.b64decode(msg["agent"]), msg["layout"]


class MetadataListener:
    """The listener thread: serves ``payload`` to every GET_METADATA on a ROUTER socket."""

    def __init__(self, payload: bytes, host: str = "127.0.0.1", recv_timeout_ms: int = RECV_TIMEOUT_MS,
                 name: str = "nixl-handshake-listener") -> None:
        self._payload = payload
        self._host = host
        self._timeout = recv_timeout_ms
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.address = ""
        self.served = 0
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"metadata listener did not start: {self._error!r}")

    def _serve(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, self._timeout)
            port = sock.bind_to_random_port(f"tcp://{self._host}")
            self.address = f"tcp://{self._host}:{port}"
        except BaseException as exc:
            self._error = exc
            sock.close(0)
            ctx.term()
            self._ready.set()
            return
        self._ready.set()
        try:
            while not self._stop.is_set():
                try:
                    frames = sock.recv_multipart()
                except zmq.Again:
                    continue  # the receive timeout: look at the stop event again
                identity, request = frames[0], frames[-1]
                if request == GET_METADATA:
                    sock.send_multipart([identity, b"", self._payload])
                    self.served += 1
        finally:
            sock.close(0)
            ctx.term()

    def request_stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        """Set the stop event and join: returns once the current receive has timed out."""
        self._stop.set()
        self._thread.join()


@dataclass
class RemoteAgent:
    address: str
    name: str
    dlist: Any
    num_blocks: int
    num_regions: int


@dataclass
class _Recv:
    handle: Any
    posted: float


def _indices(ids: Any, num_regions: int, num_blocks: int) -> np.ndarray:
    arr = np.asarray(ids, dtype=np.int32).reshape(1, -1)
    offsets = (np.arange(num_regions, dtype=np.int32) * np.int32(num_blocks)).reshape(-1, 1)
    return (offsets + arr).ravel()


class ThreadedConnector:
    """The decode-side connector of the model: one NIXL agent, a listener thread, a
    one-worker handshake executor, and per-step polling of posted reads."""

    def __init__(self, name: str, layout: dict[str, Any], ucx_tls: str | None = None,
                 recv_timeout_ms: int = RECV_TIMEOUT_MS) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        kwargs: dict[str, Any] = {"enable_prog_thread": False, "backends": ["UCX"]}
        with contextlib.suppress(ImportError, AttributeError):
            from nixl._api import nixl_thread_sync_t

            kwargs["sync_mode"] = nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
        try:
            config = nixl_agent_config(**kwargs)
        except TypeError:
            kwargs.pop("sync_mode", None)
            config = nixl_agent_config(**kwargs)
        with Context.ucx_env(ucx_tls):
            self.agent = nixl_agent(name, config)
        self.name = name
        self.layout = layout
        self.num_regions = len(layout["bases"])
        self.num_blocks = int(layout["num_blocks"])
        mem_type = layout["mem_type"]
        spans = np.array([[b, self.num_blocks * int(layout["stride"]), layout["device"]]
                          for b in layout["bases"]], dtype=np.uint64)
        self._reg = self.agent.register_memory(spans, mem_type)
        self._local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_descriptors(layout), mem_type)
        self._listener = MetadataListener(encode_metadata(self.agent.get_agent_metadata(), layout),
                                          recv_timeout_ms=recv_timeout_ms, name=f"{name}-listener")
        self.address = self._listener.address
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-handshake")
        self._handshakes: dict[str, Future[RemoteAgent]] = {}
        self._finished_handshakes: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.remotes: dict[str, RemoteAgent] = {}
        self._recving: dict[Any, _Recv] = {}
        self._closed = False

    # ---- handshakes (the executor's worker thread) --------------------------------------

    def request_handshake(self, address: str) -> None:
        """Start a handshake in the background; :meth:`get_finished` reports it ready."""
        if address in self.remotes or address in self._handshakes:
            return
        fut = self._executor.submit(self._handshake, address)
        self._handshakes[address] = fut
        fut.add_done_callback(partial(self._handshake_done, address))

    def _handshake_done(self, address: str, _fut: Future[RemoteAgent]) -> None:
        self._finished_handshakes.put(address)

    def _handshake(self, address: str) -> RemoteAgent:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        sock = ctx.socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, HANDSHAKE_TIMEOUT_MS)
            sock.connect(address)
            sock.send(GET_METADATA)
            payload = sock.recv()
        finally:
            sock.close(0)
        metadata, layout = decode_metadata(payload)
        remote_name = self.agent.add_remote_agent(metadata)
        if isinstance(remote_name, bytes):
            remote_name = remote_name.decode()
        dlist = self.agent.prep_xfer_dlist(remote_name, block_descriptors(layout), layout["mem_type"])
        return RemoteAgent(address, remote_name, dlist, int(layout["num_blocks"]), len(layout["bases"]))

    # ---- the engine loop's calls --------------------------------------------------------

    def read_blocks(self, request: Any, address: str, local_ids: Any, remote_ids: Any,
                    notify: bytes = b"") -> None:
        """Post a read of ``remote_ids`` into ``local_ids`` (every region) for ``request``
        (with ``notify``: that notification to the peer when it is done)."""
        remote = self.remotes[address]
        local_idx = _indices(local_ids, self.num_regions, self.num_blocks)
        remote_idx = _indices(remote_ids, remote.num_regions, remote.num_blocks)
        handle = self.agent.make_prepped_xfer("READ", self._local, local_idx, remote.dlist, remote_idx,
                                              notify)
        state = self.agent.transfer(handle)
        if state == "ERR":
            self.agent.release_xfer_handle(handle)
            raise RuntimeError(f"posting a read for {request!r} failed")
        self._recving[request] = _Recv(handle, time.perf_counter())

    def get_finished(self) -> tuple[list[Any], list[str]]:
        """Once per engine step: (requests whose reads finished, peers whose handshake did)."""
        ready: list[str] = []
        while True:
            try:
                address = self._finished_handshakes.get_nowait()
            except queue.Empty:
                break
            fut = self._handshakes.pop(address)
            self.remotes[address] = fut.result()  # a failed handshake raises here
            ready.append(address)
        done: list[Any] = []
        for request, rec in list(self._recving.items()):
            state = self.agent.check_xfer_state(rec.handle)
            if state == "DONE":
                self.agent.release_xfer_handle(rec.handle)
                del self._recving[request]
                done.append(request)
            elif state == "ERR":
                self.agent.release_xfer_handle(rec.handle)
                del self._recving[request]
                raise RuntimeError(f"the read for {request!r} failed")
        return done, ready

    @property
    def in_flight(self) -> int:
        return len(self._recving)

    def forget(self, address: str) -> None:
        """Drop a peer (so that the next handshake with it is a full one)."""
        remote = self.remotes.pop(address)
        remote.dlist.release()
        self.agent.remove_remote_agent(remote.name)

    def shutdown(self) -> None:
        """Stop and join the listener, stop the executor, abort reads, release everything."""
        if self._closed:
            return
        self._closed = True
        self._listener.close()
        self._executor.shutdown(wait=True)
        for rec in self._recving.values():
            for _ in range(1000):
                try:
                    self.agent.release_xfer_handle(rec.handle)
                    break
                except Exception:
                    self.agent.get_new_notifs()  # let the backend retire the aborted read
        self._recving.clear()
        for address in list(self.remotes):
            self.forget(address)
        self._local.release()
        self.agent.deregister_memory(self._reg)
        self.agent = None


def engine_step(conn: ThreadedConnector, step_s: float) -> tuple[list[Any], list[str]]:
    """One engine step: the forward pass (the thread is busy for ``step_s``), then the poll."""
    if step_s > 0:
        time.sleep(step_s)
    return conn.get_finished()
