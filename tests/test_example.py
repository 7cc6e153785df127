"""The prefill/decode example servers (examples/) as two real processes on loopback.

Concurrent requests must come back token for token equal to a single-process run of the
same model, the prefill side's blocks must all be free again afterwards, bad requests and
a dead prefill server must give clean JSON errors, and the decode server must survive it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from examples import launch
from examples.model import ModelConfig, TinyDecoder, encode, generate_reference, pick_device, setup_torch

pytestmark = pytest.mark.anyio

MAX_NEW = 12
DEVICE = str(pick_device("auto"))


@pytest.fixture
def anyio_backend() -> str:
    """The servers are asyncio applications; the client side needs no second backend here."""
    return "asyncio"


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[launch.ServerProcess,
                                                                            launch.ServerProcess]]:
    logs = tmp_path_factory.mktemp("example-logs")
    started: list[launch.ServerProcess] = []
    try:
        prefill = launch.start("prefill", ["--port", "0", "--device", DEVICE, "--blocks", "256",
                                           "--lease", "10"], logs / "prefill.log", ready_timeout=45)
        started.append(prefill)
        decode = launch.start("decode", ["--port", "0", "--device", DEVICE, "--prefill-url", prefill.url,
                                         "--connect-timeout", "5", "--transfer-timeout", "5"],
                              logs / "decode.log", ready_timeout=45)
        started.append(decode)
        yield prefill, decode
    finally:
        for server in reversed(started):
            server.stop(grace=5)


@pytest.fixture(scope="module")
def model() -> TinyDecoder:
    setup_torch()
    return TinyDecoder(ModelConfig(), DEVICE)


def prompts(count: int, seed: int = 5) -> list[str]:
    """Lengths from one token to several blocks, so reads move 1..7 blocks."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz ,.!?"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, 100))) for _ in range(count)]


async def poll_json(client: httpx.AsyncClient, url: str, until: Any, deadline_s: float) -> dict[str, Any]:
    """GET ``url`` until ``until(body)`` holds; returns the last body (the caller asserts)."""
    deadline = time.monotonic() + deadline_s
    while True:
        body: dict[str, Any] = (await client.get(url)).json()
        if until(body) or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.05)


async def test_concurrent_requests_match_the_single_process_reference(servers: Any,
                                                                      model: TinyDecoder) -> None:
    prefill, decode = servers
    texts = prompts(24)
    async with httpx.AsyncClient(base_url=decode.url, timeout=30) as client:
        replies = await asyncio.gather(*(
            client.post("/generate", json={"prompt": t, "max_new_tokens": MAX_NEW, "stream": i % 2 == 1})
            for i, t in enumerate(texts)))
        for i, (text, reply) in enumerate(zip(texts, replies, strict=True)):
            assert reply.status_code == 200, reply.text
            if i % 2:  # NDJSON: one line per token, then the summary
                lines = [json.loads(line) for line in reply.text.splitlines()]
                body = lines[-1]
                assert [m["token"] for m in lines[:-1]] == body["tokens"]
            else:
                body = reply.json()
            assert body["tokens"] == generate_reference(model, encode(text), MAX_NEW), text
            assert body["blocks_read"] == model.blocks_for(len(encode(text)))
        stats = (await client.get("/stats")).json()
        assert stats["free_blocks"] == stats["num_blocks"]
        assert [p["address"] for p in stats["engine"]["peers"]] == [prefill.info["engine_address"]]

        # Every read carried its notification: the prefill side freed each lease on it.
        pstats = await poll_json(client, f"{prefill.url}/stats",
                                 lambda s: s["free_blocks"] == s["num_blocks"], 10)
        assert pstats["free_blocks"] == pstats["num_blocks"] == 256
        assert pstats["active_leases"] == 0
        assert pstats["freed_on_notification"] >= len(texts)
        assert pstats["freed_on_lease_timeout"] == 0


