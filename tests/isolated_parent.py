"""A process that serves vLLM decoders with ``isolate=True`` and reports its serving child's
pid, then waits to be killed (``tests/test_vllm_isolated.py``):

    python -m tests.isolated_parent
"""

from __future__ import annotations

import sys

import anyio
import numpy as np

import aionixl
import aionixl.vllm


async def main() -> None:
    buf = aionixl.shared_dram(8 * 4096)
    cache = [buf.reshape(8, 4096)]
    async with aionixl.Engine("isolated-parent", cache, listen=None) as engine:
        await aionixl.vllm.serve(engine, engine_id="prefill-0", compat_hash="c0ffee" * 8, block_size=16,
                                 kv_cache_layout="LBHNC", attn_backend_name="CPU_ATTN", isolate=True)
        sidecar = engine._vllm_server.sidecar
        assert sidecar is not None and sidecar.pid is not None
        print(sidecar.pid, flush=True)
        await anyio.sleep_forever()


if __name__ == "__main__":
    np.seterr(all="raise")
    anyio.run(main)
    sys.exit(0)
