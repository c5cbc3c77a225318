"""Typed model configuration read from a Hugging Face `config.json`.

One frozen dataclass, `ModelConfig`, built at the edge (`load_config`) and passed everywhere.
It covers the DeepSeek-V3 family (DeepSeek-V3/R1, Kimi-K2, Kimi-K2-Thinking) and DeepSeek-V3.2.
Unknown architectures and missing required fields are errors that say what was expected.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from dataclasses import dataclass, field
from typing import Any

from checkpoint import kimi_k25

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM", "DeepseekV32ForCausalLM")
SUPPORTED_MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32")


class ConfigError(ValueError):
    """A config.json that moesplit cannot serve, with the reason and the fix."""


@dataclass(frozen=True)
class QuantConfig:
    """How the checkpoint's linear weights are stored.

    method: "fp8" (DeepSeek block FP8: e4m3 weight + f32 weight_scale_inv per block) or
            "int4" (compressed-tensors pack-quantized, symmetric, group-wise).
    """

    method: str
    block_size: tuple[int, int] = (128, 128)  # fp8 only
    group_size: int = 32  # int4 only
    num_bits: int = 4  # int4 only
    ignore: tuple[str, ...] = ()  # int4 only: module names / "re:" patterns kept unquantized
    raw: dict = field(default_factory=dict, compare=False, hash=False)

    @staticmethod
    def from_dict(q: dict) -> "QuantConfig":
        method = q.get("quant_method")
        if method == "fp8":
            if q.get("fmt", "e4m3") != "e4m3":
                raise ConfigError(f"fp8 format {q.get('fmt')!r} is not supported; only e4m3 checkpoints are")
            bs = tuple(q.get("weight_block_size") or (128, 128))
            return QuantConfig(method="fp8", block_size=(int(bs[0]), int(bs[1])), raw=q)
        if method == "compressed-tensors":
            if q.get("format") != "pack-quantized":
                raise ConfigError(
                    f"compressed-tensors format {q.get('format')!r} is not supported; only 'pack-quantized' is"
                )
            groups = list((q.get("config_groups") or {}).values())
            if len(groups) != 1:
                raise ConfigError("compressed-tensors: exactly one config group is supported")
            w = groups[0].get("weights") or {}
            if w.get("num_bits") != 4 or not w.get("symmetric", False) or w.get("strategy") != "group":
                raise ConfigError(
                    "compressed-tensors: only symmetric group-wise 4-bit weights are supported, got "
                    f"{w!r}"
                )
            return QuantConfig(
                method="int4",
                group_size=int(w.get("group_size", 32)),
                num_bits=4,
                ignore=tuple(q.get("ignore") or ()),
                raw=q,
            )
        raise ConfigError(
            f"quantization_config.quant_method={method!r} is not supported; "
            "supported: 'fp8' (DeepSeek block FP8) and 'compressed-tensors' (pack-quantized INT4)"
        )


_REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "qk_rope_head_dim",
    "qk_nope_head_dim",
    "v_head_dim",
)


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters of a DeepSeek-V3-family checkpoint."""

    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP layers
    moe_intermediate_size: int  # one routed / shared expert
    num_hidden_layers: int
    num_attention_heads: int
    n_routed_experts: int
    num_experts_per_tok: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None = None
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default=None, compare=True, hash=False)
    rope_interleave: bool = True
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    num_nextn_predict_layers: int = 0
    # DeepSeek-V3.2 lightning indexer (DSA)
    index_n_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0
    quantization: QuantConfig | None = None
    # Kimi-K2.5 / K2.6 (checkpoint.kimi_k25): the stored names' prefix of the language model
    # ("language_model."), and the wrapper's vision side kept as data (gpu_service.model.vision builds the tower from it)
    weight_prefix: str = ""
    multimodal: dict | None = field(default=None, compare=False, hash=False)

    # ---- derived -------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def is_v4(self) -> bool:
        """False: DeepSeek-V4 has its own config type (checkpoint.config_v4.V4Config)."""
        return False

    @property
    def is_v32(self) -> bool:
        return self.model_type == "deepseek_v32"

    @property
    def kv_cache_dim(self) -> int:
        """Values cached per token per layer by MLA: compressed c_kv plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if self.is_moe_layer(i))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_hidden_layers) if not self.is_moe_layer(i))

    def fingerprint(self) -> str:
        """Stable hash of everything that defines the weights' shapes and routing semantics.

        Shards and the GPU service compare fingerprints so that a shard of another model is refused."""
        d = dataclasses.asdict(self)
        d.pop("quantization", None)
        d.pop("eos_token_ids", None)
        d.pop("bos_token_id", None)
        d.pop("multimodal", None)
        d.pop("weight_prefix", None)
        blob = json.dumps(d, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    # ---- construction -------------------------------------------------------------------
    @staticmethod
    def from_dict(d: dict[str, Any], source: str = "config.json") -> "ModelConfig":
        if kimi_k25.is_kimi_k25(d):  # the language model of a KimiK25ForConditionalGeneration
            try:
                text, mm = kimi_k25.unwrap(d, source)
            except ValueError as e:
                raise ConfigError(str(e)) from e
            cfg = ModelConfig.from_dict(text, source=f"{source} text_config")
            return dataclasses.replace(cfg, weight_prefix=kimi_k25.LANGUAGE_PREFIX,
                                       multimodal={"wrapper": kimi_k25.ARCHITECTURE, **mm})
        archs = d.get("architectures") or []
        arch = archs[0] if archs else None
        if arch == "DeepseekV4ForCausalLM" or d.get("model_type") == "deepseek_v4":
            raise ConfigError(
                f"{source}: a DeepSeek-V4 checkpoint, not a V3-family one: load_config gives the V3 family's "
                "ModelConfig; read it with checkpoint.config_v4.load_any_config (a V4Config), as serve, gpu-server "
                "and generate do (gpu_service.runtime.runners.make_runner picks the V4 runner), or "
                "CheckpointReader(dir, any_architecture=True)"
            )
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"{source}: architecture {arch!r} is not supported; moesplit serves "
                f"{', '.join(SUPPORTED_ARCHITECTURES)} checkpoints (DeepSeek-V3/R1, V3.2, Kimi-K2)"
            )
        model_type = d.get("model_type", "deepseek_v3")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        missing = [k for k in _REQUIRED if d.get(k) is None]
        if missing:
            raise ConfigError(f"{source}: missing required field(s) {', '.join(missing)}")
        if d.get("scoring_func", "sigmoid") != "sigmoid":
            raise ConfigError(f"{source}: scoring_func {d.get('scoring_func')!r} unsupported; only 'sigmoid'")
        if d.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"{source}: hidden_act {d.get('hidden_act')!r} unsupported; only 'silu'")

        rope_scaling = d.get("rope_scaling")
        rope_theta = d.get("rope_theta")
        rp = d.get("rope_parameters")  # transformers >= 5 writes this instead of rope_scaling/rope_theta
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            rtype = rp.get("rope_type", rp.get("type", "default"))
            if rope_scaling is None and rtype not in (None, "default"):
                rope_scaling = {k: v for k, v in rp.items() if k != "rope_theta"}
        if rope_scaling is not None:
            rope_scaling = dict(rope_scaling)
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rtype in (None, "default"):
                rope_scaling = None
            elif rtype != "yarn":
                raise ConfigError(f"{source}: rope scaling type {rtype!r} unsupported; only 'yarn'")

        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        q = d.get("quantization_config")
        n_group = d.get("n_group") or 1
        topk_group = d.get("topk_group") or 1
        cfg = ModelConfig(
            architecture=arch,
            model_type=model_type,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            moe_intermediate_size=int(d["moe_intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            n_routed_experts=int(d["n_routed_experts"]),
            num_experts_per_tok=int(d["num_experts_per_tok"]),
            kv_lora_rank=int(d["kv_lora_rank"]),
            qk_rope_head_dim=int(d["qk_rope_head_dim"]),
            qk_nope_head_dim=int(d["qk_nope_head_dim"]),
            v_head_dim=int(d["v_head_dim"]),
            q_lora_rank=d.get("q_lora_rank"),
            n_shared_experts=int(d.get("n_shared_experts") or 0),
            n_group=int(n_group),
            topk_group=int(topk_group),
            first_k_dense_replace=int(d.get("first_k_dense_replace") or 0),
            moe_layer_freq=int(d.get("moe_layer_freq") or 1),
            routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
            norm_topk_prob=bool(d.get("norm_topk_prob", True)),
            scoring_func=d.get("scoring_func", "sigmoid"),
            topk_method=d.get("topk_method", "noaux_tc"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            rope_interleave=bool(d.get("rope_interleave", True)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            hidden_act=d.get("hidden_act", "silu"),
            attention_bias=bool(d.get("attention_bias", False)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_nextn_predict_layers=int(d.get("num_nextn_predict_layers") or 0),
            index_n_heads=int(d.get("index_n_heads") or 0),
            index_head_dim=int(d.get("index_head_dim") or 0),
            index_topk=int(d.get("index_topk") or 0),
            quantization=QuantConfig.from_dict(q) if q else None,
        )
        cfg._validate(source)
        return cfg

    def _validate(self, source: str) -> None:
        if self.n_routed_experts % self.n_group:
            raise ConfigError(f"{source}: n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
        if not 1 <= self.topk_group <= self.n_group:
            raise ConfigError(f"{source}: topk_group={self.topk_group} must be in [1, n_group={self.n_group}]")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError(f"{source}: num_experts_per_tok > n_routed_experts")
        if self.is_v32 and not (self.index_n_heads and self.index_head_dim and self.index_topk):
            raise ConfigError(f"{source}: deepseek_v32 needs index_n_heads, index_head_dim and index_topk")


def read_config_json(path: str | os.PathLike) -> tuple[dict, str]:
    """config.json of a checkpoint directory (or the JSON file itself) -> (dict, its path)."""
    p = os.fspath(path)
    if os.path.isdir(p):
        p = os.path.join(p, "config.json")
    if not os.path.exists(p):
        raise ConfigError(f"{p}: not found; point --model at a checkpoint directory containing config.json")
    with open(p) as f:
        try:
            return json.load(f), p
        except json.JSONDecodeError as e:
            raise ConfigError(f"{p}: not valid JSON ({e})") from e


def load_config(path: str | os.PathLike) -> ModelConfig:
    """Read `config.json` from a checkpoint directory (or a path to the JSON file itself)."""
    d, p = read_config_json(path)
    return ModelConfig.from_dict(d, source=p)
