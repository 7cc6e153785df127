"""The prefill/decode example (examples/) as real processes on loopback, driven by the
official ``openai`` client through the P/D proxy and directly at the decode server.

Answers must be token for token what one process running the same model computes, the
streamed text must join to the non-streamed text, usage must count right, bad requests
must get OpenAI-shaped 400s, every leased block must come back, a dead prefill server must
give a 503 in OpenAI's shape that the decode server survives, and ``python -m
examples.serve`` must print a base URL that a plain ``openai.OpenAI`` client can use.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from examples import launch
from examples.common import decode_bytes
from examples.model import ModelConfig, TinyDecoder, encode, generate_reference, pick_device, setup_torch

pytestmark = pytest.mark.anyio

MAX_TOKENS = 12
DEVICE = str(pick_device("auto"))
OPENAI_ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture
def anyio_backend() -> str:
    """The servers are asyncio applications; the client side needs no second backend here."""
    return "asyncio"


Servers = tuple[launch.ServerProcess, launch.ServerProcess, launch.ServerProcess]


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Prefill, decode (pointed at prefill for its direct path) and the proxy in front of both."""
    logs = tmp_path_factory.mktemp("example-logs")
    started: list[launch.ServerProcess] = []
    try:
        prefill_url = f"http://127.0.0.1:{launch.free_port()}"
        started += launch.start_all([
            ("prefill", ["--port", prefill_url.rsplit(":", 1)[1], "--device", DEVICE, "--blocks", "256",
                         "--lease", "10"], logs / "prefill.log"),
            ("decode", ["--port", "0", "--device", DEVICE, "--prefill-url", prefill_url,
                        "--connect-timeout", "5", "--transfer-timeout", "5"], logs / "decode.log"),
        ], ready_timeout=45)
        prefill, decode = started
        proxy = launch.start("proxy", ["--port", "0", "--prefill-url", prefill.url,
                                       "--decode-url", decode.url], logs / "proxy.log", ready_timeout=45)
        started.append(proxy)
        yield prefill, decode, proxy
    finally:
        for server in reversed(started):
            server.stop(grace=5)


@pytest.fixture(scope="module")
def model() -> TinyDecoder:
    setup_torch()
    return TinyDecoder(ModelConfig(), DEVICE)


def client(server: launch.ServerProcess) -> openai.AsyncOpenAI:
    """No retries: a failure must show, not be papered over."""
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=30)


def prompts(count: int, seed: int = 5) -> list[str]:
    """Lengths from one token to several blocks, so reads move 1..7 blocks; some multi-byte UTF-8."""
    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz ,.!?é✓"
    return ["".join(rng.choice(letters) for _ in range(rng.randint(1, 60))) for _ in range(count)]


async def poll_json(http: httpx.AsyncClient, url: str, until: Any, deadline_s: float) -> dict[str, Any]:
    """GET ``url`` until ``until(body)`` holds; returns the last body (the caller asserts)."""
    deadline = time.monotonic() + deadline_s
    while True:
        body: dict[str, Any] = (await http.get(url)).json()
        if until(body) or time.monotonic() > deadline:
            return body
        await asyncio.sleep(0.05)


async def complete(api: openai.AsyncOpenAI, prompt: str | list[int]) -> tuple[str, list[int], Any]:
    """Non-streamed: (text, token ids, usage)."""
    answer = await api.completions.create(model="aionixl-tiny-bytes", prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, extra_body={"return_token_ids": True})
    [only] = answer.choices
    assert only.finish_reason == "length" and answer.object == "text_completion"
    return only.text, only.model_extra["token_ids"], answer.usage


async def complete_streamed(api: openai.AsyncOpenAI, prompt: str | list[int]) -> tuple[str, list[int], Any]:
    """Streamed with include_usage: (joined text, token ids, the usage chunk's usage)."""
    stream = await api.completions.create(model="aionixl-tiny-bytes", prompt=prompt, max_tokens=MAX_TOKENS,
                                          temperature=0, stream=True, stream_options={"include_usage": True},
                                          extra_body={"return_token_ids": True})
    chunks = [chunk async for chunk in stream]
    *tokens, usage_chunk = chunks
    assert usage_chunk.choices == [] and all(c.usage is None for c in tokens)
    assert [c.choices[0].finish_reason for c in tokens] == [None] * (MAX_TOKENS - 1) + ["length"]
    ids = [t for c in tokens for t in c.choices[0].model_extra["token_ids"]]
    return "".join(c.choices[0].text for c in tokens), ids, usage_chunk.usage


