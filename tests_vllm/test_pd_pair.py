"""A real vLLM prefill/decode pair computes with the KV cache its connectors moved.

The decode is given prompt B with the ``kv_transfer_params`` of prompt A's prefill: B and A
have the same length and last token (the one token the decode computes itself) and differ
everywhere else, so the decode's greedy tokens are A's (as a plain instance generates them)
only if it attended over A's KV, read from the prefill; a decode that recomputed its prompt
produces B's. Each pair of connectors runs K concurrent requests in one ``generate`` call.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest

from aionixl_contenders.vllm_pair import ConnectorSpec, Output, VllmInstance, write_tiny_llama

#: Connector name -> (kv_connector class, module path for connectors outside vLLM's registry).
CONNECTORS: dict[str, tuple[str, str | None]] = {
    "NixlConnector": ("NixlConnector", None),
    "AionixlConnector": ("AionixlConnector", "aionixl.vllm_connector"),
}
#: (prefill connector, decode connector) pairs to prove, by name in CONNECTORS.
PAIRS: list[tuple[str, str]] = [
    ("AionixlConnector", "AionixlConnector"),
    ("AionixlConnector", "NixlConnector"),
    ("NixlConnector", "AionixlConnector"),
]

K = 3  # concurrent requests per pair
PROMPT_LEN = 80  # two full blocks of 32 and a partial one
MAX_TOKENS = 8
CANDIDATES = 32  # A/B candidates from which K usable ones are picked (about 1 in 5 is)
#: The least gap between the top two logprobs along a greedy path: bf16 logits step by 1/16
#: around the top ones, so a choice one step from a tie could flip between instances.
MIN_MARGIN = 0.1
VOCAB = 512


@dataclass(frozen=True)
class Case:
    """Prompts A and B (same length and last token), and what a plain instance generates."""

    a: list[int]
    b: list[int]
    want_a: list[int]
    got_b: list[int]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


Fleet = dict[str, VllmInstance]


@pytest.fixture(scope="module")
def fleet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """A prefill and a decode instance of each connector, and an AionixlConnector instance that
    is both (UCX over TCP only, failed loads recomputed), started side by side. A decode reads from whichever prefill a request's
    ``kv_transfer_params`` name, so these make every pair; an instance asked without transfer params computes as a plain single instance
    does (the NixlConnector prefill gives the tokens a pair must reproduce). Stopped on the
    way out (the last test checks those stops)."""
    log_dir = tmp_path_factory.mktemp("pd-logs")
    started = time.monotonic()
    instances: Fleet = {}
    try:
        for name in CONNECTORS:
            for role in ("prefill", "decode"):
                instances[f"{role} {name}"] = VllmInstance(tiny_model, role, spec(name),  # type: ignore[arg-type]
                                                           log_path=log_dir / f"{role}-{name}.log")
        # One instance both ways (kv_role "kv_both"): a prefill to some requests, a decode to
        # others; with UCX over TCP only, as between hosts, so that aionixl's push reads run,
        # and vLLM's other kv_load_failure_policy.
        both = replace(spec("AionixlConnector"), kv_role="kv_both", load_failure_policy="recompute")
        instances["both AionixlConnector"] = VllmInstance(
            tiny_model, "prefill", both, omp_bind="1", log_path=log_dir / "both-AionixlConnector.log",
            env={"UCX_TLS": "tcp"})
        for instance in instances.values():
            instance.wait_ready(600)
        print(f"\n{len(instances)} instances ready in {time.monotonic() - started:.1f} s")
        yield instances
    finally:
        for instance in instances.values():
            instance.stop()


@pytest.fixture(scope="module")
def cases(fleet: Fleet) -> list[Case]:
    """K cases whose A and B generate different tokens on a plain instance (vLLM's own
    prefill, asked without transfer params), with no near-tie on either's way."""
    rng = random.Random(1234)
    pairs = []
    for _ in range(CANDIDATES):
        a = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN)]
        b = [rng.randrange(VOCAB) for _ in range(PROMPT_LEN - 1)] + [a[-1]]
        pairs.append((a, b))
    outs = fleet["prefill NixlConnector"].generate([p for pair in pairs for p in pair], max_tokens=MAX_TOKENS,
                                           logprobs=2)
    usable = []
    for (a, b), out_a, out_b in zip(pairs, outs[0::2], outs[1::2], strict=True):
        assert out_a.margins is not None and out_b.margins is not None
        assert len(out_a.token_ids) == len(out_b.token_ids) == MAX_TOKENS
        if out_a.token_ids != out_b.token_ids and min(out_a.margins + out_b.margins) >= MIN_MARGIN:
            usable.append(Case(a, b, out_a.token_ids, out_b.token_ids))
    print(f"{len(usable)} of {CANDIDATES} candidates usable")
    assert len(usable) >= K, f"only {len(usable)} of {CANDIDATES} candidates usable: another seed?"
    return usable[:K]


