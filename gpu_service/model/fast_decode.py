"""The fused decode step: one MoE/dense layer of an all-decode step in few torch ops (issue 20).

A decode step (every chunk one token; DeepSeek-V3, or V3.2 with its lightning indexer) runs each
layer as four segments around two eager parts:

    pre     input norm, q_a_proj ++ kv_a_proj_with_mqa as one matmul (weights concatenated at
            load, the modules' weights are views of it: no extra bytes), q_a norm, q_b_proj, RoPE of
            the query and the new key (one index_select + mul + add each, the cos/sin table built
            once per step), the absorbed query q_nope W_UK  ->  qcat [Bp, nh, r + rope], new cache
            rows [Bp, r + rope]; V3.2 also the indexer's roped queries, head weights and new index keys
    (attention core, eager: write the new rows at the step's slots (V3.2: and the index keys, then
    each query's top-index_topk keys selected), batched paged attention)
    mid     W_UV, o_proj, residual, post-attention norm, router  ->  x, h, ids, w
    (expert hand-off, eager: the shards start on h / ids / w)
    shared  the shared expert (gate ++ up as one matmul) or the dense MLP, while the shards work
    post    residual + routed + shared

Rows are padded to Bp (a multiple of MIN_ROWS on CPU, the CUDA-graph bucket there): every GEMM
row lies in a full block of four rows, so a sequence's result is bit-identical alone or batched (the
CPU GEMM takes another summation order for a partial block of 1-3 rows; paged_attention.MIN_ROWS). Padded rows are zeros and
row-independent; they are never sent to the experts nor written to the cache.

On CPU fp32 RMSNorm is x * rsqrt(||x||^2 + H eps) * (w sqrt(H)): torch's fused rms_norm costs
~30-40 µs on a [1, 96] row here, vector_norm + 4 elementwise ops ~20 µs (the same value up to
rounding, ~1e-7 relative). Elsewhere (CUDA, 16-bit) the fused rms_norm is one kernel and is kept.

The segments are plain functions of tensors, so `gpu_service.model.cuda_graphs` can run them as
CUDA graphs on static buffers (or, on CPU, eagerly on the same static buffers, for tests).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from gpu_service.model import paged_attention
from gpu_service.model.qlinear import weight_of

MIN_ROWS = paged_attention.MIN_ROWS
_WKV_BUFFERS: dict = {}  # (device, dtype, shape) -> the dequantised kv_b_proj weight CUDA graphs read


# -------------------------------------------------------------------------- fused weights at load
def _plain(lin) -> bool:
    return type(lin) is nn.Linear and lin.bias is None


def _concat_rows(*lins: nn.Linear) -> None:
    """Make the linears' weights adjacent row blocks of one tensor (their concatenation), so that
    one matmul computes all their outputs; each module keeps a view (no extra bytes)."""
    ws = [lin.weight for lin in lins]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or any(w.device.type == "meta" for w in ws):
        return
    if _fused_view(ws) is not None:
        return
    big = torch.cat([w.detach() for w in ws])
    r0 = 0
    for lin, w in zip(lins, ws):
        lin.weight = nn.Parameter(big[r0:r0 + w.shape[0]], requires_grad=False)
        r0 += w.shape[0]


def _fused_view(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum(out), in] view over weights that are adjacent row blocks of one storage, else None
    (e.g. after `.to(device)` moved them separately: then the fast path runs them one by one)."""
    w0 = ws[0]
    off = w0.storage_offset()
    for w in ws:
        if (w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr() or not w.is_contiguous()
                or w.storage_offset() != off or w.shape[1] != w0.shape[1]):
            return None
        off += w.numel()
    return w0.as_strided((sum(w.shape[0] for w in ws), w0.shape[1]), (w0.shape[1], 1), w0.storage_offset())


