"""``aionixl soak``'s parts that run inside engines and read their results (private).

The chaos soak (issue 31) has three layers, each knowing only the ones below it:

1. :mod:`._worker` runs inside one engine's process, as a task of that process's task
   group (``main(engine, args)``, ``args`` the msgpack of a :class:`WorkerSpec`): it reads
   random source blocks of its peers and writes its own into their inbox slots, with random
   deadlines, checks every byte that lands, keeps the destination blocks of failed reads in
   quarantine to catch late bytes, notices when its own process was stopped, and appends
   one JSON line per operation to its events file.
2. :mod:`._report` reads those events files (several incarnations each, when an engine was
   killed and restarted) with the orchestrator's fault log and its own findings, and
   produces the soak's JSON (``"violations"`` a top-level integer) and a plot.
3. :mod:`._run`, the orchestrator (on the multi-host harness of :mod:`aionixl.testing`;
   ``aionixl soak`` runs it), starts etcd, hosts and engines with this worker, injects
   faults, tears everything down and calls the report.

Nothing here starts threads or sleeps blocking; the worker runs on asyncio and trio.
"""

from ._report import plot, read_events, summarize
from ._worker import WorkerSpec, main

__all__ = ["WorkerSpec", "main", "plot", "read_events", "summarize"]
