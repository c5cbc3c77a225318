"""The DeepSeek-V4 model minus the routed experts, one sequence at a time: embeddings copied into
hc_mult streams, per layer mHC -> attention -> mHC -> MoE, the hc_head reduction, norm and head.

`DeepseekV4.forward(tokens, cache, experts)` runs a chunk of one sequence after what its
`SeqCache` holds (a fresh cache: prefill of the whole prompt), `forward_batch` chunks of several
sequences in one step (a prefill chunk's attention per chunk, every one-token chunk's attention at once:
the batched decode, gpu_service.model.v4.decode; the rest over all rows, padded to the CPU's GEMM row
block so that a sequence's logits do not depend on its batch; an all-decode step as the layers' decode
pieces, replayed as CUDA graphs where the runner gives them); `greedy` decodes with the cache,
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
from gpu_service.model.rows import pad_rows, padded, row_block
from gpu_service.model.v4.attention import Attention, AttnState
from gpu_service.model.v4.decode import DecodeBatch
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
        self.attn.layer = layer
        self.ffn = MoE(cfg, layer, hot)

    def forward(self, X: torch.Tensor, segs: list[tuple[int, int, torch.Tensor]], states: list[AttnState],
                tokens: torch.Tensor, experts: ExpertsFn, dec=None, T: int | None = None) -> torch.Tensor:
        """X [R, hc_mult, hidden] streams of the batch's rows -> the layer's output streams. Rows
        a:b at positions pos are one sequence's chunk (segs), continuing states[j]; the window,
        compressors and attention run per chunk (the decode rows of `dec` at once), everything else
        over all rows; the first T rows are real (the rest padding, not sent to the experts)."""
        x, post, comb = hc_pre(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        x = self.attn_norm.norm(x)
        y = self.attn.forward_batch(x, segs, states, dec)
        X = hc_post(X, y, post, comb)
        x, post, comb = hc_pre(X, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        return hc_post(X, self.ffn(self.ffn_norm.norm(x), tokens, experts, T), post, comb)

    # ---- the decode pieces (pure functions of tensors: CUDA-graph capturable) ---------------------
    def attn_piece(self, X: torch.Tensor, tokens: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, *state) -> tuple:
        """mHC, the batched decode attention (`state`: `flat` of its stacked inputs), mHC, the FFN norm
        and the router -> (X, h, post, comb, ids, w, *the new state's tensors)."""
        x, post, comb = hc_pre(X, self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale, self.cfg)
        y, keys, cstate, istate = self.attn.decode(self.attn_norm.norm(x), pos, cos, sin, *unflat(state))
        X = hc_post(X, y, post, comb)
        x, post, comb = hc_pre(X, self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale, self.cfg)
        h = self.ffn_norm.norm(x)
        ids, w = self.ffn.gate.route(h, tokens)
        return (X, h, post, comb, ids, w, keys) + tuple(t for t in (cstate or ()) + (istate or ()) if t is not None)

    def shared_piece(self, h: torch.Tensor) -> torch.Tensor:
        """The shared expert of the rows."""
        return self.ffn.shared_experts(h)

    @staticmethod
    def post_piece(X: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None, post: torch.Tensor,
                   comb: torch.Tensor) -> torch.Tensor:
        """mHC after the MoE: the layer's output streams."""
        return hc_post(X, MoE.combine(routed, shared), post, comb)

    def decode(self, X: torch.Tensor, tokens: torch.Tensor, dec, experts: ExpertsFn, graphs=None) -> torch.Tensor:
        """One all-decode step of this layer over padded rows X [rows, hc, hidden] (`dec`: the step's
        DecodeBatch on this device): the pieces eagerly or as replays of their graphs (`graphs`: a
        gpu_service.runtime.cuda_graphs.GraphSet), around the eager expert hand-off."""
        i, B, moe = self.attn.layer, dec.B, self.ffn
        ins = dec.inputs(self.attn)
        state = flat(ins)
        if graphs is None:
            def run(name, fn, *a):
                out = fn(*a)
                return out if isinstance(out, tuple) else (out,)
        else:
            graphs.persist(*[e[0] for e in (ins[2], ins[4]) if e is not None])  # the entries' tensors: written in place

            def run(name, fn, *a):
                return graphs.run(i, name, fn, *a)
        E = tuple(e[2].shape[1] for e in (ins[2], ins[4]) if e is not None)
        X1, h, post, comb, ids, w, *new = run(f"attn{E}", self.attn_piece, X, tokens, dec.pos,
                                              *dec.rope_of(self.attn), *state)
        if graphs is not None:
            new = [t.clone() for t in new]  # the pieces' outputs are shared by the layers
        dec.update(self.attn, restate(new, self.attn))
        handle = moe.send(h[:B], ids[:B], w[:B], experts)
        shared = run("shared", self.shared_piece, h)[0] if moe.shared_experts is not None else None
        routed = moe.routed(handle, h[:B], ids[:B], w[:B], X.shape[0])
        return run("post", self.post_piece, X1, routed, shared, post, comb)[0]


def flat(ins: tuple) -> tuple:
    """DecodeBatch.inputs (keys, cstate, centries, istate, ientries) as one flat tuple (None for what a
    layer lacks): keys, 4 compressor state, 5 compressor entries, 4 indexer state, 5 indexer entries."""
    keys, cstate, centries, istate, ientries = ins
    return (keys,) + (cstate or (None,) * 4) + (centries or (None,) * 5) + (istate or (None,) * 4) + \
        (ientries or (None,) * 5)


def unflat(state: tuple) -> tuple:
    """`flat`'s inverse: (keys, cstate, centries, istate, ientries), None for a part the layer lacks."""
    keys, c, ce, i, ie = state[0], state[1:5], state[5:10], state[10:14], state[14:19]
    return keys, (c if c[0] is not None else None), (ce if ce[0] is not None else None), \
        (i if i[0] is not None else None), (ie if ie[0] is not None else None)


def restate(new: list, attn) -> tuple:
    """`attn_piece`'s new-state tensors -> (keys, cstate, istate) as `decode_core` returned them."""
    keys, rest = new[0], list(new[1:])
    cstate = istate = None
    if attn.compressor is not None:
        n = 4 if attn.compressor.overlap else 2
        cstate = tuple(rest[:n]) + (None,) * (4 - n)
        rest = rest[n:]
    if attn.indexer is not None:
        istate = tuple(rest[:4])
    return keys, cstate, istate


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

    def row_block(self, device: torch.device) -> int:
        """Rows a step's products are padded to a multiple of on `device` (gpu_service.model.rows),
        measured on the model's own linear shapes."""
        cfg, D = self.cfg, self.cfg.hidden_size
        shapes = [(D, cfg.q_lora_rank), (cfg.q_lora_rank, cfg.num_attention_heads * cfg.head_dim), (D, cfg.head_dim),
                  (cfg.hc_mult * D, (2 + cfg.hc_mult) * cfg.hc_mult), (D, cfg.n_routed_experts),
                  (cfg.num_attention_heads * cfg.head_dim // cfg.o_groups, cfg.o_lora_rank),
                  (cfg.o_groups * cfg.o_lora_rank, D), (D, cfg.vocab_size)]
        return row_block(device, self.head.weight.dtype, [(min(k, 2048), min(n, 2048)) for k, n in shapes])

    @torch.inference_mode()
    def forward_batch(self, chunks: list[tuple[torch.Tensor, SeqCache]], experts: ExpertsFn,
                      all_logits: bool = False, graphs=None) -> list[torch.Tensor]:
        """One step over chunks of several sequences (tokens [n_j] each following its cache) ->
        per chunk the float32 logits of its last token [V] (or [n_j, V]); one experts call per layer
        for all rows. The rows are padded to the CPU's GEMM row block (a row's result does not depend
        on its batch); the one-token chunks' attention runs batched (`DecodeBatch`); an all-decode step
        runs the layers' decode pieces (`Block.decode`), as replays of CUDA graphs where `graphs` (the
        runner's gpu_service.runtime.cuda_graphs.Graphs) gives a set for its bucket."""
        if not all_logits and all(t.shape[0] == 1 for t, _ in chunks):
            return self._decode(chunks, experts, graphs)
        tokens = torch.cat([t for t, _ in chunks])
        segs, a = [], 0
        for t, c in chunks:
            n = t.shape[0]
            segs.append((a, a + n, torch.arange(c.length, c.length + n, device=tokens.device)))
            a += n
        T = a
        dec_j = [j for j, (t, _) in enumerate(chunks) if t.shape[0] == 1]
        x = self.embed(tokens.to(self.embed.weight.device))  # [T, D]
        X = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, hc, D]
        on: dict[torch.device, tuple] = {}  # (tokens, segs, decode rows) per device of a layer split (the plan's)
        for i, blk in enumerate(self.layers):
            dev = blk.attn_norm.weight.device
            if dev not in on:
                Tp = padded(T, self.row_block(dev))
                dec = DecodeBatch([chunks[j][1].layers for j in dec_j], [chunks[j][1].length for j in dec_j],
                                  len(dec_j), dev, X.dtype, blk.attn.ropes, [segs[j][0] for j in dec_j],
                                  dec_j) if dec_j else None
                on[dev] = (pad_rows(tokens.to(dev), Tp), [(a, b, p.to(dev)) for a, b, p in segs], dec)
            X = X.to(dev)  # the hidden streams hop to the next GPU of the split (as DeepseekV3's layers)
            X = pad_rows(X, on[dev][0].shape[0])
            X = blk(X, on[dev][1], [c.layers[i] for _, c in chunks], on[dev][0], experts, on[dev][2], T)
        for t, c in chunks:
            c.length += t.shape[0]
        rows = torch.arange(T) if all_logits else torch.tensor([b - 1 for _, b, _ in segs])
        logits = self._logits(X[rows.to(X.device)])
        if not all_logits:
            return list(logits.unbind(0))
        return [logits[a:b] for a, b, _ in segs]

    def _decode(self, chunks: list[tuple[torch.Tensor, SeqCache]], experts: ExpertsFn, graphs) -> list[torch.Tensor]:
        """An all-decode step (`forward_batch`): rows padded to the graph bucket (or the row block)."""
        B = len(chunks)
        tokens = torch.cat([t for t, _ in chunks])
        X = self.embed(tokens.to(self.embed.weight.device)).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        on: dict[torch.device, tuple] = {}  # (tokens, DecodeBatch, graph set) per device
        for blk in self.layers:
            dev = blk.attn_norm.weight.device
            if dev not in on:
                gset = graphs.get(dev, 0, B) if graphs is not None else None
                rows = gset.rows if gset is not None else padded(B, self.row_block(dev))
                dec = DecodeBatch([c.layers for _, c in chunks], [c.length for _, c in chunks], rows, dev, X.dtype,
                                  blk.attn.ropes)
                on[dev] = (pad_rows(tokens.to(dev), rows), dec, gset)
            tok, dec, gset = on[dev]
            X = pad_rows(X.to(dev), dec.Bp)
            X = blk.decode(X, tok, dec, experts, gset)
        for _, c in chunks:
            c.length += 1
        return list(self._logits(X[:B]).unbind(0))

    def _logits(self, X: torch.Tensor) -> torch.Tensor:
        """Float32 logits [n, V] of rows X [n, hc, D] (padded to the row block for the head's GEMMs)."""
        n = X.shape[0]
        X = X.to(self.head.weight.device)
        X = pad_rows(X, padded(n, self.row_block(X.device)))
        h = self.norm.norm(hc_head(X, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, self.cfg))
        return self.head(h)[:n].float()


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
    for dev in {blk.attn_norm.weight.device for blk in model.layers} | {model.head.weight.device}:
        model.row_block(dev)  # measured now (once per process and shapes), not inside a step
    return model.eval(), loaded
