"""What every contender gets: the spec, both sides' memory, the prefill units, workloads.

The contenders under :mod:`aionixl_contenders` receive this object too (typed as
``Any`` there); they use only the attributes and methods documented here.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt

from ._memory import KVMemory, descriptor_indices
from ._spec import Spec
from ._target import Target, Unit

Ids = list[int] | npt.NDArray[np.int32]
Results = dict[str, list[float]]


def _ids(values: npt.NDArray[np.int64]) -> Ids:
    """Block ids as a user would pass them: a list when short, an int32 array when long."""
    return [int(v) for v in values] if values.size <= 64 else values.astype(np.int32)


class Progress:
    """One status line per step on stderr (overwritten in place on a terminal)."""

    def __init__(self, enabled: bool = True) -> None:
        self.started = time.perf_counter()
        self.enabled = enabled
        self._tty = enabled and sys.stderr.isatty()
        self._width = 0

    def __call__(self, message: str) -> None:
        if not self.enabled:
            return
        text = f"[{time.perf_counter() - self.started:6.1f} s] {message}"
        if self._tty:
            pad = max(0, self._width - len(text))
            sys.stderr.write("\r" + text + " " * pad)
            self._width = len(text)
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def done(self) -> None:
        if self._tty and self._width:
            sys.stderr.write("\r" + " " * self._width + "\r")
            sys.stderr.flush()
            self._width = 0


class Reference(Protocol):
    """Loops of other contenders that aionixl alternates with (see ``Context.open_reference``)."""

    pairs: dict[str, Callable[[], float]]

    def close(self) -> None: ...


class Context:
    def __init__(self, spec: Spec, local: KVMemory, target: Target, progress: Progress,
                 host: KVMemory | None = None) -> None:
        self.spec = spec
        #: Our (decode-side) memory; every NIXL contender reads into it.
        self.local = local
        #: In --device cuda runs: a DRAM cache of the same shape (host<->device measures).
        self.host = host
        self.target = target
        self.remote_layout: dict[str, Any] = target.layout
        self.units: list[Unit] = target.units
        self.progress = progress
        self._names = itertools.count()
        rng = np.random.default_rng(20261202)
        blocks = spec.blocks
        self._rng = rng
        self._workloads: dict[tuple[str, int], list[tuple[Ids, Ids]]] = {}
        perm_l, perm_r = rng.permutation(blocks)[:64], rng.permutation(blocks)[:64]
        #: 64 scattered blocks for checking bytes: (local ids, remote ids).
        self.verify_set: tuple[Ids, Ids] = (_ids(perm_l), _ids(perm_r))
        #: Set by the harness: builds the references aionixl is paired with (bare NIXL,
        #: memcpy), or returns None when those contenders are not part of the run.
        self.reference_factory: Callable[[], Reference | None] = lambda: None
        #: Set by the harness: starts a fresh prefill process (see ``restart_target``).
        self.target_factory: Callable[[], Target] | None = None
        #: Why the prefill process had to be started again, one line each (the report's notes).
        self.target_restarts: list[str] = []

    # ---- names, the prefill side --------------------------------------------------------

    def unique(self, prefix: str) -> str:
        """A NIXL agent name nobody else in this run uses."""
        return f"bench-{prefix}-{os.getpid()}-{next(self._names)}"

    def spin(self) -> None:
        self.target.spin()

    def target_died(self, wait: float = 0.0) -> bool:
        """Whether the prefill process exited (waiting up to ``wait`` seconds to see it)."""
        try:
            self.target.proc.wait(wait)
        except subprocess.TimeoutExpired:
            return False
        return True

    def restart_target(self, why: str) -> None:
        """The prefill process died (a peer's abort can kill a UCX GET target: see the
        threaded-model close in benchmarks/README.md): start a fresh one so that the run goes on."""
        assert self.target_factory is not None
        code = self.target.proc.returncode
        self.target.stop()
        self.progress(f"the prefill process died ({why}; exit code {code}): starting it again")
        self.target_restarts.append(f"{why} (exit code {code})")
        target = self.target_factory()
        target.wait_ready()
        self.target = target
        self.remote_layout = target.layout
        self.units = target.units

    def rest(self) -> None:
        self.target.rest()

    # ---- workloads ----------------------------------------------------------------------

    def workload(self, kind: str, nblocks: int, variants: int = 16) -> list[tuple[Ids, Ids]]:
        """``variants`` (local ids, remote ids) pairs of ``nblocks`` blocks each.

        ``contiguous``: runs of consecutive ids; ``scattered``: random distinct ids. The
        same pairs (same seed) for every contender; loops cycle through them.
        """
        key = (kind, nblocks)
        if key not in self._workloads:
            b = self.spec.blocks
            rng = np.random.default_rng(nblocks * 7919 + (kind == "scattered"))
            pairs: list[tuple[Ids, Ids]] = []
            for k in range(variants):
                if kind == "contiguous":
                    span = b - nblocks + 1
                    lo = (k * nblocks) % span
                    ro = (lo + b // 2 + 3 * k) % span
                    loc = np.arange(lo, lo + nblocks, dtype=np.int64)
                    rem = np.arange(ro, ro + nblocks, dtype=np.int64)
                elif kind == "scattered":
                    loc = rng.permutation(b)[:nblocks].astype(np.int64)
                    rem = rng.permutation(b)[:nblocks].astype(np.int64)
                else:
                    raise ValueError(kind)
                pairs.append((_ids(loc), _ids(rem)))
            self._workloads[key] = pairs
        return self._workloads[key]

    def part_workload(self) -> list[tuple[Ids, Ids, int]]:
        """The one-block sequential pairs (``workload("contiguous", 1)``), each with the part
        it moves: ``(local ids, remote ids, index)``, part ``index`` of ``spec.tp_ratio``
        equal consecutive parts of the remote block into the same part of the local block
        (the indices take turns, as decode ranks' head slices would)."""
        ratio = self.spec.tp_ratio
        return [(loc, rem, k % ratio) for k, (loc, rem) in enumerate(self.workload("contiguous", 1))]

    @property
    def part_verify_calls(self) -> list[tuple[list[int], list[int], int]]:
        """The verify set as part reads, one call per part index: block pair ``i`` moves part
        ``i % spec.tp_ratio``. Check with :meth:`clear_for_parts` before and
        :meth:`check_part_verify` after."""
        ratio = self.spec.tp_ratio
        loc, rem = ([int(x) for x in ids] for ids in self.verify_set)
        return [(loc[i::ratio], rem[i::ratio], i) for i in range(ratio) if loc[i::ratio]]

    def clear_for_parts(self) -> None:
        """Zero our whole cache, so that a part check sees any byte written out of place."""
        self.local.clear_all()

    def check_part_verify(self) -> bool:
        """Whether our cache holds exactly what :attr:`part_verify_calls` read: each part in
        its place, every other byte still zero. A pass compares :attr:`verify_blocks` block
        ids in full (the part read and the rest of the block), and every other block."""
        return self.local.check_parts(self.part_verify_calls, self.spec.tp_ratio)

    def one_block_pairs(self, count: int) -> list[tuple[list[int], list[int]]]:
        """``count`` one-block transfers with distinct local blocks (for in-flight runs)."""
        b = self.spec.blocks
        return [([i % b], [(i * 7 + 5) % b]) for i in range(count)]

    def local_indices(self, ids: Ids) -> npt.NDArray[np.int32]:
        return descriptor_indices(ids, self.local.num_regions, self.local.num_blocks)

    def remote_indices(self, ids: Ids) -> npt.NDArray[np.int32]:
        return descriptor_indices(ids, len(self.remote_layout["bases"]),
                                  int(self.remote_layout["num_blocks"]))

    def check_verify_set(self, memory: KVMemory | None = None) -> bool:
        mem = self.local if memory is None else memory
        return mem.check(*self.verify_set)

    def clear_verify_set(self, memory: KVMemory | None = None) -> None:
        (self.local if memory is None else memory).clear(self.verify_set[0])

    @property
    def verify_blocks(self) -> int:
        """Block ids one check of the verify set compares (each in every region): what a
        contender adds to its ``verified_blocks`` count per check that passed."""
        return len(self.verify_set[0])

    # ---- host<->device (--device cuda) ------------------------------------------------

    def write_pair(self) -> tuple[list[int], list[int]]:
        """(host ids, prefill ids) of the host->device write rows: the first bulk pair."""
        loc, rem = self.workload("contiguous", self.spec.bulk_blocks)[0]
        return [int(x) for x in loc], [int(x) for x in rem]

    def check_read_back(self, loc: list[int], rem: list[int], salt: int, who: str) -> int:
        """After prefill blocks ``rem`` were read back into the host's (cleared) ``loc``: raise
        unless they hold the pattern that was written there (``salt``: see
        :meth:`KVMemory.fill_expected`); else the number of block ids compared."""
        assert self.host is not None
        if not self.host.check(loc, rem, salt):
            what = "the distinct pattern written" if salt else "the prefill pattern restored"
            raise RuntimeError(f"{who}: the blocks read back from the prefill side do not hold {what}")
        return len(loc)

    def open_reference(self) -> Reference | None:
        return self.reference_factory()

    # ---- helpers ------------------------------------------------------------------------

    @staticmethod
    def cpu_seconds() -> float:
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    @staticmethod
    @contextlib.contextmanager
    def ucx_env(tls: str | None) -> Iterator[None]:
        """Set UCX_TLS while a NIXL agent is created (UCX reads it then)."""
        if tls is None:
            yield
            return
        old = os.environ.get("UCX_TLS")
        os.environ["UCX_TLS"] = tls
        try:
            yield
        finally:
            if old is None:
                os.environ.pop("UCX_TLS", None)
            else:
                os.environ["UCX_TLS"] = old

    @staticmethod
    def thread_count() -> int:
        """OS threads of this process now."""
        return len(os.listdir("/proc/self/task"))

    @staticmethod
    def latency_rows(per_repeat: list[list[float]]) -> dict[str, list[float]]:
        """One-block read latencies (seconds, one list per repeat) as the p50/p90/p99 rows:
        each repeat's percentile, so the table's median and spread are over repeats."""
        return {f"lat_1_p{q}": [float(np.percentile(r, q)) for r in per_repeat if r]
                for q in (50, 90, 99)}

    def timed_repeats(self, label: str, body: Callable[[], float], repeats: int | None = None) -> list[float]:
        """Run ``body`` (which returns one sample) ``repeats`` times, reporting progress."""
        self.progress(label)
        return [body() for _ in range(self.spec.repeats if repeats is None else repeats)]
