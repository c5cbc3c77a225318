"""Fuzzing the two network edges with hypothesis (derandomized, so CI sees the same inputs).

- ExpertService: >= 10,000 malformed LayerRequests (mutations of real requests: random bytes,
  truncated data, wrong shapes / dtypes, huge and negative dims, random layers and expert ids,
  NaN / Inf, too many tokens, missing tensors, bit-flipped serialized messages) over real gRPC
  to a real shard process. Parseable ones must get INVALID_ARGUMENT (or OK with a well-formed
  answer when the mutation happens to be valid); unparseable bytes any error but never a crash.
  Afterwards the process is alive, answers a valid request bit-identically, and its RSS grew
  < 5% over the fuzzing (measured after a warm-up).
- OpenAI HTTP API: >= 1,000 malformed requests -> 4xx with OpenAI's error shape, never 5xx.
"""
from __future__ import annotations

import json
import math
import os
import time

import grpc
import httpx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_TOKENS = 64  # the shard's --max-tokens
GRPC_MESSAGES = 10_000
PER_EXAMPLE = 8  # messages sent per hypothesis example (a few mutations leave a valid request: 11,000 sent)
HTTP_REQUESTS = 1_000
FORWARD_ONE = "/moesplit.v1.ExpertService/ForwardOne"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("fuzz") / "tiny-fuzz"), "bf16", seed=7)


@pytest.fixture(scope="module")
def shard(model_dir):
    from gpu_service.local.stack import start_shards

    # backend auto: the kernels when built (what production runs), else numpy
    with start_shards(model_dir, 1, backend="auto", extra_args=["--max-tokens", str(MAX_TOKENS)]) as sh:
        yield sh


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def _valid(cfg, T=4, seed=0, layer=None):
    from protos.moesplit.v1 import experts_pb2

    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(T)])
    w = rng.random(ids.shape).astype(np.float32)

    def t(a, dt):
        return experts_pb2.Tensor(dtype=dt, shape=list(a.shape), data=a.tobytes())

    return experts_pb2.LayerRequest(seq=1, layer=cfg.moe_layers[0] if layer is None else layer,
                                    hidden=t(x, "float32"), topk_ids=t(ids.astype(np.int64), "int64"),
                                    topk_weights=t(w, "float32"))


# ---- mutations of a real request ----------------------------------------------------------------
FIELDS = ("hidden", "topk_ids", "topk_weights")
DTYPES = ["float32", "bfloat16", "float16", "int32", "int64", "float64", "int8", "", "FLOAT32", "bool",
          "complex64", "\x00", "float32 ", "ünïcode"]
DIMS = st.one_of(st.integers(-3, 70), st.sampled_from([0, 1, 2**31 - 1, 2**31, 2**32 + 1, 2**62, 2**63 - 1,
                                                       -(2**63), -1]), st.integers(-(2**63), 2**63 - 1))


