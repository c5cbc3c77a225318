"""The memory plan's byte model: what every item costs, from config.json alone (nothing is allocated).

`gpu_service.plan.search.make_plan` places the items and searches the auto options;
`param_bytes_by_module` lets the GPU service compare "planned vs allocated" per module and device.
Every number is a module constant or a formula here; docs/plan.md ("Byte model") writes them out.
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
MXFP4_GROUP = 32
MXFP4_HOST_GROUP_BYTES = 17  # one channel's 32 inputs on the shards: 16 bytes of e2m1 codes + the e8m0 byte
QLINEAR_ROWS = 1024  # weight rows a quantised linear dequantises at once (a multiple of 128, the FP8 block)
INDEX_SCORE_ELEMS = 1 << 26  # fp32 V3.2 index scores [queries, heads, S] the indexer holds at once

ATTENTION_WEIGHTS = ("auto", "checkpoint", "bf16", "fp8", "int8")
EMBEDDINGS = ("auto", "gpu", "cpu")
EXPERT_FORMATS = ("auto", "bf16", "int8", "int4", "mxfp4")  # mxfp4: DeepSeek-V4 checkpoints' own only
# bytes per element of the compute dtype: unquantised weights ("bf16" items), KV cache, activations
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
DTYPES = tuple(DTYPE_BYTES)


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a compute dtype name ("bfloat16", "float16", "float32")."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r}: expected one of {DTYPES}")
    return DTYPE_BYTES[dtype]
PRESETS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "presets")

# GPU item categories, in table order
CATEGORIES = ("embeddings", "vision", "attention", "indexer", "compressor", "mhc", "dense_mlp", "shared_experts", "routers",
              "norms", "lm_head", "kv_cache", "index_keys", "kv_window", "gpu_experts", "workspace", "reserve")


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
def linear_bytes(out: int, inp: int, fmt: str, fp8_block: tuple[int, int] = FP8_BLOCK, eb: int = 2,
                 host: bool = False) -> int:
    """Bytes of one linear [out, inp] in `fmt`; "bf16" is held in the compute dtype (`eb` bytes). `host`:
    as the CPU shards' kernels hold it (differs for "mxfp4" only)."""
    n = out * inp
    if fmt == "bf16":
        return eb * n
    if fmt == "fp8":
        return n + 4 * math.ceil(out / fp8_block[0]) * math.ceil(inp / fp8_block[1])
    if fmt == "int8":
        return n + 4 * out
    if fmt == "int4":
        return 4 * out * math.ceil(inp / 8) + 2 * out * math.ceil(inp / INT4_GROUP)
    if fmt == "mxfp4":  # DeepSeek-V4 experts: e2m1 codes two a byte + one e8m0 scale per 32 inputs
        groups = math.ceil(inp / MXFP4_GROUP)
        if host:  # the kernels' panels: 32 channels x 32 inputs in 544 bytes (16 of codes + the e8m0 byte as
            # stored per channel: 4.25 bits a weight), channels padded to the panel's 32
            return MXFP4_HOST_GROUP_BYTES * (math.ceil(out / MXFP4_GROUP) * MXFP4_GROUP) * groups
        # the GPU's hot experts (qlinear.Mxfp4Linear): the scale as a bf16 power of two, 4.5 bits a weight
        return out * math.ceil(inp / 2) + 2 * out * groups
    raise ValueError(f"unknown weight format {fmt!r}; expected bf16, fp8, int8, int4 or mxfp4")


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
    i64: int = 0  # integer tables (DeepSeek-V4's hash-routing tid2eid)

    @property
    def params(self) -> int:
        return sum(o * i for _, o, i in self.linears) + self.bf16 + self.f32 + self.i64


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
    dtype: str = "bfloat16"  # compute dtype: bytes of unquantised weights, KV cache and activations
    cuda_graphs: bool = True  # decode pieces as CUDA graphs per batch-size bucket (their pools)

    @property
    def eb(self) -> int:
        return dtype_bytes(self.dtype)


def module_bytes(cfg: ModelConfig, mod: Module, attention_weights: str, eb: int = 2) -> int:
    """Bytes of one parameter group; `eb` bytes per element of the compute dtype."""
    b = eb * mod.bf16 + 4 * mod.f32 + 8 * mod.i64
    for name, o, i in mod.linears:
        fmt = checkpoint_format(cfg, name) if attention_weights == "checkpoint" else attention_weights
        b += linear_bytes(o, i, fmt, fp8_block(cfg) if attention_weights == "checkpoint" else FP8_BLOCK, eb)
    return b


