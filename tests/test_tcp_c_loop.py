"""The TCP data path in C on both ends.

The shard's loop (cpu_expert_service/kernels/moe_tcp.c) against the Python one (tcp_transport._serve,
MOESPLIT_TCP_LOOP=python): the same frames get byte-identical answers (float32 and bfloat16, refused
calls' messages included), over the kernels backend and the numpy reference; a frame whose rest
stalls is closed after the frame deadline; a bad header is answered, then closed (TLS through the
same C ends: tests/test_tcp_c_tls.py).

The GPU side's client (gpu_service/experts/tcp_client.c) against a raw socket: its request frame is
wire.tcp's byte for byte; nothing by the deadline, a stalled answer, and a header no request can
have end in bounded time without reading an untrusted body."""
from __future__ import annotations

import logging
import socket
import time

import grpc
import numpy as np
import pytest

from checkpoint.config import load_config
from cpu_expert_service.server import create_server
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc
from wire import shm as P
from wire import tcp as TT


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny bf16 checkpoint."""
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("tcpc") / "tiny"), "bf16", seed=3)


def _server(model_dir, backend, monkeypatch, loop, frame_timeout="10"):
    """An in-process shard (all experts) whose data port serves with `loop` ("c" or "python")."""
    monkeypatch.setenv("MOESPLIT_TCP_LOOP", loop)
    monkeypatch.setenv(TT.FRAME_TIMEOUT_ENV, frame_timeout)
    srv, port = create_server(model_dir, port=0, backend=backend, shard_id="s", shm_dir="", data_port=0)
    return srv, f"127.0.0.1:{port}"


def _connect(address: str) -> socket.socket:
    """A data connection past its hello (AttachTcp's token, the ACK)."""
    ch = grpc.insecure_channel(address)
    resp = experts_pb2_grpc.ExpertServiceStub(ch).AttachTcp(experts_pb2.AttachTcpRequest(), timeout=10)
    ch.close()
    assert resp.accepted, resp.reason
    s = socket.create_connection(("127.0.0.1", resp.port), timeout=10)
    s.sendall(resp.token)
    assert s.recv(1) == TT.ACK
    return s


def _frames(cfg) -> list[tuple]:
    """(seq, layer, x, ids, w, output code): valid calls in both float dtypes and T 1 / 8, and refused ones."""
    rng = np.random.default_rng(4)
    H, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    layer = cfg.moe_layers[0]
    out = []
    for seq, (T, code) in enumerate([(1, 0), (8, 0), (1, 1), (8, 1), (3, 2)], 1):
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)]).astype(np.int64)  # [T, k]
        w = rng.random((T, k), dtype=np.float32)
        w[0, 0] = 0.0  # a zero weight (skipped by the kernels)
        out.append((seq, layer, rng.standard_normal((T, H), dtype=np.float32).astype(P.DTYPES[code]), ids, w, code))
    x, ids, w = out[0][2], out[0][3], out[0][4]
    bad = ids.copy()
    bad[0, 1] = E + 3
    nan = x.copy()
    nan[0, 5] = np.nan
    out += [(20, 0, x, ids, w, 0),  # a dense layer
            (21, layer, x, bad, w, 0),  # expert id out of range
            (22, layer, nan, ids, w, 0),  # NaN
            (23, layer, x, ids, np.full_like(w, np.inf), 0)]
    return out


def _exchange(s: socket.socket, frames) -> list[tuple]:
    """Send every frame, then read every answer: (seq, status, T, body bytes)."""
    for seq, layer, x, ids, w, oc in frames:
        hc = P.code_of(x.dtype.name if x.dtype != P.DTYPES[1] else "bfloat16")
        TT.send_parts(s, [TT.REQUEST.pack(seq, layer, x.shape[0], ids.shape[1], hc, oc), x, ids, w])
    got = []
    for seq, *_ in frames:
        head = bytearray(TT.RESPONSE.size)
        assert TT.recv_exact(s, memoryview(head))
        rseq, status, _, _, mlen, T = TT.RESPONSE.unpack(head)
        oc = next(f[5] for f in frames if f[0] == rseq)
        body = bytearray(mlen if status else T * len(frames[0][2][0]) * P.DTYPES[oc].itemsize)
        assert TT.recv_exact(s, memoryview(body))
        got.append((rseq, status, T, bytes(body)))
    return got


