"""aionixl on the P/D request workload: asyncio, trio, or asyncio on uvloop.

One step runs in one event loop (``anyio.run``): a fresh ``Engine`` (default config), a
connect, a warm-up read, then the requests. A dispatcher task paces the arrivals (it sleeps
until shortly before each one, then yields until its time: the pacer every contender
shares), takes the request's blocks from the pool (waiting, FIFO, when it is empty) and
starts one task per request, as a server does per incoming request, the event loop's own
way (:func:`_request_tasks`); the task reads the request's blocks in one
``transfer_blocks`` call with its notification and records the completion the moment the
call returns. Closed loop (saturation): ``concurrency`` tasks, each taking the next request
as soon as its last one is done.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import anyio.lowlevel

from .._engine import Engine, Peer
from ._context import Context
from ._pdwork import Request, StepRecorder

#: The longest a request waits for blocks to come back (seconds).
BLOCKS_WAIT_S = 60.0
#: Contender name -> (anyio backend, backend options).
BACKENDS: dict[str, tuple[str, dict[str, Any]]] = {
    "aionixl-asyncio": ("asyncio", {}),
    "aionixl-trio": ("trio", {}),
    "aionixl-uvloop": ("asyncio", {"use_uvloop": True}),
}


async def _pace(due: float, spin_s: float) -> None:
    wait = due - time.perf_counter() - spin_s
    if wait > 0:
        await anyio.sleep(wait)
    while time.perf_counter() < due:
        await anyio.sleep(0)


#: ``start(fn, *args)``: run ``fn(*args)`` in a task of its own.
Start = Callable[..., object]


@contextlib.asynccontextmanager
async def _request_tasks(backend: str) -> AsyncIterator[Start]:
    """Start each request's task as a server on that event loop does (asyncio's
    ``TaskGroup``, a trio nursery): anyio's ``start_soon`` costs ~90 us per task with cold
    caches, against ~22 us (asyncio) and ~43 us (trio), and a P/D request starts cold."""
    if backend == "trio":
        import trio

        async with trio.open_nursery() as nursery:
            yield nursery.start_soon
    else:
        async with asyncio.TaskGroup() as group:
            yield lambda fn, *args: group.create_task(fn(*args))


async def _verify(ctx: Context, eng: Engine, peer: Peer) -> int:
    ctx.clear_verify_set()
    loc, rem = ctx.verify_set
    await eng.transfer_blocks(peer, loc, rem)
    if not ctx.check_verify_set():
        raise RuntimeError("aionixl (P/D): the bytes read do not match the prefill pattern")
    return ctx.verify_blocks


async def _step(ctx: Context, name: str, rec: StepRecorder, reqs: list[Request],
                concurrency: int | None, backend: str) -> int:
    memory, pool, spin_s = rec.memory, rec.pool, rec.spec.spin_s
    async with Engine(ctx.unique(name), memory.regions) as eng:
        peer = await eng.connect(ctx.units[0].address, timeout=30)
        await eng.transfer_blocks(peer, [0], [0])  # wire-up
        checked = await _verify(ctx, eng, peer)
        transfer = eng.transfer_blocks
        #: Set when blocks come back, made only while a request waits for them: a fresh
        #: event per request cost ~50 us with cold caches (asyncio), which bare NIXL's
        #: loop does not pay.
        freed: anyio.Event | None = None

        async def one(req: Request, ids: Any, due: float) -> None:
            nonlocal freed
            called = time.perf_counter()
            await transfer(peer, ids, req.remote, notify=req.notify)
            rec.done(req, ids, due, called)
            if freed is not None:
                woken, freed = freed, None
                woken.set()  # whoever waits for blocks looks again

        async def take(req: Request) -> Any:
            nonlocal freed
            ids = pool.take(req.nblocks)
            if ids is None:
                rec.result.waited_for_blocks += 1
            while ids is None:
                if freed is None:
                    freed = anyio.Event()
                with anyio.fail_after(BLOCKS_WAIT_S):  # a harness bug fails the step, not hangs it
                    await freed.wait()
                ids = pool.take(req.nblocks)
            memory.clear_sample(ids)
            return ids

        if concurrency is None:
            async with _request_tasks(backend) as start:
                rec.start()
                for req in reqs:
                    due = rec.due(req)
                    await _pace(due, spin_s)
                    ids = await take(req)
                    start(one, req, ids, due)
                    # One arrival per loop turn, as a server's accept loop takes them: a
                    # backlog spawned in one turn would start in any order on trio.
                    await anyio.lowlevel.checkpoint()
        else:
            it = iter(reqs)

            async def worker() -> None:
                for req in it:
                    ids = await take(req)
                    await one(req, ids, time.perf_counter())

            async with anyio.create_task_group() as tg:
                rec.start()
                for _ in range(concurrency):
                    tg.start_soon(worker)
        rec.stop()  # the verify read and the engine's close are not the workload's
        checked += await _verify(ctx, eng, peer)
    return checked


def step(ctx: Context, name: str, rec: StepRecorder, reqs: list[Request],
         concurrency: int | None = None) -> int:
    """Run one step on ``name``'s event loop; returns the verify-set block ids checked."""
    backend, options = BACKENDS[name]
    out: int = anyio.run(_step, ctx, name, rec, reqs, concurrency, backend, backend=backend,
                         backend_options=options)
    return out
