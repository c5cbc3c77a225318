"""Hardening, API side: each probe of a hostile client reproduced against a serving stack.

One in-process stack (tiny fp32 checkpoint, experts in-process, API key set, small limits) on
127.0.0.1: body-size cap (413 before reading), prompt cap, /health responsive meanwhile, clients
that leave non-stream requests get them cancelled, a full queue is 429, gRPC Generate needs the
key, unbounded stop lists refused, malformed JSON is 400 without internal text, half-open
connections are closed by the header deadline, /live is the engine alone.
"""
import json
import re
import socket
import threading
import time

import grpc
import httpx
import pytest

KEY = "sk-hardening"
MODEL = "tiny-hard"
HEADER_TIMEOUT_S = 0.5


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=0)


@pytest.fixture(scope="module")
def runner_factory(model_dir):
    import torch

    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    _, backend, _ = load_shard(model_dir, None, None, "numpy")
    return lambda: ModelRunner(CheckpointReader(model_dir), LocalExperts(backend), device=torch.device("cpu"),
                               dtype=torch.float32, kv_tokens=2048, page_size=16)


@pytest.fixture(scope="module")
def stack(runner_factory, model_dir):
    from gpu_service.api.guard import ServerLimits
    from gpu_service.api.tokenizer import Tokenizer
    from gpu_service.entrypoints.serving import ServingStack

    st = ServingStack(runner_factory(), Tokenizer(model_dir), MODEL, port=0, grpc_port=0, api_key=KEY,
                      max_batch=24, chunk_tokens=64, max_waiting=64,
                      limits=ServerLimits(max_body_bytes=1 << 20, max_prompt_chars=20000,
                                          header_timeout_s=HEADER_TIMEOUT_S))
    st.start()
    yield st
    st.stop()


H = {"authorization": f"Bearer {KEY}"}


def _post(st, body, headers=H, path="/v1/completions", timeout=30):
    return httpx.post(st.http_url + path, json=body, headers=headers, timeout=timeout)


def _raw(st, data: bytes, timeout=5.0) -> bytes:
    with socket.create_connection((st.host, st.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while b"\r\n\r\n" not in out:
            chunk = s.recv(65536)
            if not chunk:
                break
            out += chunk
        return out


def test_api_key_scheme_case_and_wrong_key(stack):
    body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2}
    assert _post(stack, body, headers={}).status_code == 401
    assert _post(stack, body, headers={"authorization": f"Bearer {KEY}x"}).status_code == 401
    assert _post(stack, body, headers={"authorization": KEY}).status_code == 401
    assert _post(stack, body, headers={"authorization": f"bearer {KEY}"}).status_code == 200
    assert httpx.get(stack.http_url + "/health").status_code == 200  # probes need no key


def test_16mb_body_413_fast_while_health_answers(stack):
    """Probe 3: a 16 MB body is refused in < 0.5 s without being read, declared or chunked;
    /health answers in < 100 ms meanwhile; the server's memory does not grow by the body."""
    health_ms: list[float] = []
    stop = threading.Event()

    def poll():
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                assert c.get(stack.http_url + "/health").status_code == 200
                health_ms.append((time.perf_counter() - t0) * 1e3)
                time.sleep(0.01)

    prompt = json.dumps({"model": MODEL, "prompt": "x" * (16 << 20)}).encode()  # built before timing
    rss0 = _rss_mb()
    th = threading.Thread(target=poll)
    th.start()
    try:
        time.sleep(0.3)
        for _ in range(3):
            t0 = time.perf_counter()  # Content-Length declared: refused before a byte of body
            head = _raw(stack, b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                               b"authorization: Bearer " + KEY.encode() + b"\r\n"
                               b"content-length: " + str(len(prompt)).encode() + b"\r\n\r\n" + prompt[:65536])
            dt = time.perf_counter() - t0
            assert head.startswith(b"HTTP/1.1 413"), head[:200]
            assert dt < 0.5, dt
        # chunked (no length): counted as it arrives, refused once past the cap
        t0 = time.perf_counter()
        with socket.create_connection((stack.host, stack.port), timeout=5) as s:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                      b"authorization: Bearer " + KEY.encode() + b"\r\ntransfer-encoding: chunked\r\n\r\n")
            resp = b""
            try:
                for i in range(0, len(prompt), 1 << 18):
                    part = prompt[i:i + (1 << 18)]
                    s.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
                    s.setblocking(False)
                    try:
                        resp += s.recv(65536)
                    except BlockingIOError:
                        pass
                    s.setblocking(True)
                    if resp:
                        break
            except (BrokenPipeError, ConnectionResetError):
                pass
            s.settimeout(2)
            while b"\r\n\r\n" not in resp:
                chunk = s.recv(65536)
                if not chunk:
                    break
                resp += chunk
        dt = time.perf_counter() - t0
        assert resp.startswith(b"HTTP/1.1 413"), resp[:200]
        assert dt < 0.5, dt
        time.sleep(0.3)
    finally:
        stop.set()
        th.join()
    del prompt
    growth = _rss_mb() - rss0
    print(f"\n16 MB body: 413 in {dt * 1e3:.0f} ms (chunked), /health max {max(health_ms):.1f} ms over "
          f"{len(health_ms)} polls, RSS growth {growth:.1f} MB")
    assert max(health_ms) < 100, health_ms
    assert growth < 50


