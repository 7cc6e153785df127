"""A tiny P/D proxy in front of one prefill and one decode server, as vLLM's P/D proxy works.

``POST /v1/completions`` goes twice through:

1. to the prefill server, with ``max_tokens: 1``, ``stream: false`` and
   ``kv_transfer_params: {"do_remote_decode": true, ...}``: it computes the prompt's KV
   cache, leases the blocks and answers with ``kv_transfer_params`` saying where they are;
2. to the decode server, with the client's own body plus those ``kv_transfer_params``:
   it reads the blocks over aionixl and generates. Its answer (JSON or server-sent events)
   passes through byte for byte.

Both calls carry one ``X-Request-Id``. Errors come back in OpenAI's shape: the prefill or
decode server's own (a bad request is refused by the prefill server first), or the
proxy's when a server cannot be reached (503 ``prefill_unavailable`` /
``decode_unavailable``) or drops the connection (502). ``GET /v1/models`` is the decode
server's; ``GET /health`` answers 200 while the proxy runs.

    python -m examples.proxy --port 8000 --prefill-url http://127.0.0.1:8100 \\
        --decode-url http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager, suppress
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .common import (
    REQUEST_ID_HEADER,
    TIMING_HEADER,
    ClosingStreamingResponse,
    HTTPError,
    bind,
    internal_error,
    quiet_logs,
    read_json_object,
    serve,
)

#: What vLLM's proxy sends the prefill instance: "compute the KV cache; a remote decode reads it".
PREFILL_KV_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                     "remote_block_ids": None, "remote_host": None, "remote_port": None}


class Proxy:
    """Forwards completions: prefill first (one token), then decode with its kv_transfer_params."""

    def __init__(self, prefill_url: str, decode_url: str, *, prefill_timeout: float,
                 decode_timeout: float) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.prefill_timeout = prefill_timeout
        self.decode_timeout = decode_timeout
        self._http: httpx.AsyncClient | None = None
        self.app = Starlette(routes=[
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
        ], lifespan=self.lifespan, exception_handlers={Exception: internal_error})

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=self.decode_timeout) as http:
            self._http = http
            try:
                yield
            finally:
                self._http = None

    @property
    def http(self) -> httpx.AsyncClient:
        if self._http is None:
            raise HTTPError(503, "shutting_down", "the proxy is stopping")
        return self._http

    async def completions(self, request: Request) -> Response:
        t0 = time.perf_counter()
        try:
            body = await read_json_object(request)
            request_id = uuid.uuid4().hex
            headers = {REQUEST_ID_HEADER: request_id}
            prefill_body = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": PREFILL_KV_PARAMS}
            for unused in ("stream_options", "min_tokens"):
                prefill_body.pop(unused, None)
            reply = await self._call("prefill", self.http.build_request(
                "POST", f"{self.prefill_url}/v1/completions", json=prefill_body, headers=headers,
                timeout=self.prefill_timeout))
            prefill_ms = (time.perf_counter() - t0) * 1e3
            if reply.status_code != 200:
                return await _relay_whole(reply)
            await reply.aread()
            kv = _kv_transfer_params(reply)
            timing: dict[str, Any] = {"proxy_prefill_ms": round(prefill_ms, 3)}
            with suppress(ValueError, TypeError):
                timing.update(json.loads(reply.headers.get(TIMING_HEADER, "{}")))
            decoded = await self._call("decode", self.http.build_request(
                "POST", f"{self.decode_url}/v1/completions", json={**body, "kv_transfer_params": kv},
                headers=headers))
        except HTTPError as exc:
            return exc.response()
        if decoded.status_code != 200:
            return await _relay_whole(decoded)
        with suppress(ValueError, TypeError):
            timing.update(json.loads(decoded.headers.get(TIMING_HEADER, "{}")))
        timing["proxy_ttft_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        return ClosingStreamingResponse(_passthrough(decoded), decoded.aclose,
                                        media_type=decoded.headers.get("content-type", "application/json"),
                                        headers={TIMING_HEADER: json.dumps(timing)})

    async def _call(self, role: str, outgoing: httpx.Request) -> httpx.Response:
        """Send, streaming the answer; unreachable -> 503, dropped midway -> 502 (OpenAI's shape)."""
        url = self.prefill_url if role == "prefill" else self.decode_url
        try:
            return await self.http.send(outgoing, stream=True)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            raise HTTPError(503, f"{role}_unavailable", f"cannot reach the {role} server at {url}: {exc!r}"
                            ) from None
        except httpx.HTTPError as exc:
            raise HTTPError(502, f"{role}_failed", f"{role} request to {url} failed: {exc!r}") from None

    async def models(self, request: Request) -> Response:
        try:
            reply = await self._call("decode", self.http.build_request("GET", f"{self.decode_url}/v1/models"))
        except HTTPError as exc:
            return exc.response()
        return await _relay_whole(reply)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"ok": self._http is not None, "role": "proxy", "prefill_url": self.prefill_url,
                             "decode_url": self.decode_url})

    def ready_info(self) -> dict[str, Any]:
        return {"role": "proxy", "prefill_url": self.prefill_url, "decode_url": self.decode_url}


def _kv_transfer_params(reply: httpx.Response) -> dict[str, Any]:
    try:
        kv = reply.json().get("kv_transfer_params")
    except (ValueError, AttributeError):
        kv = None
    if not isinstance(kv, dict):
        raise HTTPError(502, "prefill_bad_reply", "the prefill server's answer has no kv_transfer_params")
    return kv


async def _relay_whole(reply: httpx.Response) -> Response:
    """An upstream answer that is not a stream to pass on (an error, say), status and all."""
    try:
        content = await reply.aread()
    except httpx.HTTPError as exc:
        return HTTPError(502, "upstream_failed", f"reading {reply.url} failed: {exc!r}").response()
    finally:
        await reply.aclose()
    return Response(content, status_code=reply.status_code,
                    media_type=reply.headers.get("content-type", "application/json"))


async def _passthrough(reply: httpx.Response) -> AsyncGenerator[bytes, None]:
    """The decode server's answer as it comes. Should the decode server die midway, the error
    propagates and the client's connection is cut: a truncated answer must not look whole."""
    async for chunk in reply.aiter_raw():
        yield chunk


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one")
    parser.add_argument("--any-port-if-busy", action="store_true",
                        help="listen on a free port when --port is taken (the ready line says which)")
    parser.add_argument("--prefill-url", default="http://127.0.0.1:8100")
    parser.add_argument("--decode-url", default="http://127.0.0.1:8200")
    parser.add_argument("--prefill-timeout", type=float, default=10.0, help="seconds for the prefill call")
    parser.add_argument("--decode-timeout", type=float, default=30.0,
                        help="seconds for the decode server's answer to start, and between its chunks")
    args = parser.parse_args(argv)
    quiet_logs()
    proxy = Proxy(args.prefill_url, args.decode_url, prefill_timeout=args.prefill_timeout,
                  decode_timeout=args.decode_timeout)
    return asyncio.run(serve(proxy.app, bind(args.host, args.port, args.any_port_if_busy), proxy.ready_info))


if __name__ == "__main__":
    raise SystemExit(main())
