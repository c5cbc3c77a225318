"""DeepSeek-V4's cache in the engine's paged pool (docs/v4-cache.md has the layout).

`V4Pool` is the engine's `KVPool` (same page accounting: free list, `take`, `available`, the prefix
cache's evictable pages) whose pages hold compressed entries instead of MLA rows: a page of S tokens
holds, per CSA layer, S/4 entries of head_dim and S/4 indexer keys of index_head_dim, per HCA layer
of ratio m, S/m entries of head_dim; window-only layers hold nothing in pages. Entry w of a layer of
ratio r lives in the page of token w·r, slot page·(S/r) + w mod (S/r); S must be a multiple of
lcm(4, every HCA ratio), so a page holds whole compression blocks of every layer. One row past the
pages per tensor belongs to no page (the memory plan counts it): the batched decode
(gpu_service.model.v4.decode) points its padded reads there (masked) and writes there the entries of
windows not complete yet (a static-shaped write per row); no sequence reads it unmasked.

`V4Seq` is the engine's `SeqKV` plus the bounded per-sequence state the model keeps outside pages
(per layer an `AttnState`: the last window - 1 keys, the compressors' pending rows and overlap
halves); its entries go through `PagedEntries` into the sequence's pages, so the model's one code
path (one-shot prefill, chunked prefill, decode) reads and writes the pool.

`V4PrefixCache` is the engine's `PrefixCache` (same keys, same page sharing: a prefix's entries never
change) plus a snapshot of the bounded state at a page boundary: a sequence whose step ends on a page
boundary keeps that state (`V4Seq.snaps`); when the page is committed the snapshot goes to its node
(a sequence keeps only its latest one there, but for the prompt's boundaries at multiples of
`keep_every`, which stay for other prompts sharing that prefix), charged pool pages for its bytes. A lookup attaches up
to the deepest cached node with a snapshot and restores it, so a second turn resumes exactly where
the first stopped on a boundary.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from gpu_service.model.kv import KVPool, PoolExhausted, SeqKV
from gpu_service.model.prefix_cache import page_key, PrefixCache, root_key
from gpu_service.model.v4.attention import AttnState

CSA = 4


def page_block(cfg) -> int:
    """The smallest page size V4's pool takes: lcm(4, every HCA ratio) tokens."""
    return math.lcm(CSA, *[r for r in cfg.compress_ratios[:cfg.num_hidden_layers] if r])


