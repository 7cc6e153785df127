"""Record the Hello an engine really sends, as a sniffer on the wire would see it.

Shared by the hostile-input tests and the listener fuzz script: both replay or mutate a
real engine's handshake.
"""

from __future__ import annotations

from contextlib import suppress

import zmq
from anyio.from_thread import BlockingPortal

import aionixl
from aionixl import _protocol as proto


def record_hello(portal: BlockingPortal, engine: aionixl.Engine, limit: int = 1 << 30) -> proto.Hello:
    """Let ``engine`` (driven by ``portal``'s event loop) connect to a fake listener that
    keeps its Hello and refuses it (a final refusal, so the engine does not retry)."""
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:0")
    address = router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def connect() -> None:
        with suppress(aionixl.HandshakeError):
            await engine.connect(address, timeout=5)

    try:
        future = portal.start_task_soon(connect)
        if not router.poll(10_000):
            raise RuntimeError("the engine sent no hello")
        identity, data, *_ = router.recv_multipart()
        router.send_multipart([identity, proto.encode(proto.Reject(1, "bad-request", "recorded"))])
        future.result(timeout=10)
    finally:
        router.close(0)
    return proto.decode_hello(data, limit)
