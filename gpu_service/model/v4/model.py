"""The DeepSeek-V4 model minus the routed experts, one sequence at a time: embeddings copied into
hc_mult streams, per layer mHC -> attention -> mHC -> MoE, the hc_head reduction, norm and head.

`DeepseekV4.forward(tokens, cache, experts)` runs a chunk of one sequence after what its
`SeqCache` holds (a fresh cache: prefill of the whole prompt), `forward_batch` chunks of several
sequences in one step (attention per sequence, the rest over all rows); `greedy` decodes with the cache,
by recomputing the whole sequence each step (`recompute`), or after a chunked prefill (`chunk`).
Parameters and buffers are named as the original checkpoint (`embed`, `layers.N.attn.wq_a`,
`layers.N.hc_attn_fn`, `layers.N.ffn.gate.tid2eid`, `hc_head_fn`, `head`, ...); `build_v4` fills
them from `get(name)` and returns the names it loaded. The config is checkpoint.config_v4.V4Config;
`gpu_service.model.v4.load.load_v4` builds all of it from a checkpoint directory.
"""
from __future__ import annotations

from typing import Callable, Collection

import numpy as np
import torch
from torch import nn

from checkpoint.config_v4 import V4Config
from gpu_service.model.experts_api import ExpertsFn
from gpu_service.model.layers import RMSNorm
from gpu_service.model.qlinear import make_quantized, Mxfp4Linear, reserve_scratch
from gpu_service.model.v4.attention import Attention, AttnState
from gpu_service.model.v4.moe import MoE
from gpu_service.model.v4.pieces import hc_head, hc_post, hc_pre, v4_ropes

FLOAT32 = ("hc_", "attn_sink", ".ape", ".ffn.gate.bias", ".ffn.gate.weight")  # kept in float32 as in the reference


def check_config(cfg: V4Config) -> None:
    """Refuse what this model does not implement, naming the key."""
    if not isinstance(cfg, V4Config):
        raise TypeError(f"the V4 model takes checkpoint.config_v4.V4Config (load_v4_config / V4Config.from_dict), "
                        f"got {type(cfg).__name__}")
    if cfg.num_key_value_heads != 1:
        raise ValueError(f"num_key_value_heads {cfg.num_key_value_heads}: DeepSeek-V4 shares one KV head")
    bad = sorted({r for r in cfg.compress_ratios[:cfg.num_hidden_layers] if r not in (0, 4) and r < 8})
    if bad:
        raise ValueError(f"compress_ratios {bad}: expected 0 (window), 4 (CSA) or an HCA ratio >= 8")
    if not cfg.norm_topk_prob:
        raise ValueError("norm_topk_prob false: DeepSeek-V4 always normalises the chosen experts' scores "
                         "(as the reference and transformers do); set it true or drop it")
    if cfg.sliding_window < 1:
        raise ValueError(f"sliding_window {cfg.sliding_window}: must be >= 1")


class SeqCache:
    """One sequence's state across chunks: per layer an AttnState, and the tokens fed so far."""

    def __init__(self, n_layers: int):
        self.layers = [AttnState() for _ in range(n_layers)]
        self.length = 0


