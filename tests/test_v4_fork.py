"""DeepSeek-V4's `n` > 1 choices are forked from the prompt's prefill (gpu_service.runtime.runner_v4
`will_fork` / `copy_prefix`, gpu_service.model.v4.paged `V4Seq.fork_into`), as the engine forks V3's.

On a make-tiny Flash-like checkpoint (MXFP4 experts computed in process), fp32 on the CPU, pages of
16 tokens, the engine with check_pool on (page and reference accounting checked every step):
- n = 4 greedy choices each give the tokens of the same request alone with n = 1, and seeded
  sampling (temperature 0.8, one seed per choice) gives each choice the tokens of its request alone;
- the prompt is prefilled once: the engine's `prefill_tokens_computed` grows by the prompt plus one
  token per other choice (its last prompt token, run from the copied state), the runner counts 3
  forks; with the prefix cache the full pages are shared by reference (the choices hold the leader's
  pages), without it they are copied;
- prompts ending with the fork point inside a page and on a page boundary (48 = 3 pages of 16), a
  prefill in one chunk and in chunks of 5 (the fork point inside a chunk's passes).
"""
from __future__ import annotations

import pytest
import torch

from checkpoint.reader import CheckpointReader
from gpu_service.model.v4.moe import ReferenceExperts
from gpu_service.runtime.engine import Engine
from gpu_service.runtime.runner_v4 import V4Runner
from gpu_service.runtime.sampling import SamplingParams

PAGE, KV, STEPS, N = 16, 1024, 12, 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """(reader, in-process experts) of a tiny Flash-like V4 checkpoint."""
    from gpu_service.local import tiny

    d = str(tmp_path_factory.mktemp("v4fork") / "flash")
    tiny.make_tiny(d, fmt="mxfp4", arch="deepseek_v4", v4_schedule="flash", seed=7)
    reader = CheckpointReader(d, any_architecture=True)
    cfg = reader.config
    return reader, ReferenceExperts(reader.get, cfg.n_routed_experts, cfg.swiglu_limit)


def _prompt(n: int) -> list[int]:
    """A seeded prompt of n ids, past the tiny window (8) and several CSA / HCA blocks."""
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(n)).tolist()


def _tokens(handle) -> list[int]:
    return [t for o in handle for t in o.token_ids]


def _alone(reader, experts, prompt, params) -> list[list[int]]:
    """Each params' request alone (n = 1) through a fresh runner and engine, no prefix cache."""
    runner = V4Runner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=KV,
                      page_size=PAGE, prefix_cache=False)
    e = Engine(runner, None, max_batch=8, chunk_tokens=64, check_pool=True).start()
    try:
        return [_tokens(e.submit(prompt, p, max_tokens=STEPS, ignore_eos=True)) for p in params]
    finally:
        e.stop()


@pytest.mark.parametrize("prompt_len", [45, 49])  # fork point 44 inside a page, 48 on a page boundary
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("chunk", [64, 5])
def test_n_choices_fork_once_and_equal_their_alone_runs(ckpt, prompt_len, prefix_cache, chunk):
    reader, experts = ckpt
    prompt = _prompt(prompt_len)
    greedy = [SamplingParams()] * N
    sampled = [SamplingParams(temperature=0.8, seed=100 + i) for i in range(N)]
    runner = V4Runner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=KV,
                      page_size=PAGE, prefix_cache=prefix_cache)
    e = Engine(runner, None, max_batch=8, chunk_tokens=chunk, check_pool=True).start()
    try:
        got, computed, forks = {}, {}, {}
        for name, params in (("greedy", greedy), ("sampled", sampled)):
            before, f0 = e.stats(), runner.forked
            got[name] = [_tokens(h) for h in e.submit_n(prompt, params, max_tokens=STEPS, ignore_eos=True)]
            after = e.stats()
            computed[name] = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
            cached = after["cached_tokens"] - before["cached_tokens"]
            forks[name] = (runner.forked - f0, cached)
        assert e.stats()["errors"] == 0 and e.last_error is None
    finally:
        e.stop()
    want_greedy = _alone(reader, experts, prompt, greedy[:1])[0]
    assert got["greedy"] == [want_greedy] * N
    want_sampled = _alone(reader, experts, prompt, sampled)
    assert got["sampled"] == want_sampled
    assert len({tuple(t) for t in want_sampled}) > 1  # the seeds differ, so do the choices
    for name in got:
        n_forked, cached = forks[name]
        assert n_forked == N - 1, (name, n_forked)
        # the prompt once (less what the leader found cached), then one token per other choice
        assert computed[name] == prompt_len - cached + (N - 1), (name, computed[name], cached)
    if prefix_cache and prompt_len == 49:  # the second request resumes at the first one's boundary snapshot (48)
        assert forks["sampled"][1] == 48  # (from 45 the leader's decode moved its snapshot past the prompt)
    assert runner.pool.pages_in_use == runner.pool.cached_pages  # every choice gave its pages back


def test_forked_choices_share_the_leaders_full_pages(ckpt):
    """With the prefix cache a choice references the leader's full prompt pages (one copy in the
    pool), taken by its lookup or, past what the lookup gave, by the fork itself; the page holding
    the fork point is its own copy; running the last prompt token from the copied state gives the
    leader's logits."""
    from gpu_service.model.kv import Chunk

    reader, experts = ckpt
    prompt = _prompt(49)  # fork at 48: 3 full pages shared, the 4th page private per choice
    runner = V4Runner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=KV,
                      page_size=PAGE)
    cache, seqs = runner.prefix_cache, [runner.new_seq() for _ in range(N)]
    runner.will_fork(seqs[0], len(prompt) - 1)
    cache.attach(seqs[0], prompt)
    seqs[0].reserve(len(prompt) + 1)
    logits = runner.step(prompt, [Chunk(seqs[0], 0, len(prompt))])
    cache.commit(seqs[0], prompt)
    assert seqs[0].fork_snap is not None and seqs[0].fork_snap[0] == len(prompt) - 1
    free = len(runner.pool.free_pages)
    for j, s in enumerate(seqs[1:]):
        cache.attach(s, prompt if j == 0 else prompt[:1])  # the whole cached prefix, or none of it
        assert s.length == (48 if j == 0 else 0)
        s.reserve(len(prompt) + 1)
        runner.copy_prefix(seqs[0], s, len(prompt) - 1, start=s.length)
        assert s.length == len(prompt) - 1 and s.pages[:3] == seqs[0].pages[:3] and s.pages[3] != seqs[0].pages[3]
        assert s.nodes == seqs[0].nodes[:3]
    assert [n.refs for n in seqs[0].nodes[:3]] == [N] * 3
    assert free - len(runner.pool.free_pages) == N - 1  # one private page per choice, the shared ones given back
    assert runner.forked == N - 1
    cache.check(seqs)
    out = runner.step([prompt[-1]] * (N - 1), [Chunk(s, s.length, 1) for s in seqs[1:]])
    torch.testing.assert_close(out, logits.expand(N - 1, -1))  # each choice: the leader's last-token logits
    for s in seqs:
        s.free()
    cache.check()
    assert runner.pool.pages_in_use == runner.pool.cached_pages