def fuse_weights(model) -> None:
    """At load: q_a_proj (or q_proj) ++ kv_a_proj_with_mqa, and the shared expert's / dense MLP's
    gate ++ up, as one weight each where both are plain linears of one dtype and device."""
    for blk in model.model.layers:
        mla = blk.self_attn
        first = mla.q_proj if mla.cfg.q_lora_rank is None else mla.q_a_proj
        if _plain(first) and _plain(mla.kv_a_proj_with_mqa):
            _concat_rows(first, mla.kv_a_proj_with_mqa)
        for mlp in (getattr(blk.mlp, "shared_experts", None), blk.mlp if hasattr(blk.mlp, "gate_proj") else None):
            if mlp is not None and _plain(mlp.gate_proj) and _plain(mlp.up_proj):
                _concat_rows(mlp.gate_proj, mlp.up_proj)


# ------------------------------------------------------------------------------------ the pieces
class _Lin:
    """A linear called without nn.Module.__call__: x @ W.t() for a plain one, else its forward."""

    __slots__ = ("wt", "fwd")

    def __init__(self, lin: nn.Module, weight: torch.Tensor | None = None):
        if weight is None and _plain(lin):
            weight = lin.weight
        self.wt = None if weight is None else weight.t()
        self.fwd = None if weight is not None else lin.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.wt) if self.wt is not None else self.fwd(x)


class _Norm:
    """RMSNorm without the module call; the cheap composition on CPU fp32 (module docstring)."""

    __slots__ = ("w", "eps", "ws", "heps", "composed")

    def __init__(self, norm: nn.Module):
        w = norm.weight
        H = w.shape[0]
        self.w, self.eps = w, norm.eps
        self.composed = w.device.type == "cpu" and w.dtype == torch.float32
        self.ws = w * math.sqrt(H) if self.composed else None  # [H]: a copy of a norm weight (H floats)
        self.heps = torch.tensor(H * norm.eps, dtype=torch.float32, device=w.device)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.composed and x.dtype == torch.float32:
            n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)  # in place on fresh tensors: fewer allocations
            return (x * n.mul_(n).add_(self.heps).rsqrt_()).mul_(self.ws)
        return self.w * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def rope_index(rdim: int, interleave: bool, offset: int, device) -> torch.Tensor:
    """Columns [evens, odds, odds, evens] of a rope part starting at `offset`: times the step's
    table [c, c, -s, s] and halves added, they give Rope.apply's half-split output, bit for bit
    (x_e c + x_o (-s) == x_e c - x_o s in IEEE arithmetic)."""
    h = rdim // 2
    ev = torch.arange(0, rdim, 2) if interleave else torch.arange(h)
    od = torch.arange(1, rdim, 2) if interleave else torch.arange(h, rdim)
    return (torch.cat([ev, od, od, ev]) + offset).to(device)


def rope_table(cos: torch.Tensor, sin: torch.Tensor, rows: int) -> torch.Tensor:
    """[rows, 2 * rope] = [c, c, -s, s] per row, zero-padded to `rows` (built once per step)."""
    cs = torch.cat([cos, cos, -sin, sin], dim=-1)
    if rows > cs.shape[0]:
        cs = torch.cat([cs, cs.new_zeros(rows - cs.shape[0], cs.shape[1])])
    return cs


