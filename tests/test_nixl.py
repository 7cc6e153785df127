"""The one module that calls NIXL: what it reads from NIXL's metadata without NIXL."""

from __future__ import annotations

import logging

import numpy as np

from aionixl._nixl import NixlAgent, metadata_agent_name

logging.getLogger("nixl").setLevel(logging.WARNING)


def test_agent_name_is_read_from_real_metadata_and_junk_yields_none() -> None:
    agent = NixlAgent("metadata-name-probe", ("UCX",), False)
    try:
        memory = np.zeros(4096, np.uint8)
        agent.register(np.array([[memory.ctypes.data, memory.nbytes, 0]], np.uint64), "DRAM")
        metadata = agent.metadata()
        assert metadata_agent_name(metadata) == "metadata-name-probe"
        start = metadata.index(b"metadata-name-probe")
        broken_name = metadata[:start] + b"\xff" + metadata[start + 1:]
        huge_length = metadata[:start - 8] + (1 << 40).to_bytes(8, "little") + metadata[start:]
        for junk in (b"", b"garbage", metadata[:start + 3], broken_name, huge_length,
                     b"x" + metadata):
            assert metadata_agent_name(junk) is None
        agent.deregister_all()
    finally:
        agent.destroy()
