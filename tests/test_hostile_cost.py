"""Hostile clients, round 2 (loopback only, bounded in time): per-request cost, log amplification,
shard authentication.

- Noisy neighbours: `stop_token_ids` / `logit_bias` over their caps, aliased bias keys (" 005 ",
  "05"), too many tools, schemas nested past MAX_SCHEMA_DEPTH are refused with a 400 (gRPC:
  INVALID_ARGUMENT) naming the field; 8 neighbours at the caps slow another stream by at most 2x
  compared with 8 plain neighbours.
- Log amplification: a depth-300 json_schema is a 400 before anything compiles it, with no
  traceback logged; the shard answers a [0, 2**62]-shaped call with INVALID_ARGUMENT, no traceback.
- Shard authentication: a shard started with a shared token refuses every ExpertService call
  without it (UNAUTHENTICATED), keeps health open, serves the GPU side's client (gRPC and TCP data
  path); idle sockets on the data port leave room for the real client.
A normal greedy request afterwards returns the tokens it returned before the probes.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

import grpc
import httpx
import numpy as np
import pytest

KEY = "sk-hostile"
MODEL = "tiny-hostile"
TOKEN = "0123456789abcdef0123456789abcdef"
H = {"authorization": f"Bearer {KEY}"}
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=0)


@pytest.fixture(scope="module")
def stack(model_dir):
    import torch

    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.api.tokenizer import Tokenizer
    from gpu_service.entrypoints.serving import ServingStack
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    _, backend, _ = load_shard(model_dir, None, None, "numpy")
    runner = ModelRunner(CheckpointReader(model_dir), LocalExperts(backend), device=torch.device("cpu"),
                         dtype=torch.float32, kv_tokens=8192, page_size=16)
    st = ServingStack(runner, Tokenizer(model_dir), MODEL, port=0, grpc_port=0, api_key=KEY, max_batch=16,
                      chunk_tokens=64, max_waiting=64)
    st.start()
    st.reference = _greedy(st)  # before any probe
    yield st
    st.stop()


def _greedy(st, n=12) -> list[int]:
    ids, _, _ = st.engine.submit(PROMPT, max_tokens=n, ignore_eos=True).result(timeout=60)
    return ids


def _post(st, body, path="/v1/completions", timeout=30):
    return httpx.post(st.http_url + path, json=body, headers=H, timeout=timeout)


def _refused(st, body, param, path="/v1/completions", within_s=2.0):
    t0 = time.perf_counter()
    r = _post(st, body, path)
    dt = time.perf_counter() - t0
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] and err["param"].startswith(param), err
    assert dt < within_s, dt
    return err["message"]


def _grpc_refused(st, **fields) -> grpc.RpcError:
    """The gRPC Generate call with `fields` must fail INVALID_ARGUMENT at once."""
    from gpu_service.api.grpc_client import GenerateClient
    from protos.moesplit.v1 import generate_pb2

    with GenerateClient(st.grpc_address, api_key=KEY) as gc, pytest.raises(grpc.RpcError) as ei:
        req = generate_pb2.GenerateRequest(prompt_ids=PROMPT, max_tokens=2, **fields)
        list(gc.stub.Generate(req, timeout=10, metadata=gc.metadata))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
    return ei.value


# ---- bounded per-request cost ------------------------------------------------------------------
def test_token_lists_capped_and_bias_keys_canonical(stack):
    from gpu_service.runtime.requests import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS

    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2}
    msg = _refused(stack, {**base, "stop_token_ids": list(range(500_000))}, "stop_token_ids")
    assert str(MAX_STOP_TOKEN_IDS) in msg
    aliases = {f" {i:03d} ": 100 for i in range(100)}  # " 005 " once parsed as 5
    for bias in (aliases, {"05": 1}, {"+5": 1}, {"5.0": 1}, {"٥": 1}):
        assert "plain decimal" in _refused(stack, {**base, "logit_bias": bias}, "logit_bias")
    big = {str(i): 1 for i in range(100_000)}
    assert str(MAX_LOGIT_BIAS) in _refused(stack, {**base, "logit_bias": big}, "logit_bias")
    V = stack.engine.cfg.vocab_size
    full = [t % V for t in range(MAX_STOP_TOKEN_IDS)]  # repeats allowed: the cap bounds the list
    r = _post(stack, {**base, "logit_bias": {"5": 100, "6": -100}, "stop_token_ids": full})
    assert r.status_code == 200, r.text[:300]

    e = _grpc_refused(stack, stop_token_ids=[t % V for t in range(MAX_STOP_TOKEN_IDS + 1)])
    assert "stop_token_ids" in e.details()
    e = _grpc_refused(stack, logit_bias={t: 1.0 for t in range(MAX_LOGIT_BIAS + 1)})
    assert str(MAX_LOGIT_BIAS) in e.details()
    assert _greedy(stack) == stack.reference


def test_engine_caps_token_lists_for_direct_callers(stack):
    """Engine.submit / submit_n refuse what the API edges refuse, so a caller that bypasses the API
    (an embedding, a plugin) cannot hand the scheduler 500k stop ids or bias entries either."""
    import subprocess
    import sys

    from gpu_service.runtime.requests import MAX_LOGIT_BIAS, MAX_N, MAX_STOP_TOKEN_IDS, RequestError
    from gpu_service.runtime.sampling import SamplingParams

    eng = stack.engine
    V = eng.cfg.vocab_size
    waiting = eng.stats()["waiting"]
    requests = eng.counters["requests"]
    hostile = {
        "stop_token_ids": SamplingParams(stop_token_ids=tuple(t % V for t in range(500_000))),
        "logit_bias": SamplingParams(logit_bias=tuple((t, 1.0) for t in range(500_000))),
    }
    caps = {"stop_token_ids": MAX_STOP_TOKEN_IDS, "logit_bias": MAX_LOGIT_BIAS}
    for param, sp in hostile.items():
        with pytest.raises(RequestError) as ei:
            eng.submit(PROMPT, sp, max_tokens=2)
        assert isinstance(ei.value, ValueError) and ei.value.param == param
        assert str(caps[param]) in str(ei.value) and param in str(ei.value), str(ei.value)
        # one hostile choice among plain ones: the whole unit is refused, nothing queued
        with pytest.raises(RequestError) as ei:
            eng.submit_n(PROMPT, [SamplingParams(), sp, SamplingParams()], max_tokens=2)
        assert ei.value.param == param
    one_over = {"stop_token_ids": SamplingParams(stop_token_ids=(1,) * (MAX_STOP_TOKEN_IDS + 1)),
                "logit_bias": SamplingParams(logit_bias=tuple((t % V, 0.0) for t in range(MAX_LOGIT_BIAS + 1)))}
    for param, sp in one_over.items():
        with pytest.raises(RequestError) as ei:
            eng.submit(PROMPT, sp, max_tokens=2)
        assert ei.value.param == param
    with pytest.raises(RequestError) as ei:  # the API refuses aliased keys; the engine refuses the same id twice
        eng.submit(PROMPT, SamplingParams(logit_bias=((5, 100.0), (5, 100.0))), max_tokens=2)
    assert ei.value.param == "logit_bias" and "more than once" in str(ei.value)
    with pytest.raises(RequestError) as ei:
        eng.submit_n(PROMPT, [SamplingParams(temperature=1.0, seed=i) for i in range(MAX_N + 1)], max_tokens=2)
    assert ei.value.param == "n" and str(MAX_N) in str(ei.value)
    assert eng.stats()["waiting"] == waiting and eng.counters["requests"] == requests  # refused before queueing

    # exactly at the caps: served
    at_caps = SamplingParams(stop_token_ids=tuple(t % V for t in range(MAX_STOP_TOKEN_IDS)),
                             logit_bias=tuple((t, 0.0) for t in range(min(V, MAX_LOGIT_BIAS))))
    _, _, reason = eng.submit(PROMPT, at_caps, max_tokens=1, ignore_eos=True).result(timeout=60)
    assert reason in ("stop", "length"), reason
    # the engine gets the caps without importing the API package
    code = ("import sys, gpu_service.runtime.engine, gpu_service.runtime.requests as r; "
            "assert r.MAX_STOP_TOKEN_IDS and r.MAX_LOGIT_BIAS and r.MAX_N; "
            "print([m for m in sys.modules if m.startswith('gpu_service.api')])")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert p.returncode == 0 and p.stdout.strip() == "[]", (p.stdout, p.stderr[-2000:])
    assert _greedy(stack) == stack.reference


def _nested(depth: int) -> dict:
    s: dict = {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}}
    return s


def test_deep_schema_400_before_compiling_no_traceback(stack, caplog):
    caplog.set_level(logging.DEBUG)
    stats = dict(stack.engine.grammars.stats)
    rf = {"type": "json_schema", "json_schema": {"name": "deep", "schema": _nested(300)}}
    msg = _refused(stack, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "response_format": rf},
                   "response_format")
    assert "deep" in msg and "$ref" in msg
    _refused(stack, {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "guided_json": json.dumps(_nested(300))},
             "guided_json")
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    tool = {"type": "function", "function": {"name": "f", "parameters": _nested(300)}}
    _refused(stack, {**chat, "tools": [tool]}, "tools[0].function.parameters", path="/v1/chat/completions")
    many = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    assert "128" in _refused(stack, {**chat, "tools": many}, "tools", path="/v1/chat/completions")
    assert stack.engine.grammars.stats == stats  # refused before the compiler saw it
    assert not any(r.exc_info for r in caplog.records), [r.getMessage() for r in caplog.records if r.exc_info]
    assert not any("Traceback" in r.getMessage() or r.levelno >= logging.ERROR for r in caplog.records)
    ok = {"type": "json_schema", "json_schema": {"name": "ok", "schema": _nested(8)}}
    r = _post(stack, {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "response_format": ok})
    assert r.status_code == 200, r.text[:300]

    assert "deep" in _grpc_refused(stack, json_schema=json.dumps(_nested(300))).details()
    assert _greedy(stack) == stack.reference


def _victim_rate(st, neighbour_params, n_tokens=40) -> float:
    """Tokens/s of one greedy stream while 8 neighbours with `neighbour_params` generate."""
    from gpu_service.runtime.sampling import SamplingParams

    hs = [st.engine.submit([3 + i, 4, 5], neighbour_params, max_tokens=900, ignore_eos=True) for i in range(8)]
    try:
        for h in hs:  # every neighbour in the batch before the clock starts
            next(iter(h))
        v = st.engine.submit(PROMPT, SamplingParams(), max_tokens=n_tokens + 1, ignore_eos=True)
        it = iter(v)
        next(it)
        t0 = time.perf_counter()
        got = sum(len(o.token_ids) for o in it)
        dt = time.perf_counter() - t0
        assert not any(h.done for h in hs), "a neighbour finished early: the measurement would be unfair"
    finally:
        for h in hs:
            h.cancel()
    assert got == n_tokens, got
    return got / dt


def test_noisy_neighbours_slow_another_stream_at_most_2x(stack):
    from gpu_service.api.openai_params import sampling_fields
    from gpu_service.runtime.requests import MAX_LOGIT_BIAS, MAX_STOP_TOKEN_IDS
    from gpu_service.runtime.sampling import SamplingParams

    V = stack.engine.cfg.vocab_size
    ids = np.random.default_rng(0).permutation(V)
    body = {"logit_bias": {str(int(t)): -1.0 for t in ids[:MAX_LOGIT_BIAS]},  # every id of a small vocabulary
            # half the vocabulary, repeated up to the cap; banned (min_tokens) for the whole run
            "stop_token_ids": [int(ids[i % (V // 2)]) for i in range(MAX_STOP_TOKEN_IDS)], "min_tokens": 1000,
            "repetition_penalty": 1.1, "frequency_penalty": 0.5, "presence_penalty": 0.5}
    hostile = SamplingParams(**sampling_fields(body, V))  # the most a request may carry
    plain = SamplingParams()
    rates = {"plain": [], "hostile": []}
    for _ in range(3):  # interleaved, best of three: the machine is shared (two were seen to flake under load)
        rates["plain"].append(_victim_rate(stack, plain))
        rates["hostile"].append(_victim_rate(stack, hostile))
    best = {k: max(v) for k, v in rates.items()}
    print(f"victim tokens/s with 8 neighbours: plain {best['plain']:.0f}, at the caps {best['hostile']:.0f}")
    assert best["hostile"] >= 0.5 * best["plain"], rates
    assert _greedy(stack) == stack.reference


# ---- the shard: authentication, shapes, data-path slots ---------------------------------------
@pytest.fixture(scope="module")
def shard(model_dir):
    from gpu_service.local.stack import start_shards

    sh = start_shards(model_dir, 1, backend="numpy", auth_token=TOKEN)
    yield sh
    sh.stop()


@pytest.fixture(scope="module")
def cfg(model_dir):
    from checkpoint.config import load_config

    return load_config(model_dir)


def _stub(address, token=None):
    from protos.moesplit.v1 import experts_pb2_grpc
    from wire.channel import make_channel

    ch = make_channel(address, [], token=token.encode() if token else None) if token else grpc.insecure_channel(address)
    return ch, experts_pb2_grpc.ExpertServiceStub(ch)


def _layer_request(cfg, T=3, hidden_shape=None):
    from cpu_expert_service.server import to_tensor
    from protos.moesplit.v1 import experts_pb2

    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(T)])
    w = rng.random((T, cfg.num_experts_per_tok)).astype(np.float32)
    req = experts_pb2.LayerRequest(seq=1, layer=cfg.moe_layers[0], hidden=to_tensor(x),
                                   topk_ids=to_tensor(ids.astype(np.int64)), topk_weights=to_tensor(w))
    if hidden_shape is not None:
        req.hidden.shape[:] = hidden_shape
        req.hidden.data = b""
    return req


def test_shard_refuses_calls_without_the_token(shard, cfg):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from protos.moesplit.v1 import experts_pb2

    addr = shard.addresses[0]
    for token in (None, "wrong", TOKEN[:-1] + "0"):
        ch, stub = _stub(addr, token)
        calls = [lambda: stub.Describe(experts_pb2.DescribeRequest(), timeout=5),
                 lambda: stub.ForwardOne(_layer_request(cfg), timeout=5),
                 lambda: stub.AttachTcp(experts_pb2.AttachTcpRequest(), timeout=5),
                 lambda: next(stub.Forward(iter([_layer_request(cfg)]), timeout=5))]
        for call in calls:
            with pytest.raises(grpc.RpcError) as ei:
                call()
            assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, (token, ei.value)
            assert "MOESPLIT_SHARD_TOKEN" in ei.value.details()
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
        ch.close()
    ch, stub = _stub(addr, TOKEN)
    assert stub.ForwardOne(_layer_request(cfg), timeout=10).output.shape[:] == [3, cfg.hidden_size]
    ch.close()


def test_flooding_unauthenticated_streams_leave_the_shard_alone(shard, cfg):
    """32 streams of T = 16,384 calls without the token: refused; a real call stays fast."""
    from protos.moesplit.v1 import experts_pb2

    big = _layer_request(cfg, T=16384).SerializeToString()
    stop = threading.Event()
    codes = []

    def flood():
        ch, _ = _stub(shard.addresses[0])
        fwd = ch.stream_stream("/moesplit.v1.ExpertService/Forward")
        while not stop.is_set():
            try:
                for _ in fwd(iter([big] * 4), timeout=5):
                    pass
            except grpc.RpcError as e:
                codes.append(e.code())
        ch.close()

    threads = [threading.Thread(target=flood, daemon=True) for _ in range(32)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        ch, stub = _stub(shard.addresses[0], TOKEN)
        t0 = time.perf_counter()
        stub.ForwardOne(_layer_request(cfg), timeout=10)
        dt = time.perf_counter() - t0
        ch.close()
    finally:
        stop.set()
        for t in threads:
            t.join(10)
    assert codes and set(codes) == {grpc.StatusCode.UNAUTHENTICATED}, set(codes)
    assert dt < 1.0, dt
    assert experts_pb2 is not None


def test_huge_shape_is_invalid_argument_without_traceback(shard, cfg):
    ch, stub = _stub(shard.addresses[0], TOKEN)
    before = os.path.getsize(shard.logs[0])
    for shape in ([0, 2**62], [2**62, 0], [2**40, 2**40]):
        for _ in range(20):
            with pytest.raises(grpc.RpcError) as ei:
                stub.ForwardOne(_layer_request(cfg, hidden_shape=shape), timeout=5)
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, ei.value
            assert "hidden: shape" in ei.value.details()
    assert stub.ForwardOne(_layer_request(cfg), timeout=10).output.shape[:] == [3, cfg.hidden_size]
    ch.close()
    with open(shard.logs[0], "rb") as f:
        f.seek(before)
        tail = f.read().decode(errors="replace")
    assert "Traceback" not in tail and tail.count("\n") < 5, tail[-2000:]


def test_idle_data_connections_leave_room_for_the_client(shard, cfg):
    """64 sockets on the TCP data port that never say hello; the real client still attaches."""
    from protos.moesplit.v1 import experts_pb2
    from wire import tcp as TW

    ch, stub = _stub(shard.addresses[0], TOKEN)
    port = stub.AttachTcp(experts_pb2.AttachTcpRequest(), timeout=5).port
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(TW.MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)
        r = stub.AttachTcp(experts_pb2.AttachTcpRequest(), timeout=5)
        t0 = time.perf_counter()
        with socket.create_connection(("127.0.0.1", r.port), timeout=5) as s:
            s.sendall(r.token)
            assert s.recv(1) == TW.ACK
        assert time.perf_counter() - t0 < 1.0
    finally:
        for s in idle:
            s.close()
        ch.close()


def test_gpu_side_client_sends_the_token(shard, cfg, monkeypatch):
    """The experts client (gRPC and TCP data path) with MOESPLIT_SHARD_TOKEN in its environment."""
    from gpu_service.experts.client import ExpertsClient

    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(2)])
    w = rng.random((2, cfg.num_experts_per_tok)).astype(np.float32)
    monkeypatch.setenv("MOESPLIT_SHARD_TOKEN", TOKEN)
    outs = []
    for transport in ("grpc", "tcp"):
        with ExpertsClient(shard.addresses, cfg, transport=transport) as c:
            outs.append(np.asarray(c.forward(cfg.moe_layers[0], x, ids.astype(np.int64), w)))
    np.testing.assert_array_equal(outs[0], outs[1])
    monkeypatch.delenv("MOESPLIT_SHARD_TOKEN")
    with pytest.raises(Exception, match="UNAUTHENTICATED|token|Unauthenticated"):
        with ExpertsClient(shard.addresses, cfg, transport="grpc") as c:
            c.forward(cfg.moe_layers[0], x, ids.astype(np.int64), w)
