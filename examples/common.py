"""Pieces the example servers share: block bookkeeping, engine settings, the OpenAI API shapes, serving."""

from __future__ import annotations

import asyncio
import codecs
import errno
import importlib
import json
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

if TYPE_CHECKING:  # the proxy imports this module and needs neither torch nor NIXL
    import aionixl
    import aionixl.lowlevel

    from .model import ModelConfig

#: Blocks the prefill side keeps for a request whose decode side never confirms the read.
DEFAULT_LEASE_S = 15.0
#: Lower than the engine's 0.1 s default: a quiet engine answers sooner, for ~3 % of a core.
DEFAULT_IDLE_POLL_S = 0.005


class BlockPool:
    """Free-list of cache block ids. Single event-loop thread, so no locking."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first
        self._used: set[int] = set()

    @property
    def free_count(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` distinct free blocks, or None when there are not enough."""
        if count > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(count)]
        self._used.update(blocks)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise RuntimeError(f"block {b} freed twice")
            self._used.remove(b)
            self._free.append(b)


class HTTPError(Exception):
    """A request that ends in a clean error, in OpenAI's shape.

    The body is ``{"error": {"message", "type", "param", "code"}}``. ``code`` carries this
    example's typed cause (``prefill_unavailable``, ``peer_disconnected``, ...), ``type`` is
    OpenAI's coarse class: ``invalid_request_error`` for 4xx, ``server_error`` for 5xx.
    """

    def __init__(self, status: int, code: str, message: str, *, param: str | None = None) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status = status
        self.code = code
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def error_code(body: object) -> tuple[str | None, str]:
    """(code, message) from an OpenAI-shaped error body; (None, "") when it is not one."""
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        code = error.get("code")
        return (code if isinstance(code, str) else None), str(error.get("message", ""))
    return None, ""


async def internal_error(request: Request, exc: Exception) -> Response:
    """Even a bug answers in OpenAI's error shape, so clients parse one kind of error."""
    return HTTPError(500, "internal", repr(exc)).response()


async def read_json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, "bad_request", f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "bad_request", "body must be a JSON object")
    return body


def check_tokens(value: object, config: ModelConfig, max_len: int, param: str = "prompt") -> list[int]:
    """A non-empty list of in-vocabulary token ids no longer than ``max_len``."""
    if not isinstance(value, list) or not value:
        raise HTTPError(400, "bad_request", "the prompt must be a non-empty string or list of token ids",
                        param=param)
    if not all(type(t) is int and 0 <= t < config.vocab_size for t in value):
        raise HTTPError(400, "bad_request",
                        f"token ids must be ints in 0..{config.vocab_size - 1} (byte-level tokens)",
                        param=param)
    if len(value) > max_len:
        raise HTTPError(400, "bad_request", f"{len(value)} prompt tokens, at most {max_len} allowed here "
                        f"(the model has {config.max_positions} positions for prompt plus max_tokens - 1)",
                        param=param)
    return list(value)


# ---- the OpenAI completions API -------------------------------------------------------------

#: The name /v1/models lists and every answer carries.
SERVED_MODEL = "aionixl-tiny-bytes"
#: Upper bound on ``max_tokens`` (the model has 512 positions in all).
MAX_TOKENS = 256
#: OpenAI's default ``max_tokens`` for completions.
DEFAULT_MAX_TOKENS = 16
#: Header carrying the proxy's request id to both servers, as vLLM's P/D proxy does.
REQUEST_ID_HEADER = "x-request-id"
#: Response header with the stage timings (JSON, milliseconds); clients may ignore it.
TIMING_HEADER = "x-aionixl-timing"

#: Parameters OpenAI defines that change nothing here (greedy decoding, no EOS) when left at
#: these values; anything else is refused rather than silently ignored.
_NEUTRAL: dict[str, tuple[object, ...]] = {
    "n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None,),
    "suffix": (None, ""), "stop": (None, [], ""), "presence_penalty": (None, 0),
    "frequency_penalty": (None, 0), "logit_bias": (None, {}),
}


def _same(value: object, allowed: object) -> bool:
    """Equal and of the same kind (0 and 0.0 are; True and 1 are not)."""
    number = (int, float)
    if type(value) in number and type(allowed) in number:
        return value == allowed
    return type(value) is type(allowed) and value == allowed


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """One ``POST /v1/completions`` body, checked."""

    model: str
    tokens: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    return_token_ids: bool
    kv_transfer_params: dict[str, Any] | None


