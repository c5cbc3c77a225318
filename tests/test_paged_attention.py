"""Batched paged MLA attention (gpu_service.model.paged_attention) against the per-sequence
reference path (MLA's loop over chunks), fp32 on CPU, DeepSeek-V3 and V3.2 (sparse top-k).

- logits of mixed steps (decode + prefill chunks of other sequences, histories over many
  4-token pages, pages interleaved between sequences) within 1e-5 of the reference;
- each decode sequence's attention output is bit-identical whatever else is in the batch
  (padded page tables are masked, not padded into the arithmetic);
- 32 greedy decode steps of a batch of 3: the same tokens, logits within 1e-5.
"""
import functools

import pytest
import torch

from checkpoint.config import ModelConfig
from gpu_service.local.tiny import build_hf_model, tiny_config
from gpu_service.model import paged_attention as pa
from gpu_service.model.deepseek import build_model
from gpu_service.model.experts_api import Ready
from gpu_service.model.kv import Chunk, KVPool, SeqKV

PAGE = 4


@functools.lru_cache(maxsize=None)
def _setup(arch: str):
    over = {"index_n_heads": 8, "index_head_dim": 32, "index_topk": 6} if arch == "deepseek_v32" else {}
    d = tiny_config(arch, "bf16", over)
    hf = build_hf_model(d, 0)
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    cfg = ModelConfig.from_dict(d)
    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    I = cfg.moe_intermediate_size

    def experts(layer, h, ids, w):
        gu, dn = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"], sd[f"model.layers.{layer}.mlp.experts.down_proj"]
        g = torch.einsum("eih,th->tei", gu, h)  # every expert, then pick: [T, E, 2I]
        y = torch.einsum("ehi,tei->teh", dn, torch.nn.functional.silu(g[..., :I]) * g[..., I:])  # [T, E, H]
        out = (y.gather(1, ids[..., None].expand(-1, -1, h.shape[1])) * w[..., None]).sum(1)
        return Ready(out)

    return cfg, model, experts


ARCHS = ["deepseek_v3", "deepseek_v32"]