async def test_openai_client_concurrent_completions_match_the_reference(servers: Servers,
                                                                        model: TinyDecoder) -> None:
    """Each prompt streamed and not, through the proxy and directly, all at once."""
    prefill, decode, proxy = servers
    texts: list[str | list[int]] = [*prompts(8), [0, 255, 128, 10], [65] * 33]
    async with client(proxy) as via_proxy, client(decode) as direct:
        calls = [fn(api, p) for p in texts for fn in (complete, complete_streamed)
                 for api in (via_proxy, direct)]
        answers = await asyncio.gather(*calls)
    for i, prompt in enumerate(texts):
        tokens = prompt if isinstance(prompt, list) else encode(prompt)
        reference = generate_reference(model, tokens, MAX_TOKENS)
        plain, streamed, plain_direct, streamed_direct = answers[4 * i:4 * i + 4]
        for text, ids, usage in (plain, streamed, plain_direct, streamed_direct):
            assert ids == reference, prompt
            assert text == decode_bytes(reference) == plain[0]
            assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (
                len(tokens), MAX_TOKENS, len(tokens) + MAX_TOKENS)

    async with httpx.AsyncClient(timeout=10) as http:
        stats = (await http.get(f"{decode.url}/stats")).json()
        assert stats["free_blocks"] == stats["num_blocks"]
        assert stats["outcomes"] == {"ok": len(calls)}
        assert [p["address"] for p in stats["engine"]["peers"]] == [prefill.info["engine_address"]]
        # Every read carried its notification: the prefill side freed each lease on it.
        pstats = await poll_json(http, f"{prefill.url}/stats",
                                 lambda s: s["free_blocks"] == s["num_blocks"], 10)
        assert pstats["free_blocks"] == pstats["num_blocks"] == 256
        assert pstats["active_leases"] == 0
        assert pstats["freed_on_notification"] == len(calls)
        assert pstats["freed_on_lease_timeout"] == 0


BAD_REQUESTS = [
    (b"{not json", None, "not JSON"),
    (b"[1, 2]", None, "JSON object"),
    (b'{"prompt": ""}', "prompt", "empty"),
    (b'{"prompt": [1, 256]}', "prompt", "0..255"),
    (b'{"prompt": ["a", "b"]}', "prompt", "one prompt"),
    (b'{"prompt": "hi", "max_tokens": 0}', "max_tokens", "max_tokens"),
    (b'{"prompt": "hi", "max_tokens": 500}', "max_tokens", "max_tokens"),
    (b'{"prompt": "hi", "temperature": 0.7}', "temperature", "temperature must be 0"),
    (b'{"prompt": "hi", "n": 2}', "n", "not supported"),
    (b'{"prompt": "hi", "stream": "yes"}', "stream", "stream"),
    (b'{"prompt": "hi", "stream_options": {"include_usage": true}}', "stream_options", "stream=true"),
    (json.dumps({"prompt": [7] * 400, "max_tokens": 200, "stream": True}).encode(), "prompt", "at most 313"),
    (b'{"prompt": [7], "kv_transfer_params": {"do_remote_prefill": true, "remote_block_ids": [0],'
     b' "remote_num_tokens": 9}}', "kv_transfer_params", "this prompt has 1 tokens"),
]


@pytest.mark.parametrize(("body", "param", "detail"), BAD_REQUESTS)
async def test_bad_requests_get_openai_shaped_400s(servers: Servers, body: bytes, param: str | None,
                                                   detail: str) -> None:
    """Straight at the decode server; nothing is allocated for them."""
    _, decode, _ = servers
    async with httpx.AsyncClient(base_url=decode.url, timeout=10) as http:
        reply = await http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert set(error) == OPENAI_ERROR_KEYS
        assert error["type"] == "invalid_request_error" and error["param"] == param
        assert detail in error["message"]
        stats = (await http.get("/stats")).json()
        assert stats["free_blocks"] == stats["num_blocks"]