@pytest.mark.parametrize("backend", ["auto", "numpy"])
def test_c_loop_answers_as_the_python_loop(model_dir, backend, monkeypatch, caplog):
    """Every frame's answer, byte for byte, from both loops (kernels backend: all in C; numpy: the C loop
    calls the backend's forward); the C loop is the one used for plaintext by default."""
    cfg = load_config(model_dir)
    frames = _frames(cfg)
    answers = {}
    caplog.set_level(logging.INFO, logger="moesplit.tcp")
    for loop in ("python", "c"):
        srv, addr = _server(model_dir, backend, monkeypatch, loop)
        try:
            s = _connect(addr)
            answers[loop] = _exchange(s, frames)
            s.close()
        finally:
            srv.stop(0)
    assert [a[:3] for a in answers["c"]] == [(f[0], 0 if f[0] < 20 else TT.INVALID_ARGUMENT, f[2].shape[0])
                                             for f in frames]
    for c, py in zip(answers["c"], answers["python"]):
        assert c == py, (c[:3], c[3][:200], py[3][:200])
    assert "shard s: seq 21: topk_ids: expert id" in answers["c"][-3][3].decode()
    logs = [r.getMessage() for r in caplog.records if "tcp data path from" in r.getMessage()]
    assert any(m.endswith("the C loop") for m in logs) and any("MOESPLIT_TCP_LOOP=python" in m for m in logs), logs


def test_c_loop_frame_deadline_and_bad_header(model_dir, monkeypatch):
    """A frame whose rest stops coming is closed after MOESPLIT_TCP_FRAME_TIMEOUT_S (an idle connection
    is not); a header whose T or k cannot be trusted is answered INVALID_ARGUMENT, then closed. The
    shard serves on."""
    cfg = load_config(model_dir)
    srv, addr = _server(model_dir, "auto", monkeypatch, "c", frame_timeout="0.5")
    try:
        s = _connect(addr)
        time.sleep(0.8)  # idle between frames: fine
        x, ids, w = _frames(cfg)[0][2:5]
        assert _exchange(s, [(1, cfg.moe_layers[0], x, ids, w, 0)])[0][1] == 0
        s.sendall(TT.REQUEST.pack(2, cfg.moe_layers[0], 1, ids.shape[1], 0, 0)[:10])  # a partial header
        t0 = time.monotonic()
        s.settimeout(5)
        assert s.recv(1) == b""  # closed by the shard
        took = time.monotonic() - t0
        assert 0.4 < took < 2.0, took
        s.close()
        for T, k in ((10**6, 2), (1, 0), (1, cfg.num_experts_per_tok + 1)):
            s = _connect(addr)
            s.sendall(TT.REQUEST.pack(7, cfg.moe_layers[0], T, k, 0, 0))
            head = bytearray(TT.RESPONSE.size)
            assert TT.recv_exact(s, memoryview(head))
            seq, status, _, _, mlen, _ = TT.RESPONSE.unpack(head)
            msg = bytearray(mlen)
            assert TT.recv_exact(s, memoryview(msg))
            assert (seq, status) == (7, TT.INVALID_ARGUMENT) and b"bad frame header" in msg, bytes(msg)
            assert s.recv(1) == b""
            s.close()
        s = _connect(addr)  # still serving
        assert _exchange(s, [(3, cfg.moe_layers[0], x, ids, w, 0)])[0][1] == 0
        s.close()
    finally:
        srv.stop(0)


def _pair(H=8, wire=1, max_tokens=4):
    """The GPU side's C client on one end of a socket pair, the raw other end (as a shard)."""
    from gpu_service.experts import _tcp_client

    a, b = socket.socketpair()
    return _tcp_client.Client(a.fileno(), H, wire, max_tokens), a, b


def test_c_client_frames():
    """The C client's request is wire.tcp's frame byte for byte (float32 cast to bfloat16 as numpy
    casts); an answer's rows come back as float32; a refusal's message is kept."""
    import ml_dtypes

    c, a, b = _pair()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8), dtype=np.float32)
    ids = rng.integers(0, 16, (3, 2)).astype(np.int64)
    w = rng.random((3, 2), dtype=np.float32)
    c.send(9, 1, x, ids, w, 1000)
    want = TT.REQUEST.pack(9, 1, 3, 2, 1, 1) + x.astype(ml_dtypes.bfloat16).tobytes() + ids.tobytes() + w.tobytes()
    b.settimeout(5)
    got = b""
    while len(got) < len(want):
        got += b.recv(65536)
    assert got == want
    y = rng.standard_normal((3, 8), dtype=np.float32).astype(ml_dtypes.bfloat16)
    b.sendall(TT.RESPONSE.pack(9, 0, 5, 6, 0, 3) + y.tobytes())
    assert c.wait(0, time.monotonic_ns() + 5 * 10**9, 10**9) == (9, 0, 5, 6, 0, 3)
    np.testing.assert_array_equal(c.read(3), y.astype(np.float32))
    b.sendall(TT.RESPONSE.pack(10, TT.INVALID_ARGUMENT, 0, 0, 5, 3) + b"nope!")
    assert c.wait(0, time.monotonic_ns() + 5 * 10**9, 10**9)[1] == TT.INVALID_ARGUMENT and c.message(5) == b"nope!"
    assert (c.sent, c.answered) == (1, 2)
    a.close(), b.close()


