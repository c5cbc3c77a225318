"""DeepSeek-V4 routed experts on the CPU shard: MXFP4 / FP8-e8m0 weights and swiglu_limit.

Oracles: (1) a numpy reference written here from ../shared/formats-v4.md (MXFP4 bit fields, e8m0
scales, gate = min(w1 x, L), up = clamp(w3 x, -L, L), silu(gate) * up -> w2), in float64;
(2) transformers' DeepseekV4Experts: the module of the fp32 DeepseekV4ForCausalLM that
tests/v4_reference.load_reference_v4 loads from the same tiny checkpoint (its own conversion
mapping), run on the same hidden states, ids and weights."""
from __future__ import annotations

import numpy as np
import pytest

from checkpoint import names_v4 as N4
from checkpoint.reader import CheckpointReader
from cpu_expert_service.backend import NumpyExperts, available_backends
from gpu_service.local import tiny

L_TEST = 3  # a non-hash MoE layer of the tiny schedules (hash layers: 0, 1)
E2M1 = np.array([0, .5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)
KERNELS = pytest.mark.skipif("kernels" not in available_backends(), reason="C kernels not built")


@pytest.fixture(scope="module")
def flash(tmp_path_factory):
    return tiny.make_tiny(str(tmp_path_factory.mktemp("v4e")), fmt="mxfp4", seed=5, arch="deepseek_v4")


@pytest.fixture(scope="module")
def pro_fp8(tmp_path_factory):
    return tiny.make_tiny(str(tmp_path_factory.mktemp("v4e8")), fmt="fp8", seed=6, arch="deepseek_v4",
                          v4_schedule="pro")


@pytest.fixture(scope="module")
def reference(flash):
    pytest.importorskip("transformers")
    from tests.v4_reference import load_reference_v4

    return load_reference_v4(flash)


# ---- the reference written from formats-v4.md ---------------------------------------------------
def decode_mxfp4(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """I8 [out, in/2] + F8_E8M0 [out, in/32] -> float64 [out, in]: byte j holds element 2j (low
    nibble) and 2j+1 (high); nibble bit 3 = sign, bits 0-2 index 0,.5,1,1.5,2,3,4,6; x 2^(e-127)."""
    b = q.view(np.uint8).astype(np.int64)
    nib = np.stack([b & 15, b >> 4], axis=-1).reshape(q.shape[0], -1)
    v = np.where(nib & 8, -1.0, 1.0) * E2M1[nib & 7]
    e = s.view(np.uint8).astype(np.float64)
    return v * np.repeat(2.0 ** (e - 127), 32, axis=1)


def stored_expert(reader, layer: int, e: int, proj: str) -> np.ndarray:
    """One expert matrix decoded here from the stored bytes (MXFP4) or taken from the reader (FP8)."""
    st = reader.get_stored(N4.expert_weight(layer, e, proj))
    if st.format == "mxfp4":
        return decode_mxfp4(st.arrays["weight"], st.arrays["scale"])
    return reader.get(N4.expert_weight(layer, e, proj)).astype(np.float64)


def reference_moe(reader, layer, x, ids, w, limit, experts=None, i0=0, i1=None):
    """sum_j w[t, j] * w2 @ (silu(min(w1 x, L)) * clamp(w3 x, -L, L)) in float64 over held experts."""
    out = np.zeros(x.shape, dtype=np.float64)
    for t in range(x.shape[0]):
        for e, wt in zip(ids[t], w[t]):
            if experts is not None and int(e) not in experts:
                continue
            w1, w3, w2 = (stored_expert(reader, layer, int(e), p) for p in ("gate", "up", "down"))
            sl = slice(i0, i1)
            g, u = w1[sl] @ x[t], w3[sl] @ x[t]
            if limit is not None:
                g, u = np.minimum(g, limit), np.clip(u, -limit, limit)
            out[t] += wt * (w2[:, sl] @ (g / (1 + np.exp(-g)) * u))
    return out


def inputs(cfg, T=12, scale=12.0, seed=0):
    """x scaled so that many gate/up pre-activations pass the limit (the clamp is exercised)."""
    rng = np.random.default_rng(seed)
    x = (scale * rng.standard_normal((T, cfg.hidden_size))).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(T)])
    w = rng.random(ids.shape).astype(np.float32)
    return x, ids.astype(np.int64), w


