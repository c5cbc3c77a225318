"""Mutual TLS between the GPU service and the expert shards, with certificates made in the test
(`cryptography`): a CA, a shard certificate for 127.0.0.1 / localhost, a GPU-service client
certificate, and a client certificate from another CA that the shard must reject."""
from __future__ import annotations

import datetime
import ipaddress
import os
import re
import signal
import subprocess
import sys
import time

import grpc
import httpx
import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(cn):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _leaf(ca, cn, server: bool, client: bool):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    ca_key, ca_cert = ca
    key = _key()
    now = datetime.datetime.now(datetime.timezone.utc)
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + ([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])
    b = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
         .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
         .not_valid_after(now + datetime.timedelta(days=1))
         .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
         .add_extension(x509.ExtendedKeyUsage(usages), critical=False))
    if server:
        b = b.add_extension(x509.SubjectAlternativeName([
            x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
    return key, b.sign(ca_key, hashes.SHA256())


def _write(d, name, key, cert):
    from cryptography.hazmat.primitives import serialization

    paths = {}
    if key is not None:
        paths["key"] = os.path.join(d, f"{name}.key")
        with open(paths["key"], "wb") as f:
            f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                      serialization.NoEncryption()))
    paths["cert"] = os.path.join(d, f"{name}.crt")
    with open(paths["cert"], "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    return paths


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("pki"))
    ca, rogue_ca = _ca("moesplit test CA"), _ca("some other CA")
    out = {"ca": _write(d, "ca", None, ca[1])["cert"], "rogue_ca": _write(d, "rogue_ca", None, rogue_ca[1])["cert"]}
    out["server"] = _write(d, "server", *_leaf(ca, "expert-shard", server=True, client=False))
    out["client"] = _write(d, "client", *_leaf(ca, "gpu-service", server=False, client=True))
    out["rogue"] = _write(d, "rogue", *_leaf(rogue_ca, "gpu-service", server=False, client=True))
    out["both"] = _write(d, "both", *_leaf(ca, "moesplit", server=True, client=True))  # `serve`: one cert, both sides
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("tls") / "tiny-tls"), "bf16", seed=5)


@pytest.fixture(scope="module")
def tls_shard(model_dir, pki):
    from gpu_service.local.stack import start_shards

    s = pki["server"]
    with start_shards(model_dir, 1, backend="auto",
                      extra_args=["--tls-cert", s["cert"], "--tls-key", s["key"], "--tls-ca", pki["ca"]]) as sh:
        yield sh


def _files(pki, who, ca="ca"):
    from wire.channel import TLSFiles

    return TLSFiles(pki[who]["cert"], pki[who]["key"], pki[ca])


def _x(cfg):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, cfg.hidden_size)).astype(np.float32)
    ids = rng.integers(0, cfg.n_routed_experts, (3, cfg.num_experts_per_tok)).astype(np.int64)
    return x, ids, np.full(ids.shape, 0.25, np.float32)


def test_client_with_valid_certificate(tls_shard, pki, model_dir):
    from checkpoint.config import load_config
    from gpu_service.experts.client import ExpertsClient

    cfg = load_config(model_dir)
    with ExpertsClient(tls_shard.addresses, cfg, timeout_s=10, tls=_files(pki, "client")) as c:
        y = c.forward(cfg.moe_layers[0], *_x(cfg))
        assert y.shape == (3, cfg.hidden_size) and np.isfinite(y).all()
        ok, detail = c.health()  # health checks over TLS too
        assert ok and set(detail.values()) == {"SERVING"}


