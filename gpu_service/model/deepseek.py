"""Our PyTorch implementation of the DeepSeek-V3 architecture, minus the routed experts.

Embeddings, RMSNorm, MLA attention with YaRN RoPE and a compressed KV cache (c_kv + k_pe per
token per layer), the dense MLP layers, the router (sigmoid + correction bias, group-limited top-k),
shared experts and lm_head. Routed experts are never loaded here: each MoE layer hands its
tokens to an `ExpertsFn` (the gRPC experts client, or an in-process backend in benchmarks).

The forward pass takes a flat token batch made of per-sequence chunks (continuous batching):
each chunk writes its c_kv/k_pe into the paged `KVPool` and attends over its sequence's cache.
A one-token chunk (decode) uses the weight-absorbed MLA path; longer chunks expand K/V.
DeepSeek-V3.2 (DSA): each MLA also caches lightning-indexer keys (`KVPool.index_k`) and attends
only to the top-`index_topk` positions its `Indexer` selects (gpu_service/indexer.py).
"""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from checkpoint.config import ModelConfig
from gpu_service.model.experts_api import ExpertsFn
from gpu_service.model.qlinear import make_quantized, weight_of
from gpu_service.model.indexer import Indexer
from gpu_service.model.kv import Chunk, KVPool
from gpu_service.model import fast_decode, paged_attention


