"""The DeepSeek-V4 model (gpu_service.model.v4) on CPU, fp32, against transformers'
DeepseekV4ForCausalLM on tiny seeded Flash-like and Pro-like layer schedules (tests/v4_reference.py):

- pieces against transformers' modules on the same inputs: RoPE frequencies (plain and YaRN), mHC
  (Sinkhorn mixing, stream update, hc_head), each attention type (window only, CSA with the
  indexer, HCA) with sinks and the grouped output, the compressors' entries, the indexer's picks,
  hash and sqrtsoftplus routing, the clamped shared expert and the reference routed experts;
- the whole model: every prompt position's logits within 2e-5 of transformers', greedy tokens
  (64 with the cache, 32 otherwise) equal to transformers' generate on a prompt longer than the
  window and than several CSA and HCA blocks, decoding with the cache, by recompute, and after a
  prefill in chunks smaller than a compression block; a batch mixing prompt chunks and decode
  tokens of three sequences gives each its alone run's tokens; bf16 runs close to fp32;
- loading: every non-expert checkpoint tensor used, a wrong shape named, the real Flash / Pro
  configs build the checkpoint's shapes.
"""
import functools
import os

import pytest
import torch

from checkpoint.config_v4 import load_v4_config
from gpu_service.attention.sink_torch import complete_entries
from gpu_service.model.v4.attention import AttnState
from gpu_service.model.v4.compressor import CompressorState
from gpu_service.model.v4.model import build_v4, DeepseekV4, greedy
from gpu_service.model.v4.moe import ReferenceExperts
from gpu_service.model.v4.pieces import hc_head, hc_post, hc_pre, v4_ropes
from tests.v4_reference import original_state_dict, runtime_config, tiny_v4

SCHEDULES = ["flash", "pro"]
PROMPT_LEN = 100  # window 8, CSA entries 25 (top-3 picked), HCA (16) entries 6
TOL = 2e-5


@functools.lru_cache(maxsize=None)
def _setup(schedule: str):
    """(transformers model, original state dict, runtime config, our model, names loaded, experts)."""
    hf = tiny_v4(schedule)
    sd = original_state_dict(hf)
    cfg = runtime_config(schedule)
    model, loaded = build_v4(cfg, sd.__getitem__)
    experts = ReferenceExperts(sd.__getitem__, cfg.n_routed_experts, cfg.swiglu_limit)
    return hf, sd, cfg, model, loaded, experts


def _prompt(n: int = PROMPT_LEN, seed: int = 3) -> torch.Tensor:
    """A seeded prompt of n token ids (no BOS / EOS)."""
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed))


def _x(n: int, d: int, seed: int = 7) -> torch.Tensor:
    """Seeded hidden states [n, d]."""
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed))


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = TOL) -> None:
    """Assert max |a - b| < tol."""
    err = (a - b).abs().max().item()
    assert err < tol, f"differs from transformers by {err}"


# ---- pieces ---------------------------------------------------------------------------------------
def test_rope_frequencies_equal_transformers():
    hf, _, cfg, *_ = _setup("flash")
    ropes = v4_ropes(cfg)
    for kind in ("main", "compress"):
        want = getattr(hf.model.rotary_emb, f"{kind}_inv_freq")
        _close(ropes[kind].inv_freq, want, 1e-9)
        assert hf.model.rotary_emb.__dict__.get(f"{kind}_attention_scaling", 1.0) == 1.0
    assert not torch.allclose(ropes["main"].inv_freq, ropes["compress"].inv_freq)  # two bases + YaRN


