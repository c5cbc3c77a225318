"""The native decode step (gpu_service.model.native_decode, C in native_decode.c) on the tiny
DeepSeek-V3 model, CPU float32 (what `moesplit serve` runs on CPU by default):

- 32 greedy decode steps of 3 sequences: native == the plain per-sequence reference and == the torch
  fused step (tokens equal, logits within 1e-5), and every layer of every step ran natively, for
  DeepSeek-V3 and V3.2 (the lightning indexer's top-k selection in C);
- a sequence's logits are bit-identical alone or in any batch, with and without ping-pong;
- variants (no q_lora, one expert group, unnormalised top-k, half-split RoPE) equal the reference;
- the router's group-limited top-k equals deepseek.Router on 256 random rows (ids and weights);
- what the C code cannot run (int8 attention, a large layer with torch threads) takes the torch
  path, and the runner's 'fused' decode path turns the native one off.
"""
import pytest
import torch

from gpu_service.model import native_decode as nd
from gpu_service.model.kv import KVPool
from tests.test_fast_decode import decode_step_from_prefilled, PROMPTS, _row_independent_experts
from tests.test_paged_attention import _setup, ARCHS, greedy_decode, PAGE

pytestmark = pytest.mark.skipif(not nd.available(), reason="gpu_service.model._native_decode is not built (make build)")


def _row_experts(layer, h, ids, w):
    """Row-wise like the real experts, and like them independent of the order of a row's k picks
    (the C router lists them by score, torch's topk(sorted=False) in its own order)."""
    out = h * 0.5 + (w * (ids + 1)).sum(-1, keepdim=True) * 0.01
    return lambda: out


@pytest.fixture
def count_native(monkeypatch):
    """Counts the layers run by native_decode.block_steps."""
    calls = {"n": 0}
    real = nd.block_steps

    def spy(*a, **kw):
        calls["n"] += 1
        return (yield from real(*a, **kw))
    monkeypatch.setattr(nd, "block_steps", spy)
    return calls


@pytest.mark.parametrize("arch", ARCHS)
def test_native_decode_32_steps_equal_plain_and_fused(arch, count_native):
    """V3.2 (index_topk 6): most steps select keys (the prompts and the steps outgrow 6)."""
    cfg, model, experts = _setup(arch)
    plain = greedy_decode(model, cfg, experts, PROMPTS[:3], 32, batched=False)
    fused = greedy_decode(model, cfg, experts, PROMPTS[:3], 32, native=False)
    assert count_native["n"] == 0
    native = greedy_decode(model, cfg, experts, PROMPTS[:3], 32)
    # 32 decode steps, two ping-pong micro-batches each, every layer (the prefill runs the torch path)
    assert count_native["n"] == 32 * 2 * cfg.num_hidden_layers
    assert native[0] == plain[0] == fused[0]
    for ref in (plain, fused):
        err = max(float((a - b).abs().max()) for a, b in zip(ref[1], native[1]))
        assert err < 1e-5, f"native decode logits differ by {err}"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("ping_pong", [True, False])
def test_native_decode_bit_identical_alone_or_batched(ping_pong, arch, count_native):
    cfg, model, _ = _setup(arch)
    step, n = decode_step_from_prefilled(cfg, model)
    model.ping_pong = ping_pong
    try:
        together = step(list(range(n)))
        for i in range(n):
            assert torch.equal(step([i])[0], together[i]), f"sequence {i}'s logits depend on its neighbours"
        for order in ([5, 0, 3], [2, 1]):
            got = step(order)
            for j, i in enumerate(order):
                assert torch.equal(got[j], together[i])
    finally:
        model.ping_pong = True
    assert count_native["n"] > 0


def _model(over: dict, arch: str = "deepseek_v3"):
    from checkpoint.config import ModelConfig
    from gpu_service.local.tiny import build_hf_model, tiny_config
    from gpu_service.model.deepseek import build_model

    d = tiny_config(arch, "bf16", over)
    sd = {k: v.float() for k, v in build_hf_model(d, 0).state_dict().items()}
    cfg = ModelConfig.from_dict(d)
    return cfg, sd, build_model


@pytest.mark.parametrize("over", [{"q_lora_rank": None}, {"n_group": 1, "topk_group": 1},
                                  {"norm_topk_prob": False, "routed_scaling_factor": 2.5}, {"rope_interleave": False}],
                         ids=["no-q-lora", "one-group", "unnormalised", "half-split-rope"])
def test_native_decode_variants_equal_plain(over, count_native):
    cfg, sd, build_model = _model(over)
    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    plain = greedy_decode(model, cfg, _row_experts, PROMPTS[:3], 8, batched=False)
    native = greedy_decode(model, cfg, _row_experts, PROMPTS[:3], 8)
    assert count_native["n"] == 8 * 2 * cfg.num_hidden_layers
    assert native[0] == plain[0]
    assert max(float((a - b).abs().max()) for a, b in zip(plain[1], native[1])) < 1e-5


