"""`train_tiny`: the tiny checkpoint of `make_tiny`, trained a few hundred AdamW steps on real text.

Random-init weights give nearly flat logits (top1 - top2 gaps ~0.2), so a weight-only quantisation
flips greedy tokens on near-ties; trained, the gaps are ~2 as in a real model. Same config, init
and on-disk format as `make_tiny` (its tensors are overwritten). The corpus is Python's
language-reference topics (`corpus_text`), fixed for an interpreter; batches are seeded crops
starting with BOS. Defaults: 500 steps, ~25 s, loss ~6.7 -> ~1.1.

This module imports torch and transformers; the runtime never does.
"""
from __future__ import annotations

import json
import math
import os
import time

from gpu_service.local import tiny

DENSE_ROUTING = {"num_hidden_layers": 4, "n_routed_experts": 4, "num_experts_per_tok": 4,
                 "n_group": 1, "topk_group": 1}  # every token uses every expert (no top-k knife edges)
CORPUS_CHARS = 20000


def corpus_text(chars: int = CORPUS_CHARS) -> str:
    """The default training text: the first `chars` characters of Python's language-reference topics
    (`pydoc_data.topics`), in sorted order: ~14k tokens, unaffected by edits to this repository."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n".join(topics[k] for k in sorted(topics))[:chars]


def corpus_ids(model_dir: str, text: str | None = None) -> list[int]:
    """`text` (default `corpus_text()`) tokenised by the checkpoint's tokenizer, no special tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return tok.encode(corpus_text() if text is None else text, add_special_tokens=False).ids


def train_model(model, ids: list[int], steps: int = 500, seed: int = 0, lr: float = 3e-3, batch: int = 8,
                seq_len: int = 64, bos: int = 0, threads: int | None = 1, log_every: int = 0) -> list[float]:
    """AdamW next-token training of a transformers causal LM in place on seeded crops of `ids`
    (each prefixed by `bos`); returns the per-step losses. Deterministic for a given thread count."""
    import torch

    old_threads = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(seed)
        data = torch.tensor(ids, dtype=torch.long)
        n = seq_len - 1
        if len(data) <= n:
            raise ValueError(f"corpus of {len(data)} tokens is shorter than seq_len {seq_len}")
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
        sched = torch.optim.lr_scheduler.LambdaLR(  # short warm-up, then cosine down to 10%
            opt, lambda s: min(1.0, (s + 1) / 20) * (0.55 + 0.45 * math.cos(math.pi * s / steps)))
        model.train()
        losses = []
        for step in range(steps):
            starts = torch.randint(0, len(data) - n, (batch,), generator=g)
            x = torch.stack([torch.cat([torch.tensor([bos]), data[s:s + n]]) for s in starts.tolist()])
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            if log_every and (step % log_every == 0 or step == steps - 1):
                print(f"step {step:4d}  loss {losses[-1]:.3f}")
        model.eval()
        return losses
    finally:
        torch.set_num_threads(old_threads)


def train_tiny(out_dir: str, fmt: str = "bf16", seed: int = 7, overrides: dict | None = None,
               arch: str = "deepseek_v3", steps: int = 500, train_seed: int = 0, threads: int | None = 1,
               text: str | None = None, log_every: int = 0, tokenizer: str | None = None, **train_kw) -> dict:
    """`make_tiny(out_dir, fmt, seed, overrides, arch, tokenizer)`, then `steps` training steps on `text`
    (a callable gets the written directory and returns the text) and the weights overwritten (in
    `fmt`); returns {"dir", "losses", "seconds"}."""
    out_dir = tiny.make_tiny(out_dir, fmt=fmt, seed=seed, overrides=overrides, arch=arch, tokenizer=tokenizer)
    with open(os.path.join(out_dir, "config.json")) as f:
        cfg = json.load(f)  # make_tiny's own dict (a tokenizer kind sets vocab and special ids)
    if callable(text):
        text = text(out_dir)
    model = tiny.build_hf_model(cfg, seed)  # the very model make_tiny wrote
    t0 = time.perf_counter()
    losses = train_model(model, corpus_ids(out_dir, text), steps=steps, seed=train_seed, threads=threads,
                         bos=int(cfg.get("bos_token_id", 0)), log_every=log_every, **train_kw)
    seconds = time.perf_counter() - t0
    stored = tiny._encode(tiny._to_checkpoint_tensors(model, cfg), fmt, cfg)
    # same names and shapes as make_tiny's, so the shard files and index come out with the same layout
    tiny._write_shards(out_dir, stored, int(cfg["num_hidden_layers"]))
    return {"dir": out_dir, "losses": losses, "seconds": seconds}
