"""The paged pool of MLA's compressed KV cache and each sequence's view of it.

Per layer one tensor of [pages * page_size, kv_lora_rank + rope] (c_kv ++ k_pe) and, for
DeepSeek-V3.2, the lightning indexer's keys in the same slots. A sequence owns a list of pages;
a `Chunk` is a run of its tokens inside a batch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from checkpoint.config import ModelConfig


class KVPool:
    """Paged pool for MLA's compressed cache: per layer [pages * page_size, kv_lora_rank + rope].

    A sequence owns a list of pages; token position p lives in slot page[p // S] * S + p % S.
    """

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 layer_devices: list[torch.device]):
        self.cfg, self.page_size, self.num_pages = cfg, page_size, num_pages
        self.kv = [torch.zeros(num_pages * page_size, cfg.kv_cache_dim, dtype=dtype, device=d)
                   for d in layer_devices]  # c_kv (normalised) ++ k_pe (roped)
        # DeepSeek-V3.2: the lightning indexer's keys, [slots, index_head_dim] per layer, same slots
        self.index_k = ([torch.zeros(num_pages * page_size, cfg.index_head_dim, dtype=dtype, device=d)
                         for d in layer_devices] if cfg.is_v32 else None)
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))

    @property
    def pages_in_use(self) -> int:
        return self.num_pages - len(self.free_pages)

    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.kv + (self.index_k or []))


class PoolExhausted(RuntimeError):
    """The KV pool has no free page: wait for a request to finish or lower the load."""


@dataclass
class SeqKV:
    """One sequence's view of the pool."""

    pool: KVPool
    pages: list[int] = field(default_factory=list)
    length: int = 0  # tokens whose KV has been written

    def reserve(self, n_tokens: int) -> None:
        need = -(-n_tokens // self.pool.page_size) - len(self.pages)
        if need > len(self.pool.free_pages):
            raise PoolExhausted(
                f"KV pool exhausted: need {need} more pages of {self.pool.page_size} tokens, "
                f"{len(self.pool.free_pages)} free of {self.pool.num_pages}"
            )
        for _ in range(max(need, 0)):
            self.pages.append(self.pool.free_pages.pop())

    def free(self) -> None:
        self.pool.free_pages.extend(reversed(self.pages))
        self.pages.clear()
        self.length = 0

    def slots(self, start: int, end: int, device: torch.device) -> torch.Tensor:
        pos = torch.arange(start, end)
        pages = torch.tensor(self.pages, dtype=torch.long)[pos // self.pool.page_size]
        return (pages * self.pool.page_size + pos % self.pool.page_size).to(device)


@dataclass
class Chunk:
    """A run of consecutive tokens of one sequence inside a batch."""

    seq: SeqKV
    start: int  # position of the first token
    n: int
