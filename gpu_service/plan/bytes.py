"""The memory plan's byte model: what every item costs, from config.json alone (nothing is allocated).

Nothing is allocated. `make_plan` places every non-routed weight, the KV cache, the activation
workspace and optional GPU-resident hot experts on the GPUs given, places the routed experts on
CPU shards, and — for each option left at "auto" — searches for a configuration that fits.
The GPU service executes the plan; `param_bytes_by_module` lets it compare "planned vs allocated"
per module and device.

Byte model (every number below is a module constant or a formula in this file)
-------------------------------------------------------------------------------
Weights, per linear [out, in] of n = out*in parameters:
    bf16  2n
    fp8   n + 4 * ceil(out/128) * ceil(in/128)        e4m3 + f32 scale per 128x128 block
    int8  n + 4 * out                                 per-output-channel f32 scale
    int4  n/2 + 2 * out * ceil(in/32)                 packed int32 + bf16 scale per group of 32
  "checkpoint" = as stored: fp8 for DeepSeek/Kimi-K2 FP8 checkpoints, bf16 for the non-expert
  linears of Kimi-K2-Thinking (its INT4 `ignore` list), bf16 for BF16 checkpoints.
  Quantisable on the GPU: attention (q_a/q_b or q_proj, kv_a, kv_b, o_proj), V3.2 indexer wq_b/wk,
  shared experts and dense MLP. Always bf16: embeddings, lm_head, norms (q_a/kv_a norms are
  counted in "attention"), the V3.2 indexer weights_proj and k_norm. Routers: f32 weight and f32
  e_score_correction_bias (the model keeps router weights in f32).
KV cache, bf16, per token per layer: MLA c_kv + k_pe = kv_lora_rank + qk_rope_head_dim values
  (576 for every target model); V3.2 adds its indexer key, index_head_dim values ("index_keys").
  `kv_tokens` is the pool size shared by all running sequences; every layer holds all of it.
Workspace of one GPU (the largest layer it runs; T = chunk_tokens, Kb = min(kv_tokens, T)):
    act    = 2 * T * (3*H + max(A, 3*M))   bf16 residual/normed/output rows, plus the widest of
             A = q_lora + kv_lora + rope + heads*qk_head_dim + heads*v_head_dim (attention) and
             M = widest MLP on this GPU (dense intermediate, shared-expert or hot-expert width)
    attn   = 4*T*heads*Kb  + 2*Kb*heads*(qk_head_dim + v_head_dim) + 4*T*heads*v_head_dim
             fp32 scores of one key block, expanded K/V of the block, fp32 output accumulator:
             the expanded prefill path attends over the cache in key blocks of <= T tokens
             (online softmax); decode uses the absorbed path, which needs less.
    index  = 4*T*index_heads*Kb + 4*T*kv_tokens + 8*T*index_topk      (V3.2 only; runs before
             attention, so the workspace takes max(attn, index))
    moe    = 4*T*H + 12*T*top_k                 fp32 sum of shard partials, routing ids/weights
    logits = 2 * 4 * max_batch * vocab          fp32 logits + sampling probs (GPU with lm_head;
             only each sequence's last position is projected)
Reserve of one GPU: CUDA context 512 MiB (context, cuBLAS handles, kernel images; the user report
  shows ~350 MiB outside PyTorch) + allocator fragmentation max(256 MiB, 3% of capacity).
  `--gpu 24GiB` is taken as the card's total; a card that reports less (an RTX 3090 shows
  "total capacity of 23.56 GiB") should be given its reported total for an exact plan.
CPU shard (one per NUMA node; intermediate-slice split: shard i holds rows/cols i/n of every
  expert's intermediate dimension): weights in the expert format (formula above, per slice)
  + buffers 4*(2*T*H + T*top_k*(H + 3*I_slice)) + 1 GiB process baseline.
Host RAM = all shards + GPU service host side (4 GiB + embeddings when they live on the CPU)
  + 8 GiB for the OS; checked against --host-ram when given.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass

from checkpoint.config import ModelConfig

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

CUDA_CONTEXT_BYTES = 512 * MiB
FRAGMENTATION_FRACTION = 0.03
FRAGMENTATION_MIN_BYTES = 256 * MiB
DEFAULT_KV_TARGET = 65536
DEFAULT_MIN_KV_TOKENS = 4096
DEFAULT_CHUNK_TOKENS = 2048
DEFAULT_MAX_BATCH = 16
KV_ROUND = 256
SHARD_BASELINE_BYTES = 1 * GiB
GPU_SERVICE_HOST_BYTES = 4 * GiB
HOST_OS_RESERVE_BYTES = 8 * GiB
FP8_BLOCK = (128, 128)
INT4_GROUP = 32

ATTENTION_WEIGHTS = ("auto", "checkpoint", "bf16", "fp8", "int8")
EMBEDDINGS = ("auto", "gpu", "cpu")
EXPERT_FORMATS = ("auto", "bf16", "int8", "int4")
PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")

# GPU item categories, in table order
CATEGORIES = ("embeddings", "attention", "indexer", "dense_mlp", "shared_experts", "routers", "norms",
              "lm_head", "kv_cache", "index_keys", "gpu_experts", "workspace", "reserve")


# ------------------------------------------------------------------------------------- sizes
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": KiB, "ki": KiB, "m": 1000**2, "mb": 1000**2,
          "mib": MiB, "mi": MiB, "g": 1000**3, "gb": 1000**3, "gib": GiB, "gi": GiB,
          "t": 1000**4, "tb": 1000**4, "tib": TiB, "ti": TiB}


def parse_size(s: str | int | float) -> int:
    """"24GiB" -> 25769803776. GB/MB/KB/TB (and G/M/K/T) are powers of 1000, GiB/MiB/KiB/TiB
    (and Gi/Mi/Ki/Ti) powers of 1024; a bare number is bytes. Raises ValueError otherwise."""
    if isinstance(s, (int, float)) and not isinstance(s, bool):
        return int(s)
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(s))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"cannot read size {s!r}; write e.g. 24GiB, 16GB, 768GiB, 512MiB")
    return int(round(float(m.group(1)) * _UNITS[unit]))


def fmt_gib(n: int | float) -> str:
    return f"{n / GiB:.2f} GiB"


# ----------------------------------------------------------------------------- weight bytes
def linear_bytes(out: int, inp: int, fmt: str, fp8_block: tuple[int, int] = FP8_BLOCK) -> int:
    """Bytes of one linear weight [out, inp] stored in `fmt` (see the module docstring); an FP8
    checkpoint kept as stored has its own scale blocks (quantization_config.weight_block_size)."""
    n = out * inp
    if fmt == "bf16":
        return 2 * n
    if fmt == "fp8":
        return n + 4 * math.ceil(out / fp8_block[0]) * math.ceil(inp / fp8_block[1])
    if fmt == "int8":
        return n + 4 * out
    if fmt == "int4":
        return 4 * out * math.ceil(inp / 8) + 2 * out * math.ceil(inp / INT4_GROUP)
    raise ValueError(f"unknown weight format {fmt!r}; expected bf16, fp8, int8 or int4")


@dataclass(frozen=True)
class Module:
    """One GPU-side parameter group. linears: quantisable [out, in] weights (with their checkpoint
    names for the INT4 ignore list); bf16/f32: element counts of always-unquantised tensors."""

    name: str
    category: str
    layer: int | None
    linears: tuple[tuple[str, int, int], ...] = ()
    bf16: int = 0
    f32: int = 0

    @property
    def params(self) -> int:
        return sum(o * i for _, o, i in self.linears) + self.bf16 + self.f32


def gpu_modules(cfg: ModelConfig) -> list[Module]:
    """Every non-routed parameter group of the model (MTP layers excluded: not served)."""
    H, V, nh = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads
    mods = [Module("model.embed_tokens", "embeddings", None, bf16=V * H)]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        mods.append(Module(p + "input_layernorm", "norms", i, bf16=H))
        a = p + "self_attn."
        if cfg.q_lora_rank:
            q = ((a + "q_a_proj", cfg.q_lora_rank, H), (a + "q_b_proj", nh * cfg.qk_head_dim, cfg.q_lora_rank))
            qnorm = cfg.q_lora_rank
        else:
            q, qnorm = ((a + "q_proj", nh * cfg.qk_head_dim, H),), 0
        lin = q + ((a + "kv_a_proj_with_mqa", cfg.kv_cache_dim, H),
                   (a + "kv_b_proj", nh * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
                   (a + "o_proj", H, nh * cfg.v_head_dim))
        mods.append(Module(p + "self_attn", "attention", i, lin, bf16=qnorm + cfg.kv_lora_rank))
        if cfg.is_v32:
            x, hd, ih = a + "indexer.", cfg.index_head_dim, cfg.index_n_heads
            mods.append(Module(p + "self_attn.indexer", "indexer", i,
                               ((x + "wq_b", ih * hd, cfg.q_lora_rank or H), (x + "wk", hd, H)),
                               bf16=ih * H + 2 * hd))  # weights_proj [ih, H], k_norm weight + bias
        mods.append(Module(p + "post_attention_layernorm", "norms", i, bf16=H))
        m = p + "mlp."
        if cfg.is_moe_layer(i):
            if cfg.n_shared_experts:
                I = cfg.n_shared_experts * cfg.moe_intermediate_size
                s = m + "shared_experts."
                mods.append(Module(p + "mlp.shared_experts", "shared_experts", i,
                                   ((s + "gate_proj", I, H), (s + "up_proj", I, H), (s + "down_proj", H, I))))
            mods.append(Module(p + "mlp.gate", "routers", i, f32=cfg.n_routed_experts * H + cfg.n_routed_experts))
        else:
            I = cfg.intermediate_size
            mods.append(Module(p + "mlp", "dense_mlp", i,
                               ((m + "gate_proj", I, H), (m + "up_proj", I, H), (m + "down_proj", H, I))))
    mods.append(Module("model.norm", "norms", None, bf16=H))
    mods.append(Module("lm_head", "lm_head", None, bf16=V * H))
    return mods


def param_counts(cfg: ModelConfig) -> dict[str, int]:
    """{"routed": ..., "non_routed": ..., "total": ...} parameters (MTP layers excluded)."""
    routed = len(cfg.moe_layers) * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    mods = gpu_modules(cfg)
    non = sum(m.params for m in mods if not (cfg.tie_word_embeddings and m.category == "lm_head"))
    return {"routed": routed, "non_routed": non, "total": routed + non}


def _int4_ignored(cfg: ModelConfig, linear_name: str) -> bool:
    for pat in cfg.quantization.ignore:
        if pat.startswith("re:"):
            if re.match(pat[3:], linear_name):
                return True
        elif linear_name == pat or linear_name.startswith(pat + "."):
            return True
    return False


def checkpoint_format(cfg: ModelConfig, linear_name: str) -> str:
    """How the checkpoint stores one non-expert linear: bf16, fp8 or int4."""
    q = cfg.quantization
    if q is None:
        return "bf16"
    if q.method == "fp8":
        return "fp8"
    return "bf16" if _int4_ignored(cfg, linear_name) else "int4"


@dataclass(frozen=True)
class Options:
    """Resolved plan options (no "auto" left)."""

    attention_weights: str  # checkpoint|bf16|fp8|int8
    embeddings: str  # gpu|cpu
    expert_format: str  # bf16|int8|int4
    gpu_experts: int
    kv_tokens: int
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS
    max_batch: int = DEFAULT_MAX_BATCH


def module_bytes(cfg: ModelConfig, mod: Module, attention_weights: str) -> int:
    b = 2 * mod.bf16 + 4 * mod.f32
    for name, o, i in mod.linears:
        fmt = checkpoint_format(cfg, name) if attention_weights == "checkpoint" else attention_weights
        b += linear_bytes(o, i, fmt, fp8_block(cfg) if attention_weights == "checkpoint" else FP8_BLOCK)
    return b


def fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    """Scale block of the checkpoint's FP8 linears ((128, 128) for DeepSeek's and Kimi's)."""
    q = cfg.quantization
    return tuple(q.block_size) if q is not None and q.method == "fp8" else FP8_BLOCK


