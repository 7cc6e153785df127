"""How the bench starts its child processes: ``python -m <module>`` of this very aionixl.

Children are modules of the installed package (``aionixl_contenders.*``), never
files of a source checkout, so ``aionixl bench`` runs from a wheel. The child gets this
process's interpreter, and the folder this process imported aionixl from goes first on its
``PYTHONPATH``: ``-m`` would otherwise put the child's working directory first, where an
aionixl checkout (or another version) could stand in for the one running the bench.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path


def package_root() -> str:
    """The folder that holds the ``aionixl`` package this process runs."""
    import aionixl

    return str(Path(aionixl.__file__).resolve().parent.parent)


def module_command(module: str, *args: str,
                   env: Mapping[str, str] | None = None) -> tuple[list[str], dict[str, str]]:
    """``argv`` and environment that run ``python -m module args...`` with this aionixl."""
    child_env = dict(os.environ if env is None else env)
    root = package_root()
    path = [p for p in child_env.get("PYTHONPATH", "").split(os.pathsep) if p]
    child_env["PYTHONPATH"] = os.pathsep.join([root, *[p for p in path if p != root]])
    return [sys.executable, "-m", module, *args], child_env


def pin_threads(pid: int, cpus: Iterable[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus`` (a thread that ended meanwhile is skipped)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):
            os.sched_setaffinity(int(tid), cpus)


def cpu_seconds(pid: int) -> float:
    """CPU seconds its live threads have run, of process ``pid``: the scheduler's nanosecond
    count (/proc/PID/stat counts 10 ms ticks, too coarse for an idle process)."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except OSError:  # a thread that ended meanwhile
            pass
    return total / 1e9
