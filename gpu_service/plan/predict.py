"""Predicted decode speed of a model on a box: the bytes each decode step reads on each side,
divided by that side's measured (or stated) ceiling, plus the hand-off per MoE layer.

For B concurrent streams (one decode step makes B tokens):

    D(B)      = E * (1 - (1 - k/E)^B)                   distinct routed experts a layer's B tokens pick
                                                        (uniform routing: hot-expert skew lowers it)
    cpu_bytes = L_moe * D(B) * (E - g)/E * expert_bytes  routed experts the shards read (g per layer on the GPU)
    cpu_ops   = L_moe * B * k * (E - g)/E * 6 * H * I    their ops (3 matrices of H x I, 2 per multiply-add)
    t_cpu     = max(cpu_bytes / cpu_read_bw, cpu_ops / cpu_dot_peak)
    gpu_bytes = non-routed weights (all but the embeddings) + hot experts * D(B)/E
                + B * context * kv_bytes_per_token
    t_gpu     = gpu_bytes / gpu_bw
    t_handoff = L_moe * (handoff_latency + 2 * B * H * 2 bytes / link_bw)
    t_step    = t_gpu + t_cpu + t_handoff               (no overlap of the two sides: the ping-pong
                                                        micro-batches of B >= 2 can hide some)
    tokens/s  = B / t_step

`predict` returns the terms and the result per B; `formula_lines` prints them. Torch-free.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from checkpoint.config import ModelConfig
from gpu_service.plan.bytes import dtype_bytes, expert_bytes, gpu_modules, module_bytes

FORMULA = __doc__.split("\n\n")[2].rstrip()  # the block above, printed with every prediction
# items of a plan's GPU table that a decode step reads in full (embeddings: B rows only; KV: by context)
READ_PER_STEP = ("attention", "indexer", "dense_mlp", "shared_experts", "routers", "norms", "lm_head")


@dataclass
class Side:
    """What the prediction knows of the box: ceilings measured by the doctor's probes or stated."""

    cpu_read_gbps: float
    cpu_dot_peak_gops: float | None  # the instruction the shards' GEMM runs on (None: bandwidth only)
    gpu_gbps: float
    handoff_us: float
    link_gbps: float
    sources: dict  # term -> where its value came from ("measured ...", "assumed ...", "--flag")


@dataclass
class ModelBytes:
    """The per-step byte sizes of a model as placed: the plan's or the local stack's."""

    experts_per_layer: int  # E
    top_k: int  # k
    moe_layers: int  # L_moe
    hidden: int  # H
    moe_intermediate: int  # I
    expert_bytes: int  # one routed expert on the shards (their format)
    expert_format: str
    gpu_experts: int  # g: hot experts per MoE layer on the GPU
    gpu_expert_bytes: int  # all hot experts on the GPU, bytes
    gpu_weight_bytes: int  # READ_PER_STEP items on the GPU
    kv_bytes_per_token: int  # all layers


def gpu_weight_bytes(cfg: ModelConfig, attention_weights: str, dtype: str) -> int:
    """Bytes of the READ_PER_STEP parameter groups for a resolved attention-weights format and dtype
    (what the local stack holds when the GPU side runs without a plan, e.g. on the CPU)."""
    eb = dtype_bytes(dtype)
    return sum(module_bytes(cfg, m, attention_weights, eb) for m in gpu_modules(cfg) if m.category in READ_PER_STEP)


def model_bytes_from_plan(cfg: ModelConfig, plan: dict) -> ModelBytes:
    """ModelBytes of a plan's JSON (`Plan.to_json()`): GPU items summed over its GPUs."""
    o = plan["options"]
    items: dict[str, int] = {}
    for g in plan["gpus"]:
        for k, v in g["items"].items():
            items[k] = items.get(k, 0) + v
    return ModelBytes(cfg.n_routed_experts, cfg.num_experts_per_tok, len(cfg.moe_layers), cfg.hidden_size,
                      cfg.moe_intermediate_size, expert_bytes(cfg, o["expert_format"], host=True), o["expert_format"],
                      int(o["gpu_experts"]), items.get("gpu_experts", 0),
                      sum(items.get(k, 0) for k in READ_PER_STEP), int(plan["kv_bytes_per_token"]))


def distinct_experts(E: int, k: int, B: int) -> float:
    """Expected distinct experts B tokens pick, each k of E uniformly."""
    return E * (1.0 - (1.0 - k / E) ** B)


def _sig(x: float, n: int = 4) -> float:
    """x to `n` significant digits (ms and tokens/s span six orders between a tiny model and Kimi)."""
    return float(f"{x:.{n}g}")


