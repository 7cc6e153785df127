"""Real vLLM prefill/decode pairs on CPUs, each instance a child process of its own: for the
tests of vLLM's connectors (tests_vllm/) and for ``aionixl bench --workload vllm-pairs``.

A KV connector is proven by what vLLM computes with it, not by the bytes it moves: a decode
that produced the tokens of prompt A while it was given prompt B (and A's ``kv_transfer_params``)
can only have attended over the KV cache the prefill computed for A. That needs weights whose
greedy outputs depend on the whole prompt, so :func:`write_tiny_llama` writes a tiny Llama with
seeded random weights (vLLM's dummy weights make every logit equal).

Every instance is ``python -m aionixl_contenders.vllm_pair --role ROLE ...`` (an offline ``LLM``
with or without a ``kv_transfer_config``), in a session of its own so that vLLM's engine-core
and worker processes go with it when it has to be killed. Messages (:mod:`aionixl._lines`): the
child writes ``{"ready": ...}`` (or ``{"error": ...}``) on ``--fd``, then one reply per command
it reads on stdin:

- ``{"op": "generate", "requests": [{"prompt_token_ids": [...], "kv_transfer_params": {...}}],
  "max_tokens": N, "logprobs": K}``: greedy, ``ignore_eos``, all requests in one ``LLM.generate``
  call; ``{"outputs": [{"token_ids", "kv_transfer_params", "num_cached_tokens", "margins"}],
  "elapsed_s"}``. ``margins`` (with ``logprobs >= 2``) are the top-1 minus top-2 logprobs of
  each generated token: how far each greedy choice was from a tie.
- ``{"op": "info"}``: ``{"info": [{"pid", "name", "threads"}, ...]}``, the child and every
  process under it: vLLM's engine core (the connector's scheduler half) and its worker (the
  connector's worker half, which moves the KV).
- With ``--open-loop`` the instance is vLLM's ``AsyncLLM`` instead, and takes
  ``{"op": "submit", "id", "prompt_token_ids", "max_tokens", "kv_transfer_params"}`` (no
  ``generate``): each request starts when it comes, answered ``{"done": ID, "first_token_at",
  "done_at", ...}`` (an output's fields, times on ``time.monotonic``) or ``{"failed": ID, "error"}``
  when it ends.
- ``{"op": "stop"}`` or the end of stdin: shuts the engine core down, answers ``{"stopped":
  {"shutdown_s", "engine_exit_codes", "threads_left"}}`` and exits.

vLLM's own output (much of it) goes to a log file; its tail comes with every error raised here.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

from aionixl._bench._child import module_command
from aionixl._lines import LineReader, decode_line, encode_line, write_file

Role = Literal["prefill", "decode", "single"]

#: What each role is to vLLM's connector; ``single`` runs without one (the reference).
KV_ROLES: dict[str, Literal["kv_producer", "kv_consumer"]] = {"prefill": "kv_producer",
                                                              "decode": "kv_consumer"}
#: One core each on a 2-core machine: the two halves of a pair never share OpenMP cores, and
#: every instance computes with one thread (GEMMs may round differently with more).
DEFAULT_OMP_BIND: dict[str, str] = {"prefill": "0", "decode": "1", "single": "0"}
#: CPU attention needs blocks of a multiple of 32 tokens.
BLOCK_SIZE = 32
MODULE = "aionixl_contenders.vllm_pair"


@dataclass(frozen=True)
class ConnectorSpec:
    """Which vLLM KV connector an instance loads: a class name, and the module that holds it for
    connectors outside vLLM's registry (loaded by module path, in vLLM's spawned workers too)."""

    kv_connector: str
    module_path: str | None = None
    extra_config: Mapping[str, Any] = field(default_factory=dict)
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] | None = None  # None: the role's own
    #: vLLM's ``kv_load_failure_policy``: a request whose KV could not be loaded fails, or
    #: its prompt is computed here instead.
    load_failure_policy: Literal["fail", "recompute"] = "fail"


@dataclass(frozen=True)
class Output:
    """One request's result, as ``LLM.generate`` gave it."""

    token_ids: list[int]
    kv_transfer_params: dict[str, Any] | None
    num_cached_tokens: int | None
    margins: list[float] | None  # top-1 minus top-2 logprob per token (with logprobs >= 2)
    finish_reason: str | None = None  # vLLM's: "length" here, "error" for a failed request


