"""The co-located shared-memory fast path (gpu_service/experts/shm.py, cpu_expert_service/shm_transport.py) on real shard processes.

Same tokens and logits with and without it; automatic fallback to gRPC when a shard refuses it
(a directory it does not share, disabled on the shard) or when it breaks mid-run; an invalid call
over it is refused like gRPC's INVALID_ARGUMENT and the shard keeps serving.
"""
from __future__ import annotations

import time

import grpc
import numpy as np
import pytest
import torch

from checkpoint.config import load_config
from checkpoint.reader import CheckpointReader
from wire import shm as P
from gpu_service.experts.client import ExpertsClient
from gpu_service.experts.errors import ExpertsClientError, ShardError
from gpu_service.experts.fast import RETRY_MIN_S
from gpu_service.local.stack import start_shards
from gpu_service.experts.handoff import RemoteExperts
from gpu_service.runtime.runner import ModelRunner

pytestmark = pytest.mark.skipif(not P.enabled(), reason="MOESPLIT_SHM=0")
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]
N_GEN = 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("pipe") / "tiny"), "bf16", seed=5)


@pytest.fixture(scope="module")
def shards(model_dir):
    with start_shards(model_dir, 2) as s:
        yield s


@pytest.fixture(scope="module")
def cfg(model_dir):
    return load_config(model_dir)


def _generate(model_dir, client):
    runner = ModelRunner(CheckpointReader(model_dir), RemoteExperts(client), device=torch.device("cpu"),
                         dtype=torch.float32, kv_tokens=64)
    return runner.generate(PROMPT, N_GEN)


def _call(cfg, T=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)  # [T, H]
    ids = np.stack([rng.permutation(cfg.n_routed_experts)[:cfg.num_experts_per_tok] for _ in range(T)])  # [T, k]
    w = rng.random(ids.shape).astype(np.float32)  # [T, k]
    return x, ids.astype(np.int64), w


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_fast_path_matches_grpc(model_dir, shards, cfg, wire):
    layer = cfg.moe_layers[0]
    with ExpertsClient(shards.addresses, cfg, transport="grpc", wire_dtype=wire) as g, \
            ExpertsClient(shards.addresses, cfg, transport="shm", wire_dtype=wire) as s:
        assert [s.fast.transport_of(a) for a in shards.addresses] == ["shm", "shm"]
        for T in (1, 5, 40):
            args = _call(cfg, T, seed=T)
            np.testing.assert_array_equal(g.forward(layer, *args), s.forward(layer, *args))
        if wire == "float32":  # whole generation: same tokens, same logits
            rg, rs = _generate(model_dir, g), _generate(model_dir, s)
            assert rg.token_ids == rs.token_ids
            torch.testing.assert_close(rg.last_logits, rs.last_logits, atol=1e-5, rtol=0)
        assert all(fp.calls > 0 for fp, _ in s.fast.paths.values())  # it really went through shared memory


def test_fallback_when_the_shard_refuses(model_dir, shards, cfg, tmp_path, monkeypatch):
    layer = cfg.moe_layers[0]
    args = _call(cfg)
    with ExpertsClient(shards.addresses, cfg, transport="grpc") as g:
        want = g.forward(layer, *args)
    # a directory the shards do not share: refused; "auto" then takes the TCP data path
    with ExpertsClient(shards.addresses, cfg, transport="auto", shm_dir=str(tmp_path)) as c:
        assert [c.fast.transport_of(a) for a in shards.addresses] == ["tcp", "tcp"]
        assert all("not inside" in c.fast.reasons[a] for a in shards.addresses)
        np.testing.assert_array_equal(c.forward(layer, *args), want)
    # ... and without that (MOESPLIT_TCP=0 on the client) the client stays on gRPC
    monkeypatch.setenv("MOESPLIT_TCP", "0")
    with ExpertsClient(shards.addresses, cfg, transport="auto", shm_dir=str(tmp_path)) as c:
        assert [c.fast.transport_of(a) for a in shards.addresses] == ["grpc", "grpc"]
        assert all("not inside" in c.fast.reasons[a] for a in shards.addresses)
        np.testing.assert_array_equal(c.forward(layer, *args), want)
    assert not list(tmp_path.iterdir())  # nothing left behind
    with pytest.raises(ExpertsClientError, match="refused"):
        ExpertsClient(shards.addresses, cfg, transport="shm", shm_dir=str(tmp_path)).connect()
    # disabled on the shard (--shm-dir ''): refused with the reason
    with start_shards(model_dir, 1, extra_args=("--shm-dir", "")) as one:
        with ExpertsClient(one.addresses, cfg, transport="auto") as c:
            assert c.fast.transport_of(one.addresses[0]) == "grpc"
            assert "disabled" in c.fast.reasons[one.addresses[0]]
            np.testing.assert_allclose(c.forward(layer, *args), want, atol=1e-6)  # one shard: another sum order


