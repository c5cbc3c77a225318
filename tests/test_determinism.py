"""Greedy output does not depend on load: the serving stack on the default expert backend.

One stack for the module: a tiny bf16 checkpoint, 2 shards x 2 replicas on the default backend
(the C kernels; the module is skipped where they are not built), the engine + OpenAI HTTP API.
8 concurrent greedy completions of 160 tokens must equal the same requests sent one at a time,
on three rounds, and killing one replica of a shard while all 8 streams are mid-generation must
change no text. This holds only because each expert call's token rows are batch-invariant
(tests/test_kernels.py::test_batch_invariant): a row's bits never depend on its neighbours.
"""
from __future__ import annotations

import concurrent.futures as cf
import time

import httpx
import pytest

from local_stack import replicated_stack

pytest.importorskip("cpu_expert_service.kernel_backend", reason="kernel extension not built (make build)")

MODEL = "tiny-det"
N_REQ = 8
N_TOK = 160


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("det") / MODEL), "bf16", seed=11)


@pytest.fixture(scope="module")
def stack(model_dir):
    with replicated_stack(model_dir, MODEL, kv_tokens=8192,
                          max_batch=N_REQ, chunk_tokens=64, expert_timeout=10.0) as st:
        yield st


PROMPTS = [f"request {i}: " + "the experts answer " * (1 + i % 4) for i in range(N_REQ)]


def _complete(stack, prompt):
    r = httpx.post(stack.http_url + "/v1/completions", timeout=600,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": N_TOK, "temperature": 0,
                         "ignore_eos": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    return choice["text"]


def _concurrent(stack, during=None):
    with cf.ThreadPoolExecutor(N_REQ) as ex:
        futs = [ex.submit(_complete, stack, p) for p in PROMPTS]
        if during is not None:
            during()
        return [f.result() for f in futs]


@pytest.fixture(scope="module")
def alone(stack):
    """Each request with the stack to itself."""
    return [_complete(stack, p) for p in PROMPTS]


def test_shards_run_the_kernels(stack):
    ok, detail = stack.client.health()
    assert ok and len(detail) == 4
    from cpu_expert_service.backend import available_backends

    assert available_backends()[0] == "kernels"  # what backend="auto" picked in the shard processes


def test_concurrent_equals_alone(stack, alone):
    for round_ in range(3):
        got = _concurrent(stack)
        same = [g == a for g, a in zip(got, alone)]
        assert all(same), f"round {round_}: {sum(same)}/{N_REQ} concurrent completions equal the request alone"


def test_replica_killed_mid_generation_changes_no_text(stack, alone):
    eng, sh = stack.engine, stack.shards
    victim = 1  # shard 1, replica set 0

    def kill_mid_generation():
        t0 = eng.counters["generated_tokens"]
        deadline = time.monotonic() + 120
        while eng.counters["generated_tokens"] < t0 + N_REQ * N_TOK // 3:  # all 8 streams a third in
            assert time.monotonic() < deadline, "generation did not progress"
            time.sleep(0.01)
        sh.kill(victim)

    try:
        got = _concurrent(stack, during=kill_mid_generation)
        rep = next(r for r in stack.client.replicas if r.address == sh.addresses[victim])
        assert not rep.healthy, "the kill happened after generation ended: nothing was tested"
        same = [g == a for g, a in zip(got, alone)]
        assert all(same), f"{sum(same)}/{N_REQ} completions unchanged by the failover"
    finally:
        sh.restart(victim)