@st.composite
def mutation(draw, cfg):
    """(kind, function LayerRequest -> LayerRequest | bytes)."""
    kind = draw(st.sampled_from([
        "random_bytes", "truncate", "extend", "shape", "dtype", "layer", "expert_ids", "nonfinite", "too_many_tokens",
        "missing", "rank", "wire_bits", "wire_random", "wire_truncate", "k_zero", "rows", "hidden_size"]))
    field = draw(st.sampled_from(FIELDS))
    if kind == "random_bytes":
        data = draw(st.binary(min_size=0, max_size=4096))
        return kind, lambda r: (getattr(r, field).__setattr__("data", data), r)[1]
    if kind == "truncate":
        cut = draw(st.integers(1, 4096))
        return kind, lambda r: (getattr(r, field).__setattr__("data", getattr(r, field).data[:-cut]), r)[1]
    if kind == "extend":
        extra = draw(st.binary(min_size=1, max_size=64))
        return kind, lambda r: (getattr(r, field).__setattr__("data", getattr(r, field).data + extra), r)[1]
    if kind in ("shape", "rank"):
        shape = draw(st.lists(DIMS, min_size=0, max_size=5)) if kind == "rank" else [draw(DIMS), draw(DIMS)]

        def f(r):
            t = getattr(r, field)
            del t.shape[:]
            t.shape.extend(shape)
            return r
        return kind, f
    if kind == "dtype":
        dt = draw(st.one_of(st.sampled_from(DTYPES), st.text(max_size=12)))
        return kind, lambda r: (getattr(r, field).__setattr__("dtype", dt), r)[1]
    if kind == "layer":
        layer = draw(st.one_of(st.integers(-(2**31), 2**31 - 1), st.sampled_from([0, -1, cfg.num_hidden_layers, 2**31 - 1])))
        return kind, lambda r: (r.__setattr__("layer", layer), r)[1]
    if kind == "expert_ids":
        bad = draw(st.one_of(st.integers(-(2**63), -1), st.integers(cfg.n_routed_experts, 2**63 - 1)))
        where = draw(st.integers(0, 10**6))
        as32 = draw(st.booleans()) and -(2**31) <= bad < 2**31

        def f(r):
            ids = np.frombuffer(r.topk_ids.data, np.int64).copy()
            ids[where % ids.size] = bad
            if as32:
                r.topk_ids.dtype, r.topk_ids.data = "int32", ids.astype(np.int32).tobytes()
            else:
                r.topk_ids.data = ids.tobytes()
            return r
        return kind, f
    if kind == "nonfinite":
        val = draw(st.sampled_from([np.nan, np.inf, -np.inf]))
        which = draw(st.sampled_from(["hidden", "topk_weights"]))
        where = draw(st.integers(0, 10**6))

        def f(r):
            t = getattr(r, which)
            a = np.frombuffer(t.data, np.float32).copy()
            a[where % a.size] = val
            t.data = a.tobytes()
            return r
        return kind, f
    if kind == "too_many_tokens":
        T = draw(st.integers(MAX_TOKENS + 1, MAX_TOKENS + 40))
        return kind, lambda r: _valid(cfg, T=T)
    if kind == "missing":
        return kind, lambda r: (r.ClearField(field), r)[1]
    if kind == "k_zero":  # T rows of zero experts: k must be >= 1
        def f(r):
            T = r.hidden.shape[0] if len(r.hidden.shape) else 1
            for name in ("topk_ids", "topk_weights"):
                t = getattr(r, name)
                del t.shape[:]
                t.shape.extend([T, 0])
                t.data = b""
            return r
        return kind, f
    if kind == "rows":  # ids for fewer / more rows than hidden
        n = draw(st.integers(0, 8))

        def f(r):
            ids = np.frombuffer(r.topk_ids.data, np.int64).reshape(tuple(r.topk_ids.shape))  # real data: small
            if ids.ndim != 2 or ids.shape[1] > 64:
                return r
            reps = np.resize(ids, (n if n != ids.shape[0] else n + 1, ids.shape[1]))
            r.topk_ids.data = reps.astype(np.int64).tobytes()
            del r.topk_ids.shape[:]
            r.topk_ids.shape.extend(reps.shape)
            return r
        return kind, f
    if kind == "hidden_size":
        H = draw(st.integers(1, 2 * cfg.hidden_size).filter(lambda h: h != cfg.hidden_size))

        def f(r):
            T = min(r.hidden.shape[0], MAX_TOKENS) if len(r.hidden.shape) else 1  # never build a huge array here
            r.hidden.data = np.zeros((max(T, 0), H), np.float32).tobytes()
            del r.hidden.shape[:]
            r.hidden.shape.extend([T, H])
            return r
        return kind, f
    # wire-level: bytes that may not even parse
    if kind == "wire_bits":
        flips = draw(st.lists(st.integers(0, 10**7), min_size=1, max_size=16))

        def f(r):
            b = bytearray(r.SerializeToString())
            for i in flips:
                b[i % len(b)] ^= 1 << (i % 8)
            return bytes(b)
        return kind, f
    if kind == "wire_random":
        data = draw(st.binary(min_size=0, max_size=2048))
        return kind, lambda r: data
    cut = draw(st.integers(1, 2000))
    return kind, lambda r: r.SerializeToString()[:-cut]


