"""``import aionixl`` does not import torch (about a second and 240 MB per process).

NIXL's ``nixl`` package imports torch to find out which CUDA build of its bindings to load;
aionixl loads the bindings module directly (``aionixl._nixl.find_bindings``). Checked in a
fresh interpreter: any other test that imports torch would hide it in this one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

IMPORTS = """
import sys
import aionixl
import aionixl.vllm
assert "torch" not in sys.modules, "import aionixl imported torch"
assert "nixl" not in sys.modules, "import aionixl imported the nixl package"
assert "vllm" not in sys.modules, "import aionixl imported vLLM (only aionixl.vllm_connector may)"
print("ok")
"""

ENGINE_PAIR = """
import sys

import anyio
import numpy as np

import aionixl


async def main() -> None:
    blocks, block_bytes = 16, 4096
    src = [np.random.default_rng(i).integers(0, 255, (blocks, block_bytes), dtype=np.uint8)
           for i in range(2)]
    dst = [np.zeros((blocks, block_bytes), np.uint8) for _ in range(2)]
    async with aionixl.Engine("import-check-a", src, listen="tcp://127.0.0.1:0") as a, \\
            aionixl.Engine("import-check-b", dst) as b:
        assert a.address is not None
        peer = await b.connect(a.address)
        await b.transfer_blocks(peer, [0, 3, 5], [7, 8, 15])
        await b.transfer_blocks(peer, [9], [1], op="read")
        for d, s in zip(dst, src, strict=True):
            assert (d[[0, 3, 5]] == s[[7, 8, 15]]).all() and (d[9] == s[1]).all()
    assert "torch" not in sys.modules, "an engine pair over numpy arrays imported torch"
    print("ok")


anyio.run(main)
"""


def _run(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("UCX_TLS", None)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120, env=env)


def test_import_aionixl_does_not_import_torch() -> None:
    proc = _run(IMPORTS)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr


def test_an_engine_pair_over_numpy_never_imports_torch() -> None:
    proc = _run(ENGINE_PAIR)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout + proc.stderr
