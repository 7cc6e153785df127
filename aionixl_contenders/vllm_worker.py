"""A real vLLM NixlConnector prefill worker, without a model's weights (tests and bench).

Runs under a venv with vLLM (``./run vllm-setup``), as
``python -m aionixl_contenders.vllm_worker``. It builds what vLLM's engine would:
a config-only tiny Llama (a local ``config.json``, no weights, no tokenizer), a gloo world
of one, a KV cache as per-layer views of one flat buffer (vLLM's ``create_kv_cache_views``,
layout LBHNC: one region per layer, K and V in one page) filled with a known pattern, a
WORKER-role ``NixlConnector`` that registers it, and a SCHEDULER-role one that runs vLLM's
side-channel listener. Then it plays vLLM's engine loop: every step it hands the worker
connector the scheduler's metadata (requests whose blocks it holds, with lease deadlines)
and calls ``get_finished``, which reads the decoders' notifications and frees blocks.

Protocol: a JSON ``ready`` line on ``--fd``; then JSON commands on stdin, one per line:
``{"op": "hold", "req": ID, "lease_s": S}`` (blocks of request ID are held until a decoder's
notification or the lease's end; acknowledged with ``{"held": ID}``; ``hold_many`` with
``"reqs": [IDs]`` holds many in one step, acknowledged with ``{"held_many": N}``), and events on
``--fd`` as they happen: ``{"event": "notif", "msg": ...}`` for every notification NIXL
delivered, ``{"event": "lease", "req": ID, "remaining_s": S}`` when a lease deadline moved
(heartbeats), ``{"event": "freed", "req": ID, "reason": "notified" | "expired"}`` (none of
these with ``--quiet``). End of
stdin shuts the connectors down and exits.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# Set before vLLM reads its environment.
os.environ.setdefault("VLLM_KV_CACHE_LAYOUT", "LBHNC")

import numpy as np

from aionixl._bench._child import pin_threads
from aionixl._bench._memory import expected_words
from aionixl._lines import LineReader, write_file


def thread_count() -> int:
    """OS threads of this process now."""
    return len(os.listdir("/proc/self/task"))


def write_model_config(folder: str, layers: int, kv_heads: int, head_dim: int) -> None:
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "hidden_size": kv_heads * head_dim, "intermediate_size": 256,
        "num_attention_heads": kv_heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": layers, "vocab_size": 128, "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5,
    }
    Path(folder).mkdir(parents=True, exist_ok=True)
    staged = Path(folder, f"config.json.{os.getpid()}")
    staged.write_text(json.dumps(config))
    staged.replace(Path(folder, "config.json"))  # atomic: processes may write it at once


def free_port() -> int:
    """A port free right now, for this process to bind at once. The parent picking it would
    leave it free only until this process, many seconds of imports later, binds it; in CI
    something else had taken one meanwhile (EADDRINUSE in gloo's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmSide:
    """One vLLM worker's connector pair over a patterned KV cache (prefill or decode).

    ``port`` (the side channel) and ``dist_port`` (gloo's rendezvous): 0 picks one just
    before it is bound; ``self.port`` is the prefill's side channel."""

    def __init__(self, role: str, engine_id: str, port: int, layers: int, blocks: int,
                 block_size: int, kv_heads: int, head_dim: int, lease_s: int, dist_port: int,
                 unpin: bool = False) -> None:
        self.port = port
        os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
        import torch
        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            VllmConfig,
            set_current_vllm_config,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector
        from vllm.distributed.parallel_state import (
            ensure_model_parallel_initialized,
            init_distributed_environment,
        )
        from vllm.v1.kv_cache_interface import (
            FullAttentionSpec,
            KVCacheConfig,
            KVCacheGroupSpec,
            KVCacheTensor,
            create_kv_cache_views,
        )
        from vllm.v1.kv_cache_layout import KVCacheLayout

        # One folder per geometry, the same in every process: vLLM's compatibility hash covers
        # the model's name (its path here), so a prefill and a decode must name the same one.
        folder = Path(tempfile.gettempdir()) / f"aionixl-vllm-tiny-llama-{layers}x{kv_heads}x{head_dim}"
        write_model_config(str(folder), layers, kv_heads, head_dim)
        model = ModelConfig(model=str(folder), dtype=torch.bfloat16, skip_tokenizer_init=True)
        cache = CacheConfig(block_size=block_size)
        cache.kv_cache_layout = "LBHNC"
        kv = KVTransferConfig(kv_connector="NixlConnector",
                              kv_role="kv_producer" if role == "prefill" else "kv_consumer",
                              engine_id=engine_id, kv_buffer_device="cpu",
                              kv_connector_extra_config={"kv_lease_duration": lease_s})
        self.config = VllmConfig(model_config=model, cache_config=cache, kv_transfer_config=kv,
                                 device_config=DeviceConfig("cpu"))
        self._ctx = set_current_vllm_config(self.config)
        self._ctx.__enter__()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"tcp://127.0.0.1:{dist_port or free_port()}")
        ensure_model_parallel_initialized(1, 1)
        self._unpin = unpin
        self.layer_names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=kv_heads, head_size=head_dim,
                                 dtype=torch.bfloat16)
        self.page_bytes = int(spec.page_size_bytes)
        self.layers, self.blocks = layers, blocks
        tensor = KVCacheTensor(size=self.page_bytes * blocks * layers, layers=self.layer_names,
                               layer_stride=self.page_bytes * blocks, block_stride=self.page_bytes)
        kv_config = KVCacheConfig(num_blocks=blocks, kv_cache_tensors=[tensor],
                                  kv_cache_groups=[KVCacheGroupSpec(self.layer_names, spec)],
                                  kv_cache_layout="LBHNC")
        self.raw = torch.zeros(self.page_bytes * blocks * layers, dtype=torch.int8)
        #: [layer, block, word]: LBHNC puts each layer's blocks one after another.
        self.words = self.raw.numpy().view(np.uint64).reshape(layers, blocks, self.page_bytes // 8)
        self._views = create_kv_cache_views(self.raw, spec, blocks, KVCacheLayout.LBHNC, tensor)
        self._kv_config = kv_config
        self._connector_cls, self._roles = NixlConnector, KVConnectorRole
        #: OS threads of this process before any connector exists (vLLM, torch, gloo are up).
        self.threads_base = thread_count()
        self.worker = self.new_worker()
        self.handshake = self.worker.get_handshake_metadata()
        self.scheduler: Any = None
        if role == "prefill":
            self.fill()
            self.port = port or free_port()
            self.scheduler = self.new_listener(self.worker, self.port)
        self.address = f"tcp://127.0.0.1:{self.port}"

    def new_worker(self) -> Any:
        """A WORKER-role connector (its own NIXL agent) that registers this cache."""
        worker = self._connector_cls(self.config, self._roles.WORKER, self._kv_config)
        #: On CPU, vLLM's connector worker pins the thread that creates it (the engine loop's,
        #: which calls start_load_kv) to the last core of each NUMA node.
        self.affinity = sorted(os.sched_getaffinity(0))
        worker.register_kv_caches(dict(zip(self.layer_names, self._views, strict=True)))
        if self._unpin:  # the bench: every thread of this process may run on any CPU again
            pin_threads(os.getpid(), range(os.cpu_count() or 1))
        return worker

    def new_listener(self, worker: Any, port: int) -> Any:
        """A SCHEDULER-role connector serving ``worker``'s metadata on vLLM's side channel
        (``port`` 0: one picked here, as its listener thread binds it. Picked seconds earlier,
        before vLLM's imports, CI once found it taken, and vLLM then waits forever for a
        listener whose bind failed.)"""
        os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(port or free_port())
        scheduler = self._connector_cls(self.config, self._roles.SCHEDULER, self._kv_config)
        scheduler.set_xfer_handshake_metadata_pp_aware({(0, 0): worker.get_handshake_metadata()})
        return scheduler

    def fill(self) -> None:
        ids = np.arange(self.blocks, dtype=np.int64)
        for layer in range(self.layers):
            self.words[layer] = expected_words(layer, ids, self.words.shape[2])

    def shutdown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.shutdown()
        self.worker.shutdown()


class PrefillLoop:
    """vLLM's engine loop, reduced to what the connector sees: metadata in, get_finished out."""

    def __init__(self, side: VllmSide, emit: Any, quiet: bool = False) -> None:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

        self._meta_cls = NixlConnectorMetadata
        self.side = side
        self.emit = emit
        self.pending: dict[str, float] = {}  # newly held: request -> lease seconds
        worker = side.worker.connector_worker
        self._inner = worker
        self.deadlines: dict[str, float] = {}
        self._expired: set[str] = set()
        self.quiet = quiet
        self.freed = 0  # requests whose blocks get_finished reported free
        # Observe, not change: wrap the NIXL notification read and the lease reaper so the
        # harness can say what vLLM saw and why it freed blocks.
        wrapper = worker.nixl_wrapper
        original_get = wrapper.get_new_notifs
        original_reap = worker._reap_expired_send_leases

        def get_new_notifs() -> Any:
            notifs = original_get()
            if quiet:
                return notifs
            for agent, messages in notifs.items():
                for m in messages:
                    self.emit({"event": "notif", "from": agent, "msg": m.decode("utf-8", "replace")})
            return notifs

        def reap(done: set[str]) -> None:
            before = set(done)
            original_reap(done)
            self._expired |= done - before

        wrapper.get_new_notifs = get_new_notifs
        worker._reap_expired_send_leases = reap

    def hold(self, req: str, lease_s: float) -> None:
        self.pending[req] = lease_s

    def step(self) -> None:
        meta = self._meta_cls()
        now = time.perf_counter()
        meta.scheduler_clock = now
        meta.reqs_in_batch = set(self.pending)
        meta.reqs_to_send = {req: now + lease for req, lease in self.pending.items()}
        self.pending.clear()
        self.side.worker.bind_connector_metadata(meta)
        self.side.worker.start_load_kv(None)
        self.side.worker.clear_connector_metadata()
        self._expired = set()
        sending, _ = self.side.worker.get_finished(set())
        self.freed += len(sending)
        if self.quiet:
            return
        for req in sorted(sending):
            reason = "expired" if req in self._expired else "notified"
            self.emit({"event": "freed", "req": req, "reason": reason})
        live = dict(self._inner._reqs_to_send)
        for req, deadline in live.items():
            old = self.deadlines.get(req)
            if old is None or abs(deadline - old) > 1e-6:
                self.deadlines[req] = deadline
                if old is not None:
                    self.emit({"event": "lease", "req": req, "remaining_s": deadline - time.perf_counter()})
        for req in list(self.deadlines):
            if req not in live:
                del self.deadlines[req]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--fd", type=int, required=True)
    p.add_argument("--port", type=int, default=0, help="vLLM side-channel port (0: pick one)")
    p.add_argument("--dist-port", type=int, default=0, help="gloo rendezvous port (0: pick one)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--blocks", type=int, default=256)
    p.add_argument("--block-size", type=int, default=32, help="tokens per block")
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--lease-s", type=int, default=30, help="vLLM kv_lease_duration")
    p.add_argument("--step-ms", type=float, default=1.0, help="engine step: get_finished period")
    p.add_argument("--engine-id", default=f"vllm-prefill-{os.getpid()}")
    p.add_argument("--unpin", action="store_true",
                   help="let every thread run on any CPU again after vLLM's connector pinned it")
    p.add_argument("--quiet", action="store_true",
                   help="no notif/lease/freed events (the bench: thousands of reads)")
    args = p.parse_args()
    out = os.fdopen(args.fd, "w")

    def emit(obj: dict[str, Any]) -> None:
        write_file(out, obj)

    side = VllmSide("prefill", args.engine_id, args.port, args.layers, args.blocks, args.block_size,
                    args.kv_heads, args.head_dim, args.lease_s, args.dist_port, unpin=args.unpin)
    loop = PrefillLoop(side, emit, quiet=args.quiet)
    emit({"ready": {"pid": os.getpid(), "address": side.address, "engine_id": args.engine_id,
                    "compat_hash": side.handshake.compatibility_hash, "layers": side.layers,
                    "blocks": side.blocks, "page_bytes": side.page_bytes,
                    "threads": thread_count(),
                    "vllm_affinity": side.affinity, "affinity": sorted(os.sched_getaffinity(0))}})
    fd = sys.stdin.fileno()
    reader = LineReader()
    try:
        while True:
            ready, _, _ = select.select([fd], [], [], args.step_ms / 1e3)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                reader.feed(chunk)
                while (cmd := reader.pop()) is not None:
                    if cmd["op"] == "hold":
                        loop.hold(cmd["req"], float(cmd["lease_s"]))
                        loop.step()
                        emit({"held": cmd["req"]})
                    elif cmd["op"] == "hold_many":  # the bench: one step holds them all
                        for req in cmd["reqs"]:
                            loop.hold(req, float(cmd["lease_s"]))
                        loop.step()
                        emit({"held_many": len(cmd["reqs"]), "freed_so_far": loop.freed})
            loop.step()
    finally:
        side.shutdown()


if __name__ == "__main__":
    main()