class Block(nn.Module):
    """One decoder layer with its two hyper-connections (`hc_attn_*`, `hc_ffn_*`)."""

    def __init__(self, cfg, layer: int, ropes, hot=()):
        super().__init__()
        n, D = cfg.hc_mult, cfg.hidden_size
        self.cfg = cfg
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(D, cfg.rms_norm_eps)
        for s in ("attn", "ffn"):
            setattr(self, f"hc_{s}_fn", nn.Parameter(torch.zeros((2 + n) * n, n * D)))
            setattr(self, f"hc_{s}_base", nn.Parameter(torch.zeros((2 + n) * n)))
            setattr(self, f"hc_{s}_scale", nn.Parameter(torch.zeros(3)))
        self.attn = Attention(cfg, cfg.compress_ratios[layer], ropes)
        self.ffn = MoE(cfg, layer, hot)

    def forward(self, X: torch.Tensor, segs: list[tuple[int, int, torch.Tensor]], states: list[AttnState],
                tokens: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
        """X [T, hc_mult, hidden] streams of the batch's rows -> the layer's output streams. Rows
        a:b at positions pos are one sequence's chunk (segs), continuing states[j]; the window,
        compressors and attention run per sequence, everything else over all rows."""
        x, post, comb = hc_pre(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        x = self.attn_norm.norm(x)
        y = self.attn.forward_batch(x, segs, states)
        X = hc_post(X, y, post, comb)
        x, post, comb = hc_pre(X, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        return hc_post(X, self.ffn(self.ffn_norm.norm(x), tokens, experts), post, comb)


class DeepseekV4(nn.Module):
    """Everything but the routed experts (module docstring)."""

    def __init__(self, cfg: V4Config, hot_experts: dict[int, list[int]] | None = None):
        """`hot_experts`: layer -> routed experts held and computed here (a memory plan's)."""
        super().__init__()
        check_config(cfg)
        hot_experts = hot_experts or {}
        n, D = cfg.hc_mult, cfg.hidden_size
        self.cfg = cfg
        ropes = v4_ropes(cfg)
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(Block(cfg, i, ropes, hot_experts.get(i, ())) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(D, cfg.rms_norm_eps)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * D))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.zeros(1))
        self.head = nn.Linear(D, cfg.vocab_size, bias=False)

    def prepare(self) -> None:
        """At load: the norms' constants."""
        for blk in self.layers:
            blk.attn_norm.prepare()
            blk.ffn_norm.prepare()
            blk.attn.prepare()
        self.norm.prepare()

    def new_cache(self) -> SeqCache:
        """An empty cache for a new sequence."""
        return SeqCache(len(self.layers))

    def forward(self, tokens: torch.Tensor, cache: SeqCache, experts: ExpertsFn,
                all_logits: bool = False) -> torch.Tensor:
        """tokens [n] following what `cache` holds -> float32 logits of the last token [V] (all
        tokens' [n, V] with all_logits); the cache then holds them too."""
        return self.forward_batch([(tokens, cache)], experts, all_logits)[0]

    @torch.inference_mode()
    def forward_batch(self, chunks: list[tuple[torch.Tensor, SeqCache]], experts: ExpertsFn,
                      all_logits: bool = False) -> list[torch.Tensor]:
        """One step over chunks of several sequences (tokens [n_j] each following its cache) ->
        per chunk the float32 logits of its last token [V] (or [n_j, V]); one experts call per layer
        for all rows."""
        tokens = torch.cat([t for t, _ in chunks])
        segs, a = [], 0
        for t, c in chunks:
            n = t.shape[0]
            segs.append((a, a + n, torch.arange(c.length, c.length + n, device=tokens.device)))
            a += n
        x = self.embed(tokens.to(self.embed.weight.device))  # [T, D]
        X = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, hc, D]
        on: dict[torch.device, tuple] = {}  # (tokens, segs) per device of a layer split (the plan's)
        for i, blk in enumerate(self.layers):
            dev = blk.attn_norm.weight.device
            if dev not in on:
                on[dev] = (tokens.to(dev), [(a, b, p.to(dev)) for a, b, p in segs])
            X = X.to(dev)  # the hidden streams hop to the next GPU of the split (as DeepseekV3's layers)
            X = blk(X, on[dev][1], [c.layers[i] for _, c in chunks], on[dev][0], experts)
        for t, c in chunks:
            c.length += t.shape[0]
        rows = torch.arange(X.shape[0]) if all_logits else torch.tensor([b - 1 for _, b, _ in segs])
        X = X[rows.to(X.device)].to(self.head.weight.device)
        h = self.norm.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg))
        logits = self.head(h).float()
        if not all_logits:
            return list(logits.unbind(0))
        return [logits[a:b] for a, b, _ in segs]


