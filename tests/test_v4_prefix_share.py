"""DeepSeek-V4's prefix cache shares a prefix across different prompts (a system prompt): the
snapshots of a prompt's boundaries at multiples of `snapshot_every` stay cached
(gpu_service.model.v4.paged.V4PrefixCache `keep_every`, the runner's passes split there).

On a make-tiny Flash-like checkpoint (MXFP4 experts in process), fp32 on the CPU, pages of 16, the
engine with check_pool on: conversation A (a 50-token system prompt + its user turn) runs, then
conversation B (the same system prompt + another user turn): B resumes at the deepest kept boundary
inside the shared system prompt (48 tokens with a snapshot every page, 32 every 2 pages) and its
tokens equal a run without the cache; with no kept boundaries (the single last-boundary snapshot
per sequence) B finds nothing to resume from.
"""
from __future__ import annotations

import pytest
import torch

from checkpoint.reader import CheckpointReader
from gpu_service.model.v4.moe import ReferenceExperts
from gpu_service.runtime.engine import Engine
from gpu_service.runtime.runner_v4 import V4Runner
from gpu_service.runtime.sampling import SamplingParams

PAGE, KV, STEPS = 16, 2048, 12  # KV: room for every kept snapshot (13 pages each) beside the prompts


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    """A tiny Flash-like V4 checkpoint's directory."""
    from gpu_service.local import tiny

    d = str(tmp_path_factory.mktemp("v4share") / "flash")
    tiny.make_tiny(d, fmt="mxfp4", arch="deepseek_v4", v4_schedule="flash", seed=5)
    return d


@pytest.fixture(scope="module")
def ckpt(ckpt_dir):
    """(reader, in-process experts) of a tiny Flash-like V4 checkpoint."""
    reader = CheckpointReader(ckpt_dir, any_architecture=True)
    cfg = reader.config
    return reader, ReferenceExperts(reader.get, cfg.n_routed_experts, cfg.swiglu_limit)


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


SYSTEM = _ids(50, 1)
A, B = SYSTEM + _ids(20, 2), SYSTEM + _ids(15, 3)


def _runs(runner, prompts) -> tuple[list[list[int]], list[int]]:
    """Each prompt's greedy tokens in turn through one engine, and the tokens each found cached."""
    e = Engine(runner, None, max_batch=4, chunk_tokens=64, check_pool=True).start()
    try:
        out, cached = [], []
        for p in prompts:
            h = e.submit(p, SamplingParams(), max_tokens=STEPS, ignore_eos=True)
            out.append([t for o in h for t in o.token_ids])
            cached.append(h.cached_tokens)
        assert e.stats()["errors"] == 0 and e.last_error is None
        return out, cached
    finally:
        e.stop()


@pytest.mark.parametrize("every,resume", [(16, 48), (32, 32), (0, 0)])
def test_two_conversations_share_a_system_prompt(ckpt, every, resume):
    reader, experts = ckpt

    def runner(**kw):
        return V4Runner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=KV,
                        page_size=PAGE, **kw)

    want, _ = _runs(runner(prefix_cache=False), [A, B])
    r = runner(snapshot_every=every)
    got, cached = _runs(r, [A, B])
    assert got == want  # A, then B resumed from A's system-prompt boundary: the tokens of no cache
    assert cached == [0, resume]
    assert r.pool.pages_in_use == r.pool.cached_pages
    kept = [s for s in r.prefix_cache.snaps.values() if s.owner is None and s.state[0] % max(every, 1) == 0
            and s.state[0] <= len(A)] if every else []
    assert len(kept) == (len(A) // every if every else 0) + (len(B) // every - resume // every if every else 0)
    r.prefix_cache.check()


def test_snapshot_interval_must_be_whole_pages(ckpt):
    reader, experts = ckpt
    with pytest.raises(ValueError, match="multiple of the page size"):
        V4Runner(reader, experts, device=torch.device("cpu"), dtype=torch.float32, kv_tokens=KV, page_size=PAGE,
                 snapshot_every=24)


def test_prefix_snapshot_every_flag(ckpt_dir, tmp_path):
    """serve / gpu-server's --prefix-snapshot-every: checked against the page size, refused with
    --no-prefix-cache and by name for a model that is not DeepSeek-V4, and handed to V4Runner."""
    import argparse
    import shutil

    from gpu_service.entrypoints import serve
    from gpu_service.entrypoints.serving import build_runner, check_serving_args
    from gpu_service.local.stack import start_shards

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    base = ["--model", ckpt_dir, "--page-size", str(PAGE)]
    assert p.parse_args(base).prefix_snapshot_every is None  # the runner's default
    from gpu_service.entrypoints import server

    gs = argparse.ArgumentParser()
    server.add_arguments(gs)
    assert gs.parse_args(base + ["--prefix-snapshot-every", "64"]).prefix_snapshot_every == 64  # gpu-server too
    for ok in ("32", "0"):
        assert check_serving_args(p.parse_args(base + ["--prefix-snapshot-every", ok])) is None
    for extra, words in ((["--prefix-snapshot-every", "24"], ("multiple of the page", str(PAGE))),
                         (["--prefix-snapshot-every", "-16"], (">= 0",)),
                         (["--prefix-snapshot-every", "32", "--no-prefix-cache"], ("--no-prefix-cache",))):
        err = check_serving_args(p.parse_args(base + extra))
        assert err is not None and "--prefix-snapshot-every" in err and all(w in err for w in words), err
    v3 = tmp_path / "v3"
    v3.mkdir()
    shutil.copy("/work/shared/model-configs/deepseek-v3.json", v3 / "config.json")
    assert check_serving_args(p.parse_args(["--model", str(v3)])) is None
    err = check_serving_args(p.parse_args(["--model", str(v3), "--prefix-snapshot-every", "2048"]))
    assert err is not None and "--prefix-snapshot-every" in err and "DeepSeek-V4 only" in err

    shards = start_shards(ckpt_dir, 1, backend="numpy")
    try:
        for every, want in ((32, 32), (None, 2048)):
            runner, client, _ = build_runner(ckpt_dir, shards.addresses, "cpu", "float32", kv_tokens=KV,
                                             page_size=PAGE, prefix_snapshot_every=every)
            client.close()
            assert runner.prefix_cache.keep_every == want
    finally:
        shards.stop()