def param_bytes_by_module(cfg: ModelConfig, options: Options | dict | str = "checkpoint") -> dict[str, int]:
    """{module name: bytes} of every GPU-side parameter group with the given attention-weights
    format (an `Options`, a dict with "attention_weights", or the format string). Names are the
    model's module paths (model.layers.{i}.self_attn, ...mlp.shared_experts, ...mlp.gate, lm_head)."""
    aw = options if isinstance(options, str) else (
        options["attention_weights"] if isinstance(options, dict) else options.attention_weights)
    if aw not in ATTENTION_WEIGHTS[1:]:
        raise ValueError(f"attention_weights {aw!r} must be resolved: one of {ATTENTION_WEIGHTS[1:]}")
    return {m.name: module_bytes(cfg, m, aw) for m in gpu_modules(cfg)}


def expert_bytes(cfg: ModelConfig, fmt: str, inter: int | None = None) -> int:
    """Bytes of one routed expert (or of an intermediate slice of `inter` rows of it)."""
    I, H = inter if inter is not None else cfg.moe_intermediate_size, cfg.hidden_size
    return 2 * linear_bytes(I, H, fmt) + linear_bytes(H, I, fmt)


def kv_bytes_per_token_layer(cfg: ModelConfig) -> tuple[int, int]:
    """(MLA c_kv + k_pe bytes, V3.2 indexer key bytes) per token per layer, bf16."""
    return 2 * cfg.kv_cache_dim, (2 * cfg.index_head_dim if cfg.is_v32 else 0)