def parse_completion(body: dict[str, Any], config: ModelConfig) -> CompletionRequest:
    """Check a completions request; 400 in OpenAI's shape for anything this model cannot honour.

    Tokens are bytes: a string prompt is its UTF-8 encoding, a list prompt is byte values.
    Decoding is greedy, so ``temperature`` must be 0 (or absent). ``model`` is not checked:
    one model is served and every answer names it.
    """
    model = body.get("model", SERVED_MODEL)
    if not isinstance(model, str):
        raise HTTPError(400, "bad_request", "model must be a string", param="model")
    max_tokens = body.get("max_tokens")
    max_tokens = DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens
    if type(max_tokens) is not int or not 1 <= max_tokens <= MAX_TOKENS:
        raise HTTPError(400, "bad_request", f"max_tokens must be an int in 1..{MAX_TOKENS}",
                        param="max_tokens")
    temperature = body.get("temperature")
    if temperature is not None and (type(temperature) not in (int, float) or temperature != 0):
        raise HTTPError(400, "bad_request", "only greedy decoding is supported: temperature must be 0",
                        param="temperature")
    for name, allowed in _NEUTRAL.items():
        if name in body and not any(_same(body[name], a) for a in allowed):
            raise HTTPError(400, "bad_request", f"{name}={body[name]!r} is not supported by this example "
                            f"(allowed: {', '.join(repr(a) for a in allowed)})", param=name)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        raise HTTPError(400, "bad_request", "one prompt per request (batched prompts are not supported)",
                        param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise HTTPError(400, "bad_request", "the prompt must not be empty", param="prompt")
        prompt = list(prompt.encode())
    tokens = check_tokens(prompt, config, config.max_positions - max_tokens + 1)
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise HTTPError(400, "bad_request", "stream must be true or false", param="stream")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise HTTPError(400, "bad_request", "stream_options is only allowed with stream=true",
                            param="stream_options")
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise HTTPError(400, "bad_request", "stream_options must be {\"include_usage\": bool}",
                            param="stream_options")
        include_usage = options.get("include_usage", False)
    return_token_ids = body.get("return_token_ids")
    if return_token_ids is not None and not isinstance(return_token_ids, bool):
        raise HTTPError(400, "bad_request", "return_token_ids must be true or false",
                        param="return_token_ids")
    kv = body.get("kv_transfer_params")
    if kv is not None and not isinstance(kv, dict):
        raise HTTPError(400, "bad_request", "kv_transfer_params must be an object",
                        param="kv_transfer_params")
    return CompletionRequest(model, tokens, max_tokens, bool(stream), include_usage,
                             bool(return_token_ids), kv)


def request_id_from(request: Request) -> str:
    """The caller's X-Request-Id (the proxy sends one to both servers), or a fresh one."""
    given = request.headers.get(REQUEST_ID_HEADER, "")
    if given:
        if len(given) > 128 or not given.isprintable():
            raise HTTPError(400, "bad_request", "X-Request-Id must be 1..128 printable characters")
        return given
    return uuid.uuid4().hex


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_object(request_id: str, created: int, choices: list[dict[str, Any]],
                      usage_: dict[str, int] | None, **extra: Any) -> dict[str, Any]:
    """A ``text_completion`` object, whole or as one streamed chunk."""
    return {"id": f"cmpl-{request_id}", "object": "text_completion", "created": created,
            "model": SERVED_MODEL, "choices": choices, "usage": usage_, **extra}


def choice(text: str, finish_reason: str | None, token_ids: list[int] | None = None,
           prompt_token_ids: list[int] | None = None) -> dict[str, Any]:
    """One choice; ``token_ids``/``prompt_token_ids`` only when asked (vLLM's ``return_token_ids``)."""
    out: dict[str, Any] = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if prompt_token_ids is not None:
        out["prompt_token_ids"] = prompt_token_ids
    if token_ids is not None:
        out["token_ids"] = token_ids
    return out


def sse(message: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(message, separators=(",", ":")).encode() + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


async def completion_stream(req: CompletionRequest, request_id: str, created: int,
                            tokens: AsyncGenerator[int, None]) -> AsyncGenerator[bytes, None]:
    """Server-sent events: one chunk per token, the usage chunk if asked, then ``[DONE]``.

    Tokens are bytes, and a UTF-8 character may span several: an incremental decoder holds
    partial characters back, so the streamed texts join to exactly the non-streamed text.
    """
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    count = 0
    no_usage: dict[str, Any] = {"usage": None} if req.include_usage else {}
    try:
        async for token in tokens:
            count += 1
            last = count == req.max_tokens
            text = decoder.decode(bytes([token]), final=last)
            chunk = completion_object(request_id, created, [choice(
                text, "length" if last else None, [token] if req.return_token_ids else None,
                req.tokens if req.return_token_ids and count == 1 else None)], None)
            if not req.include_usage:
                del chunk["usage"]
            yield sse(chunk | no_usage)
    finally:
        await tokens.aclose()  # a step still running finishes before the blocks are freed
    if req.include_usage:
        yield sse(completion_object(request_id, created, [], usage(len(req.tokens), count)))
    yield SSE_DONE


def completion_body(req: CompletionRequest, request_id: str, created: int, tokens: list[int],
                    **extra: Any) -> dict[str, Any]:
    """The non-streamed answer."""
    ids = req.return_token_ids
    return completion_object(request_id, created, [choice(
        decode_bytes(tokens), "length", tokens if ids else None, req.tokens if ids else None)],
        usage(len(req.tokens), len(tokens)), **extra)


def decode_bytes(tokens: Sequence[int]) -> str:
    """Byte-level detokenisation: the tokens' bytes as UTF-8, invalid sequences as U+FFFD."""
    return bytes(tokens).decode("utf-8", errors="replace")


def models_body() -> dict[str, Any]:
    return {"object": "list", "data": [{"id": SERVED_MODEL, "object": "model", "created": STARTED,
                                         "owned_by": "aionixl-example", "max_model_len": 512}]}


STARTED = int(time.time())


class ClosingStreamingResponse(StreamingResponse):
    """A stream that closes its generator and runs ``release`` however it ends.

    Starlette may cancel a stream before it starts iterating (the client went away), and an
    async generator that never started runs no ``finally``: the release must not live there.
    """

    def __init__(self, body: AsyncGenerator[bytes, None], release: Callable[[], Awaitable[None] | None],
                 media_type: str = "text/event-stream", headers: dict[str, str] | None = None) -> None:
        super().__init__(body, media_type=media_type, headers=headers)
        self._body = body
        self._release = release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await self._body.aclose()
            finally:
                pending = self._release()
                if pending is not None:
                    await pending


class Metrics:
    """``GET /metrics``: aionixl's Prometheus collector when the optional extra is installed.

    ``aionixl.prometheus`` (the ``aionixl[prometheus]`` extra) provides ``EngineCollector``;
    each server registers it for its engine in a registry of its own. Without the extra the
    route answers 404 and says what to install.
    """

    def __init__(self) -> None:
        self._registry: Any = None
        self._missing = ""
        try:
            self._prometheus = importlib.import_module("aionixl.prometheus")
            self._client = importlib.import_module("prometheus_client")
        except ImportError as exc:
            self._prometheus = self._client = None
            self._missing = str(exc)

    def attach(self, engine: aionixl.Engine) -> None:
        if self._prometheus is not None and self._client is not None:
            registry = self._client.CollectorRegistry()
            registry.register(self._prometheus.EngineCollector(engine))
            self._registry = registry

    def detach(self) -> None:
        self._registry = None

    async def endpoint(self, request: Request) -> Response:
        if self._client is None:
            return HTTPError(404, "metrics_unavailable", "Prometheus metrics need the optional extra "
                             f"aionixl[prometheus] (aionixl.prometheus is not importable: {self._missing})"
                             ).response()
        if self._registry is None:
            return HTTPError(503, "not_ready", "the engine is not open").response()
        return Response(self._client.generate_latest(self._registry),
                        media_type=self._client.CONTENT_TYPE_LATEST)


def engine_config(model: ModelConfig) -> aionixl.EngineConfig:
    """The model's shape goes into the compat keys: engines of different models refuse to pair.
    The handshake secret comes from ``AIONIXL_HANDSHAKE_SECRET`` (16 characters or more, the
    same for both servers): an engine listening beyond loopback refuses to start without one."""
    import aionixl

    secret = os.environ.get("AIONIXL_HANDSHAKE_SECRET")
    return aionixl.EngineConfig(compat={"model": model.fingerprint(), "dtype": "float32"},
                                handshake_secret=secret.encode() if secret else None)


def engine_tuning(idle_poll_s: float) -> aionixl.lowlevel.Tuning:
    """How often an idle engine polls NIXL (``Tuning.idle_poll_interval``)."""
    import aionixl.lowlevel

    return aionixl.lowlevel.Tuning(idle_poll_interval=idle_poll_s)


def engine_counts(engine: aionixl.Engine) -> dict[str, int | bool]:
    """The engine's counts and flags (the number and bool fields of ``metrics()``), JSON-ready."""
    return {key: value for key, value in engine.metrics().as_dict().items() if isinstance(value, (int, bool))}


def quiet_logs() -> None:
    """NIXL logs every agent creation at INFO on stdout; keep stdout for the ready line."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("nixl").setLevel(logging.WARNING)


def bind(host: str, port: int, any_port_if_busy: bool = False) -> socket.socket:
    """A listening TCP socket (port 0 picks one), reusable right after a previous owner died.

    ``proto=IPPROTO_TCP`` matters: asyncio sets TCP_NODELAY only on sockets that say they are
    TCP, and with proto 0 every streamed token after the first waits ~40 ms for a delayed ACK.
    With ``any_port_if_busy`` a port someone else listens on gives way to a free one (the
    ready line says which).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        if not (any_port_if_busy and exc.errno == errno.EADDRINUSE):
            sock.close()
            raise
        print(f"port {port} is in use; listening on a free port instead", file=sys.stderr, flush=True)
        sock.bind((host, 0))
    sock.listen(256)
    return sock


async def serve(app: Starlette, sock: socket.socket, ready_info: Callable[[], dict[str, Any]]) -> int:
    """Run uvicorn on ``sock``; once it accepts requests, print one JSON ``ready`` line.

    Launchers (tests, the load script) wait for that line; uvicorn's own logs go to stderr.
    Returns a process exit status.
    """
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.01)
    if server.started:
        host, port = sock.getsockname()[:2]
        print(json.dumps({"ready": True, "url": f"http://{host}:{port}", "port": port, **ready_info()}),
              flush=True)
    await task
    return 0 if server.started else 1
