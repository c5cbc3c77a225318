"""The one model's decode (gpu_service.model.deepseek over the torch attention backend) on CPU,
fp32, DeepSeek-V3 and V3.2 (lightning indexer selecting) tiny models, against transformers:

- mixed steps (decode of some sequences with prefill chunks of others, histories over many
  4-token pages interleaved in the pool): every chunk's logits within 1e-4 of transformers'
  full recompute of that sequence;
- 32 greedy decode steps of 3 sequences: transformers' tokens;
- a sequence's logits are bit-identical alone or batched (all-decode steps, with and without
  ping-pong), and a decode token in a mixed step equals the same token in an all-decode step;
- the attention backend's decode and V3.2 selection per row are bit-identical whatever else is
  in the batch (padded keys read the pool's zero row and are masked);
- the pieces run on static buffers with bucket padding (what CUDA graphs replay) equal eager,
  a failed capture falls back to eager; variants (no q_lora, int8 / fp8 attention) decode as they
  prefill; fused weights are views; the hot-experts output equals the per-expert loop.
"""
import functools

import pytest
import torch

from checkpoint.config import ModelConfig
from gpu_service import plan as P
from gpu_service.attention.meta import build_meta
from gpu_service.attention.torch_paged import TorchBackend
from gpu_service.local.tiny import build_hf_model, tiny_config
from gpu_service.model.deepseek import build_model, MoE
from gpu_service.model.experts_api import Ready
from gpu_service.model.kv import Chunk, KVPool, SeqKV
from gpu_service.model.layers import fused_view
from gpu_service.runtime.cuda_graphs import Graphs

PAGE = 4
ARCHS = ["deepseek_v3", "deepseek_v32"]
PROMPTS = [[5, 9, 17, 33, 2, 8, 100, 7, 41, 3, 3, 19, 250, 11, 6, 90, 12], [400, 21, 22], list(range(30, 39)),
           [7] * 12, [1, 2, 3, 4, 5], [9, 9], [300], [8] * 20, [44] * 3]


@functools.lru_cache(maxsize=None)
def _setup(arch: str):
    over = {"index_n_heads": 8, "index_head_dim": 32, "index_topk": 6} if arch == "deepseek_v32" else {}
    d = tiny_config(arch, "bf16", over)
    hf = build_hf_model(d, 0).float().eval()
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    cfg = ModelConfig.from_dict(d)
    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    I = cfg.moe_intermediate_size

    def experts(layer, h, ids, w):
        gu, dn = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"], sd[f"model.layers.{layer}.mlp.experts.down_proj"]
        g = torch.einsum("eih,th->tei", gu, h)  # every expert, then pick: [T, E, 2I]
        y = torch.einsum("ehi,tei->teh", dn, torch.nn.functional.silu(g[..., :I]) * g[..., I:])  # [T, E, H]
        return Ready((y.gather(1, ids[..., None].expand(-1, -1, h.shape[1])) * w[..., None]).sum(1))

    return cfg, model, experts, hf


@functools.lru_cache(maxsize=None)
def _setup_torch(arch: str):
    """As _setup, without transformers (a bare CUDA host): make-tiny's torch-drawn weights
    (gpu_service.local.tiny.random_tensors) and the per-expert checkpoint tensors as the experts."""
    from checkpoint.names import expert_weight
    from gpu_service.local.tiny import random_tensors

    cfg = ModelConfig.from_dict(tiny_config(arch, "bf16", {}))
    sd = random_tensors(cfg, seed=0)
    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    E = cfg.n_routed_experts
    gu = {i: torch.stack([torch.cat([sd[expert_weight(i, e, p)] for p in ("gate", "up")]) for e in range(E)])
          for i in cfg.moe_layers}  # [E, 2I, H]
    dn = {i: torch.stack([sd[expert_weight(i, e, "down")] for e in range(E)]) for i in cfg.moe_layers}  # [E, H, I]
    I = cfg.moe_intermediate_size

    def experts(layer, h, ids, w):
        g = torch.einsum("eih,th->tei", gu[layer], h)  # every expert, then pick: [T, E, 2I]
        y = torch.einsum("ehi,tei->teh", dn[layer], torch.nn.functional.silu(g[..., :I]) * g[..., I:])  # [T, E, H]
        return Ready((y.gather(1, ids[..., None].expand(-1, -1, h.shape[1])) * w[..., None]).sum(1))

    return cfg, model, experts


