"""DeepSeek-V4 tensor names as the original release stores them, with shapes and stored kinds.

No `model.` prefix (a checkpoint saved by transformers' `save_pretrained` writes the same names
with one; `strip_prefix` maps it away). Logical names keep `.weight` for linears; the FP8 / MXFP4
scale of `X.weight` is stored as `X.scale`. Per layer `layers.N.`:

    attn_norm, ffn_norm [D]                         hc_{attn,ffn}_{fn [(2+hc)*hc, hc*D], base, scale [3]}
    attn.wq_a [q_lora, D]  attn.q_norm [q_lora]     attn.wq_b [H*hd, q_lora]
    attn.wkv [hd, D]  attn.kv_norm [hd]             attn.wo_a [G*o_lora, H*hd/G]  attn.wo_b [D, G*o_lora]
    attn.attn_sink [H]
    ratio != 0: attn.compressor.{wkv,wgate} [c*hd, D] (c = 2 for CSA, 1 for HCA), .ape [ratio, c*hd], .norm [hd]
    CSA only:   attn.indexer.wq_b [nI*dI, q_lora], .weights_proj [nI, D],
                attn.indexer.compressor.{wkv,wgate} [2*dI, D], .ape [4, 2*dI], .norm [dI]
    ffn.gate.weight [E, D]; ffn.gate.bias [E] (score-routed layers) or ffn.gate.tid2eid [vocab, k] (hash layers)
    ffn.experts.K.{w1,w3} [I, D], w2 [D, I]; ffn.shared_experts.{w1,w3} [I*ns, D], w2 [D, I*ns]
Top: embed, head [V, D], norm [D], hc_head_{fn [hc, hc*D], base [hc], scale [1]}.
MTP `mtp.K.`: a window-only block with a score-routed gate + e_proj, h_proj [D, D], enorm, hnorm,
norm, hc_head_*; embed and head are shared with the main model.

Stored kinds: "fp8" (F8_E4M3 + F8_E8M0 `.scale` per 128x128), "expert" (routed experts: MXFP4 or
FP8 as quantization_config says), "bf16", "f32", "i64". Without a quantization_config every linear
is bf16.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from checkpoint.config_v4 import CSA_RATIO, V4Config

PROJ_NAMES = {"gate": "w1", "up": "w3", "down": "w2"}  # moesplit's proj names -> V4's
EMBED, HEAD, FINAL_NORM = "embed.weight", "head.weight", "norm.weight"

_LAYER_RE = re.compile(r"^layers\.(\d+)\.")
_EXPERT_RE = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.(w1|w2|w3)\.weight$")
_MTP_RE = re.compile(r"^mtp\.(\d+)\.")
_W_TO_PROJ = {v: k for k, v in PROJ_NAMES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """Logical (dequantised) shape and stored kind of one V4 tensor."""

    shape: tuple[int, ...]
    kind: str  # fp8 | expert | bf16 | f32 | i64


def strip_prefix(name: str) -> str:
    """`model.layers.0.…` (transformers' save_pretrained spelling) -> `layers.0.…`."""
    return name[len("model."):] if name.startswith("model.") else name


def expert_weight(layer: int, expert: int, proj: str) -> str:
    """`layers.{layer}.ffn.experts.{expert}.w1.weight`; proj is gate|up|down (w1|w3|w2)."""
    if proj not in PROJ_NAMES:
        raise ValueError(f"proj must be one of {tuple(PROJ_NAMES)}, got {proj!r}")
    return f"layers.{layer}.ffn.experts.{expert}.{PROJ_NAMES[proj]}.weight"


def parse_expert(name: str) -> tuple[int, int, str] | None:
    """(layer, expert, gate|up|down) of a routed-expert weight name, else None."""
    m = _EXPERT_RE.match(strip_prefix(name))
    return (int(m.group(1)), int(m.group(2)), _W_TO_PROJ[m.group(3)]) if m else None


def parse_layer(name: str) -> int | None:
    """Layer index of a `layers.{i}.…` name, else None (top-level and MTP tensors)."""
    m = _LAYER_RE.match(strip_prefix(name))
    return int(m.group(1)) if m else None


def is_mtp(name: str) -> bool:
    """True for multi-token-prediction tensors (`mtp.K.…`)."""
    return _MTP_RE.match(strip_prefix(name)) is not None


def _lin(out: dict, name: str, shape: tuple[int, int], kind: str, quantized: bool) -> None:
    """A linear weight: its stored kind when the checkpoint is quantized, else bf16."""
    out[name + ".weight"] = TensorSpec(tuple(shape), kind if quantized else "bf16")


def _hc(out: dict, p: str, which: str, cfg: V4Config) -> None:
    """mHC mixing parameters of one sublayer (f32)."""
    hc, D = cfg.hc_mult, cfg.hidden_size
    mix = (2 + hc) * hc
    out[f"{p}hc_{which}_fn"] = TensorSpec((mix, hc * D), "f32")
    out[f"{p}hc_{which}_base"] = TensorSpec((mix,), "f32")
    out[f"{p}hc_{which}_scale"] = TensorSpec((3,), "f32")


def _attention(out: dict, p: str, cfg: V4Config, ratio: int, q: bool) -> None:
    """Attention weights of one block (`p` = `layers.N.` or `mtp.K.`) with compress ratio `ratio`."""
    D, H, hd, ql = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
    G, ol = cfg.o_groups, cfg.o_lora_rank
    a = p + "attn."
    _lin(out, a + "wq_a", (ql, D), "fp8", q)
    out[a + "q_norm.weight"] = TensorSpec((ql,), "bf16")
    _lin(out, a + "wq_b", (H * hd, ql), "fp8", q)
    _lin(out, a + "wkv", (hd, D), "fp8", q)
    out[a + "kv_norm.weight"] = TensorSpec((hd,), "bf16")
    _lin(out, a + "wo_a", (G * ol, H * hd // G), "fp8", q)
    _lin(out, a + "wo_b", (D, G * ol), "fp8", q)
    out[a + "attn_sink"] = TensorSpec((H,), "f32")
    if ratio == 0:
        return
    c = 2 if ratio == CSA_RATIO else 1
    _compressor(out, a + "compressor.", cfg, ratio, c * hd, hd)
    if ratio == CSA_RATIO:
        nI, dI = cfg.index_n_heads, cfg.index_head_dim
        _lin(out, a + "indexer.wq_b", (nI * dI, ql), "fp8", q)
        out[a + "indexer.weights_proj.weight"] = TensorSpec((nI, D), "bf16")
        _compressor(out, a + "indexer.compressor.", cfg, ratio, 2 * dI, dI)


def _compressor(out: dict, p: str, cfg: V4Config, ratio: int, width: int, norm: int) -> None:
    """A KV compressor: bf16 wkv / wgate [width, D], f32 ape [ratio, width], norm [norm]."""
    out[p + "wkv.weight"] = TensorSpec((width, cfg.hidden_size), "bf16")
    out[p + "wgate.weight"] = TensorSpec((width, cfg.hidden_size), "bf16")
    out[p + "ape"] = TensorSpec((ratio, width), "f32")
    out[p + "norm.weight"] = TensorSpec((norm,), "bf16")


def _ffn(out: dict, p: str, cfg: V4Config, hash_routed: bool, q: bool, routed: bool) -> None:
    """Router, shared expert and (unless routed=False) routed experts of one block."""
    D, E, inter = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
    f = p + "ffn."
    out[f + "gate.weight"] = TensorSpec((E, D), "bf16")
    if hash_routed:
        out[f + "gate.tid2eid"] = TensorSpec((cfg.vocab_size, cfg.num_experts_per_tok), "i64")
    else:
        out[f + "gate.bias"] = TensorSpec((E,), "f32")
    si = inter * cfg.n_shared_experts
    _lin(out, f + "shared_experts.w1", (si, D), "fp8", q)
    _lin(out, f + "shared_experts.w2", (D, si), "fp8", q)
    _lin(out, f + "shared_experts.w3", (si, D), "fp8", q)
    if routed:
        for e in range(E):
            _lin(out, f"{f}experts.{e}.w1", (inter, D), "expert", q)
            _lin(out, f"{f}experts.{e}.w2", (D, inter), "expert", q)
            _lin(out, f"{f}experts.{e}.w3", (inter, D), "expert", q)


def _block(out: dict, p: str, cfg: V4Config, ratio: int, hash_routed: bool, routed: bool) -> None:
    """One decoder block: norms, mHC, attention, MoE."""
    q = cfg.quantization is not None
    out[p + "attn_norm.weight"] = TensorSpec((cfg.hidden_size,), "bf16")
    out[p + "ffn_norm.weight"] = TensorSpec((cfg.hidden_size,), "bf16")
    _hc(out, p, "attn", cfg)
    _hc(out, p, "ffn", cfg)
    _attention(out, p, cfg, ratio, q)
    _ffn(out, p, cfg, hash_routed, q, routed)


def _hc_head(out: dict, p: str, cfg: V4Config) -> None:
    hc, D = cfg.hc_mult, cfg.hidden_size
    out[p + "hc_head_fn"] = TensorSpec((hc, hc * D), "f32")
    out[p + "hc_head_base"] = TensorSpec((hc,), "f32")
    out[p + "hc_head_scale"] = TensorSpec((1,), "f32")


def tensor_table(cfg: V4Config, *, routed: bool = True, mtp: bool = False) -> dict[str, TensorSpec]:
    """{logical name: TensorSpec} for every weight, in checkpoint order. routed=False leaves out the
    routed experts (what the GPU holds); mtp=True adds the `mtp.K.` blocks."""
    D, V = cfg.hidden_size, cfg.vocab_size
    out: dict[str, TensorSpec] = {EMBED: TensorSpec((V, D), "bf16")}
    for i in range(cfg.num_hidden_layers):
        _block(out, f"layers.{i}.", cfg, cfg.compress_ratios[i], cfg.is_hash_layer(i), routed)
    out[FINAL_NORM] = TensorSpec((D,), "bf16")
    _hc_head(out, "", cfg)
    if not cfg.tie_word_embeddings:
        out[HEAD] = TensorSpec((V, D), "bf16")
    if mtp:
        q = cfg.quantization is not None
        for k in range(cfg.num_nextn_predict_layers):
            p = f"mtp.{k}."
            _block(out, p, cfg, 0, False, routed)
            _lin(out, p + "e_proj", (D, D), "fp8", q)
            _lin(out, p + "h_proj", (D, D), "fp8", q)
            for n in ("enorm", "hnorm", "norm"):
                out[f"{p}{n}.weight"] = TensorSpec((D,), "bf16")
            _hc_head(out, p, cfg)
    return out


def expected_shapes(cfg: V4Config, *, routed: bool = True, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """{logical name: logical shape}; see `tensor_table`."""
    return {n: s.shape for n, s in tensor_table(cfg, routed=routed, mtp=mtp).items()}
