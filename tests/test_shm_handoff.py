"""The GPU side of the expert hand-off over shared memory, per layer call: a shard's refusal is
raised as its own error, a stopped or killed replica is failed over within the call, tokens unchanged.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("cpu_expert_service.kernels._moe")

from tests.test_shm_shard_loop import _client, _server, cfg, model_dir, shard  # noqa: E402,F401  (fixtures)


def _runner(model_dir, experts):
    from checkpoint.reader import CheckpointReader
    from gpu_service.runtime.runner import ModelRunner

    return ModelRunner(CheckpointReader(model_dir), experts, device=torch.device("cpu"), dtype=torch.float32,
                       kv_tokens=2048, page_size=16)


def _decode(runner, B, steps, seed=0, after_prefill=None):
    """Logits [steps, B, V] of greedy decoding after a prefill of 16 tokens per sequence."""
    from gpu_service.model.kv import Chunk

    rng = np.random.default_rng(seed)
    seqs = [runner.new_seq() for _ in range(B)]
    try:
        runner.step([int(t) for t in rng.integers(4, runner.cfg.vocab_size, 16 * B)],
                    [Chunk(s, 0, 16) for s in seqs])
        if after_prefill is not None:
            after_prefill()
        toks, out = [int(t) for t in rng.integers(4, runner.cfg.vocab_size, B)], []
        for _ in range(steps):
            lg = runner.step(toks, [Chunk(s, s.length, 1) for s in seqs])
            out.append(lg)
            toks = lg.argmax(-1).tolist()
        return torch.stack(out)
    finally:
        for s in seqs:
            s.free()


def test_refusal_raises_the_shards_error(model_dir, cfg, shard):
    """Inf embeddings make the hidden states the shards get non-finite: the shard refuses the call
    and the step raises the shard's own error; with the weights restored the fast path is still
    used, with the tokens of before."""
    from gpu_service.experts.errors import ShardError
    from gpu_service.runtime.runner import RemoteExperts

    c = _client(shard[1], cfg)
    try:
        runner = _runner(model_dir, RemoteExperts(c))
        want = _decode(runner, 2, 4)
        wt = runner.model.model.embed_tokens.weight
        keep = wt.clone()
        try:
            with pytest.raises(ShardError, match="NaN or Inf"):
                _decode(runner, 2, 2, after_prefill=lambda: wt.fill_(float("inf")))
        finally:
            wt.copy_(keep)
        assert all(fp.usable for fp, _ in c.fast.paths.values())  # a refusal does not end the fast path
        assert torch.equal(_decode(runner, 2, 4), want)
    finally:
        c.close()


def test_call_fails_over_from_a_stopped_replica(model_dir, cfg):
    """SIGSTOP one of two replicas: the call that waits on it hits the deadline, the replica is
    marked down and the call re-sent to the other replica; tokens unchanged."""
    from gpu_service.local.stack import start_shards
    from gpu_service.runtime.runner import RemoteExperts

    sh = start_shards(model_dir, 1, backend="auto", replicas=2)
    c = _client(sh.addresses, cfg, timeout_s=1.0)
    try:
        runner = _runner(model_dir, RemoteExperts(c))
        want = _decode(runner, 1, 8)
        os.kill(sh.procs[0].pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = _decode(runner, 1, 8)
            took = time.monotonic() - t0
            stopped = next(r for r in c.replicas if r.address == sh.addresses[0])
            assert not stopped.healthy  # marked down by the call's deadline
            assert not c.fast.paths[sh.addresses[0]][0].usable  # its fast path expired
        finally:
            os.kill(sh.procs[0].pid, signal.SIGCONT)
        assert torch.equal(got, want)
        assert took < 5.0, took  # one deadline (1 s), not one per layer
    finally:
        c.close()
        sh.stop()


def test_killed_replica_is_marked_down(model_dir, cfg):
    """kill -9 of one of two replicas before the decode steps: the doorbell breaks, the replica is
    marked down; tokens unchanged."""
    from gpu_service.local.stack import start_shards
    from gpu_service.runtime.runner import RemoteExperts

    sh = start_shards(model_dir, 1, backend="auto", replicas=2)
    c = _client(sh.addresses, cfg, timeout_s=5.0)
    try:
        runner = _runner(model_dir, RemoteExperts(c))
        want = _decode(runner, 1, 8)
        got = _decode(runner, 1, 8, after_prefill=lambda: sh.kill(0))  # only decode steps after the kill
        assert torch.equal(got, want)
        dead = next(r for r in c.replicas if r.address == sh.addresses[0])
        assert not dead.healthy
    finally:
        c.close()
        sh.stop()
