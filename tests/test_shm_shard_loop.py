"""The shard's only shared-memory loop, in C (cpu_expert_service/kernels/moe_shm.c).

Its answers equal the backend's own forward bit for bit, for every wire dtype, with the kernels (all in
C) and with the numpy reference (its forward called back with the GIL); every call it does not
compute is answered by the same loop with the validator's status and message, and the loop serves on;
a bad doorbell ends only that client's fast path; metrics count what the metered backend counts.
"""
from __future__ import annotations

import sys
import time

import ml_dtypes
import numpy as np
import pytest

from wire import shm as P

pytest.importorskip("cpu_expert_service.kernels._moe")

BACKENDS = ("kernels", "numpy")
WIRES = {"float32": 0, "bfloat16": 1, "float16": 2}


def test_c_sides_agree_with_the_wire_format():
    """The shard's C loop hard-codes wire.shm's call header and doorbell (see its docstring)."""
    from cpu_expert_service.kernels import _moe

    assert _moe.SHM_WIRE == {"doorbell_bytes": P.DOORBELL.size, "op_forward": P.OP_FORWARD,
                             "result_offset": P.RESULT_OFFSET, "msg_offset": P.MSG_OFFSET,
                             "msg_max": P.SLOT_META_BYTES - P.MSG_OFFSET}
    assert P.CALL.format == "<iIIIIIIQQI" and P.RESULT.format == "<QQI" and P.DOORBELL.format == "<IIQ"
    assert P.CALL.size - P.RESULT.size == P.RESULT_OFFSET  # RESULT is CALL's tail
    assert P.DTYPE_NAMES == ("float32", "bfloat16", "float16", "int32", "int64")  # moe_shm.c's CODE_*


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("nh") / "tiny-nh"), "bf16", seed=5)


@pytest.fixture(scope="module")
def cfg(model_dir):
    from checkpoint.config import load_config

    return load_config(model_dir)


def _server(model_dir, registry=None, backend="auto", **kw):
    from cpu_expert_service.server import create_server

    return create_server(model_dir, port=0, backend=backend, shm_dir="/dev/shm", metrics_registry=registry, **kw)


@pytest.fixture(scope="module")
def shard(model_dir):
    """One in-process shard holding every expert on the kernels."""
    srv, port = _server(model_dir)
    yield srv, f"127.0.0.1:{port}"
    srv.stop(0)


@pytest.fixture(scope="module")
def shards(model_dir, shard):
    """backend name -> (server, address): the kernels shard and one on the numpy reference."""
    srv, port = _server(model_dir, backend="numpy")
    assert type(shard[0].servicer.backend).__name__ == "KernelExperts"
    yield {"kernels": shard, "numpy": (srv, f"127.0.0.1:{port}")}
    srv.stop(0)


def _client(address, cfg, wire="float32", timeout_s=10.0):
    from gpu_service.experts.client import ExpertsClient

    return ExpertsClient(address if isinstance(address, list) else [address], cfg, transport="shm",
                         wire_dtype=wire, timeout_s=timeout_s).connect()


