"""DeepSeek-V4 attention core in torch (CPU and CUDA): one shared key = value head, a per-head
sink logit in the softmax denominator, and an additive bias that says which keys each query sees
(the sliding window over recent tokens, then the compressed entries the layer allows).

The masks are built here too, from positions only: `window_bias` (query t sees keys at positions
t - window + 1 .. t) and `compressed_bias` (entry w is complete for query t when
w < (t + 1) // ratio; a CSA layer further keeps only the indexer's picks).
"""
from __future__ import annotations

import torch


def sink_attention(q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [n, H, D], kv [S, D] (keys and values), bias [n, S] (0 or -inf), sinks [H] -> [n, H, D].
    softmax over the S keys and the head's sink logit (whose value is 0); the max is subtracted
    first, as the reference does."""
    n, H, _ = q.shape
    logits = torch.matmul(q, kv.t()) * scale + bias[:, None, :]  # [n, H, S]
    sink = sinks.to(logits.dtype)[None, :, None].expand(n, H, 1)
    logits = torch.cat([logits, sink], dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :-1]  # [n, H, S]: the sink's share dropped
    return torch.matmul(probs.to(kv.dtype), kv)


def window_bias(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int, dtype: torch.dtype) -> torch.Tensor:
    """[n, S]: 0 where 0 <= q - k < window, else -inf (causal sliding window)."""
    d = q_pos[:, None] - k_pos[None, :]
    bias = torch.zeros(d.shape, dtype=dtype, device=q_pos.device)
    return bias.masked_fill((d < 0) | (d >= window), float("-inf"))


def complete_entries(q_pos: torch.Tensor, ratio: int) -> torch.Tensor:
    """[n]: how many compressed entries query position t may see, (t + 1) // ratio."""
    return (q_pos + 1) // ratio


def compressed_bias(q_pos: torch.Tensor, n_entries: int, ratio: int, dtype: torch.dtype,
                    picks: torch.Tensor | None = None) -> torch.Tensor:
    """[n, W]: 0 for the entries query t sees, else -inf. Without `picks`, every complete entry
    (HCA); with picks [n, k] (entry indices, -1 for none), only those (CSA)."""
    n = q_pos.shape[0]
    if picks is None:
        w = torch.arange(n_entries, device=q_pos.device)
        bias = torch.zeros(n, n_entries, dtype=dtype, device=q_pos.device)
        return bias.masked_fill(w[None, :] >= complete_entries(q_pos, ratio)[:, None], float("-inf"))
    safe = torch.where(picks >= 0, picks, torch.full_like(picks, n_entries))
    bias = torch.full((n, n_entries + 1), float("-inf"), dtype=dtype, device=q_pos.device)
    return bias.scatter_(-1, safe, 0.0)[:, :n_entries]