@pytest.mark.parametrize(("body", "detail"), [
    (b"{not json", "not JSON"),
    (b"[1, 2]", "JSON object"),
    (b'{"tokens": []}', "non-empty list"),
    (b'{"tokens": [1, 256]}', "0..255"),
    (b'{"prompt": "hi", "max_new_tokens": 0}', "max_new_tokens"),
    (b'{"prompt": "hi", "stream": "yes"}', "stream"),
    (b'{"tokens": [7, 7, 7], "max_new_tokens": 500}', "max_new_tokens"),
])
async def test_bad_requests_get_a_json_400(servers: Any, body: bytes, detail: str) -> None:
    _, decode = servers
    async with httpx.AsyncClient(base_url=decode.url, timeout=10) as client:
        reply = await client.post("/generate", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400
        assert reply.json()["error"] == "bad_request"
        assert detail in reply.json()["detail"]
        stats = (await client.get("/stats")).json()
        assert stats["free_blocks"] == stats["num_blocks"]


async def test_prompt_too_long_for_the_model(servers: Any) -> None:
    _, decode = servers
    too_long = ModelConfig().max_positions
    async with httpx.AsyncClient(base_url=decode.url, timeout=10) as client:
        reply = await client.post("/generate", json={"tokens": [1] * too_long, "max_new_tokens": 2})
        assert reply.status_code == 400 and "at most" in reply.json()["detail"]


async def test_unread_blocks_are_freed_when_the_lease_ends(servers: Any) -> None:
    """Nobody reads these blocks, so no notification comes: the lease timeout frees them."""
    prefill, _ = servers
    async with httpx.AsyncClient(base_url=prefill.url, timeout=10) as client:
        before = (await client.get("/stats")).json()
        grant = await client.post("/prefill", json={"request_id": "never-read", "tokens": [3] * 40,
                                                    "lease_s": 0.3})
        assert grant.status_code == 200, grant.text
        assert len(grant.json()["blocks"]) == 3
        after = await poll_json(client, "/stats", lambda s: s["free_blocks"] == s["num_blocks"], 10)
        assert after["free_blocks"] == after["num_blocks"]
        assert after["freed_on_lease_timeout"] == before["freed_on_lease_timeout"] + 1
        bad = await client.post("/prefill", json={"request_id": "x", "tokens": [1], "lease_s": 1e6})
        assert bad.status_code == 400 and bad.json()["error"] == "bad_request"


async def test_dead_prefill_server_gives_503_and_decode_survives(servers: Any, model: TinyDecoder,
                                                               tmp_path: Path) -> None:
    """Last in the module: it kills the prefill server, then starts a new one on the same port."""
    prefill, decode = servers
    prefill.kill()
    async with httpx.AsyncClient(base_url=decode.url, timeout=15) as client:
        started = time.monotonic()
        reply = await client.post("/generate", json={"prompt": "anyone there?", "max_new_tokens": 4})
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"] == "prefill_unavailable"
        assert time.monotonic() - started < 5
        assert (await client.get("/health")).status_code == 200
        assert decode.alive()
        stats = (await client.get("/stats")).json()
        assert stats["free_blocks"] == stats["num_blocks"]

        # A new prefill process on the same HTTP port: its engine has a new address and
        # name, so the decode server handshakes afresh and serves again.
        args = ["--port", str(prefill.port), "--device", DEVICE, "--blocks", "256"]
        restarted = launch.start("prefill", args, prefill.log_path, ready_timeout=45)
        try:
            text = "back again"
            reply = await client.post("/generate", json={"prompt": text, "max_new_tokens": MAX_NEW})
            assert reply.status_code == 200, reply.text
            assert reply.json()["tokens"] == generate_reference(model, encode(text), MAX_NEW)
            assert reply.json()["prefill_engine"] == restarted.info["engine_name"]
        finally:
            restarted.stop(grace=5)