def test_fallback_when_the_fast_path_breaks(shards, cfg):
    layer = cfg.moe_layers[0]
    args = _call(cfg, 4, seed=1)
    with ExpertsClient(shards.addresses, cfg, transport="auto") as c:
        want = c.forward(layer, *args)
        fp = c.fast.paths[shards.addresses[0]][0]
        fp.sock.shutdown(2)  # the doorbell dies under the client
        np.testing.assert_array_equal(c.forward(layer, *args), want)  # re-sent / sent over gRPC
        assert not fp.usable  # that fast path is never used again
        assert c.fast.transport_of(shards.addresses[1]) == "shm"
        np.testing.assert_array_equal(c.forward(layer, *args), want)
        # the replica's gRPC channel never failed: a fresh fast path is negotiated after a back-off
        deadline = time.monotonic() + RETRY_MIN_S + 5
        while c.fast.transport_of(shards.addresses[0]) != "shm" and time.monotonic() < deadline:
            np.testing.assert_array_equal(c.forward(layer, *args), want)
            time.sleep(0.05)
        assert c.fast.paths[shards.addresses[0]][0] is not fp and c.fast.transport_of(shards.addresses[0]) == "shm"
        np.testing.assert_array_equal(c.forward(layer, *args), want)


def _invalid_calls(cfg):
    """A valid call (x, ids, w) and three the shard refuses: (layer, x, ids, w, words of the reason)."""
    layer = cfg.moe_layers[0]
    x, ids, w = _call(cfg, 2)
    bad_ids = ids.copy()
    bad_ids[1, 0] = cfg.n_routed_experts + 5
    nan_x = x.copy()
    nan_x[0, 3] = np.nan
    return (x, ids, w), [(0, x, ids, w, "not an MoE layer"),  # layer 0 is dense
                         (layer, x, bad_ids, w, "outside"),
                         (layer, nan_x, ids, w, "NaN")]


def test_invalid_call_refused_like_grpc(shards, cfg):
    layer = cfg.moe_layers[0]
    (x, ids, w), cases = _invalid_calls(cfg)
    with ExpertsClient(shards.addresses, cfg, transport="shm") as c:
        fp = c.fast.paths[shards.addresses[0]][0]
        for lyr, xx, ii, ww, what in cases:
            f = fp.send(lyr, xx, ii, ww, 10.0, fallback=None)
            assert f is not None
            while not f.done():
                fp.pump()
            e = f.exception()
            assert isinstance(e, ShardError) and e.code == grpc.StatusCode.INVALID_ARGUMENT, e
            assert what in e.details
        assert fp.usable  # the fast path and the shard survive a refused call
        with ExpertsClient(shards.addresses, cfg, transport="grpc") as g:
            with pytest.raises(ShardError) as ge:  # gRPC refuses the same call the same way
                g.forward(0, x, ids, w)
            assert ge.value.code == grpc.StatusCode.INVALID_ARGUMENT and "not an MoE layer" in ge.value.details
            np.testing.assert_array_equal(c.forward(layer, x, ids, w), g.forward(layer, x, ids, w))
    assert all(p.poll() is None for p in shards.procs)


