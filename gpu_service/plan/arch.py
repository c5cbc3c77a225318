"""Which byte model a config gets: one `ArchBytes` per architecture, chosen once by `arch_bytes(cfg)`.

The planner (gpu_service.plan.search, report, host_tier) asks the architecture's functions for the
parts that differ: the GPU parameter groups, a layer's cache items, the pool's bytes per token, the
workspace, the experts' native format, which item categories exist and how the table names them.
DeepSeek-V3 / V3.2 / Kimi-K2 (MLA): gpu_service.plan.bytes; DeepSeek-V4: gpu_service.plan.bytes_v4.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from gpu_service.plan import bytes as B
from gpu_service.plan import bytes_v4 as B4

V3_LABELS = {"attention": "attention (MLA)", "indexer": "indexer (V3.2)", "kv_cache": "KV cache (c_kv+k_pe)",
             "index_keys": "indexer keys"}
LABELS = {"embeddings": "embeddings", "dense_mlp": "dense MLP", "shared_experts": "shared experts",
          "routers": "routers", "norms": "norms", "lm_head": "lm_head", "gpu_experts": "hot experts",
          "workspace": "workspace", "reserve": "CUDA ctx + reserve", "vision": "vision tower"}


@dataclass(frozen=True)
class ArchBytes:
    """The architecture-specific half of the byte model (the rest is shared in gpu_service.plan.bytes)."""

    name: str
    gpu_modules: Callable[[Any], list[B.Module]]
    kv_layer_items: Callable[[Any, int, B.Options], dict[str, int]]  # (cfg, layer, options) -> {category: bytes}
    kv_bytes_per_token: Callable[[Any, int], float]  # (cfg, eb) -> pool bytes per token, all layers
    workspace: Callable[..., int]  # as gpu_service.plan.bytes.workspace_bytes
    native_expert_format: Callable[[Any], str | None]  # the checkpoint's expert format kept as stored
    hot_format: Callable[[Any, str], str]  # (cfg, the shards' expert format) -> the hot GPU experts' format
    categories: Callable[[Any], tuple[str, ...]]  # the GPU item categories this model has, table order
    labels: dict[str, str] = field(default_factory=dict)

    def label(self, category: str) -> str:
        """The table's name of an item category."""
        return self.labels.get(category) or LABELS[category]


def _v3_kv_items(cfg, layer: int, o: B.Options) -> dict[str, int]:
    """MLA: c_kv + k_pe (and the V3.2 index key) per pool token + the null slot, every layer."""
    kv, idx = B.kv_bytes_per_token_layer(cfg, o.eb)
    items = {"kv_cache": kv * (o.kv_tokens + 1)}
    if idx:
        items["index_keys"] = idx * (o.kv_tokens + 1)
    return items


def _v3_kv_per_token(cfg, eb: int = 2) -> float:
    return sum(B.kv_bytes_per_token_layer(cfg, eb)) * cfg.num_hidden_layers


def _v3_native(cfg) -> str | None:
    q = cfg.quantization
    return "int4" if q is not None and q.method == "int4" else None


def _v3_hot_format(cfg, expert_format: str) -> str:
    """V3 family: hot GPU experts are held in the shards' expert format."""
    return expert_format


def _v3_categories(cfg) -> tuple[str, ...]:
    drop = {"compressor", "mhc", "kv_window"} | (set() if cfg.is_v32 else {"indexer", "index_keys"})
    drop |= set() if getattr(cfg, "multimodal", None) else {"vision"}
    return tuple(c for c in B.CATEGORIES if c not in drop)


def _v4_categories(cfg) -> tuple[str, ...]:
    drop = {"dense_mlp", "vision"} | (set() if B4.CSA_RATIO in cfg.compress_ratios else {"indexer", "index_keys"})
    return tuple(c for c in B.CATEGORIES if c not in drop)


MLA = ArchBytes("mla", B.gpu_modules, _v3_kv_items, _v3_kv_per_token, B.workspace_bytes, _v3_native,
                _v3_hot_format, _v3_categories, V3_LABELS)
DEEPSEEK_V4 = ArchBytes("deepseek_v4", B4.gpu_modules_v4, B4.kv_layer_items_v4, B4.kv_bytes_per_token_v4,
                        B4.workspace_bytes_v4, B4.native_expert_format_v4, B4.hot_expert_format_v4,
                        _v4_categories, B4.V4_LABELS)


def arch_bytes(cfg) -> ArchBytes:
    """The byte model of `cfg` (a ModelConfig or a V4Config)."""
    return DEEPSEEK_V4 if cfg.is_v4 else MLA


def hot_expert_format(cfg, expert_format: str) -> str:
    """The format the hot GPU experts are held in (and counted at) when the shards' is `expert_format`."""
    return arch_bytes(cfg).hot_format(cfg, expert_format)


def gpu_modules(cfg) -> list[B.Module]:
    """Every non-routed parameter group of any supported model."""
    return arch_bytes(cfg).gpu_modules(cfg)


def kv_bytes_per_token(cfg, eb: int = 2) -> float:
    """KV pool bytes per token over all layers (V4: amortised compressed entries + indexer keys)."""
    return arch_bytes(cfg).kv_bytes_per_token(cfg, eb)


def param_counts(cfg) -> dict[str, int]:
    """{"routed", "non_routed", "total"} parameters of any supported model (MTP layers excluded)."""
    routed = len(cfg.moe_layers) * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    non = sum(m.params for m in gpu_modules(cfg) if not (cfg.tie_word_embeddings and m.category == "lm_head"))
    return {"routed": routed, "non_routed": non, "total": routed + non}
