"""A step's attention metadata over the paged pool, built once per micro-batch and device.

Every new token's slot (one `index_copy_` per layer writes them all); for the decode tokens (one
per sequence) the padded page table expanded to slots [B, Smax] with the positions past each
sequence's length pointing at the pool's zero row (`KVPool.null_slot`) and masked; for each
prefill chunk (n > 1) its rows, its history's slots and its start.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# Padded key columns at least: below a vector's worth or so the CPU softmax takes a scalar path
# (another exp, another summation order) that a longer padded row in a batch would not take.
MIN_KEYS = 64


@dataclass
class StepMeta:
    """One micro-batch's attention metadata on one device."""

    write_slots: torch.Tensor  # [T] long: the pool slot of every new token (chunks concatenated)
    dec_rows: torch.Tensor | None  # [Bd] rows of x that are decode tokens; None: every row is one
    key_slots: torch.Tensor | None  # [Bd, Smax] long: padded page table expanded to slots
    invalid: torch.Tensor | None  # [Bd, 1, Smax] bool: key position >= the sequence's length
    lengths: list[int]  # [Bd] keys each decode query sees (its position + 1)
    prefill: list[tuple[slice, torch.Tensor, int]]  # per chunk of n > 1: (rows, history slots, start)
    backend_state: dict | None = None  # what a backend plans once per step (FlashInfer: indices)

    @property
    def all_decode(self) -> bool:
        return self.dec_rows is None and not self.prefill and self.key_slots is not None


def build_meta(chunks, pool, device: torch.device) -> StepMeta:
    """Slot indices and masks of a step, from the chunks' page lists (pages already reserved)."""
    ps = pool.page_size
    write, dec_rows, dec_pages, lengths, prefill = [], [], [], [], []
    t0 = 0
    for ch in chunks:
        pages = ch.seq.pages
        write.extend(pages[p // ps] * ps + p % ps for p in range(ch.start, ch.start + ch.n))
        if ch.n == 1:
            dec_rows.append(t0)
            dec_pages.append(pages[: -(-(ch.start + 1) // ps)])
            lengths.append(ch.start + 1)
        else:
            hist = [pages[p // ps] * ps + p % ps for p in range(ch.start + ch.n)]
            prefill.append((slice(t0, t0 + ch.n), torch.tensor(hist, dtype=torch.long).to(device), ch.start))
        t0 += ch.n
    meta = StepMeta(torch.tensor(write, dtype=torch.long).to(device),
                    None if len(dec_rows) == t0 else torch.tensor(dec_rows, dtype=torch.long).to(device),
                    None, None, lengths, prefill)
    if dec_rows:
        P = max(max(len(p) for p in dec_pages), -(-MIN_KEYS // ps))  # at least MIN_KEYS columns
        table = torch.tensor([p + [0] * (P - len(p)) for p in dec_pages], dtype=torch.long)  # [Bd, P] padded
        slots = (table[:, :, None] * ps + torch.arange(ps)).view(len(dec_pages), P * ps)  # [Bd, Smax]
        invalid = torch.arange(P * ps)[None, None, :] >= torch.tensor(lengths)[:, None, None]  # [Bd, 1, Smax]
        slots = slots.masked_fill(invalid[:, 0], pool.null_slot)  # padded keys read the pool's zero row
        meta.key_slots, meta.invalid = slots.to(device), invalid.to(device)
    return meta