@dataclass(frozen=True)
class StopReport:
    """How an instance ended: its exit code, the engine core's shutdown time (as the child
    measured it), the whole stop (request to exit), how the engine-core processes ended, the
    child's threads that outlived the shutdown and any process of its session left behind."""

    exit_code: int | None
    shutdown_s: float | None
    stop_s: float
    engine_exit_codes: list[int | None]  # vLLM's engine-core processes: -9 if vLLM had to kill one
    threads_left: list[str]
    leftover_pids: list[int]
    killed: bool


_ports_given: set[int] = set()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the side channel binds it tens of seconds later), never
    one this process gave out before: two instances started together must not get the same
    one. Drawn below the kernel's ephemeral range (``ip_local_port_range``): a port the kernel
    gave out would be free again, and could go to any socket that connects meanwhile (a CI run
    lost a side channel's port that way)."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    while True:
        port = random.randrange(max(1024, low - 12_000), low)
        if port in _ports_given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ports_given.add(port)
        return port


# --- the model ------------------------------------------------------------------------------

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 2048,
    # 0.3 rather than HF's 0.02: logits spread wide enough that greedy choices are rarely near
    # ties (bf16 rounding must not flip them between instances), and still depend on the context.
    "initializer_range": 0.3, "tie_word_embeddings": False,
}


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """A tiny Llama with seeded random weights in ``path`` (safetensors, bf16, no tokenizer);
    kept when ``path`` already holds one written with the same seed and shape."""
    marker = path / "aionixl-tiny-llama.json"
    stamp = json.dumps({"seed": seed, **TINY_LLAMA}, sort_keys=True)
    if marker.is_file() and marker.read_text() == stamp:
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA)).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    marker.write_text(stamp)
    return path


# --- the parent's side ----------------------------------------------------------------------