def threads(processes: list[dict[str, Any]]) -> str:
    """An instance's processes as ``name[pid]: threads``, for the log."""
    return ", ".join(f"{p['name']}[{p['pid']}]: {p['threads']}" for p in processes)


def spec(name: str) -> ConnectorSpec:
    kv_connector, module_path = CONNECTORS[name]
    return ConnectorSpec(kv_connector, module_path)


@pytest.mark.slow
@pytest.mark.parametrize(("prefill_connector", "decode_connector"), PAIRS, ids=[f"{p}-{d}" for p, d in PAIRS])
def test_decode_generates_from_the_prefills_kv(prefill_connector: str, decode_connector: str,
                                               fleet: Fleet, cases: list[Case]) -> None:
    prefill, decode = fleet[f"prefill {prefill_connector}"], fleet[f"decode {decode_connector}"]
    prefilled = prefill.prefill([c.a for c in cases])
    for out in prefilled:
        assert out.kv_transfer_params and out.kv_transfer_params.get("do_remote_prefill"), out
    # B's tokens, A's KV: each decode request takes what A's prefill answered.
    remote = [o.kv_transfer_params for o in prefilled]
    decoded: list[Output] = decode.generate([c.b for c in cases], max_tokens=MAX_TOKENS,
                                            kv_transfer_params=remote)
    for case, pre, out in zip(cases, prefilled, decoded, strict=True):
        assert pre.token_ids == case.want_a[:1]  # the prefill's one token: A's first
        assert out.token_ids != case.got_b, "the decode recomputed B: the remote KV was not used"
        assert out.token_ids == case.want_a
    # The decode instance itself computes B as the single instance does: A's tokens came
    # from A's KV.
    plain = decode.generate([c.b for c in cases], max_tokens=MAX_TOKENS)
    assert [o.token_ids for o in plain] == [c.got_b for c in cases]
    print(f"\n{prefill_connector} -> {decode_connector}; threads: prefill {threads(prefill.info())}, "
          f"decode {threads(decode.info())}")


@pytest.mark.slow
def test_a_kv_both_aionixl_instance_serves_reads_and_reads(fleet: Fleet, cases: list[Case]) -> None:
    """``"kv_role": "kv_both"``: the same AionixlConnector instance prefills for vLLM's
    NixlConnector decode and for aionixl's, and decodes from vLLM's NixlConnector prefill."""
    both = fleet["both AionixlConnector"]
    for name in ("decode NixlConnector", "decode AionixlConnector"):
        prefilled = both.prefill([c.a for c in cases])
        assert [o.token_ids for o in prefilled] == [c.want_a[:1] for c in cases]
        decoded = fleet[name].generate([c.b for c in cases], max_tokens=MAX_TOKENS,
                                       kv_transfer_params=[o.kv_transfer_params for o in prefilled])
        assert [o.token_ids for o in decoded] == [c.want_a for c in cases], name
    prefilled = fleet["prefill NixlConnector"].prefill([c.a for c in cases])
    decoded = both.generate([c.b for c in cases], max_tokens=MAX_TOKENS,
                            kv_transfer_params=[o.kv_transfer_params for o in prefilled])
    assert [o.token_ids for o in decoded] == [c.want_a for c in cases]


def read_paths(instance: VllmInstance) -> dict[str, str]:
    """How an AionixlConnector decode reads from each prefill it met (by engine id), from its log."""
    text = instance.log_path.read_text(errors="replace")
    return dict(re.findall(r"AionixlConnector reads from prefill (\S+) at \S+ by (.+)", text))


