"""`moesplit make-tiny --arch deepseek_v4`: tiny seeded random DeepSeek-V4 checkpoints in the real
on-disk layout (dev/test tool).

What is real: config.json with the original release's keys (`compress_ratios` with the MTP entry,
`num_hash_layers`, `qk_rope_head_dim`, `rope_theta` + `compress_rope_theta` + `rope_scaling`
yarn, `quantization_config` fp8/e4m3/ue8m0/128x128), the original tensor names without `model.`
(checkpoint.names_v4), their dtypes and packing: block FP8 F8_E4M3 + `.scale` F8_E8M0 for the
attention / shared-expert / indexer wq_b / MTP projections, routed experts in MXFP4 (I8 packed
e2m1, low nibble first, F8_E8M0 scale per 32 inputs) or FP8, bf16 norms / router / compressors /
embed / head, f32 mHC parameters, `ape` and `attn_sink`, f32 `gate.bias`, int64 `gate.tid2eid`,
an `mtp.0.` block, safetensors sharded with an index.json.

What is tiny: the sizes (`TINY_V4`), and the layer schedule: `flash` (window, window, then CSA / HCA
alternating, as V4-Flash) or `pro` (HCA, HCA, then CSA / HCA, as V4-Pro), with HCA ratio 16 and a
window of 8, so prompts of a few dozen tokens pass the window and several compression blocks (CSA
selection with index_topk 4 and HCA both act).

Formats (`--format`): mxfp4 (default: MXFP4 experts, FP8 elsewhere, the instruct releases), fp8
(FP8 experts, `expert_dtype` "fp8" in quantization_config, the base releases), bf16 (no
quantization_config, every linear bf16). Numpy only: the values are drawn, then quantised; the
checkpoint's dequantised values are the model.
"""
from __future__ import annotations

import copy
import json
import os
from typing import Callable

import ml_dtypes
import numpy as np

from checkpoint import names_v4 as N4
from checkpoint.config_v4 import V4Config
from checkpoint.formats_v4 import quant_fp8_e8m0, quant_mxfp4
from checkpoint.reader import write_safetensors

V4_FORMATS = ("mxfp4", "fp8", "bf16")
SCHEDULES = ("flash", "pro")
HCA_RATIO = 16  # the real HCA ratio is 128: tiny prompts would never fill one entry
BF16 = np.dtype(ml_dtypes.bfloat16)

TINY_V4: dict = {  # original DeepSeek-V4 field names; sizes tiny, semantics real
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
    "vocab_size": 512, "hidden_size": 128, "moe_intermediate_size": 64, "num_hidden_layers": 6,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16,
    "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_shared_experts": 1, "num_hash_layers": 2,
    "routed_scaling_factor": 1.5, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "swiglu_limit": 10.0, "hidden_act": "silu",
    # 16 indexer heads: an entry scores sum_h w_h relu(q_h . k), exactly 0 when every head's relu is 0;
    # with 4 heads that is 1 entry in 16, and equal scores at the top-k boundary (5 of 288 queries on
    # a 100 + 64 token run) make the pick depend on topk's tie order (transformers' cached and
    # uncached runs may differ). With 16 heads no tie was seen.
    "index_n_heads": 16, "index_head_dim": 32, "index_topk": 4, "sliding_window": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6,
    "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 64, "beta_fast": 32,
                     "beta_slow": 1},
    "max_position_embeddings": 1024, "tie_word_embeddings": False, "attention_bias": False,
    "attention_dropout": 0.0, "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 1,
    "initializer_range": 0.02, "torch_dtype": "bfloat16", "use_cache": True,
}
V4_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
            "weight_block_size": [128, 128]}


def schedule(kind: str, n_layers: int, hca: int = HCA_RATIO) -> list[int]:
    """compress_ratios for `n_layers` layers + the MTP entry (0): Flash-like or Pro-like."""
    if kind not in SCHEDULES:
        raise ValueError(f"--v4-schedule must be one of {SCHEDULES}, got {kind!r}")
    head = [0, 0] if kind == "flash" else [hca, hca]
    body = [4 if i % 2 == 0 else hca for i in range(2, n_layers)]
    return (head + body)[:n_layers] + [0]


