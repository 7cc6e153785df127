"""The prefill server: computes a prompt's KV cache and lends its blocks to a decode server.

``POST /v1/completions`` is OpenAI's completions API with what a vLLM prefill instance does
in disaggregated serving: the request carries ``max_tokens: 1`` and
``kv_transfer_params: {"do_remote_decode": true, ...}`` (as vLLM's P/D proxy sends it), the
server runs the prompt into freshly allocated cache blocks, answers with the first token,
and hands back ``kv_transfer_params`` in vLLM's shape (``remote_engine_id``,
``remote_block_ids``, ``remote_host``, ``remote_port``, ...) plus what aionixl needs (the
handshake address, the notification that releases the blocks, the lease). The blocks stay
leased (``engine.lease``) until the decode side's read delivers that notification
(``aionixl.read_done``: vLLM's ``"<request id>:1"``) or until the lease runs out. Without
``do_remote_decode`` the blocks are freed at once.
``X-Request-Id`` (the proxy sends one) names the lease. ``GET /v1/models``, ``/health``,
``/stats`` and ``/metrics`` (with the ``aionixl[prometheus]`` extra) describe the server.

    python -m examples.prefill_server --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager
from typing import Any
from urllib.parse import urlsplit

import anyio
import anyio.abc
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import aionixl

from .common import (
    DEFAULT_IDLE_POLL_S,
    DEFAULT_LEASE_S,
    TIMING_HEADER,
    BlockPool,
    ClosingStreamingResponse,
    HTTPError,
    Metrics,
    bind,
    completion_body,
    completion_stream,
    engine_config,
    engine_counts,
    engine_tuning,
    internal_error,
    models_body,
    parse_completion,
    quiet_logs,
    read_json_object,
    request_id_from,
    serve,
)
from .model import ModelConfig, TinyDecoder, pick_device, setup_torch


def done_message(request_id: str) -> bytes:
    """The notification a decode server attaches to its read of this request's blocks:
    vLLM's, which releases the engine's lease on them."""
    return aionixl.read_done(request_id)


class PrefillServer:
    """Owns the model, the paged cache, its block pool and the one engine that exposes it."""

    def __init__(self, model: TinyDecoder, num_blocks: int, lease_s: float, idle_poll_s: float,
                 engine_host: str = "127.0.0.1") -> None:
        self.model = model
        self.cache = model.new_cache(num_blocks)
        self.pool = BlockPool(num_blocks)
        self.lease_s = lease_s
        self.idle_poll_s = idle_poll_s
        self.engine_host = engine_host
        self.counts = {"prefilled": 0, "freed_on_notification": 0, "freed_on_lease_timeout": 0}
        self._engine: aionixl.Engine | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self.metrics = Metrics()
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics.endpoint, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={Exception: internal_error})

    @property
    def engine(self) -> aionixl.Engine:
        if self._engine is None:
            raise HTTPError(503, "not_ready", "the engine is not open")
        return self._engine

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The engine lives as long as the app; lease tasks end before the engine closes."""
        config, tuning = engine_config(self.model.config), engine_tuning(self.idle_poll_s)
        async with aionixl.Engine(f"prefill-{os.getpid()}", self.model.cache_regions(self.cache),
                                  listen=f"tcp://{self.engine_host}:0", config=config,
                                  tuning=tuning) as engine, \
                anyio.create_task_group() as tasks:
            self._engine, self._tasks = engine, tasks
            self.metrics.attach(engine)
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                self.metrics.detach()
                self._engine = self._tasks = None

    async def completions(self, request: Request) -> Response:
        created = int(time.time())
        try:
            req = parse_completion(await read_json_object(request), self.model.config)
            if req.max_tokens != 1:
                raise HTTPError(400, "bad_request", "a prefill server produces only the first token: "
                                "max_tokens must be 1 (the proxy or the decode server generates the rest)",
                                param="max_tokens")
            kv = req.kv_transfer_params or {}
            remote_decode = kv.get("do_remote_decode") is True
            if remote_decode and req.stream:
                raise HTTPError(400, "bad_request", "kv_transfer_params come back only with stream=false",
                                param="stream")
            lease_s = kv.get("lease_s", self.lease_s)
            if type(lease_s) not in (int, float) or not 0 < lease_s <= self.lease_s:
                raise HTTPError(400, "bad_request", f"lease_s must be a number in (0, {self.lease_s}]",
                                param="kv_transfer_params")
            request_id = request_id_from(request)
            if request_id in self.engine.leases:
                raise HTTPError(409, "duplicate_request", f"request {request_id!r} already holds blocks")
            if remote_decode and (request_id.startswith("HB:") or "," in request_id):
                raise HTTPError(400, "bad_request", "X-Request-Id must not start with 'HB:' or hold "
                                "',' (vLLM's lease heartbeat could not name it)")
            engine, tasks = self.engine, self._tasks
            assert tasks is not None
            tokens = req.tokens
            blocks = self.pool.allocate(self.model.blocks_for(len(tokens)))
            if blocks is None:
                raise HTTPError(503, "prefill_out_of_blocks",
                                f"{self.pool.free_count} free blocks, {len(tokens)} tokens need more")
        except HTTPError as exc:
            return exc.response()
        try:
            started = time.perf_counter()
            # In a worker thread, not cancellable midway: the blocks are never freed while
            # the model still writes into them.
            first = await anyio.to_thread.run_sync(self.model.prefill, tokens, self.cache, blocks)
            compute_s = time.perf_counter() - started
            # Leased before the answer goes out: a read-done that beats the waiting task
            # still finds its lease.
            lease = engine.lease(request_id, blocks, duration=float(lease_s)) if remote_decode else None
        except BaseException:
            self.pool.free(blocks)
            raise
        self.counts["prefilled"] += 1
        headers = {TIMING_HEADER: json.dumps({"prefill_compute_ms": round(compute_s * 1e3, 3)})}
        if not remote_decode:
            self.pool.free(blocks)
            if req.stream:
                return ClosingStreamingResponse(completion_stream(req, request_id, created, _one(first)),
                                                lambda: None, headers=headers)
            return JSONResponse(completion_body(req, request_id, created, [first],
                                                kv_transfer_params=None), headers=headers)
        assert lease is not None
        tasks.start_soon(self._hold_lease, lease)
        params = kv_transfer_params(engine, request_id, blocks, tokens, first, float(lease_s))
        return JSONResponse(completion_body(req, request_id, created, [first], kv_transfer_params=params),
                            headers=headers)

    async def _hold_lease(self, lease: aionixl.Lease) -> None:
        """Free the blocks once the decode side's read has landed, or when the lease ends."""
        try:
            await lease.wait()
            self.counts["freed_on_notification"] += 1
        except aionixl.LeaseExpiredError:
            self.counts["freed_on_lease_timeout"] += 1
        except aionixl.EngineClosedError:
            pass
        finally:
            self.pool.free(list(lease.block_ids))

    async def stats(self, request: Request) -> Response:
        engine = self._engine
        return JSONResponse({
            "num_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.free_count,
            "active_leases": 0 if engine is None else len(engine.leases),
            **self.counts,
            "engine": None if engine is None else {
                "name": engine.name, "address": engine.address, **engine_counts(engine),
                "peers": sorted(engine.peers),
            },
        })

    async def models(self, request: Request) -> Response:
        return JSONResponse(models_body())

    async def health(self, request: Request) -> Response:
        engine = self._engine
        return JSONResponse({"ok": engine is not None, "role": "prefill"},
                            status_code=200 if engine is not None else 503)

    def ready_info(self) -> dict[str, Any]:
        engine = self.engine
        return {"role": "prefill", "engine_name": engine.name, "engine_address": engine.address}


