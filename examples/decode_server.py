"""The decode server: asks the prefill server for a prompt's KV cache, reads it, generates.

``POST /generate {"prompt": "text"} | {"tokens": [...]}``, with optional ``max_new_tokens``
(default 16) and ``stream`` (NDJSON lines, one per token, then a summary). Per request:

1. allocate local blocks for prompt + generated tokens (503 ``decode_out_of_blocks``);
2. ``POST /prefill`` to the prefill server: block ids, first token, its engine address;
3. ``engine.connect(address)``: a handshake the first time, the same peer afterwards;
4. ``engine.transfer_blocks(..., op="read", notify=b"kv-done:<id>")``: the notification
   tells the prefill server it may free its blocks;
5. greedy decoding from the local cache, one model step per token in a worker thread.

Everything that depends on the prefill side happens before the first byte of the
response, so its failures are clean HTTP errors: 503 when the prefill server cannot be
reached, 502 when it fails midway (handshake, transfer, timeout), each with a JSON body
``{"error": code, "detail": text}``. After a failed transfer the peer is disconnected, so
the next request performs a fresh handshake (with a restarted prefill server, say), and
blocks granted by an engine found disconnected fail at once instead of waiting for a
handshake that cannot be answered.

    python -m examples.decode_server --port 8200 --prefill-url http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

import aionixl

from .common import (
    DEFAULT_IDLE_POLL_S,
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

MAX_NEW_TOKENS = 256


@dataclass(frozen=True, slots=True)
class Grant:
    """The prefill server's answer: where the prompt's KV blocks are and for how long."""

    blocks: list[int]
    first_token: int
    engine_address: str
    engine_name: str
    notify: bytes
    lease_deadline: float  # time.monotonic() after which the blocks may be reused
    compute_ms: float


@dataclass(slots=True)
class Timing:
    """Milliseconds since the request arrived, per stage; reported with every answer."""

    start: float
    prefill_ms: float = 0.0
    prefill_compute_ms: float = 0.0
    connect_ms: float = 0.0
    transfer_ms: float = 0.0
    transfer_engine_ms: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0

    def since(self, t0: float) -> float:
        return (time.perf_counter() - t0) * 1e3

    def report(self) -> dict[str, float]:
        return {k: round(getattr(self, k), 3) for k in self.__slots__ if k != "start"}


class _GeneratorResponse(StreamingResponse):
    """NDJSON stream that closes its generator and runs ``release`` however it ends.

    Starlette may cancel a stream before it starts iterating (the client went away), and an
    async generator that never started runs no ``finally``: the release must not live there.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], release: Callable[[], None]) -> None:
        super().__init__(body, media_type="application/x-ndjson")
        self._body = body
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()
            finally:
                self._release()


