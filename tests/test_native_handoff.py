"""Issue 20: the expert hand-off in C on both sides of the shared-memory fast path.

Shard side (cpu_expert_service/kernels/moe_shm.c): the C doorbell loop gives the bits of the
Python loop for every wire dtype, hands every call it does not take (bad ids, NaN, an unknown
layer, int32 ids, rows over the shard's maximum) to Python, which answers it as before, and counts
metrics as the metered backend does. GPU side (gpu_service/model/native_remote.c): a whole decode
step with its hand-offs in C gives the logits of the Python hand-off bit for bit, alone and with
two ping-pong micro-batches, and a refusal or a stopped replica mid-step is settled and re-run in
Python (failover included) with unchanged tokens.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
import torch

from cpu_expert_service import shm_transport
from wire import shm as P

pytest.importorskip("cpu_expert_service.kernels._moe")


def test_c_sides_agree_with_the_wire_format():
    """Both C ends hard-code wire.shm's call header and doorbell (see its docstring)."""
    from cpu_expert_service.kernels import _moe
    from gpu_service.model import _native_decode

    want = {"doorbell_bytes": P.DOORBELL.size, "op_forward": P.OP_FORWARD, "result_offset": P.RESULT_OFFSET,
            "msg_offset": P.MSG_OFFSET}
    assert _native_decode.WIRE == want
    assert _moe.SHM_WIRE == {k: v for k, v in want.items() if k != "msg_offset"}
    assert P.CALL.format == "<iIIIIIIQQI" and P.RESULT.format == "<QQI" and P.DOORBELL.format == "<IIQ"
    assert P.CALL.size - P.RESULT.size == P.RESULT_OFFSET  # RESULT is CALL's tail


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("nh") / "tiny-nh"), "bf16", seed=5)


@pytest.fixture(scope="module")
def cfg(model_dir):
    from checkpoint.config import load_config

    return load_config(model_dir)


def _server(model_dir, registry=None, **kw):
    from cpu_expert_service.server import create_server

    return create_server(model_dir, port=0, backend="auto", shm_dir="/dev/shm", metrics_registry=registry, **kw)


@pytest.fixture(scope="module")
def shard(model_dir):
    """One in-process shard holding every expert on the kernels."""
    srv, port = _server(model_dir)
    yield srv, f"127.0.0.1:{port}"
    srv.stop(0)


def _client(address, cfg, wire="float32", native=True, timeout_s=10.0):
    from gpu_service.experts.client import ExpertsClient

    old = os.environ.get(shm_transport.NATIVE_ENV)
    os.environ[shm_transport.NATIVE_ENV] = "1" if native else "0"  # read by the shard when the client attaches
    try:
        c = ExpertsClient(address if isinstance(address, list) else [address], cfg, transport="shm",
                          wire_dtype=wire, timeout_s=timeout_s).connect()
    finally:
        if old is None:
            os.environ.pop(shm_transport.NATIVE_ENV, None)
        else:
            os.environ[shm_transport.NATIVE_ENV] = old
    return c


def _calls(cfg, T, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(T)])
    w = rng.random((T, cfg.num_experts_per_tok)).astype(np.float32)
    w[0, 0] = 0.0  # a pair the GPU side computes itself: skipped
    return x, ids.astype(np.int64), w


def _counting_loops(monkeypatch):
    """Count the C loops the shard starts (shm_transport.native_loop)."""
    made = []
    real = shm_transport.native_loop

    def spy(*a, **kw):
        loop = real(*a, **kw)
        made.append(True)
        return loop

    monkeypatch.setattr(shm_transport, "native_loop", spy)
    return made


@pytest.mark.parametrize("wire", ["float32", "bfloat16", "float16"])
def test_c_loop_equals_python_loop(shard, cfg, wire, monkeypatch):
    made = _counting_loops(monkeypatch)
    c_native, c_py = _client(shard[1], cfg, wire), _client(shard[1], cfg, wire, native=False)
    try:
        for T in (1, 3, 7):
            for layer in cfg.moe_layers[:2]:
                x, ids, w = _calls(cfg, T, seed=T * 10 + layer)
                a, b = c_native.forward(layer, x, ids, w), c_py.forward(layer, x, ids, w)
                np.testing.assert_array_equal(a, b)
                assert np.abs(a).max() > 0
        assert all(fp.calls == 6 for fp, _ in c_native.fast.paths.values())  # every call went over shared memory
        assert made == [True]  # the first client's calls were served by the C loop, the second's in Python
    finally:
        c_native.close()
        c_py.close()


