"""The cross-host TCP data path (cpu_expert_service/tcp_transport.py, gpu_service/experts/tcp.py) on
real shard processes.

Same answers, tokens and logits as gRPC; refused (and gRPC used) when the shard has it off; a
connection that breaks mid-run re-sends over gRPC (its mutual-TLS form: tests/test_tls.py); an invalid call is refused like gRPC's INVALID_ARGUMENT and the connection kept; a frame
whose header cannot be trusted, or a connection without a valid token, is closed.
"""
from __future__ import annotations

import socket
import time

import grpc
import ml_dtypes
import numpy as np
import pytest
import torch

from checkpoint.reader import CheckpointReader
from wire import tcp as TT
from gpu_service.experts.client import ExpertsClient
from gpu_service.experts.errors import ExpertsClientError, ShardError
from gpu_service.experts.fast import RETRY_MIN_S
from gpu_service.local.stack import start_shards
from gpu_service.experts.handoff import RemoteExperts
from gpu_service.runtime.runner import ModelRunner
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc
from tests.test_pipeline import _call, _invalid_calls, cfg, model_dir, shards  # noqa: F401 - the same tiny model and 2 shards

pytestmark = pytest.mark.skipif(not TT.enabled(), reason="MOESPLIT_TCP=0")
PROMPT = [5, 17, 42, 99, 7, 3, 250, 11]


@pytest.mark.parametrize("wire", ["float32", "bfloat16"])
def test_tcp_path_matches_grpc(model_dir, shards, cfg, wire):
    layer = cfg.moe_layers[0]
    with ExpertsClient(shards.addresses, cfg, transport="grpc", wire_dtype=wire) as g, \
            ExpertsClient(shards.addresses, cfg, transport="tcp", wire_dtype=wire) as t:
        assert [t.fast.transport_of(a) for a in shards.addresses] == ["tcp", "tcp"]
        for T in (1, 5, 40, 300):
            x, ids, w = _call(cfg, T, seed=T)
            want = g.forward(layer, x, ids, w)
            np.testing.assert_array_equal(t.forward(layer, x, ids, w), want)
            if wire == "bfloat16":  # handed over already in the wire dtype, as RemoteExperts does
                np.testing.assert_array_equal(t.forward(layer, x.astype(ml_dtypes.bfloat16), ids, w), want)
        if wire == "float32":  # a whole generation: same tokens, same logits
            runs = [ModelRunner(CheckpointReader(model_dir), RemoteExperts(c), device=torch.device("cpu"),
                                dtype=torch.float32, kv_tokens=64).generate(PROMPT, 8) for c in (g, t)]
            assert runs[0].token_ids == runs[1].token_ids
            torch.testing.assert_close(runs[0].last_logits, runs[1].last_logits, atol=1e-5, rtol=0)
        assert all(p.calls > 0 and p.kind == "tcp" for p, _ in t.fast.paths.values())
        # plaintext: every frame sent and every answer received by the C client
        assert all(p.c.sent == p.calls == p.c.answered and "C client" in p.describe() for p, _ in t.fast.paths.values())


def test_auto_prefers_shared_memory_on_one_host(shards, cfg):
    with ExpertsClient(shards.addresses, cfg, transport="auto") as c:
        assert [c.fast.transport_of(a) for a in shards.addresses] == ["shm", "shm"]


def test_refused_when_off_on_the_shard(model_dir, cfg):
    layer = cfg.moe_layers[0]
    args = _call(cfg, 4, seed=1)
    with start_shards(model_dir, 1, extra_args=("--data-port", "-1", "--shm-dir", "")) as one:
        with ExpertsClient(one.addresses, cfg, transport="auto") as c:  # neither fast path: gRPC, with the reasons
            assert c.fast.transport_of(one.addresses[0]) == "grpc"
            why = c.fast.reasons[one.addresses[0]]
            assert "tcp: shard refused" in why and "--data-port -1" in why and "shm:" in why
            assert c.forward(layer, *args).shape == (4, cfg.hidden_size)
        with pytest.raises(ExpertsClientError, match="TCP data path was refused"):
            ExpertsClient(one.addresses, cfg, transport="tcp").connect()