def _check_answer(cfg, req_bytes, resp_or_err, stats):
    from protos.moesplit.v1 import experts_pb2

    if isinstance(resp_or_err, grpc.RpcError):
        code = resp_or_err.code()
        stats[code.name] = stats.get(code.name, 0) + 1
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            assert resp_or_err.details(), "INVALID_ARGUMENT without a message"
            return
        # anything else is only acceptable for bytes that are not a LayerRequest at all
        try:
            experts_pb2.LayerRequest.FromString(req_bytes)
            parses = True
        except Exception:  # noqa: BLE001
            parses = False
        assert not parses, f"{code.name}: {resp_or_err.details()} for a parseable request"
        return
    stats["OK"] = stats.get("OK", 0) + 1  # the mutation happened to leave a valid request
    resp = experts_pb2.LayerResponse.FromString(resp_or_err)
    req = experts_pb2.LayerRequest.FromString(req_bytes)
    assert list(resp.output.shape) == [req.hidden.shape[0], cfg.hidden_size]


def test_fuzz_expert_service(shard, model_dir):
    from checkpoint.config import load_config
    from protos.moesplit.v1 import experts_pb2

    cfg = load_config(model_dir)
    addr, proc = shard.addresses[0], shard.procs[0]
    ch = grpc.insecure_channel(addr)
    call = ch.unary_unary(FORWARD_ONE)  # raw bytes in and out: unparseable messages reach the server too
    good = _valid(cfg, T=5, seed=1)
    reference = experts_pb2.LayerResponse.FromString(call(good.SerializeToString(), timeout=10)).output
    stats: dict = {}
    sent = [0]
    base_reqs = [_valid(cfg, T=t, seed=t, layer=l) for t in (1, 3, 8) for l in cfg.moe_layers]

    def send(req_bytes):
        try:
            out = call(req_bytes, timeout=10)
        except grpc.RpcError as e:
            out = e
        sent[0] += 1
        _check_answer(cfg, req_bytes, out, stats)

    # warm-up: every kind of mutation once or more, plus messages over the size limit and a stream abort
    rng = np.random.default_rng(0)
    for i in range(600):
        b = bytearray(base_reqs[i % len(base_reqs)].SerializeToString())
        b[rng.integers(len(b))] ^= 0xFF
        send(bytes(b))
    from wire.channel import max_message_bytes

    too_big = experts_pb2.LayerRequest(seq=1, layer=cfg.moe_layers[0], hidden=experts_pb2.Tensor(
        dtype="float32", shape=[1, 1], data=b"\0" * (max_message_bytes(cfg, MAX_TOKENS) + 1024)))
    with pytest.raises(grpc.RpcError) as ei:
        call(too_big.SerializeToString(), timeout=10)
    assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    stub_stream = ch.stream_stream("/moesplit.v1.ExpertService/Forward")
    with pytest.raises(grpc.RpcError) as ei:
        bad = _valid(cfg)
        bad.layer = 0
        list(stub_stream(iter([good.SerializeToString(), bad.SerializeToString()]), timeout=10))
    assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    def fuzz(batch):
        for base, muts in batch:
            req = experts_pb2.LayerRequest()
            req.CopyFrom(base_reqs[base])
            for _, f in muts:
                if isinstance(req, bytes):
                    break
                try:
                    req = f(req)
                except (ValueError, IndexError, ZeroDivisionError):  # an earlier mutation left nothing to mutate
                    pass
            send(req if isinstance(req, bytes) else req.SerializeToString())

    def run(n_examples):
        settings(max_examples=n_examples, deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))(
            given(st.lists(st.tuples(st.integers(0, len(base_reqs) - 1), st.lists(mutation(cfg), min_size=1, max_size=3)),
                           min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))(fuzz))()

    run(200)  # warm-up through the same paths (allocator pools, gRPC arenas, kernel scratch) before measuring
    time.sleep(0.5)
    rss0 = _rss(proc.pid)
    t0 = time.monotonic()
    warm = sent[0]
    stats.clear()
    run(GRPC_MESSAGES * 11 // 10 // PER_EXAMPLE)
    n = sent[0] - warm
    dt = time.monotonic() - t0
    time.sleep(0.5)
    rss1 = _rss(proc.pid)
    assert proc.poll() is None, "the shard process died"
    again = experts_pb2.LayerResponse.FromString(call(good.SerializeToString(), timeout=10)).output
    assert again.data == reference.data and list(again.shape) == list(reference.shape)
    growth = (rss1 - rss0) / rss0
    print(f"\ngRPC fuzz: {n} mutated messages in {dt:.1f}s ({sent[0]} with warm-up), answers {stats}; "
          f"shard RSS {rss0 / 2**20:.1f} -> {rss1 / 2**20:.1f} MiB ({growth * 100:+.2f}%)")
    assert stats.get("INVALID_ARGUMENT", 0) >= GRPC_MESSAGES  # refused as malformed, and the shard lived on
    assert growth < 0.05, (rss0, rss1)
    ch.close()


# ---- HTTP ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http_stack(model_dir):
    import torch

    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner
    from gpu_service.entrypoints.serving import ServingStack
    from gpu_service.api.tokenizer import Tokenizer

    _, backend, _ = load_shard(model_dir, None, None, "numpy")
    runner = ModelRunner(CheckpointReader(model_dir), LocalExperts(backend), device=torch.device("cpu"),
                         dtype=torch.float32, kv_tokens=512, page_size=16)
    st_ = ServingStack(runner, Tokenizer(model_dir), "fuzz", port=0, grpc_port=0, max_batch=4, chunk_tokens=64)
    st_.start()
    yield st_
    st_.stop()


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids, max_size=4),
    max_leaves=8)
