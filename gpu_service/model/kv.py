"""The paged pool of MLA's compressed KV cache and each sequence's view of it.

Per layer one tensor of [pages * page_size, kv_lora_rank + rope] (c_kv ++ k_pe) and, for
DeepSeek-V3.2, the lightning indexer's keys in the same slots. A sequence owns a list of pages;
a `Chunk` is a run of its tokens inside a batch. With a prefix cache (`pool.cache`,
gpu_service.model.prefix_cache) leading full pages may be shared between sequences and cached
pages stay in use after their sequences end; the pool evicts them only when it needs pages.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from checkpoint.config import ModelConfig


class KVPool:
    """Paged pool for MLA's compressed cache: per layer [pages * page_size, kv_lora_rank + rope];
    position p of a sequence lives in slot page[p // S] * S + p % S."""

    def __init__(self, cfg: ModelConfig, num_pages: int, page_size: int, dtype: torch.dtype,
                 layer_devices: list[torch.device]):
        self.cfg, self.page_size, self.num_pages = cfg, page_size, num_pages
        # one row past the pages, never written (the null slot): the zero row padded key positions
        # read, so a stale non-finite value left in a freed page (or past a sequence's length) never
        # meets a 0 weight (0 * inf). The memory plan counts it (kv_tokens + 1 rows per layer).
        self.null_slot = num_pages * page_size
        self.kv = [torch.zeros(num_pages * page_size + 1, cfg.kv_cache_dim, dtype=dtype, device=d)
                   for d in layer_devices]  # c_kv (normalised) ++ k_pe (roped)
        # DeepSeek-V3.2: the lightning indexer's keys, [slots, index_head_dim] per layer, same slots
        self.index_k = ([torch.zeros(num_pages * page_size + 1, cfg.index_head_dim, dtype=dtype, device=d)
                         for d in layer_devices] if cfg.is_v32 else None)
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self.cache = None  # a PrefixCache attaches itself here

    @property
    def pages_in_use(self) -> int:
        """Pages not free: held by sequences or cached (see `cached_pages`)."""
        return self.usable_pages - len(self.free_pages)

    @property
    def usable_pages(self) -> int:
        """Pages sequences can hold (all of them: the null slot is a row past the pages)."""
        return self.num_pages

    def page_view(self, t: torch.Tensor) -> torch.Tensor:
        """A layer tensor's pages as [num_pages, page_size, dim] (the null slot left out)."""
        return t[: self.null_slot].view(self.num_pages, self.page_size, t.shape[1])

    @property
    def cached_pages(self) -> int:
        """Pages held only by the prefix cache (evictable); 0 without one."""
        return self.cache.evictable if self.cache is not None else 0

    def available(self) -> int:
        """Pages a reservation can get: free ones plus unreferenced cached ones."""
        return len(self.free_pages) + self.cached_pages

    def take(self, n: int) -> list[int]:
        """`n` pages, evicting unreferenced cached pages (LRU) when too few are free."""
        if n > len(self.free_pages) and self.cache is not None:
            self.cache.evict(n - len(self.free_pages))
        if n > len(self.free_pages):
            raise PoolExhausted(f"KV pool exhausted: need {n} pages of {self.page_size} tokens, "
                                f"{len(self.free_pages)} free of {self.usable_pages}")
        return [self.free_pages.pop() for _ in range(n)]

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
    nodes: list = field(default_factory=list)  # prefix-cache nodes referenced for pages[:len(nodes)]
    cache_root: bytes | None = None  # the prefix cache's chain root (salt) once looked up

    def reserve(self, n_tokens: int) -> None:
        need = -(-n_tokens // self.pool.page_size) - len(self.pages)
        if need > self.pool.available():
            raise PoolExhausted(
                f"KV pool exhausted: need {need} more pages of {self.pool.page_size} tokens, "
                f"{self.pool.available()} free of {self.pool.usable_pages}"
            )
        if need > 0:
            self.pages += self.pool.take(need)

    def free(self) -> None:
        if self.nodes or self.cache_root is not None:
            self.pool.cache.release(self)  # shared pages stay cached (marked -1 here)
        self.pool.free_pages.extend(p for p in reversed(self.pages) if p >= 0)
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
