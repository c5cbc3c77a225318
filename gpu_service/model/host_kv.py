"""Host-RAM tier of the prefix cache: KV pages evicted from the GPU pool, kept in host memory.

One tensor per plane (MLA's c_kv ++ k_pe, and DeepSeek-V3.2's index keys) of
[slots, layers, page_size, dim], pinned when the pool is on CUDA, so a page's KV for all layers is
contiguous. Moving a batch of pages either way is one device copy per device (all pages, all
layers, staged through a pinned buffer) plus one gather / scatter per layer on the device; the
`PrefixCache` decides what moves (LRU) and this module only copies.

Sizing: `--host-kv-cache SIZE` (bytes, "64GiB", 0 = off, "auto" = a share of the RAM the memory
plan leaves free, or of MemAvailable without a plan: `auto_host_kv_bytes`).
"""
from __future__ import annotations

import weakref

import torch

AUTO_SHARE = 0.5  # of the host RAM left free by the plan (shards, GPU service, OS reserve)
AUTO_SHARE_UNPLANNED = 0.25  # of MemAvailable when there is no plan with --host-ram
AUTO_CAP_UNPLANNED = 64 << 30


def page_bytes(pool) -> int:
    """Bytes of one page (all layers, all planes) in the pool's dtype."""
    el = pool.kv[0].element_size()
    dims = pool.cfg.kv_cache_dim + (pool.cfg.index_head_dim if pool.index_k is not None else 0)
    return len(pool.kv) * pool.page_size * dims * el


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def auto_host_kv_bytes(plan=None) -> int:
    """The default host tier: AUTO_SHARE of the RAM the plan leaves free when it was given
    --host-ram, else AUTO_SHARE_UNPLANNED of MemAvailable (at most 64 GiB)."""
    host = getattr(plan, "host", None) or {}
    if host.get("host_kv_cache_bytes") is not None:
        return int(host["host_kv_cache_bytes"])
    avail = mem_available()
    return min(int(avail * AUTO_SHARE_UNPLANNED), AUTO_CAP_UNPLANNED) if avail else 0


class HostKVTier:
    """`num_slots` host copies of pool pages (see the module docstring)."""

    @property
    def pool(self):
        """The KV pool whose pages this tier copies (held weakly)."""
        p = self._pool()
        if p is None:
            raise RuntimeError("the KV pool of this host tier was freed: keep the pool alive while the tier is used")
        return p

    def __init__(self, pool, num_slots: int, pin: bool | None = None):
        if num_slots < 1:
            raise ValueError(f"host KV tier of {num_slots} pages: give --host-kv-cache at least one page "
                             f"({page_bytes(pool)} B) or 0 to turn it off")
        self._pool = weakref.ref(pool)  # the pool owns its cache and tier: no cycle back to it
        self.num_slots, S = num_slots, pool.page_size
        self.pin = any(t.device.type == "cuda" for t in pool.kv) if pin is None else pin
        self.planes = [pool.kv] + ([pool.index_k] if pool.index_k is not None else [])
        L, dt = len(pool.kv), pool.kv[0].dtype
        self.host = [torch.empty((num_slots, L, S, p[0].shape[1]), dtype=dt, pin_memory=self.pin)
                     for p in self.planes]
        self._staging: list[torch.Tensor | None] = [None] * len(self.planes)
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))
        # contiguous layer ranges per device: one host<->device copy each
        self.groups: list[tuple[torch.device, int, int]] = []
        for i, t in enumerate(pool.kv):
            if self.groups and self.groups[-1][0] == t.device and self.groups[-1][2] == i:
                self.groups[-1] = (t.device, self.groups[-1][1], i + 1)
            else:
                self.groups.append((t.device, i, i + 1))

    def bytes(self) -> int:
        return sum(h.numel() * h.element_size() for h in self.host)

    def alloc(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        self.free_slots.append(slot)

    def _stage(self, j: int, n: int) -> torch.Tensor:
        st = self._staging[j]
        if st is None or st.shape[0] < n:
            cap = max(n, 2 * st.shape[0] if st is not None else 16)
            st = torch.empty((cap,) + tuple(self.host[j].shape[1:]), dtype=self.host[j].dtype, pin_memory=self.pin)
            self._staging[j] = st
        return st[:n]

    def store(self, pages: list[int], slots: list[int]) -> int:
        """Copy pool `pages` (all layers) into host `slots`; returns the bytes copied."""
        n, S = len(pages), self.pool.page_size
        if not n:
            return 0
        slot_t = torch.tensor(slots, dtype=torch.long)
        for j, plane in enumerate(self.planes):
            st = self._stage(j, n)
            for dev, a, b in self.groups:
                idx = torch.tensor(pages, dtype=torch.long, device=dev)
                g = torch.stack([self.pool.page_view(plane[i])[idx] for i in range(a, b)], 1)
                st[:, a:b].copy_(g)  # one device->host copy per device (synchronous)
            self.host[j][slot_t] = st
        return n * sum(h[0].numel() * h.element_size() for h in self.host)

    def load(self, slots: list[int], pages: list[int]) -> int:
        """Copy host `slots` into pool `pages` (all layers); returns the bytes copied."""
        n, S = len(slots), self.pool.page_size
        if not n:
            return 0
        slot_t = torch.tensor(slots, dtype=torch.long)
        for j, plane in enumerate(self.planes):
            st = self._stage(j, n)
            torch.index_select(self.host[j], 0, slot_t, out=st)
            for dev, a, b in self.groups:
                idx = torch.tensor(pages, dtype=torch.long, device=dev)
                g = st[:, a:b].to(dev, non_blocking=self.pin)  # one host->device copy per device
                for i in range(a, b):
                    self.pool.page_view(plane[i])[idx] = g[:, i - a]
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)  # the staging buffer is reused by the next copy
        return n * sum(h[0].numel() * h.element_size() for h in self.host)