class VllmInstance:
    """One vLLM ``LLM`` in a child process, started at construction; :meth:`wait_ready` waits
    for it. Commands block until answered: these children never wait on this process.
    ``env``: variables set in the child's environment on top of this process's."""

    def __init__(self, model: Path, role: Role, connector: ConnectorSpec | None = None, *,
                 side_channel_port: int | None = None, omp_bind: str | None = None,
                 log_path: Path | None = None, dtype: str = "bfloat16", max_model_len: int = 1024,
                 kv_cache_bytes: int = 256 << 20, seed: int = 0, open_loop: bool = False,
                 env: Mapping[str, str] | None = None) -> None:
        if (connector is None) != (role == "single"):
            raise ValueError(f"a {role} instance needs {'no' if role == 'single' else 'a'} connector")
        self.role = role
        self.connector = connector
        self.side_channel_port = side_channel_port or free_port()
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"pd_pair-{role}-", suffix=".log")
            os.close(fd)
            log_path = Path(name)
        self.log_path = log_path
        args = ["--role", role, "--model", str(model), "--dtype", dtype,
                "--max-model-len", str(max_model_len), "--kv-cache-bytes", str(kv_cache_bytes),
                "--seed", str(seed), "--side-channel-port", str(self.side_channel_port),
                "--omp-bind", omp_bind or DEFAULT_OMP_BIND[role], *(["--open-loop"] if open_loop else [])]
        if connector is not None:
            kv_role = connector.kv_role or KV_ROLES[role]
            args += ["--kv-connector", connector.kv_connector, "--kv-role", kv_role,
                     "--extra-config", json.dumps(dict(connector.extra_config)),
                     "--load-failure-policy", connector.load_failure_policy]
            if connector.module_path:
                args += ["--kv-connector-module-path", connector.module_path]
        read_fd, write_fd = os.pipe()
        try:
            argv, child_env = module_command(MODULE, "--fd", str(write_fd), *args,
                                             env={**os.environ, **(env or {})})
            with open(log_path, "ab") as log:
                # A session of its own: a kill takes vLLM's processes (its grandchildren) with it.
                self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=log, stderr=log,
                                             pass_fds=(write_fd,), env=child_env, start_new_session=True)
        finally:
            os.close(write_fd)
        self._fd = read_fd
        self._reader = LineReader()
        self.ready: dict[str, Any] = {}
        self.stopped: StopReport | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError as exc:
            return f"(no log: {exc})"

    def _fail(self, what: str) -> RuntimeError:
        return RuntimeError(f"vLLM {self.role} (pid {self.pid}): {what}\n--- {self.log_path} (tail) ---\n"
                            f"{self.log_tail()}")

    def _message(self, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while (msg := self._reader.pop()) is None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"no answer within {timeout} s")
            ready, _, _ = select.select([self._fd], [], [], min(left, 1.0))
            if ready:
                self._read()
        if "error" in msg:
            raise self._error(msg)
        return msg

    def _read(self) -> None:
        """Take what arrived (the fd is readable); the child's exit raises."""
        chunk = os.read(self._fd, 1 << 20)
        if not chunk:
            raise self._fail(f"exited (code {self.proc.wait()})")
        self._reader.feed(chunk)

    def _error(self, msg: dict[str, Any]) -> RuntimeError:
        return self._fail(f"{msg['error']}\n{msg.get('traceback', '')}")

    def wait_ready(self, timeout: float = 600.0) -> VllmInstance:
        """Wait until the ``LLM`` is built."""
        if not self.ready:
            self.ready = self._message(timeout)["ready"]
        return self

    def _ask(self, cmd: dict[str, Any], timeout: float) -> dict[str, Any]:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(encode_line(cmd))
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._fail(f"exited (code {self.proc.wait()})") from None
        return self._message(timeout)

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8,
                 kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None,
                 logprobs: int | None = None, timeout: float = 300.0) -> list[Output]:
        """Greedy outputs for ``prompts``, all in one ``LLM.generate`` call (one batch), each with
        its ``kv_transfer_params`` (None: none)."""
        reply = self._ask(_generate_command(prompts, max_tokens, kv_transfer_params, logprobs), timeout)
        return [Output(**o) for o in reply["outputs"]]

    def start_generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int = 8,
                       kv_transfer_params: Sequence[Mapping[str, Any] | None] | None = None) -> None:
        """As :meth:`generate`, without waiting for the answer (a test kills the instance meanwhile)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_line(_generate_command(prompts, max_tokens, kv_transfer_params, None)))
        self.proc.stdin.flush()

    def submit(self, request_id: str, prompt: Sequence[int], *, max_tokens: int,
               kv_transfer_params: Mapping[str, Any] | None = None, logprobs: int | None = None) -> None:
        """Start one request in an ``open_loop`` instance; its answer comes through
        :meth:`messages` (``done`` or ``failed``, with this id)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_line({"op": "submit", "id": request_id, "max_tokens": max_tokens,
                                           "prompt_token_ids": list(map(int, prompt)),
                                           "kv_transfer_params": dict(kv_transfer_params or {}) or None,
                                           "logprobs": logprobs}))
        self.proc.stdin.flush()

    def fileno(self) -> int:
        """Where this instance's messages arrive (for ``select``)."""
        return self._fd

    def messages(self) -> list[dict[str, Any]]:
        """The messages that arrived, after ``select`` found :meth:`fileno` readable."""
        self._read()
        found = []
        while (msg := self._reader.pop()) is not None:
            if "error" in msg and "failed" not in msg:  # a request's failure is an answer
                raise self._error(msg)
            found.append(msg)
        return found

    def prefill(self, prompts: Sequence[Sequence[int]], timeout: float = 300.0) -> list[Output]:
        """Prefill ``prompts`` for a remote decode: one token each, the KV kept for the decode to
        read; each output's ``kv_transfer_params`` are what the decode request takes."""
        return self.generate(prompts, max_tokens=1, timeout=timeout,
                             kv_transfer_params=[{"do_remote_decode": True}] * len(prompts))

    def info(self, timeout: float = 30.0) -> list[dict[str, Any]]:
        """The child and its processes (vLLM's engine core and worker): pid, name, thread count."""
        return list(self._ask({"op": "info"}, timeout)["info"])

    def session_pids(self) -> list[int]:
        """Live processes of the child's session (itself included): what a stop must leave none of."""
        import psutil

        pids = []
        for proc in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):
                if os.getsid(proc.pid) == self.pid and proc.status() != psutil.STATUS_ZOMBIE:
                    pids.append(proc.pid)
        return pids

    def kill(self) -> StopReport:
        """SIGKILL the instance and all its processes (its session) at once, as a crash
        would; the report says ``killed``."""
        if self.stopped is not None:
            return self.stopped
        start = time.monotonic()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        code = self.proc.wait()
        os.close(self._fd)
        self.stopped = StopReport(exit_code=code, shutdown_s=None, stop_s=time.monotonic() - start,
                                  engine_exit_codes=[], threads_left=[], leftover_pids=[], killed=True)
        return self.stopped

    def stop(self, timeout: float = 60.0) -> StopReport:
        """Ask for a clean shutdown and time it; killed (with its whole session) past
        ``timeout``. Idempotent: a second call returns the first report."""
        if self.stopped is not None:
            return self.stopped
        start = time.monotonic()
        shutdown_s, engine_codes, threads_left, killed = None, [], [], False
        if self.proc.poll() is None:
            with contextlib.suppress(RuntimeError):
                if self.ready:  # a child still starting reads no commands: it is killed below
                    stopped = self._ask({"op": "stop"}, timeout)["stopped"]
                    shutdown_s, threads_left = stopped["shutdown_s"], stopped["threads_left"]
                    engine_codes = stopped["engine_exit_codes"]
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            try:
                self.proc.wait(max(1.0, timeout - (time.monotonic() - start)) if self.ready else 0.1)
            except subprocess.TimeoutExpired:
                killed = True
        # vLLM's engine core and multiprocessing's resource tracker end right after the child.
        deadline = time.monotonic() + 10
        while (left := self.session_pids()) and time.monotonic() < deadline and not killed:
            time.sleep(0.2)
        if left or killed:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
        code = self.proc.wait()
        os.close(self._fd)
        self.stopped = StopReport(exit_code=code, shutdown_s=shutdown_s, stop_s=time.monotonic() - start,
                                  engine_exit_codes=engine_codes, threads_left=threads_left,
                                  leftover_pids=left, killed=killed)
        return self.stopped