def _raw(address, cfg, n_slots=2):
    """Play the GPU side by hand: a sealed region and its doorbell, accepted by the shard."""
    import grpc

    from gpu_service.experts.shm import negotiate

    ch = grpc.insecure_channel(address)
    fp, why = negotiate(ch, address, cfg.hidden_size, cfg.num_experts_per_tok, "/dev/shm", "float32", 8, n_slots)
    assert fp is not None, why
    fp.sock.setblocking(True)
    fp.sock.settimeout(10)
    return ch, fp


def _ring(fp, slot, seq, layer, x, ids, w, ic=4):
    """Write one call into `slot` by hand, ring, and return (status, message, output or None)."""
    lay = fp.lay
    base = lay.slot_base(slot)
    (T, H), k = x.shape, ids.shape[1]
    P.view(fp.mm, base + lay.hidden_off, x.shape, np.dtype(np.float32))[...] = x
    P.view(fp.mm, base + lay.ids_off, ids.shape, P.DTYPES[ic])[...] = ids
    P.view(fp.mm, base + lay.w_off, w.shape, np.dtype(np.float32))[...] = w
    P.CALL.pack_into(fp.mm, base, layer, T, k, 0, ic, 0, 0, 0, 0, 0)
    fp.sock.send(P.DOORBELL.pack(P.OP_FORWARD, slot, seq))
    status, s, q = P.DOORBELL.unpack(fp.sock.recv(16))
    assert (s, q) == (slot, seq)
    _, _, mlen = P.RESULT.unpack_from(fp.mm, base + P.RESULT_OFFSET)
    msg = bytes(fp.mm[base + P.MSG_OFFSET:base + P.MSG_OFFSET + mlen]).decode()
    out = P.view(fp.mm, base + lay.out_off, (T, H), np.dtype(np.float32)).copy() if status == P.OK else None
    return status, msg, out


def test_c_loop_hands_odd_calls_to_python(shard, cfg, monkeypatch):
    made = _counting_loops(monkeypatch)
    ch, fp = _raw(shard[1], cfg)
    try:
        layer = cfg.moe_layers[0]
        x, ids, w = _calls(cfg, 3, seed=1)
        st, _, want = _ring(fp, 0, 1, layer, x, ids, w)
        assert st == P.OK and made == [True]
        st, _, got = _ring(fp, 1, 2, layer, x, ids.astype(np.int32), w, ic=3)  # int32 ids: Python computes it
        assert st == P.OK
        np.testing.assert_array_equal(got, want)
        bad = ids.copy()
        bad[1, 2] = cfg.n_routed_experts
        st, msg, _ = _ring(fp, 0, 3, layer, x, bad, w)
        assert st == P.INVALID_ARGUMENT and f"expert id {cfg.n_routed_experts} outside" in msg and "seq 3" in msg
        xn = x.copy()
        xn[2, 5] = np.nan
        st, msg, _ = _ring(fp, 1, 4, layer, xn, ids, w)
        assert st == P.INVALID_ARGUMENT and "NaN or Inf" in msg
        st, msg, _ = _ring(fp, 0, 5, 0, x, ids, w)  # layer 0 is dense
        assert st == P.INVALID_ARGUMENT and "not an MoE layer" in msg
        st, _, again = _ring(fp, 1, 6, layer, x, ids, w)  # the C loop took over again
        assert st == P.OK
        np.testing.assert_array_equal(again, want)
        fp.sock.send(P.DOORBELL.pack(P.OP_FORWARD, 9, 7))  # a slot that does not exist: this fast path ends
        assert fp.sock.recv(16) == b""
    finally:
        fp.close()
        ch.close()
    c = _client(shard[1], cfg)  # the shard serves on
    try:
        np.testing.assert_array_equal(c.forward(layer, x, ids, w), want)
    finally:
        c.close()


def test_c_loop_metrics_match_the_calls(model_dir, cfg):
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    srv, port = _server(model_dir, registry=reg)
    c = _client(f"127.0.0.1:{port}", cfg)
    try:
        layer = cfg.moe_layers[1]
        calls = [_calls(cfg, T, seed=T) for T in (1, 2, 5)]
        for x, ids, w in calls:
            c.forward(layer, x, ids, w)
        assert all(fp.calls == 3 for fp, _ in c.fast.paths.values())
        lab = {"layer": str(layer)}
        deadline = time.monotonic() + 5.0  # the histograms fill when the drainer next runs (every DRAIN_S)
        while reg.get_sample_value("moesplit_expert_kernel_seconds_count", lab) != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert reg.get_sample_value("moesplit_expert_kernel_seconds_count", lab) == 3
        assert reg.get_sample_value("moesplit_expert_queue_wait_seconds_count") == 3
        assert reg.get_sample_value("moesplit_expert_tokens_total", lab) == 8
        ids_all = np.concatenate([i.reshape(-1) for _, i, _ in calls])
        for e in range(cfg.n_routed_experts):
            got = reg.get_sample_value("moesplit_expert_activations_total", {"layer": str(layer), "expert": str(e)})
            assert got == int((ids_all == e).sum()), e
    finally:
        c.close()
        srv.stop(0)


