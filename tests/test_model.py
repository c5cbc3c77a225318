"""Our PyTorch model (in process, experts computed by a plain torch loop) against transformers'
DeepseekV3ForCausalLM built in memory, plus the compressed-cache invariants."""
import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from checkpoint.config import ModelConfig
from gpu_service.model.kv import Chunk, KVPool, SeqKV
from gpu_service.model.deepseek import build_model
from gpu_service.model.experts_api import Ready

BASE = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=512, hidden_size=96,
            intermediate_size=160, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, first_k_dense_replace=1,
            n_shared_experts=1, q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
            v_head_dim=16, routed_scaling_factor=2.5, max_position_embeddings=1024, rope_theta=10000.0,
            rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                          "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            rms_norm_eps=1e-6, initializer_range=0.15, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
VARIANTS = {
    "grouped_yarn": {},
    "no_q_lora_no_yarn_kimi_groups": {"q_lora_rank": None, "rope_scaling": None, "n_group": 1, "topk_group": 1,
                                      "first_k_dense_replace": 2, "n_shared_experts": 2, "num_hidden_layers": 4},
}


def _setup(over):
    d = {**BASE, **over}
    torch.manual_seed(0)
    hf = DeepseekV3ForCausalLM(DeepseekV3Config(**d)).eval()
    with torch.no_grad():
        for n, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if "e_score_correction_bias" in n:
                p.normal_(0, 0.1)
            elif "norm" in n:
                p.normal_(1, 0.1)
    sd = {k: v.float() for k, v in hf.state_dict().items()}
    cfg = ModelConfig.from_dict(d)
    model, loaded = build_model(cfg, lambda n: sd[n].numpy(), torch.float32, lambda n: torch.device("cpu"))
    I = cfg.moe_intermediate_size

    def experts(layer, h, ids, w):
        gu, dn = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"], sd[f"model.layers.{layer}.mlp.experts.down_proj"]
        out = torch.zeros_like(h)
        for t in range(h.shape[0]):
            for j in range(ids.shape[1]):
                e = int(ids[t, j])
                out[t] += w[t, j] * (dn[e] @ (torch.nn.functional.silu(gu[e, :I] @ h[t]) * (gu[e, I:] @ h[t])))
        return Ready(out)

    return hf, cfg, model, experts


@pytest.fixture(scope="module", params=list(VARIANTS))
def setup(request):
    return _setup(VARIANTS[request.param])


def _greedy(model, cfg, experts, prompt, n, chunk=None):
    pool = KVPool(cfg, 16, 8, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    seq = SeqKV(pool)
    chunk = chunk or len(prompt)
    for s in range(0, len(prompt), chunk):
        logits = model(torch.tensor(prompt[s:s + chunk]), [Chunk(seq, s, len(prompt[s:s + chunk]))], pool, experts)
    out, lg = [], []
    for i in range(n):
        lg.append(logits[0])
        out.append(int(logits[0].argmax()))
        if i + 1 < n:
            logits = model(torch.tensor([out[-1]]), [Chunk(seq, seq.length, 1)], pool, experts)
    seq.free()
    assert pool.pages_in_use == 0
    return out, lg


def test_greedy_tokens_and_logits_match_transformers(setup):
    hf, cfg, model, experts = setup
    prompt = torch.randint(2, 512, (13,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False, output_logits=True,
                          return_dict_in_generate=True)
    ref_toks = ref.sequences[0, len(prompt):].tolist()
    toks, lg = _greedy(model, cfg, experts, prompt, len(ref_toks))
    assert toks == ref_toks
    diffs = [float((a - b[0]).abs().max()) for a, b in zip(lg, ref.logits)]
    assert max(diffs) < 1e-4, diffs


def test_incremental_decode_equals_full_recompute_and_chunked_prefill(setup):
    _, cfg, model, experts = setup
    prompt = list(range(3, 23))
    toks, lg = _greedy(model, cfg, experts, prompt, 10)
    toks_chunked, lg_chunked = _greedy(model, cfg, experts, prompt, 10, chunk=7)
    assert toks_chunked == toks
    assert max(float((a - b).abs().max()) for a, b in zip(lg, lg_chunked)) < 1e-4
    pool = KVPool(cfg, 16, 8, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    full = prompt + toks[:-1]
    all_logits = model(torch.tensor(full), [Chunk(SeqKV(pool), 0, len(full))], pool, experts, all_logits=True)
    for i in range(10):  # the logits that chose toks[i] = full recompute at position len(prompt)-1+i
        assert float((all_logits[len(prompt) - 1 + i] - lg[i]).abs().max()) < 1e-4


def test_batched_sequences_equal_alone(setup):
    _, cfg, model, experts = setup
    pa, pb = list(range(5, 17)), list(range(40, 45))
    alone = [_greedy(model, cfg, experts, p, 1)[1][0] for p in (pa, pb)]
    pool = KVPool(cfg, 16, 8, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    sa, sb = SeqKV(pool), SeqKV(pool)
    both = model(torch.tensor(pa + pb), [Chunk(sa, 0, len(pa)), Chunk(sb, 0, len(pb))], pool, experts)
    for got, want in zip(both, alone):
        assert float((got - want).abs().max()) < 1e-4


def test_blocked_prefill_attention_equals_one_block(setup):
    """The expanded prefill path attends over key blocks with an online softmax (bounded
    workspace); many small blocks give the same result as one block."""
    _, cfg, model, experts = setup
    prompt = list(range(3, 40))
    one = _greedy(model, cfg, experts, prompt, 6)
    try:
        for blk in model.model.layers:
            blk.self_attn.key_block = 5
        many = _greedy(model, cfg, experts, prompt, 6)
    finally:
        for blk in model.model.layers:
            blk.self_attn.key_block = 2048
    assert one[0] == many[0]
    assert max(float((a - b).abs().max()) for a, b in zip(one[1], many[1])) < 1e-4


def test_ping_pong_micro_batches_overlap_and_match(setup):
    """With two sequences the batch runs as two micro-batches: micro-batch 1's attention and
    send happen while micro-batch 0's experts are remote; outputs equal the single batch."""
    _, cfg, model, experts = setup
    events = []

    def recording(layer, h, ids, w):
        events.append(("send", layer, h.shape[0]))
        handle = experts(layer, h, ids, w)

        class Recorded:
            def wait(self):
                events.append(("wait", layer, h.shape[0]))
                return handle.wait()

        return Recorded()

    pa, pb = list(range(5, 17)), list(range(40, 49))
    outs = {}
    for pp in (False, True):
        model.ping_pong = pp
        pool = KVPool(cfg, 16, 8, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
        events.clear()
        outs[pp] = model(torch.tensor(pa + pb), [Chunk(SeqKV(pool), 0, len(pa)), Chunk(SeqKV(pool), 0, len(pb))],
                         pool, recording)
        if pp:
            first = cfg.moe_layers[0]
            assert events[:3] == [("send", first, len(pa)), ("send", first, len(pb)), ("wait", first, len(pa))]
        else:
            assert events[:2] == [("send", cfg.moe_layers[0], len(pa) + len(pb)), ("wait", cfg.moe_layers[0], len(pa) + len(pb))]
    model.ping_pong = True
    assert float((outs[True] - outs[False]).abs().max()) < 1e-5