NOT_INT = JSON.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, int)))
NOT_NUM = JSON.filter(lambda v: v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))))


@st.composite
def bad_request(draw, vocab):
    """(method, path, body bytes) that must be refused with a 4xx."""
    chat = draw(st.booleans())
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": "fuzz", "max_tokens": 2}
    if chat:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = [5, 6, 7]
    for k, v in draw(st.dictionaries(st.sampled_from(["user", "logit_bias", "x", "presence_penalty"]), JSON,
                                     max_size=2)).items():
        body[k] = v  # noise the server ignores
    kind = draw(st.sampled_from([
        "model", "prompt", "messages", "max_tokens", "temperature", "top_p", "n", "stop", "stream_options",
        "seed", "top_k", "bools", "json", "not_object", "path", "method", "missing"]))
    if kind == "model":
        body["model"] = draw(st.text(max_size=30).filter(lambda m: m != "fuzz"))
    elif kind == "prompt" and not chat:
        body["prompt"] = draw(st.one_of(
            st.lists(st.integers(vocab, 2**80) | st.integers(-(2**80), -1), min_size=1, max_size=5),
            st.just([]), st.integers(), st.floats(allow_nan=True), st.lists(st.floats(), min_size=1),
            st.dictionaries(st.text(max_size=5), JSON, max_size=3),
            st.lists(st.lists(st.integers(0, 9)), min_size=2).filter(lambda b: not all(b))))  # a batch with an empty prompt
    elif kind in ("prompt", "messages"):
        body["messages"] = draw(st.one_of(
            st.just([]), st.text(max_size=10), st.integers(), st.lists(st.integers(), min_size=1, max_size=3),
            st.lists(st.fixed_dictionaries({"role": st.text(max_size=10).filter(
                lambda r: r not in ("system", "user", "assistant", "developer", "tool")), "content": st.text(max_size=10)}),
                min_size=1, max_size=3),
            st.lists(st.fixed_dictionaries({"role": st.just("user"), "content": st.integers() | st.dictionaries(
                st.text(max_size=3), st.integers(), max_size=2) | st.lists(st.integers(), min_size=1)}),
                min_size=1, max_size=2)))
        if not chat:
            body.pop("prompt")  # completions without a prompt
    elif kind == "max_tokens":
        body["max_tokens"] = draw(st.one_of(st.integers(-(2**70), 0), st.integers(10**6, 2**70), NOT_INT))
    elif kind == "temperature":
        body["temperature"] = draw(st.one_of(st.floats(max_value=-1e-9), st.just(float("nan")), st.just(float("inf")),
                                             NOT_NUM))
    elif kind == "top_p":
        body["top_p"] = draw(st.one_of(st.floats(max_value=0.0), st.floats(min_value=1.0001), st.just(float("nan")),
                                       NOT_NUM))
    elif kind == "n":
        body["n"] = draw(st.one_of(st.integers().filter(lambda n: n != 1), NOT_INT))
    elif kind == "stop":
        body["stop"] = draw(st.one_of(st.integers(), st.dictionaries(st.text(max_size=3), JSON, min_size=1, max_size=2),
                                      st.lists(st.integers() | st.none(), min_size=1, max_size=3),
                                      st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=20)))
    elif kind == "stream_options":
        body["stream"] = True
        body["stream_options"] = draw(JSON.filter(lambda v: v is not None and not isinstance(v, dict)))
    elif kind == "seed":
        body["seed"] = draw(st.one_of(st.integers(2**64, 2**90), st.integers(-(2**90), -(2**63) - 1), NOT_INT))
        body["temperature"] = 0.5
    elif kind == "top_k":
        body["top_k"] = draw(NOT_INT)
    elif kind == "bools":
        body[draw(st.sampled_from(["stream", "ignore_eos", "return_token_ids"]))] = draw(
            JSON.filter(lambda v: v is not None and not isinstance(v, bool)))
    elif kind == "missing":
        body.pop("messages" if chat else "prompt")
    if kind == "json":
        raw = draw(st.binary(max_size=200).filter(lambda b: _not_json_object(b)))
    elif kind == "not_object":
        raw = json.dumps(draw(JSON.filter(lambda v: not isinstance(v, dict)))).encode()
    else:
        raw = json.dumps(body).encode()  # NaN / Infinity written as such (Python's json reads them back)
    method = "POST"
    if kind == "path":
        path = "/v1/" + draw(st.text(alphabet="abcdefghijklmnopqrstuvwxyz/_-", min_size=1, max_size=20).filter(
            lambda p: p.strip("/") not in ("completions", "chat/completions", "models")))
    elif kind == "method":
        method = draw(st.sampled_from(["GET", "PUT", "DELETE", "PATCH"]))
    return method, path, raw