@pytest.mark.parametrize("who", ["rogue", "no_cert", "plaintext", "wrong_ca"])
def test_client_without_valid_certificate_rejected(tls_shard, pki, model_dir, who):
    from checkpoint.config import load_config
    from wire.channel import make_channel
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.experts.errors import ShardError
    from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

    cfg = load_config(model_dir)
    addr = tls_shard.addresses[0]
    if who in ("rogue", "wrong_ca"):  # a certificate from another CA / not trusting the shard's CA
        tls = _files(pki, "rogue") if who == "rogue" else _files(pki, "client", ca="rogue_ca")
        with pytest.raises(ShardError) as ei:
            ExpertsClient([addr], cfg, timeout_s=2, connect_timeout_s=2, tls=tls).connect()
        assert addr in str(ei.value)
        return
    if who == "no_cert":  # TLS that trusts the shard, but presents no client certificate
        with open(pki["ca"], "rb") as f:
            ch = grpc.secure_channel(addr, grpc.ssl_channel_credentials(root_certificates=f.read()))
    else:
        ch = make_channel(addr, [])
    with ch:
        with pytest.raises(grpc.RpcError) as ei:
            experts_pb2_grpc.ExpertServiceStub(ch).Describe(experts_pb2.DescribeRequest(), timeout=3)
        assert ei.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)


def test_tcp_data_path_with_mutual_tls(tls_shard, pki, model_dir):
    """With TLS the TCP data path is TLS too: a client with its certificate gets it and the gRPC
    answers; a connection to the data port without a client certificate is refused in the handshake."""
    import socket
    import ssl

    from checkpoint.config import load_config
    from gpu_service.experts.client import ExpertsClient
    from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

    cfg = load_config(model_dir)
    addr = tls_shard.addresses[0]
    layer = cfg.moe_layers[0]
    with ExpertsClient([addr], cfg, timeout_s=10, tls=_files(pki, "client"), transport="tcp") as t, \
            ExpertsClient([addr], cfg, timeout_s=10, tls=_files(pki, "client"), transport="grpc") as g:
        assert t.fast.transport_of(addr) == "tcp"
        for T in (1, 3, 70):
            rng = np.random.default_rng(T)
            x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
            ids = rng.integers(0, cfg.n_routed_experts, (T, cfg.num_experts_per_tok)).astype(np.int64)
            w = rng.random(ids.shape).astype(np.float32)
            np.testing.assert_array_equal(t.forward(layer, x, ids, w), g.forward(layer, x, ids, w))
        assert t.fast.paths[addr][0].calls == 3
        # the data port, with a valid token but TLS without a client certificate: no handshake
        resp = experts_pb2_grpc.ExpertServiceStub(g.replicas[0].channel).AttachTcp(
            experts_pb2.AttachTcpRequest(), timeout=5)
    assert resp.accepted
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(pki["ca"])
    with socket.create_connection(("127.0.0.1", resp.port), timeout=5) as raw:
        with pytest.raises((ssl.SSLError, OSError)):
            with ctx.wrap_socket(raw, server_hostname="localhost") as s:
                s.sendall(resp.token)
                assert s.recv(1) == b""  # TLS 1.3 may finish the client's side first: then the shard closes
                raise OSError("closed without an answer")  # no ACK either way


def test_partial_tls_flags_refused(model_dir, pki):
    p = subprocess.run([sys.executable, "-m", "moesplit", "expert-server", "--model", model_dir,
                        "--tls-cert", pki["server"]["cert"]], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert p.returncode == 2 and "--tls-key" in p.stderr and "--tls-ca" in p.stderr


def test_serve_with_mutual_tls(model_dir, pki):
    """`moesplit serve --tls-*`: local shards serve mutual TLS, the GPU service connects with the
    same certificate, /health (which asks the shards over TLS) is 200 and a completion works."""
    b = pki["both"]
    cmd = [sys.executable, "-m", "moesplit", "serve", "--model", model_dir, "--shards", "2", "--port", "0",
           "--grpc-port", "0", "--kv-tokens", "256", "--dtype", "float32", "--device", "cpu", "--log-level",
           "WARNING", "--tls-cert", b["cert"], "--tls-key", b["key"], "--tls-ca", pki["ca"]]
    p = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        url, lines = None, []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line and p.poll() is not None:
                break
            lines.append(line)
            m = re.search(r"OpenAI API (http://\S+)/v1", line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(lines)
        h = httpx.get(url + "/health", timeout=10)
        assert h.status_code == 200 and set(h.json()["shards"].values()) == {"SERVING"}, h.text
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
