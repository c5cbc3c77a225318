"""Mutual TLS on the TCP data path's C ends (wire/tcp_io.c under kernels/moe_tcp.c and
gpu_service/experts/tcp_client.c), with the gRPC path's certificate files (tests/test_tls.py's PKI).

A TLS shard and a plaintext one answer every call with the same bits, both carried by the C loop
and the C client (the shard says "the C loop, TLSv1.3"; the client's link counts TLS records); a
client that does not trust the shard's CA, or presents a certificate of another CA or none, is
refused with a reason naming the flags to fix; over a socket pair, the C client's TLS frames are
wire.tcp's byte for byte, and nothing by the deadline, a stalled answer, a peer that stops reading
and a peer gone all end in bounded time."""
from __future__ import annotations

import logging
import socket
import threading
import time

import numpy as np
import pytest

from checkpoint.config import load_config
from cpu_expert_service import tcp_transport
from cpu_expert_service.server import create_server
from wire import tcp as TT
from wire.channel import TLSFiles, make_channel
from tests.test_tls import pki  # noqa: F401 - the test PKI fixture


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny bf16 checkpoint."""
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("tcptls") / "tiny"), "bf16", seed=7)


def _files(pki, who, ca="ca"):
    return TLSFiles(pki[who]["cert"], pki[who]["key"], pki[ca])


def _shard(model_dir, pki=None):
    """An in-process shard (all experts) whose data port is served by the C loop; TLS with pki."""
    srv, port = create_server(model_dir, port=0, backend="auto", shard_id="s", shm_dir="", data_port=0,
                              tls=_files(pki, "server") if pki else None)
    return srv, f"127.0.0.1:{port}"


def test_tls_through_the_c_ends_gives_plaintext_bits(model_dir, pki, monkeypatch, caplog):
    """Every call (float32 and bfloat16 wires; 1, 8 and 300 rows: a frame above the 64 KiB staging
    buffer) through a TLS shard equals the plaintext shard's bit for bit; both ends were C."""
    from gpu_service.experts.client import ExpertsClient

    monkeypatch.delenv(tcp_transport.LOOP_ENV, raising=False)
    caplog.set_level(logging.INFO, logger="moesplit.tcp")
    cfg = load_config(model_dir)
    layer = cfg.moe_layers[0]
    (tsrv, taddr), (psrv, paddr) = _shard(model_dir, pki), _shard(model_dir)
    try:
        for wire in ("float32", "bfloat16"):
            with ExpertsClient([taddr], cfg, tls=_files(pki, "client"), transport="tcp", wire_dtype=wire) as t, \
                    ExpertsClient([paddr], cfg, transport="tcp", wire_dtype=wire) as p:
                path = t.fast.paths[taddr][0]
                assert path.c is not None and path.c.link.tls and path.c.link.version.startswith("TLSv1."), \
                    path.describe()
                assert "C client, TLS" in path.describe() and p.fast.paths[paddr][0].c.link.tls is False
                for T in (1, 8, 300):
                    rng = np.random.default_rng(T)
                    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
                    ids = rng.integers(0, cfg.n_routed_experts, (T, cfg.num_experts_per_tok)).astype(np.int64)
                    w = rng.random(ids.shape).astype(np.float32)
                    np.testing.assert_array_equal(t.forward(layer, x, ids, w), p.forward(layer, x, ids, w))
                assert (path.c.sent, path.c.answered) == (3, 3)  # carried by the C client, none by Python's ssl
                received, sent, records = path.c.link.counts
                want = sum(TT.REQUEST.size + T * cfg.hidden_size * (4 if wire == "float32" else 2)
                           + T * cfg.num_experts_per_tok * 12 for T in (1, 8, 300))
                assert sent >= want and records >= 5 and received > 0, path.c.link.counts
    finally:
        tsrv.stop(0), psrv.stop(0)
    logs = [r.getMessage() for r in caplog.records if "tcp data path from" in r.getMessage()]
    assert sum(m.endswith("the C loop, TLSv1.3") for m in logs) == 2, logs  # the shard's end was C too
    assert sum(m.endswith("the C loop") for m in logs) == 2, logs


@pytest.mark.parametrize("who", ["wrong_ca", "rogue_cert", "no_cert"])
def test_tls_c_ends_refuse_naming_the_fix(model_dir, pki, monkeypatch, caplog, who):
    """The client checks the shard's certificate against its --tls-ca; the shard requires a client
    certificate signed by its own: each refusal says which flags to fix, and no frame is served."""
    from gpu_service.experts.tcp import negotiate_tcp
    from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc
    import ssl

    monkeypatch.delenv(tcp_transport.LOOP_ENV, raising=False)
    monkeypatch.setattr(tcp_transport.client_errors, "_last", {})  # this test's refusal logged, whatever came before
    caplog.set_level(logging.INFO, logger="moesplit.tcp")
    cfg = load_config(model_dir)
    srv, addr = _shard(model_dir, pki)
    try:
        with make_channel(addr, [], tls=_files(pki, "client")) as ch:
            if who == "no_cert":  # TLS that trusts the shard, no client certificate
                resp = experts_pb2_grpc.ExpertServiceStub(ch).AttachTcp(experts_pb2.AttachTcpRequest(), timeout=5)
                ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
                ctx.load_verify_locations(pki["ca"])
                with socket.create_connection(("127.0.0.1", resp.port), timeout=5) as raw:
                    with pytest.raises(OSError):
                        with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                            s.sendall(resp.token)
                            if s.recv(1) == b"":  # TLS 1.3 may finish the client's side first: then the shard closes
                                raise OSError("closed without an answer")
            else:
                tls = _files(pki, "client", ca="rogue_ca") if who == "wrong_ca" else _files(pki, "rogue")
                path, why = negotiate_tcp(ch, addr, cfg.hidden_size, "bfloat16", 8, tls=tls, server_name="localhost")
                assert path is None
                if who == "wrong_ca":
                    assert "certificate failed verification for localhost" in why and "--tls-ca" in why, why
                else:
                    assert "--tls-cert/--tls-key" in why and "--tls-ca" in why, why
        deadline = time.monotonic() + 5
        while who != "wrong_ca" and not any("handshake" in r.getMessage() for r in caplog.records) \
                and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        srv.stop(0)
    logs = [r.getMessage() for r in caplog.records]
    assert not any("tcp data path from" in m for m in logs), logs  # nothing served
    if who != "wrong_ca":
        assert any("TLS handshake failed" in m and "must present its certificate" in m and "--tls-ca" in m
                   for m in logs), logs


