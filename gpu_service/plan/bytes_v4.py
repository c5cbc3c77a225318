"""The memory plan's byte model for DeepSeek-V4 (`checkpoint.config_v4.V4Config`); docs/v4.md writes
every formula out. gpu_service.plan.arch picks this module or the V3 one (gpu_service.plan.bytes).

What differs from V3 (MLA):
- GPU weights: per layer q_a/q_b (per-head 512-dim queries), one shared KV head `wkv`, the grouped
  output projection `wo_a` / `wo_b`, per-head sinks, the KV compressors (bf16) and on CSA layers
  the lightning indexer (FP8 wq_b, bf16 weights_proj and its own compressor), mHC mixing (f32),
  a router with either a correction bias or a hash table (`tid2eid`, int64).
- KV: every layer keeps a sliding window of `sliding_window` tokens per running sequence (a ring,
  max_batch of them) and its compressor's pending tokens (f32 kv + score); CSA layers add one
  compressed entry (head_dim values) and one indexer key (index_head_dim values) per 4 tokens of
  the pool, HCA layers one entry per `ratio` tokens. The pool of `kv_tokens` tokens therefore costs
  (head_dim + index_head_dim)/4 values per token on a CSA layer and head_dim/ratio on an HCA layer.
- Workspace: as the torch model computes a layer step (measured by tests/test_peak_memory_v4.py): the
  mHC streams, the projections, then the largest of the attention core (a block of ATTN_BLOCK queries'
  logits and probabilities over window + chunk + its keys: every entry of an HCA layer, a CSA
  query's gathered index_topk picks), the indexer (f32 scores of INDEX_BLOCK queries and every head
  over all of the sequence's CSA entries) and the compressor; the larger of a prefill chunk's and a
  decode batch's step (every row at once), and with CUDA graphs one pool per batch bucket.
- Experts: MXFP4 as each side holds it: on the shards the e8m0 byte as stored (`linear_bytes(..., "mxfp4",
  host=True)`: 4.25 bits a weight, the kernels' panels), as hot GPU experts the scale as bf16 (4.5 bits,
  `Mxfp4Linear`);
  FP8 experts (Pro-style base releases) as stored as hot GPU experts (`linear_bytes(..., "fp8")`: e4m3
  bytes + an f32 scale per 128x128 block, as `Fp8Linear` holds them), the shards' format searched.
"""
from __future__ import annotations

import math

from checkpoint.config_v4 import CSA_RATIO, V4Config
from gpu_service.model.v4.blocks import ATTN_BLOCK, DECODE_INDEX_BLOCK, INDEX_BLOCK
from gpu_service.plan.bytes import checkpoint_format, Module, Options, graph_buckets

F32 = 4
V4_HOT_FORMATS = ("mxfp4", "fp8")  # hot GPU experts the V4 model holds: the checkpoint's experts as stored
# categories a V4 GPU plan shows (gpu_service.plan.bytes.CATEGORIES order; "kv_window" and "kv_state" are V4's)
V4_LABELS = {"attention": "attention (V4)", "indexer": "indexer (CSA)", "compressor": "KV compressors",
             "mhc": "mHC mixing", "kv_cache": "KV compressed", "index_keys": "indexer keys",
             "kv_window": "KV window + state"}


def compressor_width(cfg: V4Config, ratio: int) -> int:
    """Output width of a layer's KV compressor: 2*head_dim for CSA (overlapping), head_dim for HCA."""
    return (2 if ratio == CSA_RATIO else 1) * cfg.head_dim


