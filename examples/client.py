"""Send prompts to the decode server concurrently and check each answer against a
single-process run of the same model.

    .venv/bin/python -m examples.client "Hello, world" "The quick brown fox"
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import httpx

from .model import ModelConfig, TinyDecoder, decode, encode, generate_reference, pick_device, setup_torch


async def ask(client: httpx.AsyncClient, prompt: str, max_new_tokens: int) -> tuple[int, dict[str, Any]]:
    reply = await client.post("/generate", json={"prompt": prompt, "max_new_tokens": max_new_tokens})
    return reply.status_code, reply.json()


async def run(url: str, prompts: list[str], max_new_tokens: int, device: str) -> int:
    setup_torch()
    model = TinyDecoder(ModelConfig(), pick_device(device))
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        answers = await asyncio.gather(*(ask(client, p, max_new_tokens) for p in prompts))
    failures = 0
    for prompt, (status, body) in zip(prompts, answers, strict=True):
        if status != 200:
            failures += 1
            print(f"{prompt!r}: HTTP {status} {body}")
            continue
        same = body["tokens"] == generate_reference(model, encode(prompt), max_new_tokens)
        failures += not same
        t = body["timing"]
        print(f"{prompt!r} -> {decode(body['tokens'])!r}\n"
              f"    tokens {body['tokens']}\n"
              f"    same as the single-process reference: {'yes' if same else 'NO'}; "
              f"ttft {t['ttft_ms']:.1f} ms (prefill {t['prefill_ms']:.1f}, connect {t['connect_ms']:.1f}, "
              f"read of {body['blocks_read']} blocks {t['transfer_ms']:.2f}), total {t['total_ms']:.1f} ms")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", nargs="*", default=["Hello, world", "The quick brown fox jumps"])
    parser.add_argument("--url", default="http://127.0.0.1:8200", help="the decode server")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--device", default="auto", help="where the reference runs; match the servers")
    args = parser.parse_args(argv)
    return asyncio.run(run(args.url, args.prompts, args.max_new_tokens, args.device))


if __name__ == "__main__":
    raise SystemExit(main())