# --------------------------------------------------------------------------------------- basics
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in float32 (torch's fused rms_norm: the same values, fewer ops)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class Rope:
    """YaRN rotary embedding for the qk_rope_head_dim part (DeepSeek interleaved pairs)."""

    def __init__(self, cfg: ModelConfig):
        dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
        self.interleave = cfg.rope_interleave
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
        rs = cfg.rope_scaling
        self.attention_factor = 1.0
        self.softmax_mscale = 1.0
        if rs is None:
            inv_freq = 1.0 / pos_freqs
        else:
            factor = float(rs["factor"])
            orig = rs["original_max_position_embeddings"]
            beta_fast = rs.get("beta_fast") or 32
            beta_slow = rs.get("beta_slow") or 1
            mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
            if rs.get("attention_factor") is not None:
                self.attention_factor = float(rs["attention_factor"])
            elif mscale and mscale_all:
                self.attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            else:
                self.attention_factor = yarn_mscale(factor)

            def corr_dim(rot: float) -> float:
                return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

            low, high = corr_dim(beta_fast), corr_dim(beta_slow)
            if rs.get("truncate", True):
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
            extrap = 1 - ramp
            inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
            if mscale_all:
                self.softmax_mscale = yarn_mscale(factor, mscale_all) ** 2
        self.inv_freq = inv_freq  # [dim/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, dim/2]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, dim]; cos/sin: [T, dim/2]. Output in the de-interleaved (half-split) layout."""
        c, s = cos[:, None, :], sin[:, None, :]
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


# ------------------------------------------------------------------------------------ attention
class MLA(nn.Module):
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

    def _q(self, x: torch.Tensor) -> torch.Tensor:
        if self.cfg.q_lora_rank is None:
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                chunks: list[Chunk], ik: torch.Tensor | None = None) -> torch.Tensor:
        # x: [T, H]; kv: this layer's pool tensor [slots, r + rope]; ik: its index keys [slots, index_head_dim]
        meta = getattr(chunks, "paged", None)  # a StepView: the batched paged path (paged_attention.py)
        if meta is not None:
            return paged_attention.mla_forward(self, x, cos, sin, kv, meta, ik)
        T = x.shape[0]
        if self.indexer is None:
            q = self._q(x).view(T, self.nh, self.nope + self.rdim)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))  # [T, q_lora_rank], the indexer's query input
            q = self.q_b_proj(q_resid).view(T, self.nh, self.nope + self.rdim)
            idx_new = self.indexer.keys(x, cos, sin).to(ik.dtype)  # [T, index_head_dim]
        q_nope, q_pe = q[..., : self.nope], self.rope.apply(q[..., self.nope:], cos, sin)  # [T,nh,nope],[T,nh,rope]
        ckv = self.kv_a_proj_with_mqa(x)  # [T, r + rope]
        c = self.kv_a_layernorm(ckv[:, : self.r])
        k_pe = self.rope.apply(ckv[:, None, self.r:], cos, sin)[:, 0]  # [T, rope]
        new = torch.cat([c, k_pe], dim=-1).to(kv.dtype)  # [T, r + rope]
        del ckv, c, k_pe

        out = x.new_empty(T, self.nh * self.vdim)
        wkv = weight_of(self.kv_b_proj, x.dtype)  # dequantised once per call, shared by chunks and key blocks
        t0 = 0
        for ch in chunks:
            sl = slice(t0, t0 + ch.n)
            t0 += ch.n
            kv[ch.seq.slots(ch.start, ch.start + ch.n, kv.device)] = new[sl]
            cache = kv[ch.seq.slots(0, ch.start + ch.n, kv.device)].to(x.dtype)  # [S, r + rope]
            keep = None
            if self.indexer is not None:
                ik[ch.seq.slots(ch.start, ch.start + ch.n, ik.device)] = idx_new[sl]
                keys = ik[ch.seq.slots(0, ch.start + ch.n, ik.device)].to(x.dtype)  # [S, index_head_dim]
                keep = self.indexer.select(x[sl], q_resid[sl], cos[sl], sin[sl], keys, ch.start)
            out[sl] = self._attend(q_nope[sl], q_pe[sl], cache, ch.start, keep, wkv)
            del cache, keep
        del wkv, q, q_nope, q_pe, new
        return self.o_proj(out)

    def _attend(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, start: int,
                keep: torch.Tensor | None, wkv: torch.Tensor) -> torch.Tensor:
        """keep: [n, S] bool, the positions each query may see (DSA selection, causal included);
        wkv: kv_b_proj's weight [nh*(nope+v), r] in the compute dtype (dequantised once per step)."""
        n, S = q_nope.shape[0], cache.shape[0]
        c_kv, k_pe = cache[:, : self.r], cache[:, self.r:]  # [S, r], [S, rope]
        if n == 1:
            # weight-absorbed decode: score = (q_nope W_UK) . c_kv + q_pe . k_pe ; out = (attn c_kv) W_UV
            w3 = wkv.view(self.nh, self.nope + self.vdim, self.r)
            q_abs = torch.einsum("thd,hdr->thr", q_nope, w3[:, : self.nope])  # [1,nh,r]
            scores = torch.einsum("thr,sr->ths", q_abs, c_kv) + torch.einsum("thd,sd->ths", q_pe, k_pe)
            if keep is not None:
                scores.masked_fill_(~keep[:, None, :], float("-inf"))
            p = torch.softmax(scores.float() * self.scaling, dim=-1).to(q_nope.dtype)  # [1,nh,S]
            o_lat = torch.einsum("ths,sr->thr", p, c_kv)
            o = torch.einsum("thr,hvr->thv", o_lat, w3[:, self.nope:])  # [1,nh,v]
            return o.reshape(n, -1)
        return self._prefill(q_nope, q_pe, c_kv, k_pe, start, keep, wkv)

    def _prefill(self, q_nope, q_pe, c_kv, k_pe, start, keep, wkv) -> torch.Tensor:
        """Expanded prefill: K/V of one key block at a time through kv_b_proj, online softmax.

        What it keeps at its peak (the plan's `attn` workspace term, gpu_service/plan/bytes.py):
        one [nh, n, b] score block in fp32 plus, for a 16-bit compute dtype, its compute-dtype
        twin for one op (the matmul result before the fp32 copy, or the probabilities cast back
        for p @ v); one expanded K/V block [b, nh, nope + v]; the fp32 accumulator [nh, n, v].
        Softmax steps are in place and every block is dropped before the next is built."""
        n, S, dt = q_nope.shape[0], c_kv.shape[0], q_nope.dtype
        qn, qp = q_nope.transpose(0, 1), q_pe.transpose(0, 1)  # [nh, n, nope], [nh, n, rope] (views)
        qpos = torch.arange(start, start + n, device=c_kv.device)[:, None]
        m = torch.full((self.nh, n), float("-inf"), device=c_kv.device)  # running max
        l = torch.zeros(self.nh, n, device=c_kv.device)  # running sum of exp
        acc = torch.zeros(self.nh, n, self.vdim, device=c_kv.device)  # running sum of p @ v, fp32
        for s0 in range(0, S, self.key_block):
            s1 = min(S, s0 + self.key_block)
            kvx = F.linear(c_kv[s0:s1], wkv).view(s1 - s0, self.nh, self.nope + self.vdim)  # [b, nh, nope+v]
            sc = torch.matmul(qp, k_pe[s0:s1].t())  # [nh, n, b]
            sc.baddbmm_(qn, kvx[..., : self.nope].permute(1, 2, 0))
            if sc.dtype != torch.float32:
                sc = sc.float()
            sc.mul_(self.scaling)
            if keep is None:
                sc.masked_fill_(torch.arange(s0, s1, device=c_kv.device)[None, :] > qpos, float("-inf"))
            else:
                sc.masked_fill_(~keep[:, s0:s1], float("-inf"))
            m_new = torch.maximum(m, sc.amax(-1))
            m_safe = m_new.masked_fill(torch.isinf(m_new), 0.0)  # rows with nothing yet: subtract 0
            sc.sub_(m_safe[..., None]).exp_()  # p, in place
            corr = torch.exp(m - m_safe)
            l.mul_(corr).add_(sc.sum(-1))
            acc.mul_(corr[..., None])
            p = sc.to(dt) if dt != torch.float32 else sc
            del sc
            acc.add_(torch.matmul(p, kvx[..., self.nope:].transpose(0, 1)))  # [nh, n, v]
            del p, kvx
            m = m_new
        acc.div_(l[..., None])
        return acc.to(dt).transpose(0, 1).reshape(n, -1)


