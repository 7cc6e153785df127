"""The P/D request workload's pieces that every contender shares (no NIXL, no event loop).

``aionixl bench --workload pd``: a decode process receives requests from an open-loop
generator and reads each request's prompt KV from the prefill process in one call with a
notification, then frees its blocks. This module holds what every contender uses the same
way, so that they differ only in how they post and wait:

- :class:`PdSpec`: the geometry and the sizes of a run;
- :func:`make_requests`: the seeded request list (prompt lengths, remote block ids, unit-rate
  Poisson arrival offsets; a load step scales the offsets by 1 / rate);
- :class:`BlockPool`: the decode cache's free block ids (a request takes its blocks on
  arrival, waiting in FIFO order when the pool is empty, and gives them back when done);
- :class:`PdMemory`: the decode cache as one array, so that a request's sampled blocks are
  cleared before its read and compared with the prefill pattern after it in one step;
- :class:`StepRecorder`: latency from each request's *scheduled* arrival, bytes, CPU, checks.
"""

from __future__ import annotations

import math
import resource
import time
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from ._memory import _SEED, KVMemory
from ._spec import KVShape

I64 = npt.NDArray[np.int32]  # block ids, as a user holds them


@dataclass(frozen=True, slots=True, kw_only=True)
class PdSpec(KVShape):
    """The P/D workload's geometry and sizes (times in seconds)."""

    #: A small model (the micro workload's): 4 layers x K/V = 8 regions; a block of 16 tokens
    #: x 8 KV heads x head dim 64 x bf16 = 16 KiB per region, 128 KiB per block id (8 KiB
    #: per token).
    layers: int = 4
    block_bytes: int = 16384
    block_tokens: int = 16
    #: Blocks per region on each side: 4096 x 128 KiB = 512 MiB per side.
    blocks: int = 4096
    #: Prompt lengths: log-uniform on [min_tokens, max_tokens] (density ~ 1/length), seeded.
    min_tokens: int = 256
    max_tokens: int = 8192
    seed: int = 32
    #: Requests per contender per load step and repeat.
    requests: int = 120
    #: Requests per closed-loop saturation run, and how many are kept outstanding.
    sat_requests: int = 120
    sat_concurrency: int = 4
    #: Load steps as fractions of bare NIXL's saturation request rate (the last: overload).
    loads: tuple[float, ...] = (0.25, 0.5, 0.75, 0.9, 1.0, 1.2)
    #: Repeats of every (contender, load) step, contenders interleaved in rotating order.
    repeats: int = 3
    #: The arrival pacer sleeps until this long before an arrival, then spins (event-loop
    #: timers are rounded to 1 ms by epoll): the same in every contender.
    spin_s: float = 0.0012
    #: Run bare NIXL's loop twice in every repeat, the second time as a control (not a
    #: contender): its ratios to the first are the run's noise floor (``_pd.CONTROL``).
    control: bool = True
    quick: bool = False

    @property
    def max_blocks(self) -> int:
        return -(-self.max_tokens // self.block_tokens)

    def problems(self) -> list[str]:
        out = []
        if self.requests < 1 or self.sat_requests < 1 or self.repeats < 1:
            out.append("--pd-requests and --pd-repeats must be at least 1")
        if self.blocks < 2 * self.max_blocks:
            out.append(f"the P/D workload needs at least {2 * self.max_blocks} blocks per region")
        if not 0 < self.min_tokens <= self.max_tokens:
            out.append("the P/D prompt lengths need 0 < min <= max")
        return out


def default_pd() -> PdSpec:
    return PdSpec()


def quick_pd() -> PdSpec:
    """CI-sized: the same distribution and loads on a model of half the layers (half the
    bytes per token, so twice the request rate and half the time per step), fewer requests."""
    return replace(PdSpec(), layers=2, requests=40, sat_requests=40, repeats=4, quick=True)


@dataclass(frozen=True, slots=True)
class Request:
    index: int
    #: Arrival offset at rate 1 request/s (Poisson: cumulative unit exponentials).
    at: float
    tokens: int
    remote: I64
    notify: bytes

    @property
    def nblocks(self) -> int:
        return len(self.remote)


def make_requests(spec: PdSpec, n: int, salt: int = 0) -> list[Request]:
    """``n`` requests, the same for every contender (seeded): log-uniform prompt lengths,
    remote block ids distinct within a request, unit-rate Poisson arrival offsets."""
    rng = np.random.default_rng(spec.seed * 1000 + salt)
    lo, hi = math.log(spec.min_tokens), math.log(spec.max_tokens)
    tokens = np.exp(rng.uniform(lo, hi, n)).astype(np.int64)
    gaps = rng.exponential(1.0, n)
    at = np.cumsum(gaps) - gaps[0]  # the first request arrives at once
    out = []
    for i in range(n):
        nb = int(-(-int(tokens[i]) // spec.block_tokens))
        remote = rng.choice(spec.blocks, nb, replace=False).astype(np.int32)
        out.append(Request(i, float(at[i]), int(tokens[i]), remote, b"pd-%d-%d" % (salt, i)))
    return out


class BlockPool:
    """The decode cache's free block ids: taken FIFO on arrival, given back when done."""

    def __init__(self, blocks: int, seed: int) -> None:
        ids = np.random.default_rng(seed).permutation(blocks)
        self._free: deque[int] = deque(int(x) for x in ids)

    def take(self, n: int) -> I64 | None:
        if len(self._free) < n:
            return None
        free = self._free
        return np.fromiter((free.popleft() for _ in range(n)), dtype=np.int32, count=n)

    def give(self, ids: I64) -> None:
        self._free.extend(int(x) for x in ids)

    @property
    def free(self) -> int:
        return len(self._free)


class PdMemory(KVMemory):
    """The decode cache as one ``[regions, blocks, block_bytes]`` array (DRAM), ``regions``
    its per-region views (what NIXL registers), so that one numpy step clears or checks a
    request's sampled blocks in every region."""

    def __init__(self, regions: int, blocks: int, block_bytes: int) -> None:
        self.num_regions = regions
        self.num_blocks = blocks
        self.block_bytes = block_bytes
        self.device = "cpu"
        self.mem_type = "DRAM"
        self.device_id = 0
        self.array = np.zeros((regions, blocks, block_bytes), np.uint8)
        self.array.fill(0)  # every page mapped before anything is timed
        self.regions = [self.array[r] for r in range(regions)]
        self.words = self.array.view(np.uint64)
        self._rw = region_words(regions, block_bytes // 8)

    @staticmethod
    def sample(local: I64, remote: I64) -> tuple[I64, I64]:
        """The blocks of a request that are checked: its first and last."""
        return local[[0, -1]], remote[[0, -1]]

    def clear_sample(self, local: I64) -> None:
        self.words[:, local[[0, -1]], :] = 0

    def check_sample(self, local: I64, remote: I64) -> bool:
        loc, rem = self.sample(local, remote)
        return check_words(self.words, loc, rem, self._rw)


def region_words(regions: int, words: int) -> npt.NDArray[np.uint64]:
    """The (region, word) part of the prefill pattern, ``[regions, 1, words]``."""
    return ((np.arange(regions, dtype=np.uint64) << np.uint64(48)).reshape(-1, 1, 1)
            | np.arange(words, dtype=np.uint64).reshape(1, 1, -1))


def check_words(words: npt.NDArray[np.uint64], local: I64, remote: I64,
                rw: npt.NDArray[np.uint64]) -> bool:
    """Whether ``words[:, local, :]`` (a ``[regions, blocks, words]`` cache) holds the
    prefill pattern of blocks ``remote`` (:func:`aionixl._bench._memory.expected_words`)."""
    want = (rw | (remote.astype(np.uint64) << np.uint64(24)).reshape(1, -1, 1)) ^ np.uint64(_SEED)
    return bool(np.array_equal(words[:, local, :], want))


def start_lead(rate: float | None) -> float:
    """Seconds from a step's start to its first scheduled arrival: an open loop's first
    request is due 2 ms on (the pacer's set-up); a closed loop (``rate`` None) starts at
    once, its clock running from the start, so that no contender's first requests run
    before its clock does."""
    return 0.002 if rate else 0.0


def process_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@dataclass
class StepResult:
    """One (contender, load, repeat) step."""

    latencies: list[float] = field(default_factory=list)  # seconds, scheduled arrival -> seen done
    #: Seconds from a request's scheduled arrival to its transfer call (pacing, the block
    #: pool, spawning its task): the part of its latency before the transfer engine has it.
    #: For the vLLM connector: to the step that hands it over (``start_load_kv``). Empty
    #: for a contender that does not say when it called.
    to_call: list[float] = field(default_factory=list)
    nbytes: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0  # first scheduled arrival -> last completion
    verified: int = 0  # requests whose sampled blocks matched the prefill pattern
    requests: int = 0
    waited_for_blocks: int = 0  # requests that found the pool empty on arrival

    def as_dict(self) -> dict[str, Any]:
        """What :meth:`StepRecorder.adopt` takes: a step measured in another process."""
        return {"latencies": self.latencies, "to_call": self.to_call, "nbytes": self.nbytes,
                "cpu_s": self.cpu_s, "wall_s": self.wall_s, "verified": self.verified,
                "requests": self.requests, "waited_for_blocks": self.waited_for_blocks}


class StepRecorder:
    """What a contender calls during one step: ``start`` (t0, CPU), ``done`` per request
    (latency from its scheduled arrival, then the byte check, then the blocks go back),
    ``finish``. ``rate`` None: a closed loop (arrival = when it was posted)."""

    def __init__(self, memory: PdMemory, pool: BlockPool, spec: PdSpec, rate: float | None) -> None:
        self.memory = memory
        self.pool = pool
        self.spec = spec
        self.rate = rate
        self.result = StepResult()
        self.t0 = 0.0
        self._cpu0 = 0.0
        self._cpu_s: float | None = None
        self._last = 0.0
        self.block_bytes = spec.bytes_per_block_id

    def start(self) -> float:
        """The step's clock starts: t0 is the first scheduled arrival (:func:`start_lead`)."""
        self._cpu0 = process_cpu()
        self.t0 = time.perf_counter() + start_lead(self.rate)
        return self.t0

    def due(self, req: Request) -> float:
        """When ``req`` is scheduled to arrive (perf_counter seconds)."""
        return self.t0 + (req.at / self.rate if self.rate else 0.0)

    def admit(self, req: Request, now: float, closed_loop: bool) -> tuple[float, I64] | None:
        """The next request, if it is due at ``now`` (in a closed loop it always is) and the
        pool has its blocks: its arrival time and its local block ids, sample cleared. None:
        not yet (a wait for blocks is counted)."""
        due = now if closed_loop else self.due(req)
        if due > now:
            return None
        ids = self.pool.take(req.nblocks)
        if ids is None:
            self.result.waited_for_blocks += 1
            return None
        self.memory.clear_sample(ids)
        return due, ids

    def done(self, req: Request, local: I64, scheduled: float, called: float | None = None) -> None:
        """``req`` is seen done now; ``called``: when its transfer was called (or posted)."""
        t = time.perf_counter()
        res = self.result
        res.latencies.append(t - scheduled)
        if called is not None:
            res.to_call.append(called - scheduled)
        self._last = t
        res.nbytes += req.nblocks * self.block_bytes
        res.requests += 1
        if not self.memory.check_sample(local, req.remote):
            raise RuntimeError(f"request {req.index}: the bytes read do not match the prefill pattern")
        res.verified += 1
        self.pool.give(local)

    def stop(self) -> None:
        """Every request is done: the step's CPU clock stops. What a contender does after
        (checking its verify set again, closing its engine) is its own, not the workload's.
        ``finish`` stops it where a contender did not."""
        if self._cpu_s is None:
            self._cpu_s = process_cpu() - self._cpu0

    def adopt(self, measured: dict[str, Any]) -> None:
        """A step measured in another process (the vLLM decode worker): its numbers."""
        res = self.result
        res.latencies = [float(x) for x in measured["latencies"]]
        res.to_call = [float(x) for x in measured.get("to_call", [])]
        for key in ("nbytes", "verified", "requests", "waited_for_blocks"):
            setattr(res, key, int(measured[key]))
        res.cpu_s, res.wall_s = float(measured["cpu_s"]), float(measured["wall_s"])
        self._adopted = True

    def finish(self) -> StepResult:
        res = self.result
        if getattr(self, "_adopted", False):
            return res
        self.stop()
        assert self._cpu_s is not None
        res.cpu_s = self._cpu_s
        res.wall_s = max(self._last - self.t0, 1e-9)
        return res