async def test_bad_requests_through_the_proxy_raise_openai_errors(servers: Servers) -> None:
    """The openai client turns the relayed 400 into BadRequestError with OpenAI's error body."""
    async with client(servers[2]) as api:
        with pytest.raises(openai.BadRequestError) as caught:
            await api.completions.create(model="x", prompt="hi", temperature=1.0)
        assert caught.value.status_code == 400
        assert caught.value.body == {"message": "only greedy decoding is supported: temperature must be 0",
                                     "type": "invalid_request_error", "param": "temperature",
                                     "code": "bad_request"}
        with pytest.raises(openai.BadRequestError) as caught:
            await api.completions.create(model="x", prompt=[1, 999])
        assert caught.value.body["param"] == "prompt"


async def test_models_health_and_metrics(servers: Servers) -> None:
    prefill, decode, proxy = servers
    for server in (decode, proxy):
        async with client(server) as api:
            models = await api.models.list()
        assert [m.id for m in models.data] == ["aionixl-tiny-bytes"]
    # /metrics needs prometheus_client (the aionixl[prometheus] extra): aionixl.prometheus, the
    # module itself, ships with aionixl and is always found. The servers run this Python.
    have_prometheus = importlib.util.find_spec("prometheus_client") is not None
    async with httpx.AsyncClient(timeout=10) as http:
        for server in servers:
            assert (await http.get(f"{server.url}/health")).json()["ok"] is True
        for server in (prefill, decode):
            reply = await http.get(f"{server.url}/metrics")
            if have_prometheus:
                assert reply.status_code == 200 and "aionixl_" in reply.text
            else:
                assert reply.status_code == 404
                assert reply.json()["error"]["code"] == "metrics_unavailable"
                assert "aionixl[prometheus]" in reply.json()["error"]["message"]


async def test_metrics_without_prometheus_client_answer_404_naming_the_extra(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The servers' /metrics where prometheus_client is not installed (the other branch of the
    test above): a fresh import of aionixl.prometheus fails, as it would there."""
    from starlette.requests import Request

    from examples.common import Metrics

    monkeypatch.delitem(sys.modules, "aionixl.prometheus", raising=False)
    for name in [n for n in sys.modules if n == "prometheus_client" or n.startswith("prometheus_client.")]:
        monkeypatch.setitem(sys.modules, name, None)  # importing it fails, as where it is missing
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    reply = await Metrics().endpoint(Request({"type": "http", "method": "GET", "path": "/metrics",
                                              "headers": []}))
    assert reply.status_code == 404
    error = json.loads(bytes(reply.body))["error"]
    assert error["code"] == "metrics_unavailable"
    assert "aionixl[prometheus]" in error["message"] and "prometheus_client" in error["message"]


async def test_prefill_hands_back_kv_transfer_params_and_frees_unread_blocks(servers: Servers,
                                                                            model: TinyDecoder) -> None:
    """vLLM's prefill step by hand; nobody reads the blocks, so the lease timeout frees them."""
    prefill, _, _ = servers
    tokens = [3] * 40
    async with httpx.AsyncClient(base_url=prefill.url, timeout=10) as http:
        before = (await http.get("/stats")).json()
        reply = await http.post("/v1/completions", headers={"X-Request-Id": "never-read"}, json={
            "model": "m", "prompt": tokens, "max_tokens": 1, "stream": False,
            "kv_transfer_params": {"do_remote_decode": True, "remote_block_ids": None, "lease_s": 0.3}})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        kv = body["kv_transfer_params"]
        first = generate_reference(model, tokens, 1)
        assert kv["do_remote_prefill"] is True and kv["do_remote_decode"] is False
        assert kv["remote_engine_id"] == prefill.info["engine_name"]
        assert kv["remote_handshake_address"] == prefill.info["engine_address"]
        assert f"tcp://{kv['remote_host']}:{kv['remote_port']}" == prefill.info["engine_address"]
        assert len(kv["remote_block_ids"]) == 3 and kv["remote_num_tokens"] == 40
        assert kv["remote_request_id"] == "never-read" and kv["remote_notify"] == "never-read:1"
        assert [kv["first_token_id"]] == first and body["choices"][0]["text"] == decode_bytes(first)
        assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 1, "total_tokens": 41}
        after = await poll_json(http, "/stats", lambda s: s["free_blocks"] == s["num_blocks"], 10)
        assert after["free_blocks"] == after["num_blocks"]
        assert after["freed_on_lease_timeout"] == before["freed_on_lease_timeout"] + 1

        # Without do_remote_decode nothing is leased.
        plain = await http.post("/v1/completions", json={"prompt": tokens, "max_tokens": 1})
        assert plain.status_code == 200 and plain.json()["kv_transfer_params"] is None
        assert (await http.get("/stats")).json()["active_leases"] == 0
        for bad, param in [({"max_tokens": 2}, "max_tokens"),
                           ({"kv_transfer_params": {"do_remote_decode": True, "lease_s": 1e6}},
                            "kv_transfer_params")]:
            reply = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, **bad})
            assert reply.status_code == 400 and reply.json()["error"]["param"] == param


