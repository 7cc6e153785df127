"""Write a Hugging Face tokenizer directory whose tokens are the example model's: bytes.

Load generators for OpenAI-compatible servers (AIPerf, for one) size their synthetic
prompts with a tokenizer. The example's model has a 256-token byte vocabulary, so this
builds one with the ``tokenizers`` package (AIPerf installs it): a BPE whose vocabulary is
the 256 byte symbols of the byte-level pre-tokenizer, numbered by byte value, with no merges.

    python benchmarks/byte_tokenizer.py /tmp/bytetok    # then: aiperf profile --tokenizer /tmp/bytetok ...
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def byte_symbols() -> dict[int, str]:
    """The byte-level pre-tokenizer's printable stand-in for each byte (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    symbols = {b: chr(b) for b in printable}
    spare = 256
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(spare)
            spare += 1
    return symbols


def main(argv: list[str]) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    out = Path(argv[0] if argv else "byte-tokenizer")
    out.mkdir(parents=True, exist_ok=True)
    vocab = {symbol: b for b, symbol in byte_symbols().items()}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    sample = "Hello, wörld"
    if tokenizer.encode(sample).ids != list(sample.encode()):
        raise SystemExit("the tokenizer does not map bytes to their values")
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