def default_page_size(cfg, usual: int = 64) -> int:
    """The page size V4 serves with when none is given: the smallest multiple of `page_block` that is
    at least the usual default (64 tokens; 128 for a release whose HCA ratio is 128)."""
    block = page_block(cfg)
    return -(-usual // block) * block


class V4Pool(KVPool):
    """Pages of compressed entries (module docstring); the accounting is KVPool's."""

    def __init__(self, cfg, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: "torch.device | list[torch.device]"):
        """`device`: of every layer, or one per layer (a memory plan's split: each layer's tensors on its GPU)."""
        block = page_block(cfg)
        if page_size < 1 or page_size % block:
            raise ValueError(f"--page-size {page_size}: a DeepSeek-V4 page must hold whole compression blocks of "
                             f"every layer; use a multiple of {block} (lcm of 4 and the HCA ratios)")
        self.cfg, self.page_size, self.num_pages = cfg, page_size, num_pages
        ratios = cfg.compress_ratios[:cfg.num_hidden_layers]
        self.ratios = tuple(ratios)
        devs = list(device) if isinstance(device, (list, tuple)) else [device] * len(ratios)
        self.entries = [torch.zeros(num_pages * page_size // r + 1, cfg.head_dim, dtype=dtype, device=d)
                        if r else None for r, d in zip(ratios, devs)]
        self.index_k = [torch.zeros(num_pages * page_size // CSA + 1, cfg.index_head_dim, dtype=dtype, device=d)
                        if r == CSA else None for r, d in zip(ratios, devs)]
        self.kv = [t for t in self.entries + self.index_k if t is not None]  # every paged tensor
        self.free_pages: list[int] = list(range(num_pages - 1, -1, -1))
        self.cache = None

    def bytes(self) -> int:
        """Bytes of every paged tensor."""
        return sum(t.numel() * t.element_size() for t in self.kv)

    def copy_page(self, src: int, dst: int) -> None:
        """Every paged tensor's rows of page `src` into page `dst` (a fork's partial page)."""
        for ratios, tensors in ((self.ratios, self.entries), ((CSA,) * len(self.ratios), self.index_k)):
            for r, t in zip(ratios, tensors):
                if t is not None:
                    k = self.page_size // r
                    t[dst * k:(dst + 1) * k].copy_(t[src * k:(src + 1) * k])

    def page_bytes(self) -> int:
        """Bytes one page holds over all layers."""
        return sum(t[:-1].numel() * t.element_size() for t in self.kv) // max(self.num_pages, 1)


class PagedEntries:
    """One compressor's entries of one sequence in the pool (the model's entries store)."""

    __slots__ = ("t", "seq", "per_page")

    def __init__(self, t: torch.Tensor, seq: "V4Seq", ratio: int):
        self.t, self.seq, self.per_page = t, seq, seq.pool.page_size // ratio

    def _slots(self, a: int, b: int) -> torch.Tensor:
        """Pool rows of entries a .. b - 1."""
        return self._rows(torch.arange(a, b))

    def _rows(self, w: torch.Tensor) -> torch.Tensor:
        """Pool rows of the entries at indices w (any shape, any device)."""
        pages = torch.tensor(self.seq.pages, dtype=torch.long, device=w.device)[w // self.per_page]
        return (pages * self.per_page + w % self.per_page).to(self.t.device)

    def write(self, first: int, new: torch.Tensor) -> None:
        """Entries first .. first + len(new) into the sequence's pages (reserved by the engine)."""
        self.t.index_copy_(0, self._slots(first, first + new.shape[0]), new.to(self.t.dtype))

    def read(self, count: int, like: torch.Tensor) -> torch.Tensor:
        """The first `count` entries [count, d] in like's dtype."""
        return self.t.index_select(0, self._slots(0, count)).to(like.dtype)

    def gather(self, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The entries at indices idx (any shape, each < those written) -> [*idx.shape, d] in like's dtype."""
        rows = self._rows(idx.reshape(-1))
        return self.t.index_select(0, rows).view(*idx.shape, self.t.shape[1]).to(like.dtype)


@dataclass(eq=False)
class V4Seq(SeqKV):
    """A sequence's pages plus its bounded state (module docstring): the model's cache of it."""

    layers: list = field(default_factory=list)  # AttnState per layer
    snaps: list = field(default_factory=list)  # (length, per-layer snapshots) at each page boundary a step ended on
    snap_node: object = None  # the prefix-cache node holding this sequence's latest snapshot
    fed_to: int = 0  # tokens the engine feeds before its next sample (set at the prefix-cache lookup)
    fork_at: int = -1  # the engine forks this sequence's n choices here (its last prompt token); -1: none
    fork_snap: tuple | None = None  # (fork_at, per-layer snapshots): the bounded state there, until copied

    def __post_init__(self):
        self._fresh()

    def _fresh(self) -> None:
        """Empty bounded state bound to this sequence's pages."""
        pool = self.pool
        self.layers = [AttnState(PagedEntries(pool.entries[i], self, r) if r else None,
                                 PagedEntries(pool.index_k[i], self, r) if r == CSA else None)
                       for i, r in enumerate(pool.ratios)]
        self.snaps = []
        self.snap_node = self.fork_snap = None  # fork_at stays: a preempted leader forks still
        self.fed_to = 0

    def free(self) -> None:
        """Pages back to the pool (or the prefix cache), the bounded state dropped."""
        super().free()
        self._fresh()

    def take_snapshot(self) -> None:
        """Keep the bounded state now (a pass of the engine's step ended at a page boundary) until the
        step's commit places it."""
        self.snaps.append((self.length, [st.snapshot() for st in self.layers]))

    def take_fork_snapshot(self) -> None:
        """Keep the bounded state now, at `fork_at` tokens (the choices forked from this one copy it)."""
        self.fork_snap = (self.length, [st.snapshot() for st in self.layers])

    def fork_into(self, dst: "V4Seq", n: int, cache: "V4PrefixCache | None") -> None:
        """`dst` becomes this sequence at its first `n` tokens (the `fork_snap` state): its full pages
        are this one's by reference where the prefix cache holds them (refcounts, as a lookup takes
        them; dst's own page for that position back to the pool), else copied; the partial last page
        copied; the bounded state (window keys, pending rows, overlap halves, counts) cloned. dst
        holds pages reserved for them (the engine's) and may hold a cached prefix of them already."""
        if self.fork_snap is None or self.fork_snap[0] != n:
            raise RuntimeError(f"V4 fork at {n} tokens without the sequence's snapshot there")
        S = self.pool.page_size
        if len(dst.pages) < -(-n // S) or dst.length > n:
            raise RuntimeError(f"V4 fork: destination holds {len(dst.pages)} pages and {dst.length} tokens for {n}")
        shared = cache is not None and dst.cache_root is not None and dst.cache_root == self.cache_root
        for i in range(dst.length // S, -(-n // S)):
            if shared and i == len(dst.nodes) and i < len(self.nodes) and (i + 1) * S <= n:
                node = self.nodes[i]  # a full page of the prompt, cached: by reference
                cache.share(node)
                self.pool.free_pages.append(dst.pages[i])
                dst.pages[i] = node.page
                dst.nodes.append(node)
            elif dst.pages[i] != self.pages[i]:
                self.pool.copy_page(self.pages[i], dst.pages[i])
        dst.length = n
        dst.restore(self.fork_snap)

    def restore(self, snap: tuple) -> None:
        """Continue from a snapshot taken at `self.length` tokens (the pages hold its entries)."""
        length, states = snap
        if length != self.length:
            raise RuntimeError(f"V4 snapshot of {length} tokens restored onto a sequence of {self.length}")
        for st, s in zip(self.layers, states):
            st.restore(s)


@dataclass(eq=False)
class Snapshot:
    """A cached node's bounded-state snapshot and the pool pages it is charged (its bytes rounded up)."""

    state: tuple  # (length, per-layer AttnState snapshots)
    pages: list[int]
    owner: object = None  # the running sequence that placed it (it keeps only its latest)


class V4PrefixCache(PrefixCache):
    """PrefixCache whose lookups stop at the deepest node with a bounded-state snapshot (module
    docstring). A snapshot is charged pool pages (its bytes rounded up to pages), so the engine's
    admission and preemption see it; it is dropped (pages freed) with its node, when its sequence
    places a newer one, or least recently used first when the pool needs pages and no cached node
    is left to evict. No host tier: the snapshots would have to move with the pages."""

    def __init__(self, pool: V4Pool, keep_every: int = 0):
        """`keep_every`: snapshots at prompt boundaries that are multiples of it (tokens, a multiple of
        the page size; 0: none) stay cached for other prompts sharing that prefix."""
        if keep_every % pool.page_size:
            raise ValueError(f"V4 prefix snapshots every {keep_every} tokens: use a multiple of the page size "
                             f"{pool.page_size}")
        super().__init__(pool, None)
        self.keep_every = keep_every
        self.snaps: "collections.OrderedDict[object, Snapshot]" = collections.OrderedDict()  # node -> its, LRU
        self.snap_pages = 0
        self.stats.update(snapshots=0, snapshots_dropped=0)

    @property
    def evictable(self) -> int:
        """Unreferenced cached pages plus every snapshot's pages (droppable at any time)."""
        return len(self.gpu_lru) + self.snap_pages

    def _depth(self, tokens: list[int], salt: str | None) -> int:
        """Pages of `tokens` cached on the GPU up to the deepest node holding a snapshot."""
        key, best, S = root_key(salt), 0, self.S
        for i in range((len(tokens) - 1) // S):
            key = page_key(key, tokens[i * S:(i + 1) * S])
            node = self.nodes.get(key)
            if node is None or node.page < 0:
                break
            if node in self.snaps:
                best = i + 1
        return best

    def attach(self, seq: V4Seq, tokens: list[int], salt: str | None = None) -> tuple[int, int]:
        """PrefixCache.attach up to the deepest snapshot, then the sequence resumes from it. Notes
        len(tokens) on the sequence: the runner splits the chunk that ends there at its last page
        boundary, so the sequence leaves a snapshot before its first sample."""
        k = self._depth(tokens, salt)
        seq.fed_to = len(tokens)
        hit = super().attach(seq, tokens[:k * self.S + 1], salt)
        if seq.nodes:
            self.snaps.move_to_end(seq.nodes[-1])
            seq.restore(self.snaps[seq.nodes[-1]].state)
        return hit

    def commit(self, seq: V4Seq, tokens: list[int]) -> None:
        """PrefixCache.commit, then the sequence's boundary snapshots onto their pages' nodes: one at a
        multiple of `keep_every` inside the prompt stays there (ownerless, until evicted: a shared
        system prompt's boundaries), any other replaces the one the sequence placed before; skipped
        when the pool cannot give its pages."""
        super().commit(seq, tokens)
        pending, seq.snaps = seq.snaps, []
        if seq.cache_root is None:
            return
        for snap in pending:
            length = snap[0]
            if not length or length // self.S > len(seq.nodes):
                continue
            node = seq.nodes[length // self.S - 1]
            if node in self.snaps:
                continue
            kept = bool(self.keep_every) and length % self.keep_every == 0 and length <= seq.fed_to
            old = self.snaps.get(seq.snap_node)
            if not kept and old is not None and old.owner is seq:
                self._unsnap(seq.snap_node)
            size = sum(t.numel() * t.element_size() for st in snap[1] for t in _tensors(st))
            try:
                pages = self.pool.take(-(-size // max(self.pool.page_bytes(), 1)))  # the node is referenced: kept
            except PoolExhausted:
                continue
            self.snaps[node] = Snapshot(snap, pages, None if kept else seq)
            self.snap_pages += len(pages)
            if not kept:
                seq.snap_node = node
            self.stats["snapshots"] += 1

    def share(self, node) -> None:
        """One more sequence references `node` (a fork taking its leader's cached page)."""
        self._incref(node)

    def _unsnap(self, node) -> None:
        """Drop `node`'s snapshot (if any), its pages back to the pool."""
        s = self.snaps.pop(node, None)
        if s is not None:
            self.pool.free_pages.extend(s.pages)
            self.snap_pages -= len(s.pages)
            self.stats["snapshots_dropped"] += 1

    def evict(self, k: int) -> int:
        """PrefixCache.evict (a dropped node's snapshots go with it), then snapshots least recently
        used first while fewer than `k` pages came free."""
        freed = super().evict(k)
        while freed < k and self.snaps:
            n0 = len(self.pool.free_pages)
            self._unsnap(next(iter(self.snaps)))
            freed += len(self.pool.free_pages) - n0
        return freed

    def _drop(self, n) -> None:
        """PrefixCache._drop, the snapshots of `n` and its descendants dropped first."""
        stack = [n]
        while stack:
            x = stack.pop()
            stack.extend(x.children)
            self._unsnap(x)
        super()._drop(n)

    def release(self, seq) -> None:
        """PrefixCache.release; the snapshot the sequence left stays with its node, ownerless."""
        s = self.snaps.get(seq.snap_node) if getattr(seq, "snap_node", None) is not None else None
        if s is not None and s.owner is seq:
            s.owner = None
        super().release(seq)

    def check(self, seqs=()) -> None:
        """PrefixCache.check with the snapshots' pages held too."""
        held = SimpleNamespace(pages=[p for s in self.snaps.values() for p in s.pages], nodes=[])
        if sum(len(s.pages) for s in self.snaps.values()) != self.snap_pages:
            raise AssertionError(f"snapshot pages counted {self.snap_pages}, held {len(held.pages)}")
        super().check(list(seqs) + [held])


def _tensors(st: dict):
    """The tensors of one layer's AttnState snapshot."""
    for v in [st["keys"], *st["comp"].values(), *st["index"].values()]:
        if isinstance(v, torch.Tensor):
            yield v