def _calls(cfg, T, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    ids = np.array([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(T)])
    w = rng.random((T, cfg.num_experts_per_tok)).astype(np.float32)
    if T:
        w[0, 0] = 0.0  # a pair the GPU side computes itself: skipped
    return x, ids.reshape(T, cfg.num_experts_per_tok).astype(np.int64), w


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


def _ring(fp, slot, seq, layer, x, ids, w, codes=(0, 4, 0, 0), T=None):
    """Write one call into `slot` by hand (x, ids, w cast to the dtype codes hidden / ids / weights /
    output; T: the row count in the header, default x's), ring, and return (status, message, output
    in the output dtype or None)."""
    lay = fp.lay
    base = lay.slot_base(slot)
    k, H = ids.shape[1], lay.hidden_size
    T = x.shape[0] if T is None else T
    hc, ic, wc, oc = codes
    P.view(fp.mm, base + lay.hidden_off, x.shape, P.DTYPES[min(hc, 4)])[...] = x
    P.view(fp.mm, base + lay.ids_off, ids.shape, P.DTYPES[ic])[...] = ids
    P.view(fp.mm, base + lay.w_off, w.shape, P.DTYPES[min(wc, 4)])[...] = w
    P.CALL.pack_into(fp.mm, base, layer, T, k, hc, ic, wc, oc, 0, 0, 0)
    fp.sock.send(P.DOORBELL.pack(P.OP_FORWARD, slot, seq))
    status, s, q = P.DOORBELL.unpack(fp.sock.recv(16))
    assert (s, q) == (slot, seq)
    _, _, mlen = P.RESULT.unpack_from(fp.mm, base + P.RESULT_OFFSET)
    msg = bytes(fp.mm[base + P.MSG_OFFSET:base + P.MSG_OFFSET + mlen]).decode()
    out = P.view(fp.mm, base + lay.out_off, (T, H), P.DTYPES[oc]).copy() if status == P.OK else None
    return status, msg, out


def _direct(srv, layer, x, ids, w):
    """The backend's own forward on the rows the shard received (as float32), [T, H] f32."""
    be = srv.servicer.backend
    return be.forward(layer, np.asarray(x, np.float32), np.asarray(ids, np.int64), np.asarray(w, np.float32))


def _refusal(srv, seq, layer, x, ids, w):
    """The validator's own answer (ExpertServicer.check_and_forward) as the gRPC path words it."""
    servicer = srv.servicer
    RequestError = sys.modules[type(servicer).__module__].RequestError
    with pytest.raises(RequestError) as e:
        servicer.check_and_forward(layer, x, ids, w)
    return f"shard {servicer.shard_id}: seq {seq}: {e.value}"


@pytest.fixture
def loops(monkeypatch):
    """The C loops the shard starts from now on (shm_transport.shard_loop)."""
    from cpu_expert_service import shm_transport

    made, real = [], shm_transport.shard_loop

    def shard_loop(*a, **kw):
        loop, whole, metrics = real(*a, **kw)
        made.append(loop)
        return loop, whole, metrics

    monkeypatch.setattr(shm_transport, "shard_loop", shard_loop)
    return made


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wire", list(WIRES))
def test_c_loop_equals_the_backends_forward(shards, cfg, backend, wire, loops):
    """Raw calls in every wire dtype (hidden and output) at T = 1, 3, 7, bit for bit; then the same
    through the GPU service's client, every call over shared memory."""
    srv, address = shards[backend]
    dt, code = P.DTYPES[WIRES[wire]], WIRES[wire]
    ch, fp = _raw(address, cfg)
    assert [lp.compute for lp in loops] == [{"kernels": "kernels", "numpy": "forward"}[backend]]
    try:
        for T in (1, 3, 7):
            for i, layer in enumerate(cfg.moe_layers[:2]):
                x, ids, w = _calls(cfg, T, seed=T * 10 + layer)
                xw = x.astype(dt)
                st, msg, got = _ring(fp, i, T * 10 + i, layer, xw, ids, w, codes=(code, 4, 0, code))
                assert st == P.OK, msg
                want = _direct(srv, layer, xw, ids, w).astype(dt)
                assert got.dtype == dt and np.abs(want.astype(np.float32)).max() > 0
                np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))
    finally:
        fp.close()
        ch.close()
    c = _client(address, cfg, wire)
    try:
        x, ids, w = _calls(cfg, 3, seed=99)
        layer = cfg.moe_layers[0]
        want = _direct(srv, layer, x.astype(dt), ids, w).astype(dt).astype(np.float32)
        np.testing.assert_array_equal(c.forward(layer, x, ids, w), want)
        assert [fp.calls for fp, _ in c.fast.paths.values()] == [1]  # over shared memory
    finally:
        c.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_c_loop_converts_what_the_validator_accepts(shards, cfg, backend):
    """int32 ids, bfloat16 / float16 weights and zero rows are computed, not refused."""
    srv, address = shards[backend]
    ch, fp = _raw(address, cfg)
    try:
        layer = cfg.moe_layers[1]
        x, ids, w = _calls(cfg, 3, seed=2)
        st, _, want = _ring(fp, 0, 1, layer, x, ids, w)
        assert st == P.OK
        np.testing.assert_array_equal(want, _direct(srv, layer, x, ids, w))
        st, _, got = _ring(fp, 1, 2, layer, x, ids.astype(np.int32), w, codes=(0, 3, 0, 0))
        assert st == P.OK
        np.testing.assert_array_equal(got, want)
        for seq, (wc, wdt) in enumerate(((1, ml_dtypes.bfloat16), (2, np.float16)), start=3):
            w16 = w.astype(wdt)
            st, msg, got = _ring(fp, 0, seq, layer, x, ids, w16, codes=(0, 4, wc, 0))
            assert st == P.OK, msg
            np.testing.assert_array_equal(got, _direct(srv, layer, x, ids, w16))
        st, msg, got = _ring(fp, 1, 5, layer, x[:0], ids[:0], w[:0])  # T = 0: an empty answer
        assert st == P.OK and msg == "" and got.shape == (0, cfg.hidden_size)
    finally:
        fp.close()
        ch.close()