# ------------------------------------------------------------------------------------------ MLP
class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Router(nn.Module):
    """Sigmoid scores; selection with e_score_correction_bias and group-limited top-k (top-2 sum
    per group); weights from the unbiased scores, normalised, times routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cfg, E = self.cfg, self.cfg.n_routed_experts
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias.float()
        if cfg.n_group > 1:
            g = choice.view(-1, cfg.n_group, E // cfg.n_group).topk(2, dim=-1)[0].sum(-1)  # [T, G]
            gidx = g.topk(cfg.topk_group, dim=-1, sorted=False)[1]
            gmask = torch.zeros_like(g, dtype=torch.bool).scatter_(1, gidx, True)  # [T, G]
            choice = choice.view(-1, cfg.n_group, E // cfg.n_group).masked_fill(
                ~gmask[:, :, None], float("-inf")).view(-1, E)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]  # [T, k]
        w = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return ids, w * cfg.routed_scaling_factor


class MoE(nn.Module):
    """Router + shared experts; routed experts on the shards, except the optional GPU-resident
    hot experts (`experts`, named like the checkpoint: mlp.experts.{e}.*), which are computed
    here and sent to the shards with weight 0 so that the shards skip them."""

    def __init__(self, cfg: ModelConfig, layer: int, hot: list[int] = ()):
        super().__init__()
        self.layer = layer
        self.gate = Router(cfg)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self.hot = list(hot)
        self.experts = nn.ModuleDict({str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size) for e in self.hot}) \
            if self.hot else None

    def start(self, x: torch.Tensor, experts: ExpertsFn) -> Callable[[], torch.Tensor]:
        """Route and send to the shards; returns `finish()` -> MoE output. Between the two, the
        caller may compute something else (the other micro-batch's attention: ping-pong)."""
        ids, w = self.gate(x)  # [T, k], [T, k] float32
        w_remote = w if self.experts is None else self.remote_weights(ids, w)
        handle = experts(self.layer, x, ids, w_remote)  # shards work while we compute the rest

        def finish() -> torch.Tensor:
            shared = self.shared_experts(x) if self.shared_experts is not None else None
            routed = handle.wait()
            if self.experts is not None:
                routed = routed + self.hot_output(x, ids, w, routed)
            return routed if shared is None else routed + shared

        return finish

    def _hot_ids(self, device: torch.device) -> torch.Tensor:
        hot = self.__dict__.get("_hot_t")
        if hot is None or hot.device != device:
            hot = self.__dict__["_hot_t"] = torch.tensor(self.hot, device=device)
        return hot

    def remote_weights(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The weights sent to the shards: 0 for the GPU-resident hot experts (the shards skip them)."""
        return w.masked_fill((ids[..., None] == self._hot_ids(ids.device)).any(-1), 0.0)

    def hot_output(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """sum over the hot experts this step selected of w * expert(x) on their rows. One
        host sync finds the hot experts present; the loop is bounded by min(#hot, T * k)."""
        out = torch.zeros_like(like)
        present = (ids[..., None] == self._hot_ids(ids.device)).any(1).any(0).nonzero().flatten().tolist()  # one sync
        for j in present:
            e = self.hot[j]
            rows, cols = torch.where(ids == e)
            y = self.experts[str(e)](x[rows]) * w[rows, cols, None].to(x.dtype)
            out.index_add_(0, rows, y.to(out.dtype))
        return out

    def forward(self, x: torch.Tensor, experts: ExpertsFn) -> torch.Tensor:
        return self.start(x, experts)()


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rope: Rope, hot: list[int] = ()):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, rope)
        self.mlp = MoE(cfg, layer, hot) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def steps(self, x, cos, sin, kv, chunks, experts: ExpertsFn, ik=None):
        """Generator: attention, then (MoE layers) send to the shards and yield once while they
        work, then finish. Returns the layer output (StopIteration.value)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv, chunks, ik)
        h = self.post_attention_layernorm(x)
        if not isinstance(self.mlp, MoE):
            return x + self.mlp(h)
        finish = self.mlp.start(h, experts)
        yield
        return x + finish()

    def forward(self, x, cos, sin, kv, chunks, experts: ExpertsFn, ik=None):
        return _run(self.steps(x, cos, sin, kv, chunks, experts, ik))


def _run(gen):
    """Run a `steps` generator to completion; returns its value."""
    try:
        while True:
            next(gen)
    except StopIteration as e:
        return e.value


def _round_robin(gens: list) -> list:
    """Advance generators in turn until all finish: while one micro-batch's experts are on the
    shards, the next micro-batch computes its attention (ping-pong). Returns their values."""
    out, active = [None] * len(gens), list(range(len(gens)))
    while active:
        for j in list(active):
            try:
                next(gens[j])
            except StopIteration as e:
                out[j] = e.value
                active.remove(j)
    return out


def split_micro_batches(chunks: list[Chunk]) -> list[list[Chunk]]:
    """Two micro-batches of whole sequences with about half the tokens each (one if < 2 chunks)."""
    if len(chunks) < 2:
        return [chunks]
    total, acc = sum(c.n for c in chunks), 0
    for i, c in enumerate(chunks[:-1]):
        acc += c.n
        if acc * 2 >= total:
            return [chunks[: i + 1], chunks[i + 1:]]
    return [chunks[:-1], chunks[-1:]]


# ---------------------------------------------------------------------------------------- model
class DeepseekV3(nn.Module):
    """Everything but the routed experts. Parameter names equal the checkpoint's (minus experts)."""

    def __init__(self, cfg: ModelConfig, hot_experts: dict[int, list[int]] | None = None):
        super().__init__()
        self.cfg = cfg
        self.rope = Rope(cfg)
        hot_experts = hot_experts or {}
        self.ping_pong = True  # two micro-batches overlap attention with remote experts
        self.batched_attention = True  # False: MLA's per-sequence reference path
        self.fused_decode = True  # all-decode steps through fast_decode's segments (batched path only)
        self.graphs = None  # a cuda_graphs.Graphs: decode segments replayed per batch-size bucket
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg, i, self.rope, hot_experts.get(i, ()))
                                          for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layer_devices(self) -> list[torch.device]:
        return [blk.input_layernorm.weight.device for blk in self.model.layers]

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, chunks: list[Chunk], pool: KVPool,
                experts: ExpertsFn, slot: int = 0):
        """Generator over all layers for one micro-batch (`slot`); yields while its experts are
        remote. An all-decode step runs the fused decode segments (gpu_service/model/fast_decode.py)."""
        cos_sin: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
        views: dict[torch.device, list[Chunk]] = {}  # per device: the chunks, or a StepView with metadata
        fast: dict[torch.device, fast_decode.DecodeStep | None] = {}
        B = x.shape[0]
        for i, blk in enumerate(self.model.layers):
            dev = pool.kv[i].device
            x = x.to(dev)
            if dev not in cos_sin:
                cos_sin[dev] = self.rope.cos_sin(positions.to(dev), x.dtype)
                views[dev] = paged_attention.step_view(chunks, pool, dev) if self.batched_attention else chunks
                meta = getattr(views[dev], "paged", None)
                fast[dev] = None
                if fast_decode.eligible(self, meta):
                    graphs = self.graphs.get(dev, slot, B) if self.graphs is not None else None
                    Bp = graphs.rows if graphs is not None else fast_decode.padded_rows(B, dev)
                    fast[dev] = fast_decode.DecodeStep(meta, *cos_sin[dev], B, Bp, graphs)
            st = fast[dev]
            if st is not None:
                if x.shape[0] != st.Bp:
                    x = torch.cat([x[:B], x.new_zeros(st.Bp - B, x.shape[1])]) if st.Bp > B else x[:B]
                x = yield from fast_decode.block_steps(fast_decode.fast_block(self, i, x.dtype), x, st, pool.kv[i],
                                                       experts, i, pool.index_k[i] if pool.index_k is not None else None)
                continue
            if x.shape[0] != B:
                x = x[:B]
            x = yield from blk.steps(x, *cos_sin[dev], pool.kv[i], views[dev], experts,
                                     pool.index_k[i] if pool.index_k is not None else None)
        return x[:B] if x.shape[0] != B else x

    def _run_layers(self, x, positions, groups, bounds, pool, experts) -> torch.Tensor:
        """Every layer, micro-batches in ping-pong."""
        gens = [self._layers(x[a:b], positions[a:b], g, pool, experts, slot)
                for slot, (g, a, b) in enumerate(zip(groups, bounds[:-1], bounds[1:]))]
        return torch.cat(_round_robin(gens)) if len(gens) > 1 else _run(gens[0])

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, chunks: list[Chunk], pool: KVPool, experts: ExpertsFn,
                all_logits: bool = False) -> torch.Tensor:
        """input_ids: [T] (chunks concatenated). Returns logits [len(chunks), V] of each chunk's
        last token (or [T, V] with all_logits). Writes the chunks' KV and advances seq.length."""
        emb_dev = self.model.embed_tokens.weight.device
        x = self.model.embed_tokens(input_ids.to(emb_dev))  # [T, H]
        all_decode = all(c.n == 1 for c in chunks)
        positions = (torch.tensor([c.start for c in chunks]) if all_decode  # decode: one op
                     else torch.cat([torch.arange(c.start, c.start + c.n) for c in chunks]))
        for c in chunks:
            c.seq.reserve(c.start + c.n)
        groups = split_micro_batches(chunks) if self.ping_pong else [chunks]
        bounds = torch.tensor([0] + [sum(c.n for c in g) for g in groups]).cumsum(0).tolist()
        x = self._run_layers(x, positions, groups, bounds, pool, experts)
        for c in chunks:
            c.seq.length = max(c.seq.length, c.start + c.n)
        x = x.to(self.lm_head.weight.device)
        if not all_logits:
            last = torch.tensor([c.n for c in chunks]).cumsum(0) - 1
            x = x[last.to(x.device)]
        n = x.shape[0]
        pad = fast_decode.padded_rows(n, x.device) - n  # batch-invariant GEMM rows (fast_decode)
        if pad and not all_logits:
            x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
        x = self.model.norm(x)
        return self.lm_head(x)[:n].float()