def test_fallback_when_the_connection_breaks(shards, cfg):
    layer = cfg.moe_layers[0]
    args = _call(cfg, 4, seed=2)
    with ExpertsClient(shards.addresses, cfg, transport="tcp") as c:
        want = c.forward(layer, *args)
        old = c.fast.paths[shards.addresses[0]][0]
        old.sock.shutdown(socket.SHUT_RDWR)  # the connection dies under the client
        np.testing.assert_array_equal(c.forward(layer, *args), want)  # re-sent / sent over gRPC
        assert not old.usable  # that connection is never used again
        assert c.fast.transport_of(shards.addresses[1]) == "tcp"
        np.testing.assert_array_equal(c.forward(layer, *args), want)
        # the replica's gRPC channel never failed: a fresh data connection is negotiated after a back-off
        deadline = time.monotonic() + RETRY_MIN_S + 5
        while c.fast.transport_of(shards.addresses[0]) != "tcp" and time.monotonic() < deadline:
            np.testing.assert_array_equal(c.forward(layer, *args), want)
            time.sleep(0.05)
        assert c.fast.transport_of(shards.addresses[0]) == "tcp"
        calls = c.fast.paths[shards.addresses[0]][0].calls
        np.testing.assert_array_equal(c.forward(layer, *args), want)
        assert c.fast.paths[shards.addresses[0]][0] is not old
        assert c.fast.paths[shards.addresses[0]][0].calls > calls  # served by the new connection
    assert all(p.poll() is None for p in shards.procs)


def test_invalid_call_refused_like_grpc(shards, cfg):
    layer = cfg.moe_layers[0]
    (x, ids, w), cases = _invalid_calls(cfg)  # the shared-memory path's cases
    with ExpertsClient(shards.addresses, cfg, transport="tcp") as c:
        tp = c.fast.paths[shards.addresses[0]][0]
        for lyr, xx, ii, ww, what in cases:
            f = tp.send(lyr, xx, ii, ww, 10.0, fallback=None)
            while not f.done():
                tp.pump()
            e = f.exception()
            assert isinstance(e, ShardError) and e.code == grpc.StatusCode.INVALID_ARGUMENT, e
            assert what in e.details
        assert tp.usable  # the connection survives a refused call
        with ExpertsClient(shards.addresses, cfg, transport="grpc") as g:
            np.testing.assert_array_equal(c.forward(layer, x, ids, w), g.forward(layer, x, ids, w))


def _raw_connection(address: str, token: bytes | None = None) -> socket.socket:
    resp = experts_pb2_grpc.ExpertServiceStub(grpc.insecure_channel(address)).AttachTcp(
        experts_pb2.AttachTcpRequest(), timeout=10)
    assert resp.accepted and len(resp.token) == TT.TOKEN_BYTES
    s = socket.create_connection((address.rsplit(":", 1)[0], resp.port), timeout=10)
    s.sendall(resp.token if token is None else token)
    return s


def test_untrusted_header_and_wrong_token_close_the_connection(shards, cfg):
    s = _raw_connection(shards.addresses[0], token=b"\0" * TT.TOKEN_BYTES)
    assert s.recv(1) == b""  # no ACK: closed
    s.close()
    s = _raw_connection(shards.addresses[0])
    assert s.recv(1) == TT.ACK
    s.sendall(TT.REQUEST.pack(7, cfg.moe_layers[0], 10**6, 2, 0, 0))  # T far above --max-tokens
    head = bytearray(TT.RESPONSE.size)
    assert TT.recv_exact(s, memoryview(head))
    seq, status, _, _, mlen, _ = TT.RESPONSE.unpack(head)
    msg = bytearray(mlen)
    assert TT.recv_exact(s, memoryview(msg))
    assert (seq, status) == (7, TT.INVALID_ARGUMENT) and b"bad frame header" in msg
    assert s.recv(1) == b""  # then closed
    s.close()
    assert all(p.poll() is None for p in shards.procs)