def test_refusal_on_a_stream_fails_only_its_own_request(shards, cfg):
    """A refused request ends the gRPC stream; requests already queued behind it (which the shard never
    read) are re-sent on a new stream and answered, not failed with the other request's refusal."""
    from gpu_service.experts.client import _tensor
    from gpu_service.experts.stream import _ShardStream
    from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

    x, ids, w = _call(cfg)
    t = [_tensor(x, "float32"), _tensor(ids, "int64"), _tensor(w, "float32")]
    layer = cfg.moe_layers[0]
    with grpc.insecure_channel(shards.addresses[1]) as ch:
        stub = experts_pb2_grpc.ExpertServiceStub(ch)
        want = stub.ForwardOne(experts_pb2.LayerRequest(seq=1, layer=layer, hidden=t[0], topk_ids=t[1],
                                                        topk_weights=t[2]), timeout=10).output.data
        s = _ShardStream(shards.addresses[1], experts_pb2_grpc.ExpertServiceStub(ch))
        for rounds in range(20):  # the good requests are queued before the refusal has come back
            bad = s.send(experts_pb2.LayerRequest(seq=100 * rounds + 1, layer=0, hidden=t[0], topk_ids=t[1],
                                                  topk_weights=t[2]), 10.0)
            good = [s.send(experts_pb2.LayerRequest(seq=100 * rounds + 2 + j, layer=layer, hidden=t[0],
                                                    topk_ids=t[1], topk_weights=t[2]), 10.0) for j in range(3)]
            with pytest.raises(ShardError) as e:
                bad.result(10)
            assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"seq {100 * rounds + 1}:" in e.value.details
            for f in good:
                r = f.result(10)
                assert r.output.data == want
        s.close()


def test_doorbell_spin_polls_then_gives_up(monkeypatch):
    """recv_spin: a waiting message at once, None once the window passes, b"" at EOF; the window
    comes from MOESPLIT_SHM_SPIN_US and a bad value names the variable."""
    import socket
    import time

    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        t0 = time.perf_counter()
        assert P.recv_spin(b, 0.002) is None
        assert time.perf_counter() - t0 >= 0.002
        msg = P.DOORBELL.pack(P.OP_FORWARD, 1, 7)
        a.send(msg)
        assert P.recv_spin(b, 0.5) == msg
        a.close()
        assert P.recv_spin(b, 0.5) == b""
    finally:
        b.close()
    monkeypatch.setenv(P.SPIN_ENV, "0")
    assert P.spin_seconds() == 0.0
    monkeypatch.setenv(P.SPIN_ENV, "150")
    assert P.spin_seconds() == pytest.approx(150e-6)
    monkeypatch.setenv(P.SPIN_ENV, "fast")
    with pytest.raises(ValueError, match=P.SPIN_ENV):
        P.spin_seconds()


@pytest.mark.parametrize("spin_us", ["0", "5000"])
def test_same_answers_with_and_without_spinning(model_dir, cfg, monkeypatch, spin_us):
    """Shards and client that never spin (0) or always catch the next call spinning (5 ms) answer
    exactly what gRPC answers; a hidden state handed over already in the wire dtype (as
    RemoteExperts does) gives what the float32 one gives."""
    import ml_dtypes

    monkeypatch.setenv(P.SPIN_ENV, spin_us)  # read by the shards at start and by the client's fast paths
    layer = cfg.moe_layers[0]
    with start_shards(model_dir, 2) as sh, \
            ExpertsClient(sh.addresses, cfg, transport="grpc", wire_dtype="bfloat16") as g, \
            ExpertsClient(sh.addresses, cfg, transport="shm", wire_dtype="bfloat16") as s:
        for T in (1, 1, 6, 1):
            x, ids, w = _call(cfg, T, seed=10 + T)
            want = g.forward(layer, x, ids, w)
            np.testing.assert_array_equal(s.forward(layer, x, ids, w), want)
            np.testing.assert_array_equal(s.forward(layer, x.astype(ml_dtypes.bfloat16), ids, w), want)
            np.testing.assert_array_equal(g.forward(layer, x.astype(ml_dtypes.bfloat16), ids, w), want)
        assert all(fp.calls >= 8 for fp, _ in s.fast.paths.values())


def test_calls_that_route_nothing_give_zeros(shards, cfg):
    """k = 0 (no routed expert) and T = 0: zeros of the right shape, no shard called, no error."""
    with ExpertsClient(shards.addresses, cfg) as c:
        for T, k in ((1, 0), (3, 0), (0, 2)):
            y = c.forward(cfg.moe_layers[0], np.ones((T, cfg.hidden_size), np.float32), np.zeros((T, k), np.int64),
                          np.zeros((T, k), np.float32))
            assert y.shape == (T, cfg.hidden_size) and y.dtype == np.float32 and not y.any()
        assert all(fp.calls == 0 for fp, _ in c.fast.paths.values())
