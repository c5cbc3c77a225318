"""CPU expert shards end to end: numpy backend, real shard processes, the GPU-side client.

Shard processes are started once per module (one whole shard, two by experts, two by
intermediate slice, two FP8 slice shards) on a small random checkpoint whose experts are big
enough (~38 MB in f32) for the memory check to mean something.
"""
from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import subprocess
import sys

import grpc
import ml_dtypes
import numpy as np
import pytest

from checkpoint.config import load_config
from checkpoint.names import expert_weight
from checkpoint.reader import CheckpointReader
from cpu_expert_service.backend import ExpertBackend, NumpyExperts, make_backend
from cpu_expert_service.server import parse_experts, parse_slice, slice_range
from gpu_service.experts.errors import CoverageError, FingerprintError, ShardError
from gpu_service.experts.client import ExpertsClient
from gpu_service.local.stack import expert_ranges, start_shards
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMS = dict(
    hidden_size=256,
    moe_intermediate_size=384,
    n_routed_experts=16,
    num_experts_per_tok=4,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
MAX_TOKENS = 64  # --max-tokens of the whole shard


# ---- checkpoints ------------------------------------------------------------------------------
def _own_tiny(out_dir: str, fmt: str, seed: int) -> str:
    """Expert weights + config.json only (used when gpu_service.local.tiny is not available)."""
    from checkpoint.formats import quant_fp8_block
    from checkpoint.reader import write_safetensors

    os.makedirs(out_dir, exist_ok=True)
    cfg = dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=64,
        intermediate_size=512, num_attention_heads=2, kv_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, q_lora_rank=None, torch_dtype="bfloat16", **DIMS,
    )
    if fmt == "fp8":
        cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    rng = np.random.default_rng(seed)
    H, I = DIMS["hidden_size"], DIMS["moe_intermediate_size"]
    tensors = {}
    for layer in range(DIMS["first_k_dense_replace"], DIMS["num_hidden_layers"]):
        for e in range(DIMS["n_routed_experts"]):
            for proj, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
                w = (rng.standard_normal(shape) * 0.05).astype(np.float32)
                name = expert_weight(layer, e, proj)
                if fmt == "fp8":
                    q, s = quant_fp8_block(w)
                    tensors[name], tensors[name + "_scale_inv"] = q, s
                else:
                    tensors[name] = w.astype(ml_dtypes.bfloat16)
    write_safetensors(os.path.join(out_dir, "model.safetensors"), tensors)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out_dir


def make_ckpt(out_dir: str, fmt: str, seed: int = 0) -> str:
    try:
        from gpu_service.local.tiny import make_tiny
    except ImportError:
        return _own_tiny(out_dir, fmt, seed)
    return make_tiny(out_dir, fmt=fmt, seed=seed, overrides=dict(DIMS))


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    return make_ckpt(str(tmp_path_factory.mktemp("tiny_bf16")), "bf16")


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory):
    return make_ckpt(str(tmp_path_factory.mktemp("tiny_fp8")), "fp8", seed=1)


@pytest.fixture(scope="module")
def cfg(bf16_dir):
    return load_config(bf16_dir)


def _weights(model_dir):
    """{(layer, expert): (gate, up, down)} float32, read in-process (the reference's weights)."""
    r = CheckpointReader(model_dir)
    c = r.config
    return {
        (l, e): tuple(r.get(expert_weight(l, e, p)) for p in ("gate", "up", "down"))
        for l in c.moe_layers
        for e in range(c.n_routed_experts)
    }


@pytest.fixture(scope="module")
def bf16_weights(bf16_dir):
    return _weights(bf16_dir)


# ---- shard processes (started once) -----------------------------------------------------------
@pytest.fixture(scope="module")
def shards(bf16_dir, fp8_dir):
    started = {}
    try:
        started["whole"] = start_shards(bf16_dir, 1, extra_args=("--max-tokens", str(MAX_TOKENS)))
        started["experts"] = start_shards(bf16_dir, 2, split="experts")
        started["slice"] = start_shards(bf16_dir, 2, split="intermediate")
        started["fp8"] = start_shards(fp8_dir, 2, split="intermediate")
        yield started
    finally:
        for s in started.values():
            s.stop()


@pytest.fixture(scope="module")
def clients(shards, cfg, fp8_dir):
    made = {}
    for name, s in shards.items():
        c = load_config(fp8_dir) if name == "fp8" else cfg
        made[name] = ExpertsClient(s.addresses, c, timeout_s=20.0).connect()
    yield made
    for c in made.values():
        c.close()