def gpu_modules_v4(cfg: V4Config) -> list[Module]:
    """Every non-routed parameter group of a V4 model, GPU-side (MTP block excluded: not served)."""
    D, V, H, hd = cfg.hidden_size, cfg.vocab_size, cfg.num_attention_heads, cfg.head_dim
    ql, G, ol, E = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.n_routed_experts
    hc = cfg.hc_mult
    mix = (2 + hc) * hc
    mods = [Module("embed", "embeddings", None, bf16=V * D)]
    for i in range(cfg.num_hidden_layers):
        p, a, r = f"layers.{i}.", f"layers.{i}.attn.", cfg.compress_ratios[i]
        mods.append(Module(p + "norms", "norms", i, bf16=2 * D))
        mods.append(Module(p + "hc", "mhc", i, f32=2 * (mix * hc * D + mix + 3)))
        mods.append(Module(p + "attn", "attention", i,
                           ((a + "wq_a", ql, D), (a + "wq_b", H * hd, ql), (a + "wkv", hd, D),
                            (a + "wo_a", G * ol, H * hd // G), (a + "wo_b", D, G * ol)),
                           bf16=ql + hd, f32=H))  # q_norm, kv_norm; attn_sink
        if r:
            w = compressor_width(cfg, r)
            mods.append(Module(p + "attn.compressor", "compressor", i, bf16=2 * w * D + hd, f32=r * w))
        if r == CSA_RATIO:
            nI, dI = cfg.index_n_heads, cfg.index_head_dim
            mods.append(Module(p + "attn.indexer", "indexer", i, ((a + "indexer.wq_b", nI * dI, ql),),
                               bf16=nI * D + 2 * (2 * dI) * D + dI, f32=CSA_RATIO * 2 * dI))
        si = cfg.n_shared_experts * cfg.moe_intermediate_size
        if si:
            s = p + "ffn.shared_experts."
            mods.append(Module(p + "ffn.shared_experts", "shared_experts", i,
                               ((s + "w1", si, D), (s + "w3", si, D), (s + "w2", D, si))))
        if cfg.is_hash_layer(i):
            mods.append(Module(p + "ffn.gate", "routers", i, f32=E * D, i64=V * cfg.num_experts_per_tok))
        else:
            mods.append(Module(p + "ffn.gate", "routers", i, f32=E * D + E))
    mods.append(Module("norm", "norms", None, bf16=D, f32=hc * hc * D + hc + 1))  # + hc_head
    mods.append(Module("head", "lm_head", None, bf16=V * D))
    return mods


def entries(kv_tokens: int, ratio: int) -> int:
    """Compressed entries a pool of kv_tokens tokens holds on a layer of this ratio, + the null slot."""
    return math.ceil(kv_tokens / ratio) + 1 if ratio else 0


def kv_layer_items_v4(cfg: V4Config, layer: int, o: Options) -> dict[str, int]:
    """{category: bytes} of one layer's cache: compressed entries and indexer keys in the pool
    (kv_tokens), the window ring and compressor pending state per running sequence (max_batch)."""
    r, hd, e, B = cfg.compress_ratios[layer], cfg.head_dim, o.eb, o.max_batch
    items = {"kv_window": B * (e * cfg.sliding_window * hd + _pending_bytes(cfg, r))}
    if r:
        items["kv_cache"] = e * hd * entries(o.kv_tokens, r)
    if r == CSA_RATIO:
        items["index_keys"] = e * cfg.index_head_dim * entries(o.kv_tokens, r)
    return items


def _pending_bytes(cfg: V4Config, ratio: int) -> int:
    """One sequence's compressor state on a layer: f32 kv and score rows of the tokens not yet
    compressed (CSA keeps the previous block too: 2*ratio rows), indexer compressor included."""
    if not ratio:
        return 0
    rows = 2 * ratio if ratio == CSA_RATIO else ratio
    b = 2 * F32 * rows * compressor_width(cfg, ratio)
    if ratio == CSA_RATIO:
        b += 2 * F32 * rows * 2 * cfg.index_head_dim
    return b


def kv_bytes_per_token_v4(cfg: V4Config, eb: int = 2) -> float:
    """Pool bytes per token, all layers: the amortised compressed entries and indexer keys (the window
    and compressor state are per sequence, not per token)."""
    total = 0.0
    for r in cfg.compress_ratios:
        if r:
            total += eb * (cfg.head_dim + (cfg.index_head_dim if r == CSA_RATIO else 0)) / r
    return total


def _hca_entries(cfg: V4Config, kv: int) -> int:
    """Compressed entries an HCA query block reads: its layer's every entry (masked to the complete
    ones), the most over the HCA layers (the smallest HCA ratio). A CSA query reads its index_topk
    picks, gathered (gpu_service.model.v4.attention)."""
    return max((entries(kv, r) for r in cfg.compress_ratios if r and r != CSA_RATIO), default=0)


def _rows(cfg: V4Config, e: int, mlp_width: int) -> int:
    """Bytes per token row of the attention and MLP projections (compute dtype): qr, per-head q and the
    attention output, kv, the grouped o_a output, the hidden output, the widest MLP."""
    H, hd = cfg.num_attention_heads, cfg.head_dim
    return e * (cfg.q_lora_rank + 2 * H * hd + hd + cfg.o_groups * cfg.o_lora_rank + cfg.hidden_size
                + 3 * mlp_width)


def layer_step_bytes_v4(cfg: V4Config, o: Options, *, rows: int, span: int, seqs: int, mlp_width: int) -> int:
    """Transient bytes of one layer over `rows` token rows of `seqs` sequences whose queries see at most
    `span` keys of their own chunk (a prefill chunk: T rows, span T, 1 sequence; the batched decode is
    `decode_step_bytes_v4`), as the torch model computes it (docs/v4.md "Memory plan"): the streams and projections
    over all rows, then one sequence at a time (r = rows / seqs) what attention holds beside its scores
    and the largest of the attention core (ATTN_BLOCK queries at a time), the indexer (INDEX_BLOCK
    queries at a time) and the compressor, which run one after the other."""
    e, kv, D, hc = o.eb, o.kv_tokens, cfg.hidden_size, cfg.hc_mult
    H, hd, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    f32copy = 0 if e == F32 else F32  # a float32 copy of a 16-bit tensor (`.float()`)
    r = rows // seqs  # one sequence's rows
    Eh = _hca_entries(cfg, kv)
    topk = cfg.index_topk if CSA_RATIO in cfg.compress_ratios else 0
    streams = 2 * F32 * rows * hc * D + F32 * rows * (2 + hc) * hc  # X, X' (f32 at most), mixing coefficients
    act = rows * _rows(cfg, e, mlp_width)
    widest = max((compressor_width(cfg, r) for r in cfg.compress_ratios if r), default=0)
    # alive through the layer's attention: the compressors' and the indexer's row-wise projections of all rows
    proj = e * rows * (2 * widest + (4 * cfg.index_head_dim + cfg.index_n_heads * (cfg.index_head_dim + 1)
                                     if topk else 0))
    held = proj + e * (span + W) * hd + e * r * (span + W) + 16 * r * topk  # window keys, window mask, picks (+ cat)
    b = min(r, ATTN_BLOCK)
    S = span + W + max(Eh, topk)  # a block's key columns: window (W-1), chunk, HCA entries or CSA picks, sink
    attn = (2 * e * b * H * S + e * r * H * hd  # a block's logits and probabilities; the blocks' outputs
            + 2 * e * Eh * hd + e * r * Eh  # HCA: entries read, keys ++ entries, their mask
            + e * b * topk * (hd + 1))  # CSA: a block's gathered picks and their mask
    index = 0
    if topk:
        E4, nI, dI = entries(kv, CSA_RATIO), cfg.index_n_heads, cfg.index_head_dim
        bi = min(r, INDEX_BLOCK)
        index = ((e + f32copy) * E4 * dI + e * r * nI * dI + F32 * r * nI  # keys read (+ f32), queries, weights
                 + bi * (f32copy * nI * dI + F32 * nI * E4 + F32 * E4 + 28 * topk))  # a block: scores, top-k
    comp = (4 * e + 3 * F32) * rows * widest  # kv, gate (+ the chunk's rows), gate + ape, slots, softmax: f32
    return streams + act + held + max(attn, index, comp)


def _state_row(cfg: V4Config, e: int) -> int:
    """Bytes of one sequence's stacked bounded state of the widest layer kind, as the batched decode
    stacks it: window keys [W-1, hd], the compressor's pending kv / gate [r, wc] and (overlap) previous
    half [r, hd] (kv in the compute dtype, gate f32), the CSA indexer's the same at index_head_dim."""
    W, hd, dI = cfg.sliding_window, cfg.head_dim, cfg.index_head_dim
    best = 0
    for r in set(cfg.compress_ratios):
        b = 0
        if r:
            b += 2 * e * r * compressor_width(cfg, r)
        if r == CSA_RATIO:
            b += (e + F32) * r * hd + 2 * e * r * 2 * dI + (e + F32) * r * dI
        best = max(best, b)
    return e * (W - 1) * hd + best


def _slots(cfg: V4Config) -> int:
    """The widest compressor window a decode row pools: max over ratios of ratio * compressor width
    (a CSA entry pools 2 * 4 slots of head_dim, an HCA entry r slots)."""
    return max((r * compressor_width(cfg, r) for r in cfg.compress_ratios if r), default=0)


def decode_step_bytes_v4(cfg: V4Config, o: Options, *, rows: int, mlp_width: int) -> int:
    """Transient bytes of one layer's batched decode of `rows` sequences' new tokens (docs/v4.md
    "Memory plan"; gpu_service.model.v4 `Attention.decode_core`): the streams and projections of the
    rows, the stacked state in and out, then the largest of the attention (ATTN_BLOCK rows' logits over
    the window and E gathered entries or k picks), the indexer (DECODE_INDEX_BLOCK rows' gathered keys,
    their f32 copy and scores over E4 padded entries) and the compressors' pooling of every row's window."""
    e, kv, D, hc, B = o.eb, o.kv_tokens, cfg.hidden_size, cfg.hc_mult, rows
    H, hd, W = cfg.num_attention_heads, cfg.head_dim, cfg.sliding_window
    Eh = _hca_entries(cfg, kv)
    topk = cfg.index_topk if CSA_RATIO in cfg.compress_ratios else 0
    streams = 2 * F32 * B * hc * D + F32 * B * (2 + hc) * hc
    act = B * _rows(cfg, e, mlp_width)
    widest = max((compressor_width(cfg, r) for r in cfg.compress_ratios if r), default=0)
    proj = e * B * (2 * widest + (4 * cfg.index_head_dim + cfg.index_n_heads * (cfg.index_head_dim + 1)
                                  if topk else 0))
    S = W + max(Eh, topk)  # a row's key columns: window, HCA entries or CSA picks (+ the sink)
    held = proj + 2 * B * _state_row(cfg, e) + e * B * S * (hd + 1) + 16 * B * topk  # keys ++ entries, bias, picks
    b = min(B, ATTN_BLOCK)
    attn = 2 * e * b * H * S + e * B * H * hd + e * B * max(Eh, topk) * hd  # logits, probs; outputs; gathered
    index = 0
    if topk:
        E4, nI, dI = entries(kv, CSA_RATIO), cfg.index_n_heads, cfg.index_head_dim
        bi = min(B, DECODE_INDEX_BLOCK)
        index = e * B * nI * dI + F32 * B * nI + 28 * B * topk + bi * E4 * ((e + F32) * dI + F32 * nI + F32)
    comp = (3 * e + 3 * F32) * B * _slots(cfg)  # new buffers, gate + ape, slots, softmax (f32)
    return streams + act + held + max(attn, index, comp)


def graph_pool_bytes_v4(cfg: V4Config, o: Options, *, mlp_width: int) -> int:
    """CUDA-graph pools of V4's decode pieces (gpu_service.runtime.runner_v4): per batch bucket b (one
    micro-batch: V4 has no ping-pong) one piece's temporaries (a batched decode layer step of b rows)
    and the pieces' static inputs and outputs (streams in / out, h, the shared and routed rows, the
    stacked state in and out, the entry rows)."""
    e, D, hc = o.eb, cfg.hidden_size, cfg.hc_mult
    E4 = entries(o.kv_tokens, CSA_RATIO) if CSA_RATIO in cfg.compress_ratios else 0
    static = (3 * F32 * hc * D + 3 * e * D + 2 * F32 * (2 + hc) * hc + 2 * _state_row(cfg, e)
              + 8 * (_hca_entries(cfg, o.kv_tokens) + 2 * E4) + 12 * cfg.num_experts_per_tok)
    return sum(decode_step_bytes_v4(cfg, o, rows=b, mlp_width=mlp_width) + b * static
               for b in graph_buckets(o.max_batch))


def workspace_bytes_v4(cfg: V4Config, o: Options, *, mlp_width: int, lm_head: bool, scratch: int = 0,
                       layers: int = 0) -> int:
    """Activation workspace of one GPU running V4 layers (docs/v4.md "Memory plan"): the larger of a
    prefill chunk's and a decode batch's layer step, the MoE routing, the logits, scratch, graphs and a
    quantised wo_a dequantised whole for its grouped product (gpu_service.model.qlinear.weight_of)."""
    T, B, e, D = o.chunk_tokens, o.max_batch, o.eb, cfg.hidden_size
    wo_a = checkpoint_format(cfg, "layers.0.attn.wo_a.weight") if o.attention_weights == "checkpoint" \
        else o.attention_weights
    wo_a_dq = e * cfg.num_attention_heads * cfg.head_dim * cfg.o_lora_rank if wo_a != "bf16" else 0
    prefill = layer_step_bytes_v4(cfg, o, rows=T, span=T, seqs=1, mlp_width=mlp_width)
    decode = decode_step_bytes_v4(cfg, o, rows=B, mlp_width=mlp_width)
    moe = F32 * T * D + 12 * T * cfg.num_experts_per_tok + hot_experts_bytes_v4(cfg, o)
    logits = 2 * F32 * B * cfg.vocab_size if lm_head else 0
    graphs = graph_pool_bytes_v4(cfg, o, mlp_width=mlp_width) if o.cuda_graphs and layers else 0
    return max(prefill, decode) + moe + logits + scratch + graphs + wo_a_dq


def hot_experts_bytes_v4(cfg: V4Config, o: Options) -> int:
    """The hot GPU experts' transient in a chunk's MoE (gpu_service.model.deepseek.MoE.hot_output, 0
    without them): their summed output [T, D] and one expert's rows at its worst moment, every row
    of the chunk picking it: its input rows and the clamped SwiGLU's gate, up, their clamps, silu
    and product (D + 6I per row), or later its output, weighted output and input (3D); the
    dequantisation scratch is the workspace's `scratch`."""
    if not o.gpu_experts:
        return 0
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    return o.eb * o.chunk_tokens * (D + max(D + 6 * I, 3 * D))


def native_expert_format_v4(cfg: V4Config) -> str | None:
    """The experts' stored format when the shards can keep it as is: "mxfp4" for MXFP4 checkpoints."""
    return "mxfp4" if cfg.quantization is not None and cfg.expert_dtype == "fp4" else None


def hot_expert_format_v4(cfg: V4Config, expert_format: str) -> str:
    """The hot GPU experts' format: the checkpoint's block FP8 as stored (`Fp8Linear`) for FP8-expert
    checkpoints whatever the shards hold, else the shards' format (MXFP4 as stored for MXFP4 ones)."""
    return "fp8" if cfg.quantization is not None and cfg.expert_dtype == "fp8" else expert_format