def checkpoint_name(param_name: str) -> str:
    """Our parameter names are the checkpoint's names, so the load table is the identity."""
    return param_name


def build_model(cfg: ModelConfig, get: Callable[[str], "object"], dtype: torch.dtype,
                device_of: Callable[[str], torch.device],
                linear_format: Callable[[str], str | None] = lambda name: None,
                get_stored: Callable[[str], "object"] | None = None,
                hot_experts: dict[int, list[int]] | None = None) -> tuple[DeepseekV3, set[str]]:
    """Build the model on the meta device and fill every parameter from `get(name) -> float32
    ndarray`, placing each on `device_of(param_name)`. Nothing is allocated twice and nothing is
    left random: a missing tensor raises through `get`. Router weights stay float32 (as in the
    reference). `linear_format(weight_name)` may return "fp8"/"int8" to hold that linear
    weight-only quantised; an FP8 checkpoint's own e4m3 arrays are kept without re-quantising
    (through `get_stored`). Returns the model and the set of checkpoint names loaded."""
    with torch.device("meta"):
        model = DeepseekV3(cfg, hot_experts)
    loaded: set[str] = set()
    for name, p in list(model.named_parameters()):
        src = checkpoint_name(name)
        if src == "lm_head.weight" and cfg.tie_word_embeddings:
            src = "model.embed_tokens.weight"
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        dev = device_of(name)
        fmt = linear_format(name) if isinstance(mod, nn.Linear) and attr == "weight" else None
        if fmt is not None:
            stored = get_stored(src) if get_stored is not None else None
            if fmt == "int4" and stored is not None and stored.format == "int4":
                a = stored.arrays
                q = make_quantized(None, "int4", dev, stored=(
                    torch.from_numpy(np.ascontiguousarray(a["weight_packed"])),
                    torch.from_numpy(np.ascontiguousarray(a["weight_scale"]).view(np.int16)).view(torch.bfloat16),
                    tuple(stored.shape)))
            elif fmt == "fp8" and stored is not None and stored.format == "fp8":
                pair = (torch.from_numpy(stored.arrays["weight"].view(np.uint8).copy()).view(torch.float8_e4m3fn),
                        torch.from_numpy(np.array(stored.arrays["weight_scale_inv"], dtype=np.float32)))
                if tuple(pair[0].shape) != tuple(p.shape):
                    raise ValueError(f"tensor {src!r} has shape {tuple(pair[0].shape)}, expected {tuple(p.shape)}")
                qc = cfg.quantization
                q = make_quantized(None, "fp8", dev, stored=pair,
                                   fp8_block=tuple(qc.block_size) if qc is not None and qc.method == "fp8" else (128, 128))
            else:
                w = torch.from_numpy(get(src))
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"tensor {src!r} has shape {tuple(w.shape)}, expected {tuple(p.shape)}")
                q = make_quantized(w, fmt, dev)
            parent_name, _, child = mod_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, q)
            loaded.add(src)
            continue
        t = torch.from_numpy(get(src))
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"tensor {src!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)} from config.json")
        keep32 = ".mlp.gate." in name or ".indexer.weights_proj." in name  # float32 as in the reference
        mod._parameters[attr] = nn.Parameter(
            t.to(device=dev, dtype=torch.float32 if keep32 else dtype), requires_grad=False)
        loaded.add(src)
    fast_decode.fuse_weights(model)  # q_a ++ kv_a, gate ++ up: one weight each, the modules hold views
    return model.eval(), loaded