@pytest.mark.slow
def test_aionixl_decodes_read_aionixl_prefills_by_aionixls_handshake_and_vllms_by_its_side_channel(
        fleet: Fleet, cases: list[Case]) -> None:
    """Negotiated per prefill: an AionixlConnector prefill names its own handshake in vLLM's
    reply, so an AionixlConnector decode reads it as an aionixl peer (GET on one host with
    shared memory, push over UCX TCP), and a NixlConnector prefill by vLLM's wire; the
    tokens prove the bytes either way."""
    decode, both = fleet["decode AionixlConnector"], fleet["both AionixlConnector"]
    paths = {}
    for prefill_name, reader, reader_name in (
            ("prefill AionixlConnector", decode, "decode"), ("prefill NixlConnector", decode, "decode"),
            ("prefill AionixlConnector", both, "both")):
        prefilled = fleet[prefill_name].prefill([c.a for c in cases])
        decoded = reader.generate([c.b for c in cases], max_tokens=MAX_TOKENS,
                                  kv_transfer_params=[o.kv_transfer_params for o in prefilled])
        assert [o.token_ids for o in decoded] == [c.want_a for c in cases], prefill_name
        engine_id = prefilled[0].kv_transfer_params["remote_engine_id"]  # type: ignore[index]
        paths[prefill_name, reader_name] = read_paths(reader).get(engine_id)
    assert paths == {("prefill AionixlConnector", "decode"): "aionixl's handshake (get reads)",
                     ("prefill NixlConnector", "decode"): "vLLM's side channel",
                     # UCX over TCP only on the reader: push, the server writes.
                     ("prefill AionixlConnector", "both"): "aionixl's handshake (push reads)"}


@pytest.mark.slow
def test_a_decode_whose_kv_cannot_be_loaded_computes_the_prompt_itself_under_the_recompute_policy(
        fleet: Fleet, cases: list[Case]) -> None:
    """``kv_load_failure_policy: "recompute"`` (the kv_both instance): a request naming an
    engine id the prefill does not have (as after a restart) fails its read, the connector
    reports the blocks, and vLLM computes prompt B itself: B's tokens, not an error. The
    same KV asked for under the right id is then read (which frees the prefill's blocks:
    a vLLM engine holding unread blocks steps on, busy, until their lease runs out)."""
    both, prefill = fleet["both AionixlConnector"], fleet["prefill AionixlConnector"]
    params = [o.kv_transfer_params or {} for o in prefill.prefill([c.a for c in cases])]
    wrong = [{**p, "remote_engine_id": "restarted-" + p["remote_engine_id"]} for p in params]
    recomputed = both.generate([c.b for c in cases], max_tokens=MAX_TOKENS, kv_transfer_params=wrong)
    assert [(o.token_ids, o.finish_reason) for o in recomputed] == [(c.got_b, "length") for c in cases]
    decoded = both.generate([c.b for c in cases], max_tokens=MAX_TOKENS, kv_transfer_params=params)
    assert [o.token_ids for o in decoded] == [c.want_a for c in cases]


def worker(instance: VllmInstance) -> dict[str, Any]:
    """The instance's vLLM worker process (pid, name, threads)."""
    (found,) = [p for p in instance.info() if p["name"] == "VLLM::Worker"]
    return found


@pytest.mark.slow
def test_an_aionixl_worker_runs_fewer_threads_than_a_nixl_connector_worker(fleet: Fleet) -> None:
    """Its loop thread plus what its NIXL agents and zmq start. Measured against a worker
    with no connector (46 threads here): aionixl adds 4 on a prefill and 4 on a decode (2 of
    them zmq's, for aionixl's handshake: on a decode since it reads aionixl prefills as
    aionixl peers), vLLM's NixlConnector 7-8 (its agent's threads, a handshake executor...);
    the check keeps the difference."""
    counts = {name: worker(instance)["threads"] for name, instance in fleet.items()}
    print(f"\nworker threads: {counts}")
    for role in ("prefill", "decode"):
        assert counts[f"{role} AionixlConnector"] <= counts[f"{role} NixlConnector"] - 3, counts


@pytest.mark.slow
def test_an_idle_aionixl_worker_uses_at_most_5_percent_of_a_core(fleet: Fleet) -> None:
    """NIXL's progress thread is off and nothing spins: measured as the worker process's CPU
    time over 3 s with no request in flight (every instance at once), from 2 s after the last
    request (a vLLM worker busy-polls its input queue for 1 s after each read of it)."""
    import psutil

    procs = {key: psutil.Process(worker(instance)["pid"]) for key, instance in fleet.items()}
    time.sleep(2.0)
    before = {key: sum(p.cpu_times()[:2]) for key, p in procs.items()}
    started = time.monotonic()
    time.sleep(3.0)
    wall = time.monotonic() - started
    used = {key: round((sum(p.cpu_times()[:2]) - before[key]) / wall, 3) for key, p in procs.items()}
    print(f"\nidle worker CPU, cores: {used}")
    for name in ("prefill AionixlConnector", "decode AionixlConnector", "both AionixlConnector"):
        assert used[name] <= 0.05, used


