"""The shard's side of the shared-memory fast path (cpu_expert_service/kernels/moe_shm.c).

The C doorbell loop gives the bits of the Python loop for every wire dtype, hands every call it
does not take (bad ids, NaN, an unknown layer, int32 ids, rows over the shard's maximum) to Python,
which answers it as before, and counts metrics as the metered backend does.
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
    """The shard's C loop hard-codes wire.shm's call header and doorbell (see its docstring)."""
    from cpu_expert_service.kernels import _moe

    want = {"doorbell_bytes": P.DOORBELL.size, "op_forward": P.OP_FORWARD, "result_offset": P.RESULT_OFFSET,
            "msg_offset": P.MSG_OFFSET}
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
