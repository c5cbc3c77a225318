"""Prefix cache (gpu_service.model.prefix_cache) and its host tier (gpu_service.model.host_kv).

Tiny fp32 checkpoints on the CPU with in-process experts. The reference is always the same
engine or runner without the cache (`prefix_cache=False`): greedy tokens equal, last-step logits
within 1e-5, for DeepSeek-V3 and V3.2 (index keys cached too), with the prefix served by the GPU
tier and, separately, by the host tier. Prefill work is counted twice: the engine's
`prefill_tokens` counter and the tokens the routed experts (the CPU shards' work) receive.
Engines here run with `check_pool=True`: the pool's invariants are asserted after every step.
"""
import time

import pytest
import torch

PAGE = 16
SYSTEM = [(i * 37 + 11) % 480 + 5 for i in range(70)]  # a 70-token "system prompt with tools"


@pytest.fixture(scope="module", params=["deepseek_v3", "deepseek_v32"])
def ckpt(request, tmp_path_factory):
    from cpu_expert_service.server import load_shard
    from gpu_service.local.tiny import make_tiny

    # V3.2 dense (index_topk > the conversation): its sparse top-k is not chunking-invariant even
    # without the cache (near-tied index scores flip with the prefill chunk size), so the tokens
    # are compared dense; the index keys are still cached, and checked against a full prefill
    over = {"index_topk": 512} if request.param == "deepseek_v32" else None
    d = make_tiny(str(tmp_path_factory.mktemp("ckpt") / request.param), "bf16", seed=0, overrides=over,
                  arch=request.param)
    return d, load_shard(d, None, None, "numpy")[1]


@pytest.fixture(scope="module")
def v3(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("ckpt") / "v3"), "bf16", seed=0)


class CountingExperts:
    """LocalExperts that counts the tokens sent to the first MoE layer (what the CPU shards compute)."""

    def __init__(self, backend, layer):
        from gpu_service.experts.handoff import LocalExperts

        self.inner, self.layer, self.tokens = LocalExperts(backend), layer, 0

    def __call__(self, layer, h, ids, w):
        if layer == self.layer:
            self.tokens += h.shape[0]
        return self.inner(layer, h, ids, w)


def make_runner(model_dir, backend, kv_tokens=4096, cache=True, host_pages=0):
    from checkpoint.reader import CheckpointReader
    from gpu_service.runtime.runner import ModelRunner

    reader = CheckpointReader(model_dir)
    experts = CountingExperts(backend, reader.config.moe_layers[0])
    r = ModelRunner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=kv_tokens,
                    page_size=PAGE, prefix_cache=cache)
    if host_pages:
        from gpu_service.model.host_kv import page_bytes
        from gpu_service.model.prefix_cache import make_prefix_cache

        r.prefix_cache = make_prefix_cache(r.pool, host_pages * page_bytes(r.pool))
    return r


def engine(runner, **kw):
    from gpu_service.runtime.engine import Engine

    return Engine(runner, None, max_batch=kw.pop("max_batch", 8), chunk_tokens=kw.pop("chunk_tokens", 48),
                  check_pool=True, **kw).start()


