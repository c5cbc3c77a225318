"""transformers' DeepseekV4ForCausalLM as the DeepSeek-V4 oracle, two ways (tests only; the runtime
never imports transformers).

From a checkpoint on disk: `load_reference_v4(dir)` dequantises a V4 checkpoint (original names, FP8 / MXFP4 with `.scale`)
to float32 under the same original names, writes them with a transformers config built from
checkpoint.config_v4.V4Config, and loads that directory with `DeepseekV4ForCausalLM.from_pretrained`,
so transformers' own conversion mapping (conversion_mapping.py "deepseek_v4": renames, experts
merged into gate_up_proj / down_proj) consumes the names. Loading info is checked: nothing missing,
nothing unexpected, nothing mismatched (the `mtp.` tensors, which transformers does not build, are
left out of the copy and counted apart).

From a seeded config in memory: `tiny_v4(schedule)` builds a `DeepseekV4ForCausalLM` in fp32 from a small config whose window,
compression rates and indexer top-k are small enough that a ~100-token prompt crosses the window,
several CSA blocks (the indexer selects) and several HCA blocks. Parameters transformers
initialises to zeros or ones (sinks, mHC bases, `position_bias`, correction bias, norms, `tid2eid`)
are redrawn so that every piece of the math acts. `original_state_dict(hf)` renames transformers'
parameters to the checkpoint's (the inverse of its conversion mapping) and splits the fused
experts back into `ffn.experts.K.w1/w2/w3`.
"""
from __future__ import annotations

import os
import re
import tempfile
import numpy as np
import torch

from checkpoint import names_v4 as N4
from checkpoint.config_v4 import CSA_RATIO, V4Config
from checkpoint.reader import CheckpointReader


