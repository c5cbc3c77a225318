"""The fused decode step (gpu_service.model.fast_decode) and its CUDA-graph plumbing
(gpu_service.model.cuda_graphs) on CPU, fp32, DeepSeek-V3 and V3.2 (lightning indexer) tiny models:

- 32 greedy decode steps of 3 sequences: fused == the unfused batched path == the plain reference
  (tokens equal, logits within 1e-5);
- a sequence's decode logits are bit-identical alone or batched (with and without ping-pong);
- the segments run on static buffers with bucket padding (what CUDA graphs replay) equal the
  fused path bit for bit at 1, 3, 5 and 9 sequences;
- the fused weights are views (no extra bytes), the hot-experts output equals the per-expert loop,
  the plan's workspace counts the decode attention and the graph pools.
"""
import pytest
import torch

from gpu_service import plan as P
from gpu_service.model import fast_decode as fd
from gpu_service.model.cuda_graphs import Graphs
from gpu_service.model.deepseek import MoE
from gpu_service.model.experts_api import Ready
from gpu_service.model.kv import Chunk, KVPool, SeqKV
from tests.test_paged_attention import _setup, ARCHS, greedy_decode, PAGE

def _greedy(*a, **kw):
    """The torch fused path (this file's subject)."""
    return greedy_decode(*a, **kw)


PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 7, 41, 3, 3, 19, 250, 11, 6, 90, 12], [400, 21, 22], list(range(30, 39)),
           [7] * 12, [1, 2, 3, 4, 5], [9, 9], [300], [8] * 20, [44] * 3]


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_decode_32_steps_equal_unfused_and_plain(arch):
    cfg, model, experts = _setup(arch)
    plain = _greedy(model, cfg, experts, PROMPTS[:3], 32, batched=False)
    unfused = _greedy(model, cfg, experts, PROMPTS[:3], 32, fused=False)
    fused = _greedy(model, cfg, experts, PROMPTS[:3], 32)
    assert fused[0] == plain[0] == unfused[0]
    for ref in (plain, unfused):
        err = max(float((a - b).abs().max()) for a, b in zip(ref[1], fused[1]))
        assert err < 1e-5, f"fused decode logits differ by {err}"


def _row_independent_experts(layer, h, ids, w):
    out = h * 0.5 + w[:, :1] * 0.25  # elementwise: each row from its own inputs only
    return Ready(out)


def decode_step_from_prefilled(cfg, model):
    """Six sequences (the last spans several pages), each prefilled alone; returns (step, n):
    step(idx) restores the caches and decodes sequences idx once together -> their logits."""
    prompts = PROMPTS[:5] + [list(range(60, 130))]
    pool = KVPool(cfg, 128, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    seqs = [SeqKV(pool) for _ in prompts]
    for s, p in zip(seqs, prompts):  # each prefilled alone: the same cache either way
        model(torch.tensor(p), [Chunk(s, 0, len(p))], pool, _row_independent_experts)
    caches = pool.kv + (pool.index_k or [])  # V3.2: the index keys too
    snap = [t.clone() for t in caches]
    toks = [3, 44, 55, 66, 77, 88]

    def step(idx):
        for t, c in zip(caches, snap):
            t.copy_(c)
        out = model(torch.tensor([toks[i] for i in idx]), [Chunk(seqs[i], seqs[i].length, 1) for i in idx], pool,
                    _row_independent_experts)
        for i in idx:
            seqs[i].length -= 1
        return out

    return step, len(seqs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ping_pong", [True, False])
def test_fused_decode_bit_identical_alone_or_batched(ping_pong, arch):
    cfg, model, _ = _setup(arch)
    step, n = decode_step_from_prefilled(cfg, model)
    model.ping_pong = ping_pong
    try:
        together = step(list(range(n)))
        for i in range(n):
            assert torch.equal(step([i])[0], together[i]), f"sequence {i}'s logits depend on its neighbours"
    finally:
        model.ping_pong = True


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [1, 3, 5, 9])
def test_static_graph_segments_equal_fused_path(n, arch):
    cfg, model, experts = _setup(arch)
    graphs = Graphs(mode="static", min_rows=fd.MIN_ROWS)
    ref = _greedy(model, cfg, experts, PROMPTS[:n], 10)
    got = _greedy(model, cfg, experts, PROMPTS[:n], 10, graphs=graphs)
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1])), "bucket-padded static segments differ"
    assert graphs.captured() > 0 and sum(s.replays for s in graphs.sets.values()) > 0
    for (_, _, rows), s in graphs.sets.items():
        assert rows in graphs.buckets and rows >= fd.MIN_ROWS


def test_graphs_eager_above_the_largest_bucket():
    cfg, model, experts = _setup("deepseek_v3")
    graphs = Graphs(buckets=(4,), mode="static", min_rows=fd.MIN_ROWS)
    model.ping_pong = False
    try:
        ref = _greedy(model, cfg, experts, PROMPTS[:5], 4)
        got = _greedy(model, cfg, experts, PROMPTS[:5], 4, graphs=graphs)
    finally:
        model.ping_pong = True
    assert got[0] == ref[0] and graphs.captured() == 0 and graphs.eager_steps == 4