def fp8_block(cfg: ModelConfig) -> tuple[int, int]:
    """Scale block of the checkpoint's FP8 linears ((128, 128) for DeepSeek's and Kimi's)."""
    q = cfg.quantization
    return tuple(q.block_size) if q is not None and q.method == "fp8" else FP8_BLOCK


def param_bytes_by_module(cfg: ModelConfig, options: Options | dict | str = "checkpoint") -> dict[str, int]:
    """{module name: bytes} of every GPU-side parameter group for an attention-weights format (an
    `Options`, a dict with "attention_weights", or the format string)."""
    aw = options if isinstance(options, str) else (
        options["attention_weights"] if isinstance(options, dict) else options.attention_weights)
    dt = "bfloat16" if isinstance(options, str) else (
        options.get("dtype", "bfloat16") if isinstance(options, dict) else options.dtype)
    if aw not in ATTENTION_WEIGHTS[1:]:
        raise ValueError(f"attention_weights {aw!r} must be resolved: one of {ATTENTION_WEIGHTS[1:]}")
    if cfg.is_v4:
        raise ValueError("param_bytes_by_module is the MLA byte model; for DeepSeek-V4 use "
                         "gpu_service.plan.arch.gpu_modules with module_bytes")
    return {m.name: module_bytes(cfg, m, aw, dtype_bytes(dt)) for m in gpu_modules(cfg)}


def expert_bytes(cfg: ModelConfig, fmt: str, inter: int | None = None, eb: int = 2, host: bool = False) -> int:
    """Bytes of one routed expert (or of an intermediate slice of `inter` rows of it); a "bf16"
    expert on the GPU is held in the compute dtype (`eb` bytes), on the shards in bf16. `host`: as a
    CPU shard holds it (`linear_bytes`), else as the GPU holds a hot expert."""
    I, H = inter if inter is not None else cfg.moe_intermediate_size, cfg.hidden_size
    return 2 * linear_bytes(I, H, fmt, eb=eb, host=host) + linear_bytes(H, I, fmt, eb=eb, host=host)


def kv_bytes_per_token_layer(cfg: ModelConfig, eb: int = 2) -> tuple[int, int]:
    """(MLA c_kv + k_pe bytes, V3.2 indexer key bytes) per token per layer, in the compute dtype."""
    return eb * cfg.kv_cache_dim, (eb * cfg.index_head_dim if cfg.is_v32 else 0)


def gpu_reserve(capacity: int) -> int:
    return CUDA_CONTEXT_BYTES + max(FRAGMENTATION_MIN_BYTES, int(FRAGMENTATION_FRACTION * capacity))


def qlinear_scratch_bytes(out: int, inp: int, fmt: str, eb: int) -> int:
    """The reused dequantisation scratch of a weight-only linear [out, inp] (0 unquantised)."""
    if fmt == "bf16":
        return 0
    rows = min(QLINEAR_ROWS, out)
    if fmt == "int4":
        cols = 8 * math.ceil(inp / 8)
        return eb * rows * cols + rows * cols
    if fmt == "mxfp4":  # Mxfp4Linear: + the rows' code bytes as int32 (the pair table's index)
        return eb * rows * inp + 4 * rows * math.ceil(inp / 2)
    return eb * rows * inp


def kv_b_dequantised(cfg: ModelConfig, o: Options) -> bool:
    """Whether kv_b_proj is held quantised, so each step dequantises it once into the workspace."""
    if o.attention_weights == "checkpoint":
        q = cfg.quantization
        return q is not None and q.method == "fp8"
    return o.attention_weights in ("fp8", "int8")


GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32)  # the CUDA-graph batch-size buckets (plus powers of 2 to max_batch)
GRAPH_SLOTS = 2  # micro-batches of one step (ping-pong): each has its own graph sets
MIN_KEYS = 64  # gpu_service.attention.meta.MIN_KEYS: a decode query's padded key columns at least


def graph_buckets(max_batch: int) -> tuple[int, ...]:
    """The batch-size buckets the runner captures (ModelRunner.set_cuda_graphs)."""
    top = max(max_batch, GRAPH_BUCKETS[-1])
    return tuple(sorted(set(GRAPH_BUCKETS) | {1 << i for i in range(top.bit_length()) if (1 << i) <= top}))