def _run(model, batched: bool, steps, cfg, experts):
    """Run the same schedule of steps on a fresh pool; returns the logits of each step."""
    model.batched_attention = batched
    try:
        pool = KVPool(cfg, 96, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
        seqs = [SeqKV(pool) for _ in range(4)]
        hold = SeqKV(pool)  # grabs pages between steps: sequences' pages interleave in the pool
        out = []
        for step in steps:
            ids, chunks = [], []
            for si, toks in step:
                s = seqs[si]
                chunks.append(Chunk(s, s.length, len(toks)))
                ids += toks
            out.append(model(torch.tensor(ids), chunks, pool, experts))
            hold.reserve(len(hold.pages) * PAGE + 1)
        return out
    finally:
        model.batched_attention = True


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
def test_mixed_steps_equal_reference(arch):
    cfg, model, experts = _setup(arch)
    steps = _schedule()
    ref = _run(model, False, steps, cfg, experts)
    got = _run(model, True, steps, cfg, experts)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a.shape == b.shape
        err = float((a - b).abs().max())
        assert err < 1e-5, f"step {i}: batched logits differ from the reference by {err}"


def _pool_with_histories(cfg, lengths, seed=0):
    """A pool with random finite c_kv/k_pe/index keys and sequences of the given lengths on
    interleaved pages; returns (pool, seqs)."""
    g = torch.Generator().manual_seed(seed)
    pool = KVPool(cfg, 256, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    for t in pool.kv + (pool.index_k or []):
        t.copy_(torch.randn(t.shape, generator=g))
    seqs = [SeqKV(pool) for _ in lengths]
    for n in range(1, max(lengths) + 1):  # one token at a time, round robin: pages interleave
        for s, L in zip(seqs, lengths):
            if n <= L:
                s.reserve(n)
    return pool, seqs


@pytest.mark.parametrize("arch", ARCHS)
def test_each_sequence_bit_identical_to_alone(arch):
    cfg, model, _ = _setup(arch)
    lengths = [1, 7, 30, 4, 61, 13, 9, 44, 2, 3, 5, 15, 16, 17, 64, 65, 100, 129]  # up to 33 pages of 4
    pool, seqs = _pool_with_histories(cfg, lengths)
    g = torch.Generator().manual_seed(1)
    layer = model.model.layers[1]
    mla = layer.self_attn
    B = len(lengths)
    x = torch.randn(B, cfg.hidden_size, generator=g)
    q_nope = torch.randn(B, mla.nh, mla.nope, generator=g)
    q_pe = torch.randn(B, mla.nh, mla.rdim, generator=g)
    q_resid = torch.randn(B, cfg.q_lora_rank, generator=g)
    cos, sin = model.rope.cos_sin(torch.tensor([L - 1 for L in lengths]), torch.float32)
    kv, ik = pool.kv[1], (pool.index_k[1] if pool.index_k else None)

    def attend(idx):
        chunks = [Chunk(seqs[i], lengths[i] - 1, 1) for i in idx]
        meta = pa.build_meta(chunks, pool, torch.device("cpu"))
        keep = None
        if mla.indexer is not None:
            keep = pa.select_decode(mla.indexer, x[idx], q_resid[idx], cos[idx], sin[idx], ik, meta)
            if keep is not None and len(idx) == B:
                assert bool((keep.sum(-1) == torch.tensor([lengths[i] for i in idx]).clamp(max=cfg.index_topk)).all())
        return pa.decode_attention(mla, q_nope[idx], q_pe[idx], kv, meta, keep)

    together = attend(list(range(B)))
    for i in range(B):
        assert torch.equal(attend([i]), together[i:i + 1]), f"sequence {i} depends on its neighbours"
    perm = torch.randperm(B, generator=g).tolist()
    assert torch.equal(attend(perm), together[perm])


def greedy_decode(model, cfg, experts, prompts, steps, *, batched=True, fused=True, graphs=None):
    """Greedy decode of `prompts` together for `steps` steps on a fresh pool, with the model's
    decode path set as asked (batched attention, fused step, CUDA-graph set) and
    restored after: (tokens per step, logits per step)."""
    model.batched_attention, model.fused_decode, model.graphs = batched, fused, graphs
    try:
        pool = KVPool(cfg, 128, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
        seqs = [SeqKV(pool) for _ in prompts]
        logits = model(torch.tensor(sum(prompts, [])), [Chunk(s, 0, len(p)) for s, p in zip(seqs, prompts)],
                       pool, experts)
        toks, lg = [], []
        for _ in range(steps):
            nxt = logits.argmax(-1).tolist()
            toks.append(nxt)
            logits = model(torch.tensor(nxt), [Chunk(s, s.length, 1) for s in seqs], pool, experts)
            lg.append(logits)
        return toks, lg
    finally:
        model.batched_attention, model.fused_decode, model.graphs = True, True, None


@pytest.mark.parametrize("arch", ARCHS)
def test_32_decode_steps_optimised_equal_plain(arch):
    cfg, model, experts = _setup(arch)
    prompts = [[5, 9, 17, 33, 2, 8, 100, 7, 41, 3, 3, 19, 250, 11, 6, 90, 12], [400, 21, 22], list(range(30, 39))]

    t_plain, l_plain = greedy_decode(model, cfg, experts, prompts, 32, batched=False)
    t_fast, l_fast = greedy_decode(model, cfg, experts, prompts, 32)
    assert t_fast == t_plain
    assert max(float((a - b).abs().max()) for a, b in zip(l_plain, l_fast)) < 1e-5


@pytest.mark.gpu
def test_batched_attention_on_cuda_equals_plain():
    """On CUDA (FlashInfer where importable and the dims are DeepSeek's, else the torch path):
    32 greedy steps of 3 sequences, batched vs the per-sequence reference."""
    cfg, model_cpu, experts = _setup("deepseek_v3")
    import copy

    model = copy.deepcopy(model_cpu).cuda()

    def experts_cuda(layer, h, ids, w):
        out = experts(layer, h.cpu(), ids.cpu(), w.cpu()).wait()
        return Ready(out.to(h.device))

    prompts = [[5, 9, 17, 33, 2, 8, 100], [400, 21, 22], list(range(30, 49))]

    def greedy(batched):
        model.batched_attention = batched
        pool = KVPool(cfg, 64, PAGE, torch.float32, [torch.device("cuda")] * cfg.num_hidden_layers)
        seqs = [SeqKV(pool) for _ in prompts]
        logits = model(torch.tensor(sum(prompts, [])), [Chunk(s, 0, len(p)) for s, p in zip(seqs, prompts)],
                       pool, experts_cuda)
        toks, lg = [], []
        for _ in range(32):
            nxt = logits.argmax(-1).tolist()
            toks.append(nxt)
            logits = model(torch.tensor(nxt), [Chunk(s, s.length, 1) for s in seqs], pool, experts_cuda)
            lg.append(logits.cpu())
        return toks, lg

    a, b = greedy(False), greedy(True)
    assert a[0] == b[0]
    assert max(float((x - y).abs().max()) for x, y in zip(a[1], b[1])) < 1e-4