def test_a_failed_capture_falls_back_to_eager(monkeypatch, caplog):
    """A capture error (here: every capture raises) never fails a step with on_error='eager':
    the segment runs eagerly, graphs turn off with a warning naming the error, tokens unchanged."""
    from gpu_service.model import cuda_graphs

    cfg, model, experts = _setup("deepseek_v3")
    graphs = Graphs(mode="static", min_rows=fd.MIN_ROWS, on_error="eager")

    def boom(self, name, fn, args):
        raise RuntimeError(f"operation not permitted when stream is capturing ({name})")
    monkeypatch.setattr(cuda_graphs.GraphSet, "_capture", boom)
    ref = _greedy(model, cfg, experts, PROMPTS[:3], 6)
    with caplog.at_level("WARNING", logger="moesplit.cuda_graphs"):
        got = _greedy(model, cfg, experts, PROMPTS[:3], 6, graphs=graphs)
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert graphs.disabled and "operation not permitted" in graphs.disabled and graphs.captured() == 0
    assert any("CUDA graphs off" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="operation not permitted"):  # mode static raises by default
        _greedy(model, cfg, experts, PROMPTS[:1], 2, graphs=Graphs(mode="static", min_rows=fd.MIN_ROWS))


def test_cuda_graph_mode_without_cuda_names_the_flag():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(RuntimeError, match="--no-cuda-graphs"):
        Graphs(mode="cuda")


def test_fused_weights_are_views_of_one_tensor():
    cfg, model, _ = _setup("deepseek_v3")
    for blk in model.model.layers:
        mla = blk.self_attn
        ws = [mla.q_a_proj.weight, mla.kv_a_proj_with_mqa.weight]
        assert fd._fused_view(ws) is not None
        assert ws[0].untyped_storage().nbytes() == sum(w.numel() for w in ws) * 4  # no extra bytes
        mlp = blk.mlp.shared_experts if isinstance(blk.mlp, MoE) else blk.mlp
        assert fd._fused_view([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None


def test_hot_output_equals_the_per_expert_loop():
    cfg, _, _ = _setup("deepseek_v3")
    torch.manual_seed(0)
    moe = MoE(cfg, 1, hot=[0, 3, 5]).eval()
    x = torch.randn(6, cfg.hidden_size)
    ids = torch.tensor([[0, 1, 2, 3], [4, 6, 7, 8], [5, 3, 9, 10], [11, 12, 13, 14], [0, 5, 3, 2], [1, 2, 4, 6]])
    w = torch.rand(6, 4)
    with torch.inference_mode():
        got = moe.hot_output(x, ids, w, torch.zeros(6, cfg.hidden_size))
        ref = torch.zeros(6, cfg.hidden_size)
        for e in moe.hot:
            rows, cols = torch.where(ids == e)
            if rows.numel():
                ref.index_add_(0, rows, moe.experts[str(e)](x[rows]) * w[rows, cols, None])
        assert torch.equal(got, ref)
        assert torch.equal(moe.remote_weights(ids, w), w.masked_fill((ids[..., None] == torch.tensor([0, 3, 5])).any(-1), 0))


def test_plan_workspace_counts_decode_attention_and_graph_pools():
    cfg = P.load_model_config("deepseek-v3")[0]
    o = P.Options("bf16", "gpu", "int4", 0, 65536, max_batch=16)
    dec = P.decode_workspace_bytes(cfg, o, mlp_width=2048)
    K = 65536 + 16 * P.MIN_KEYS
    assert dec >= 2 * 576 * K + 4 * 128 * K  # the gathered cache and an fp32 score row per head and key
    g = P.graph_pool_bytes(cfg, o, layers=61, mlp_width=2048)
    assert g > 0 and P.graph_pool_bytes(cfg, o, layers=0, mlp_width=2048) == 0
    no_graphs = P.Options("bf16", "gpu", "int4", 0, 65536, max_batch=16, cuda_graphs=False)
    kw = dict(mlp_width=2048, lm_head=True, layers=61)
    assert P.workspace_bytes(cfg, o, **kw) - P.workspace_bytes(cfg, no_graphs, **kw) == g
    assert g < 256 * 2 ** 20  # one layer's static buffers per set, not one per layer


@pytest.mark.parametrize("over,fmt", [({"q_lora_rank": None}, None), ({}, "int8"), ({}, "fp8")],
                         ids=["no-q-lora", "int8-attention", "fp8-attention"])
def test_fused_decode_variants_equal_plain(over, fmt):
    """No q_lora (q_proj fused with kv_a), weight-only quantised attention / shared expert (no fusion,
    kv_b_proj dequantised per step): the fused step equals the plain reference."""
    from checkpoint.config import ModelConfig
    from gpu_service.local.tiny import build_hf_model, tiny_config
    from gpu_service.model.deepseek import build_model

    d = tiny_config("deepseek_v3", "bf16", over)
    sd = {k: v.float() for k, v in build_hf_model(d, 0).state_dict().items()}
    cfg = ModelConfig.from_dict(d)

    def linear_format(n):
        return fmt if fmt and ("self_attn" in n or "shared_experts" in n) and n.endswith("proj.weight") else None

    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"),
                           linear_format=linear_format)
    plain = _greedy(model, cfg, _row_independent_experts, PROMPTS[:3], 8, batched=False)
    fused = _greedy(model, cfg, _row_independent_experts, PROMPTS[:3], 8)
    assert fused[0] == plain[0]
    assert max(float((a - b).abs().max()) for a, b in zip(plain[1], fused[1])) < 1e-5
    assert len(model.__dict__["_fast_blocks"]) == cfg.num_hidden_layers  # the fused path ran every layer
