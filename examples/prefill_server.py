"""The prefill server: computes a prompt's KV cache and lends its blocks to a decode server.

``POST /prefill {"request_id", "tokens", "decode_engine", "lease_s"?}`` allocates blocks, runs the
prompt through the model into them, and answers with the block ids, the first generated
token and this process's engine address. The blocks stay leased until the decode server's
read delivers the notification ``kv-done:<request_id>`` (``engine.wait_notification``) or
until the lease times out, whichever comes first; then they are free again.
``GET /stats`` reports free blocks and lease outcomes; ``GET /health`` says it is up.

    python -m examples.prefill_server --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

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
    BlockPool,
    HTTPError,
    bind,
    check_tokens,
    engine_config,
    internal_error,
    quiet_logs,
    read_json_object,
    serve,
)
from .model import ModelConfig, TinyDecoder, pick_device, setup_torch


def done_message(request_id: str) -> bytes:
    """The notification a decode server attaches to its read of this request's blocks."""
    return b"kv-done:" + request_id.encode()


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
        self.leases: dict[str, list[int]] = {}
        self.counts = {"prefilled": 0, "freed_on_notification": 0, "freed_on_lease_timeout": 0}
        self._engine: aionixl.Engine | None = None
        self._tasks: anyio.abc.TaskGroup | None = None
        self.app = Starlette(routes=[
            Route("/prefill", self.prefill, methods=["POST"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={Exception: internal_error})

    @property
    def engine(self) -> aionixl.Engine:
        if self._engine is None:
            raise HTTPError(503, "not_ready", "the engine is not open")
        return self._engine

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        """The engine lives as long as the app; lease tasks end before the engine closes."""
        config = engine_config(self.model.config, self.idle_poll_s)
        async with aionixl.Engine(f"prefill-{os.getpid()}", self.model.cache_regions(self.cache),
                                  listen=f"tcp://{self.engine_host}:0", config=config) as engine, \
                anyio.create_task_group() as tasks:
            self._engine, self._tasks = engine, tasks
            try:
                yield
            finally:
                tasks.cancel_scope.cancel()
                self._engine = self._tasks = None

    async def prefill(self, request: Request) -> Response:
        try:
            body = await read_json_object(request)
            request_id = body.get("request_id")
            if not isinstance(request_id, str) or not 0 < len(request_id) <= 128:
                raise HTTPError(400, "bad_request", "request_id must be a string of 1..128 chars")
            tokens = check_tokens(body.get("tokens"), self.model.config, self.model.config.max_positions)
            decode_engine = body.get("decode_engine")
            if decode_engine is not None and not isinstance(decode_engine, str):
                raise HTTPError(400, "bad_request", "decode_engine must be a string")
            lease_s = body.get("lease_s", self.lease_s)
            if type(lease_s) not in (int, float) or not 0 < lease_s <= self.lease_s:
                raise HTTPError(400, "bad_request", f"lease_s must be a number in (0, {self.lease_s}]")
            if request_id in self.leases:
                raise HTTPError(409, "duplicate_request", f"request {request_id!r} already holds blocks")
            engine, tasks = self.engine, self._tasks
            assert tasks is not None
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
            self.leases[request_id] = blocks
        except BaseException:
            self.pool.free(blocks)
            raise
        # Waiting starts now; a notification that beats it to the mailbox is kept there.
        tasks.start_soon(self._hold_lease, request_id, blocks, decode_engine, float(lease_s))
        self.counts["prefilled"] += 1
        return JSONResponse({
            "request_id": request_id,
            "blocks": blocks,
            "num_tokens": len(tokens),
            "first_token": first,
            "engine_address": engine.address,
            "engine_name": engine.name,
            "notify": done_message(request_id).decode(),
            "lease_s": lease_s,
            "compute_ms": compute_s * 1e3,
        })

    async def _hold_lease(self, request_id: str, blocks: list[int], decode_engine: str | None,
                          lease_s: float) -> None:
        """Free the blocks once the decode side's read has landed, or when the lease ends."""
        try:
            await self.engine.wait_notification(done_message(request_id), peer=decode_engine,
                                                timeout=lease_s)
            self.counts["freed_on_notification"] += 1
        except TimeoutError:
            self.counts["freed_on_lease_timeout"] += 1
        except aionixl.EngineClosedError:
            pass
        finally:
            del self.leases[request_id]
            self.pool.free(blocks)

    async def stats(self, request: Request) -> Response:
        engine = self._engine
        return JSONResponse({
            "num_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.free_count,
            "active_leases": len(self.leases),
            **self.counts,
            "engine": None if engine is None else {
                "name": engine.name, "address": engine.address, **engine.stats(),
                "peers": sorted(engine.peers),
            },
        })

    async def health(self, request: Request) -> Response:
        engine = self._engine
        return JSONResponse({"ok": engine is not None, "role": "prefill"},
                            status_code=200 if engine is not None else 503)

    def ready_info(self) -> dict[str, Any]:
        engine = self.engine
        return {"role": "prefill", "engine_name": engine.name, "engine_address": engine.address}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100, help="HTTP port; 0 picks a free one")
    parser.add_argument("--blocks", type=int, default=256, help="KV cache blocks")
    parser.add_argument("--lease", type=float, default=DEFAULT_LEASE_S,
                        help="seconds blocks stay leased without a read notification")
    parser.add_argument("--idle-poll", type=float, default=DEFAULT_IDLE_POLL_S,
                        help="EngineConfig.idle_poll_interval")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    args = parser.parse_args(argv)
    quiet_logs()
    setup_torch()
    server = PrefillServer(TinyDecoder(ModelConfig(), pick_device(args.device)), args.blocks, args.lease,
                           args.idle_poll, engine_host=args.host)
    return asyncio.run(serve(server.app, bind(args.host, args.port), server.ready_info))


if __name__ == "__main__":
    raise SystemExit(main())