def decode_workspace_bytes(cfg: ModelConfig, o: Options, *, mlp_width: int) -> int:
    """The batched decode attention and the fused decode step at max_batch rows (docs/plan.md "Byte model")."""
    B, eb, H, nh = o.max_batch, o.eb, cfg.hidden_size, cfg.num_attention_heads
    r, rope, K = cfg.kv_lora_rank, cfg.qk_rope_head_dim, o.kv_tokens + o.max_batch * MIN_KEYS
    twin = 0 if eb == 4 else eb
    attn = eb * cfg.kv_cache_dim * K + (2 * eb + 8 + twin) * nh * K  # gather; scores, fp32 copy, softmax
    meta = 9 * B * K  # the step's padded slots (int64) and their mask, for the whole batch
    if cfg.is_v32:  # the indexer's selection (row groups of at most K keys) before attention, then its mask
        ih, hd = cfg.index_n_heads, cfg.index_head_dim
        attn = max(attn, (eb + 4) * hd * K + 8 * ih * K + 8 * K) + B * K  # keys, f32 keys, scores, index; keep
    A = (cfg.q_lora_rank or 0) + cfg.kv_cache_dim + nh * (cfg.qk_head_dim + 2 * rope + r)
    rows = eb * B * (4 * H + max(A, 3 * mlp_width) + nh * r) + 8 * B * 2 * rope  # segments + step buffers
    return attn + meta + rows


def graph_pool_bytes(cfg: ModelConfig, o: Options, *, layers: int, mlp_width: int) -> int:
    """CUDA-graph pools: per micro-batch slot and bucket, one layer's static buffers and one set of
    temporaries, plus the dequantised kv_b_proj buffer graphs read."""
    if not o.cuda_graphs or not layers:
        return 0
    eb, H, nh, r, rope = o.eb, cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    k, E = cfg.num_experts_per_tok, cfg.n_routed_experts
    row_static = eb * (nh * (r + rope) + nh * r + (r + rope) + 6 * H) + 12 * k + 8 * rope
    A = (cfg.q_lora_rank or 0) + cfg.kv_cache_dim + nh * (cfg.qk_head_dim + 2 * rope + r)
    row_tmp = eb * (A + 3 * mlp_width + 2 * H) + 8 * E
    if cfg.is_v32:  # pre's indexer outputs (roped f32 queries, head weights, new index key) and temporaries
        ih, hd = cfg.index_n_heads, cfg.index_head_dim
        row_static += 4 * ih * hd + 4 * ih + eb * hd
        row_tmp += (eb + 8) * ih * hd + 4 * ih + 3 * eb * hd
    wkv = eb * nh * (cfg.qk_nope_head_dim + cfg.v_head_dim) * r if kv_b_dequantised(cfg, o) else 0
    return GRAPH_SLOTS * sum(graph_buckets(o.max_batch)) * (row_static + row_tmp) + wkv


def workspace_bytes(cfg: ModelConfig, o: Options, *, mlp_width: int, lm_head: bool, scratch: int = 0,
                    layers: int = 0) -> int:
    """Activation workspace of one GPU (docs/plan.md "Byte model"), CUDA-graph pools included."""
    T, H, nh, eb, kv = o.chunk_tokens, cfg.hidden_size, cfg.num_attention_heads, o.eb, o.kv_tokens
    Kb = min(kv, T)
    nope, rope, v, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    A = (cfg.q_lora_rank or 0) + cfg.kv_cache_dim + nh * (cfg.qk_head_dim + rope + v)
    act = eb * T * (3 * H + max(A, 3 * mlp_width))
    twin = 0 if eb == 4 else eb  # a 16-bit score block beside its fp32 copy, for one op
    common = (eb * cfg.kv_cache_dim + 8) * kv  # the sequence's cache gathered from the pool, its slots
    if kv_b_dequantised(cfg, o):
        common += eb * nh * (nope + v) * r  # kv_b_proj dequantised once per step
    attn = ((4 + twin) * T * nh * Kb + T * Kb + eb * Kb * nh * (nope + v) + (4 + eb) * T * nh * v)
    index = 0
    if cfg.is_v32:
        ih, hd = cfg.index_n_heads, cfg.index_head_dim
        common += eb * hd * kv  # the sequence's index keys gathered
        attn += T * kv  # the selection mask, alive through attention
        index = (4 * min(T * ih * kv, max(INDEX_SCORE_ELEMS, ih * kv)) + 7 * T * kv
                 + 12 * T * cfg.index_topk + 2 * eb * T * ih * hd + 4 * T * ih)
    moe = 4 * T * H + 12 * T * cfg.num_experts_per_tok
    logits = 2 * 4 * o.max_batch * cfg.vocab_size if lm_head else 0
    decode = decode_workspace_bytes(cfg, o, mlp_width=mlp_width)
    graphs = graph_pool_bytes(cfg, o, layers=layers, mlp_width=mlp_width)
    return act + max(common + max(attn, index), decode) + moe + logits + scratch + graphs


# ------------------------------------------------------------------------------- the plan
