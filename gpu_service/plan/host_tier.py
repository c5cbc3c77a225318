"""The prefix cache's host-RAM tier in the memory plan: its bytes and how many tokens it holds.

`--host-kv-cache SIZE` is taken as given (and counted in the host RAM required); "auto" (the
default) gives the tier `AUTO_SHARE` of the host RAM the plan leaves free (--host-ram minus shards,
GPU service and OS reserve), or nothing to report when --host-ram is not given (the server then
sizes it from MemAvailable at start, gpu_service.model.host_kv.auto_host_kv_bytes). DeepSeek-V4's
prefix cache has no host tier (a prefix is its pages plus a boundary snapshot, docs/v4-cache.md):
its plan reports none and an explicit size is refused.
"""
from __future__ import annotations

from checkpoint.config import ModelConfig
from gpu_service.plan.arch import kv_bytes_per_token
from gpu_service.plan.bytes import parse_size

AUTO_SHARE = 0.5


def host_kv_fields(cfg: ModelConfig, host: dict, host_kv_cache: int | str | None = "auto") -> dict:
    """Fields merged into `Plan.host`: host_kv_cache_bytes (None when unknown), host_kv_cache_tokens,
    and, for an explicit size, required_bytes / fits / missing_bytes updated."""
    if cfg.is_v4:
        if host_kv_cache not in (None, "auto", 0, "0"):
            raise ValueError(f"--host-kv-cache {host_kv_cache}: DeepSeek-V4's prefix cache has no host tier "
                             "(pages plus boundary snapshots stay on the GPU); drop --host-kv-cache")
        return dict(host_kv_cache_bytes=0, host_kv_cache_tokens=0, host_kv_tier=False)
    per_token = kv_bytes_per_token(cfg)
    cap = host.get("capacity_bytes")
    out: dict = {}
    if host_kv_cache in (None, "auto"):
        size = None if cap is None else max(0, int(AUTO_SHARE * (cap - host["required_bytes"])))
    else:
        size = parse_size(host_kv_cache)
        req = host["required_bytes"] + size
        out.update(required_bytes=req, fits=cap is None or req <= cap)
        if cap is not None and req > cap:
            out["missing_bytes"] = req - cap
    out.update(host_kv_cache_bytes=size, host_kv_cache_tokens=None if size is None else int(size // per_token))
    return out
