"""Send prompts to the example with the official ``openai`` client, concurrently, streamed and
not, and check each answer against a single-process run of the same model.

    .venv/bin/python -m examples.client --base-url http://127.0.0.1:8000/v1 "Hello, world" "The quick"

``--base-url`` is the line ``python -m examples.serve`` prints (the proxy), or the decode
server's URL plus ``/v1`` for the direct path.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import openai

from .model import ModelConfig, TinyDecoder, decode, encode, generate_reference, pick_device, setup_torch


async def ask(api: openai.AsyncOpenAI, prompt: str, max_tokens: int,
              stream: bool) -> tuple[list[int], str, float]:
    """(token ids, text, seconds to the first token) of one completion."""
    started = time.perf_counter()
    if not stream:
        answer = await api.completions.create(model="aionixl-tiny-bytes", prompt=prompt,
                                              max_tokens=max_tokens, temperature=0,
                                              extra_body={"return_token_ids": True})
        only = answer.choices[0]
        return only.model_extra["token_ids"], only.text, time.perf_counter() - started
    ids: list[int] = []
    text: list[str] = []
    first = 0.0
    chunks = await api.completions.create(model="aionixl-tiny-bytes", prompt=prompt, max_tokens=max_tokens,
                                          temperature=0, stream=True,
                                          extra_body={"return_token_ids": True})
    async for chunk in chunks:
        first = first or time.perf_counter() - started
        ids += chunk.choices[0].model_extra["token_ids"]
        text.append(chunk.choices[0].text)
    return ids, "".join(text), first


async def run(base_url: str, prompts: list[str], max_tokens: int, device: str) -> int:
    setup_torch()
    model = TinyDecoder(ModelConfig(), pick_device(device))
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as api:
        answers = await asyncio.gather(*(ask(api, p, max_tokens, stream) for p in prompts
                                         for stream in (False, True)), return_exceptions=True)
    failures = 0
    for i, prompt in enumerate(prompts):
        reference = generate_reference(model, encode(prompt), max_tokens)
        for answer, how in zip(answers[2 * i:2 * i + 2], ("plain", "streamed"), strict=True):
            if isinstance(answer, BaseException):
                failures += 1
                print(f"{prompt!r} ({how}): {answer!r}")
                continue
            ids, text, ttft = answer
            same = ids == reference and text == decode(reference)
            failures += not same
            print(f"{prompt!r} ({how}) -> {text!r}\n    tokens {ids}\n"
                  f"    same as the single-process reference: {'yes' if same else 'NO'}; "
                  f"first token after {ttft * 1e3:.1f} ms")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompts", nargs="*", default=["Hello, world", "The quick brown fox jumps"])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="what examples.serve printed")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--device", default="auto", help="where the reference runs; match the servers")
    args = parser.parse_args(argv)
    return asyncio.run(run(args.base_url, args.prompts, args.max_tokens, args.device))


if __name__ == "__main__":
    raise SystemExit(main())
