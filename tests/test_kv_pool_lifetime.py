"""A dropped KV pool is freed by reference counting alone: the prefix cache and its host tier
refer back to the pool weakly, so the previous runner's pages go the moment it is dropped (a
plan-vs-allocated check right after a runner is replaced sees only the new one), with the cycle
collector off."""
from __future__ import annotations

import gc
import weakref

import torch

from checkpoint.config import ModelConfig
from gpu_service.local.tiny import tiny_config
from gpu_service.model.host_kv import HostKVTier, page_bytes
from gpu_service.model.kv import KVPool, SeqKV
from gpu_service.model.prefix_cache import PrefixCache, make_prefix_cache


def _pool() -> KVPool:
    cfg = ModelConfig.from_dict(tiny_config())
    return KVPool(cfg, 8, 4, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)


def test_pool_with_cache_and_host_tier_freed_without_the_cycle_collector():
    gc.collect()
    gc.disable()
    try:
        pool = _pool()
        cache = make_prefix_cache(pool, 2 * page_bytes(pool))
        assert isinstance(cache.host, HostKVTier)
        seq = SeqKV(pool)
        cache.attach(seq, list(range(9)))
        seq.reserve(9)
        seq.length = 9
        cache.commit(seq, list(range(9)))
        seq.free()
        kv, ref = weakref.ref(pool.kv[0]), weakref.ref(pool)
        del pool, cache, seq
        assert ref() is None, "the pool outlived its last holder: a reference cycle keeps it"
        assert kv() is None, "the pool's KV tensors outlived it"
    finally:
        gc.enable()


def test_cache_names_the_fix_once_its_pool_is_gone():
    pool = _pool()
    cache = PrefixCache(pool)
    del pool
    try:
        cache.pool
    except RuntimeError as e:
        assert "keep the pool" in str(e)
    else:
        raise AssertionError("a cache whose pool was freed must say so")