def greedy(model: DeepseekV4, prompt: list[int], steps: int, experts: ExpertsFn, chunk: int | None = None,
           recompute: bool = False, stop_ids: Collection[int] = ()) -> list[int]:
    """`steps` greedy tokens after `prompt`: decode with the cache (the prompt prefilled in chunks of
    `chunk` tokens, else at once), or with `recompute` the whole sequence from a fresh cache each step.
    A token in `stop_ids` ends it early (that token included)."""
    if not prompt:
        raise ValueError("greedy needs a prompt of at least one token")
    seq = list(prompt)
    out: list[int] = []
    cache = model.new_cache()
    size = chunk or len(prompt)
    device = model.embed.weight.device
    for a in range(0, len(prompt), size):
        logits = model(torch.tensor(prompt[a:a + size], device=device), cache, experts)
    for i in range(steps):
        out.append(int(logits.argmax()))
        seq.append(out[-1])
        if i + 1 == steps or out[-1] in stop_ids:
            break
        if recompute:
            logits = model(torch.tensor(seq, device=device), model.new_cache(), experts)
        else:
            logits = model(torch.tensor(seq[-1:], device=device), cache, experts)
    return out


def build_v4(cfg: V4Config, get: Callable[[str], "np.ndarray | torch.Tensor"], dtype: torch.dtype = torch.float32,
             device: "torch.device | str | Callable[[str], torch.device]" = "cpu", stored: Callable | None = None,
             fp8_block: tuple[int, int] = (128, 128),
             hot_experts: dict[int, list[int]] | None = None) -> tuple[DeepseekV4, set[str]]:
    """The model on `device` (or each tensor on `device(name)`: a memory plan's placement) with every
    parameter and buffer filled from `get(name)` (original
    checkpoint names; float weights dequantised; routed experts are not asked for). Mixing and
    sink parameters, `ape` and the gate stay float32. `stored(name)` -> (e4m3 weight, float32
    block scales) or None: a linear it gives arrays for is an `Fp8Linear` (gpu_service.model.qlinear)
    holding them; a hot routed expert (`hot_experts`: layer -> ids) is an `Mxfp4Linear` of the arrays
    `stored` gives for it as ("mxfp4", packed, e8m0), or an `Fp8Linear` of its FP8 arrays (FP8-expert
    checkpoints). Returns the model and the names loaded."""
    with torch.device("meta"):
        model = DeepseekV4(cfg, hot_experts)
    loaded: set[str] = set()
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    device_of = device if callable(device) else (lambda name, d=torch.device(device): d)
    for name, p in tensors:
        mod_name, _, attr = name.rpartition(".")
        device = device_of(name)
        q = stored(name) if stored is not None and attr == "weight" and \
            isinstance(model.get_submodule(mod_name), nn.Linear) else None
        mxfp4 = q is not None and isinstance(q[0], str) and q[0] == "mxfp4"
        if mxfp4:
            parent, _, child = mod_name.rpartition(".")
            setattr(model.get_submodule(parent), child, Mxfp4Linear.from_stored(q[1], q[2], device))
            loaded.add(name)
            continue
        if ".ffn.experts." in name and q is None:
            raise ValueError(f"{name}: a hot GPU expert is held as the checkpoint stores it (MXFP4 or block FP8); "
                             "this checkpoint's experts are neither: plan with --gpu-experts 0 for it")
        if q is not None:  # a block-FP8 linear as stored (a hot FP8 expert of a Pro-style base release too)
            if tuple(q[0].shape) != tuple(p.shape):
                raise ValueError(f"tensor {name!r} has shape {tuple(q[0].shape)}, expected {tuple(p.shape)} from "
                                 "config.json")
            parent, _, child = mod_name.rpartition(".")
            setattr(model.get_submodule(parent), child, make_quantized(None, "fp8", device, stored=q, fp8_block=fp8_block))
            loaded.add(name)
            continue
        t = torch.as_tensor(get(name))
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)} from config.json")
        mod = model.get_submodule(mod_name)
        if p.dtype == torch.long:
            mod._buffers[attr] = t.to(device=device, dtype=torch.long)
        else:
            keep32 = any(k in name for k in FLOAT32)
            mod._parameters[attr] = nn.Parameter(t.to(device=device, dtype=torch.float32 if keep32 else dtype),
                                                 requires_grad=False)
        loaded.add(name)
    model.prepare()
    reserve_scratch(model, dtype)  # the FP8 linears' dequantisation buffer, sized once
    return model.eval(), loaded
