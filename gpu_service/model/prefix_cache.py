"""Prefix sharing over the paged KV pool: full pages keyed by their token content from the start.

A block-hash chain: a full page's key is sha256(parent key || its S token ids), the root key
sha256(salt), so a key names the whole prefix (and the tenant's `cache_salt`); a lookup is one dict
probe per page. Not a radix tree: the pool's unit is the page, and content keys are the same in
any process (a shared host tier can reuse them).

A node holds one copy of its page, on the GPU (`page`) or on the host tier (`slot`,
gpu_service.model.host_kv). Sequences reference the nodes of their leading full pages
(`SeqKV.nodes`), so a referenced node and its ancestors are on the GPU and never evicted or
written. Unreferenced GPU nodes stay cached and are evicted LRU only when the pool needs pages
(moved to the host tier if any, else dropped; dropping a node drops its descendants). A lookup
matches at most (prompt - 1) // S pages: the last prompt token is always recomputed. Two
sequences prefilling the same prefix at once both compute it; the second references the existing
node and keeps its own copy private, so its numerics never change mid-request.
"""
from __future__ import annotations

import collections
import hashlib
import time
import weakref
from array import array
from dataclasses import dataclass, field
from typing import Iterable

ROOT_TAG = b"moesplit-kv-prefix-v1\0"


@dataclass(eq=False)
class Node:
    """One cached full page (identity-hashed: used as an LRU key)."""

    key: bytes
    parent: "Node | None"
    page: int = -1  # GPU pool page, or -1
    slot: int = -1  # host tier slot, or -1
    refs: int = 0
    alive: bool = True
    children: set = field(default_factory=set)

    @property
    def depth(self) -> int:
        d, n = 0, self.parent
        while n is not None:
            d, n = d + 1, n.parent
        return d


def page_key(parent: bytes, tokens: Iterable[int]) -> bytes:
    """The chained key of one full page."""
    return hashlib.sha256(parent + array("q", tokens).tobytes()).digest()


def root_key(salt: str | None) -> bytes:
    """The chain's root for a `cache_salt` (None and "" share the unsalted root)."""
    return hashlib.sha256(ROOT_TAG + (salt or "").encode("utf-8")).digest()