def _odd_calls(cfg, x, ids, w):
    """(name, layer, x, ids, w) the validator refuses: each one check of check_and_forward."""
    E, layer = cfg.n_routed_experts, cfg.moe_layers[0]
    bad_ids, neg_ids, xn, xi, wn = ids.copy(), ids.copy(), x.copy(), x.copy(), w.copy()
    bad_ids[1, 2] = E
    neg_ids[2, 0] = -7
    xn[2, 5] = np.nan
    xi[0, 1] = np.inf
    wn[1, 1] = np.inf
    return [("dense layer", 0, x, ids, w), ("unknown layer", 999, x, ids, w), ("negative layer", -1, x, ids, w),
            ("id over", layer, x, bad_ids, w), ("id under", layer, x, neg_ids, w), ("NaN hidden", layer, xn, ids, w),
            ("Inf hidden", layer, xi, ids, w), ("Inf weight", layer, x, ids, wn),
            ("k = 0", layer, x, ids[:, :0], w[:, :0])]


@pytest.mark.parametrize("backend", BACKENDS)
def test_c_loop_answers_odd_calls_with_the_validators_messages(shards, cfg, backend):
    srv, address = shards[backend]
    layer = cfg.moe_layers[0]
    x, ids, w = _calls(cfg, 3, seed=1)
    ch, fp = _raw(address, cfg)
    try:
        st, _, want = _ring(fp, 0, 1, layer, x, ids, w)
        assert st == P.OK
        seq = 2
        for name, lyr, xb, ib, wb in _odd_calls(cfg, x, ids, w):
            st, msg, _ = _ring(fp, seq % 2, seq, lyr, xb, ib, wb)
            assert (st, msg) == (P.INVALID_ARGUMENT, _refusal(srv, seq, lyr, xb, ib, wb)), name
            seq += 1
        sid, K = srv.servicer.shard_id, cfg.num_experts_per_tok  # the slot's own checks (no gRPC equivalent)
        st, msg, _ = _ring(fp, 0, seq, layer, x, ids, w, T=9)
        assert (st, msg) == (P.INVALID_ARGUMENT, f"shard {sid}: seq {seq}: 9 tokens x top-{K} exceed the shared slot "
                                                 f"(8 x {K})")
        st, msg, _ = _ring(fp, 1, seq + 1, layer, x, ids, w, codes=(3, 4, 0, 0))
        assert (st, msg) == (P.INVALID_ARGUMENT, f"shard {sid}: seq {seq + 1}: dtype codes hidden/ids/weights/output "
                                                 "3/4/0/0 not accepted")
        st, _, again = _ring(fp, 0, seq + 2, layer, x, ids, w)  # the same loop serves on
        assert st == P.OK
        np.testing.assert_array_equal(again, want)
        fp.sock.send(P.DOORBELL.pack(P.OP_FORWARD, 9, seq + 3))  # a slot that does not exist: this fast path ends
        assert fp.sock.recv(16) == b""
    finally:
        fp.close()
        ch.close()
    c = _client(address, cfg)  # the shard serves on, over shared memory
    try:
        np.testing.assert_array_equal(c.forward(layer, x, ids, w), want)
        assert [fp.calls for fp, _ in c.fast.paths.values()] == [1]
    finally:
        c.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failing_forward_is_answered_internal(model_dir, cfg, backend, caplog):
    """A backend whose forward raises (here on 2-row calls): INTERNAL with the exception named, logged
    with its traceback, and the loop serves the next call. A kernels backend with its forward replaced
    is called back too."""
    srv, port = _server(model_dir, backend=backend)
    be = srv.servicer.backend
    real = be.forward

    def forward(layer, x, ids, w):
        if x.shape[0] == 2:
            raise RuntimeError("boom")
        return real(layer, x, ids, w)

    be.forward = forward
    ch, fp = _raw(f"127.0.0.1:{port}", cfg)
    try:
        layer = cfg.moe_layers[0]
        x, ids, w = _calls(cfg, 3, seed=4)
        st, msg, _ = _ring(fp, 0, 1, layer, x[:2], ids[:2], w[:2])
        assert (st, msg) == (P.INTERNAL, f"shard {srv.servicer.shard_id}: seq 1: RuntimeError: boom")
        st, _, got = _ring(fp, 1, 2, layer, x, ids, w)
        assert st == P.OK
        np.testing.assert_array_equal(got, real(layer, x, ids, w))
        logged = [r for r in caplog.records if "shm seq 1 failed" in r.getMessage()]
        assert len(logged) == 1 and "RuntimeError: boom" in logged[0].getMessage() and logged[0].exc_info
    finally:
        fp.close()
        ch.close()
        srv.stop(0)


