"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN would pass a plain `< 0`
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:  # also false for NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    def generator(self) -> torch.Generator | None:
        if self.greedy:
            return None
        g = torch.Generator()
        g.manual_seed(self.seed if self.seed is not None else torch.seed())
        return g


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    """logits: [V] float32 (any device). Returns the chosen token id."""
    if p.greedy:
        return int(torch.argmax(logits))
    x = logits.float().cpu() / p.temperature
    if p.top_k:
        kth = torch.topk(x, min(p.top_k, x.numel()))[0][-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sp, si = torch.sort(probs, descending=True)
        keep = sp.cumsum(0) - sp < p.top_p  # smallest prefix whose mass reaches top_p
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))
