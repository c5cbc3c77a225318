"""Replicas, failover and recovery of the expert shards, on real processes over loopback gRPC.

One stack for the module: a tiny bf16 checkpoint, 2 shards x 2 replicas (4 processes), the
engine + HTTP + gRPC APIs with a 3 s expert deadline. Also: the replica-aware coverage check,
the client's message-size / keepalive options and checkpoint integrity at start-up (shard and
GPU service).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

from local_stack import replicated_stack
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-rel"
TIMEOUT_S = 3.0  # --expert-timeout of the stack
N_GEN = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("rel") / MODEL), "bf16", seed=3)


@pytest.fixture(scope="module")
def stack(model_dir):
    with replicated_stack(model_dir, MODEL, kv_tokens=4096,
                          max_batch=N_GEN, chunk_tokens=256, expert_timeout=TIMEOUT_S) as st:
        yield st


def _prompts(tok, n=N_GEN):
    return [tok.encode("shard replica " * (1 + i % 5) + str(i)) for i in range(n)]


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _healthy(stack):
    return httpx.get(stack.http_url + "/health", timeout=10).status_code == 200


@pytest.fixture(scope="module")
def reference(stack):
    """Fault-free greedy tokens of the N_GEN prompts, generated concurrently."""
    eng = stack.engine
    hs = [eng.submit(p, max_tokens=24, ignore_eos=True) for p in _prompts(stack.tokenizer)]
    return [h.result(120)[0] for h in hs]


def test_groups_and_options(stack, model_dir):
    from wire.channel import max_message_bytes

    c = stack.client
    assert len(c.groups) == 2 and all(len(g.replicas) == 2 for g in c.groups)
    assert stack.shards.groups == [0, 1, 0, 1]  # replica set 0 of every shard, then set 1
    cfg = c.cfg
    n = max_message_bytes(cfg)
    assert 16384 * cfg.hidden_size * 4 < n < 2**31 and n != 4 << 20
    opts = dict(c._options)
    assert opts["grpc.max_receive_message_length"] == n and opts["grpc.keepalive_time_ms"] > 0
    ok, detail = c.health()
    assert ok and set(detail.values()) == {"SERVING"} and len(detail) == 4


def test_round_robin_spreads_calls(stack, monkeypatch):
    c = stack.client
    picked = []
    pick = c._pick

    def spy(g, tried):  # whatever carries the call (gRPC stream or shared memory), the replica is chosen here
        r = pick(g, tried)
        picked.append(r.address)
        return r

    monkeypatch.setattr(c, "_pick", spy)
    x = np.random.default_rng(0).standard_normal((4, c.cfg.hidden_size)).astype(np.float32)
    ids = np.array([[0, 8], [2, 9], [4, 13], [6, 15]], dtype=np.int64) % c.cfg.n_routed_experts  # both groups
    w = np.full(ids.shape, 0.5, np.float32)
    outs = [c.forward(c.cfg.moe_layers[0], x, ids, w) for _ in range(4)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])  # replicas hold identical weights: identical answers
    for g in c.groups:  # every replica of every group got calls, in turn
        got = [a for a in picked if a in {r.address for r in g.replicas}]
        assert len(got) == 4 and set(got) == {r.address for r in g.replicas} and got[0] != got[1], got


def test_declined_direct_route_leaves_the_turn(stack):
    """A decode call asks direct_route first; when it declines (a part not on shared memory), the
    call goes through forward_async and the turn must still be that call's: else every decode call of
    a 2-replica group lands on the same replica."""
    c = stack.client
    before = [g.rr for g in c.groups]
    row = [0, c.cfg.n_routed_experts - 1]  # a decode row routed to both groups
    route = c.direct_route(row)
    taken = {id(g) for g, _, _ in route or ()}
    assert [g.rr - b for g, b in zip(c.groups, before)] == [int(id(g) in taken) for g in c.groups]
    c.fast.paths, saved = {}, c.fast.paths  # no fast path: the route declines
    try:
        before = [g.rr for g in c.groups]
        assert c.direct_route(row) is None
        assert [g.rr for g in c.groups] == before
    finally:
        c.fast.paths = saved


def test_kill_one_replica_during_generation(stack, reference):
    """kill -9 of one of 2 replicas mid-generation: all 16 complete with the fault-free tokens."""
    eng, sh = stack.engine, stack.shards
    victim = 0  # shard 0, replica set 0
    tokens0 = eng.counters["generated_tokens"]
    hs = [eng.submit(p, max_tokens=24, ignore_eos=True) for p in _prompts(stack.tokenizer)]
    _wait(lambda: eng.counters["generated_tokens"] >= tokens0 + 3 * N_GEN, 60, "a few decode steps")
    t_kill = time.monotonic()
    n_at_kill = eng.counters["generated_tokens"]
    sh.kill(victim)
    _wait(lambda: eng.counters["generated_tokens"] > n_at_kill + N_GEN, 30, "decoding to go on")
    failover_s = time.monotonic() - t_kill
    got = [h.result(120) for h in hs]
    assert [g[2] for g in got] == ["length"] * N_GEN
    assert [g[0] for g in got] == reference
    rep = next(r for r in stack.client.replicas if r.address == sh.addresses[victim])
    assert not rep.healthy
    ok, detail = stack.client.health()
    assert ok and not detail[sh.addresses[victim]].startswith("SERVING")  # the other replica serves
    assert _healthy(stack)
    print(f"\nfailover: next {N_GEN} tokens {failover_s:.2f}s after kill -9; "
          f"client failovers={stack.client.failovers}")
    # the replica comes back on its port: the client reconnects by itself
    sh.restart(victim)
    _wait(lambda: rep.healthy, 30, "the restarted replica to be used again")


def test_all_replicas_dead_then_recover(stack, reference):
    """Both replicas of shard 1 killed: in-flight requests end within the deadline with 503 /
    UNAVAILABLE naming the shard; /health 503; the shard restarts on its ports and the service
    recovers without a restart."""
    from gpu_service.api.grpc_client import GenerateClient

    eng, sh = stack.engine, stack.shards
    _wait(lambda: all(r.healthy for r in stack.client.replicas), 30, "every replica healthy")
    prompts = _prompts(stack.tokenizer, 6)
    results: dict = {}

    def http_one(i):
        r = httpx.post(stack.http_url + "/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": prompts[i], "max_tokens": 400, "temperature": 0, "ignore_eos": True})
        results[("http", i)] = (r.status_code, r.json(), time.monotonic())

    def stream_one(i):
        lines = []
        with httpx.stream("POST", stack.http_url + "/v1/completions", timeout=60, json={
                "model": MODEL, "prompt": prompts[i], "max_tokens": 400, "stream": True, "ignore_eos": True}) as resp:
            lines = [ln for ln in resp.iter_lines() if ln]
        results[("sse", i)] = (resp.status_code, lines, time.monotonic())

    def grpc_one(i):
        with GenerateClient(stack.grpc_address) as gc:
            try:
                for _ in gc.generate(prompt_ids=prompts[i], max_tokens=400, ignore_eos=True):
                    pass
                results[("grpc", i)] = (None, "finished", time.monotonic())
            except grpc.RpcError as e:
                results[("grpc", i)] = (e.code(), e.details(), time.monotonic())

    ths = [threading.Thread(target=f, args=(i,)) for i, f in
           enumerate([http_one, http_one, stream_one, stream_one, grpc_one, grpc_one])]
    running0 = eng.counters["generated_tokens"]
    for t in ths:
        t.start()
    _wait(lambda: eng.stats()["running"] == 6 and eng.counters["generated_tokens"] > running0 + 12, 60,
          "6 requests decoding")
    dead = [i for i, g in enumerate(sh.groups) if g == 1]
    t_kill = time.monotonic()
    for i in dead:
        sh.kill(i)
    for t in ths:
        t.join(60)
    ended = max(v[2] for v in results.values()) - t_kill
    assert ended < 2 * TIMEOUT_S + 2.0, ended  # bounded: well within the deadline of the calls in flight
    names = {sh.addresses[i] for i in dead}
    for (kind, i), (status, body, _) in results.items():
        if kind == "http":
            assert status == 503, body
            err = body["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["code"] == "expert_shard_unavailable"
            assert any(a in err["message"] for a in names), err
        elif kind == "sse":
            assert status == 200 and body[-1] == "data: [DONE]"
            err = json.loads(body[-2][len("data: "):])["error"]
            assert err["code"] == "expert_shard_unavailable" and any(a in err["message"] for a in names)
        else:
            assert status == grpc.StatusCode.UNAVAILABLE, (status, body)
            assert any(a in body for a in names), body
    r = httpx.get(stack.http_url + "/health", timeout=10)
    assert r.status_code == 503 and r.json()["status"] == "unavailable"
    # a new request fails fast while the shard is away
    t0 = time.monotonic()
    r = httpx.post(stack.http_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": prompts[0], "max_tokens": 4})
    assert r.status_code == 503 and time.monotonic() - t0 < TIMEOUT_S + 2
    print(f"\nall replicas dead: every in-flight request ended {ended:.2f}s after kill -9")

    # the shard comes back on the same ports: no restart of the GPU service
    t_back = time.monotonic()
    for i in dead:
        sh.restart(i)
    _wait(lambda: _healthy(stack), 30, "/health 200 again")
    recovered_s = time.monotonic() - t_back
    r = httpx.post(stack.http_url + "/v1/completions", timeout=60, json={
        "model": MODEL, "prompt": _prompts(stack.tokenizer)[0], "max_tokens": 24, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == reference[0]
    print(f"recovered {recovered_s:.2f}s after the shard processes were restarted")
    _wait(lambda: eng.stats()["running"] == 0 and eng.pool.pages_in_use == eng.pool.cached_pages, 10, "engine idle")


def test_connect_with_a_replica_down(stack):
    """A missing replica-set member is fine when every group has a live replica; a group with none is not."""
    import socket

    from gpu_service.experts.client import ExpertsClient
    from gpu_service.experts.errors import ShardError

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    a = stack.shards.addresses
    g = stack.shards.groups
    one_each = [a[g.index(0)], a[g.index(1)]]
    with ExpertsClient(one_each + [dead], stack.client.cfg, timeout_s=2, connect_timeout_s=1) as c:
        assert len(c.groups) == 2 and not c.replicas[-1].healthy
    with pytest.raises(ShardError) as ei:
        ExpertsClient([a[g.index(0)], dead], stack.client.cfg, timeout_s=2, connect_timeout_s=1).connect()
    assert dead in str(ei.value) and "do not cover" in str(ei.value)


# ---- checkpoint integrity at start-up ----------------------------------------------------------
def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def _largest(dir_):
    files = [f for f in os.listdir(dir_) if f.endswith(".safetensors")]
    return max(files, key=lambda f: os.path.getsize(os.path.join(dir_, f)))


def _expert_file(model_dir):
    from checkpoint.names import expert_weight
    from checkpoint.reader import CheckpointReader

    r = CheckpointReader(model_dir)
    name = expert_weight(r.config.moe_layers[-1], 0, "down")
    return r.file_of(name), name


def _dense_file(model_dir):
    from checkpoint.reader import CheckpointReader

    r = CheckpointReader(model_dir)
    name = "model.layers.0.self_attn.o_proj.weight"
    return r.file_of(name), name


def _cut(path, name):
    """Truncate the file in the middle of tensor `name` (a partial download)."""
    from checkpoint.reader import SafetensorsFile

    info = SafetensorsFile(path).tensors[name]
    with open(path, "r+b") as f:
        f.truncate(info.begin + (info.end - info.begin) // 2)


def _run_shard(model_dir, timeout=60):
    return subprocess.run([sys.executable, "-m", "moesplit", "expert-server", "--model", model_dir,
                           "--backend", "auto", "--port", "0"], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def _rewrite(path, name, fn):
    """Rewrite one tensor of a safetensors file through `fn(array) -> array` (header and all)."""
    from checkpoint.reader import SafetensorsFile, write_safetensors

    f = SafetensorsFile(path)
    tensors = {n: np.array(f.array(n)) for n in f.tensors}
    meta = f.metadata
    f.close()
    tensors[name] = fn(tensors[name])
    write_safetensors(path, tensors, meta or None)


@pytest.mark.parametrize("damage", ["truncated", "corrupt_header", "corrupt_data", "wrong_shape"])
def test_shard_refuses_damaged_checkpoint(model_dir, tmp_path, damage):
    d = _copy(model_dir, str(tmp_path / "m"))
    path, name = _expert_file(d)
    if damage == "truncated":
        _cut(path, name)
    elif damage == "corrupt_header":
        with open(path, "r+b") as f:
            f.seek(12)
            f.write(b"\xff\x00garbage\x00")
    elif damage == "corrupt_data":
        from checkpoint.reader import SafetensorsFile

        info = SafetensorsFile(path).tensors[name]
        with open(path, "r+b") as f:  # NaN bf16 bit patterns in the middle of the tensor
            f.seek(info.begin + 64)
            f.write(b"\xc0\x7f" * 32)
    else:
        _rewrite(path, name, lambda a: a[:, :-2].copy())
    p = _run_shard(d)
    assert p.returncode != 0 and "READY" not in p.stdout, (p.stdout, p.stderr[-2000:])
    assert os.path.basename(path) in p.stderr, p.stderr[-2000:]
    if damage != "corrupt_header":  # a broken header cannot say which tensor: the file is named
        assert name in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


@pytest.mark.parametrize("damage", ["truncated", "wrong_shape"])
def test_gpu_service_refuses_damaged_checkpoint(model_dir, stack, tmp_path, damage):
    """`moesplit gpu-server` verifies what it loads before reporting ready (the shards are fine)."""
    d = _copy(model_dir, str(tmp_path / "m"))
    path, name = _dense_file(d)
    if damage == "truncated":
        _cut(path, name)
    else:
        _rewrite(path, name, lambda a: a[:-1].copy())
    live = [stack.shards.addresses[stack.shards.groups.index(g)] for g in (0, 1)]
    p = subprocess.run([sys.executable, "-m", "moesplit", "gpu-server", "--model", d, "--shards-addresses",
                        ",".join(live), "--port", "0", "--grpc-port", "0", "--device", "cpu", "--dtype", "float32",
                        "--kv-tokens", "256"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 1 and "serving" not in p.stderr.split("\n")[-2:], p.stderr[-2000:]
    logical = name.replace("_scale_inv", "")
    assert os.path.basename(path) in p.stderr and (name in p.stderr or logical in p.stderr), p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]


def test_generate_cli_with_replicas(stack, model_dir):
    """`moesplit generate --replicas 2`: 2 shards x 2 replicas, same greedy tokens as the stack."""
    ids = _prompts(stack.tokenizer)[1]
    p = subprocess.run([sys.executable, "-m", "moesplit", "generate", "--model", model_dir, "--prompt-ids",
                        ",".join(map(str, ids)), "--max-new-tokens", "6", "--shards", "2", "--replicas", "2",
                        "--backend", "auto", "--device", "cpu", "--dtype", "float32", "--ignore-eos",
                        "--expert-timeout", "10", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    want = stack.engine.submit(ids, max_tokens=6, ignore_eos=True).result(60)[0]
    assert out["token_ids"] == want