def transformers_experts(model, layer, x, ids, w):
    import torch

    mod = model.model.layers[layer].mlp.experts
    with torch.no_grad():
        return mod(torch.from_numpy(x), torch.from_numpy(ids), torch.from_numpy(w)).numpy()


# ---- tests ------------------------------------------------------------------------------------
def test_reader_dequant_equals_the_bit_field_decode(flash):
    r = CheckpointReader(flash, any_architecture=True)
    assert r.format_of(N4.expert_weight(L_TEST, 0, "gate")) == "mxfp4"
    for e in (0, 7, 15):
        for p in ("gate", "up", "down"):
            np.testing.assert_array_equal(r.get(N4.expert_weight(L_TEST, e, p)).astype(np.float64),
                                          stored_expert(r, L_TEST, e, p))


def test_transformers_experts_equal_the_written_reference(flash, reference):
    """The rule copied (clamp gate above, up both sides, before silu) is transformers' own."""
    r = CheckpointReader(flash, any_architecture=True)
    cfg = r.config
    x, ids, w = inputs(cfg)
    got = transformers_experts(reference, L_TEST, x, ids, w)
    want = reference_moe(r, L_TEST, x, ids, w, cfg.swiglu_limit)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    unclamped = reference_moe(r, L_TEST, x, ids, w, None)
    assert np.abs(unclamped - want).max() > 0.1 * np.abs(want).max()  # the clamp changes the result here


@pytest.mark.parametrize("which", ["flash", "pro_fp8"])
def test_load_shard_numpy_equals_references(which, request):
    from cpu_expert_service.server import load_shard

    d = request.getfixturevalue(which)
    cfg, be, info = load_shard(d, None, None, backend="numpy")
    assert cfg.is_v4 and be.swiglu_limit == cfg.swiglu_limit == 10.0
    assert info["weight_format"] == ("mxfp4" if which == "flash" else "fp8_e8m0")
    assert info["layers"] == list(range(cfg.num_hidden_layers))  # every V4 layer is MoE (hash ones too)
    r = CheckpointReader(d, any_architecture=True)
    for layer in (0, L_TEST):
        x, ids, w = inputs(cfg, seed=layer)
        want = reference_moe(r, layer, x, ids, w, cfg.swiglu_limit)
        np.testing.assert_allclose(be.forward(layer, x, ids, w), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    if which == "flash":
        model = request.getfixturevalue("reference")
        got = be.forward(L_TEST, x, ids, w)
        hf = transformers_experts(model, L_TEST, x, ids, w)
        np.testing.assert_allclose(got, hf, rtol=1e-5, atol=1e-5 * np.abs(hf).max())


def test_numpy_swiglu_limit_off_is_the_v3_path():
    """swiglu_limit None computes exactly what it did before (silu(g) * u); a limit clamps."""
    from cpu_expert_service.backend import silu, swiglu

    rng = np.random.default_rng(1)
    g, u = (20 * rng.standard_normal((4, 64))).astype(np.float32), (20 * rng.standard_normal((4, 64))).astype(np.float32)
    np.testing.assert_array_equal(swiglu(g, u), silu(g) * u)
    np.testing.assert_array_equal(swiglu(g, u, 10.0), silu(np.minimum(g, 10)) * np.clip(u, -10, 10))
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="swiglu_limit"):
            NumpyExperts(swiglu_limit=bad)