def predict_step(m: ModelBytes, s: Side, streams: int, context: int) -> dict:
    """The formula's terms and result for `streams` concurrent decodes at `context` tokens each."""
    E, k, B = m.experts_per_layer, m.top_k, streams
    D = distinct_experts(E, k, B)
    cpu_share = (E - m.gpu_experts) / E
    cpu_bytes = m.moe_layers * D * cpu_share * m.expert_bytes
    cpu_ops = m.moe_layers * B * k * cpu_share * 6.0 * m.hidden * m.moe_intermediate
    t_cpu_bw = cpu_bytes / (s.cpu_read_gbps * 1e9)
    t_cpu_ops = cpu_ops / (s.cpu_dot_peak_gops * 1e9) if s.cpu_dot_peak_gops else 0.0
    gpu_bytes = m.gpu_weight_bytes + m.gpu_expert_bytes * D / E + B * context * m.kv_bytes_per_token
    t_gpu = gpu_bytes / (s.gpu_gbps * 1e9)
    t_handoff = m.moe_layers * (s.handoff_us * 1e-6 + 2.0 * B * m.hidden * 2 / (s.link_gbps * 1e9))
    t_step = t_gpu + max(t_cpu_bw, t_cpu_ops) + t_handoff
    return {"streams": B, "distinct_experts_per_layer": round(D, 2), "cpu_bytes": int(cpu_bytes),
            "cpu_ops": int(cpu_ops), "t_cpu_bandwidth_ms": _sig(t_cpu_bw * 1e3),
            "t_cpu_compute_ms": _sig(t_cpu_ops * 1e3), "cpu_bound": "compute" if t_cpu_ops > t_cpu_bw else "bandwidth",
            "gpu_bytes": int(gpu_bytes), "t_gpu_ms": _sig(t_gpu * 1e3), "t_handoff_ms": _sig(t_handoff * 1e3),
            "t_step_ms": _sig(t_step * 1e3), "ms_per_token_per_stream": _sig(t_step * 1e3),
            "tokens_per_s": _sig(B / t_step)}


def predict(m: ModelBytes, s: Side, streams=(1, 32), context: int = 1024) -> dict:
    """{"formula", "inputs", "sides", "by_streams": {B: predict_step(...)}}: one JSON-able dict."""
    return {"formula": FORMULA, "inputs": dict(asdict(m), context_tokens=context), "sides": asdict(s),
            "by_streams": {int(b): predict_step(m, s, int(b), context) for b in streams}}


def formula_lines(p: dict) -> list[str]:
    """The prediction as text: the formula, its inputs with their sources, each B's terms."""
    m, s = p["inputs"], p["sides"]
    src = s["sources"]
    peak = f"{s['cpu_dot_peak_gops']:.1f} G ops/s" if s["cpu_dot_peak_gops"] else "none (bandwidth only)"
    lines = ["prediction (decode):", *p["formula"].splitlines(), "  where:",
             f"    E={m['experts_per_layer']} k={m['top_k']} L_moe={m['moe_layers']} H={m['hidden']} "
             f"I={m['moe_intermediate']} g={m['gpu_experts']} context={m['context_tokens']}",
             f"    expert_bytes={m['expert_bytes']:,} ({m['expert_format']}), non-routed GPU weights "
             f"{m['gpu_weight_bytes'] / 2**30:.2f} GiB, hot experts {m['gpu_expert_bytes'] / 2**30:.2f} GiB, "
             f"KV {m['kv_bytes_per_token']:,} B/token",
             f"    cpu_read_bw={s['cpu_read_gbps']:.2f} GB/s ({src.get('cpu_read_gbps', '?')})",
             f"    cpu_dot_peak={peak} ({src.get('cpu_dot_peak_gops', '?')})",
             f"    gpu_bw={s['gpu_gbps']:.0f} GB/s ({src.get('gpu_gbps', '?')})",
             f"    handoff_latency={s['handoff_us']:.0f} us/layer ({src.get('handoff_us', '?')}), "
             f"link_bw={s['link_gbps']:.1f} GB/s ({src.get('link_gbps', '?')})"]
    for b, r in p["by_streams"].items():
        lines.append(f"  B={b:>3}: D={r['distinct_experts_per_layer']:.1f}  t_cpu={max(r['t_cpu_bandwidth_ms'], r['t_cpu_compute_ms']):.3f} ms "
                     f"({r['cpu_bound']}: {r['cpu_bytes'] / 1e9:.3f} GB)  t_gpu={r['t_gpu_ms']:.3f} ms "
                     f"({r['gpu_bytes'] / 1e9:.3f} GB)  t_handoff={r['t_handoff_ms']:.3f} ms  "
                     f"t_step={r['t_step_ms']:.3f} ms  -> {r['tokens_per_s']:.1f} tokens/s")
    return lines
