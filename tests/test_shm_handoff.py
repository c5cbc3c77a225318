"""The GPU side of the expert hand-off over shared memory, per layer call, through the C client
(gpu_service/experts/shm_client.c): greedy decoding gives gRPC's logits bit for bit, a shard's
refusal is raised as its own error, a stopped or killed replica is failed over within the call,
tokens unchanged; the C client casts like numpy and waits without the GIL up to its deadline.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

pytest.importorskip("cpu_expert_service.kernels._moe")
_C = pytest.importorskip("gpu_service.experts._shm_client")

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


def test_c_client_agrees_with_the_wire_format():
    """The C client takes its doorbell and result constants from wire/shm_wire.h, as the shard does."""
    from wire import shm as P

    from gpu_service.experts import handoff

    assert _C.SHM_WIRE == {"doorbell_bytes": P.DOORBELL.size, "op_forward": P.OP_FORWARD,
                           "result_offset": P.RESULT_OFFSET, "msg_offset": P.MSG_OFFSET}
    assert (_C.OUT_WIRE, _C.OUT_F32, _C.OUT_ADD_F32) == (handoff.OUT_WIRE, handoff.OUT_F32, handoff.OUT_ADD_F32)


def _c_pair(wire: int, H: int = 8, M: int = 4, K: int = 2):
    """A C client over an anonymous mapping and one end of a socket pair (no shard)."""
    import mmap
    import socket

    from wire import shm as P

    lay = P.Layout(2, H, M, K)
    mm = mmap.mmap(-1, lay.file_bytes)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c = _C.Client(mm, a.fileno(), (lay.n_slots, M, K, P.HEADER_BYTES, lay.slot_bytes, lay.hidden_off, lay.ids_off,
                                   lay.w_off, lay.out_off), H, wire)
    return c, mm, lay, a, b


@pytest.mark.parametrize("wire", [1, 2])
def test_c_client_casts_like_numpy(wire):
    """float32 hidden rows are written in the wire dtype with numpy's (ml_dtypes') rounding, ties,
    infinities and subnormals included; the output is read back to float32 exactly."""
    from wire import shm as P

    H = 8
    c, mm, lay, a, b = _c_pair(wire, H)
    try:
        rng = np.random.default_rng(3)
        x = rng.standard_normal((4, H)).astype(np.float32)
        x[0, :6] = [1 + 2 ** -8, 1 + 3 * 2 ** -8, np.inf, -np.inf, 1e-41, 65520.0]  # ties, inf, subnormal, f16 max+
        ids, w = np.zeros((4, 2), np.int64), np.ones((4, 2), np.float32)
        c.send(1, 9, 3, x, ids, w, 100)
        assert P.DOORBELL.unpack(b.recv(16)) == (P.OP_FORWARD, 1, 9) and c.sent == 1
        base = lay.slot_base(1)
        got = P.view(mm, base + lay.hidden_off, (4, H), P.DTYPES[wire])
        with np.errstate(over="ignore"):  # (65520 overflows float16 to inf, as it should)
            want = x.astype(P.DTYPES[wire])
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        assert P.CALL.unpack_from(mm, base)[:7] == (3, 4, 2, wire, 4, 0, wire)
        y = rng.standard_normal((4, H)).astype(P.DTYPES[wire])
        P.view(mm, base + lay.out_off, (4, H), P.DTYPES[wire])[...] = y
        np.testing.assert_array_equal(c.read(1, 4), y.astype(np.float32))
        with pytest.raises(ValueError, match="C-contiguous"):
            c.send(0, 10, 3, x[:, ::2], ids, w, 100)
    finally:
        a.close()
        b.close()


def test_c_wait_releases_the_gil_and_keeps_its_deadline():
    """Nothing answers: wait() returns None at its deadline, and Python threads run meanwhile;
    an answer is received; the peer closing the doorbell raises ConnectionError."""
    import threading

    from wire import shm as P

    c, mm, lay, a, b = _c_pair(0)
    try:
        ticks, stop = [0], threading.Event()

        def count():
            while not stop.is_set():
                ticks[0] += 1
        t = threading.Thread(target=count)
        t.start()
        t0 = time.monotonic()
        assert c.wait(0, time.monotonic_ns() + 200_000_000) is None
        took = time.monotonic() - t0
        stop.set()
        t.join()
        assert 0.19 <= took < 1.0, took
        assert ticks[0] > 1000  # the other thread ran while the C side waited
        b.send(P.DOORBELL.pack(P.OK, 1, 77))
        assert c.wait(10_000_000, time.monotonic_ns() + 1_000_000_000) == (P.OK, 1, 77) and c.answered == 1
        b.close()
        with pytest.raises(ConnectionError, match="closed"):
            c.wait(0, time.monotonic_ns() + 1_000_000_000)
    finally:
        a.close()


def _c_counts(client) -> tuple[int, int, int]:
    """(calls the fast paths took, doorbells the C clients rang, answers they received)."""
    fps = [fp for fp, _ in client.fast.paths.values() if fp is not None]
    return sum(fp.calls for fp in fps), sum(fp.c.sent for fp in fps), sum(fp.c.answered for fp in fps)


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("B", [1, 3])
def test_greedy_decode_over_shm_equals_grpc(model_dir, cfg, shard, B, wire):
    """The same shard over shared memory (the C client) and over gRPC only: greedy decoding gives
    the same logits bit for bit, and every expert call of the shared-memory run went through C."""
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.experts.handoff import RemoteExperts

    shm = _client(shard[1], cfg, wire)
    grpc_only = ExpertsClient([shard[1]], cfg, transport="grpc", wire_dtype=wire).connect()
    try:
        assert grpc_only.fast.paths == {} and shm.fast.transport_of(shard[1]) == "shm"
        runner = _runner(model_dir, RemoteExperts(shm))
        steps = 5
        got = _decode(runner, B, steps, seed=B)
        calls, sent, answered = _c_counts(shm)
        runner.experts = RemoteExperts(grpc_only)
        want = _decode(runner, B, steps, seed=B)
        assert torch.equal(got, want)
        # every MoE layer of the prefill and of each step, once per micro-batch (ping-pong: 2 from B = 2)
        n_mb = 1 if B == 1 else 2
        assert sent == answered == calls >= len(cfg.moe_layers) * (1 + steps * n_mb), (calls, sent, answered)
        assert _c_counts(shm) == (calls, sent, answered)  # the gRPC run did not touch shared memory
    finally:
        shm.close()
        grpc_only.close()


def test_refusal_raises_the_shards_error(model_dir, cfg, shard):
    """Inf embeddings make the hidden states the shards get non-finite: the shard refuses the call
    and the step raises the shard's own error; with the weights restored the fast path is still
    used, with the tokens of before."""
    from gpu_service.experts.errors import ShardError
    from gpu_service.experts.handoff import RemoteExperts

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
    from gpu_service.experts.handoff import RemoteExperts

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
    from gpu_service.experts.handoff import RemoteExperts

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


def _torch_call(cfg, T, seed, dtype):
    """hidden [T, H] in dtype, ids [T, k] int64, weights [T, k] float32 (seeded)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok] for _ in range(T)])
    return h, ids, torch.rand(T, cfg.num_experts_per_tok, generator=g)