def test_prompt_cap_before_tokenizing(stack):
    t0 = time.perf_counter()
    r = _post(stack, {"model": MODEL, "prompt": "y" * 500_000})
    assert r.status_code == 400 and "--max-prompt-chars" in r.json()["error"]["message"]
    r = _post(stack, {"model": MODEL, "messages": [{"role": "user", "content": "z" * 500_000}]},
              path="/v1/chat/completions")
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    assert time.perf_counter() - t0 < 3.0  # refused before tokenizing (a 16 MB prompt took 13.4 s before)


def _cancelled(st) -> float:
    text = httpx.get(st.http_url + "/metrics").text
    m = re.search(r'^moesplit_request_finished_total\{finished_reason="cancelled"\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_non_stream_clients_that_leave_are_cancelled(stack):
    """Probe 4: 20 non-stream requests whose clients disconnect after 0.5 s: all cancelled within
    1 s of leaving (finished_reason="cancelled" in the metrics), the engine idle again."""
    eng = stack.engine
    before = _cancelled(stack)
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 1000, "ignore_eos": True}

    def leave():
        try:
            _post(stack, body, timeout=0.5)
        except httpx.TimeoutException:
            pass

    ths = [threading.Thread(target=leave) for _ in range(20)]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    t_left = time.monotonic()
    while eng.stats()["running"] + eng.stats()["waiting"] > 0 and time.monotonic() - t_left < 5:
        time.sleep(0.02)
    dt = time.monotonic() - t_left
    n = _cancelled(stack) - before
    print(f"\n20 clients left after 0.5 s: {n:.0f} cancelled, engine idle {dt:.2f} s after")
    assert n == 20
    assert dt < 1.0


def test_full_queue_is_429_with_retry_after(runner_factory, model_dir):
    from fastapi.testclient import TestClient

    from gpu_service.api.grpc_api import create_server
    from gpu_service.api.grpc_client import GenerateClient
    from gpu_service.api.http_api import create_app
    from gpu_service.runtime.engine import Engine

    eng = Engine(runner_factory(), None, max_batch=1, max_waiting=2)  # not started: requests stay queued
    for _ in range(2):
        eng.submit([5, 6, 7], max_tokens=2)
    r = TestClient(create_app(eng, None, MODEL)).post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2})
    assert r.status_code == 429 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == "queue_full"
    server, port = create_server(eng, None, port=0)
    try:
        with GenerateClient(f"127.0.0.1:{port}") as gc, pytest.raises(grpc.RpcError) as ei:
            next(gc.generate(prompt_ids=[5, 6], max_tokens=2))
        assert ei.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        server.stop(None)
        eng.stop()


