"""Typed DeepSeek-V4 (Flash, Pro) configuration, read from a checkpoint's `config.json`.

V4 is not V3 with new numbers (one shared 512-dim KV head, sliding window + compressed branches,
mHC residual streams, hash-routed first layers, MXFP4 experts), so it has its own frozen dataclass,
`V4Config`, rather than optional fields on `checkpoint.config.ModelConfig`.

Both spellings of the keys are read:
- the original release's (`compress_ratios` per layer incl. the MTP entry, `num_hash_layers`,
  `qk_rope_head_dim`, `rope_theta` + `compress_rope_theta` + `rope_scaling` {"type": "yarn"});
- transformers' (`layer_types` of sliding_attention / compressed_sparse_attention /
  heavily_compressed_attention with `compress_rates`, `mlp_layer_types` of hash_moe / moe,
  `partial_rotary_factor`, nested `rope_parameters` {"main": …, "compress": …}).
A key given in both spellings must agree. Unknown architecture, missing or inconsistent fields
are errors that say what was expected.

Ratio semantics follow the reference implementation: ratio 0 = sliding window only; ratio 4 =
CSA (overlapping compressor, lightning indexer); any other ratio = HCA (dense over entries).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from checkpoint.config import ConfigError, ModelConfig, load_config, read_config_json

V4_ARCHITECTURE = "DeepseekV4ForCausalLM"
V4_MODEL_TYPE = "deepseek_v4"
CSA_RATIO = 4  # the reference's `overlap = compress_ratio == 4`; indexer only on these layers
LAYER_TYPE_NAMES = {"sliding_attention": "window", "compressed_sparse_attention": "csa",
                    "heavily_compressed_attention": "hca"}
EXPERT_DTYPES = ("fp4", "fp8")

_REQUIRED = ("vocab_size", "hidden_size", "moe_intermediate_size", "num_hidden_layers", "num_attention_heads",
             "head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts", "num_experts_per_tok",
             "index_n_heads", "index_head_dim", "index_topk", "sliding_window")


@dataclass(frozen=True)
class V4Quant:
    """V4 quantization: block FP8 e4m3 with ue8m0 (power-of-two, F8_E8M0) scales for the attention
    and shared-expert linears; routed experts in MXFP4 ("fp4": e2m1 + ue8m0 per 32 inputs, the
    instruct releases, and the default when `expert_dtype` is absent, as vLLM assumes) or "fp8"."""

    block_size: tuple[int, int] = (128, 128)
    scale_fmt: str = "ue8m0"
    expert_dtype: str = "fp4"
    raw: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def method(self) -> str:
        """"fp8", as checkpoint.config.QuantConfig.method says for block-FP8 checkpoints."""
        return "fp8"

    @staticmethod
    def from_dict(q: dict, top_expert_dtype: str | None, source: str) -> "V4Quant":
        """quantization_config (+ a top-level `expert_dtype`) -> V4Quant; anything else is an error."""
        if q.get("quant_method") != "fp8" or q.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{source}: DeepSeek-V4 quantization_config must be quant_method 'fp8', fmt 'e4m3' "
                              f"(got {q.get('quant_method')!r}, {q.get('fmt')!r})")
        scale_fmt = q.get("scale_fmt", "ue8m0")
        if scale_fmt != "ue8m0":
            raise ConfigError(f"{source}: scale_fmt {scale_fmt!r} unsupported for DeepSeek-V4; only 'ue8m0'")
        ed = q.get("expert_dtype", top_expert_dtype) or "fp4"
        if ed not in EXPERT_DTYPES:
            raise ConfigError(f"{source}: expert_dtype {ed!r} unsupported; expected one of {EXPERT_DTYPES}")
        bs = tuple(int(x) for x in (q.get("weight_block_size") or (128, 128)))
        return V4Quant(block_size=(bs[0], bs[1]), scale_fmt=scale_fmt, expert_dtype=ed, raw=q)


@dataclass(frozen=True)
class V4Config:
    """Architecture hyper-parameters of a DeepSeek-V4 checkpoint (shapes, schedule, routing, RoPE)."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # q heads and the one shared KV head (K = V)
    qk_rope_head_dim: int  # the last rope dims of head_dim get RoPE
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    num_experts_per_tok: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # one per decoder layer (MTP entry dropped): 0, 4 (CSA) or other (HCA)
    num_hash_layers: int = 3
    n_shared_experts: int = 1
    num_key_value_heads: int = 1
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    scoring_func: str = "sqrtsoftplus"
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0  # window-only layers, no scaling
    compress_rope_theta: float = 160000.0  # CSA / HCA layers, with rope_scaling
    rope_scaling: dict | None = field(default=None, compare=True, hash=False)
    max_position_embeddings: int = 1048576
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    quantization: V4Quant | None = None

    # ---- derived -------------------------------------------------------------------------
    @property
    def is_v4(self) -> bool:
        """True: lets shared code branch on the architecture without isinstance checks."""
        return True

    def layer_kind(self, layer: int) -> str:
        """'window' (ratio 0), 'csa' (ratio 4: indexer top-k) or 'hca' (dense over compressed entries)."""
        r = self.compress_ratios[layer]
        return "window" if r == 0 else ("csa" if r == CSA_RATIO else "hca")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return tuple(self.layer_kind(i) for i in range(self.num_hidden_layers))

    def is_hash_layer(self, layer: int) -> bool:
        """The first `num_hash_layers` layers route by the fixed `tid2eid[token]` table."""
        return layer < self.num_hash_layers

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Every V4 layer is MoE."""
        return tuple(range(self.num_hidden_layers))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return ()

    def is_moe_layer(self, layer: int) -> bool:
        return 0 <= layer < self.num_hidden_layers

    @property
    def expert_dtype(self) -> str:
        """'fp4' (MXFP4) or 'fp8': how the routed experts are stored."""
        return self.quantization.expert_dtype if self.quantization else "bf16"

    def fingerprint(self) -> str:
        """Stable hash of what defines the weights' shapes and routing (shards compare it)."""
        d = dataclasses.asdict(self)
        for k in ("quantization", "eos_token_ids", "bos_token_id"):
            d.pop(k, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def from_dict(d: dict[str, Any], source: str = "config.json") -> "V4Config":
        """A config.json dict (original or transformers key names) -> V4Config, validated."""
        archs = d.get("architectures") or [V4_ARCHITECTURE]
        if archs[0] != V4_ARCHITECTURE or d.get("model_type", V4_MODEL_TYPE) != V4_MODEL_TYPE:
            raise ConfigError(f"{source}: not a DeepSeek-V4 config (architectures {archs}, model_type "
                              f"{d.get('model_type')!r}); expected {V4_ARCHITECTURE} / {V4_MODEL_TYPE}")
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        n = int(d["num_hidden_layers"])
        for k, want in (("scoring_func", "sqrtsoftplus"), ("hidden_act", "silu")):
            if d.get(k, want) != want:
                raise ConfigError(f"{source}: {k} {d.get(k)!r} unsupported for DeepSeek-V4; only {want!r}")
        eos = d.get("eos_token_id")
        q = d.get("quantization_config")
        cfg = V4Config(
            architecture=V4_ARCHITECTURE, model_type=V4_MODEL_TYPE,
            vocab_size=int(d["vocab_size"]), hidden_size=int(d["hidden_size"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]), num_hidden_layers=n,
            num_attention_heads=int(d["num_attention_heads"]), head_dim=int(d["head_dim"]),
            qk_rope_head_dim=_rope_dim(d, source), q_lora_rank=int(d["q_lora_rank"]),
            o_groups=int(d["o_groups"]), o_lora_rank=int(d["o_lora_rank"]),
            n_routed_experts=int(d["n_routed_experts"]), num_experts_per_tok=int(d["num_experts_per_tok"]),
            index_n_heads=int(d["index_n_heads"]), index_head_dim=int(d["index_head_dim"]),
            index_topk=int(d["index_topk"]), sliding_window=int(d["sliding_window"]),
            compress_ratios=_ratios(d, n, source), num_hash_layers=_hash_layers(d, n, source),
            n_shared_experts=int(d.get("n_shared_experts", 1)),
            num_key_value_heads=int(d.get("num_key_value_heads", 1)),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.5)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)), scoring_func="sqrtsoftplus",
            swiglu_limit=float(d.get("swiglu_limit", 10.0)), hc_mult=int(d.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(d.get("hc_sinkhorn_iters", 20)), hc_eps=float(d.get("hc_eps", 1e-6)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            **_rope(d, source),
            max_position_embeddings=int(d.get("max_position_embeddings", 1048576)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)), hidden_act="silu",
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            quantization=V4Quant.from_dict(q, d.get("expert_dtype"), source) if q else None,
        )
        cfg._validate(source)
        return cfg

    def _validate(self, source: str) -> None:
        """Cross-field checks; each error names the fields to fix."""
        if self.num_key_value_heads != 1:
            raise ConfigError(f"{source}: num_key_value_heads={self.num_key_value_heads}; DeepSeek-V4 has one "
                              "shared KV head")
        if self.num_attention_heads % self.o_groups:
            raise ConfigError(f"{source}: num_attention_heads={self.num_attention_heads} not divisible by "
                              f"o_groups={self.o_groups}")
        if not 0 < self.qk_rope_head_dim <= self.head_dim or self.qk_rope_head_dim % 2:
            raise ConfigError(f"{source}: qk_rope_head_dim={self.qk_rope_head_dim} must be even and in "
                              f"(0, head_dim={self.head_dim}]")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"{source}: num_experts_per_tok > n_routed_experts")
        if not 0 < self.swiglu_limit < float("inf"):
            raise ConfigError(f"{source}: swiglu_limit={self.swiglu_limit} must be a finite number > 0 (the "
                              "experts' gate/up clamp; the release uses 10.0)")
        if self.hc_mult < 1 or self.sliding_window < 1:
            raise ConfigError(f"{source}: hc_mult and sliding_window must be >= 1")


