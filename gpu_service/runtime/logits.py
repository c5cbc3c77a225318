"""From a step's logits to each sampling row's token: penalties, bias, grammar mask, logprobs.

`choose_tokens(logits, rows)` takes the rows of the step's logits that sample this step (one per
request; [R, V], any device) and each row's state (`Row`: sampling params, generator, the
request's tokens so far, its grammar matcher, the ids `min_tokens` bans). Every operation is per
row, so a request's tokens do not depend on what it is batched with; the batched parts (argmax of
greedy rows, the grammar mask of constrained rows) are row-wise too. Order (sampling.py's
docstring): logit_bias, min_tokens ban, repetition, frequency and presence penalties, grammar
mask, then greedy argmax or temperature / top-k / top-p sampling. Logprobs come from the raw
logits (log-softmax before any of that), as vLLM reports them by default.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_service.runtime.grammar import apply_bitmask, fill_bitmasks
from gpu_service.runtime.sampling import sample, SamplingParams


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives [(id, logprob)] sorted by logprob."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


class Row(Protocol):
    params: SamplingParams
    gen: torch.Generator | None
    tokens: list[int]  # prompt + generated
    prompt_len: int
    matcher: object | None  # grammar.GrammarMatcher
    banned_early: tuple[int, ...]  # EOS + stop_token_ids, banned while len(out) < min_tokens


def process_row(x: torch.Tensor, p: SamplingParams, tokens: list[int], prompt_len: int,
                banned_early: tuple[int, ...] = ()) -> torch.Tensor:
    """Apply bias, min_tokens, repetition / frequency / presence penalties to one row `x` [V] in place."""
    V = x.shape[-1]
    if p.logit_bias:
        ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long, device=x.device)
        x.index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], dtype=x.dtype, device=x.device))
    out = tokens[prompt_len:]
    if p.min_tokens and len(out) < p.min_tokens and banned_early:
        x[torch.tensor([t for t in banned_early if t < V], dtype=torch.long, device=x.device)] = float("-inf")
    if p.repetition_penalty != 1.0:
        seen = torch.zeros(V, dtype=torch.bool, device=x.device)
        seen[torch.tensor(tokens, dtype=torch.long, device=x.device)] = True
        pen = torch.where(x > 0, x / p.repetition_penalty, x * p.repetition_penalty)
        x.copy_(torch.where(seen, pen, x))
    if (p.frequency_penalty or p.presence_penalty) and out:
        counts = torch.bincount(torch.tensor(out, dtype=torch.long, device=x.device), minlength=V)[:V].to(x.dtype)
        x -= counts * p.frequency_penalty + (counts > 0).to(x.dtype) * p.presence_penalty
    return x


def choose_tokens(logits: torch.Tensor, rows: list) -> list[tuple[int, TokenLogprob | None]]:
    """One (token, logprob or None) per row of `logits` [R, V] (see the module docstring)."""
    if not rows:
        return []
    raw = logits.float()
    lp = None
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if want_lp:
        lp = torch.log_softmax(raw[want_lp], dim=-1)
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    x = raw.clone() if constrained or any(r.params.processed for r in rows) else raw
    for i, r in enumerate(rows):
        if r.params.processed:
            process_row(x[i], r.params, r.tokens, r.prompt_len, r.banned_early)
    if constrained:
        mask = fill_bitmasks([rows[i].matcher for i in constrained], x.shape[-1])
        if len(constrained) == len(rows):  # no gather / scatter (each indexing op is a kernel launch)
            apply_bitmask(x, mask)
        else:
            x[constrained] = apply_bitmask(x[constrained], mask)
    greedy = x.argmax(-1).tolist() if any(r.params.greedy for r in rows) else None
    toks = [greedy[i] if r.params.greedy else sample(x[i], r.params, r.gen) for i, r in enumerate(rows)]
    out: list[tuple[int, TokenLogprob | None]] = [(t, None) for t in toks]
    if lp is not None:
        tok_idx = torch.tensor([toks[i] for i in want_lp], device=lp.device)
        chosen = lp.gather(1, tok_idx[:, None])[:, 0].tolist()
        kmax = max(rows[i].params.logprobs for i in want_lp)
        tv, ti = torch.topk(lp, kmax, dim=-1) if kmax else (None, None)
        tv = tv.tolist() if kmax else None
        ti = ti.tolist() if kmax else None
        for j, i in enumerate(want_lp):
            k = rows[i].params.logprobs
            top = list(zip(ti[j][:k], tv[j][:k])) if k else []
            out[i] = (toks[i], TokenLogprob(toks[i], chosen[j], top))
    return out


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of each next prompt token under `logits` [T, V] (row t predicts next_ids[t])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(next_ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    if k:
        tv, ti = torch.topk(lp, k, dim=-1)
        tv, ti = tv.tolist(), ti.tolist()
    return [TokenLogprob(t, c, list(zip(ti[j], tv[j])) if k else []) for j, (t, c) in enumerate(zip(next_ids, chosen))]