class PrefixCache:
    """Reference-counted, LRU-evicted cache of full KV pages; attaches itself as `pool.cache`, so
    `SeqKV.reserve` evicts through it and `SeqKV.free` returns shared pages to it."""

    def __init__(self, pool, host=None):
        # the pool owns its cache (`pool.cache`); the cache refers back weakly, so no reference
        # cycle keeps a dropped runner's KV pool alive until the cycle collector happens to run
        self._pool = weakref.ref(pool)
        self.host, self.S = host, pool.page_size
        self.nodes: dict[bytes, Node] = {}
        self.gpu_lru: collections.OrderedDict[Node, None] = collections.OrderedDict()  # refs 0, oldest first
        self.host_lru: collections.OrderedDict[Node, None] = collections.OrderedDict()  # oldest first
        self.gpu_nodes = 0
        self.stats = dict(queries=0, hits_gpu=0, hits_host=0, inserted=0, evicted_gpu=0, evicted_host=0,
                          dropped=0, copied_in_pages=0, copied_out_pages=0, copy_in_s=0.0, copy_out_s=0.0,
                          copy_in_bytes=0, copy_out_bytes=0)
        pool.cache = self

    @property
    def pool(self):
        """The KV pool this cache indexes (alive as long as anyone holds the pool)."""
        p = self._pool()
        if p is None:
            raise RuntimeError("the KV pool of this prefix cache was freed: keep the pool (the runner) alive "
                               "while its cache is used")
        return p

    # ---- sizes ------------------------------------------------------------------------------
    @property
    def evictable(self) -> int:
        """GPU pages held only by the cache (free to reuse after eviction)."""
        return len(self.gpu_lru)

    @property
    def host_pages(self) -> int:
        return len(self.host_lru)

    def page_counts(self) -> dict[tuple[str, str], int]:
        """{(tier, state): pages}: gpu referenced/cached, host cached/free."""
        out = {("gpu", "referenced"): self.gpu_nodes - len(self.gpu_lru), ("gpu", "cached"): len(self.gpu_lru)}
        if self.host is not None:
            out[("host", "cached")] = len(self.host_lru)
            out[("host", "free")] = self.host.num_slots - len(self.host_lru)
        return out

    # ---- lookup -----------------------------------------------------------------------------
    def attach(self, seq, tokens: list[int], salt: str | None = None) -> tuple[int, int]:
        """Give an empty `seq` the longest cached prefix of `tokens` (host pages copied back as far as the
        pool allows); sets `seq.length`; returns (pages from the GPU, pages from the host)."""
        if seq.pages or seq.length:
            raise RuntimeError("PrefixCache.attach needs an empty sequence: free it first")
        S = self.S
        seq.cache_root = key = root_key(salt)
        chain: list[Node] = []
        pending: list[Node] = []  # host nodes to copy in
        for i in range((len(tokens) - 1) // S):
            key = page_key(key, tokens[i * S:(i + 1) * S])
            node = self.nodes.get(key)
            if node is None:
                break
            if node.page >= 0:
                self._incref(node)
            else:
                if self.pool.available() - len(pending) < 1:
                    break  # no room to bring it back: the rest is recomputed
                self.host_lru.pop(node)  # pinned until copied in
                pending.append(node)
            chain.append(node)
        if pending:
            pages = self.pool.take(len(pending))  # may evict unreferenced GPU pages (never the chain's)
            t0 = time.perf_counter()
            self.stats["copy_in_bytes"] += self.host.load([n.slot for n in pending], pages)
            self.stats["copy_in_s"] += time.perf_counter() - t0
            self.stats["copied_in_pages"] += len(pending)
            for n, p in zip(pending, pages):
                self.host.free(n.slot)
                n.slot, n.page, n.refs = -1, p, 1
                self.gpu_nodes += 1
        seq.nodes = chain
        seq.pages = [n.page for n in chain]
        seq.length = len(chain) * S
        return len(chain) - len(pending), len(pending)

    def note_query(self, tokens: int, gpu_pages: int, host_pages: int) -> None:
        """Count one request's lookup (once per request, not per admission attempt)."""
        self.stats["queries"] += tokens
        self.stats["hits_gpu"] += gpu_pages * self.S
        self.stats["hits_host"] += host_pages * self.S

    # ---- insertion --------------------------------------------------------------------------
    def commit(self, seq, tokens: list[int]) -> None:
        """Insert `seq`'s pages that are full (KV written for all S tokens) and not yet cached;
        `tokens` are the sequence's tokens (KV exists for tokens[:seq.length])."""
        if seq.cache_root is None:
            return  # not a cached sequence (e.g. ModelRunner.generate)
        S = self.S
        key = seq.nodes[-1].key if seq.nodes else seq.cache_root
        for i in range(len(seq.nodes), seq.length // S):
            key = page_key(key, tokens[i * S:(i + 1) * S])
            parent = seq.nodes[-1] if seq.nodes else None
            node = self.nodes.get(key)
            if node is None:
                node = Node(key, parent, page=seq.pages[i], refs=1)
                self.nodes[key] = node
                if parent is not None:
                    parent.children.add(node)
                self.gpu_nodes += 1
                self.stats["inserted"] += 1
            elif node.page >= 0:
                self._incref(node)  # computed twice at once: ours stays private
            else:  # its copy is on the host: our page becomes its GPU copy
                self.host_lru.pop(node)
                self.host.free(node.slot)
                node.slot, node.page, node.refs = -1, seq.pages[i], 1
                self.gpu_nodes += 1
            seq.nodes.append(node)

    # ---- release / eviction -------------------------------------------------------------------
    def release(self, seq) -> None:
        """Drop `seq`'s references (leaf first, so ancestors are the most recently used); pages the
        cache holds are marked -1 in `seq.pages` (the caller frees the others)."""
        for i in range(len(seq.nodes) - 1, -1, -1):
            n = seq.nodes[i]
            if n.refs <= 0 or n.page < 0:
                raise AssertionError(f"prefix cache: releasing page {seq.pages[i]} with {n.refs} references")
            n.refs -= 1
            if seq.pages[i] == n.page:
                seq.pages[i] = -1
            if n.refs == 0:
                self.gpu_lru[n] = None
        seq.nodes = []
        seq.cache_root = None

    def _incref(self, n: Node) -> None:
        if n.refs == 0:
            self.gpu_lru.pop(n)
        n.refs += 1

    def evict(self, k: int) -> int:
        """Free at least `k` GPU pages (if that many are unreferenced), least recently used first:
        moved to the host tier when there is one (one copy for the batch), else dropped."""
        freed0 = len(self.pool.free_pages)
        victims = []
        while len(victims) < k and self.gpu_lru:
            victims.append(self.gpu_lru.popitem(last=False)[0])
        self.stats["evicted_gpu"] += len(victims)
        if self.host is not None and victims:
            slots = self._host_slots(len(victims))
            # a host drop may have cascaded into some; when slots are short, keep the shallow ones
            victims = sorted((n for n in victims if n.alive), key=lambda n: n.depth)
            moved = victims[:len(slots)]
            if moved:
                t0 = time.perf_counter()
                self.stats["copy_out_bytes"] += self.host.store([n.page for n in moved], slots[:len(moved)])
                self.stats["copy_out_s"] += time.perf_counter() - t0
                self.stats["copied_out_pages"] += len(moved)
            for s in slots[len(moved):]:
                self.host.free(s)
            for n, s in zip(moved, slots):
                self.pool.free_pages.append(n.page)
                n.page, n.slot = -1, s
                self.gpu_nodes -= 1
                self.host_lru[n] = None
            victims = victims[len(moved):]
        for n in victims:
            if n.alive:
                self._drop(n)
        return len(self.pool.free_pages) - freed0

    def _host_slots(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            s = self.host.alloc()
            if s is None:
                if not self.host_lru:
                    break
                self.stats["evicted_host"] += 1
                self._drop(self.host_lru.popitem(last=False)[0])
                continue
            out.append(s)
        return out

    def _drop(self, n: Node) -> None:
        """Forget `n` and its descendants (unreferenced by construction), freeing their copies."""
        stack = [n]
        while stack:
            x = stack.pop()
            stack.extend(x.children)
            if x.refs:
                raise AssertionError(f"prefix cache: dropping page {x.page} with {x.refs} references")
            x.alive = False
            del self.nodes[x.key]
            if x.page >= 0:
                self.gpu_lru.pop(x, None)
                self.pool.free_pages.append(x.page)
                self.gpu_nodes -= 1
            if x.slot >= 0:
                self.host_lru.pop(x, None)
                self.host.free(x.slot)
            self.stats["dropped"] += 1
        if n.parent is not None:
            n.parent.children.discard(n)

    def clear(self) -> None:
        """Drop every unreferenced page (GPU and host)."""
        for n in sorted(self.nodes.values(), key=lambda n: n.depth):
            if n.alive and n.refs == 0:
                self._drop(n)  # its descendants too (unreferenced as well)

    # ---- checks -------------------------------------------------------------------------------
    def check(self, seqs: Iterable = ()) -> None:
        """Assert the pool's and the cache's invariants given every live sequence: each page is
        free, private to one sequence, or one node's copy; references match the sequences'."""
        pool, owner = self.pool, {}

        def claim(p: int, who: str) -> None:
            if not 0 <= p < pool.num_pages:
                raise AssertionError(f"page {p} out of range ({who})")
            if p in owner:
                raise AssertionError(f"page {p} held twice: {owner[p]} and {who}")
            owner[p] = who

        for p in pool.free_pages:
            claim(p, "free")
        refs: collections.Counter = collections.Counter()
        for si, seq in enumerate(seqs):
            for i, p in enumerate(seq.pages):
                if i < len(seq.nodes) and seq.nodes[i].page == p:
                    refs[seq.nodes[i]] += 1
                    continue
                if i < len(seq.nodes):
                    refs[seq.nodes[i]] += 1
                claim(p, f"sequence {si}")
        gpu = 0
        for n in self.nodes.values():
            if not n.alive or (n.page >= 0) == (n.slot >= 0):
                raise AssertionError(f"node {n.key.hex()[:8]}: page {n.page} slot {n.slot} alive {n.alive}")
            if n.refs != refs[n]:
                raise AssertionError(f"node of page {n.page}: {n.refs} references, sequences hold {refs[n]}")
            if n.refs and (n.parent is not None and n.parent.refs == 0):
                raise AssertionError(f"referenced page {n.page} under an unreferenced parent")
            if n.parent is not None and (not n.parent.alive or n not in n.parent.children):
                raise AssertionError(f"node of page {n.page}: parent link broken")
            if n.page >= 0:
                gpu += 1
                claim(n.page, "cache")
                if (n.refs == 0) != (n in self.gpu_lru):
                    raise AssertionError(f"page {n.page}: refs {n.refs} but in the LRU: {n in self.gpu_lru}")
            elif n not in self.host_lru:
                raise AssertionError(f"host slot {n.slot} not in the host LRU")
        if len(owner) != pool.usable_pages:
            missing = sorted(set(range(pool.num_pages)) - set(owner))[:8]
            raise AssertionError(f"{pool.usable_pages - len(owner)} pages leaked (e.g. {missing})")
        if gpu != self.gpu_nodes or len(self.gpu_lru) + len(self.host_lru) > len(self.nodes):
            raise AssertionError(f"node counts: {gpu} on the GPU, counted {self.gpu_nodes}")
        if self.host is not None:
            slots = [n.slot for n in self.host_lru]
            if len(set(slots)) != len(slots) or set(slots) & set(self.host.free_slots):
                raise AssertionError("host slot held twice or both held and free")
            if len(slots) + len(self.host.free_slots) != self.host.num_slots:
                raise AssertionError("host slots leaked")


def make_prefix_cache(pool, host_kv_bytes: int = 0) -> PrefixCache:
    """A prefix cache over `pool`, with a host tier of `host_kv_bytes` (whole pages; 0: none)."""
    from gpu_service.model.host_kv import HostKVTier, page_bytes

    slots = int(host_kv_bytes) // page_bytes(pool) if host_kv_bytes else 0
    return PrefixCache(pool, HostKVTier(pool, slots) if slots > 0 else None)


def check_pool(pool, cache, seqs) -> None:
    """Assert `pool`'s invariants given every live sequence (`Engine(check_pool=True)`): with a
    cache `PrefixCache.check`, else every page is free or held by exactly one sequence."""
    seqs = [s for s in seqs if s.pages]
    if cache is not None:
        cache.check(seqs)
        return
    held = [p for s in seqs for p in s.pages] + pool.free_pages
    if sorted(held) != list(range(pool.num_pages)):
        raise AssertionError(f"KV pages leaked or held twice: {len(held)} of {pool.usable_pages}")