def lcp(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def conversation(eng, turns=5, max_tokens=6, salt=None, between=None, rewrite=True):
    """An agent-like conversation: each turn resends everything (+ a user message / tool result).
    From turn 3 the previous answer is rewritten (Kimi's `<think></think>`: P_N need not extend
    P_{N-1} + output). Yields (prompt, output, prefill tokens computed, expert tokens) per turn."""
    prompt, out = list(SYSTEM), []
    for t in range(turns):
        if t:
            answer = out[:1] + [3] + out[4:] if rewrite and t >= 3 else out
            prompt = prompt + answer + [(t * 53 + j * 7) % 400 + 40 for j in range(9 + 4 * t)]
        if between is not None:
            between(t)
        c0, e0 = eng.counters["prefill_tokens_computed"], eng.runner.experts.tokens
        h = eng.submit(prompt, max_tokens=max_tokens, ignore_eos=True, cache_salt=salt)
        out, _, fin = h.result(120)
        assert fin == "length", eng.last_error
        yield prompt, out, eng.counters["prefill_tokens_computed"] - c0, eng.runner.experts.tokens - e0, h


def prefill(runner, tokens, upto=None):
    """Last-token logits of `tokens` prefilled after the runner's cached prefix (if any), that
    prefix's length, and the cache contents of positions [0, upto or prefix): per plane (MLA
    c_kv ++ k_pe, V3.2 index keys) a [layers, n, dim] tensor."""
    from gpu_service.model.kv import Chunk

    seq = runner.new_seq()
    try:
        if runner.prefix_cache is not None:
            runner.prefix_cache.attach(seq, tokens)
        start = seq.length
        logits = runner.step(tokens[start:], [Chunk(seq, start, len(tokens) - start)])[0]
        pool, n = runner.pool, start if upto is None else upto
        planes = [torch.stack([t[seq.slots(0, n, t.device)] for t in plane])
                  for plane in [pool.kv] + ([pool.index_k] if pool.index_k is not None else [])]
        return logits, start, planes
    finally:
        seq.free()


# ---- reference: cache on == cache off ------------------------------------------------------------
@pytest.mark.parametrize("tier", ["gpu", "host"])
def test_multi_turn_matches_no_cache(ckpt, tier):
    model_dir, backend = ckpt
    off = engine(make_runner(model_dir, backend, cache=False))
    # host tier: a GPU pool too small to keep the conversation while another request runs
    on = engine(make_runner(model_dir, backend, kv_tokens=256 if tier == "host" else 4096,
                            host_pages=64 if tier == "host" else 0))
    other = [(i * 11 + 3) % 450 + 20 for i in range(200)]

    def evict(t):  # between turns, a 200-token request pushes the conversation out of the GPU pool
        if tier == "host" and t:
            assert on.submit(other[: 150 + t], max_tokens=2, ignore_eos=True).result(120)[2] == "length"

    try:
        ref = [(p, o) for p, o, *_ in conversation(off)]
        got = [(p, o, h) for p, o, _, _, h in conversation(on, between=evict)]
        assert [(p, o) for p, o, _ in got] == ref
        assert all(h.cached_tokens > 0 for _, _, h in got[1:])
        st = on.stats()
        assert st["prefix_hits_" + tier] > 0
        if tier == "host":
            assert st["prefix_copied_out_pages"] > 0 and st["prefix_copied_in_pages"] > 0
    finally:
        on.stop()
        off.stop()
    # last-step logits of the final prompt + answer: cached prefix vs full prefill
    final = ref[-1][0] + ref[-1][1]
    if tier == "host":
        on.runner.prefix_cache.evict(on.pool.num_pages)  # everything unreferenced to the host
        assert on.pool.cached_pages == 0 and on.runner.prefix_cache.host_pages > 0
    got_logits, start, cached = prefill(on.runner, final)
    want, _, full = prefill(off.runner, final, upto=start)
    assert start >= len(ref[-1][0]) - PAGE
    torch.testing.assert_close(got_logits, want, atol=1e-5, rtol=0)
    assert len(cached) == (2 if on.cfg.is_v32 else 1)  # V3.2: the index keys came back too
    for c, f in zip(cached, full):
        torch.testing.assert_close(c, f, atol=1e-5, rtol=0)


def test_prefill_only_new_tokens(v3):
    """Turn N computes len(P_N) - LCP(P_N, P_{N-1} + output_{N-1}) tokens, plus at most one page,
    counted by the engine and by the tokens the routed experts receive."""
    from cpu_expert_service.server import load_shard

    backend = load_shard(v3, None, None, "numpy")[1]
    off = engine(make_runner(v3, backend, cache=False))
    on = engine(make_runner(v3, backend))
    try:
        prev = None
        for (p, o, computed, experts, _), (_, _, full, _, _) in zip(conversation(on, turns=8),
                                                                  conversation(off, turns=8)):
            assert experts == computed + len(o) - 1  # prefill + one token per decode step
            assert full == len(p)
            new = len(p) - (lcp(p, prev) if prev else 0)
            assert new <= computed <= new + PAGE, (len(p), new, computed)
            prev = p + o
    finally:
        on.stop()
        off.stop()
    s = on.stats()
    assert s["prefix_queries"] == s["prompt_tokens"] and s["cached_tokens"] == s["prefix_hits_gpu"]
    assert on.pool.pages_in_use == on.pool.cached_pages > 0


def test_default_backend_greedy_identical(v3):
    """Greedy tokens bit-identical with and without the cache on the default expert backend."""
    from cpu_expert_service.server import load_shard

    backend = load_shard(v3, None, None, "auto")[1]
    off = engine(make_runner(v3, backend, cache=False))
    on = engine(make_runner(v3, backend))
    try:
        ref = [o for _, o, *_ in conversation(off, turns=6)]
        assert [o for _, o, *_ in conversation(on, turns=6)] == ref
    finally:
        on.stop()
        off.stop()


# ---- sharing, cancellation, preemption, eviction ---------------------------------------------------
def test_concurrent_cancel_preempt_evict(v3):
    from cpu_expert_service.server import load_shard

    backend = load_shard(v3, None, None, "numpy")[1]
    prompts = [SYSTEM + [(i * 17 + j) % 300 + 50 for j in range(10 + 7 * i)] for i in range(5)]
    ref_eng = engine(make_runner(v3, backend, cache=False))
    ref = [ref_eng.submit(p, max_tokens=24, ignore_eos=True).result(120)[0] for p in prompts]
    ref_eng.stop()
    # 12 pages: 5 requests of up to 8 pages each -> queueing, preemption and eviction of cached pages
    eng = engine(make_runner(v3, backend, kv_tokens=12 * PAGE), chunk_tokens=16)
    try:
        # two requests sharing the system prompt at once, then all five
        hs = [eng.submit(p, max_tokens=24, ignore_eos=True) for p in prompts[:2]]
        assert [h.result(120)[0] for h in hs] == ref[:2]
        hs = [eng.submit(p, max_tokens=24, ignore_eos=True) for p in prompts]
        assert [h.result(120)[0] for h in hs] == ref
        assert eng.counters["preempted"] > 0 and eng.stats()["prefix_evicted_gpu"] > 0
        assert sum(h.cached_tokens for h in hs) > 0
        # cancelled mid-prefill: its full pages stay cached, the next identical request uses them
        long = prompts[4] + list(range(60, 100))
        c0 = eng.counters["prefill_tokens_computed"]
        h = eng.submit(long, max_tokens=4, ignore_eos=True)
        while eng.counters["prefill_tokens_computed"] - c0 < 2 * PAGE and not h.done:
            time.sleep(0.0005)
        h.cancel()
        assert h.result(60)[2] in ("cancelled", "length")
        again = eng.submit(long, max_tokens=4, ignore_eos=True)
        assert again.result(60)[2] == "length"
        deadline = time.monotonic() + 10
        while (eng.running or eng.waiting) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.last_error is None
        assert eng.pool.pages_in_use == eng.pool.cached_pages
        eng.runner.prefix_cache.check()
    finally:
        eng.stop()


def test_cache_salt_isolates(v3):
    from cpu_expert_service.server import load_shard

    backend = load_shard(v3, None, None, "numpy")[1]
    eng = engine(make_runner(v3, backend))
    try:
        p = SYSTEM + list(range(100, 140))
        first = eng.submit(p, max_tokens=3, ignore_eos=True, cache_salt="tenant-a")
        ref = first.result(60)[0]
        b = eng.submit(p, max_tokens=3, ignore_eos=True, cache_salt="tenant-b")
        unsalted = eng.submit(p, max_tokens=3, ignore_eos=True)
        a = eng.submit(p, max_tokens=3, ignore_eos=True, cache_salt="tenant-a")
        assert b.result(60)[0] == a.result(60)[0] == unsalted.result(60)[0] == ref
        assert (first.cached_tokens, b.cached_tokens, unsalted.cached_tokens) == (0, 0, 0)
        assert a.cached_tokens == (len(p) - 1) // PAGE * PAGE
    finally:
        eng.stop()
    cache = eng.runner.prefix_cache
    seqs = {s: eng.runner.new_seq() for s in ("tenant-a", "tenant-b", None)}
    for s, seq in seqs.items():
        cache.attach(seq, p, s)
    pages = [set(seq.pages) for seq in seqs.values()]
    assert all(len(x) == (len(p) - 1) // PAGE for x in pages)
    assert not (pages[0] & pages[1] or pages[0] & pages[2] or pages[1] & pages[2])
    for seq in seqs.values():
        seq.free()
    cache.check()


# ---- the cache itself ----------------------------------------------------------------------------
def _pool(pages=8, host=0):
    """A pool of `pages` pages and its prefix cache."""
    from checkpoint.config import ModelConfig
    from gpu_service.local.tiny import tiny_config
    from gpu_service.model.host_kv import HostKVTier
    from gpu_service.model.kv import KVPool
    from gpu_service.model.prefix_cache import PrefixCache

    cfg = ModelConfig.from_dict(tiny_config())
    pool = KVPool(cfg, pages, 4, torch.float32, [torch.device("cpu")] * cfg.num_hidden_layers)
    return pool, PrefixCache(pool, HostKVTier(pool, host) if host else None)


def _fill(pool, cache, tokens, value):
    """A sequence whose KV for `tokens` is `value` + position everywhere, committed to the cache."""
    from gpu_service.model.kv import SeqKV

    seq = SeqKV(pool)
    cache.attach(seq, tokens)
    seq.reserve(len(tokens))
    for pos in range(seq.length, len(tokens)):
        slot = seq.pages[pos // 4] * 4 + pos % 4
        for t in pool.kv:
            t[slot] = value + pos
    seq.length = len(tokens)
    cache.commit(seq, tokens)
    return seq


def test_referenced_pages_never_evicted_and_lru():
    from gpu_service.model.kv import PoolExhausted, SeqKV

    pool, cache = _pool(8)
    a = _fill(pool, cache, list(range(12)), 100.0)  # 3 full pages, referenced
    b = _fill(pool, cache, list(range(50, 58)), 200.0)  # 2 pages
    b.free()  # cached, unreferenced
    c = _fill(pool, cache, list(range(70, 78)), 300.0)
    c.free()
    cache.check([a])
    assert pool.pages_in_use == 7 and pool.cached_pages == 4 and pool.available() == 5
    s = SeqKV(pool)
    with pytest.raises(PoolExhausted):
        s.reserve(6 * 4)  # more than free + unreferenced
    s.reserve(3 * 4)  # one free page + b's two (least recently used), c stays
    cache.check([a, s])
    assert cache.stats["evicted_gpu"] == 2 and pool.cached_pages == 2
    assert all(float(pool.kv[0][a.pages[i] * 4 + j, 0]) == 100.0 + 4 * i + j for i in range(3) for j in range(4))
    probe = SeqKV(pool)
    assert cache.attach(probe, list(range(70, 78)) + [1]) == (2, 0)  # c still cached
    probe.free()
    probe = SeqKV(pool)
    assert cache.attach(probe, list(range(50, 58)) + [1]) == (0, 0)  # b gone (no host tier)
    probe.free()
    s.free()
    a.free()
    cache.check()
    assert pool.pages_in_use == pool.cached_pages == 5


def test_host_tier_round_trip():
    pool, cache = _pool(4, host=3)
    toks = list(range(8))
    _fill(pool, cache, toks, 10.0).free()  # 2 pages cached on the GPU
    cache.evict(2)
    assert pool.cached_pages == 0 and cache.host_pages == 2 and len(pool.free_pages) == 4
    # overwrite the freed GPU pages with garbage: the host copy must come back intact
    for t in pool.kv:
        t.fill_(-1.0)
    from gpu_service.model.kv import SeqKV

    seq = SeqKV(pool)
    assert cache.attach(seq, toks + [0]) == (0, 2)
    for i, p in enumerate(seq.pages):
        for j in range(4):
            assert all(float(t[p * 4 + j, 0]) == 10.0 + 4 * i + j for t in pool.kv)
    cache.check([seq])
    assert cache.host_pages == 0 and cache.stats["copied_in_pages"] == 2
    seq.free()
    # host LRU: 3 slots; a 4th page moved out drops the oldest host page (and its descendants)
    for v, base in ((20.0, 100), (30.0, 200)):
        _fill(pool, cache, list(range(base, base + 8)), v).free()
    cache.evict(pool.num_pages)
    cache.check()
    assert cache.host_pages == 3 and cache.stats["evicted_host"] >= 1


def test_http_usage_salt_and_metrics(v3):
    """OpenAI usage.prompt_tokens_details.cached_tokens, cache_salt over HTTP, /metrics."""
    from fastapi.testclient import TestClient

    from cpu_expert_service.server import load_shard
    from gpu_service.api.http_api import create_app
    from gpu_service.api.tokenizer import Tokenizer
    from gpu_service.metrics import GpuMetrics

    runner = make_runner(v3, load_shard(v3, None, None, "numpy")[1])
    eng = engine(runner)
    try:
        client = TestClient(create_app(eng, Tokenizer(v3), "tiny", metrics=GpuMetrics(eng, runner)))
        prompt = SYSTEM + list(range(200, 230))

        def cached(**extra):
            r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **extra})
            assert r.status_code == 200, r.text
            return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

        assert cached() == 0
        assert cached() == (len(prompt) - 1) // PAGE * PAGE
        assert cached(cache_salt="other") == 0
        r = client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "cache_salt": 3})
        assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
        text = client.get("/metrics").text
        hits = (len(prompt) - 1) // PAGE * PAGE
        assert f'moesplit_prefix_cache_hits_total{{tier="gpu"}} {float(hits)}' in text
        assert f"moesplit_prefix_cache_queries_total {float(3 * len(prompt))}" in text
        assert f"moesplit_prefill_tokens_computed_total {float(3 * len(prompt) - hits)}" in text
        assert 'moesplit_prefix_cache_pages{state="cached",tier="gpu"}' in text
    finally:
        eng.stop()