class FastBlock:
    """One layer's decode segments with its weights resolved once (views, no copies)."""

    def __init__(self, blk, dtype: torch.dtype):
        mla = blk.self_attn
        cfg = mla.cfg
        self.blk, self.mla, self.cfg, self.dtype = blk, mla, cfg, dtype
        self.nh, self.nope, self.rdim, self.r, self.vdim = mla.nh, mla.nope, mla.rdim, mla.r, mla.vdim
        self.ql = cfg.q_lora_rank
        first = mla.q_proj if self.ql is None else mla.q_a_proj
        self.n_first = first.weight.shape[0] if hasattr(first, "weight") else None
        wa = _fused_view([first.weight, mla.kv_a_proj_with_mqa.weight]) \
            if _plain(first) and _plain(mla.kv_a_proj_with_mqa) else None
        self.a = _Lin(None, wa) if wa is not None else None  # q_a ++ kv_a in one matmul
        self.first, self.kva = _Lin(first), _Lin(mla.kv_a_proj_with_mqa)
        self.qb = _Lin(mla.q_b_proj) if self.ql is not None else None
        self.q_norm = _Norm(mla.q_a_layernorm) if self.ql is not None else None
        self.kv_norm = _Norm(mla.kv_a_layernorm)
        self.in_norm, self.post_norm = _Norm(blk.input_layernorm), _Norm(blk.post_attention_layernorm)
        self.o = _Lin(mla.o_proj)
        dev = blk.input_layernorm.weight.device
        # RoPE of the query heads and the new key in one gather over cat([q, kv_a output]) (or over
        # the fused output alone when it already holds q: no q_lora)
        self.kv_off = self.n_first if self.a is not None else 0  # kv_a's columns in its output
        qw = self.nh * (self.nope + self.rdim)
        self.pe_in_a = self.a is not None and self.ql is None  # q is a's first columns
        k0 = (self.kv_off if self.pe_in_a else qw + self.kv_off) + self.r
        self.pe_idx = torch.cat([rope_index(self.rdim, mla.rope.interleave, h * (self.nope + self.rdim) + self.nope, dev)
                                 for h in range(self.nh)] + [rope_index(self.rdim, mla.rope.interleave, k0, dev)])
        self.scaling = torch.tensor(mla.scaling, dtype=torch.float32, device=dev)
        self.ninf = torch.tensor(float("-inf"), dtype=torch.float32, device=dev)
        self.eps20 = torch.tensor(1e-20, dtype=torch.float32, device=dev)
        self.route_scale = torch.tensor(cfg.routed_scaling_factor, dtype=torch.float32, device=dev)
        self.wkv_fixed = None
        if type(mla.kv_b_proj) is nn.Linear:  # unquantised: W_UK / W_UV views resolved once
            self.wkv_fixed = self._wkv(mla.kv_b_proj.weight.to(dtype))
        self.moe = blk.mlp if hasattr(blk.mlp, "gate") else None  # a MoE (router + experts)
        mlp = self.moe.shared_experts if self.moe is not None else blk.mlp
        self.mlp = None if mlp is None else _Mlp(mlp)
        if self.moe is not None:
            g = self.moe.gate
            self.router_wt = g.weight.float().t()
            self.router_bias = g.e_score_correction_bias.float()
            self.k = cfg.num_experts_per_tok
        self.ix = mla.indexer  # DeepSeek-V3.2: the lightning indexer's query, head weights and new key in `pre`
        self.key = self.fingerprint(blk)

    @staticmethod
    def fingerprint(blk) -> tuple:
        """What the resolved views depend on (moved or reloaded weights rebuild the FastBlock)."""
        p = blk.input_layernorm.weight
        return p.device, p.data_ptr(), blk.self_attn.kv_a_proj_with_mqa.weight.data_ptr() \
            if hasattr(blk.self_attn.kv_a_proj_with_mqa, "weight") else 0

    def _wkv(self, w: torch.Tensor):
        w3 = w.view(self.nh, self.nope + self.vdim, self.r)
        return w3[:, : self.nope], w3[:, self.nope:].transpose(1, 2)  # [nh, nope, r], [nh, r, v]

    def wkv(self):
        """(W_UK, W_UV^T) in the compute dtype (a quantised kv_b_proj is dequantised per step)."""
        if self.wkv_fixed is not None:
            return self.wkv_fixed
        return self._wkv(weight_of(self.mla.kv_b_proj, self.dtype))

    def wkv_static(self):
        """wkv() at a fixed address: a quantised kv_b_proj is dequantised into one buffer per
        device and dtype, shared by all layers (a layer reads it only between its pre and mid
        segments, with no yield in between), so CUDA graphs read it in place."""
        if self.wkv_fixed is not None:
            return self.wkv_fixed
        w = weight_of(self.mla.kv_b_proj, self.dtype)
        key = (w.device, w.dtype, tuple(w.shape))
        buf = _WKV_BUFFERS.get(key)
        if buf is None:
            buf = _WKV_BUFFERS[key] = torch.empty_like(w)
        buf.copy_(w)
        return self._wkv(buf)

    # ---- segments (pure functions of tensors: CUDA-graph capturable) ---------------------------
    def pre(self, x: torch.Tensor, cs: torch.Tensor, w_uk: torch.Tensor):
        """x [Bp, H], cs [Bp, 2 rope] -> qcat [Bp, nh, r + rope], new cache rows [Bp, r + rope]
        (V3.2, then: the indexer's roped queries [Bp, nh_i, hd_i] f32, head weights [Bp, nh_i] f32
        times nh_i^-0.5 (Indexer.query), the new index keys [Bp, hd_i] (Indexer.keys))."""
        Bp = x.shape[0]
        xn = self.in_norm(x)
        if self.a is not None:
            a = self.a(xn)  # [Bp, q_a (or q) + r + rope]
            q0, ckv = a[:, : self.n_first], a
        else:
            q0, ckv = self.first(xn), self.kva(xn)
        qr = self.q_norm(q0) if self.qb is not None else None  # q_resid [Bp, q_lora_rank]
        q = self.qb(qr) if self.qb is not None else q0  # [Bp, nh * (nope + rope)]
        src = ckv if self.pe_in_a else torch.cat([q, ckv], dim=1)
        m = src.index_select(1, self.pe_idx).view(Bp, self.nh + 1, 2 * self.rdim).mul_(cs[:, None, :])
        pe = m[..., : self.rdim] + m[..., self.rdim:]  # [Bp, nh + 1, rope]: the heads' q_pe, then k_pe
        c = self.kv_norm(ckv[:, self.kv_off: self.kv_off + self.r])
        q_abs = torch.bmm(q.view(Bp, self.nh, self.nope + self.rdim)[..., : self.nope].transpose(0, 1), w_uk)
        out = torch.cat([q_abs.transpose(0, 1), pe[:, : self.nh]], dim=-1), torch.cat([c, pe[:, self.nh]], dim=-1)
        if self.ix is None:
            return out
        h = self.rdim // 2
        cos, sin = cs[:, :h], cs[:, 3 * h:]  # the table is [c, c, -s, s]
        iq, iw = self.ix.query(xn, qr, cos, sin)
        return out + (iq.float(), iw, self.ix.keys(xn, cos, sin))

    def mid(self, x: torch.Tensor, o_lat: torch.Tensor, w_uv: torch.Tensor):
        """o_lat [Bp, nh, r] -> x after attention, h = post-attention norm, (MoE) ids, w."""
        o = torch.bmm(o_lat.transpose(0, 1), w_uv)  # [nh, Bp, v]
        x = self.o(o.transpose(0, 1).reshape(x.shape[0], self.nh * self.vdim)).add_(x)  # x + o (commutative)
        h = self.post_norm(x)
        if self.moe is None:
            return x, h
        ids, w = self.route(h)
        return x, h, ids, w

    def route(self, h: torch.Tensor):
        """Router.forward in fewer ops (the same selection and weights)."""
        cfg, E = self.cfg, self.cfg.n_routed_experts
        hf = h if h.dtype == torch.float32 else h.float()
        scores = torch.mm(hf, self.router_wt).sigmoid()  # [Bp, E]
        choice = scores + self.router_bias
        if cfg.n_group > 1:
            cg = choice.view(-1, cfg.n_group, E // cfg.n_group)
            gidx = cg.topk(2, dim=-1)[0].sum(-1).topk(cfg.topk_group, dim=-1, sorted=False)[1]  # [Bp, topk_group]
            drop = torch.ones(cg.shape[:2] + (1,), dtype=torch.bool, device=h.device).scatter_(1, gidx[..., None], False)
            choice = torch.where(drop, self.ninf, cg).view(-1, E)
        ids = choice.topk(self.k, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True).add_(self.eps20)
        return ids, (w.mul_(self.route_scale) if cfg.routed_scaling_factor != 1.0 else w)

    def shared(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(h)

    @staticmethod
    def post(x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        return x + routed if shared is None else (routed + shared).add_(x)  # x + (routed + shared)


class _Mlp:
    """down(silu(gate(x)) * up(x)) with gate ++ up in one matmul when fused at load."""

    def __init__(self, mlp: nn.Module):
        self.inter = mlp.gate_proj.weight.shape[0] if hasattr(mlp.gate_proj, "weight") else None
        gu = _fused_view([mlp.gate_proj.weight, mlp.up_proj.weight]) \
            if _plain(mlp.gate_proj) and _plain(mlp.up_proj) else None
        self.gu = _Lin(None, gu) if gu is not None else None
        self.gate, self.up, self.down = _Lin(mlp.gate_proj), _Lin(mlp.up_proj), _Lin(mlp.down_proj)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.gu is not None:
            gu = self.gu(x)
            return self.down(F.silu(gu[:, : self.inter]) * gu[:, self.inter:])
        return self.down(F.silu(self.gate(x)) * self.up(x))


# ------------------------------------------------------------------------------- the decode step
class DecodeStep:
    """Per step and device: padded row count, the RoPE table, the attention metadata."""

    def __init__(self, meta, cos: torch.Tensor, sin: torch.Tensor, B: int, Bp: int, graphs=None):
        self.meta, self.B, self.Bp = meta, B, Bp
        self.cs = rope_table(cos, sin, Bp)
        if graphs is not None:
            self.cs = graphs.rope_table(self.cs)  # the set's static buffer: no copy per layer
        self.graphs = graphs  # a cuda_graphs.GraphSet for this (device, micro-batch, bucket), or None
        self._o_lat = None

    def o_lat_buffer(self, nh: int, r: int, dtype: torch.dtype, device) -> torch.Tensor:
        """[Bp, nh, r] zeros, once per step: attention writes its B real rows, pad rows stay 0
        (every layer's o_lat is consumed by its own `mid` before the next layer writes)."""
        if self._o_lat is None:
            self._o_lat = torch.zeros(self.Bp, nh, r, dtype=dtype, device=device)
        return self._o_lat


def padded_rows(B: int, device: torch.device) -> int:
    """Rows a step runs with: on CPU a multiple of MIN_ROWS (the CPU GEMM computes rows in blocks
    of four and a row in a partial block in another summation order: measured, any row of an M = 4k
    product equals the same row alone padded to 4; tests/test_fast_decode.py checks it end to end)."""
    return -(-B // MIN_ROWS) * MIN_ROWS if device.type == "cpu" else B


def eligible(model, meta) -> bool:
    """An all-decode step (DeepSeek-V3 or V3.2) on the batched path."""
    return (getattr(model, "fused_decode", True) and meta is not None and meta.dec_rows is None
            and not meta.prefill and meta.key_slots is not None)


def fast_block(model, i: int, dtype: torch.dtype) -> FastBlock:
    """The layer's FastBlock, built once (rebuilt when its weights moved)."""
    cache = model.__dict__.setdefault("_fast_blocks", {})
    blk = model.model.layers[i]
    fb = cache.get(i)
    if fb is None or fb.dtype != dtype or fb.key != FastBlock.fingerprint(blk):
        fb = cache[i] = FastBlock(blk, dtype)
    return fb


def attention_core(fb: FastBlock, qcat: torch.Tensor, new: torch.Tensor, kv: torch.Tensor, st: DecodeStep,
                   ix_out: tuple = (), ik: torch.Tensor | None = None):
    """Eager: write the step's new cache rows, attend (one query per sequence) -> o_lat [Bp, nh, r].
    V3.2 (ix_out = pre's indexer outputs, ik the layer's index-key cache): the new index keys are
    written and each query attends to its top-index_topk keys only (paged_attention.select_decode_qw)."""
    meta, B, Bp, r = st.meta, st.B, st.Bp, fb.r
    new = new[:B] if Bp > B else new
    kv.index_copy_(0, meta.write_slots, new if new.dtype == kv.dtype else new.to(kv.dtype))
    keep = None
    if fb.ix is not None:
        iq, iw, ikn = (t[:B] for t in ix_out) if Bp > B else ix_out
        ik.index_copy_(0, meta.write_slots, ikn if ikn.dtype == ik.dtype else ikn.to(ik.dtype))
        keep = paged_attention.select_decode_qw(fb.ix, iq, iw, ik, meta)
    q = qcat[:B] if Bp > B else qcat
    if meta.fi_indices is not None and kv.device.type == "cuda":
        o_lat = paged_attention._flashinfer_decode(fb.mla, q[..., :r], q[..., r:], kv, meta, keep)
    else:
        buf = st.o_lat_buffer(q.shape[1], r, q.dtype, q.device) if Bp > B else None  # pad rows stay 0
        o = paged_attention.torch_attend(q, kv, meta, keep, fb.scaling, r, None if buf is None else buf[:B], fb.ninf)
        return o if buf is None else buf
    if Bp > B:
        o_lat = torch.cat([o_lat, o_lat.new_zeros((Bp - B,) + tuple(o_lat.shape[1:]))])
    return o_lat


def block_steps(fb: FastBlock, x: torch.Tensor, st: DecodeStep, kv: torch.Tensor, experts, layer: int,
                ik: torch.Tensor | None = None):
    """Generator like Block.steps over padded rows x [Bp, H]: yields once while the experts work
    (ik: the layer's V3.2 index-key cache)."""
    g = st.graphs
    w_uk, w_uv = fb.wkv() if g is None else fb.wkv_static()
    if g is not None:
        g.persist(w_uk, w_uv)
    if g is None:
        qcat, new, *ix_out = fb.pre(x, st.cs, w_uk)
    else:
        qcat, new, *ix_out = g.run(layer, "pre", fb.pre, x, st.cs, w_uk)
    o_lat = attention_core(fb, qcat, new, kv, st, tuple(ix_out), ik)
    if g is None:
        outs = fb.mid(x, o_lat, w_uv)
    else:
        outs = g.run(layer, "mid", fb.mid, x, o_lat, w_uv)
    if fb.moe is None:
        x1, h = outs
        m = fb.shared(h) if g is None else g.run(layer, "shared", fb.shared, h)[0]
        return x1 + m
    x1, h, ids, w = outs
    B, Bp = st.B, st.Bp
    hb, ib, wb = (h[:B], ids[:B], w[:B]) if Bp > B else (h, ids, w)
    moe = fb.moe
    w_remote = wb if moe.experts is None else moe.remote_weights(ib, wb)
    handle = experts(moe.layer, hb, ib, w_remote)
    yield
    shared = None
    if fb.mlp is not None:
        shared = fb.shared(h) if g is None else g.run(layer, "shared", fb.shared, h)[0]
    routed = handle.wait()
    if moe.experts is not None:
        routed = routed + moe.hot_output(hb, ib, wb, routed)
    if Bp > B:
        routed = torch.cat([routed, routed.new_zeros(Bp - B, routed.shape[1])])
    if g is None:
        return fb.post(x1, routed, shared)
    return g.run(layer, "post", fb.post, x1, routed, shared)[0]