def _row_independent_experts(layer, h, ids, w):
    return Ready(h * 0.5 + w[:, :1] * 0.25)  # elementwise: each row from its own inputs only


def _hf_last(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


def _schedule():
    g = torch.Generator().manual_seed(0)

    def toks(n):
        return torch.randint(4, 500, (n,), generator=g).tolist()

    steps = [[(0, toks(23)), (1, toks(5))], [(0, toks(1)), (1, toks(1)), (2, toks(9))]]
    for i in range(10):  # mixed: decode of 0..2 with prefill chunks of sequence 3
        step = [(0, toks(1)), (1, toks(1)), (2, toks(1))]
        if i in (2, 6):
            step.insert(1, (3, toks(7 if i == 2 else 3)))
        elif i > 6:
            step.append((3, toks(1)))
        steps.append(step)
    return steps


@pytest.mark.parametrize("arch", ARCHS)
def test_mixed_steps_equal_transformers(arch):
    cfg, model, experts, hf = _setup(arch)
    pool = KVPool(cfg, 96, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    seqs, hist = [SeqKV(pool) for _ in range(4)], [[] for _ in range(4)]
    hold = SeqKV(pool)  # grabs pages between steps: sequences' pages interleave in the pool
    for i, step in enumerate(_schedule()):
        ids, chunks = [], []
        for si, toks in step:
            chunks.append(Chunk(seqs[si], seqs[si].length, len(toks)))
            ids += toks
            hist[si] += toks
        out = model(torch.tensor(ids), chunks, pool, experts)
        for j, (si, _) in enumerate(step):
            err = float((out[j] - _hf_last(hf, hist[si])).abs().max())
            assert err < 1e-4, f"step {i}, sequence {si}: logits differ from transformers by {err}"
        hold.reserve(len(hold.pages) * PAGE + 1)


def greedy_decode(model, cfg, experts, prompts, steps, graphs=None):
    """Greedy decode of `prompts` together for `steps` steps on a fresh pool: (tokens, logits) per step."""
    pool = KVPool(cfg, 128, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    seqs = [SeqKV(pool) for _ in prompts]
    logits = model(torch.tensor(sum(prompts, [])), [Chunk(s, 0, len(p)) for s, p in zip(seqs, prompts)],
                   pool, experts, graphs=graphs)
    toks, lg = [], []
    for _ in range(steps):
        nxt = logits.argmax(-1).tolist()
        toks.append(nxt)
        logits = model(torch.tensor(nxt), [Chunk(s, s.length, 1) for s in seqs], pool, experts, graphs=graphs)
        lg.append(logits)
    return toks, lg


@pytest.mark.parametrize("arch", ARCHS)
def test_32_decode_steps_equal_transformers(arch):
    cfg, model, experts, hf = _setup(arch)
    prompts = PROMPTS[:3]
    toks, _ = greedy_decode(model, cfg, experts, prompts, 32)
    for i, p in enumerate(prompts):
        seq = list(p)
        for t in range(32):
            want = int(_hf_last(hf, seq).argmax())
            assert toks[t][i] == want, f"sequence {i}, step {t}: token {toks[t][i]}, transformers {want}"
            seq.append(want)


def decode_step_from_prefilled(cfg, model):
    """Six sequences (the last spans several pages), each prefilled alone; returns (step, n):
    step(idx, extra) restores the caches and decodes sequences idx once together (with `extra`, a
    prefill chunk of a seventh sequence, in the same step) -> their logits."""
    prompts = PROMPTS[:5] + [list(range(60, 130))]
    pool = KVPool(cfg, 128, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    seqs = [SeqKV(pool) for _ in prompts]
    for s, p in zip(seqs, prompts):  # each prefilled alone: the same cache either way
        model(torch.tensor(p), [Chunk(s, 0, len(p))], pool, _row_independent_experts)
    other = SeqKV(pool)
    caches = pool.kv + (pool.index_k or [])  # V3.2: the index keys too
    snap = [t.clone() for t in caches]
    toks = [3, 44, 55, 66, 77, 88]

    def step(idx, extra=()):
        for t, c in zip(caches, snap):
            t.copy_(c)
        chunks = [Chunk(seqs[i], seqs[i].length, 1) for i in idx] + ([Chunk(other, 0, len(extra))] if extra else [])
        out = model(torch.tensor([toks[i] for i in idx] + list(extra)), chunks, pool, _row_independent_experts)
        for i in idx:
            seqs[i].length -= 1
        other.length = 0
        return out

    return step, len(seqs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ping_pong", [True, False])
def test_decode_bit_identical_alone_or_batched(ping_pong, arch):
    cfg, model, _, _ = _setup(arch)
    step, n = decode_step_from_prefilled(cfg, model)
    model.ping_pong = ping_pong
    try:
        together = step(list(range(n)))
        for i in range(n):
            assert torch.equal(step([i])[0], together[i]), f"sequence {i}'s logits depend on its neighbours"
        mixed = step(list(range(n)), extra=[9, 8, 7, 6, 5])  # one prefill chunk in the step: not all-decode
        for i in range(n):
            assert torch.equal(mixed[i], together[i]), f"sequence {i}'s logits differ in a mixed step"
    finally:
        model.ping_pong = True


def _pool_with_histories(cfg, lengths, seed=0):
    """A pool with random finite c_kv/k_pe/index keys (and a NaN page nobody owns) and sequences of
    the given lengths on interleaved pages; returns (pool, seqs)."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(cfg, 256, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    for t in pool.kv + (pool.index_k or []):
        t[: pool.null_slot].copy_(torch.randn((pool.null_slot, t.shape[1]), generator=g))
    seqs = [SeqKV(pool) for _ in lengths]
    for n in range(1, max(lengths) + 1):  # one token at a time, round robin: pages interleave
        for s, L in zip(seqs, lengths):
            if n <= L:
                s.reserve(n)
    for t in pool.kv + (pool.index_k or []):  # stale non-finite rows past the sequences' lengths
        for s, L in zip(seqs, lengths):
            t[s.slots(L, len(s.pages) * PAGE, t.device)] = float("nan")
    return pool, seqs


@pytest.mark.parametrize("arch", ARCHS)
def test_backend_rows_bit_identical_to_alone(arch):
    cfg, model, _, _ = _setup(arch)
    lengths = [1, 7, 30, 4, 61, 13, 9, 44, 2, 3, 5, 15, 16, 17, 64, 65, 100, 129]  # up to 33 pages of 4
    pool, seqs = _pool_with_histories(cfg, lengths)
    g = torch.Generator().manual_seed(1)
    mla = model.model.layers[1].self_attn
    B, be = len(lengths), TorchBackend()
    q = torch.randn(B, mla.nh, mla.r + mla.rdim, generator=g)
    kv, ik = pool.kv[1], (pool.index_k[1] if pool.index_k else None)
    iq = torch.randn(B, 8, 32, generator=g) if ik is not None else None
    iw = torch.randn(B, 8, generator=g) if ik is not None else None

    def attend(idx):
        meta = build_meta([Chunk(seqs[i], lengths[i] - 1, 1) for i in idx], pool, torch.device("cpu"))
        keep = None
        if ik is not None:
            keep = be.select_decode(mla.indexer, iq[idx], iw[idx], ik, meta)
            if keep is not None and len(idx) == B:
                assert bool((keep.sum(-1) == torch.tensor([lengths[i] for i in idx]).clamp(max=cfg.index_topk)).all())
        return be.decode(mla, q[idx], kv, meta, keep)

    together = attend(list(range(B)))
    assert bool(torch.isfinite(together).all()), "a stale NaN past a sequence's length reached its output"
    for i in range(B):
        assert torch.equal(attend([i]), together[i:i + 1]), f"sequence {i} depends on its neighbours"
    perm = torch.randperm(B, generator=g).tolist()
    assert torch.equal(attend(perm), together[perm])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("n", [1, 3, 5, 9])
def test_static_graph_pieces_equal_eager(n, arch):
    cfg, model, experts, _ = _setup(arch)
    block = model.row_block(torch.device("cpu"))
    graphs = Graphs(mode="static", min_rows=block)
    ref = greedy_decode(model, cfg, experts, PROMPTS[:n], 10)
    got = greedy_decode(model, cfg, experts, PROMPTS[:n], 10, graphs=graphs)
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1])), "bucket-padded static pieces differ"
    assert graphs.captured() > 0 and sum(s.replays for s in graphs.sets.values()) > 0
    for (_, _, rows), s in graphs.sets.items():
        assert rows in graphs.buckets and rows >= block


def test_graphs_eager_above_the_largest_bucket():
    cfg, model, experts, _ = _setup("deepseek_v3")
    block = model.row_block(torch.device("cpu"))
    graphs = Graphs(buckets=(block,), mode="static", min_rows=block)
    prompts = [[i + 3, i + 5] for i in range(block + 1)]
    model.ping_pong = False
    try:
        ref = greedy_decode(model, cfg, experts, prompts, 4)
        got = greedy_decode(model, cfg, experts, prompts, 4, graphs=graphs)
    finally:
        model.ping_pong = True
    assert got[0] == ref[0] and graphs.captured() == 0 and graphs.eager_steps == 4


def test_a_failed_capture_falls_back_to_eager(monkeypatch, caplog):
    """A capture error (here: every capture raises) never fails a step with on_error='eager':
    the piece runs eagerly, graphs turn off with a warning naming the error, tokens unchanged."""
    from gpu_service.runtime import cuda_graphs

    cfg, model, experts, _ = _setup("deepseek_v3")
    block = model.row_block(torch.device("cpu"))
    graphs = Graphs(mode="static", min_rows=block, on_error="eager")

    def boom(self, name, fn, args):
        raise RuntimeError(f"operation not permitted when stream is capturing ({name})")
    monkeypatch.setattr(cuda_graphs.GraphSet, "_capture", boom)
    ref = greedy_decode(model, cfg, experts, PROMPTS[:3], 6)
    with caplog.at_level("WARNING", logger="moesplit.cuda_graphs"):
        got = greedy_decode(model, cfg, experts, PROMPTS[:3], 6, graphs=graphs)
    assert got[0] == ref[0]
    assert all(torch.equal(a, b) for a, b in zip(ref[1], got[1]))
    assert graphs.disabled and "operation not permitted" in graphs.disabled and graphs.captured() == 0
    assert any("CUDA graphs off" in r.getMessage() for r in caplog.records)
    with pytest.raises(RuntimeError, match="operation not permitted"):  # mode static raises by default
        greedy_decode(model, cfg, experts, PROMPTS[:1], 2, graphs=Graphs(mode="static", min_rows=block))


def test_cuda_graph_mode_without_cuda_names_the_flag():
    if torch.cuda.is_available():
        pytest.skip("CUDA is here")
    with pytest.raises(RuntimeError, match="--no-cuda-graphs"):
        Graphs(mode="cuda")


def test_fused_weights_are_views_of_one_tensor():
    cfg, model, _, _ = _setup("deepseek_v3")
    for blk in model.model.layers:
        mla = blk.self_attn
        ws = [mla.q_a_proj.weight, mla.kv_a_proj_with_mqa.weight]
        assert fused_view(ws) is not None
        assert ws[0].untyped_storage().nbytes() == sum(w.numel() for w in ws) * 4  # no extra bytes
        mlp = blk.mlp.shared_experts if isinstance(blk.mlp, MoE) else blk.mlp
        assert fused_view([mlp.gate_proj.weight, mlp.up_proj.weight]) is not None


def test_hot_output_equals_the_per_expert_loop():
    cfg, _, _, _ = _setup("deepseek_v3")
    torch.manual_seed(0)
    moe = MoE(cfg, 1, hot=[0, 3, 5]).eval()
    for m in moe.experts.values():
        m.prepare()
    x = torch.randn(6, cfg.hidden_size)
    ids = torch.tensor([[0, 1, 2, 3], [4, 6, 7, 8], [5, 3, 9, 10], [11, 12, 13, 14], [0, 5, 3, 2], [1, 2, 4, 6]])
    w = torch.rand(6, 4)
    with torch.inference_mode():
        got = moe.hot_output(x, ids, w, torch.zeros(6, cfg.hidden_size))
        ref = torch.zeros(6, cfg.hidden_size)
        for e in moe.hot:
            rows, cols = torch.where(ids == e)
            if rows.numel():
                m = moe.experts[str(e)]
                y = m.down_proj(torch.nn.functional.silu(m.gate_proj(x[rows])) * m.up_proj(x[rows]))
                ref.index_add_(0, rows, y * w[rows, cols, None])
        assert torch.allclose(got, ref, atol=1e-6, rtol=0)
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
def test_variants_decode_as_they_prefill(over, fmt):
    """No q_lora (q_proj fused with kv_a), weight-only quantised attention / shared expert (no fusion,
    kv_b_proj dequantised per step): incremental decoding gives the tokens, and logits within 1e-4,
    of recomputing each whole sequence in one prefill."""
    d = tiny_config("deepseek_v3", "bf16", over)
    sd = {k: v.float() for k, v in build_hf_model(d, 0).state_dict().items()}
    cfg = ModelConfig.from_dict(d)

    def linear_format(n):
        return fmt if fmt and ("self_attn" in n or "shared_experts" in n) and n.endswith("proj.weight") else None

    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"),
                           linear_format=linear_format)
    prompts = PROMPTS[:3]
    toks, lg = greedy_decode(model, cfg, _row_independent_experts, prompts, 8)
    for i, p in enumerate(prompts):
        seq = p + [t[i] for t in toks]
        pool = KVPool(cfg, 64, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
        full = model(torch.tensor(seq), [Chunk(SeqKV(pool), 0, len(seq))], pool, _row_independent_experts,
                     all_logits=True)
        for t in range(8):
            assert int(full[len(p) - 1 + t].argmax()) == toks[t][i]
            if t:
                assert float((full[len(p) - 1 + t] - lg[t - 1][i]).abs().max()) < 1e-4


@pytest.mark.gpu
def test_decode_on_cuda_equals_cpu():
    """On CUDA (FlashInfer where importable and the dims are DeepSeek's, else the torch backend):
    32 greedy steps of 3 sequences give the CPU's tokens (weights drawn without transformers,
    which the lent GPU machine may not have)."""
    import copy

    cfg, model_cpu, experts = _setup_torch("deepseek_v3")
    model = copy.deepcopy(model_cpu).cuda()
    model.prepare(torch.float32)

    def experts_cuda(layer, h, ids, w):
        return Ready(experts(layer, h.cpu(), ids.cpu(), w.cpu()).wait().to(h.device))

    prompts = PROMPTS[:3]
    want, _ = greedy_decode(model_cpu, cfg, experts, prompts, 32)
    pool = KVPool(cfg, 64, PAGE, torch.float32, [torch.device("cuda")] * cfg.num_hidden_layers)
    seqs = [SeqKV(pool) for _ in prompts]
    logits = model(torch.tensor(sum(prompts, [])), [Chunk(s, 0, len(p)) for s, p in zip(seqs, prompts)], pool,
                   experts_cuda)
    got = []
    for _ in range(32):
        nxt = logits.argmax(-1).tolist()
        got.append(nxt)
        logits = model(torch.tensor(nxt), [Chunk(s, s.length, 1) for s in seqs], pool, experts_cuda)
    assert got == want