def test_plan_reports_the_host_tier():
    from gpu_service import plan as P
    from gpu_service.plan.bytes import GiB, kv_bytes_per_token_layer

    cfg, name = P.load_model_config("kimi-k2-thinking")
    per_token = sum(kv_bytes_per_token_layer(cfg)) * cfg.num_hidden_layers
    auto = P.make_plan(cfg, ["24GiB"], host_ram="768GiB", model=name)
    h = auto.host
    assert h["host_kv_cache_bytes"] == int(0.5 * (768 * GiB - h["required_bytes"]))
    assert h["host_kv_cache_tokens"] == h["host_kv_cache_bytes"] // per_token
    assert f"{h['host_kv_cache_tokens']:,} cached tokens" in auto.table()
    fixed = P.make_plan(cfg, ["24GiB"], host_ram="768GiB", model=name, host_kv_cache="100GiB")
    assert fixed.host["host_kv_cache_bytes"] == 100 * GiB and fixed.fits
    assert fixed.host["required_bytes"] == h["required_bytes"] + 100 * GiB
    too_big = P.make_plan(cfg, ["24GiB"], host_ram="768GiB", model=name, host_kv_cache="700GiB", suggest=False)
    assert not too_big.fits and too_big.host["missing_bytes"] > 0
    assert P.make_plan(cfg, ["24GiB"], model=name).host["host_kv_cache_bytes"] is None  # no --host-ram