# ---- helpers ----------------------------------------------------------------------------------
def routing(T, E, k, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int64)  # distinct per row
    w = rng.random((T, k)).astype(np.float32)
    x = rng.standard_normal((T, DIMS["hidden_size"])).astype(np.float32)
    return x, ids, w


def loop_reference(weights, layer, x, ids, w, held=None):
    """Independent per-token, per-choice loop in float64."""
    out = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            if held is not None and e not in held:
                continue
            g, u, d = (a.astype(np.float64) for a in weights[(layer, e)])
            a = g @ x[t]
            h = (a / (1 + np.exp(-a))) * (u @ x[t])
            out[t] += w[t, j] * (d @ h)
    return out


def _req(layer, x, ids, w, seq=1, hidden_dtype="float32", ids_dtype="int64", w_dtype="float32"):
    def t(a, dt):
        np_dt = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
                 "int32": np.int32, "int64": np.int64}[dt]
        a = np.ascontiguousarray(a, dtype=np_dt)
        return experts_pb2.Tensor(dtype=dt, shape=list(a.shape), data=a.tobytes())

    return experts_pb2.LayerRequest(seq=seq, layer=layer, hidden=t(x, hidden_dtype),
                                    topk_ids=t(ids, ids_dtype), topk_weights=t(w, w_dtype))


def _stub(address):
    ch = grpc.insecure_channel(address)
    return ch, experts_pb2_grpc.ExpertServiceStub(ch)


def _vm(pid, key):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