# ---- the GPU side: a whole step in C -----------------------------------------------------------------
def _runner(model_dir, experts):
    from checkpoint.reader import CheckpointReader
    from gpu_service.runtime.runner import ModelRunner

    return ModelRunner(CheckpointReader(model_dir), experts, device=torch.device("cpu"), dtype=torch.float32,
                       kv_tokens=2048, page_size=16)


def _decode(runner, path, B, steps, seed=0, after_prefill=None, handoff=True):
    """Logits [steps, B, V] of greedy decoding after a prefill of 16 tokens per sequence; handoff:
    the expert hand-offs in C where they can be (False: the client's Python)."""
    from gpu_service.model.kv import Chunk

    runner.set_decode_path(path)
    runner.model.native_handoff = handoff
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


@pytest.fixture(scope="module")
def two_shards(model_dir):
    from cpu_expert_service.server import create_server  # noqa: F401

    servers = [_server(model_dir, experts=list(range(i, 16, 2))) for i in range(2)]
    yield [f"127.0.0.1:{p}" for _, p in servers]
    for s, _ in servers:
        s.stop(0)


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_native_step_equals_python_handoff(model_dir, cfg, two_shards, wire):
    """fast: the whole step in C; layers / fused: the C layers or the torch fused step (what CUDA runs)
    with each layer call's hand-off in C. Each equals its path with the Python hand-off, bit for bit."""
    from gpu_service.runtime.runner import RemoteExperts

    c = _client(two_shards, cfg, wire)
    try:
        runner = _runner(model_dir, RemoteExperts(c))
        for B in (1, 3):  # 3: two ping-pong micro-batches
            py = {p: _decode(runner, p, B, 16, handoff=False) for p in ("layers", "fused")}
            for path, base, counter in (("fast", "layers", "native_steps"), ("layers", "layers", "native_call_steps"),
                                        ("fused", "fused", "native_call_steps")):
                n0 = (c.native_steps, c.native_call_steps)
                got = _decode(runner, path, B, 16)
                ran = {"native_steps": c.native_steps - n0[0], "native_call_steps": c.native_call_steps - n0[1]}
                assert ran == {k: 16 if k == counter else 0 for k in ran}, (path, ran)  # every decode step, in C
                assert torch.equal(got, py[base]), (path, B, float((got - py[base]).abs().max()))
        # against the reference path: the same tokens; logits close (the kernels round their inputs to bf16,
        # so a 1e-6 difference upstream can move a logit by ~1e-3)
        plain, fast = _decode(runner, "plain", 1, 32), _decode(runner, "fast", 1, 32)
        assert torch.equal(plain.argmax(-1), fast.argmax(-1))
        assert torch.allclose(fast, plain, atol=1e-2, rtol=0), float((fast - plain).abs().max())
    finally:
        c.close()


@pytest.mark.parametrize("path", ["fast", "fused"])
def test_native_step_refusal_raises_like_the_python_path(model_dir, cfg, shard, monkeypatch, path):
    """Inf embeddings make the hidden states the shards get non-finite: the shard refuses the call,
    the C hand-off hands it back, the Python re-run raises the shard's own error; with the weights
    restored the steps run in C again, with the tokens of before."""
    from gpu_service.experts import native_handoff
    from gpu_service.experts.errors import ShardError
    from gpu_service.runtime.runner import RemoteExperts

    c = _client(shard[1], cfg)
    try:
        runner = _runner(model_dir, RemoteExperts(c))
        want = _decode(runner, path, 2, 4)
        wt = runner.model.model.embed_tokens.weight
        keep = wt.clone()
        ends = []
        finish = native_handoff.Handoff.finish

        def spy(self, rc, *a):
            ends.append(rc)
            return finish(self, rc, *a)

        monkeypatch.setattr(native_handoff.Handoff, "finish", spy)
        try:
            with pytest.raises(ShardError, match="NaN or Inf"):
                _decode(runner, path, 2, 2, after_prefill=lambda: wt.fill_(float("inf")))
        finally:
            wt.copy_(keep)
        assert ends == [native_handoff.REFUSED]  # the decode step's C run stopped at the refusal
        assert all(fp.usable and not fp.claimed for fp, _ in c.fast.paths.values())  # a refusal does not end it
        n0 = c.native_steps + c.native_call_steps
        assert torch.equal(_decode(runner, path, 2, 4), want)
        # the other micro-batch's call was still out at the refusal: its late answer keeps its slot
        # pending until the next Python step receives it, so the first step may take the Python path
        assert c.native_steps + c.native_call_steps - n0 >= 3
        assert not any(fp.pending for fp, _ in c.fast.paths.values())
    finally:
        c.close()


