"""DeepSeek-V3.2 sparse attention (DSA): our model with the lightning indexer against transformers'
`DeepseekV32ForCausalLM`, fp32 on CPU.

In process (fast): the reference is built in memory by `gpu_service.local.tiny.build_hf_model`, our model
is loaded from its state dict and the routed experts run as a plain torch loop. End to end: tiny
V3.2 checkpoints through `moesplit generate --json` with 2 real shard processes.
Both with index_topk smaller than the sequence (selection matters) and larger (dense)."""
import functools
import json
import os
import subprocess
import sys

import pytest
import torch

from gpu_service.model.experts_api import Ready

from checkpoint.config import ModelConfig
from gpu_service.model.kv import Chunk, KVPool, SeqKV
from gpu_service.model.deepseek import build_model
from gpu_service.model.experts_api import Ready
from gpu_service.local.tiny import build_hf_model, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_NEW = 32
PROMPT = [0] + [(i * 37 + 11) % 500 + 2 for i in range(14)]  # 15 tokens; 47 positions after 32 steps
SPARSE_TOPK, DENSE_TOPK = 6, 256
OVERRIDES = {"index_n_heads": 8, "index_head_dim": 32}  # head_dim > qk_rope_head_dim: rope and pass parts


@functools.lru_cache(maxsize=None)
def _setup(topk: int, seed: int = 0):
    d = tiny_config("deepseek_v32", "bf16", {**OVERRIDES, "index_topk": topk})
    hf = build_hf_model(d, seed)
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    cfg = ModelConfig.from_dict(d)
    model, loaded = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    assert {n for n in loaded if ".indexer." in n} == {n for n in sd if ".indexer." in n}
    I = cfg.moe_intermediate_size

    def experts(layer, h, ids, w):
        gu, dn = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"], sd[f"model.layers.{layer}.mlp.experts.down_proj"]
        h32 = h.float()
        out = torch.zeros_like(h32)
        for t in range(h.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                out[t] += w[t, j] * (dn[e] @ (torch.nn.functional.silu(gu[e, :I] @ h32[t]) * (gu[e, I:] @ h32[t])))
        return Ready(out.to(h.dtype))

    return hf, cfg, model, experts


def _greedy(model, cfg, experts, prompt, n, chunk=None):
    """Greedy decode with our model; prefill in chunks of `chunk` tokens (chunked prefill)."""
    pool = KVPool(cfg, 16, 8, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    seq = SeqKV(pool)
    chunk = chunk or len(prompt)
    for s in range(0, len(prompt), chunk):
        part = prompt[s:s + chunk]
        logits = model(torch.tensor(part), [Chunk(seq, s, len(part))], pool, experts)
    out = []
    for i in range(n):
        out.append(int(logits[0].argmax()))
        if i + 1 == n:
            break
        logits = model(torch.tensor([out[-1]]), [Chunk(seq, seq.length, 1)], pool, experts)
    return out, logits[0]


def _reference(hf, prompt, n):
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                        output_logits=True, return_dict_in_generate=True)
    return g.sequences[0, len(prompt):].tolist(), g.logits[-1][0]


@pytest.fixture(scope="module", params=[SPARSE_TOPK, DENSE_TOPK], ids=["sparse", "dense"])
def setup(request):
    return _setup(request.param)


def test_greedy_and_logits_match_transformers(setup):
    hf, cfg, model, experts = setup
    ref_toks, ref_last = _reference(hf, PROMPT, N_NEW)
    toks, last = _greedy(model, cfg, experts, PROMPT, N_NEW)
    diff = (last - ref_last).abs().max().item()
    print(f"index_topk={cfg.index_topk}: last-logits max|diff| = {diff:.2e}")
    assert toks == ref_toks
    assert diff < 1e-4


def test_chunked_prefill_matches(setup):
    """Chunks with start > 0 and n > 1 select over the cached index keys of earlier chunks."""
    _, cfg, model, experts = setup
    a, la = _greedy(model, cfg, experts, PROMPT, 6)
    b, lb = _greedy(model, cfg, experts, PROMPT, 6, chunk=4)
    assert a == b and (la - lb).abs().max().item() < 1e-4



def test_batched_sequences_select_independently():
    """Two sequences in one batch (prefill chunks together, then decode together) give the same
    logits as each alone: each chunk scores only its own sequence's index keys."""
    _, cfg, model, experts = _setup(SPARSE_TOPK)
    other = [0] + [(i * 53 + 7) % 500 + 2 for i in range(10)]
    alone = [_greedy(model, cfg, experts, p, 3) for p in (PROMPT, other)]
    pool = KVPool(cfg, 16, 8, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    seqs = [SeqKV(pool), SeqKV(pool)]
    logits = model(torch.tensor(PROMPT + other), [Chunk(seqs[0], 0, len(PROMPT)), Chunk(seqs[1], 0, len(other))],
                   pool, experts)
    toks = [[], []]
    for step in range(3):
        for j in range(2):
            toks[j].append(int(logits[j].argmax()))
        if step < 2:
            logits = model(torch.tensor([toks[0][-1], toks[1][-1]]),
                           [Chunk(seqs[0], seqs[0].length, 1), Chunk(seqs[1], seqs[1].length, 1)], pool, experts)
    for j in range(2):
        assert toks[j] == alone[j][0]
        assert (logits[j] - alone[j][1]).abs().max().item() < 1e-4


def test_bfloat16_runs_close_to_float32():
    hf, cfg, model, experts = _setup(SPARSE_TOPK)
    d = tiny_config("deepseek_v32", "bf16", {**OVERRIDES, "index_topk": cfg.index_topk})
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    m16, _ = build_model(ModelConfig.from_dict(d), lambda n: sd[n].numpy(), torch.bfloat16, lambda n: torch.device("cpu"))
    assert m16.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32  # as in transformers
    pool = KVPool(cfg, 16, 8, torch.bfloat16, [torch.device("cpu")] * cfg.num_hidden_layers)
    seq = SeqKV(pool)
    l16 = m16(torch.tensor(PROMPT), [Chunk(seq, 0, len(PROMPT))], pool, experts)
    l16 = m16(torch.tensor([int(l16[0].argmax())]), [Chunk(seq, seq.length, 1)], pool, experts)
    _, l32 = _greedy(model, cfg, experts, PROMPT, 2)
    assert torch.isfinite(l16).all() and (l16[0] - l32).abs().max().item() < 0.5

def test_selection_matters():
    """With index_topk < sequence length the result differs from dense attention (same weights),
    so an indexer that selects everything (or nothing is masked) would fail the comparison."""
    _, cfg_s, sparse, experts = _setup(SPARSE_TOPK)
    _, cfg_d, dense, _ = _setup(DENSE_TOPK)
    _, ls = _greedy(sparse, cfg_s, experts, PROMPT, 4)
    _, ld = _greedy(dense, cfg_d, experts, PROMPT, 4)
    assert (ls - ld).abs().max().item() > 1e-2


def test_index_keys_cached_beside_mla_cache():
    cfg = ModelConfig.from_dict(tiny_config("deepseek_v32", "bf16", OVERRIDES))
    pool = KVPool(cfg, 4, 8, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    assert [tuple(t.shape) for t in pool.index_k] == [(32 + 1, cfg.index_head_dim)] * cfg.num_hidden_layers
    assert pool.bytes() == 4 * (32 + 1) * (cfg.kv_cache_dim + cfg.index_head_dim) * cfg.num_hidden_layers  # + the null slot
    v3 = ModelConfig.from_dict(tiny_config("deepseek_v3", "bf16"))
    assert KVPool(v3, 4, 8, torch.float32, [torch.device("cpu")] * v3.num_hidden_layers).index_k is None


def test_blocked_prefill_scoring_is_identical(setup, monkeypatch):
    """Long prefills score queries in blocks (bounded memory); the result must not change."""
    import gpu_service.model.indexer as ix

    _, cfg, model, experts = setup
    a, la = _greedy(model, cfg, experts, PROMPT, 3)
    monkeypatch.setattr(ix, "SCORE_ELEMS", cfg.index_n_heads * 8)  # a few queries per block
    b, lb = _greedy(model, cfg, experts, PROMPT, 3)
    assert a == b and torch.equal(la, lb)


# ------------------------------------------------------------------ end to end, 2 shard processes
@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    base = tmp_path_factory.mktemp("v32")
    return {name: make_tiny(str(base / name), fmt="bf16", seed=1, overrides={**OVERRIDES, "index_topk": k},
                            arch="deepseek_v32")
            for name, k in (("sparse", SPARSE_TOPK), ("dense", DENSE_TOPK))}


def _generate(model_dir, prompt, n=N_NEW):
    cmd = [sys.executable, "-m", "moesplit", "generate", "--model", model_dir,
           "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(n),
           "--shards", "2", "--json", "--dtype", "float32", "--device", "cpu",
           "--backend", "numpy"]  # fp32 experts: the kernels round activations to bf16 (~5e-3 off)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def generated(ckpts):
    return {name: _generate(d, PROMPT) for name, d in ckpts.items()}


@pytest.mark.parametrize("name", ["sparse", "dense"])
def test_generate_with_shards_matches_transformers(ckpts, generated, name):
    from tests.hf_reference import load_reference

    got = generated[name]
    ref_toks, ref_last = _reference(load_reference(ckpts[name]), PROMPT, N_NEW)
    diff = (torch.tensor(got["last_logits"]) - ref_last).abs().max().item()
    print(f"e2e {name}: last-logits max|diff| = {diff:.2e}")
    assert got["token_ids"] == ref_toks
    assert diff < 1e-4


def test_selection_matters_end_to_end(generated):
    """Same seed, so same weights: only index_topk differs between the two checkpoints."""
    s, d = generated["sparse"], generated["dense"]
    assert s["token_ids"] != d["token_ids"]
    assert (torch.tensor(s["last_logits"]) - torch.tensor(d["last_logits"])).abs().max().item() > 1e-2