class DecodeServer:
    """Owns the model, the local paged cache, one engine and one HTTP client for prefill."""

    def __init__(self, model: TinyDecoder, num_blocks: int, prefill_url: str, *, idle_poll_s: float,
                 prefill_timeout: float, connect_timeout: float, transfer_timeout: float,
                 notify_mode: str = "attached") -> None:
        self.model = model
        self.cache = model.new_cache(num_blocks)
        self.pool = BlockPool(num_blocks)
        self.prefill_url = prefill_url.rstrip("/")
        self.idle_poll_s = idle_poll_s
        self.prefill_timeout = prefill_timeout
        self.connect_timeout = connect_timeout
        self.transfer_timeout = transfer_timeout
        self.notify_mode = notify_mode
        self.outcomes: Counter[str] = Counter()
        #: Names of prefill engines a transfer found disconnected (insertion-ordered, capped).
        self._dead_engines: dict[str, None] = {}
        self._engine: aionixl.Engine | None = None
        self._http: httpx.AsyncClient | None = None
        self.app = Starlette(routes=[
            Route("/generate", self.generate, methods=["POST"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={Exception: internal_error})

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config = engine_config(self.model.config, self.idle_poll_s)
        async with aionixl.Engine(f"decode-{os.getpid()}", self.model.cache_regions(self.cache),
                                  listen=None, config=config) as engine, \
                httpx.AsyncClient(base_url=self.prefill_url, timeout=self.prefill_timeout) as http:
            self._engine, self._http = engine, http
            try:
                yield
            finally:
                self._engine = self._http = None

    # ---- the request path ---------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        timing = Timing(time.perf_counter())
        local: list[int] | None = None
        try:
            tokens, max_new, stream = await self._parse(request)
            local = self.pool.allocate(self.model.blocks_for(len(tokens) + max_new - 1))
            if local is None:
                raise HTTPError(503, "decode_out_of_blocks", f"{self.pool.free_count} free blocks")
            request_id = uuid.uuid4().hex
            grant = await self._prefill(request_id, tokens, timing)
            peer = await self._connect(grant, timing)
            await self._read_blocks(peer, local, grant, timing)
        except BaseException as exc:
            if local is not None:
                self.pool.free(local)
            if not isinstance(exc, HTTPError):
                raise
            self.outcomes[exc.error] += 1
            return exc.response()
        # The KV cache is local now: the first token is out, nothing remote can fail any more.
        timing.ttft_ms = timing.since(timing.start)
        steps = self._decode(tokens, grant.first_token, max_new, local, timing)
        summary = {"request_id": request_id, "prefill_engine": grant.engine_name,
                   "prompt_tokens": len(tokens), "blocks_read": len(grant.blocks)}
        release = partial(self.pool.free, local)
        if stream:
            return _GeneratorResponse(self._ndjson(steps, summary, timing), release)
        try:
            out = [t async for t in steps]
        finally:
            await steps.aclose()
            release()
        self.outcomes["ok"] += 1
        return JSONResponse({"tokens": out, **summary, "timing": timing.report()})

    async def _parse(self, request: Request) -> tuple[list[int], int, bool]:
        body = await read_json_object(request)
        cfg = self.model.config
        max_new = body.get("max_new_tokens", 16)
        if type(max_new) is not int or not 1 <= max_new <= MAX_NEW_TOKENS:
            raise HTTPError(400, "bad_request", f"max_new_tokens must be an int in 1..{MAX_NEW_TOKENS}")
        if "prompt" in body:
            if not isinstance(body["prompt"], str) or not body["prompt"]:
                raise HTTPError(400, "bad_request", "prompt must be a non-empty string")
            raw: object = list(body["prompt"].encode())
        else:
            raw = body.get("tokens")
        tokens = check_tokens(raw, cfg, cfg.max_positions - max_new + 1)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise HTTPError(400, "bad_request", "stream must be true or false")
        return tokens, max_new, stream

    async def _prefill(self, request_id: str, tokens: list[int], timing: Timing) -> Grant:
        http, engine = self._http, self._engine
        if http is None or engine is None:
            raise HTTPError(503, "shutting_down", "the decode server is stopping")
        t0 = time.perf_counter()
        try:
            reply = await http.post("/prefill", json={"request_id": request_id, "tokens": tokens,
                                                      "decode_engine": engine.name})
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise HTTPError(503, "prefill_unavailable",
                            f"cannot reach the prefill server at {self.prefill_url}: {exc!r}") from None
        except httpx.HTTPError as exc:  # reset, protocol error, read timeout
            raise HTTPError(502, "prefill_failed",
                            f"prefill request to {self.prefill_url} failed: {exc!r}") from None
        received = time.monotonic()
        timing.prefill_ms = timing.since(t0)
        try:
            body = reply.json()
        except ValueError:
            body = None
        if reply.status_code != 200:
            error = body.get("error", "prefill_error") if isinstance(body, dict) else "prefill_error"
            detail = body.get("detail", reply.text[:200]) if isinstance(body, dict) else reply.text[:200]
            status = reply.status_code if reply.status_code in (400, 409, 503) else 502
            raise HTTPError(status, error, f"prefill server: {detail}")
        try:
            assert isinstance(body, dict)
            grant = Grant(list(body["blocks"]), int(body["first_token"]), str(body["engine_address"]),
                          str(body["engine_name"]), str(body["notify"]).encode(),
                          received + float(body["lease_s"]), float(body["compute_ms"]))
        except (AssertionError, KeyError, TypeError, ValueError) as exc:
            raise HTTPError(502, "prefill_bad_reply", f"unusable prefill reply: {exc!r}") from None
        timing.prefill_compute_ms = grant.compute_ms
        return grant

    def _time_left(self, grant: Grant, limit: float) -> float:
        """``limit``, cut short so that we never read blocks the prefill side may have reused."""
        left = grant.lease_deadline - time.monotonic() - 0.5
        if left <= 0:
            raise HTTPError(502, "lease_expired", "the prefill server's lease on the blocks ran out")
        return min(limit, left)

    async def _connect(self, grant: Grant, timing: Timing) -> aionixl.Peer:
        engine = self._engine
        assert engine is not None
        if grant.engine_name in self._dead_engines:
            # Granted by a process whose engine has since disconnected: engine names are
            # unique per process, so a handshake could only wait for its timeout.
            raise HTTPError(502, "peer_disconnected",
                            f"prefill engine {grant.engine_name!r} disconnected after granting the blocks")
        t0 = time.perf_counter()
        try:
            # Idempotent: after the first request this returns the live peer at once, and
            # concurrent first requests share one handshake.
            limit = self._time_left(grant, self.connect_timeout)
            peer = await engine.connect(grant.engine_address, timeout=limit)
        except aionixl.IncompatiblePeerError as exc:
            raise HTTPError(502, "incompatible_peer", str(exc), field=exc.field) from None
        except aionixl.HandshakeError as exc:
            raise HTTPError(502, "handshake_failed", str(exc)) from None
        except aionixl.EngineClosedError as exc:
            raise HTTPError(503, "shutting_down", str(exc)) from None
        timing.connect_ms = timing.since(t0)
        if peer.name != grant.engine_name:
            raise HTTPError(502, "wrong_peer", f"{grant.engine_address} is {peer.name!r}, "
                            f"the prefill server named {grant.engine_name!r}")
        return peer

    async def _read_blocks(self, peer: aionixl.Peer, local: list[int], grant: Grant, timing: Timing) -> None:
        engine = self._engine
        assert engine is not None
        attached = self.notify_mode == "attached"
        t0 = time.perf_counter()
        try:
            result = await engine.transfer_blocks(peer, local[:len(grant.blocks)], grant.blocks, op="read",
                                                  notify=grant.notify if attached else None,
                                                  timeout=self._time_left(grant, self.transfer_timeout))
        except aionixl.TransferTimeoutError as exc:
            await self._forget(peer)
            raise HTTPError(502, "transfer_timeout", str(exc)) from None
        except aionixl.PeerDisconnectedError as exc:
            self._dead_engines[peer.name] = None
            while len(self._dead_engines) > 64:
                del self._dead_engines[next(iter(self._dead_engines))]
            await self._forget(peer)
            raise HTTPError(502, "peer_disconnected", str(exc)) from None
        except aionixl.TransferError as exc:
            await self._forget(peer)
            raise HTTPError(502, "transfer_failed", str(exc)) from None
        except aionixl.EngineClosedError as exc:
            raise HTTPError(503, "shutting_down", str(exc)) from None
        except ValueError as exc:
            if not peer.connected:  # another request's failure disconnected it meanwhile
                raise HTTPError(502, "peer_disconnected", str(exc)) from None
            raise
        timing.transfer_ms = timing.since(t0)
        timing.transfer_engine_ms = result.seconds * 1e3
        if not attached:
            # The data is here already. Should this fail, the prefill side's lease frees the blocks.
            with suppress(aionixl.AionixlError, ValueError):
                await engine.send_notification(peer, grant.notify)

    async def _forget(self, peer: aionixl.Peer) -> None:
        """Drop a peer whose transfer failed, so the next request handshakes afresh."""
        engine = self._engine
        if engine is not None and peer.connected:
            with suppress(aionixl.AionixlError, ValueError):
                await engine.disconnect(peer)

    async def _decode(self, prompt: list[int], first: int, max_new: int, blocks: list[int],
                      timing: Timing) -> AsyncGenerator[int, None]:
        """Yield the generated tokens: the first came from the prefill server, the rest are ours."""
        token = first
        yield token
        for step in range(max_new - 1):
            # Not cancellable midway: whoever frees the blocks waits for the running step.
            token = await anyio.to_thread.run_sync(self.model.decode_step, token, len(prompt) + step,
                                                   self.cache, blocks)
            yield token
        timing.total_ms = timing.since(timing.start)

    async def _ndjson(self, steps: AsyncGenerator[int, None], summary: dict[str, Any],
                      timing: Timing) -> AsyncGenerator[bytes, None]:
        out: list[int] = []
        try:
            async for token in steps:
                out.append(token)
                yield json.dumps({"token": token}).encode() + b"\n"
        finally:
            await steps.aclose()
        self.outcomes["ok"] += 1
        yield json.dumps({"done": True, "tokens": out, **summary, "timing": timing.report()}).encode() + b"\n"

    # ---- introspection ------------------------------------------------------------------

    async def stats(self, request: Request) -> Response:
        engine = self._engine
        return JSONResponse({
            "num_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.free_count,
            "outcomes": dict(self.outcomes),
            "engine": None if engine is None else {
                "name": engine.name, **engine.stats(),
                "peers": [{"name": p.name, "address": p.address} for p in engine.peers.values()],
            },
        })

    async def health(self, request: Request) -> Response:
        ok = self._engine is not None
        return JSONResponse({"ok": ok, "role": "decode"}, status_code=200 if ok else 503)

    def ready_info(self) -> dict[str, Any]:
        engine = self._engine
        assert engine is not None
        return {"role": "decode", "engine_name": engine.name, "prefill_url": self.prefill_url}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8200, help="HTTP port; 0 picks a free one")
    parser.add_argument("--prefill-url", default="http://127.0.0.1:8100")
    parser.add_argument("--blocks", type=int, default=512, help="KV cache blocks")
    parser.add_argument("--idle-poll", type=float, default=DEFAULT_IDLE_POLL_S,
                        help="EngineConfig.idle_poll_interval")
    parser.add_argument("--prefill-timeout", type=float, default=10.0, help="seconds for POST /prefill")
    parser.add_argument("--connect-timeout", type=float, default=5.0, help="seconds for engine.connect")
    parser.add_argument("--transfer-timeout", type=float, default=5.0, help="seconds for the block read")
    parser.add_argument("--notify", choices=["attached", "separate"], default="attached",
                        help="attached: transfer_blocks(notify=...); separate: send_notification() "
                        "after the read (the read then does not wait for the prefill engine's next poll)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda, ...")
    args = parser.parse_args(argv)
    quiet_logs()
    setup_torch()
    server = DecodeServer(TinyDecoder(ModelConfig(), pick_device(args.device)), args.blocks, args.prefill_url,
                          idle_poll_s=args.idle_poll, prefill_timeout=args.prefill_timeout,
                          connect_timeout=args.connect_timeout, transfer_timeout=args.transfer_timeout,
                          notify_mode=args.notify)
    return asyncio.run(serve(server.app, bind(args.host, args.port), server.ready_info))


if __name__ == "__main__":
    raise SystemExit(main())
