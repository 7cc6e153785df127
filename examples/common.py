"""Pieces both example servers share: block bookkeeping, engine settings, JSON errors, serving."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

import aionixl

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
    """A request that ends in a clean JSON error: ``{"error": code, "detail": text}``."""

    def __init__(self, status: int, error: str, detail: str, **extra: Any) -> None:
        super().__init__(f"{status} {error}: {detail}")
        self.status = status
        self.error = error
        self.detail = detail
        self.extra = extra

    def response(self) -> JSONResponse:
        return JSONResponse({"error": self.error, "detail": self.detail, **self.extra},
                            status_code=self.status)


async def internal_error(request: Request, exc: Exception) -> Response:
    """Even a bug answers in JSON, so clients parse one error shape."""
    return JSONResponse({"error": "internal", "detail": repr(exc)}, status_code=500)


async def read_json_object(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (ValueError, UnicodeDecodeError) as exc:
        raise HTTPError(400, "bad_request", f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise HTTPError(400, "bad_request", "body must be a JSON object")
    return body


def check_tokens(value: object, config: ModelConfig, max_len: int) -> list[int]:
    """A non-empty list of in-vocabulary token ids no longer than ``max_len``."""
    if not isinstance(value, list) or not value:
        raise HTTPError(400, "bad_request", "tokens must be a non-empty list of ints")
    if not all(type(t) is int and 0 <= t < config.vocab_size for t in value):
        raise HTTPError(400, "bad_request", f"tokens must be ints in 0..{config.vocab_size - 1}")
    if len(value) > max_len:
        raise HTTPError(400, "bad_request", f"{len(value)} tokens, at most {max_len} allowed")
    return list(value)


def engine_config(model: ModelConfig, idle_poll_s: float) -> aionixl.EngineConfig:
    """The model's shape goes into the compat keys: engines of different models refuse to pair."""
    return aionixl.EngineConfig(compat={"model": model.fingerprint(), "dtype": "float32"},
                                idle_poll_interval=idle_poll_s)


def quiet_logs() -> None:
    """NIXL logs every agent creation at INFO on stdout; keep stdout for the ready line."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("nixl").setLevel(logging.WARNING)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket (port 0 picks one), reusable right after a previous owner died.

    ``proto=IPPROTO_TCP`` matters: asyncio sets TCP_NODELAY only on sockets that say they are
    TCP, and with proto 0 every streamed token after the first waits ~40 ms for a delayed ACK.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
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
