"""The contenders of ``aionixl bench`` that are not aionixl itself, and its child processes.

- :mod:`.bare_nixl`: bare NIXL, synchronous loops on NIXL's Python API (the ceiling);
- :mod:`.threaded` drives :mod:`.threaded_connector`, a MODEL of the thread-based
  connector design;
- :mod:`.vllm_contender` (``--with-vllm``): vLLM's real NixlConnector, in two children,
  :mod:`.vllm_worker` (prefill) and :mod:`.vllm_decode`;
- :mod:`.target`: the prefill side every other contender reads from, a child process.

Each contender module has ``run(ctx)`` (``ctx``: :class:`aionixl._bench._context.Context`)
returning samples per measure. The children run as ``python -m`` of their module
(:func:`aionixl._bench._child.module_command`). Nothing here is imported until its
contender runs: the bare-NIXL and threaded ones import NIXL's ``nixl`` package, vLLM's
ones vLLM.

Why a package of its own, beside ``aionixl`` in the same wheel: the baselines are what the
engine is measured against, so they do what the engine must not. The threaded model runs
threads, an executor and a blocking engine step (the design it models); vLLM's connector
and its decode worker do the same; bare NIXL calls NIXL's own Python API (going through
``aionixl._nixl`` would not be bare). ``aionixl`` itself starts no thread, never sleeps
blocking, and calls NIXL only in ``aionixl._nixl`` (``tests/test_layers.py`` checks all
three).
"""
