"""Weight-only quantised linears dequantise one row block at a time into a reused scratch buffer:
the same numbers as the full rebuild they replace, and no more bytes per call than
their output plus that buffer (measured by the dispatch byte tracker)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from gpu_service import plan as P
from gpu_service.model import qlinear as Q
from tests.memtrack import ByteTracker


# ---- the previous implementation (a full fp32 rebuild per call): the reference ----------------------
def _old_fp8(m: Q.Fp8Linear, dtype):
    bo, bi = m.block
    out, inp = m.weight.shape
    s = m.weight_scale_inv.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[:out, :inp]
    return (m.weight.to(torch.float32) * s).to(dtype)


def _old_int8(m: Q.Int8Linear, dtype):
    return (m.weight.to(torch.float32) * m.weight_scale[:, None]).to(dtype)


def _old_int4(m: Q.Int4Linear, dtype):
    out, inn = m.shape
    shifts = 4 * torch.arange(8, dtype=torch.int32)
    q = ((m.weight_packed[..., None] >> shifts) & 0xF).view(out, -1)[:, :inn] - 8
    s = m.weight_scale.float().repeat_interleave(m.group, dim=1)[:, :inn]
    return (q.float() * s).to(dtype)


OLD = {Q.Fp8Linear: _old_fp8, Q.Int8Linear: _old_int8, Q.Int4Linear: _old_int4}
SHAPES = [(300, 200), (256, 384), (129, 70), (40, 1000)]  # partial FP8 blocks, INT4 groups and words


@pytest.fixture
def small_rows(monkeypatch):
    """Row blocks of 128 so that every shape above takes several blocks, the last one partial."""
    monkeypatch.setattr(Q, "QLINEAR_ROWS", 128)
    monkeypatch.setattr(P.bytes, "QLINEAR_ROWS", 128)
    Q.SCRATCH.clear()
    yield 128
    Q.SCRATCH.clear()


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{o}x{i}" for o, i in SHAPES])
def test_blockwise_equals_full_rebuild(small_rows, fmt, shape):
    g = torch.Generator().manual_seed(sum(shape))
    w = torch.randn(shape, generator=g) * 0.05
    m = Q.make_quantized(w, fmt, torch.device("cpu"))
    ref_w = OLD[type(m)](m, torch.float32)
    x = torch.randn(5, shape[1], generator=g)
    assert torch.allclose(m(x), F.linear(x, ref_w), atol=1e-5, rtol=1e-5)
    assert torch.equal(m.dequant_weight(torch.float32), ref_w)
    xb = x.to(torch.bfloat16)  # bf16: one rounding of the same fp32 product, as before
    assert torch.equal(m.dequant_weight(torch.bfloat16), OLD[type(m)](m, torch.bfloat16))
    assert torch.allclose(m(xb).float(), F.linear(xb, OLD[type(m)](m, torch.bfloat16)).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("fmt", ["fp8", "int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_transient_bytes_per_call_bounded_by_scratch(small_rows, fmt, dtype):
    out, inp, T = 700, 520, 9
    m = Q.make_quantized(torch.randn(out, inp) * 0.05, fmt, torch.device("cpu"))
    x = torch.randn(T, inp).to(dtype)
    eb = torch.finfo(dtype).bits // 8
    scratch = P.qlinear_scratch_bytes(out, inp, fmt, eb)
    y_bytes = eb * T * out
    for call in range(2):  # the first call grows the scratch buffer, the second reuses it
        tr = ByteTracker()
        with tr:
            base = tr.reset_peak()
            y = m(x)
            got = tr.transient(base).get("cpu", 0)
        del y
        # after the first call the buffer exists: only the output (and INT4's nibble temporaries)
        bound = y_bytes + scratch if call == 0 else y_bytes + (scratch - eb * 128 * (8 * -(-inp // 8) if fmt == "int4" else inp))
        print(f"{fmt} {dtype} call {call}: {got} B kept, bound {bound} B (output {y_bytes}, scratch {scratch})")
        assert got <= bound
        assert got >= y_bytes
    full_fp32 = 4 * out * inp  # what one call used to rebuild, before the scale tensor beside it
    assert scratch < full_fp32 / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_transient_bytes_per_call_bounded_by_scratch(small_rows, dtype):
    """DeepSeek-V4's MXFP4 hot experts (Mxfp4Linear) dequantise exactly, and a call keeps at most the
    scratch the plan counts for "mxfp4" (the rows in the compute dtype + their codes as int32) beside
    its output; the rows' temporaries are the codes only (a former int64 copy and per-nibble
    tables kept 4x that)."""
    from checkpoint.formats_v4 import dequant_mxfp4, quant_mxfp4

    out, inp, T = 700, 512, 9
    packed, e8m0 = quant_mxfp4((torch.randn(out, inp, generator=torch.Generator().manual_seed(1)) * 0.05).numpy())
    m = Q.Mxfp4Linear.from_stored(packed, e8m0, torch.device("cpu"))
    ref = torch.from_numpy(dequant_mxfp4(packed, e8m0))
    assert torch.equal(m.dequant_weight(torch.float32), ref)
    assert torch.equal(m.dequant_weight(torch.bfloat16), ref.to(torch.bfloat16))  # e2m1 x 2^k: exact in bf16
    x = torch.randn(T, inp).to(dtype)
    eb = torch.finfo(dtype).bits // 8
    scratch, y_bytes = P.qlinear_scratch_bytes(out, inp, "mxfp4", eb), eb * T * out
    codes = 4 * 128 * (inp // 2)
    assert scratch == eb * 128 * inp + codes
    for call in range(2):  # the first call grows the scratch buffer, the second reuses it
        tr = ByteTracker()
        with tr:
            base = tr.reset_peak()
            y = m(x)
            got = tr.transient(base).get("cpu", 0)
        torch.testing.assert_close(y.float(), (x.float() @ ref.t()).to(dtype).float(), rtol=2e-2, atol=2e-2)
        del y
        bound = y_bytes + (scratch if call == 0 else codes) + 2 * 256 * eb * (call == 0)  # (+ the pair table, once)
        print(f"mxfp4 {dtype} call {call}: {got} B kept, bound {bound} B (output {y_bytes}, scratch {scratch})")
        assert y_bytes + codes <= got <= bound


def test_scratch_is_reused_and_sized_as_planned(small_rows):
    lins = [Q.make_quantized(torch.randn(o, i) * 0.05, "int8", torch.device("cpu")) for o, i in [(700, 520), (300, 900)]]
    for m in lins:
        m(torch.randn(3, m.in_features))
    buf = Q.SCRATCH._bufs[(torch.device("cpu"), torch.float32)]
    planned = max(P.qlinear_scratch_bytes(m.out_features, m.in_features, "int8", 4) for m in lins)
    assert buf.numel() * buf.element_size() == planned


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_model_logits_equal_the_full_rebuild(tmp_path, monkeypatch, fmt):
    """A whole model with quantised attention / shared experts / dense MLP: logits (fp32) within
    1e-5 of the previous per-call full rebuild, prefill (several chunks) and decode."""
    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.local.tiny import make_tiny
    from gpu_service.model.placement import Placement
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    d = make_tiny(str(tmp_path / "m"), fmt="bf16", seed=5, overrides={"intermediate_size": 300})
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    plan = P.make_plan(reader.config, ["1GiB"], kv_tokens=256, min_kv_tokens=256, chunk_tokens=32, max_batch=4,
                       attention_weights=fmt, embeddings="gpu", gpu_experts=0, dtype="float32")
    runner = ModelRunner(reader, LocalExperts(backend), dtype=torch.float32,
                         placement=Placement.from_plan(plan, [torch.device("cpu")]), page_size=64)
    prompt = [(5 * i + 1) % reader.config.vocab_size for i in range(70)]
    new = runner.generate(prompt, 6).last_logits
    for cls, old in OLD.items():
        monkeypatch.setattr(cls, "forward", lambda self, x, old=old: F.linear(x, old(self, x.dtype), self.bias))
        monkeypatch.setattr(cls, "dequant_weight", lambda self, dtype, old=old: old(self, dtype))
    ref = runner.generate(prompt, 6).last_logits
    assert torch.allclose(new, ref, atol=1e-5, rtol=0), (new - ref).abs().max()


def test_scratch_sized_at_load_never_moves(tmp_path):
    """The model reserves each device's dequantisation scratch at load, as large as its widest
    quantised linear (the plan's qlinear_scratch_bytes): a chunked prefill and decode steps through
    static CUDA-graph pieces neither grow nor move it (a graph captured on CUDA bakes its address)."""
    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.local.tiny import make_tiny
    from gpu_service.model.placement import Placement
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    Q.SCRATCH.clear()
    d = make_tiny(str(tmp_path / "m"), fmt="bf16", seed=5, overrides={"intermediate_size": 300})
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    plan = P.make_plan(reader.config, ["1GiB"], kv_tokens=256, min_kv_tokens=256, chunk_tokens=32, max_batch=4,
                       attention_weights="int8", embeddings="gpu", gpu_experts=2, dtype="float32")
    runner = ModelRunner(reader, LocalExperts(backend), dtype=torch.float32,
                         placement=Placement.from_plan(plan, [torch.device("cpu")]), page_size=64)
    runner.set_cuda_graphs(True, mode="static")
    lins = [m for m in runner.model.modules() if isinstance(m, Q._Blockwise)]
    assert lins, "the plan holds quantised linears"
    at_load = {k: (b.data_ptr(), b.numel()) for k, b in Q.SCRATCH._bufs.items()}
    assert at_load, "no scratch reserved at load"
    widest = max(P.qlinear_scratch_bytes(m.out_features, m.in_features, "int8", 4) for m in lins)
    assert Q.SCRATCH.nbytes(torch.device("cpu")) == widest
    prompt = [(5 * i + 1) % reader.config.vocab_size for i in range(70)]
    runner.generate(prompt, 6, chunk_tokens=32)
    assert runner.graphs.captured() > 0
    assert {k: (b.data_ptr(), b.numel()) for k, b in Q.SCRATCH._bufs.items()} == at_load
    assert Q.SCRATCH.grown == 0


def test_replaced_scratch_is_kept_for_captured_graphs():
    """A buffer outgrown later (a wider linear built after a model's graphs were captured) stays
    allocated: the graphs' baked address never lands in memory handed to another tensor."""
    s = Q._Scratch()
    a = s.reserve(torch.device("cpu"), torch.float32, 100)
    b = s.reserve(torch.device("cpu"), torch.float32, 50)
    assert b is a
    c = s.reserve(torch.device("cpu"), torch.float32, 200)
    assert c.numel() == 200 and s.grown == 1 and any(r is a for r in s._retired)
    assert s.nbytes(torch.device("cpu")) == 800