def _generate_command(prompts: Sequence[Sequence[int]], max_tokens: int,
                      kv_transfer_params: Sequence[Mapping[str, Any] | None] | None,
                      logprobs: int | None) -> dict[str, Any]:
    params = list(kv_transfer_params) if kv_transfer_params is not None else [None] * len(prompts)
    if len(params) != len(prompts):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} kv_transfer_params")
    requests = [{"prompt_token_ids": list(map(int, p)), "kv_transfer_params": dict(kv) if kv else None}
                for p, kv in zip(prompts, params, strict=True)]
    return {"op": "generate", "requests": requests, "max_tokens": max_tokens, "logprobs": logprobs}


# --- the child's side -----------------------------------------------------------------------


def _process_tree() -> list[dict[str, Any]]:
    """This process and every process under it: pid, name, thread count, main thread's CPUs."""
    import psutil

    me = psutil.Process()
    tree = []
    for proc in [me, *me.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            # The main thread's CPUs: where vLLM's CPU worker computes (a connector may move it).
            tree.append({"pid": proc.pid, "name": proc.name(), "threads": proc.num_threads(),
                         "cpus": sorted(os.sched_getaffinity(proc.pid))})
    return tree


def _margins(logprobs: Any) -> list[float] | None:
    """Top-1 minus top-2 logprob of each generated token (None without two logprobs)."""
    if not logprobs:
        return None
    margins = []
    for position in logprobs:
        top = sorted((lp.logprob for lp in position.values()), reverse=True)
        if len(top) < 2:
            return None
        margins.append(float(top[0] - top[1]))
    return margins


def _error(exc: BaseException) -> dict[str, Any]:
    """An error message: what went wrong first, then where."""
    return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}


