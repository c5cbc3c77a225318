"""DeepSeek-V4 attention core in torch (CPU and CUDA): one shared key = value head, a per-head
sink logit in the softmax denominator, and an additive bias that says which keys each query sees
(the sliding window over recent tokens, then the compressed entries the layer allows), and for a
CSA layer each query's own gathered picks.

The masks are built here too, from positions only: `window_bias` (query t sees keys at positions
t - window + 1 .. t) and `compressed_bias` (entry w is complete for query t when
w < (t + 1) // ratio) and `picks_bias` (a CSA query's picks; -1 marks none).
"""
from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                   scale: float, own: torch.Tensor | None = None, own_bias: torch.Tensor | None = None,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, H, D], kv [S, D] (keys and values shared by the queries) or [n, S, D] (each query's own:
    the batched decode's padded keys), bias [n, S] (0 or -inf), sinks [H] -> [n, H, D]; `own` [n, k, D]
    with `own_bias` [n, k]: further keys each query has to itself (a CSA query's picked entries,
    gathered); `out` [n, H, D]: where to write the result (else a new tensor). softmax over the keys and
    the head's sink logit (whose value is 0); the max is
    subtracted first, as the reference does. Per-query keys are the GEMM's rows (M = S; K, N fixed),
    so a key's score does not depend on how far another query's keys were padded."""
    n, H, _ = q.shape
    S = kv.shape[-2]
    scores = torch.matmul(q, kv.t()) if kv.dim() == 2 else torch.bmm(kv, q.transpose(1, 2)).transpose(1, 2)
    parts = [scores.mul_(scale).add_(bias[:, None, :])]  # [n, H, S]
    del scores
    if own is not None:
        parts.append(torch.matmul(q, own.transpose(1, 2)).mul_(scale).add_(own_bias[:, None, :]))  # [n, H, k]
    parts.append(sinks.to(q.dtype)[None, :, None].expand(n, H, 1))
    logits = torch.cat(parts, dim=-1)
    del parts
    logits.sub_(logits.max(dim=-1, keepdim=True).values)
    probs = torch.softmax(logits, dim=-1).to(kv.dtype)  # [n, H, S (+ k) + 1]: the sink's share dropped below
    del logits
    out = torch.matmul(probs[..., :S], kv, out=out)
    if own is not None:
        out += torch.matmul(probs[..., S:-1], own)
    return out


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, S]: 0 where 0 <= q - k < window and k >= 0, else -inf (causal sliding window; negative key
    positions are the zero-padded window of a sequence shorter than it). k_pos [S] (shared) or [n, S]."""
    k = k_pos[None, :] if k_pos.dim() == 1 else k_pos
    d = q_pos[:, None] - k
    bias = torch.zeros(d.shape, dtype=dtype, device=q_pos.device)
    return bias.masked_fill((d < 0) | (d >= window) | (k < 0), float("-inf"))


def complete_entries(q_pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """[n]: how many compressed entries query position t may see, (t + 1) // ratio."""
    return (q_pos + 1) // ratio


def compressed_bias(q_pos: torch.Tensor, n_entries: int, ratio: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, W]: 0 for the entries query t sees (every complete one: HCA), else -inf. A CSA layer's
    queries read their picks instead (`sink_attention`'s `own` keys, `picks_bias`)."""
    n = q_pos.shape[0]
    w = torch.arange(n_entries, device=q_pos.device)
    bias = torch.zeros(n, n_entries, dtype=dtype, device=q_pos.device)
    return bias.masked_fill(w[None, :] >= complete_entries(q_pos, ratio)[:, None], float("-inf"))


def picks_bias(picks: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, k]: 0 for a pick, -inf for none (-1: fewer entries complete than k)."""
    return torch.zeros(picks.shape, dtype=dtype, device=picks.device).masked_fill(picks < 0, float("-inf"))
