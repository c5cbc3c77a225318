"""Soak: 32 concurrent streaming completions, continuously, against the local stack on loopback
(2 shards x 2 replicas, engine + OpenAI HTTP API). Every stream must end with `data: [DONE]` and
carry exactly the greedy reference tokens of its prompt; p50 / p99 latency is reported.

`make test` runs a short form (MOESPLIT_SOAK_S, default 15 s); `make soak` runs 120 s.
"""
from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import numpy as np
import pytest

from local_stack import replicated_stack

SOAK_S = float(os.environ.get("MOESPLIT_SOAK_S", "15"))
CONCURRENCY = 32
MODEL = "tiny-soak"
N_PROMPTS = 12


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    model_dir = make_tiny(str(tmp_path_factory.mktemp("soak") / MODEL), "bf16", seed=11)
    with replicated_stack(model_dir, MODEL, kv_tokens=8192,
                          max_batch=CONCURRENCY, chunk_tokens=256, expert_timeout=10.0) as st:
        yield st


def test_soak_streaming(stack):
    tok, eng = stack.tokenizer, stack.engine
    prompts = [tok.encode("soak test " * (1 + i % 4) + f"number {i}") for i in range(N_PROMPTS)]
    max_tokens = [6 + (i * 5) % 11 for i in range(N_PROMPTS)]
    hs = [eng.submit(p, max_tokens=m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    reference = [h.result(120)[0] for h in hs]

    lat: list[float] = []
    ttft: list[float] = []
    problems: list[str] = []
    done = [0]

    async def one(c: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": prompts[i], "max_tokens": max_tokens[i], "temperature": 0,
                "ignore_eos": True, "stream": True, "return_token_ids": True}
        t0 = time.monotonic()
        first = None
        ids, lines = [], []
        try:
            async with c.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    problems.append(f"prompt {i}: HTTP {r.status_code}")
                    return
                async for ln in r.aiter_lines():
                    if not ln:
                        continue
                    lines.append(ln)
                    if ln.startswith("data: {"):
                        ch = json.loads(ln[6:])
                        if "error" in ch:
                            problems.append(f"prompt {i}: error event {ch['error']}")
                            return
                        if first is None:
                            first = time.monotonic() - t0
                        ids += ch["choices"][0]["token_ids"]
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            problems.append(f"prompt {i}: lost ({type(e).__name__}: {e})")
            return
        if not lines or lines[-1] != "data: [DONE]":
            problems.append(f"prompt {i}: stream did not end with [DONE] (last {lines[-1:] })")
        elif ids != reference[i]:
            problems.append(f"prompt {i}: tokens {ids} != reference {reference[i]}")
        else:
            lat.append(time.monotonic() - t0)
            ttft.append(first)
            done[0] += 1

    async def worker(c: httpx.AsyncClient, w: int, stop_at: float) -> None:
        k = w
        while time.monotonic() < stop_at:
            await one(c, k % N_PROMPTS)
            k += CONCURRENCY

    async def main() -> float:
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=stack.http_url, timeout=60, limits=limits) as c:
            t0 = time.monotonic()
            await asyncio.gather(*(worker(c, w, t0 + SOAK_S) for w in range(CONCURRENCY)))
            return time.monotonic() - t0

    steps0, peak0 = eng.counters["steps"], eng.counters["peak_running"]
    wall = asyncio.run(main())
    p50, p99 = (float(np.percentile(lat, q)) for q in (50, 99)) if lat else (float("nan"),) * 2
    t50, t99 = (float(np.percentile(ttft, q)) for q in (50, 99)) if ttft else (float("nan"),) * 2
    print(f"\nsoak {SOAK_S:.0f}s x {CONCURRENCY} streams: {done[0]} completed in {wall:.1f}s, "
          f"{len(problems)} lost/corrupted; latency p50 {p50:.3f}s p99 {p99:.3f}s; "
          f"time to first token p50 {t50:.3f}s p99 {t99:.3f}s; engine steps {eng.counters['steps'] - steps0}, "
          f"peak batch {eng.counters['peak_running']}; client failovers {stack.client.failovers}")
    assert not problems, problems[:5]
    assert done[0] >= CONCURRENCY
    assert eng.counters["peak_running"] >= CONCURRENCY // 2 or peak0 >= CONCURRENCY // 2  # really concurrent
    deadline = time.monotonic() + 10
    while (eng.stats()["running"] or eng.pool.pages_in_use > eng.pool.cached_pages) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert eng.pool.pages_in_use == eng.pool.cached_pages  # only prefix-cached pages remain
