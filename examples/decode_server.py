"""The decode server: reads a prompt's KV cache from the prefill server, then generates.

``POST /v1/completions`` is OpenAI's completions API (greedy decoding only, byte-level
tokens; see ``common.parse_completion``). Two ways in:

- from the proxy (vLLM's P/D flow): the body carries the prefill server's
  ``kv_transfer_params`` (``do_remote_prefill: true``, ``remote_block_ids``, ...), so the
  prompt's KV cache is ready on the prefill side and only needs reading;
- directly: without ``kv_transfer_params`` the decode server makes the prefill call itself
  (``max_tokens: 1`` and ``do_remote_decode: true`` to the prefill server's
  ``/v1/completions``), as the proxy would.

Then, per request:

1. allocate local blocks for prompt + generated tokens (503 ``decode_out_of_blocks``);
2. ``engine.connect(address)``: a handshake the first time, the same peer afterwards;
3. ``engine.transfer_blocks(..., op="read", notify=b"<id>:1")``: the notification
   tells the prefill server it may free its blocks;
4. greedy decoding from the local cache, one model step per token in a worker thread,
   answered as one JSON object or as server-sent events ending in ``data: [DONE]``.

Everything that depends on the prefill side happens before the first byte of the
response, so its failures are clean HTTP errors in OpenAI's shape: 503 when the prefill
server cannot be reached, 502 when it fails midway (handshake, transfer, timeout). After a
failed transfer the peer is disconnected, so the next request performs a fresh handshake
(with a restarted prefill server, say), and blocks granted by an engine found disconnected
fail at once instead of waiting for a handshake that cannot be answered.

    python -m examples.decode_server --port 8200 --prefill-url http://127.0.0.1:8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from functools import partial
from typing import Any

import anyio
import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

import aionixl

from .common import (
    DEFAULT_IDLE_POLL_S,
    REQUEST_ID_HEADER,
    TIMING_HEADER,
    BlockPool,
    ClosingStreamingResponse,
    CompletionRequest,
    HTTPError,
    Metrics,
    bind,
    completion_body,
    completion_stream,
    engine_config,
    engine_counts,
    engine_tuning,
    error_code,
    internal_error,
    models_body,
    parse_completion,
    quiet_logs,
    read_json_object,
    request_id_from,
    serve,
)
from .model import ModelConfig, TinyDecoder, pick_device, setup_torch


@dataclass(frozen=True, slots=True)
class Grant:
    """The prefill side's ``kv_transfer_params``: where the prompt's KV blocks are, for how long."""

    blocks: list[int]
    first_token: int
    engine_address: str
    engine_name: str
    notify: bytes
    lease_deadline: float  # time.monotonic() after which the blocks may be reused

    @classmethod
    def from_kv_params(cls, kv: dict[str, Any], prompt_tokens: int, blocks_needed: int,
                       received: float | None = None) -> Grant:
        """Check the fields this side relies on; 400 (the caller's mistake) when they do not hold.

        The lease ends at whichever comes first: ``remote_lease_s`` after ``received``
        (when this process got the grant first-hand) or the wall-clock
        ``remote_lease_expires_at`` (when a proxy passed it along).
        """
        def bad(why: str) -> HTTPError:
            return HTTPError(400, "bad_kv_transfer_params", why, param="kv_transfer_params")

        blocks = kv.get("remote_block_ids")
        if not isinstance(blocks, list) or not all(type(b) is int and b >= 0 for b in blocks):
            raise bad("remote_block_ids must be a list of block ids")
        if kv.get("remote_num_tokens") != prompt_tokens or len(blocks) != blocks_needed:
            raise bad(f"the blocks hold {kv.get('remote_num_tokens')} tokens in {len(blocks)} blocks; "
                      f"this prompt has {prompt_tokens} tokens in {blocks_needed} blocks")
        address = kv.get("remote_handshake_address")
        if address is None and isinstance(kv.get("remote_host"), str) and type(kv.get("remote_port")) is int:
            address = f"tcp://{kv['remote_host']}:{kv['remote_port']}"
        name, notify, first = kv.get("remote_engine_id"), kv.get("remote_notify"), kv.get("first_token_id")
        if not isinstance(address, str) or not isinstance(name, str) or not isinstance(notify, str):
            raise bad("remote_handshake_address (or remote_host/remote_port), remote_engine_id and "
                      "remote_notify are required")
        if type(first) is not int:
            raise bad("first_token_id must be an int (the prefill side's first token)")
        now_mono, now_wall = time.monotonic(), time.time()
        deadlines: list[float] = []
        expires_at, lease_s = kv.get("remote_lease_expires_at"), kv.get("remote_lease_s")
        if type(expires_at) in (int, float):
            deadlines.append(now_mono + (expires_at - now_wall))
        if received is not None and type(lease_s) in (int, float):
            deadlines.append(received + lease_s)
        if not deadlines:
            raise bad("remote_lease_expires_at must be a number (unix time)")
        return cls(list(blocks), first, address, name, notify.encode(), min(deadlines))


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
        return {k: round(getattr(self, k), 3) for k in self.__slots__ if k != "start" and getattr(self, k)}

    def header(self) -> dict[str, str]:
        return {TIMING_HEADER: json.dumps(self.report())}


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
        self.metrics = Metrics()
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/stats", self.stats, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics.endpoint, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={Exception: internal_error})

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        config, tuning = engine_config(self.model.config), engine_tuning(self.idle_poll_s)
        async with aionixl.Engine(f"decode-{os.getpid()}", self.model.cache_regions(self.cache),
                                  listen=None, config=config,
                                  tuning=tuning) as engine, \
                httpx.AsyncClient(base_url=self.prefill_url, timeout=self.prefill_timeout) as http:
            self._engine, self._http = engine, http
            self.metrics.attach(engine)
            try:
                yield
            finally:
                self.metrics.detach()
                self._engine = self._http = None

    # ---- the request path ---------------------------------------------------------------

    async def completions(self, request: Request) -> Response:
        timing = Timing(time.perf_counter())
        created = int(time.time())
        local: list[int] | None = None
        try:
            req = parse_completion(await read_json_object(request), self.model.config)
            request_id = request_id_from(request)
            kv = req.kv_transfer_params or {}
            if kv.get("do_remote_decode") is True:
                raise HTTPError(400, "bad_request", "do_remote_decode goes to the prefill server; the decode "
                                "server takes the kv_transfer_params the prefill server returned",
                                param="kv_transfer_params")
            needed = self.model.blocks_for(len(req.tokens))
            grant = None
            if kv.get("do_remote_prefill") is True:
                grant = Grant.from_kv_params(kv, len(req.tokens), needed)
            local = self.pool.allocate(self.model.blocks_for(len(req.tokens) + req.max_tokens - 1))
            if local is None:
                raise HTTPError(503, "decode_out_of_blocks", f"{self.pool.free_count} free blocks")
            if grant is None:
                grant = await self._prefill(request_id, req, needed, timing)
            peer = await self._connect(grant, timing)
            await self._read_blocks(peer, local, grant, timing)
        except BaseException as exc:
            if local is not None:
                self.pool.free(local)
            if not isinstance(exc, HTTPError):
                raise
            self.outcomes[exc.code] += 1
            return exc.response()
        # The KV cache is local now: the first token is out, nothing remote can fail any more.
        timing.ttft_ms = timing.since(timing.start)
        steps = self._decode(req.tokens, grant.first_token, req.max_tokens, local, timing)
        release = partial(self.pool.free, local)
        if req.stream:
            return ClosingStreamingResponse(self._counted(completion_stream(req, request_id, created, steps)),
                                            release, headers=timing.header())
        try:
            out = [t async for t in steps]
        finally:
            await steps.aclose()
            release()
        self.outcomes["ok"] += 1
        return JSONResponse(completion_body(req, request_id, created, out), headers=timing.header())

    async def _counted(self, events: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        """Counts a stream as ok once its last event is out."""
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
        self.outcomes["ok"] += 1

    async def _prefill(self, request_id: str, req: CompletionRequest, blocks_needed: int,
                       timing: Timing) -> Grant:
        """The proxy's first step, done here: the prefill server computes and leases the KV blocks."""
        http, engine = self._http, self._engine
        if http is None or engine is None:
            raise HTTPError(503, "shutting_down", "the decode server is stopping")
        t0 = time.perf_counter()
        body = {"model": req.model, "prompt": req.tokens, "max_tokens": 1, "stream": False,
                "kv_transfer_params": {"do_remote_decode": True, "do_remote_prefill": False,
                                       "decode_engine_id": engine.name}}
        try:
            reply = await http.post("/v1/completions", json=body, headers={REQUEST_ID_HEADER: request_id})
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise HTTPError(503, "prefill_unavailable",
                            f"cannot reach the prefill server at {self.prefill_url}: {exc!r}") from None
        except httpx.HTTPError as exc:  # reset, protocol error, read timeout
            raise HTTPError(502, "prefill_failed",
                            f"prefill request to {self.prefill_url} failed: {exc!r}") from None
        received = time.monotonic()
        timing.prefill_ms = timing.since(t0)
        try:
            answer = reply.json()
        except ValueError:
            answer = None
        if reply.status_code != 200:
            code, message = error_code(answer)
            status = reply.status_code if reply.status_code in (400, 409, 503) else 502
            raise HTTPError(status, code or "prefill_error", f"prefill server: {message or reply.text[:200]}")
        with suppress(ValueError, TypeError, KeyError):
            timing.prefill_compute_ms = float(json.loads(reply.headers[TIMING_HEADER])["prefill_compute_ms"])
        kv = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        if not isinstance(kv, dict):
            raise HTTPError(502, "prefill_bad_reply", "the prefill reply has no kv_transfer_params")
        try:
            return Grant.from_kv_params(kv, len(req.tokens), blocks_needed, received)
        except HTTPError as exc:
            raise HTTPError(502, "prefill_bad_reply", f"unusable prefill reply: {exc.message}") from None

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
            raise HTTPError(502, "incompatible_peer", f"{exc} (field {exc.field})") from None
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

    # ---- introspection ------------------------------------------------------------------

    async def stats(self, request: Request) -> Response:
        engine = self._engine
        return JSONResponse({
            "num_blocks": self.pool.num_blocks,
            "free_blocks": self.pool.free_count,
            "outcomes": dict(self.outcomes),
            "engine": None if engine is None else {
                "name": engine.name, **engine_counts(engine),
                "peers": [{"name": p.name, "address": p.address} for p in engine.peers.values()],
            },
        })

    async def models(self, request: Request) -> Response:
        return JSONResponse(models_body())

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
    parser.add_argument("--blocks", type=int, default=2048, help="KV cache blocks (16 KiB each)")
    parser.add_argument("--idle-poll", type=float, default=DEFAULT_IDLE_POLL_S,
                        help="aionixl.lowlevel.Tuning.idle_poll_interval")
    parser.add_argument("--prefill-timeout", type=float, default=10.0,
                        help="seconds for the direct path's prefill call")
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