def test_split_shards_sum_to_the_whole(flash):
    """Expert split and intermediate-slice split of a V4 MXFP4 checkpoint (numpy backend)."""
    from cpu_expert_service.server import load_shard

    cfg, whole, _ = load_shard(flash, None, None, backend="numpy")
    x, ids, w = inputs(cfg, T=9, seed=3)
    want = whole.forward(L_TEST, x, ids, w)
    parts = [load_shard(flash, ex, None, backend="numpy")[1] for ex in ([0, 1, 2, 3, 4, 5, 6, 7], list(range(8, 16)))]
    np.testing.assert_allclose(sum(p.forward(L_TEST, x, ids, w) for p in parts), want, rtol=1e-5, atol=1e-4)
    slices = [load_shard(flash, None, (i, 2), backend="numpy") for i in range(2)]
    assert [s[2]["intermediate_start"] for s in slices] == [0, cfg.moe_intermediate_size // 2]
    np.testing.assert_allclose(sum(s[1].forward(L_TEST, x, ids, w) for s in slices), want, rtol=1e-5, atol=1e-4)
    # a slice alone is the reference on its rows of w1/w3 and columns of w2 (the clamp is elementwise)
    r = CheckpointReader(flash, any_architecture=True)
    half = cfg.moe_intermediate_size // 2
    ref = reference_moe(r, L_TEST, x, ids, w, cfg.swiglu_limit, i0=half, i1=None)
    np.testing.assert_allclose(slices[1][1].forward(L_TEST, x, ids, w), ref, rtol=2e-5, atol=2e-5 * np.abs(ref).max())


@KERNELS
@pytest.mark.parametrize("which,asked,held", [("flash", "auto", "mxfp4"), ("flash", "bf16", "bf16"),
                                              ("pro_fp8", "auto", "bf16")])
def test_kernels_hold_v4_experts_exactly(which, asked, held, request):
    """auto on MXFP4 = mxfp4 kernels holding the stored nibbles and e8m0 scales; --weight-format
    bf16 on MXFP4 and auto on FP8-e8m0 = bf16 kernels; either way every weight the kernels hold is
    the dequantised checkpoint weight exactly."""
    from cpu_expert_service.server import load_shard

    d = request.getfixturevalue(which)
    cfg, be, info = load_shard(d, [1, 4, 9], None, backend="kernels", weight_format=asked)
    assert be.weight_format == held and info["serve_format"] == held and be.swiglu_limit == 10.0
    r = CheckpointReader(d, any_architecture=True)
    for e in (1, 4, 9):
        for p, got in zip(("gate", "up", "down"), be.dequantised(L_TEST, e)):
            np.testing.assert_array_equal(got, r.get(N4.expert_weight(L_TEST, e, p)))


def _bf16(a):
    import ml_dtypes

    return np.asarray(a, dtype=np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


@KERNELS
@pytest.mark.parametrize("isa", ["generic", "avx2", "avx512", "amx"])
def test_kernels_apply_swiglu_limit_in_c(flash, isa):
    """The C clamp (moe_core.c, before the activation) on every ISA here: the kernels' output
    equals the float64 reference on bf16 activations (what the bf16 kernels compute), and is far
    from the unclamped one; a limit no value reaches is bit-identical to no limit (V3 path)."""
    from cpu_expert_service.kernel_backend import AVAILABLE_ISAS, KernelExperts

    if isa not in AVAILABLE_ISAS:
        pytest.skip(f"{isa} not available here")
    r = CheckpointReader(flash, any_architecture=True)
    cfg = r.config
    held = list(range(cfg.n_routed_experts))
    bes = {lim: KernelExperts("bf16", num_threads=2, isa=isa, swiglu_limit=lim) for lim in (None, 10.0, 1e30)}
    for be in bes.values():
        for e in held:
            be.add_expert(L_TEST, e, *(r.get(N4.expert_weight(L_TEST, e, p)) for p in ("gate", "up", "down")))
        be.finalize()
    x, ids, w = inputs(cfg, T=16, seed=7)
    x = _bf16(x)  # the kernels round activations to bf16; start from values that are bf16 already
    got = bes[10.0].forward(L_TEST, x, ids, w)
    want = reference_moe(r, L_TEST, x, ids, w, 10.0)
    unclamped = reference_moe(r, L_TEST, x, ids, w, None)
    scale = np.abs(want).max()
    # bf16 rounding of the intermediate activation: relative 2^-8 per term
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * scale)
    assert np.abs(unclamped - want).max() > 0.2 * scale
    assert np.abs(got - want).max() < 0.1 * np.abs(unclamped - want).max()
    np.testing.assert_array_equal(bes[1e30].forward(L_TEST, x, ids, w), bes[None].forward(L_TEST, x, ids, w))


@KERNELS
def test_kernels_and_numpy_agree_through_load_shard(flash, pro_fp8):
    """A half slice on mxfp4 kernels (auto) against numpy; mxfp4 on anything but MXFP4, and a slice
    off the group of 32, are refused."""
    from cpu_expert_service.server import load_shard

    cfg, kb, _ = load_shard(flash, None, (1, 2), backend="kernels")
    assert kb.weight_format == "mxfp4"
    with pytest.raises(ValueError, match="stores fp8_e8m0"):
        load_shard(pro_fp8, [0], None, backend="kernels", weight_format="mxfp4")
    from cpu_expert_service.shard_load import slice_range

    I = cfg.moe_intermediate_size
    bad = next((i, n) for n in range(2, 9) for i in range(n) if slice_range(I, i, n)[0] % 32)
    with pytest.raises(ValueError, match="group of 32"):
        load_shard(flash, [0], bad, backend="kernels")
    _, nb, _ = load_shard(flash, None, (1, 2), backend="numpy", weight_format="bf16")
    x, ids, w = inputs(cfg, T=10, seed=11)
    x = _bf16(x)
    got, want = kb.forward(L_TEST, x, ids, w), nb.forward(L_TEST, x, ids, w)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * np.abs(want).max())