def test_v4_plan_has_no_host_tier():
    """DeepSeek-V4's prefix cache keeps pages and snapshots on the GPU: the plan reports no host tier
    (none counted in host RAM) and refuses an explicit size, naming the flag."""
    from gpu_service import plan as P

    cfg, name = P.load_model_config("deepseek-v4-flash")
    p = P.make_plan(cfg, ["24GiB"], host_ram="256GiB", model=name)
    assert p.host["host_kv_cache_bytes"] == 0 and p.host["host_kv_tier"] is False
    assert "prefix cache tier): none" in p.table()
    with pytest.raises(ValueError, match="drop --host-kv-cache"):
        P.make_plan(cfg, ["24GiB"], host_ram="256GiB", model=name, host_kv_cache="10GiB")


def test_serving_host_kv_arguments():
    import argparse

    from gpu_service.entrypoints.serving import add_serving_arguments, host_kv_bytes

    p = argparse.ArgumentParser()
    add_serving_arguments(p)
    a = p.parse_args(["--model", "m"])
    assert a.prefix_cache and a.host_kv_cache == "auto"
    a = p.parse_args(["--model", "m", "--no-prefix-cache", "--host-kv-cache", "2GiB"])
    assert not a.prefix_cache and host_kv_bytes(a.host_kv_cache) == 2 << 30
    assert host_kv_bytes("auto", device="cpu") == 0  # the pool is in host memory already


def test_n_choices_share_the_cached_prompt(v3):
    """submit_n: choices 2..n reference the first one's cached pages (copying only the partial
    page); seeded choices give the same tokens as without the cache, and the pool stays sound."""
    from cpu_expert_service.server import load_shard
    from gpu_service.runtime.sampling import SamplingParams

    backend = load_shard(v3, None, None, "numpy")[1]
    prompt = SYSTEM + list(range(300, 335))
    params = [SamplingParams(temperature=0.8, seed=7 + i) for i in range(3)]
    outs = {}
    for cache in (False, True):
        eng = engine(make_runner(v3, backend, cache=cache))
        try:
            hs = eng.submit_n(prompt, params, max_tokens=8, ignore_eos=True)
            outs[cache] = [h.result(120)[0] for h in hs]
            assert eng.last_error is None and eng.counters["prefill_tokens_computed"] <= len(prompt) + 2 * PAGE
        finally:
            eng.stop()
        if cache:
            eng.runner.prefix_cache.check()
            assert eng.pool.pages_in_use == eng.pool.cached_pages
    assert outs[True] == outs[False]