@pytest.mark.parametrize("topk", [5, 64])
def test_v32_selection_over_long_contexts_equals_plain(topk, count_native):
    """Contexts of 70-136 keys (many pages) and index_topk 5 / 64: the C top-k selection and
    attention over the selected keys give the plain path's tokens and logits."""
    over = {"index_n_heads": 8, "index_head_dim": 32, "index_topk": topk}
    cfg, sd, build_model = _model(over, "deepseek_v32")
    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    prompts = [[(7 * i + 3 * j) % 500 + 4 for j in range(n)] for i, n in enumerate((70, 100, 130))]
    plain = greedy_decode(model, cfg, _row_experts, prompts, 6, batched=False)
    native = greedy_decode(model, cfg, _row_experts, prompts, 6)
    assert count_native["n"] == 6 * 2 * cfg.num_hidden_layers
    assert native[0] == plain[0]
    assert max(float((a - b).abs().max()) for a, b in zip(plain[1], native[1])) < 1e-5


def test_router_equals_the_reference_router():
    """nd_attn's routing on 256 random rows against deepseek.Router on the h it returns."""
    cfg, model, _ = _setup("deepseek_v3")
    blocks = nd.native_blocks(model)
    i = cfg.first_k_dense_replace
    nb, moe = blocks[i], model.model.layers[i].mlp
    B, H = 256, cfg.hidden_size
    g = torch.Generator().manual_seed(3)
    x = torch.randn(B, H, generator=g) * 3
    pool = KVPool(cfg, 64, PAGE, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    kv = pool.kv[i]
    smax = 1
    ks = torch.arange(B, dtype=torch.int64)[:, None].contiguous()  # each row attends its own new key
    lengths = torch.ones(B, dtype=torch.int64)
    cos, sin = torch.ones(B, cfg.qk_rope_head_dim // 2), torch.zeros(B, cfg.qk_rope_head_dim // 2)
    scratch = torch.empty(nb.c.scratch_floats(B, smax))
    st = nd._c.Step(B, smax, ks.data_ptr(), ks.data_ptr(), lengths.data_ptr(), cos.data_ptr(), sin.data_ptr(),
                    scratch.data_ptr())
    x1, h = torch.empty(B, H), torch.empty(B, H)
    ids, w = torch.empty(B, cfg.num_experts_per_tok, dtype=torch.int64), torch.empty(B, cfg.num_experts_per_tok)
    nb.c.attn(st, kv.data_ptr(), 0, x.data_ptr(), x1.data_ptr(), h.data_ptr(), ids.data_ptr(), w.data_ptr())
    with torch.inference_mode():
        rid, rw = moe.gate(h)
    got = {(b, int(e)): float(v) for b in range(B) for e, v in zip(ids[b], w[b])}
    ref = {(b, int(e)): float(v) for b in range(B) for e, v in zip(rid[b], rw[b])}
    assert got.keys() == ref.keys(), "selected experts differ"
    assert max(abs(got[k] - ref[k]) for k in ref) < 1e-5
    choice = (h @ moe.gate.weight.t()).sigmoid() + moe.gate.e_score_correction_bias
    picked = choice.gather(1, ids)
    assert bool((picked[:, :-1] >= picked[:, 1:]).all())  # listed by the selection score, best first


def test_what_native_cannot_run_takes_the_torch_path(monkeypatch, count_native):
    cfg, sd, build_model = _model({})
    q8, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"),
                        linear_format=lambda n: "int8" if "self_attn" in n and n.endswith("proj.weight") else None)
    assert nd.native_blocks(q8) is None
    greedy_decode(q8, cfg, _row_independent_experts, PROMPTS[:2], 2)
    assert count_native["n"] == 0 and len(q8.__dict__["_fast_blocks"]) == cfg.num_hidden_layers

    model, _ = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    assert nd.native_blocks(model) is not None
    monkeypatch.setattr(nd, "NATIVE_MAX_LAYER_BYTES", 0)  # every layer "large"
    model.__dict__.pop("_native_blocks")
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert nd.native_blocks(model) is None  # a large layer and torch threads: torch's threaded GEMMs
        torch.set_num_threads(1)
        assert nd.native_blocks(model) is not None  # one torch thread: C is never slower
    finally:
        torch.set_num_threads(threads)


def test_v32_runs_natively():
    cfg, model, experts = _setup("deepseek_v32")
    blocks = nd.native_blocks(model)
    assert blocks is not None and all(b.keep for b in blocks)


def test_runner_fused_path_turns_native_off(tmp_path):
    from checkpoint.reader import CheckpointReader
    from gpu_service.local.tiny import make_tiny
    from gpu_service.runtime.runner import ModelRunner

    make_tiny(str(tmp_path), "bf16", seed=0)
    r = ModelRunner(CheckpointReader(str(tmp_path)), _row_independent_experts, device=torch.device("cpu"))
    assert r.model.native_decode and r.decode_path == "fast"
    r.set_decode_path("fused")
    assert not r.model.native_decode and r.model.batched_attention
    r.set_decode_path("plain")
    assert not r.model.batched_attention
    with pytest.raises(ValueError, match="fused"):
        r.set_decode_path("native")