def kill_a_reader_mid_read(fleet: Fleet, cases: list[Case], victim_name: str) -> None:
    """``victim_name`` is given many requests whose KV the aionixl prefill holds and is
    SIGKILLed (its whole instance) 0.3 s later, while their reads are under way or about to
    be. The aionixl prefill instance lives on and serves: the aionixl decode then reads its
    next prefills and generates exactly A's tokens."""
    prefill, victim = fleet["prefill AionixlConnector"], fleet[victim_name]
    prefilled = prefill.prefill([c.a for c in cases] * 8)
    victim.start_generate([c.b for c in cases] * 8, max_tokens=MAX_TOKENS,
                          kv_transfer_params=[o.kv_transfer_params for o in prefilled])
    time.sleep(0.3)
    assert victim.kill().killed
    time.sleep(1.0)  # whatever the reader's death does to the prefill's NIXL agent, it has done
    assert prefill.proc.poll() is None
    again = [o.kv_transfer_params for o in prefill.prefill([c.a for c in cases])]
    decoded = fleet["decode AionixlConnector"].generate([c.b for c in cases], max_tokens=MAX_TOKENS,
                                                        kv_transfer_params=again)
    assert [o.token_ids for o in decoded] == [c.want_a for c in cases]


@pytest.mark.slow
def test_an_aionixl_prefill_serves_on_after_a_decode_reading_from_it_is_sigkilled(
        fleet: Fleet, cases: list[Case]) -> None:
    """vLLM's NixlConnector decode reads by GET from the prefill's serving agent (on one host
    with shared memory here: see docs/vllm.md for UCX TCP)."""
    kill_a_reader_mid_read(fleet, cases, "decode NixlConnector")


@pytest.mark.slow
def test_an_aionixl_prefill_serves_on_after_an_aionixl_decode_push_reading_from_it_over_tcp_is_sigkilled(
        fleet: Fleet, cases: list[Case]) -> None:
    """Over UCX TCP a decode dying mid-GET can abort the process that serves the GET;
    between two AionixlConnectors the reads are pushes (the prefill writes), so the kv_both
    instance (UCX over TCP only) is the victim here."""
    kill_a_reader_mid_read(fleet, cases, "both AionixlConnector")


@pytest.mark.slow
def test_a_decode_whose_aionixl_prefill_was_sigkilled_fails_that_request_and_serves_on(
        fleet: Fleet, cases: list[Case]) -> None:
    """The prefill dies (SIGKILL, its whole instance) after it computed A: the aionixl decode's
    read fails, vLLM fails the request by its kv_load_failure_policy ("fail", the default),
    and the decode goes on serving."""
    prefill, decode = fleet["prefill AionixlConnector"], fleet["decode AionixlConnector"]
    case = cases[0]
    (prefilled,) = prefill.prefill([case.a])
    assert prefill.kill().killed
    (failed,) = decode.generate([case.b], max_tokens=MAX_TOKENS,
                                kv_transfer_params=[prefilled.kv_transfer_params], timeout=120)
    print(f"\nthe request whose prefill died: {failed}")
    assert failed.finish_reason == "error" and failed.token_ids != case.want_a, failed
    plain = decode.generate([c.b for c in cases], max_tokens=MAX_TOKENS)
    assert [o.token_ids for o in plain] == [c.got_b for c in cases]


@pytest.mark.slow
def test_every_instance_stops_cleanly_and_in_time(fleet: Fleet) -> None:
    """Each instance exits 0 without vLLM killing its engine core or this harness killing
    anything, and leaves no process behind; the shutdown times are printed per connector."""
    with ThreadPoolExecutor(len(fleet)) as pool:  # side by side: each stop takes seconds
        reports = dict(zip(fleet, pool.map(VllmInstance.stop, fleet.values()), strict=True))
    for name, report in reports.items():
        print(f"\n{name} stop: {report}")
        if name in ("prefill AionixlConnector", "decode NixlConnector", "both AionixlConnector"):
            continue  # SIGKILLed by the tests above
        assert report.exit_code == 0 and not report.killed and not report.leftover_pids, report
        assert report.engine_exit_codes == [0], report  # vLLM did not have to kill its engine core
