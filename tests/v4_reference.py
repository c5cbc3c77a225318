"""transformers' DeepseekV4ForCausalLM as the DeepSeek-V4 oracle (tests only; the runtime never
imports transformers).

`load_reference_v4(dir)` dequantises a V4 checkpoint (original names, FP8 / MXFP4 with `.scale`)
to float32 under the same original names, writes them with a transformers config built from
checkpoint.config_v4.V4Config, and loads that directory with `DeepseekV4ForCausalLM.from_pretrained`,
so transformers' own conversion mapping (conversion_mapping.py "deepseek_v4": renames, experts
merged into gate_up_proj / down_proj) consumes the names. Loading info is checked: nothing missing,
nothing unexpected, nothing mismatched (the `mtp.` tensors, which transformers does not build, are
left out of the copy and counted apart).
"""
from __future__ import annotations

import os
import tempfile

import numpy as np

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