def _not_json_object(b: bytes) -> bool:
    try:
        return not isinstance(json.loads(b), dict)
    except Exception:  # noqa: BLE001
        return True


def test_fuzz_http_api(http_stack):
    vocab = http_stack.engine.cfg.vocab_size
    stats: dict = {}
    with httpx.Client(base_url=http_stack.http_url, timeout=30) as c:
        @settings(max_examples=HTTP_REQUESTS, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(bad_request(vocab))
        def fuzz(req):
            method, path, raw = req
            for attempt in (0, 1):  # a reset of a kept-alive socket (a close racing the next request): once
                try:
                    r = c.request(method, path, content=raw, headers={"content-type": "application/json"})
                    break
                except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                    if attempt:
                        raise
                    stats["reset"] = stats.get("reset", 0) + 1
            stats[r.status_code] = stats.get(r.status_code, 0) + 1
            assert 400 <= r.status_code < 500, (method, path, raw[:300], r.status_code, r.text[:500])
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text

        t0 = time.monotonic()
        fuzz()
        dt = time.monotonic() - t0
        ok = c.post("/v1/completions", json={"model": "fuzz", "prompt": [5, 6, 7], "max_tokens": 2})
    assert ok.status_code == 200, ok.text
    assert http_stack.engine.alive
    resets = stats.pop("reset", 0)  # each such request was sent again on a new connection and checked
    assert resets <= HTTP_REQUESTS // 100, f"{resets} connection resets: more than a rare close race"
    n = sum(stats.values())
    print(f"\nHTTP fuzz: {n} malformed requests in {dt:.1f}s, statuses {dict(sorted(stats.items()))}, "
          f"{resets} resets retried")
    assert n >= HTTP_REQUESTS
