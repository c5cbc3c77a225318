"""The memory plan's report (`moesplit plan`'s table) and its model input (checkpoint, config.json, preset)."""
from __future__ import annotations

import json
import os

from checkpoint.config import ConfigError, ModelConfig
from checkpoint.config_v4 import V4Config, config_from_dict, load_any_config
from gpu_service.plan.arch import arch_bytes, kv_bytes_per_token, param_counts
from gpu_service.plan.bytes import CATEGORIES, fmt_gib, PRESETS_DIR
from gpu_service.plan.vision import vision_bytes


def _hot_note(cfg, o) -> str:
    """" (fp8)" when the hot GPU experts are held in another format than the shards' (V4 FP8 experts)."""
    hot = arch_bytes(cfg).hot_format(cfg, o.expert_format)
    return f" ({hot})" if o.gpu_experts and hot != o.expert_format else ""


def render_table(p: "Plan") -> str:  # a gpu_service.plan.search.Plan
    cfg, o = p.cfg, p.options
    A = arch_bytes(cfg)
    c = param_counts(cfg)
    lines = [f"moesplit plan: {p.model} ({cfg.architecture}, {cfg.num_hidden_layers} layers, "
             f"{len(cfg.moe_layers)} MoE x {cfg.n_routed_experts} experts)",
             f"parameters: {c['total']:,} = {c['routed']:,} routed (CPU shards) + {c['non_routed']:,} other",
             f"options: attention-weights {o.attention_weights}, embeddings {o.embeddings}, expert-format "
             f"{o.expert_format}, gpu-experts {o.gpu_experts}/layer{_hot_note(cfg, o)}, kv-tokens {o.kv_tokens}, "
             f"chunk-tokens {o.chunk_tokens}, max-batch {o.max_batch}, dtype {o.dtype}"]
    vb = vision_bytes(cfg, o.eb) if not cfg.is_v4 else None
    if vb:
        lines.append(f"vision tower + projector on cuda:0: {vb['params']:,} parameters = {fmt_gib(vb['weights'])}, "
                     f"workspace {fmt_gib(vb['workspace'])} (largest image: {vb['patches']:,} patches), "
                     f"embedding cache {fmt_gib(vb['cache'])}")
    lines.append("")
    w0 = 22
    cats = [k for k in CATEGORIES if any(k in g.items for g in p.gpus)]
    hdr = "GPU".ljust(w0) + "".join(g.device.rjust(13) for g in p.gpus)
    lines += [hdr, "-" * len(hdr)]

    def row(label: str, vals: list[str]) -> str:
        return label.ljust(w0) + "".join(v.rjust(13) for v in vals)

    lr = [f"{g.layers[0]}-{g.layers[-1]}" if g.layers else "-" for g in p.gpus]
    lines.append(row("layers", lr))
    for k in cats:
        lines.append(row(A.label(k), [fmt_gib(g.items.get(k, 0)) for g in p.gpus]))
    lines.append("-" * len(hdr))
    lines.append(row("used", [fmt_gib(g.used_bytes) for g in p.gpus]))
    lines.append(row("capacity", [fmt_gib(g.capacity_bytes) for g in p.gpus]))
    lines.append(row("free", [fmt_gib(g.free_bytes) for g in p.gpus]))
    kvb = kv_bytes_per_token(cfg, o.eb)
    lines += ["", f"KV cache: {o.kv_tokens} tokens x {kvb:,.6g} B/token (all layers)"]
    if cfg.is_v4:
        lines.append(f"  (compressed entries + indexer keys, amortised; window {cfg.sliding_window} tokens + "
                     f"compressor state per sequence x {o.max_batch}: {fmt_gib(sum(g.items.get('kv_window', 0) for g in p.gpus))})")
    lines += ["",
              f"CPU shards ({len(p.shards)}, {o.expert_format} experts):"]
    for s in p.shards:
        what = f"slice {s.slice[0]}/{s.slice[1]}" if s.slice else f"experts {s.experts[0]}-{s.experts[1] - 1}"
        lines.append(f"  shard {s.index}  numa {s.numa_node}  {what:<16} weights {fmt_gib(s.weight_bytes):>12}"
                     f"  RAM {fmt_gib(s.ram_bytes):>12}")
    h = p.host
    cap = fmt_gib(h["capacity_bytes"]) if h["capacity_bytes"] is not None else "unchecked (no --host-ram)"
    lines.append(f"host RAM: needs {fmt_gib(h['required_bytes'])} (shards + GPU service + OS) of {cap}")
    if h.get("host_kv_tier") is False:
        lines.append("host KV cache (prefix cache tier): none (this architecture's prefix cache stays on the GPU)")
    elif h.get("host_kv_cache_bytes") is not None:
        lines.append(f"host KV cache (prefix cache tier): {fmt_gib(h['host_kv_cache_bytes'])} = "
                     f"{h['host_kv_cache_tokens']:,} cached tokens")
    else:
        lines.append("host KV cache (prefix cache tier): sized at start from free RAM (give --host-ram to plan it)")
    lines += ["", "choices:"] + [f"  - {x}" for x in p.choices]
    if p.fits:
        lines += ["", "FITS"]
    else:
        where = [f"{g.device} short by {fmt_gib(-g.free_bytes)}" for g in p.gpus if g.free_bytes < 0]
        if not h["fits"]:
            where.append(f"host RAM short by {fmt_gib(h['missing_bytes'])}")
        lines += ["", f"DOES NOT FIT: {fmt_gib(p.missing_bytes)} missing ({'; '.join(where)})"]
        if p.suggestions:
            lines.append("options that would fit (each verified by re-planning):")
            for s in p.suggestions:
                used = ", ".join(f"{fmt_gib(u)}/{fmt_gib(cp)}"
                                 for u, cp in zip(s["gpu_used_bytes"], s["gpu_capacity_bytes"]))
                lines.append(f"  {s['args']:<40} kv-tokens {s['kv_tokens']}, "
                             f"gpu-experts {s['gpu_experts']}, GPU {used}")
        else:
            lines.append("no single option change fits; add GPU memory or host RAM")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ model input
def presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(PRESETS_DIR) if f.endswith(".json"))


def load_model_config(spec: str) -> tuple[ModelConfig | V4Config, str]:
    """--model: a checkpoint directory, a config.json path, or a preset name. Returns (cfg, name)."""
    if os.path.exists(spec):
        cfg = load_any_config(spec)
        base = spec if os.path.isdir(spec) else os.path.dirname(os.path.abspath(spec))
        return cfg, os.path.basename(os.path.normpath(base)) or spec
    path = os.path.join(PRESETS_DIR, f"{spec}.json")
    if os.path.exists(path):
        with open(path) as f:
            return config_from_dict(json.load(f), source=path), spec
    raise ConfigError(f"--model {spec!r} is neither a checkpoint directory, a config.json nor a preset; "
                      f"presets: {', '.join(presets())}")