def test_server_describes_and_serves_v4(flash):
    """expert-server on a V4 checkpoint: Describe carries swiglu_limit and the MXFP4 format; a
    ForwardOne answers the same numbers as the backend."""
    import grpc

    from cpu_expert_service.server import create_server
    from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc
    from cpu_expert_service.server import to_tensor

    server, port = create_server(flash, experts=[0, 1, 2, 3, 4, 5, 6, 7], backend="numpy", shm_dir=None,
                                 data_port=-1)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = experts_pb2_grpc.ExpertServiceStub(ch)
            info = stub.Describe(experts_pb2.DescribeRequest(), timeout=10)
            assert info.swiglu_limit == 10.0 and info.weight_format == "mxfp4" and info.kernel == "numpy"
            assert list(info.experts) == list(range(8))
            cfg = server.servicer.cfg
            x, ids, w = inputs(cfg, T=5, seed=2)
            resp = stub.ForwardOne(experts_pb2.LayerRequest(seq=3, layer=L_TEST, hidden=to_tensor(x),
                                                            topk_ids=to_tensor(ids), topk_weights=to_tensor(w)),
                                   timeout=10)
            out = np.frombuffer(resp.output.data, dtype=np.float32).reshape(x.shape)
            r = CheckpointReader(flash, any_architecture=True)
            want = reference_moe(r, L_TEST, x, ids, w, 10.0, experts=set(range(8)))
            np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())
    finally:
        server.stop(None)


