"""Token sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator.

`SamplingParams` also carries what gpu_service.runtime.logits applies before sampling (OpenAI /
vLLM definitions, in this order): `logit_bias`; EOS and `stop_token_ids` banned below `min_tokens`;
`repetition_penalty` (prompt + output: a positive logit divided, a negative one multiplied);
`frequency_penalty` x count and `presence_penalty` x (count > 0) over the output; the grammar's
mask. `logprobs`: None, or the number of top alternatives (0..20).

Sampling runs in float32: a temperature below MIN_TEMPERATURE or a top_p below float32's smallest
normal is refused when the params are made; `sample` raises `SamplingError` for a row it cannot
sample, so the caller fails that request alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

MIN_TEMPERATURE = 1e-5  # below: logits / temperature overflows float32 (and 1e-300 is 0 there)
MIN_TOP_P = float(torch.finfo(torch.float32).tiny)  # ~1.2e-38: smaller rounds to 0 (or a denormal) in float32


class SamplingError(ValueError):
    """A row that cannot be sampled (no token left, non-finite probabilities); `param` names the
    request field that caused it, when one did."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs
    min_tokens: int = 0
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None  # None = off; k = the chosen token's logprob and the top k

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN would pass a plain `< 0`
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise ValueError(f"temperature {self.temperature:g} is below {MIN_TEMPERATURE:g}, where logits / "
                             f"temperature overflows float32: use 0 for greedy decoding or a temperature "
                             f">= {MIN_TEMPERATURE:g}")
        if not 0 < self.top_p <= 1:  # also false for NaN
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_p < MIN_TOP_P:
            raise ValueError(f"top_p {self.top_p:g} is 0 in float32 (below {MIN_TOP_P:.3g}): use top_k=1 to "
                             f"keep only the most likely token, or a top_p >= {MIN_TOP_P:.3g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not -(2**63) <= self.seed < 2**64:
            raise ValueError(f"seed must fit in 64 bits, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise ValueError(f"{name} must be in [-2, 2], got {v}")
        if not (math.isfinite(self.repetition_penalty) and 0 < self.repetition_penalty <= 2):
            raise ValueError(f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if any(not (math.isfinite(b) and -100 <= b <= 100) for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs (top_logprobs) must be in [0, 20], got {self.logprobs}")

    @property
    def processed(self) -> bool:
        """Whether the logits are changed before sampling (bias, min_tokens, penalties)."""
        return bool(self.logit_bias or self.min_tokens or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

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
    """logits: [V] float32 (any device). Returns the chosen token id; SamplingError when no token
    can be chosen (every logit -inf, or probabilities that are not finite)."""
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
        keep[0] = True  # at least the most likely token, however small top_p is
        sp = sp * keep
        probs = torch.zeros_like(probs).scatter_(0, si, sp)
    total = probs.sum()
    if not (torch.isfinite(total) and total > 0):
        raise SamplingError(f"no token can be sampled: the probabilities sum to {float(total)} "
                            f"(temperature {p.temperature:g}, top_p {p.top_p:g}, top_k {p.top_k})")
    return int(torch.multinomial(probs / total, 1, generator=gen))
