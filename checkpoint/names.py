"""Real Hugging Face tensor names of DeepSeek-V3-family checkpoints and their shapes.

The names are those written by DeepSeek-V3/R1, V3.2 and Kimi-K2 checkpoints on disk
(per-expert `mlp.experts.{e}.gate_proj.weight`, not transformers 5's fused in-memory
`mlp.experts.gate_up_proj`). Shapes are logical (dequantised) `[out, in]` for linear weights.
Multi-token-prediction layers (index >= num_hidden_layers) are not part of the served model and
are left out of `expected_shapes`.
"""
from __future__ import annotations

import re

from checkpoint.config import ModelConfig

PROJS = ("gate", "up", "down")

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"

_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


def slice_range(intermediate: int, index: int, count: int) -> tuple[int, int]:
    """Even split of [0, intermediate) into `count` parts; part `index` as [i0, i1) (the shards load
    it, the memory plan counts it)."""
    return (index * intermediate) // count, ((index + 1) * intermediate) // count


def layer_prefix(layer: int) -> str:
    return f"model.layers.{layer}."


def expert_weight(layer: int, expert: int, proj: str) -> str:
    """`model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight`; proj is gate|up|down."""
    if proj not in PROJS:
        raise ValueError(f"proj must be one of {PROJS}, got {proj!r}")
    return f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight"


def shared_expert_weight(layer: int, proj: str) -> str:
    if proj not in PROJS:
        raise ValueError(f"proj must be one of {PROJS}, got {proj!r}")
    return f"model.layers.{layer}.mlp.shared_experts.{proj}_proj.weight"


def router_weight(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.weight"


def router_bias(layer: int) -> str:
    return f"model.layers.{layer}.mlp.gate.e_score_correction_bias"


def parse_layer(name: str) -> int | None:
    """Layer index of a `model.layers.{i}.…` name, else None (embeddings, final norm, lm_head)."""
    m = _LAYER_RE.match(name)
    return int(m.group(1)) if m else None


def parse_expert(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, proj) of a routed-expert weight name, else None."""
    m = _EXPERT_RE.match(name)
    return (int(m.group(1)), int(m.group(2)), m.group(3)) if m else None


def is_routed_expert(name: str) -> bool:
    return _EXPERT_RE.match(name) is not None


def is_mtp(name: str, cfg: ModelConfig) -> bool:
    """True for tensors of multi-token-prediction layers (layer index >= num_hidden_layers)."""
    layer = parse_layer(name)
    return layer is not None and layer >= cfg.num_hidden_layers


def attention_shapes(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """MLA weights of one layer (plus the V3.2 lightning indexer)."""
    p = layer_prefix(layer) + "self_attn."
    H, nh = cfg.hidden_size, cfg.num_attention_heads
    out: dict[str, tuple[int, ...]] = {}
    if cfg.q_lora_rank:
        out[p + "q_a_proj.weight"] = (cfg.q_lora_rank, H)
        out[p + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        out[p + "q_b_proj.weight"] = (nh * cfg.qk_head_dim, cfg.q_lora_rank)
    else:
        out[p + "q_proj.weight"] = (nh * cfg.qk_head_dim, H)
    out[p + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, H)
    out[p + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    out[p + "kv_b_proj.weight"] = (nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    out[p + "o_proj.weight"] = (H, nh * cfg.v_head_dim)
    if cfg.is_v32:
        if not cfg.q_lora_rank:
            raise ValueError("DeepSeek-V3.2 needs q_lora_rank (the indexer's wq_b reads the q LoRA latent)")
        ip = p + "indexer."
        out[ip + "wq_b.weight"] = (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        out[ip + "wk.weight"] = (cfg.index_head_dim, H)
        out[ip + "k_norm.weight"] = (cfg.index_head_dim,)
        out[ip + "k_norm.bias"] = (cfg.index_head_dim,)
        out[ip + "weights_proj.weight"] = (cfg.index_n_heads, H)
    return out


def mlp_shapes(cfg: ModelConfig, layer: int, *, routed: bool = True) -> dict[str, tuple[int, ...]]:
    """Dense MLP, or MoE router + shared experts (+ routed experts unless routed=False)."""
    p = layer_prefix(layer) + "mlp."
    H = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {}
    if not cfg.is_moe_layer(layer):
        inter = cfg.intermediate_size
        out[p + "gate_proj.weight"] = (inter, H)
        out[p + "up_proj.weight"] = (inter, H)
        out[p + "down_proj.weight"] = (H, inter)
        return out
    E, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    out[router_weight(layer)] = (E, H)
    if cfg.topk_method == "noaux_tc":
        out[router_bias(layer)] = (E,)
    if cfg.n_shared_experts:
        si = inter * cfg.n_shared_experts
        out[shared_expert_weight(layer, "gate")] = (si, H)
        out[shared_expert_weight(layer, "up")] = (si, H)
        out[shared_expert_weight(layer, "down")] = (H, si)
    if routed:
        for e in range(E):
            out[expert_weight(layer, e, "gate")] = (inter, H)
            out[expert_weight(layer, e, "up")] = (inter, H)
            out[expert_weight(layer, e, "down")] = (H, inter)
    return out


def expected_shapes(cfg: ModelConfig, *, routed: bool = True) -> dict[str, tuple[int, ...]]:
    """{logical tensor name: shape} for every weight of the model, in checkpoint order.

    routed=False leaves out the routed experts (what the GPU service loads)."""
    H = cfg.hidden_size
    out: dict[str, tuple[int, ...]] = {EMBED: (cfg.vocab_size, H)}
    for i in range(cfg.num_hidden_layers):
        p = layer_prefix(i)
        out[p + "input_layernorm.weight"] = (H,)
        out.update(attention_shapes(cfg, i))
        out[p + "post_attention_layernorm.weight"] = (H,)
        out.update(mlp_shapes(cfg, i, routed=routed))
    out[FINAL_NORM] = (H,)
    if not cfg.tie_word_embeddings:
        out[LM_HEAD] = (cfg.vocab_size, H)
    return out


def is_norm(name: str) -> bool:
    """RMSNorm / LayerNorm parameters (never quantized)."""
    return name.endswith(("layernorm.weight", "norm.weight", "norm.bias"))


def compact_ranges(values) -> str:
    """[0,1,2,3,5,7,8] -> '0-3,5,7-8' (for messages naming layers and experts)."""
    vals = sorted(set(int(v) for v in values))
    out, i = [], 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ",".join(out)