def test_grpc_generate_needs_the_key_and_bounds_stop(stack):
    """Probes 2 and 8: gRPC Generate without / with a wrong key is UNAUTHENTICATED, with the key
    it streams tokens; 200k stop strings are refused before any work."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from gpu_service.api.grpc_client import GenerateClient

    for key in (None, "wrong", KEY.upper()):
        with GenerateClient(stack.grpc_address, api_key=key) as gc, pytest.raises(grpc.RpcError) as ei:
            next(gc.generate(prompt_ids=[5, 6, 7], max_tokens=2))
        assert ei.value.code() == grpc.StatusCode.UNAUTHENTICATED, key
    with GenerateClient(stack.grpc_address, api_key=KEY) as gc:
        r = next(gc.generate(prompt_ids=[5, 6, 7], max_tokens=3, ignore_eos=True, stream=False))
        assert len(r.token_ids) == 3
        t0 = time.perf_counter()
        with pytest.raises(grpc.RpcError) as ei:
            next(gc.generate(prompt_ids=[5, 6, 7], max_tokens=2, stop=[f"s{i}" for i in range(200_000)]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop" in ei.value.details()
        assert time.perf_counter() - t0 < 2.0
        with pytest.raises(grpc.RpcError) as ei:
            next(gc.generate(prompt_ids=[5, 6, 7], max_tokens=2, stop=["x" * 10_000]))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ch = grpc.insecure_channel(stack.grpc_address)  # the health service needs no key (probes)
    assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
    ch.close()


def test_malformed_bodies_are_400_without_internals(stack):
    """Probe 10: deep nesting, a 5000-digit integer, integers past 64 bits: 400, no internal text."""
    bodies = [b"[" * 200_000 + b"]" * 200_000,
              b'{"model": "tiny-hard", "prompt": [5], "max_tokens": ' + b"9" * 5000 + b"}",
              json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 10**30}).encode(),
              json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 2, "seed": 10**40}).encode(),
              json.dumps({"model": MODEL, "prompt": [5], "max_tokens": 2, "temperature": 10**400}).encode(),
              b'{"model": "tiny-hard", "prompt": ' + b'{"a": ' * 50_000 + b"1" + b"}" * 50_000 + b"}"]
    for raw in bodies:
        r = httpx.post(stack.http_url + "/v1/completions", content=raw, timeout=30,
                       headers={**H, "content-type": "application/json"})
        assert r.status_code == 400, (raw[:60], r.status_code, r.text[:300])
        msg = r.json()["error"]["message"]
        assert "Traceback" not in msg and "Error:" not in msg and len(msg) < 300, msg


def test_half_open_connections_closed_by_the_header_deadline(stack):
    """Probe 10: 100 connections that never finish their headers are closed within the deadline."""
    socks = []
    for i in range(100):
        s = socket.create_connection((stack.host, stack.port), timeout=5)
        if i % 2:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\n")  # headers never finished
        socks.append(s)
    t0 = time.monotonic()
    closed = 0
    for s in socks:
        s.settimeout(max(0.1, HEADER_TIMEOUT_S + 2.0 - (time.monotonic() - t0)))
        try:
            closed += s.recv(1) == b""
        except (socket.timeout, ConnectionResetError):
            pass
        s.close()
    dt = time.monotonic() - t0
    print(f"\n100 half-open connections: {closed} closed by the server within {dt:.2f} s")
    assert closed == 100 and dt < HEADER_TIMEOUT_S + 2.0
    assert _post(stack, {"model": MODEL, "prompt": [5, 6], "max_tokens": 2}).status_code == 200


def test_live_is_the_engine_alone(runner_factory):
    from fastapi.testclient import TestClient

    from gpu_service.api.http_api import create_app
    from gpu_service.runtime.engine import Engine

    eng = Engine(runner_factory()).start()
    app = create_app(eng, None, MODEL, health_fn=lambda: (False, {"a:1": "UNAVAILABLE: gone"}))
    c = TestClient(app)
    assert c.get("/live").status_code == 200  # shards down: ready no, alive yes
    assert c.get("/health").status_code == 503
    eng.stop()
    assert c.get("/live").status_code == 503