def hf_v4_config(cfg: V4Config):
    """transformers.DeepseekV4Config with transformers' key names, from our typed config."""
    import transformers

    hca = sorted({r for r in cfg.compress_ratios if r not in (0, CSA_RATIO)})
    if len(hca) > 1:
        raise ValueError(f"transformers' DeepseekV4Config has one HCA rate; this config has {hca}")
    kind = {"window": "sliding_attention", "csa": "compressed_sparse_attention", "hca": "heavily_compressed_attention"}
    rs = dict(cfg.rope_scaling or {})
    compress = {"rope_type": rs.pop("type", "default"), **rs, "rope_theta": cfg.compress_rope_theta,
                "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim}
    if compress["rope_type"] == "yarn":
        compress["attention_factor"] = 1.0  # the reference applies no mscale
    return transformers.DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=1, head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank,
        num_experts_per_tok=cfg.num_experts_per_tok, n_routed_experts=cfg.n_routed_experts,
        n_shared_experts=cfg.n_shared_experts, scoring_func=cfg.scoring_func, norm_topk_prob=cfg.norm_topk_prob,
        routed_scaling_factor=cfg.routed_scaling_factor, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        layer_types=[kind[k] for k in cfg.layer_kinds],
        compress_rates={"compressed_sparse_attention": CSA_RATIO,
                        "heavily_compressed_attention": hca[0] if hca else 128},
        mlp_layer_types=["hash_moe" if cfg.is_hash_layer(i) else "moe" for i in range(cfg.num_hidden_layers)],
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.sliding_window, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, num_nextn_predict_layers=cfg.num_nextn_predict_layers,
        rms_norm_eps=cfg.rms_norm_eps, bos_token_id=cfg.bos_token_id,
        eos_token_id=list(cfg.eos_token_ids) if len(cfg.eos_token_ids) > 1 else (cfg.eos_token_ids or (None,))[0],
        tie_word_embeddings=cfg.tie_word_embeddings, partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim,
        rope_parameters={"main": {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                  "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim},
                         "compress": compress},
        architectures=["DeepseekV4ForCausalLM"],
    )


def dequantised_copy(model_dir: str, out_dir: str) -> dict:
    """Every non-MTP tensor of `model_dir` as float32 (int64 kept) under its original name, written to
    out_dir with transformers' config; returns {"written": names, "mtp": names}."""
    from safetensors.numpy import save_file

    r = CheckpointReader(model_dir, any_architecture=True)
    cfg = r.config
    if not cfg.is_v4:
        raise ValueError(f"{model_dir} is not a DeepSeek-V4 checkpoint")
    tensors, mtp = {}, []
    for name in r.names(include_mtp=True):
        if N4.is_mtp(name):
            mtp.append(name)
            continue
        st = r.get_stored(name)
        tensors[name] = np.ascontiguousarray(st.data) if st.format == "i64" else r.get(name)
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    hf_v4_config(cfg).save_pretrained(out_dir)
    return {"written": sorted(tensors), "mtp": sorted(mtp)}


def load_reference_v4(model_dir: str, *, check: bool = True):
    """fp32 transformers DeepseekV4ForCausalLM (eval) with the checkpoint's dequantised weights.

    check=True asserts transformers' loading info is clean (no missing, unexpected or mismatched
    tensor). Returns the model; `model.moesplit_loading` holds the loading info and the names."""
    import torch
    import transformers

    with tempfile.TemporaryDirectory(prefix="v4ref-") as tmp:
        names = dequantised_copy(model_dir, tmp)
        model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, output_loading_info=True)
    if check:
        bad = {k: v for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
        if bad:
            raise AssertionError(f"transformers did not load {model_dir} cleanly: {bad}")
    model = model.float().eval()
    model.moesplit_loading = {**info, **names}
    return model


# ---- seeded in memory --------------------------------------------------------------------------
SCHEDULES = {
    # per layer: 0 window only, 4 CSA, HCA_RATE HCA (real Flash: 0, 0, then 4 / 128 alternating;
    # real Pro: 128, 128, then 4 / 128 alternating)
    "flash": [0, 0, 4, 16, 4],
    "pro": [16, 16, 4, 16, 4],
}
HCA_RATE = 16
_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", HCA_RATE: "heavily_compressed_attention"}


def raw_config(schedule: str) -> dict:
    """The tiny model's config.json-style dict (the original key names the runtime reads)."""
    ratios = SCHEDULES[schedule]
    return dict(
        vocab_size=512, hidden_size=64, num_hidden_layers=len(ratios), num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16, num_key_value_heads=1,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=32,
        scoring_func="sqrtsoftplus", norm_topk_prob=True, routed_scaling_factor=1.5, num_hash_layers=2,
        swiglu_limit=0.05, sliding_window=8, index_n_heads=16, index_head_dim=16, index_topk=3,
        hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, rope_theta=10000.0,
        compress_rope_theta=160000.0, max_position_embeddings=1048576,
        rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
        compress_ratios=ratios + [0], tie_word_embeddings=False, bos_token_id=0, eos_token_id=1,
    )


def runtime_config(schedule: str) -> V4Config:
    """The raw config as the typed V4Config (what the runtime's V4 model reads; the MTP entry of
    compress_ratios dropped, as this config has no MTP layer)."""
    raw = raw_config(schedule)
    return V4Config.from_dict({**raw, "compress_ratios": raw["compress_ratios"][:-1]}, source=f"tiny {schedule}")


def _hf_config(schedule: str):
    """The same config as transformers' DeepseekV4Config (its new key names)."""
    import transformers

    raw = raw_config(schedule)
    ratios = raw["compress_ratios"][:-1]
    kw = {k: v for k, v in raw.items() if k not in ("compress_ratios", "rope_scaling", "num_hash_layers",
                                                     "qk_rope_head_dim")}
    return transformers.DeepseekV4Config(
        **kw, layer_types=[_TYPES[r] for r in ratios],
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": HCA_RATE},
        mlp_layer_types=["hash_moe" if i < raw["num_hash_layers"] else "moe" for i in range(len(ratios))],
        partial_rotary_factor=raw["qk_rope_head_dim"] / raw["head_dim"],
        rope_parameters={"rope_type": "yarn", **{k: v for k, v in raw["rope_scaling"].items() if k != "type"}},
    )


def tiny_v4(schedule: str, seed: int = 0):
    """fp32 eval-mode transformers DeepseekV4ForCausalLM with seeded random weights (module docstring)."""
    import transformers

    cfg = _hf_config(schedule)
    torch.manual_seed(seed)
    model = transformers.DeepseekV4ForCausalLM(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith(".base") or name.endswith("hc_base"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif name.endswith(".scale") or name.endswith("hc_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            elif name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
            elif "norm" in name and name.endswith("weight"):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("weights_proj.weight") or name.endswith("gate.weight"):
                p.copy_(0.3 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=g))
            elif name.endswith("tid2eid"):
                E, k = cfg.n_routed_experts, cfg.num_experts_per_tok
                b.copy_(torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(b.shape[0])]))
    return model


_RENAMES = [  # transformers name pattern -> original checkpoint name (applied in order)
    (r"^model\.embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.norm\.weight$", "norm.weight"),
    (r"^model\.hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"^model\.layers\.", "layers."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.self_attn\.sinks$", ".attn.attn_sink"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.mlp\.", ".ffn."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
]


def original_name(name: str) -> str:
    """transformers' parameter / buffer name -> the original checkpoint name."""
    for pat, rep in _RENAMES:
        name = re.sub(pat, rep, name)
    return name


def original_state_dict(model) -> dict[str, torch.Tensor]:
    """Every persistent tensor of `model` under the original checkpoint names; fused experts split
    into `layers.N.ffn.experts.K.{w1,w3}` [I, D] and `w2` [D, I]."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().clone()
        m = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if m is None:
            out[original_name(name)] = t
            continue
        p = f"layers.{m.group(1)}.ffn.experts."
        for e in range(t.shape[0]):
            if m.group(2) == "down_proj":
                out[f"{p}{e}.w2.weight"] = t[e].clone()
            else:
                w1, w3 = t[e].chunk(2, dim=0)
                out[f"{p}{e}.w1.weight"], out[f"{p}{e}.w3.weight"] = w1.clone(), w3.clone()
    return out