def test_mhc_equals_transformers():
    hf, sd, cfg, model, *_ = _setup("flash")
    X = torch.randn(6, cfg.hc_mult, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ref_layer, blk = hf.model.layers[1], model.layers[1]
    post_r, comb_r, col_r = ref_layer.attn_hc(X[None])
    col, post, comb = hc_pre(X, blk.hc_attn_fn, blk.hc_attn_base, blk.hc_attn_scale, cfg)
    _close(col, col_r[0], 1e-6)
    _close(post, post_r[0], 1e-6)
    _close(comb, comb_r[0], 1e-6)
    assert torch.allclose(comb.sum(-1), torch.ones(()), atol=1e-3)  # Sinkhorn: doubly stochastic
    y = torch.randn(6, cfg.hidden_size)
    want = post_r.unsqueeze(-1) * y[None].unsqueeze(-2) + torch.matmul(comb_r.transpose(-1, -2), X[None])
    _close(hc_post(X, y, post, comb), want[0], 1e-6)
    head = hc_head(X, model.hc_head_fn, model.hc_head_base, model.hc_head_scale, cfg)
    _close(head, hf.model.hc_head(X[None])[0], 1e-6)


def _hf_attention(hf, layer: int, x: torch.Tensor) -> torch.Tensor:
    """transformers' attention of `layer` over x [n, D] (one-shot, no cache), its own masks."""
    n, window = x.shape[0], hf.config.sliding_window
    pos = torch.arange(n)[None]
    pe = {k: hf.model.rotary_emb(x[None], position_ids=pos, layer_type=k) for k in ("main", "compress")}
    d = pos[0][:, None] - pos[0][None, :]
    mask = torch.zeros(n, n).masked_fill((d < 0) | (d >= window), float("-inf"))[None, None]
    return hf.model.layers[layer].self_attn(x[None], pe, pos, mask)[0][0]


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_each_attention_type_equals_transformers(schedule):
    """Window-only, CSA and HCA layers (sinks, grouped output, compressed entries, indexer picks)."""
    hf, _, cfg, model, *_ = _setup(schedule)
    x = _x(PROMPT_LEN, cfg.hidden_size)
    for i, blk in enumerate(model.layers):
        with torch.no_grad():
            _close(blk.attn(x, torch.arange(PROMPT_LEN), AttnState()), _hf_attention(hf, i, x))


def test_compressors_and_indexer_equal_transformers():
    hf, _, cfg, model, *_ = _setup("flash")
    x = _x(PROMPT_LEN, cfg.hidden_size)
    pos = torch.arange(PROMPT_LEN)
    pe_pos = pos[None]
    with torch.no_grad():
        for i in (2, 3):  # CSA, HCA
            ours = model.layers[i].attn
            ref = hf.model.layers[i].self_attn
            want, _ = ref.compressor(x[None], ref.q_a_norm(ref.q_a_proj(x[None])), pe_pos, None, i)
            st = CompressorState()
            entries = st.store.read(ours.compressor.extend(x, st), x)
            assert entries.shape[0] == PROMPT_LEN // ours.ratio
            _close(entries, want[0, 0], 1e-6)
        ours, ref = model.layers[2].attn, hf.model.layers[2].self_attn
        qr = ours.q_norm.norm(ours.wq_a(x))
        want = ref.compressor.indexer(x[None], qr[None], pe_pos, None, 2)[0]
        picks = ours.indexer.pick(x, qr, pos, CompressorState())
    assert torch.equal(picks.sort(-1).values, want.sort(-1).values)
    ready = complete_entries(pos, 4)
    assert ((picks >= 0).sum(-1) == ready.clamp(max=cfg.index_topk)).all()
    assert (ready[-1] > cfg.index_topk) and (picks[-1] >= 0).all()  # the last query chose among 25


def test_query_blocks_give_the_same_picks_and_attention(monkeypatch):
    """The indexer's query blocks and the attention's (a CSA query's gathered picks, an HCA layer's
    masked entries) change nothing: block sizes 1 and 7 against one block of every query."""
    from gpu_service.model.v4 import attention as A

    _, _, cfg, model, *_ = _setup("flash")
    x, pos = _x(PROMPT_LEN, cfg.hidden_size), torch.arange(PROMPT_LEN)
    with torch.no_grad():
        ours = model.layers[2].attn
        qr = ours.q_norm.norm(ours.wq_a(x))
        whole = ours.indexer.pick(x, qr, pos, CompressorState(), block=PROMPT_LEN)
        assert (whole >= 0).any()
        for block in (1, 7):
            assert torch.equal(ours.indexer.pick(x, qr, pos, CompressorState(), block=block), whole)
        for i in (2, 3):  # CSA, HCA
            monkeypatch.setattr(A, "ATTN_BLOCK", PROMPT_LEN)
            want = model.layers[i].attn(x, pos, AttnState())
            for block in (1, 7):
                monkeypatch.setattr(A, "ATTN_BLOCK", block)
                _close(model.layers[i].attn(x, pos, AttnState()), want, 1e-6)


def test_routers_experts_and_shared_expert_equal_transformers():
    hf, sd, cfg, model, _, experts = _setup("flash")
    h = _x(40, cfg.hidden_size)
    tokens = _prompt(40)
    for i in (0, 3):  # hash, sqrtsoftplus + bias
        ref = hf.model.layers[i].mlp
        ours = model.layers[i].ffn
        with torch.no_grad():
            if ref.is_hash:
                _, w_r, ids_r = ref.gate(h, tokens)
            else:
                _, w_r, ids_r = ref.gate(h)
            ids, w = ours.gate.route(h, tokens)
            order, order_r = ids.argsort(-1), ids_r.argsort(-1)
            assert torch.equal(ids.gather(1, order), ids_r.gather(1, order_r))
            _close(w.gather(1, order), w_r.gather(1, order_r), 1e-6)
            _close(experts(i, h, ids, w).wait(), ref.experts(h, ids_r, w_r), 1e-6)
            _close(ours.shared_experts(h), ref.shared_experts(h), 1e-6)
    assert ours.gate.hashed is False and model.layers[0].ffn.gate.hashed is True
    clamped = (ours.shared_experts.w1(h) > cfg.swiglu_limit).any()
    assert clamped, "the test's swiglu_limit must clamp some pre-activations"


# ---- the whole model ------------------------------------------------------------------------------
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_prefill_logits_equal_transformers(schedule):
    hf, _, cfg, model, _, experts = _setup(schedule)
    ids = _prompt()
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    got = model(ids, model.new_cache(), experts, all_logits=True)
    _close(got, want)
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@functools.lru_cache(maxsize=None)
def _hf_greedy(schedule: str, steps: int) -> list[int]:
    """transformers' generate (greedy, its own cache, EOS not stopping) after the test prompt."""
    hf = _setup(schedule)[0]
    ids = _prompt()[None]
    out = hf.generate(ids, max_new_tokens=steps, do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("mode", ["cache", "recompute", "chunk3", "chunk7"])
def test_greedy_tokens_equal_transformers_generate(schedule, mode):
    """64 tokens with the cache; 32 by recompute and after a prefill in chunks of 3 (under a CSA
    block) or 7."""
    _, _, cfg, model, _, experts = _setup(schedule)
    chunk = int(mode[5:]) if mode.startswith("chunk") else None
    steps = 64 if mode == "cache" else 32
    got = greedy(model, _prompt().tolist(), steps, experts, chunk=chunk, recompute=mode == "recompute")
    assert PROMPT_LEN > 4 * cfg.sliding_window and PROMPT_LEN // 4 > 4 * cfg.index_topk
    assert got == _hf_greedy(schedule, 64)[:steps]


def test_mixed_batch_steps_equal_alone_runs():
    """Three sequences in one step each time: prompt chunks of one beside decode tokens of others
    (chunks of 5 and 13 cross CSA and HCA block ends); each decodes the tokens of its alone run
    (and the first, transformers' generate)."""
    _, _, cfg, model, _, experts = _setup("flash")
    prompts = [_prompt().tolist(), _prompt(37, seed=4).tolist(), _prompt(61, seed=5).tolist()]
    sizes = [PROMPT_LEN, 5, 13]
    steps = 12
    alone = [greedy(model, p, steps, experts) for p in prompts]
    assert alone[0] == _hf_greedy("flash", 64)[:steps]
    caches = [model.new_cache() for _ in prompts]
    fed, out = [0] * 3, [[] for _ in prompts]
    while any(len(o) < steps for o in out):
        batch, who = [], []
        for j, p in enumerate(prompts):
            if fed[j] < len(p):
                batch.append((torch.tensor(p[fed[j]:fed[j] + sizes[j]]), caches[j]))
                fed[j] = min(len(p), fed[j] + sizes[j])
            elif len(out[j]) < steps:
                batch.append((torch.tensor(out[j][-1:]), caches[j]))
            else:
                continue
            who.append(j)
        for j, logits in zip(who, model.forward_batch(batch, experts)):
            if fed[j] == len(prompts[j]) and len(out[j]) < steps:
                out[j].append(int(logits.argmax()))
    assert out == alone
    assert len(set(map(tuple, out))) == 3


def test_cache_holds_the_window_and_the_entries():
    _, _, cfg, model, _, experts = _setup("flash")
    cache = model.new_cache()
    model(_prompt(), cache, experts)
    for blk, st in zip(model.layers, cache.layers):
        assert st.keys.shape[0] == cfg.sliding_window - 1 and st.length == PROMPT_LEN
        if blk.attn.ratio:
            assert st.comp.count == PROMPT_LEN // blk.attn.ratio
            assert st.comp.pending == PROMPT_LEN % blk.attn.ratio and st.comp.buf_kv.shape[0] == blk.attn.ratio
            assert st.comp.store.read(st.comp.count, st.keys).shape == (st.comp.count, cfg.head_dim)
        else:
            assert st.comp.count == 0 and st.comp.store.t is None


def test_bfloat16_runs_close_to_float32():
    """bf16 weights (mixing, sinks, ape and the gate kept float32, as the reference keeps them): the
    prompt's next-token choices mostly those of fp32 (not compared with transformers in bf16)."""
    _, sd, cfg, m32, _, experts = _setup("flash")
    m16, _ = build_v4(cfg, sd.__getitem__, dtype=torch.bfloat16)
    assert m16.layers[2].ffn.gate.weight.dtype == torch.float32
    assert m16.layers[2].attn.wq_a.weight.dtype == torch.bfloat16
    ids = _prompt()
    a = m32(ids, m32.new_cache(), experts, all_logits=True)
    b = m16(ids, m16.new_cache(), experts, all_logits=True)
    assert torch.isfinite(b).all()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.85


# ---- loading --------------------------------------------------------------------------------------
def test_every_non_expert_tensor_is_loaded():
    _, sd, cfg, _, loaded, _ = _setup("pro")
    assert loaded == {n for n in sd if ".ffn.experts." not in n}
    assert any(n.endswith("tid2eid") for n in loaded) and any(n.endswith("indexer.wq_b.weight") for n in loaded)


def test_a_wrong_shape_is_named():
    _, sd, cfg, *_ = _setup("pro")
    bad = dict(sd)
    bad["layers.1.attn.attn_sink"] = torch.zeros(3)
    with pytest.raises(ValueError, match="layers.1.attn.attn_sink"):
        build_v4(cfg, bad.__getitem__)


CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "model-configs")


@pytest.mark.parametrize("name,shapes", [
    ("deepseek-v4-flash", {"layers.2.attn.compressor.wkv.weight": (1024, 4096),
                           "layers.3.attn.compressor.ape": (128, 512),
                           "layers.2.attn.indexer.wq_b.weight": (8192, 1024), "layers.0.attn.wo_a.weight": (8192, 4096),
                           "layers.0.hc_attn_fn": (24, 16384), "layers.2.ffn.gate.tid2eid": (129280, 6)}),
    ("deepseek-v4-pro", {"layers.0.attn.compressor.wkv.weight": (512, 7168), "layers.60.attn.indexer.wq_b.weight":
                         (8192, 1536), "layers.0.attn.wo_a.weight": (16384, 4096), "layers.3.ffn.gate.bias": (384,)}),
])
def test_real_configs_build_the_checkpoint_shapes(name, shapes):
    """The real config.json (original keys) builds (on the meta device) with the checkpoint's shapes."""
    path = os.path.join(CONFIGS, name + ".json")
    if not os.path.exists(path):
        pytest.skip(f"{path} is not in this checkout")
    cfg = load_v4_config(path)
    with torch.device("meta"):
        model = DeepseekV4(cfg)
    have = {n: tuple(t.shape) for n, t in list(model.named_parameters()) + list(model.named_buffers())}
    assert {n: have.get(n) for n in shapes} == shapes
    window_only = [i for i, b in enumerate(model.layers) if b.attn.compressor is None]
    assert window_only == ([0, 1] if "flash" in name else [])