@pytest.mark.parametrize("case", ["nothing", "stalled", "status", "rows", "message", "closed"])
def test_c_client_refuses_what_no_request_can_get(case):
    """Nothing by the deadline: None; a frame that began and stopped: an error after frame_ns, not
    a hang; a status, row count or message length no request can have: an error before any body is
    read; the shard gone: an error."""
    c, a, b = _pair()
    send = {"nothing": b"", "stalled": TT.RESPONSE.pack(1, 0, 0, 0, 0, 2)[:20],
            "status": TT.RESPONSE.pack(1, 7, 0, 0, 0, 2), "rows": TT.RESPONSE.pack(1, 0, 0, 0, 0, 5),
            "message": TT.RESPONSE.pack(1, TT.INTERNAL, 0, 0, TT.MAX_MESSAGE + 1, 2)}.get(case, b"")
    b.sendall(send)
    if case == "closed":
        b.close()
    t0 = time.monotonic()
    if case == "nothing":
        assert c.wait(0, time.monotonic_ns() + 300_000_000, 10**9) is None
    else:
        with pytest.raises(ConnectionError, match={"stalled": "in time", "closed": "closed"}.get(case, "bad response")):
            c.wait(0, time.monotonic_ns() + 5 * 10**9, 300_000_000)
    took = time.monotonic() - t0
    assert took < (0.25 if case not in ("nothing", "stalled") else 1.5), took
    if case in ("nothing", "stalled"):
        assert took >= 0.25, took
    a.close()
    if case != "closed":
        b.close()


def test_a_path_given_up_closes_its_connection(model_dir, monkeypatch):
    """The C client holds its own descriptor of the connection: when the GPU side gives the path up
    (a break, the client closed), the shard must still see the end and free the connection's slot."""
    from cpu_expert_service.tcp_transport import DataServer
    from gpu_service.experts.client import ExpertsClient

    made, init = [], DataServer.__init__

    def record(self, *a, **kw):
        init(self, *a, **kw)
        made.append(self)

    monkeypatch.setattr(DataServer, "__init__", record)
    cfg = load_config(model_dir)
    srv, addr = _server(model_dir, "auto", monkeypatch, "c")
    ds = made[0]
    x, ids, w = _frames(cfg)[1][2:5]
    try:
        with ExpertsClient([addr], cfg, transport="tcp") as c:
            fp = c.fast.paths[addr][0]
            assert fp.c is not None
            c.forward(cfg.moe_layers[0], x.astype(np.float32), ids, w)
            assert ds.slots._value == ds.max_connections - 1  # one connection served
            fp._break("given up by the test")
            end = time.monotonic() + 5
            while ds.slots._value != ds.max_connections and time.monotonic() < end:
                time.sleep(0.02)
            assert ds.slots._value == ds.max_connections  # the shard saw the end
    finally:
        srv.stop(0)


class _Dies:
    """A C client whose connection fails at the next wait (the shard's answer never read)."""

    def __init__(self, c):
        self.c = c

    def __getattr__(self, name):
        return getattr(self.c, name)

    def wait(self, *a):
        raise ConnectionError("the shard closed the data connection (the test)")


def test_direct_calls_over_tcp_and_a_break_under_them(model_dir, monkeypatch):
    """Decode calls go straight from the tensors onto the C client (handoff.DirectHandle, as over shared
    memory) with gRPC's bits; one whose connection breaks before its answer is read is re-sent with
    the inputs kept at send time and gets the same bits."""
    import torch

    from gpu_service.experts.client import ExpertsClient
    from gpu_service.experts.handoff import DirectHandle, RemoteExperts

    cfg = load_config(model_dir)
    srv, addr = _server(model_dir, "auto", monkeypatch, "c")
    layer = cfg.moe_layers[0]
    try:
        with ExpertsClient([addr], cfg, transport="tcp") as c, ExpertsClient([addr], cfg, transport="grpc") as g:
            ex = RemoteExperts(c)
            for seed in range(3):
                x, ids, w = (torch.from_numpy(np.ascontiguousarray(a)) for a in _frames(cfg)[0][2:5])
                x = x + seed  # [1, H] float32
                want = g.forward(layer, x.numpy(), ids.numpy(), w.numpy())
                handle = ex(layer, x, ids, w)
                assert isinstance(handle, DirectHandle)
                if seed == 2:  # the connection dies after the send, before the answer is read
                    fp = c.fast.paths[addr][0]
                    fp.c = _Dies(fp.c)
                np.testing.assert_array_equal(handle.wait().numpy(), want)
            assert not fp.usable and fp.calls == 3  # all three went on the C client; the third broke
    finally:
        srv.stop(0)


def test_unknown_loop_refused_at_start(model_dir, monkeypatch):
    """MOESPLIT_TCP_LOOP other than c / python stops the shard at start, naming the variable."""
    with pytest.raises(ValueError, match="MOESPLIT_TCP_LOOP='fast': expected c or python"):
        _server(model_dir, "auto", monkeypatch, "fast")