def _engine_arguments(args: argparse.Namespace) -> dict[str, Any]:
    """vLLM's engine arguments for this instance (``LLM`` and ``AsyncEngineArgs`` take the same)."""
    from vllm.config import KVTransferConfig

    kv_transfer_config = None
    if args.role != "single":
        kv_transfer_config = KVTransferConfig(
            kv_connector=args.kv_connector, kv_role=args.kv_role, kv_buffer_device="cpu",
            kv_connector_module_path=args.kv_connector_module_path,
            kv_connector_extra_config=json.loads(args.extra_config),
            kv_load_failure_policy=args.load_failure_policy)
    return {"model": args.model, "skip_tokenizer_init": True, "dtype": args.dtype, "enforce_eager": True,
            "seed": args.seed, "block_size": BLOCK_SIZE, "max_model_len": args.max_model_len,
            "kv_cache_memory_bytes": args.kv_cache_bytes, "enable_prefix_caching": False,
            "kv_transfer_config": kv_transfer_config}


def _sampling_params(max_tokens: int, kv_transfer_params: dict[str, Any] | None, logprobs: int | None) -> Any:
    """Greedy, ``ignore_eos``: every request makes exactly ``max_tokens`` tokens."""
    from vllm import SamplingParams

    extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs,
                          extra_args=extra)


def _output(result: Any) -> dict[str, Any]:
    """One request's ``RequestOutput`` as a message (:class:`Output`'s fields)."""
    first = result.outputs[0]
    return {"token_ids": list(first.token_ids), "kv_transfer_params": result.kv_transfer_params,
            "num_cached_tokens": result.num_cached_tokens, "margins": _margins(first.logprobs),
            "finish_reason": first.finish_reason}


def _generate(llm: Any, cmd: dict[str, Any]) -> dict[str, Any]:
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in cmd["requests"]]
    params = [_sampling_params(cmd["max_tokens"], r["kv_transfer_params"], cmd.get("logprobs"))
              for r in cmd["requests"]]
    start = time.monotonic()
    results = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.monotonic() - start
    return {"outputs": [_output(r) for r in results], "elapsed_s": elapsed}


def _ready(args: argparse.Namespace, started: float) -> dict[str, Any]:
    return {"ready": {"pid": os.getpid(), "role": args.role, "build_s": time.monotonic() - started,
                      "side_channel_port": args.side_channel_port, "processes": _process_tree()}}