# ---- backend ------------------------------------------------------------------------------------
def test_numpy_experts_matches_loop_reference():
    rng = np.random.default_rng(3)
    H, I, E, k, T = 64, 48, 8, 3, 40
    weights = {(5, e): ((rng.standard_normal((I, H)) * 0.1).astype(np.float32),
                        (rng.standard_normal((I, H)) * 0.1).astype(np.float32),
                        (rng.standard_normal((H, I)) * 0.1).astype(np.float32)) for e in range(E)}
    full, part = NumpyExperts(), NumpyExperts()
    held = {1, 2, 6}
    for (l, e), (g, u, d) in weights.items():
        full.add_expert(l, e, g, u, d)
        if e in held:
            part.add_expert(l, e, g, u, d)
    full.finalize(), part.finalize()
    assert isinstance(full, ExpertBackend)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.argsort(rng.random((T, E)), axis=1)[:, :k]
    w = rng.random((T, k)).astype(np.float32)
    np.testing.assert_allclose(full.forward(5, x, ids, w), loop_reference(weights, 5, x, ids, w), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(part.forward(5, x, ids, w), loop_reference(weights, 5, x, ids, w, held),
                               rtol=1e-4, atol=1e-5)
    assert full.weight_bytes() == E * 3 * H * I * 4
    assert not full.forward(4, x, ids, w).any()  # a layer it does not hold
    assert full.forward(5, x[:0], ids[:0], w[:0]).shape == (0, H)


def test_make_backend_and_parsers(monkeypatch):
    assert make_backend("numpy", weight_format="fp8").weight_format == "fp8"
    monkeypatch.setenv("MOESPLIT_CPU_BACKEND", "numpy")
    assert make_backend("auto").name == "numpy"
    with pytest.raises(ValueError, match="unknown expert backend"):
        make_backend("cuda")
    assert parse_experts("0-3,5, 7-8") == [0, 1, 2, 3, 5, 7, 8]
    with pytest.raises(ValueError, match="outside"):
        parse_experts("0-16", 16)
    assert parse_slice("1/2") == (1, 2)
    with pytest.raises(ValueError):
        parse_slice("2/2")
    assert [slice_range(384, i, 3) for i in range(3)] == [(0, 128), (128, 256), (256, 384)]
    assert expert_ranges(16, 3) == [(0, 4), (5, 9), (10, 15)]


# ---- shards through the client ------------------------------------------------------------------
def test_splits_match_whole_shard_and_reference(clients, cfg, bf16_weights):
    E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
    for layer in cfg.moe_layers:
        x, ids, w = routing(24, E, k, seed=layer)
        ids[0] = [0, 1, 2, 3]  # row hitting only the first expert shard
        ids[1] = [12, 13, 14, 15]  # ... only the second
        whole = clients["whole"].forward(layer, x, ids, w)
        ref = loop_reference(bf16_weights, layer, x, ids, w)
        np.testing.assert_allclose(whole, ref, rtol=1e-4, atol=1e-5)
        for split in ("experts", "slice"):
            got = clients[split].forward(layer, x, ids, w)
            assert got.dtype == np.float32 and got.shape == x.shape
            np.testing.assert_allclose(got, whole, rtol=1e-5, atol=1e-5, err_msg=split)


def test_fp8_slices_match_reference(clients, fp8_dir):
    c = load_config(fp8_dir)
    weights = _weights(fp8_dir)
    layer = c.moe_layers[-1]
    x, ids, w = routing(16, c.n_routed_experts, c.num_experts_per_tok, seed=7)
    got = clients["fp8"].forward(layer, x, ids, w)
    np.testing.assert_allclose(got, loop_reference(weights, layer, x, ids, w), rtol=1e-4, atol=1e-5)


def test_async_streams_and_bf16_wire(clients, shards, cfg):
    x, ids, w = routing(8, cfg.n_routed_experts, cfg.num_experts_per_tok, seed=11)
    c = clients["experts"]
    futs = [c.forward_async(layer, x, ids, w) for layer in cfg.moe_layers for _ in range(3)]  # in flight together
    res = [f.result(timeout=20) for f in futs]
    np.testing.assert_array_equal(res[0], res[1])
    # empty batch, and a bf16 wire: response in bf16, close to the f32 answer
    assert c.forward(cfg.moe_layers[0], x[:0], ids[:0], w[:0]).shape == (0, cfg.hidden_size)
    with ExpertsClient(shards["experts"].addresses, cfg, wire_dtype="bfloat16") as cb:
        got = cb.forward(cfg.moe_layers[0], x, ids, w)
    assert np.abs(got - res[0]).max() <= 0.02 * np.abs(res[0]).max()
    ch, stub = _stub(shards["whole"].addresses[0])
    with ch:
        resp = stub.ForwardOne(_req(cfg.moe_layers[0], x, ids, w, seq=77, hidden_dtype="bfloat16"))
    assert resp.seq == 77 and resp.output.dtype == "bfloat16" and list(resp.output.shape) == list(x.shape)
    assert resp.compute_us > 0 and resp.server_us >= resp.compute_us


def test_describe(shards, cfg, fp8_dir):
    infos = {}
    for name, s in shards.items():
        for addr in s.addresses:
            ch, stub = _stub(addr)
            with ch:
                infos.setdefault(name, []).append(stub.Describe(experts_pb2.DescribeRequest(), timeout=10))
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    a, b = infos["experts"]
    assert list(a.experts) == list(range(0, 8)) and list(b.experts) == list(range(8, 16))
    assert (a.slice_index, a.slice_count, a.intermediate_start, a.intermediate_stop) == (0, 1, 0, I)
    s0, s1 = infos["slice"]
    assert list(s0.experts) == list(range(E)) and (s1.slice_index, s1.slice_count) == (1, 2)
    assert (s0.intermediate_stop, s1.intermediate_start, s1.intermediate_stop) == (I // 2, I // 2, I)
    for info in a, s0:
        assert list(info.layers) == list(cfg.moe_layers)
        assert info.model_fingerprint == cfg.fingerprint()
        assert (info.hidden_size, info.n_routed_experts, info.num_experts_per_tok) == (
            cfg.hidden_size, E, cfg.num_experts_per_tok)
        assert info.weight_format == "bf16" and info.kernel == "numpy"
        assert info.weight_bytes == len(cfg.moe_layers) * 8 * 3 * cfg.hidden_size * I * 4
    assert a.shard_id == "shard0" and b.shard_id == "shard1"
    assert infos["whole"][0].max_tokens == MAX_TOKENS
    assert infos["fp8"][0].weight_format == "fp8"
    assert infos["fp8"][0].model_fingerprint == load_config(fp8_dir).fingerprint()
    for lst in infos.values():
        for info in lst:  # the CPU service never imports torch (or transformers)
            assert "numpy" in info.loaded_modules and "grpc" in info.loaded_modules
            assert "torch" not in info.loaded_modules and "transformers" not in info.loaded_modules


def test_health_service(shards):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch = grpc.insecure_channel(shards["whole"].addresses[0])
    with ch:
        st = health_pb2_grpc.HealthStub(ch)
        for svc in ("", "moesplit.v1.ExpertService"):
            r = st.Check(health_pb2.HealthCheckRequest(service=svc), timeout=10)
            assert r.status == health_pb2.HealthCheckResponse.SERVING


# ---- refusals -------------------------------------------------------------------------------------
def test_coverage_gap_and_overlap(shards, cfg):
    e0, e1 = shards["experts"].addresses
    s0, s1 = shards["slice"].addresses
    whole = shards["whole"].addresses[0]
    layers = f"{cfg.moe_layers[0]}-{cfg.moe_layers[-1]}"
    with pytest.raises(CoverageError) as ei:
        ExpertsClient([e0], cfg).connect()
    assert f"missing experts 8-15 in layers {layers}" in str(ei.value)
    assert len(ei.value.missing) == 8 * len(cfg.moe_layers) and not ei.value.doubled
    with pytest.raises(CoverageError) as ei:
        ExpertsClient([whole, e1], cfg).connect()
    msg = str(ei.value)
    assert f"doubled experts 8-15 in layers {layers}" in msg and whole in msg and e1 in msg
    assert "missing" not in msg
    half = cfg.moe_intermediate_size // 2
    with pytest.raises(CoverageError) as ei:
        ExpertsClient([e0, s1], cfg).connect()  # slice 1 of every expert + whole experts 0-7
    msg = str(ei.value)
    assert f"missing intermediate [0:{half}) of experts 8-15 in layers {layers}" in msg, msg
    assert f"doubled intermediate [{half}:{cfg.moe_intermediate_size}) of experts 0-7" in msg, msg
    # mixed but complete: whole experts 0-7 from one shard, and ... 8-15 whole from another
    ExpertsClient([e0, e1], cfg).connect().close()
    ExpertsClient([s0, s1], cfg).connect().close()


def test_fingerprint_mismatch_refused(shards, cfg):
    other = dataclasses.replace(cfg, rms_norm_eps=cfg.rms_norm_eps * 2)
    assert other.fingerprint() != cfg.fingerprint()
    addr = shards["whole"].addresses[0]
    with pytest.raises(FingerprintError) as ei:
        ExpertsClient([addr], other).connect()
    msg = str(ei.value)
    assert addr in msg and cfg.fingerprint() in msg and other.fingerprint() in msg


BAD = [  # (name, request modifier, expected words in the message)
    ("dtype", dict(hidden_dtype="int32"), "hidden: dtype 'int32'"),
    ("ids dtype", dict(ids_dtype="float32"), "topk_ids: dtype"),
    ("shape", "rows", "topk_ids: 5 rows but hidden has 6"),
    ("weights shape", "wshape", "topk_weights shape"),
    ("hidden size", "hsize", "size 128 != model hidden_size 256"),
    ("dense layer", dict(layer=0), "layer 0 is not an MoE layer"),
    ("layer range", dict(layer=99), "layer 99 is not an MoE layer"),
    ("expert id", "eid", "expert id 16 outside [0, 16)"),
    ("negative id", "eneg", "expert id -1 outside"),
    ("nan hidden", "nan", "hidden contains NaN or Inf"),
    ("inf weights", "inf", "topk_weights contain NaN or Inf"),
    ("too many tokens", "big", f"exceed this shard's maximum of {MAX_TOKENS}"),
]


@pytest.mark.parametrize("name,mod,words", BAD, ids=[b[0] for b in BAD])
def test_bad_request_rejected_and_shard_keeps_serving(shards, clients, cfg, name, mod, words):
    layer = cfg.moe_layers[0]
    x, ids, w = routing(6, cfg.n_routed_experts, cfg.num_experts_per_tok, seed=5)
    kw = {}
    if isinstance(mod, dict):
        kw = dict(mod)
        layer = kw.pop("layer", layer)
    elif mod == "rows":
        ids = ids[:5]
    elif mod == "wshape":
        w = w[:, :2]
    elif mod == "hsize":
        x = x[:, :128]
    elif mod == "eid":
        ids[2, 1] = 16
    elif mod == "eneg":
        ids[0, 0] = -1
    elif mod == "nan":
        x[3, 7] = np.nan
    elif mod == "inf":
        w[1, 0] = np.inf
    elif mod == "big":
        x, ids, w = routing(MAX_TOKENS + 1, cfg.n_routed_experts, cfg.num_experts_per_tok)
    addr = shards["whole"].addresses[0]
    ch, stub = _stub(addr)
    with ch:
        good = _req(cfg.moe_layers[0], *routing(3, cfg.n_routed_experts, cfg.num_experts_per_tok))
        with pytest.raises(grpc.RpcError) as ei:  # bidi stream: aborted
            list(stub.Forward(iter([good, _req(layer, x, ids, w, seq=2, **kw)]), timeout=10))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in ei.value.details(), ei.value.details()
        with pytest.raises(grpc.RpcError) as ei:  # unary
            stub.ForwardOne(_req(layer, x, ids, w, **kw), timeout=10)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in ei.value.details()
        ok = list(stub.Forward(iter([good]), timeout=10))  # a new stream works
        assert len(ok) == 1 and ok[0].seq == 1
    # the client's own persistent stream to that shard was never disturbed
    xx, ii, ww = routing(4, cfg.n_routed_experts, cfg.num_experts_per_tok, seed=9)
    assert clients["whole"].forward(cfg.moe_layers[0], xx, ii, ww).shape == xx.shape


def test_client_names_shard_on_error_and_recovers(shards, cfg):
    addr = shards["whole"].addresses[0]
    with ExpertsClient([addr], cfg, timeout_s=10) as c:
        x, ids, w = routing(4, cfg.n_routed_experts, cfg.num_experts_per_tok, seed=2)
        y = c.forward(cfg.moe_layers[0], x, ids, w)
        bad = x.copy()
        bad[0, 0] = np.nan
        with pytest.raises(ShardError) as ei:
            c.forward(cfg.moe_layers[0], bad, ids, w)
        assert ei.value.address == addr and ei.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert addr in str(ei.value) and "NaN" in str(ei.value)
        np.testing.assert_array_equal(c.forward(cfg.moe_layers[0], x, ids, w), y)  # a new stream


def test_unavailable_shard_named(cfg):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(ShardError) as ei:
        ExpertsClient([addr], cfg, timeout_s=1.0).connect()
    assert addr in str(ei.value)


# ---- processes: memory, READY line, clean stop ----------------------------------------------------
BASELINE_CODE = """
import grpc, numpy, ml_dtypes
from concurrent import futures
import cpu_expert_service.server as s, checkpoint.reader
srv = grpc.server(futures.ThreadPoolExecutor(4)); srv.add_insecure_port("127.0.0.1:0"); srv.start()
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"): print(int(line.split()[1]) * 1024)
"""


def test_shard_peak_memory_is_its_share(shards, cfg):
    out = subprocess.run([sys.executable, "-c", BASELINE_CODE], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, check=True)
    baseline = int(out.stdout.split()[-1])
    expert_total = len(cfg.moe_layers) * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 4
    rows = []
    for name in ("whole", "experts", "slice"):
        for addr, p in zip(shards[name].addresses, shards[name].procs):
            ch, stub = _stub(addr)
            with ch:
                wb = stub.Describe(experts_pb2.DescribeRequest(), timeout=10).weight_bytes
            hwm = _vm(p.pid, "VmHWM")
            rows.append((name, addr, wb, hwm))
    print(f"\nbaseline (python+numpy+grpc, no weights) VmHWM {baseline / 2**20:.1f} MiB; "
          f"all experts f32 {expert_total / 2**20:.1f} MiB")
    for name, addr, wb, hwm in rows:
        print(f"  {name:8s} {addr}: weights {wb / 2**20:6.1f} MiB, VmHWM {hwm / 2**20:6.1f} MiB, "
              f"above baseline {(hwm - baseline) / 2**20:6.1f} MiB")
    layer_stored = expert_total // len(cfg.moe_layers) // 2  # one layer's experts in bf16 on disk
    for name, addr, wb, hwm in rows:
        # resident: its f32 weights + at most one layer of mapped checkpoint pages + slack
        assert hwm - baseline < wb + layer_stored + 8 * 2**20, (name, addr, wb, hwm, baseline)
    whole_hwm = rows[0][3]
    for name, addr, wb, hwm in rows[1:]:  # a half shard never held the other half
        assert whole_hwm - hwm > 0.3 * expert_total, (name, addr, hwm, whole_hwm)


def test_cli_ready_line_clean_sigterm_and_unavailable(bf16_dir, cfg, tmp_path):
    port_file = tmp_path / "port"
    p = subprocess.Popen(
        [sys.executable, "-m", "moesplit", "expert-server", "--model", bf16_dir,
         "--port-file", str(port_file), "--shard-id", "cli"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )
    try:
        line = p.stdout.readline()
        m = re.fullmatch(r"READY port=(\d+)\n", line)
        assert m, (line, p.stderr.read() if p.poll() is not None else "")
        assert int(port_file.read_text()) == int(m.group(1))
        addr = f"127.0.0.1:{m.group(1)}"
        client = ExpertsClient([addr], cfg, timeout_s=10).connect()  # whole model in one shard
        assert client.shards[0].info.shard_id == "cli"
        assert "torch" not in client.shards[0].info.loaded_modules
        x, ids, w = routing(4, cfg.n_routed_experts, cfg.num_experts_per_tok)
        assert client.forward(cfg.moe_layers[0], x, ids, w).shape == x.shape
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=15) == 0
        with pytest.raises(ShardError) as ei:  # the shard is gone: an error naming it
            client.forward(cfg.moe_layers[0], x, ids, w)
            client.forward(cfg.moe_layers[0], x, ids, w)
        assert addr in str(ei.value)
        client.close()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
