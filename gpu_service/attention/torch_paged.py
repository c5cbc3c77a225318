"""The torch attention backend: batched paged MLA on CPU and CUDA.

Decode: every decode query of a step at once, in the weight-absorbed form: one gather of the
step's pages through the padded page table [B, Smax] and one set of bmm / softmax; padded key
positions read the pool's zero row and are masked to -inf (they contribute exact zeros: no padding
enters the arithmetic of a sequence's real keys). Keys are the GEMM's rows (M = Smax, K and N
fixed), so a key's score does not depend on how long the longest sequence of the batch is.

Prefill: one chunk's queries over its history with K/V expanded through kv_b_proj one key block
at a time and an online softmax (what the plan's `attn` workspace term assumes).

DeepSeek-V3.2: the lightning indexer's scores for the decode queries, batched over the same
padded slots, top-`index_topk` per query, as a keep-mask.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from gpu_service.attention.meta import MIN_KEYS, StepMeta


class TorchBackend:
    """Batched paged attention in torch (this module's docstring)."""

    name = "torch"

    def plan_step(self, meta: StepMeta, pool, device: torch.device) -> None:
        """Nothing to plan: the metadata is the torch backend's whole input."""

    def decode(self, mla, q: torch.Tensor, kv: torch.Tensor, meta: StepMeta, keep: torch.Tensor | None,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, nh, r + rope] against the step's padded slots -> o_lat [B, nh, r] (into `out` when given);
        in row groups when the batch's keys would exceed pool slots + B * MIN_KEYS (the plan's decode
        workspace); a row's result does not depend on its group."""
        B, Smax, r = q.shape[0], meta.key_slots.shape[1], mla.r
        scaling, ninf = mla.consts.scaling, mla.consts.ninf  # 0-d tensors: cheaper than Python scalars
        per = max(1, (kv.shape[0] + B * MIN_KEYS) // Smax)
        if out is None and per < B:
            out = q.new_empty(B, q.shape[1], r)
        for b0 in range(0, B, per):
            b1 = min(B, b0 + per)
            whole = b0 == 0 and b1 == B
            slots = meta.key_slots if whole else meta.key_slots[b0:b1]
            cache = kv.index_select(0, slots.reshape(-1)).view(b1 - b0, Smax, kv.shape[1])  # one gather
            if cache.dtype != q.dtype:
                cache = cache.to(q.dtype)
            scores = torch.bmm(cache, (q if whole else q[b0:b1]).transpose(1, 2)).transpose(1, 2)  # [b, nh, Smax]
            scores = scores.float().contiguous() if scores.dtype != torch.float32 else scores.contiguous()
            mask = meta.invalid if keep is None else ~keep[:, None, :]
            p = torch.softmax(scores.masked_fill_(mask if whole else mask[b0:b1], ninf).mul_(scaling), dim=-1)
            p = p if p.dtype == q.dtype else p.to(q.dtype)
            if out is None:
                return torch.bmm(p, cache[..., :r])
            torch.bmm(p, cache[..., :r], out=out[b0:b1])
        return out

    def prefill(self, mla, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, start: int,
                keep: torch.Tensor | None, wkv: torch.Tensor) -> torch.Tensor:
        """One chunk: q_nope [n, nh, nope], q_pe [n, nh, rope] at positions start.., cache [S, r + rope],
        keep [n, S] (V3.2) or None (causal), wkv [nh * (nope + v), r] -> [n, nh * v], `mla.key_block` keys
        at a time (at its peak one fp32 score block, one expanded K/V block, the fp32 accumulator: the
        plan's `attn` term)."""
        nh, nope, vdim, r, scaling, key_block = mla.nh, mla.nope, mla.vdim, mla.r, mla.scaling, mla.key_block
        n, S, dt, dev = q_nope.shape[0], cache.shape[0], q_nope.dtype, cache.device
        c_kv, k_pe = cache[:, :r], cache[:, r:]
        qn, qp = q_nope.transpose(0, 1), q_pe.transpose(0, 1)  # [nh, n, nope], [nh, n, rope] (views)
        qpos = torch.arange(start, start + n, device=dev)[:, None]
        m = torch.full((nh, n), float("-inf"), device=dev)  # running max
        l = torch.zeros(nh, n, device=dev)  # running sum of exp
        acc = torch.zeros(nh, n, vdim, device=dev)  # running sum of p @ v, fp32
        for s0 in range(0, S, key_block):
            s1 = min(S, s0 + key_block)
            kvx = F.linear(c_kv[s0:s1], wkv).view(s1 - s0, nh, nope + vdim)  # [b, nh, nope + v]
            sc = torch.matmul(qp, k_pe[s0:s1].t())  # [nh, n, b]
            sc.baddbmm_(qn, kvx[..., :nope].permute(1, 2, 0))
            if sc.dtype != torch.float32:
                sc = sc.float()
            sc.mul_(scaling)
            if keep is None:
                sc.masked_fill_(torch.arange(s0, s1, device=dev)[None, :] > qpos, float("-inf"))
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
            acc.add_(torch.matmul(p, kvx[..., nope:].transpose(0, 1)))  # [nh, n, v]
            del p, kvx
            m = m_new
        acc.div_(l[..., None])
        return acc.to(dt).transpose(0, 1).reshape(n, -1)

    def select_decode(self, indexer, q: torch.Tensor, w: torch.Tensor, ik: torch.Tensor,
                      meta: StepMeta) -> torch.Tensor | None:
        """V3.2: keep [B, Smax] (valid AND top-`index_topk`) from the indexer's queries q [B, nh, hd] and
        head weights w [B, nh]; None when no sequence has more than index_topk keys."""
        if max(meta.lengths) <= indexer.topk:
            return None
        B, Smax = meta.key_slots.shape
        per = max(1, (ik.shape[0] + B * MIN_KEYS) // Smax)
        keep = torch.zeros_like(meta.invalid[:, 0])  # [B, Smax] bool
        for b0 in range(0, B, per):
            b1 = min(B, b0 + per)
            keys = ik.index_select(0, meta.key_slots[b0:b1].reshape(-1)).view(b1 - b0, Smax, ik.shape[1]).float()
            scores = torch.relu(torch.bmm(q[b0:b1].float(), keys.transpose(1, 2)) * indexer.softmax_scale)
            del keys
            index = torch.bmm(w[b0:b1, None, :], scores)[:, 0].masked_fill_(meta.invalid[b0:b1, 0], float("-inf"))
            del scores
            keep[b0:b1].scatter_(1, index.topk(min(indexer.topk, Smax), dim=-1).indices, True)
        return keep.logical_and_(~meta.invalid[:, 0])