def test_without_the_kernels_extension_attach_is_refused(shards, cfg, monkeypatch):
    from gpu_service.experts.shm import negotiate
    import grpc

    import cpu_expert_service.kernels

    monkeypatch.delattr(cpu_expert_service.kernels, "_moe", raising=False)  # its import fails as if not built
    monkeypatch.setitem(sys.modules, "cpu_expert_service.kernels._moe", None)
    address = shards["numpy"][1]
    with grpc.insecure_channel(address) as ch:
        fp, why = negotiate(ch, address, cfg.hidden_size, cfg.num_experts_per_tok, "/dev/shm", "float32", 8, 2)
    assert fp is None and "kernels extension" in why and "make build" in why


def _sample(reg, name, labels=None):
    return reg.get_sample_value(name, labels or {}) or 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_c_loop_metrics_match_the_calls(model_dir, cfg, backend):
    """Computed calls count (T = 0 too: a kernel time, no tokens); refused ones do not; on numpy, a
    failed forward has its queue wait only (as the metered backend counts)."""
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry()
    srv, port = _server(model_dir, registry=reg, backend=backend)
    failing = backend == "numpy"  # (the kernels' own forward cannot be made to fail from here)
    if failing:
        inner = srv.servicer.backend._backend
        real = inner.forward
        inner.forward = lambda layer, x, ids, w: real(layer, x, ids, w) if x.shape[0] != 4 else 1 / 0
    ch, fp = _raw(f"127.0.0.1:{port}", cfg)
    try:
        layer = cfg.moe_layers[1]
        calls = [_calls(cfg, T, seed=T) for T in (1, 2, 5, 0)]
        for seq, (x, ids, w) in enumerate(calls):
            assert _ring(fp, seq % 2, seq, layer, x, ids, w)[0] == P.OK
        xn = calls[1][0].copy()
        xn[0, 0] = np.nan
        assert _ring(fp, 0, 10, layer, xn, calls[1][1], calls[1][2])[0] == P.INVALID_ARGUMENT
        if failing:
            assert _ring(fp, 1, 11, layer, *_calls(cfg, 4, seed=4))[0] == P.INTERNAL
        lab, waits = {"layer": str(layer)}, 4 + failing
        deadline = time.monotonic() + 5.0  # the histograms fill when the drainer next runs (every DRAIN_S)
        while _sample(reg, "moesplit_expert_queue_wait_seconds_count") != waits and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)  # and nothing more comes
        assert _sample(reg, "moesplit_expert_queue_wait_seconds_count") == waits
        assert _sample(reg, "moesplit_expert_kernel_seconds_count", lab) == 4
        assert _sample(reg, "moesplit_expert_tokens_total", lab) == 8
        ids_all = np.concatenate([i.reshape(-1) for _, i, _ in calls])
        for e in range(cfg.n_routed_experts):
            got = _sample(reg, "moesplit_expert_activations_total", {"layer": str(layer), "expert": str(e)})
            assert got == int((ids_all == e).sum()), e
    finally:
        fp.close()
        ch.close()
        srv.stop(0)