@pytest.mark.parametrize("path", ["fast", "layers"])
def test_native_step_fails_over_from_a_stopped_replica(model_dir, cfg, path):
    """SIGSTOP one of two replicas: the native step that waits on it hits the deadline, the replica
    is marked down and the step re-run in Python on the other replica; tokens unchanged."""
    from gpu_service.local.stack import start_shards
    from gpu_service.runtime.runner import RemoteExperts

    sh = start_shards(model_dir, 1, backend="auto", replicas=2)
    c = _client(sh.addresses, cfg, timeout_s=1.0)
    try:
        runner = _runner(model_dir, RemoteExperts(c))
        want = _decode(runner, path, 1, 8)
        os.kill(sh.procs[0].pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            got = _decode(runner, path, 1, 8)
            took = time.monotonic() - t0
            stopped = next(r for r in c.replicas if r.address == sh.addresses[0])
            assert not stopped.healthy  # marked down by the native step's deadline
            assert not c.fast.paths[sh.addresses[0]][0].usable  # its fast path expired
        finally:
            os.kill(sh.procs[0].pid, signal.SIGCONT)
        assert torch.equal(got, want)
        assert took < 5.0, took  # one deadline (1 s), not one per layer or per step
    finally:
        c.close()
        sh.stop()


def test_native_step_v32_equals_python_handoff(tmp_path_factory):
    """DeepSeek-V3.2 (index_topk 8 < the 16-token history: the indexer selects) through the native step."""
    from checkpoint.config import load_config
    from gpu_service.local.tiny import make_tiny
    from gpu_service.runtime.runner import RemoteExperts

    d = make_tiny(str(tmp_path_factory.mktemp("nh32") / "tiny-v32"), "bf16", seed=2, arch="deepseek_v32")
    cfg = load_config(d)
    srv, port = _server(d)
    c = _client(f"127.0.0.1:{port}", cfg, "bfloat16")
    try:
        runner = _runner(d, RemoteExperts(c))
        for B in (1, 3):
            n0 = c.native_steps
            fast = _decode(runner, "fast", B, 16)
            assert c.native_steps - n0 == 16
            assert torch.equal(fast, _decode(runner, "layers", B, 16))
    finally:
        c.close()
        srv.stop(0)


def test_observer_many_equals_one_call_each():
    """The native step reports its calls in one batch (ExpertsObserver.observe_many): the same
    samples as one __call__ per call."""
    from prometheus_client import CollectorRegistry, generate_latest

    from gpu_service.metrics import ExpertsObserver

    rng = np.random.default_rng(0)
    calls = [(int(rng.integers(1, 4)), f"s{int(rng.integers(2))}", float(rng.random() * 1e-3), int(rng.integers(100)),
              int(rng.integers(100)), bool(rng.random() > 0.2)) for _ in range(50)]
    one, many = CollectorRegistry(), CollectorRegistry()
    o1, o2 = ExpertsObserver(one), ExpertsObserver(many)
    for c in calls:
        o1(*c)
    o2.observe_many(calls[:20])
    o2.observe_many(calls[20:])

    def samples(reg):  # (the *_created timestamps differ)
        return sorted(ln for ln in generate_latest(reg).decode().splitlines() if "_created" not in ln)

    assert samples(one) == samples(many)
    assert any(ln.startswith("moesplit_expert_requests_total") for ln in samples(one))


@pytest.mark.parametrize("path", ["fast", "layers"])
def test_native_step_marks_a_killed_replica_down(model_dir, cfg, path):
    """kill -9 of one of two replicas before the decode steps: the doorbell breaks, a health check finds
    the replica gone, it is marked down (and reconnected once back); tokens unchanged. (Without the
    health check the replica stayed 'healthy': every native claim picked it and gave up, and the
    Python re-run's round-robin turn always fell on the other replica.)"""
    from gpu_service.local.stack import start_shards
    from gpu_service.runtime.runner import RemoteExperts

    sh = start_shards(model_dir, 1, backend="auto", replicas=2)
    c = _client(sh.addresses, cfg, timeout_s=5.0)
    try:
        runner = _runner(model_dir, RemoteExperts(c))
        want = _decode(runner, path, 1, 8)
        got = _decode(runner, path, 1, 8, after_prefill=lambda: sh.kill(0))  # only decode steps after the kill
        assert torch.equal(got, want)
        dead = next(r for r in c.replicas if r.address == sh.addresses[0])
        assert not dead.healthy
        n0 = c.native_steps + c.native_call_steps
        _decode(runner, path, 1, 4)
        assert c.native_steps + c.native_call_steps - n0 == 4  # the live replica's steps run in C again
    finally:
        c.close()
        sh.stop()