def gpu_reserve(capacity: int) -> int:
    return CUDA_CONTEXT_BYTES + max(FRAGMENTATION_MIN_BYTES, int(FRAGMENTATION_FRACTION * capacity))


def workspace_bytes(cfg: ModelConfig, o: Options, *, mlp_width: int, lm_head: bool) -> int:
    """Activation workspace of one GPU (formula in the module docstring)."""
    T, H, nh = o.chunk_tokens, cfg.hidden_size, cfg.num_attention_heads
    Kb = min(o.kv_tokens, T)
    A = (cfg.q_lora_rank or 0) + cfg.kv_cache_dim + nh * cfg.qk_head_dim + nh * cfg.v_head_dim
    act = 2 * T * (3 * H + max(A, 3 * mlp_width))
    attn = 4 * T * nh * Kb + 2 * Kb * nh * (cfg.qk_head_dim + cfg.v_head_dim) + 4 * T * nh * cfg.v_head_dim
    index = 0
    if cfg.is_v32:
        index = 4 * T * cfg.index_n_heads * Kb + 4 * T * o.kv_tokens + 8 * T * cfg.index_topk
    moe = 4 * T * H + 12 * T * cfg.num_experts_per_tok
    logits = 2 * 4 * o.max_batch * cfg.vocab_size if lm_head else 0
    return act + max(attn, index) + moe + logits


# ------------------------------------------------------------------------------- the plan