def tiny_v4_config(fmt: str = "mxfp4", v4_schedule: str = "flash", overrides: dict | None = None) -> dict:
    """config.json dict of a tiny V4 checkpoint (original key names)."""
    if fmt not in V4_FORMATS:
        raise ValueError(f"--format for deepseek_v4 must be one of {V4_FORMATS}, got {fmt!r}")
    cfg = copy.deepcopy(TINY_V4)
    for k, v in (overrides or {}).items():
        cfg[k] = {**cfg[k], **v} if k == "rope_scaling" and isinstance(v, dict) else v
    if "compress_ratios" not in (overrides or {}):
        cfg["compress_ratios"] = schedule(v4_schedule, int(cfg["num_hidden_layers"]))
    if fmt != "bf16":
        given = (overrides or {}).get("quantization_config") or {}
        cfg["quantization_config"] = {**copy.deepcopy(V4_QUANT), **given}
        if fmt == "fp8":
            cfg["quantization_config"]["expert_dtype"] = "fp8"
    return cfg


def _draw(name: str, shape: tuple[int, ...], kind: str, cfg: V4Config, rng: np.random.Generator) -> np.ndarray:
    """Seeded float32 (or int64) values for one tensor, sized so activations stay O(1) and routing and
    logits are far from ties."""
    leaf = name.rsplit(".", 1)[-1] if not name.endswith(".weight") else name[:-len(".weight")].rsplit(".", 1)[-1]
    if kind == "i64":  # tid2eid: k distinct experts per token id
        return np.argsort(rng.random((shape[0], cfg.n_routed_experts)), axis=1)[:, : shape[1]].astype(np.int64)
    if leaf.endswith("norm"):
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if "hc_" in leaf:
        if leaf.endswith("_fn"):
            return (rng.standard_normal(shape) / np.sqrt(shape[1])).astype(np.float32)
        if leaf.endswith("_scale"):
            return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
        return (0.1 * rng.standard_normal(shape)).astype(np.float32)
    if leaf in ("attn_sink", "ape", "bias"):
        return ((0.5 if leaf == "attn_sink" else 0.1) * rng.standard_normal(shape)).astype(np.float32)
    if leaf == "embed":
        return rng.standard_normal(shape).astype(np.float32)
    return (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)  # a linear [out, in]


def _store(name: str, value: np.ndarray, kind: str, cfg: V4Config) -> dict[str, np.ndarray]:
    """One logical tensor -> {stored name: array in the stored dtype} (FP8 / MXFP4 with `.scale`)."""
    base = name[: -len("weight")] if name.endswith(".weight") else None
    if kind == "expert":
        kind = "fp8" if cfg.expert_dtype == "fp8" else "mxfp4"
    if kind == "fp8":
        q, s = quant_fp8_e8m0(value, cfg.quantization.block_size)
        return {name: q, base + "scale": s}
    if kind == "mxfp4":
        q, s = quant_mxfp4(value)
        return {name: q, base + "scale": s}
    if kind == "bf16":
        return {name: value.astype(BF16)}
    return {name: value}  # f32, i64


def _write_shards(out_dir: str, stored: dict[str, np.ndarray], n_shards: int) -> list[str]:
    """Sharded safetensors (model-0000K-of-0000N) + model.safetensors.index.json, split by size."""
    names = list(stored)
    total = sum(int(stored[n].nbytes) for n in names)
    groups: list[list[str]] = [[]]
    acc = 0
    for n in names:
        if acc >= total * len(groups) / n_shards and len(groups) < n_shards:
            groups.append([])
        groups[-1].append(n)
        acc += int(stored[n].nbytes)
    weight_map, files = {}, []
    for i, g in enumerate(groups):
        fn = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        write_safetensors(os.path.join(out_dir, fn), {n: stored[n] for n in g})
        weight_map.update({n: fn for n in g})
        files.append(fn)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def make_tiny_v4(out_dir: str, fmt: str = "mxfp4", seed: int = 0, overrides: dict | None = None,
                 v4_schedule: str = "flash", write_tokenizer: Callable[[str, int], None] | None = None) -> str:
    """Write a tiny random DeepSeek-V4 checkpoint to out_dir (created if needed); returns out_dir.
    `write_tokenizer(out_dir, vocab_size)` writes the tokenizer files (gpu_service.local.tiny.make_tiny
    passes its simple one); None writes none."""
    d = tiny_v4_config(fmt, v4_schedule, overrides)
    cfg = V4Config.from_dict(d, source="make-tiny")  # what we write must load
    rng = np.random.default_rng(seed)
    stored: dict[str, np.ndarray] = {}
    for name, spec in N4.tensor_table(cfg, mtp=True).items():
        stored.update(_store(name, _draw(name, spec.shape, spec.kind, cfg, rng), spec.kind, cfg))
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(d, f, indent=2)
    _write_shards(out_dir, stored, n_shards=min(4, max(2, cfg.num_hidden_layers)))
    if write_tokenizer is not None:
        write_tokenizer(out_dir, cfg.vocab_size)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True, "bos_token_id": d.get("bos_token_id", 0),
                   "eos_token_id": d.get("eos_token_id", 1)}, f, indent=2)
    return out_dir