async def test_dead_prefill_server_gives_503_and_decode_survives(servers: Servers,
                                                                 model: TinyDecoder) -> None:
    """Last of the module's server tests: it kills the prefill server, then starts a new one
    on the same port."""
    prefill, decode, proxy = servers
    prefill.kill()
    for server in (proxy, decode):
        started = time.monotonic()
        async with client(server) as api:
            with pytest.raises(openai.InternalServerError) as caught:
                await api.completions.create(model="m", prompt="anyone there?", max_tokens=4)
        assert caught.value.status_code == 503
        assert caught.value.body["code"] == "prefill_unavailable"
        assert set(caught.value.body) == OPENAI_ERROR_KEYS and caught.value.body["type"] == "server_error"
        assert time.monotonic() - started < 5
    async with httpx.AsyncClient(base_url=decode.url, timeout=15) as http:
        assert (await http.get("/health")).status_code == 200
        assert decode.alive()
        stats = (await http.get("/stats")).json()
        assert stats["free_blocks"] == stats["num_blocks"]

        # A new prefill process on the same HTTP port: its engine has a new address and
        # name, so the decode server handshakes afresh and serves again.
        args = ["--port", str(prefill.port), "--device", DEVICE, "--blocks", "256"]
        restarted = launch.start("prefill", args, prefill.log_path, ready_timeout=45)
        try:
            async with client(proxy) as api:
                text, ids, _ = await complete_streamed(api, "back again")
            assert ids == generate_reference(model, encode("back again"), MAX_TOKENS)
            assert text == decode_bytes(ids)
            peers = [p["address"] for p in (await http.get("/stats")).json()["engine"]["peers"]]
            assert restarted.info["engine_address"] in peers
        finally:
            restarted.stop(grace=5)


def test_serve_prints_a_base_url_that_openai_clients_use(tmp_path: Path, model: TinyDecoder) -> None:
    """What a user (or a held-out script) does: start ``python -m examples.serve``, read the
    ``base_url:`` line, send concurrent completions with plain ``openai.OpenAI``, stop it."""
    command = [sys.executable, "-m", "examples.serve", "--device", DEVICE, "--logs", str(tmp_path)]
    proc = subprocess.Popen(command, cwd=launch.ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        base_url = _read_base_url(proc, deadline_s=90)
        api = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=30)
        texts = prompts(6, seed=11)

        def plain(prompt: str) -> tuple[str, int]:
            answer = api.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
            assert answer.usage is not None
            return answer.choices[0].text, answer.usage.completion_tokens

        def streamed(prompt: str) -> tuple[str, int]:
            chunks = list(api.completions.create(model="m", prompt=prompt, max_tokens=MAX_TOKENS, stream=True,
                                                 stream_options={"include_usage": True}))
            assert chunks[-1].usage is not None
            return "".join(c.choices[0].text for c in chunks if c.choices), chunks[-1].usage.completion_tokens

        with ThreadPoolExecutor(8) as pool:
            plain_answers = list(pool.map(plain, texts))
            streamed_answers = list(pool.map(streamed, texts))
        for text, a, b in zip(texts, plain_answers, streamed_answers, strict=True):
            assert a == b == (decode_bytes(generate_reference(model, encode(text), MAX_TOKENS)), MAX_TOKENS)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0
    with pytest.raises(httpx.ConnectError):  # the proxy went with it
        httpx.get(f"{base_url}/models", timeout=5)


def _read_base_url(proc: subprocess.Popen[str], deadline_s: float) -> str:
    """The ``base_url: URL`` line serve prints once every server is ready."""
    assert proc.stdout is not None
    deadline = time.monotonic() + deadline_s
    seen: list[str] = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith("base_url: "):
            return line.split(maxsplit=1)[1].strip()
        if time.monotonic() > deadline:
            break
    raise AssertionError(f"no base_url line (exit {proc.poll()}):\n{''.join(seen)}")
