"""Multi-head latent attention (MLA) of DeepSeek-V3 / V3.2 over the paged compressed KV cache.

Per token and layer the cache holds c_kv (kv_lora_rank, normalised) ++ k_pe (roped): `KVPool`.
A layer runs as two pieces around the attention core:

    project  (after the input norm) q_a_proj ++ kv_a_proj_with_mqa as one matmul (weights
             concatenated at load, the modules hold views: no extra bytes), q_a norm, q_b_proj,
             RoPE of the query heads and the new key in one gather + multiply over a per-step
             table, the new cache row; for an all-decode step also the absorbed query q_nope W_UK
             (so the whole piece is CUDA-graph capturable); V3.2: the indexer's queries, head
             weights and new index key;
    core     (eager: variable key lengths) write the new rows at the step's slots; decode queries
             through the attention backend in the absorbed form (o_lat, then W_UV), prefill chunks
             through the backend's expanded path; V3.2: each query's top-k keys selected first.

All row counts are padded (gpu_service.model.rows), so a token's result does not depend on its
batch; pad rows are zeros and never written to the cache.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from checkpoint.config import ModelConfig
from gpu_service.model.indexer import Indexer
from gpu_service.model.layers import concat_rows, fused_view, Lin, plain, RMSNorm, Rope
from gpu_service.model.qlinear import weight_of
from gpu_service.model.rows import pad_rows, padded


class MLA(nn.Module):
    """Parameters named as in the checkpoint (`...self_attn.*`); methods used after `prepare`."""

    _WKV_BUFFERS: dict = {}  # (device, dtype, shape) -> the dequantised kv_b_proj weight CUDA graphs read

    def __init__(self, cfg: ModelConfig, rope: Rope):
        super().__init__()
        self.cfg, self.rope = cfg, rope
        H, nh = cfg.hidden_size, cfg.num_attention_heads
        self.nh, self.nope, self.rdim, self.vdim, self.r = nh, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(H, nh * cfg.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(H, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, nh * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(H, self.r + self.rdim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.r, 1e-6)
        self.kv_b_proj = nn.Linear(self.r, nh * (self.nope + self.vdim), bias=False)
        self.o_proj = nn.Linear(nh * self.vdim, H, bias=cfg.attention_bias)
        self.scaling = cfg.qk_head_dim ** -0.5 * rope.softmax_mscale
        self.indexer = Indexer(cfg) if cfg.is_v32 else None  # DSA: attend to the top-k indexed tokens
        # keys per block of the expanded prefill path: the plan's Kb = min(kv_tokens, chunk_tokens)
        # (ModelRunner sets it from its placement); the workspace item assumes exactly this
        self.key_block = 2048

    def prepare(self, dtype: torch.dtype) -> None:
        """At load: fused q_a ++ kv_a weight, linears and norms resolved, RoPE columns, constants."""
        first = self.q_proj if self.cfg.q_lora_rank is None else self.q_a_proj
        if plain(first) and plain(self.kv_a_proj_with_mqa):
            concat_rows(first, self.kv_a_proj_with_mqa)
        wa = fused_view([first.weight, self.kv_a_proj_with_mqa.weight]) \
            if plain(first) and plain(self.kv_a_proj_with_mqa) else None
        self.dtype = dtype
        self.a = Lin(None, wa) if wa is not None else None  # q_a ++ kv_a in one matmul
        self.n_first = first.weight.shape[0] if wa is not None else None
        self.first, self.kva, self.o = Lin(first), Lin(self.kv_a_proj_with_mqa), Lin(self.o_proj)
        self.qb = Lin(self.q_b_proj) if self.cfg.q_lora_rank is not None else None
        for norm in (getattr(self, "q_a_layernorm", None), self.kv_a_layernorm):
            if norm is not None:
                norm.prepare()
        dev = self.kv_a_layernorm.weight.device
        self.kv_off = self.n_first if self.a is not None else 0  # kv_a's columns in its output
        self.pe_in_a = self.a is not None and self.qb is None  # q is a's first columns
        qw = self.nh * (self.nope + self.rdim)
        k0 = (self.kv_off if self.pe_in_a else qw + self.kv_off) + self.r
        self.pe_idx = torch.cat([self.rope.index(h * (self.nope + self.rdim) + self.nope, dev) for h in range(self.nh)]
                                + [self.rope.index(k0, dev)])
        self.consts = SimpleNamespace(scaling=torch.tensor(self.scaling, dtype=torch.float32, device=dev),
                                      ninf=torch.tensor(float("-inf"), dtype=torch.float32, device=dev))
        self.wkv_fixed = self._views(self.kv_b_proj.weight.to(dtype)) if type(self.kv_b_proj) is nn.Linear else None

    def _views(self, w: torch.Tensor):
        w3 = w.view(self.nh, self.nope + self.vdim, self.r)
        return w3[:, : self.nope], w3[:, self.nope:].transpose(1, 2)  # [nh, nope, r], [nh, r, v]

    def wkv(self, static: bool = False):
        """(W_UK, W_UV^T) in the compute dtype; with `static`, in one buffer per device and dtype shared by
        all layers, which CUDA graphs read in place."""
        if self.wkv_fixed is not None:
            return self.wkv_fixed
        w = weight_of(self.kv_b_proj, self.dtype)
        if static:
            key = (w.device, w.dtype, tuple(w.shape))
            buf = self._WKV_BUFFERS.get(key)
            if buf is None:
                buf = self._WKV_BUFFERS[key] = torch.empty_like(w)
            w = buf.copy_(w)
        return self._views(w)

    def project(self, xn: torch.Tensor, cs: torch.Tensor, w_uk: torch.Tensor | None) -> tuple:
        """xn [Tp, H], cs the RoPE table -> qcat, new cache rows [Tp, r + rope] (+ V3.2's indexer queries,
        head weights, new index keys); qcat is q_nope W_UK ++ q_pe with `w_uk`, else q_nope ++ q_pe."""
        T = xn.shape[0]
        if self.a is not None:
            a = self.a(xn)  # [Tp, q_a (or q) + r + rope]
            q0, ckv = a[:, : self.n_first], a
        else:
            q0, ckv = self.first(xn), self.kva(xn)
        qr = self.q_a_layernorm.norm(q0) if self.qb is not None else None  # q_resid [Tp, q_lora_rank]
        q = self.qb(qr) if self.qb is not None else q0  # [Tp, nh * (nope + rope)]
        src = ckv if self.pe_in_a else torch.cat([q, ckv], dim=1)
        m = src.index_select(1, self.pe_idx).view(T, self.nh + 1, 2 * self.rdim).mul_(cs[:, None, :])
        pe = m[..., : self.rdim] + m[..., self.rdim:]  # [Tp, nh + 1, rope]: the heads' q_pe, then k_pe
        new = torch.cat([self.kv_a_layernorm.norm(ckv[:, self.kv_off: self.kv_off + self.r]), pe[:, self.nh]], dim=-1)
        qn = q.view(T, self.nh, self.nope + self.rdim)[..., : self.nope]
        if w_uk is not None:
            qn = torch.bmm(qn.transpose(0, 1), w_uk).transpose(0, 1)  # [Tp, nh, r]
        out = torch.cat([qn, pe[:, : self.nh]], dim=-1), new
        if self.indexer is None:
            return out
        h = self.rdim // 2
        cos, sin = cs[:, :h], cs[:, 3 * h:]  # the table is [c, c, -s, s]
        iq, iw = self.indexer.query(xn, qr, cos, sin)
        return out + (iq.float(), iw, self.indexer.keys(xn, cos, sin))

    def core(self, qcat: torch.Tensor, new: torch.Tensor, ix: tuple, kv: torch.Tensor, ik: torch.Tensor | None,
             st, wkv: torch.Tensor | None) -> torch.Tensor:
        """Write the step's new rows (and V3.2 index keys), attend. All-decode (`st.decode`): o_lat
        [Tp, nh, r] (pad rows 0); else the values [Tp, nh, v], with wkv the dequantised kv_b_proj."""
        meta, T, Tp = st.meta, st.T, st.Tp
        kv.index_copy_(0, meta.write_slots, new[:T].to(kv.dtype))
        iq = iw = None
        if self.indexer is not None:
            iq, iw, ikn = ix
            ik.index_copy_(0, meta.write_slots, ikn[:T].to(ik.dtype))
        if st.decode:
            keep = None if iq is None else st.backend.select_decode(self.indexer, iq[:T], iw[:T], ik, meta)
            buf = st.o_lat_buffer(self.nh, self.r, qcat.dtype, qcat.device) if Tp > T else None
            o = st.backend.decode(self, qcat[:T], kv, meta, keep, None if buf is None else buf[:T])
            return o if buf is None else buf
        out = qcat.new_zeros(Tp, self.nh, self.vdim)
        for sl, hist, start in meta.prefill:
            keep = None if iq is None else self.indexer.select(iq[sl], iw[sl], ik[hist].to(qcat.dtype), start)
            o = st.backend.prefill(self, qcat[sl, :, : self.nope], qcat[sl, :, self.nope:], kv[hist].to(qcat.dtype),
                                   start, keep, wkv)
            out[sl] = o.view(-1, self.nh, self.vdim)
        if meta.key_slots is not None:
            out.index_copy_(0, meta.dec_rows, self._decode_rows(qcat, iq, iw, kv, ik, st, wkv))
        return out

    def _decode_rows(self, qcat, iq, iw, kv, ik, st, wkv) -> torch.Tensor:
        """The decode rows of a mixed step, absorbed as an all-decode step absorbs them (rows padded
        to the step's block, so the same bits) -> values [Bd, nh, v]."""
        rows = st.meta.dec_rows
        qd = qcat.index_select(0, rows)
        Bd = qd.shape[0]
        bp = padded(Bd, st.block)
        w_uk, w_uv = self._views(wkv)
        q_abs = torch.bmm(pad_rows(qd[..., : self.nope], bp).transpose(0, 1), w_uk).transpose(0, 1)[:Bd]
        keep = None
        if iq is not None:
            keep = st.backend.select_decode(self.indexer, iq.index_select(0, rows), iw.index_select(0, rows), ik,
                                            st.meta)
        o_lat = st.backend.decode(self, torch.cat([q_abs, qd[..., self.nope:]], dim=-1), kv, st.meta, keep)
        return torch.bmm(pad_rows(o_lat, bp).transpose(0, 1), w_uv).transpose(0, 1)[:Bd]  # [Bd, nh, v]