# ---- moesplit convert / expert-server --packed ----------------------------------------------------
def test_convert_keeps_mxfp4_as_stored_and_packed_shards_serve_it(flash, tmp_path):
    """auto on MXFP4 = mxfp4 layer files holding the checkpoint's bytes (gate/up rows, down packed
    columns of each slice); the packed shards compute what load_shard computes."""
    from cpu_expert_service.convert import convert
    from cpu_expert_service.packed import load_packed
    from cpu_expert_service.server import load_shard

    out = str(tmp_path / "packed")
    s = convert(flash, out, 2, split="intermediate", quiet=True, workers=2)
    assert s["format"] == "mxfp4" and s["source_format"] == "mxfp4" and s["written"] > 0
    src = CheckpointReader(flash, any_architecture=True)
    cfg = src.config
    half = cfg.moe_intermediate_size // 2
    shard1 = CheckpointReader(f"{out}/shard-1-of-2", config=cfg)
    for p in ("gate", "up", "down"):
        n = N4.expert_weight(L_TEST, 5, p)
        a, b = src.get_stored(n).arrays, shard1.get_stored(n).arrays
        assert shard1.format_of(n) == "mxfp4"
        if p == "down":
            np.testing.assert_array_equal(b["weight"], a["weight"][:, half // 2:])
            np.testing.assert_array_equal(b["scale"].view(np.uint8), a["scale"].view(np.uint8)[:, half // 32:])
        else:
            np.testing.assert_array_equal(b["weight"], a["weight"][half:])
            np.testing.assert_array_equal(b["scale"].view(np.uint8), a["scale"].view(np.uint8)[half:])
    x, ids, w = inputs(cfg, T=8, seed=4)
    for i in range(2):
        pcfg, pb, info = load_packed(out, i, backend="numpy")
        assert pb.swiglu_limit == 10.0 and info["weight_format"] == "mxfp4" and info["slice_count"] == 2
        _, lb, _ = load_shard(flash, None, (i, 2), backend="numpy")
        np.testing.assert_array_equal(pb.forward(L_TEST, x, ids, w), lb.forward(L_TEST, x, ids, w))
    if "kernels" in available_backends():
        _, pk, info = load_packed(out, 0, backend="kernels")
        _, lk, _ = load_shard(flash, None, (0, 2), backend="kernels")
        assert info["serve_format"] == "mxfp4" and pk.swiglu_limit == 10.0
        np.testing.assert_array_equal(pk.forward(L_TEST, x, ids, w), lk.forward(L_TEST, x, ids, w))


def test_convert_v4_formats_and_refusals(flash, pro_fp8, tmp_path):
    from cpu_expert_service.convert import convert
    from cpu_expert_service.packed import load_packed
    from cpu_expert_service.server import load_shard

    with pytest.raises(ValueError, match="MXFP4 group of 32"):  # 64 / 4 = 16-wide slices cut the groups
        convert(flash, str(tmp_path / "p4"), 4, quiet=True)
    with pytest.raises(ValueError, match="copies MXFP4 experts as stored; these are fp8_e8m0"):
        convert(pro_fp8, str(tmp_path / "bad"), 1, fmt="mxfp4", quiet=True)
    s = convert(pro_fp8, str(tmp_path / "pe"), 2, split="experts", quiet=True, workers=1)
    assert s["format"] == "bf16" and s["source_format"] == "fp8_e8m0"
    cfg, pb, info = load_packed(str(tmp_path / "pe"), 1, backend="numpy", model_dir=pro_fp8)
    assert info["experts"] == list(range(8, 16)) and pb.swiglu_limit == 10.0
    _, lb, _ = load_shard(pro_fp8, list(range(8, 16)), None, backend="numpy")
    x, ids, w = inputs(cfg, T=6, seed=9)
    # FP8-e8m0 values are exact in bf16, so the bf16 files hold the checkpoint's values
    np.testing.assert_array_equal(pb.forward(L_TEST, x, ids, w), lb.forward(L_TEST, x, ids, w))
    s = convert(flash, str(tmp_path / "i8"), 1, fmt="int8", quiet=True, workers=1)
    _, qb, _ = load_packed(str(tmp_path / "i8"), 0, backend="numpy")
    _, fb, _ = load_shard(flash, None, None, backend="numpy")
    want = fb.forward(L_TEST, x, ids, w)
    np.testing.assert_allclose(qb.forward(L_TEST, x, ids, w), want, rtol=0, atol=3e-2 * np.abs(want).max())


@KERNELS
def test_shared_memory_loop_and_clients_apply_the_limit(flash):
    """The co-located fast path (moe_shm.c -> moe_forward over the Engine, no Python) uses the same
    kernel table, so the clamp: its answer equals the kernels backend's forward bit for bit, which is
    not the unclamped one. The GPU side's ExpertsClient (V4Config) gets the same over shared memory,
    the TCP data path and gRPC."""
    from tests.test_shm_shard_loop import _raw, _ring
    from wire import shm as P
    from cpu_expert_service.server import create_server
    from gpu_service.experts.client import ExpertsClient

    srv, port = create_server(flash, backend="kernels", shm_dir="/dev/shm", data_port=0)
    try:
        cfg, be = srv.servicer.cfg, srv.servicer.backend
        assert be.swiglu_limit == 10.0 and be.weight_format == "mxfp4"  # the C loop runs the mxfp4 panels
        addr = f"127.0.0.1:{port}"
        ch, fp = _raw(addr, cfg)
        try:
            x, ids, w = inputs(cfg, T=5, seed=21)
            st, msg, got = _ring(fp, 0, 1, L_TEST, x, ids, w)
            assert st == P.OK, msg
            want = be.forward(L_TEST, x, ids, w)
            np.testing.assert_array_equal(got, want)
        finally:
            fp.close()
            ch.close()
        r = CheckpointReader(flash, any_architecture=True)
        unclamped = reference_moe(r, L_TEST, x, ids, w, None)
        assert np.abs(unclamped - got).max() > 0.2 * np.abs(got).max()
        for transport in ("shm", "tcp", "grpc"):  # every way the GPU side reaches a shard
            c = ExpertsClient([addr], cfg, transport=transport, wire_dtype="float32", timeout_s=10).connect()
            try:
                np.testing.assert_array_equal(c.forward(L_TEST, x, ids, w), want)
                assert [p.calls for p, _ in c.fast.paths.values()] == ([] if transport == "grpc" else [1])
            finally:
                c.close()
    finally:
        srv.stop(0)


def test_expert_server_processes_serve_v4(flash, tmp_path):
    """`python -m cpu_expert_service.server --model V4DIR` (what `moesplit expert-server` runs) as
    processes: two expert-split shards and a packed MXFP4 one, answered through ExpertsClient."""
    from cpu_expert_service.convert import convert
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.local.stack import start_shards

    r = CheckpointReader(flash, any_architecture=True)
    cfg = r.config
    x, ids, w = inputs(cfg, T=4, seed=31)
    want = reference_moe(r, L_TEST, x, ids, w, cfg.swiglu_limit)
    convert(flash, str(tmp_path / "packed"), 1, quiet=True, workers=1)
    for kw in (dict(n=2, split="experts"), dict(n=1, packed=str(tmp_path / "packed"))):
        shards = start_shards(flash, backend="numpy", **kw)
        try:
            c = ExpertsClient(shards.addresses, cfg, transport="grpc", timeout_s=10).connect()
            try:
                assert {(s.info.weight_format, s.info.swiglu_limit) for s in c.shards} == {("mxfp4", 10.0)}
                np.testing.assert_allclose(c.forward(L_TEST, x, ids, w), want, rtol=2e-5,
                                           atol=2e-5 * np.abs(want).max())
            finally:
                c.close()
        finally:
            shards.stop()


def test_mxfp4_hand_over_refuses_nan_scales():
    """An e8m0 scale byte 255 (NaN) is corrupt data: refused before the kernels see it, naming the file."""
    from checkpoint.reader import CheckpointError
    from cpu_expert_service.arch import add_mxfp4_expert

    class Sink:
        got = None

        def add_expert_mxfp4(self, *args):
            Sink.got = args

    ok = [{"weight": np.zeros((64, 16), np.uint8), "scale": np.full((64, 1), 127, np.uint8)}] * 3
    add_mxfp4_expert(Sink(), 3, 1, ok, ["g", "u", "d"], lambda n: "f.safetensors")
    assert Sink.got[:2] == (3, 1) and len(Sink.got) == 8
    bad = ok[:2] + [{"weight": ok[2]["weight"], "scale": np.full((64, 1), 255, np.uint8)}]
    with pytest.raises(CheckpointError, match="f.safetensors.*'d'.*255"):
        add_mxfp4_expert(Sink(), 3, 1, bad, ["g", "u", "d"], lambda n: "f.safetensors")


def test_bf16_exact_refuses_what_bf16_would_round(tmp_path):
    """The load-time check: MXFP4 values (any e8m0 scale that decodes finite) pass; a value with
    more than 8 significant bits, or an FP8 block scaled into bf16's subnormal gap, is refused."""
    import ml_dtypes

    from checkpoint.formats_v4 import dequant_mxfp4
    from checkpoint.reader import CheckpointError
    from cpu_expert_service.arch import bf16_exact

    codes = np.arange(256, dtype=np.uint8).reshape(1, 256).view(np.int8)  # every nibble pair
    for e in (0, 1, 100, 127, 200, 250):
        scale = np.full((1, 16), e, dtype=np.uint8).view(ml_dtypes.float8_e8m0fnu)
        bf16_exact(dequant_mxfp4(codes, scale), "f", "mxfp4")  # no raise
    with pytest.raises(CheckpointError, match="not exactly representable in bf16"):
        bf16_exact(np.array([[1 + 2.0 ** -9]], np.float32), "f", "w")
    e4m3_min = float(np.array(2.0 ** -9, np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    bf16_exact(np.array([[e4m3_min * 2.0 ** -124]], np.float32), "f", "fp8")  # 2^-133: bf16's least subnormal
    with pytest.raises(CheckpointError):
        bf16_exact(np.array([[e4m3_min * 2.0 ** -125]], np.float32), "f", "fp8")
