"""From a step's logits to each sampling row's token: penalties, bias, grammar mask, logprobs.

`choose_tokens(logits, rows)` takes the rows that sample this step ([R, V], any device) and each
row's state (`Row`). Every operation is per row, so a request's tokens do not depend on its batch;
the order is sampling.py's. Logprobs come from the raw logits, as vLLM reports them by default. A
row that cannot be sampled comes back as a `RowFailed` in its place; the other rows are sampled
as if it were not there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from gpu_service.runtime.grammar import apply_bitmask, fill_bitmasks
from gpu_service.runtime.sampling import sample, SamplingError, SamplingParams


@dataclass
class TokenLogprob:
    """The chosen token's logprob and the top alternatives [(id, logprob)] sorted by logprob."""

    token: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class RowFailed:
    """A row no token could be chosen for: `error` says why, `param` names the request field that
    caused it (None: not the client's doing)."""

    error: str
    param: str | None = None


def grammar_reason(error: str | None) -> str:
    """The grammar engine's reason, without the parser state and grammar dump it appends
    (llguidance: "lexer error: too many expressions constructed\n<state>...")."""
    head = (error or "the grammar does not allow it").split("<state>", 1)[0].strip()
    if "too many" in head or "TooComplex" in head:
        head += ": the grammar is too large for the grammar engine; simplify it (fewer or smaller repetitions)"
    return head[:500]


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


def _no_token(r) -> RowFailed:
    """The reason a row whose every logit is -inf cannot be sampled, naming what banned the tokens."""
    if r.matcher is not None:
        return RowFailed("no token can be sampled: the grammar allows only tokens that min_tokens / "
                         "stop_token_ids / logit_bias ban here; lower min_tokens or drop those bans", "min_tokens")
    return RowFailed("no token can be sampled: min_tokens bans EOS and stop_token_ids, and they cover every "
                     "token; lower min_tokens or list fewer stop_token_ids", "stop_token_ids")


def _failed(e: Exception) -> RowFailed:
    """A sampling exception as a row failure (a SamplingError may name the field)."""
    return RowFailed(f"sampling failed: {type(e).__name__}: {e}", getattr(e, "param", None))


def choose_tokens(logits: torch.Tensor, rows: list) -> list:
    """One (token, logprob or None) per row of `logits` [R, V] (see the module docstring), or a
    RowFailed for a row that cannot be sampled."""
    if not rows:
        return []
    raw = logits.float()
    failed: dict[int, RowFailed] = {}
    constrained = [i for i, r in enumerate(rows) if r.matcher is not None]
    processed = [i for i, r in enumerate(rows) if r.params.processed]
    x = raw.clone() if constrained or processed else raw
    for i in processed:
        try:
            process_row(x[i], rows[i].params, rows[i].tokens, rows[i].prompt_len, rows[i].banned_early)
        except Exception as e:  # noqa: BLE001 - this row alone
            failed[i] = _failed(e)
    if constrained:
        mask = fill_bitmasks([rows[i].matcher for i in constrained], x.shape[-1])
        for i in constrained:  # a matcher the grammar engine gave up on (e.g. too large) masks nothing true
            if rows[i].matcher.error is not None and i not in failed:
                failed[i] = RowFailed(f"grammar: {grammar_reason(rows[i].matcher.error)}", "response_format")
        if len(constrained) == len(rows):  # no gather / scatter (each indexing op is a kernel launch)
            apply_bitmask(x, mask)
        else:
            x[constrained] = apply_bitmask(x[constrained], mask)
    if constrained or processed:  # bans and masks may leave a row no token at all
        changed = sorted(set(constrained) | set(processed))
        dead = torch.isneginf(x[changed].amax(-1)).tolist()
        for i, d in zip(changed, dead):
            if d and i not in failed:
                failed[i] = _no_token(rows[i])
    greedy = x.argmax(-1).tolist() if any(r.params.greedy for r in rows) else None
    toks: list[int | None] = []
    for i, r in enumerate(rows):
        if i in failed:
            toks.append(None)
        elif r.params.greedy:
            toks.append(greedy[i])
        else:
            try:
                toks.append(sample(x[i], r.params, r.gen))
            except SamplingError as e:
                failed[i] = RowFailed(str(e), e.param)
                toks.append(None)
            except Exception as e:  # noqa: BLE001 - this row alone
                failed[i] = _failed(e)
                toks.append(None)
    out: list = [(t, None) if t is not None else failed[i] for i, t in enumerate(toks)]
    want_lp = [i for i, r in enumerate(rows) if r.params.logprobs is not None and i not in failed]
    if want_lp:
        _add_logprobs(out, raw, rows, toks, want_lp)
    return out


def _add_logprobs(out: list, raw: torch.Tensor, rows: list, toks: list, want_lp: list[int]) -> None:
    """Fill out[i] = (token, TokenLogprob) for the rows `want_lp` from the raw logits [R, V]."""
    lp = torch.log_softmax(raw[want_lp], dim=-1)
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


def prompt_logprobs(logits: torch.Tensor, next_ids: list[int], k: int) -> list[TokenLogprob]:
    """Logprobs of each next prompt token under `logits` [T, V] (row t predicts next_ids[t])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    idx = torch.tensor(next_ids, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, idx[:, None])[:, 0].tolist()
    if k:
        tv, ti = torch.topk(lp, k, dim=-1)
        tv, ti = tv.tolist(), ti.tolist()
    return [TokenLogprob(t, c, list(zip(ti[j], tv[j])) if k else []) for j, (t, c) in enumerate(zip(next_ids, chosen))]