def test_tls_c_loop_closes_a_stalled_frame(model_dir, pki, monkeypatch):
    """Through TLS the shard's C loop keeps its frame deadline: a frame that begins and stops is closed
    after MOESPLIT_TCP_FRAME_TIMEOUT_S, not held open."""
    from gpu_service.experts.tcp import negotiate_tcp

    monkeypatch.delenv(tcp_transport.LOOP_ENV, raising=False)
    monkeypatch.setenv(TT.FRAME_TIMEOUT_ENV, "0.5")
    cfg = load_config(model_dir)
    srv, addr = _shard(model_dir, pki)
    try:
        with make_channel(addr, [], tls=_files(pki, "client")) as ch:
            path, why = negotiate_tcp(ch, addr, cfg.hidden_size, "bfloat16", 8, tls=_files(pki, "client"),
                                      server_name="localhost")
            assert path is not None and path.c.link.tls, why
            path.c.link.send(TT.REQUEST.pack(1, cfg.moe_layers[0], 1, 1, 1, 1)[:10], 5)
            t0 = time.monotonic()
            assert path.c.link.recv(1, 10) == b""  # the shard closed the connection
            assert 0.4 <= time.monotonic() - t0 < 3.0, time.monotonic() - t0
            path.close()
    finally:
        srv.stop(0)


def _tls_pair(pki, H=8, wire=1, max_tokens=4):
    """The GPU side's C client over TLS on one end of a socket pair, the shard's C link (TLS, the
    server's side) on the other, both handshakes done in C."""
    from cpu_expert_service.kernels import _moe
    from gpu_service.experts import _tcp_client

    a, b = socket.socketpair()
    shard = _moe.Link(b.fileno())
    sctx = _moe.TlsContext(True, pki["server"]["cert"], pki["server"]["key"], pki["ca"])
    errors = []

    def accept():
        try:
            shard.start_tls(sctx, "", 5)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    t = threading.Thread(target=accept)
    t.start()
    link = _tcp_client.Link(a.fileno())
    link.start_tls(_tcp_client.TlsContext(False, pki["client"]["cert"], pki["client"]["key"], pki["ca"]),
                   "127.0.0.1", 5)
    t.join()
    assert not errors, errors
    a.close(), b.close()  # each link holds its own descriptor
    return _tcp_client.Client(link, H, wire, max_tokens), shard


def test_tls_c_client_frames_and_deadlines(pki):
    """Through TLS the C client's request is wire.tcp's frame byte for byte and an answer's rows come
    back; nothing by the deadline returns None after it; an answer that began and stalled fails after
    frame_ns; the peer gone fails at once."""
    import ml_dtypes

    c, shard = _tls_pair(pki)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 8), dtype=np.float32)
    ids = rng.integers(0, 16, (3, 2)).astype(np.int64)
    w = rng.random((3, 2), dtype=np.float32)
    c.send(9, 1, x, ids, w, 1000)
    want = TT.REQUEST.pack(9, 1, 3, 2, 1, 1) + x.astype(ml_dtypes.bfloat16).tobytes() + ids.tobytes() + w.tobytes()
    assert shard.recv(len(want), 5) == want
    y = rng.standard_normal((3, 8), dtype=np.float32).astype(ml_dtypes.bfloat16)
    shard.send(TT.RESPONSE.pack(9, 0, 5, 6, 0, 3) + y.tobytes(), 5)
    assert c.wait(0, time.monotonic_ns() + 5 * 10**9, 10**9) == (9, 0, 5, 6, 0, 3)
    np.testing.assert_array_equal(c.read(3), y.astype(np.float32))
    t0 = time.monotonic()
    assert c.wait(0, time.monotonic_ns() + 300_000_000, 10**9) is None  # nothing: the call's deadline
    assert 0.25 <= time.monotonic() - t0 < 1.5
    shard.send(TT.RESPONSE.pack(10, 0, 0, 0, 0, 2)[:20], 5)  # a frame that begins and stops
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="in time"):
        c.wait(0, time.monotonic_ns() + 5 * 10**9, 300_000_000)
    assert 0.25 <= time.monotonic() - t0 < 1.5
    shard.close()
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="closed"):
        c.wait(0, time.monotonic_ns() + 5 * 10**9, 10**9)
    assert time.monotonic() - t0 < 0.5


def test_tls_c_client_send_to_a_peer_that_stops_reading(pki):
    """A frame far larger than the socket's buffers to a shard that reads nothing: the send gives up
    at its timeout (TimeoutError), it does not hang."""
    c, shard = _tls_pair(pki, H=4096, wire=0, max_tokens=64)
    x = np.ones((64, 4096), np.float32)  # 1 MiB
    ids, w = np.zeros((64, 2), np.int64), np.ones((64, 2), np.float32)
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stayed full"):
        c.send(1, 1, x, ids, w, 300)
    assert 0.25 <= time.monotonic() - t0 < 2.0
    shard.close()