def _rope_dim(d: dict, source: str) -> int:
    """qk_rope_head_dim (original) or head_dim * partial_rotary_factor (transformers); must agree."""
    hd = int(d["head_dim"])
    orig = d.get("qk_rope_head_dim")
    prf = d.get("partial_rotary_factor")
    tf = int(round(hd * float(prf))) if prf is not None else None
    if orig is not None and tf is not None and int(orig) != tf:
        raise ConfigError(f"{source}: qk_rope_head_dim={orig} disagrees with head_dim*partial_rotary_factor={tf}")
    return int(orig) if orig is not None else (tf if tf is not None else hd // 8)


def _ratios(d: dict, n: int, source: str) -> tuple[int, ...]:
    """Per-layer compress ratio from `compress_ratios` (original, n or n+MTP entries) or from
    `layer_types` + `compress_rates` (transformers); both given must agree."""
    orig = d.get("compress_ratios")
    out = None
    if orig is not None:
        if len(orig) not in (n, n + int(d.get("num_nextn_predict_layers") or 0)):
            raise ConfigError(f"{source}: compress_ratios has {len(orig)} entries; expected num_hidden_layers={n} "
                              "(+ one per MTP layer)")
        out = tuple(int(r) for r in orig[:n])
    lt = d.get("layer_types")
    if lt is not None:
        rates = {"compressed_sparse_attention": CSA_RATIO, "heavily_compressed_attention": 128,
                 **(d.get("compress_rates") or {}), "sliding_attention": 0}
        bad = [t for t in lt if t not in LAYER_TYPE_NAMES]
        if bad or len(lt) < n:
            raise ConfigError(f"{source}: layer_types must list {n} of {tuple(LAYER_TYPE_NAMES)}; got {lt}")
        if rates["compressed_sparse_attention"] != CSA_RATIO:
            raise ConfigError(f"{source}: compress_rates CSA rate must be {CSA_RATIO} (the overlapping compressor)")
        tf = tuple(int(rates[t]) for t in lt[:n])
        if out is not None and out != tf:
            raise ConfigError(f"{source}: compress_ratios {list(out)} disagree with layer_types {lt[:n]}")
        out = tf
    if out is None:
        raise ConfigError(f"{source}: DeepSeek-V4 needs compress_ratios (or layer_types + compress_rates); "
                          "without it the layer schedule is unknown")
    if any(r < 0 for r in out):
        raise ConfigError(f"{source}: compress ratios must be >= 0, got {list(out)}")
    return out


def _hash_layers(d: dict, n: int, source: str) -> int:
    """num_hash_layers (original) or the leading run of 'hash_moe' in mlp_layer_types (transformers)."""
    orig = d.get("num_hash_layers")
    mlt = d.get("mlp_layer_types")
    tf = None
    if mlt is not None:
        tf = next((i for i, t in enumerate(mlt) if t != "hash_moe"), len(mlt))
        if any(t == "hash_moe" for t in mlt[tf:]) or any(t not in ("hash_moe", "moe") for t in mlt):
            raise ConfigError(f"{source}: mlp_layer_types must be hash_moe layers then moe layers; got {mlt}")
    if orig is not None and tf is not None and int(orig) != tf:
        raise ConfigError(f"{source}: num_hash_layers={orig} disagrees with mlp_layer_types ({tf} hash_moe)")
    k = int(orig) if orig is not None else (tf if tf is not None else 3)
    return min(k, n)


def _rope(d: dict, source: str) -> dict:
    """rope_theta, compress_rope_theta, rope_scaling from the original keys or the nested
    transformers `rope_parameters` {"main": {...}, "compress": {...}}."""
    theta, ctheta, scaling = d.get("rope_theta"), d.get("compress_rope_theta"), d.get("rope_scaling")
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
        main, comp = rp.get("main") or {}, rp["compress"]
        theta = main.get("rope_theta", theta)
        ctheta = comp.get("rope_theta", ctheta)
        if scaling is None and comp.get("rope_type", comp.get("type")) not in (None, "default"):
            scaling = {k: v for k, v in comp.items()
                       if k not in ("rope_theta", "partial_rotary_factor", "attention_factor")}
    elif isinstance(rp, dict) and scaling is None and rp.get("rope_type", rp.get("type")) not in (None, "default"):
        scaling = {k: v for k, v in rp.items() if k not in ("rope_theta", "partial_rotary_factor")}
        theta = rp.get("rope_theta", theta)
    if scaling is not None:  # the YaRN numbers only: thetas are fields of their own
        scaling = {k: v for k, v in scaling.items() if k not in ("rope_theta", "partial_rotary_factor",
                                                                  "attention_factor")}
        rtype = scaling.pop("rope_type", None) or scaling.get("type")
        scaling["type"] = rtype
        if rtype in (None, "default"):
            scaling = None
        elif rtype != "yarn":
            raise ConfigError(f"{source}: rope scaling type {rtype!r} unsupported for DeepSeek-V4; only 'yarn'")
    return {"rope_theta": float(theta if theta is not None else 10000.0),
            "compress_rope_theta": float(ctheta if ctheta is not None else 160000.0), "rope_scaling": scaling}


def is_v4_dict(d: dict) -> bool:
    """True for a DeepSeek-V4 config.json dict."""
    return (d.get("architectures") or [None])[0] == V4_ARCHITECTURE or d.get("model_type") == V4_MODEL_TYPE


def load_v4_config(path: str | os.PathLike) -> V4Config:
    """Read a DeepSeek-V4 `config.json` (directory or file)."""
    d, p = read_config_json(path)
    return V4Config.from_dict(d, source=p)


def config_from_dict(d: dict, source: str = "config.json") -> ModelConfig | V4Config:
    """V4Config for a DeepSeek-V4 dict, else checkpoint.config.ModelConfig."""
    return V4Config.from_dict(d, source) if is_v4_dict(d) else ModelConfig.from_dict(d, source)


def load_any_config(path: str | os.PathLike) -> ModelConfig | V4Config:
    """`load_config` for every supported architecture: V4Config for DeepSeek-V4, else ModelConfig."""
    d, p = read_config_json(path)
    return V4Config.from_dict(d, p) if is_v4_dict(d) else load_config(path)
