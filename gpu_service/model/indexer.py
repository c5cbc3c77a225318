"""DeepSeek-V3.2's lightning indexer: which cached positions each query attends to.

From the compressed query q_resid and the layer input x it scores every cached token s for query t,

    I[t, s] = sum_j  w[t, j] * ReLU(softmax_scale * q[t, j] . k[s])
    w[t, :] = weights_proj(x[t]) * n_heads^-0.5,   softmax_scale = index_head_dim^-0.5,

and MLA attends only to the causal top-`index_topk` positions of I[t, :]. The index keys
k = k_norm(wk(x)), roped on their first qk_rope_head_dim dims (half-split layout), are cached per
layer (`KVPool.index_k`). This follows transformers' `DeepseekV32Indexer` (the equality reference),
which differs from DeepSeek's inference code in precision only: no Hadamard rotation, no FP8 of q
or of the cached keys (scores in float32), weights_proj in float32.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from checkpoint.config import ModelConfig


def rope_half_split(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Non-interleaved RoPE. x: [T, heads, d]; cos/sin: [T, d/2] -> [T, heads, d]."""
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


from gpu_service.plan.bytes import INDEX_SCORE_ELEMS as SCORE_ELEMS  # fp32 index scores held at once (the plan's)


class Indexer(nn.Module):
    """Parameters named as in the checkpoint: `...self_attn.indexer.{wq_b,wk,k_norm,weights_proj}`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if cfg.q_lora_rank is None:
            raise ValueError("deepseek_v32: the indexer reads the compressed query, so q_lora_rank must be set")
        if cfg.index_head_dim < cfg.qk_rope_head_dim:
            raise ValueError(f"deepseek_v32: index_head_dim={cfg.index_head_dim} must be >= "
                             f"qk_rope_head_dim={cfg.qk_rope_head_dim}")
        self.nh, self.hd, self.rdim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.nh * self.hd, bias=False)
        self.wk = nn.Linear(cfg.hidden_size, self.hd, bias=False)
        self.k_norm = nn.LayerNorm(self.hd, eps=1e-6)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.nh, bias=False)  # kept float32 by build_model
        self.softmax_scale = self.hd ** -0.5

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Index keys of new tokens, to be cached. x: [T, H] -> [T, index_head_dim]."""
        k = self.k_norm(self.wk(x))  # [T, hd]
        k_rot = rope_half_split(k[:, None, : self.rdim], cos, sin)[:, 0]
        return torch.cat([k_rot, k[:, self.rdim:]], dim=-1)

    def query(self, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The roped index queries [n, nh, hd] and head weights [n, nh] f32 (times nh^-0.5) of n
        queries (x [n, H], q_resid [n, q_lora_rank], cos/sin [n, rope / 2])."""
        n = x.shape[0]
        q = self.wq_b(q_resid).view(n, self.nh, self.hd)
        q = torch.cat([rope_half_split(q[..., : self.rdim], cos, sin), q[..., self.rdim:]], dim=-1)
        w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.nh ** -0.5
        return q, w

    def select(self, q: torch.Tensor, w: torch.Tensor, index_keys: torch.Tensor, start: int) -> torch.Tensor | None:
        """keep [n, S] bool (causal AND top-`index_topk`) for queries at start..start+n-1 from q [n, nh, hd],
        w [n, nh] and index_keys [S, hd]; None when index_topk >= S (dense)."""
        n, S, dev = q.shape[0], index_keys.shape[0], q.device
        if self.topk >= S:
            return None
        k32 = index_keys.float().t()  # [hd, S]
        index = torch.empty(n, S, dtype=torch.float32, device=dev)
        step = max(1, SCORE_ELEMS // (self.nh * S))  # queries per block: bounds the [b, nh, S] scores
        for i in range(0, n, step):  # one [b, nh, S] fp32 score block at a time, in place
            scores = torch.matmul(q[i:i + step].float(), k32).mul_(self.softmax_scale).relu_()  # [b, nh, S]
            index[i:i + step] = torch.matmul(w[i:i + step, None, :], scores)[:, 0]  # [b, S]
            del scores
        del q, w, k32
        qpos = torch.arange(start, start + n, device=dev)[:, None]
        causal = torch.arange(S, device=dev)[None, :] <= qpos  # [n, S]
        index.masked_fill_(~causal, float("-inf"))
        top = index.topk(self.topk, dim=-1).indices  # [n, topk]; masked picks are dropped by `& causal`
        del index
        keep = torch.zeros_like(causal).scatter_(1, top, True)
        return keep.logical_and_(causal)