def _general(c, layer, h, ids, w):
    """The same call through forward_async (LayerCall's sum, then the caller's dtype)."""
    from gpu_service.experts.handoff import client_wire, RemoteHandle, _numpy

    x = h if h.dtype == torch.float32 or h.dtype == client_wire(c) else h.float()  # (as RemoteExperts hands it over)
    return RemoteHandle(c, c.forward_async(layer, _numpy(x), ids.numpy(), w.numpy()), layer, h.device, h.dtype).wait()


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_calls_equal_forward_async(model_dir, cfg, wire, dtype):
    """RemoteExperts sends a call straight from the tensors onto the fast paths when every part takes
    every row (one token over two shard groups; any rows when every group holds all experts), and
    the answer has the bits of the same call through forward_async."""
    from gpu_service.experts.handoff import DirectHandle, RemoteExperts
    from gpu_service.local.stack import start_shards

    layer = cfg.moe_layers[0]
    with start_shards(model_dir, 2, backend="auto") as sh:
        c = _client(sh.addresses, cfg, wire)
        try:
            assert not c.whole and len(c.groups) == 2
            ex = RemoteExperts(c)
            for T in (1, 1, 3, 1):
                for seed in range(3):
                    h, ids, w = _torch_call(cfg, T, 10 * T + seed, dtype)
                    handle = ex(layer, h, ids, w)
                    assert isinstance(handle, DirectHandle) == (T == 1)
                    got = handle.wait()
                    assert got.dtype == dtype and torch.equal(got, _general(c, layer, h, ids, w))
        finally:
            c.close()


def test_direct_calls_beyond_the_slots_fail_over(model_dir, cfg, shard):
    """More direct calls in flight than the fast path has slots: the ones without a slot go over
    gRPC (the failover), every answer equal to the call alone through forward_async."""
    from gpu_service.experts.handoff import RemoteExperts
    from wire import shm as P

    c = _client(shard[1], cfg, "bfloat16")
    try:
        assert c.whole
        fp = c.fast.paths[shard[1]][0]
        ex, layer = RemoteExperts(c), cfg.moe_layers[-1]
        calls = [_torch_call(cfg, T, T, torch.bfloat16) for T in (1, 2, 3, 4, 5, 6, 7)]
        handles = [ex(layer, *a) for a in calls]
        assert fp.c.sent == min(len(calls), fp.lay.n_slots)  # the rest had no free slot
        for a, hd in zip(calls, handles):
            assert torch.equal(hd.wait(), _general(c, layer, *a))
        assert fp.usable and len(fp.free) == fp.lay.n_slots and not fp.pending
    finally:
        c.close()