def kv_transfer_params(engine: aionixl.Engine, request_id: str, blocks: list[int], tokens: list[int],
                       first_token: int, lease_s: float) -> dict[str, Any]:
    """What the decode side needs to pull the blocks, in vLLM's NixlConnector shape plus aionixl's.

    vLLM's fields: ``do_remote_prefill`` (the decode side reads the KV), ``remote_engine_id``,
    ``remote_block_ids``, ``remote_request_id``, ``remote_host``/``remote_port`` (vLLM's
    handshake side channel; here the aionixl engine's handshake endpoint), ``tp_size``.
    aionixl's: the handshake address as one string, the notification that frees the blocks,
    the lease (seconds and wall-clock expiry), the cached token count, and the first token:
    vLLM's decode recomputes it from the last prompt token; here it travels, so the answer
    is bit for bit what one process computes.
    """
    where = urlsplit(engine.address)
    return {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": engine.name,
        "remote_block_ids": blocks,
        "remote_request_id": request_id,
        "remote_host": where.hostname,
        "remote_port": where.port,
        "tp_size": 1,
        "remote_handshake_address": engine.address,
        "remote_notify": done_message(request_id).decode(),
        "remote_num_tokens": len(tokens),
        "remote_lease_s": lease_s,
        "remote_lease_expires_at": time.time() + lease_s,
        "first_token_id": first_token,
    }


async def _one(token: int) -> AsyncGenerator[int, None]:
    yield token


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="HTTP port; 0 picks a free one")
    parser.add_argument("--blocks", type=int, default=1024, help="KV cache blocks (16 KiB each)")
    parser.add_argument("--lease", type=float, default=DEFAULT_LEASE_S,
                        help="seconds blocks stay leased without a read notification")
    parser.add_argument("--idle-poll", type=float, default=DEFAULT_IDLE_POLL_S,
                        help="aionixl.lowlevel.Tuning.idle_poll_interval")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    args = parser.parse_args(argv)
    quiet_logs()
    setup_torch()
    server = PrefillServer(TinyDecoder(ModelConfig(), pick_device(args.device)), args.blocks, args.lease,
                           args.idle_poll, engine_host=args.host)
    return asyncio.run(serve(server.app, bind(args.host, args.port), server.ready_info))


if __name__ == "__main__":
    raise SystemExit(main())