def _stopped(client: Any, shutdown_s: float) -> dict[str, Any]:
    """The stop's report: the engine core's shutdown time, how its processes ended, and the
    threads that would keep this process from exiting (a hang at exit names its culprit)."""
    import threading

    manager = getattr(getattr(client, "resources", None), "engine_manager", None)
    engine_codes = [p.exitcode for p in getattr(manager, "processes", [])]
    left = [t.name for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    return {"stopped": {"shutdown_s": shutdown_s, "engine_exit_codes": engine_codes, "threads_left": left}}


def _serve(args: argparse.Namespace) -> int:
    out = os.fdopen(args.fd, "w")
    # vLLM reads these when it builds the engine core (a spawned process that inherits them).
    os.environ["VLLM_NIXL_SIDE_CHANNEL_HOST"] = "127.0.0.1"
    os.environ["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(args.side_channel_port)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.omp_bind
    # vLLM gives its worker 5 s to exit before it terminates it, and its engine core 5 s before it
    # kills it: a stop is timed whole, not cut short (a slow connector teardown shows as slow).
    os.environ.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(int(args.shutdown_timeout)))
    if args.open_loop:
        return asyncio.run(_serve_open_loop(args, out))
    started = time.monotonic()
    try:
        from vllm import LLM

        llm = LLM(**_engine_arguments(args))
    except Exception as exc:
        write_file(out, _error(exc))
        return 1
    write_file(out, _ready(args, started))
    for raw in sys.stdin.buffer:
        cmd = decode_line(raw)
        if cmd is None:
            continue
        if cmd.get("op") == "stop":
            break
        try:
            if cmd.get("op") == "generate":
                reply = _generate(llm, cmd)
            elif cmd.get("op") == "info":
                reply = {"info": _process_tree()}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
        except Exception as exc:
            reply = _error(exc)
        write_file(out, reply)
    started = time.monotonic()
    client = llm.llm_engine.engine_core
    client.shutdown(timeout=args.shutdown_timeout)
    with contextlib.suppress(OSError):  # the parent may have stopped listening (end of stdin)
        write_file(out, _stopped(client, time.monotonic() - started))
    return 0


async def _serve_open_loop(args: argparse.Namespace, out: TextIO) -> int:
    """``--open-loop``: vLLM's ``AsyncLLM`` (the engine behind its API server), each
    ``submit`` a request of its own that starts at once, whatever else is running."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    started = time.monotonic()
    try:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**_engine_arguments(args)))
    except Exception as exc:
        write_file(out, _error(exc))
        return 1
    write_file(out, _ready(args, started))
    loop = asyncio.get_running_loop()
    commands: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
    reader = LineReader()
    stdin = sys.stdin.fileno()

    def readable() -> None:
        chunk = os.read(stdin, 1 << 20)
        if not chunk:
            loop.remove_reader(stdin)
            commands.put_nowait(None)
            return
        reader.feed(chunk)
        while (cmd := reader.pop()) is not None:
            commands.put_nowait(cmd)

    loop.add_reader(stdin, readable)
    running: set[asyncio.Task[None]] = set()
    while (cmd := await commands.get()) is not None and cmd.get("op") != "stop":
        if cmd.get("op") == "submit":
            task = asyncio.create_task(_open_loop_request(engine, cmd, out))
            running.add(task)
            task.add_done_callback(running.discard)
        elif cmd.get("op") == "info":
            write_file(out, {"info": _process_tree()})
        else:
            write_file(out, {"error": f"unknown command {cmd!r}"})
    loop.remove_reader(stdin)
    for task in running:
        task.cancel()
    await asyncio.gather(*running, return_exceptions=True)
    started = time.monotonic()
    engine.shutdown(timeout=args.shutdown_timeout)
    with contextlib.suppress(OSError):
        write_file(out, _stopped(engine.engine_core, time.monotonic() - started))
    return 0


async def _open_loop_request(engine: Any, cmd: dict[str, Any], out: TextIO) -> None:
    """One ``submit``: answered ``{"done": ID, "first_token_at", "done_at", **Output}`` when it
    ends (times on this machine's ``time.monotonic`` clock, which every process shares), or
    ``{"failed": ID, "error"}``."""
    from vllm.inputs import TokensPrompt

    params = _sampling_params(cmd["max_tokens"], cmd.get("kv_transfer_params"), cmd.get("logprobs"))
    first_token_at = None
    result = None
    try:
        async for result in engine.generate(TokensPrompt(prompt_token_ids=cmd["prompt_token_ids"]), params,
                                            request_id=str(cmd["id"])):
            if first_token_at is None and result.outputs and result.outputs[0].token_ids:
                first_token_at = time.monotonic()
    except Exception as exc:
        write_file(out, {"failed": cmd["id"], "error": f"{type(exc).__name__}: {exc}"})
        return
    if result is None:
        write_file(out, {"failed": cmd["id"], "error": "vLLM gave no output"})
        return
    write_file(out, {"done": cmd["id"], "first_token_at": first_token_at, "done_at": time.monotonic(),
                     **_output(result)})


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fd", type=int, required=True, help="where the messages go")
    p.add_argument("--role", choices=("prefill", "decode", "single"), required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--kv-connector")
    p.add_argument("--kv-connector-module-path")
    p.add_argument("--kv-role", choices=("kv_producer", "kv_consumer", "kv_both"))
    p.add_argument("--extra-config", default="{}", help="kv_connector_extra_config, as JSON")
    p.add_argument("--load-failure-policy", choices=("fail", "recompute"), default="fail",
                   help="kv_load_failure_policy")
    p.add_argument("--side-channel-port", type=int, required=True)
    p.add_argument("--omp-bind", default="nobind", help="VLLM_CPU_OMP_THREADS_BIND")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--open-loop", action="store_true",
                   help="vLLM's AsyncLLM, taking submit commands whenever they come (the load bench)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="how long vLLM waits for its engine core (and that for its worker) to exit")
    args = p.parse_args(argv)
    if (args.role == "single") != (args.kv_connector is None):
        p.error("--kv-connector is required for prefill and decode, and refused for single")
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
