"""Hostile clients at the connection level, against a serving stack on loopback.

One in-process stack (tiny checkpoint, experts in-process, API key set) with the connection limits
scaled down so a flood that passes them takes a few hundred sockets and seconds: a flood from one
address (the `GET /health` + `Content-Length: 100000` + one byte probe), an idle flood from many
addresses past --max-connections, a slow-body flood past the probes' reserve, bodies at 1 byte per
0.2 s, and a 7 MB /tokenize. Throughout, /live is polled on fresh connections and must answer in
under 200 ms; /live, /health and a keyed request must each be served within 1 s. Flood sockets
come from other loopback addresses (127.0.0.x), as an attacker's would from its own.
"""
import socket
import threading
import json
import time

import httpx
import pytest

KEY = "sk-hostile"
MODEL = "tiny-hostile"
H = {"authorization": f"Bearer {KEY}"}
HEADER_S, BODY_S = 2.0, 2.0
PER_CLIENT, MAX_CONN, PROBES = 40, 160, 16


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    import torch

    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.api.guard import ServerLimits
    from gpu_service.api.tokenizer import Tokenizer
    from gpu_service.entrypoints.serving import ServingStack
    from gpu_service.local.tiny import make_tiny
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    model_dir = make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=0)
    _, backend, _ = load_shard(model_dir, None, None, "numpy")
    runner = ModelRunner(CheckpointReader(model_dir), LocalExperts(backend), device=torch.device("cpu"),
                         dtype=torch.float32, kv_tokens=2048, page_size=16)
    limits = ServerLimits(max_prompt_chars=20000, header_timeout_s=HEADER_S, body_timeout_s=BODY_S,
                          body_min_rate=1024, max_connections=MAX_CONN, max_connections_per_client=PER_CLIENT,
                          probe_connections=PROBES)
    st = ServingStack(runner, Tokenizer(model_dir), MODEL, port=0, grpc_port=0, api_key=KEY, max_batch=8,
                      chunk_tokens=64, max_waiting=64, limits=limits).start()
    yield st
    st.stop()


class LivePoller:
    """/live on a fresh connection every 50 ms from a thread; `worst` is the slowest answer (s),
    `failures` the answers that were not 200 in time."""

    def __init__(self, st):
        self.addr, self.worst, self.failures, self.n = (st.host, st.port), 0.0, [], 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:  # a raw socket: httpx builds an SSL context per call, which is client time, not the server's
                with socket.create_connection(self.addr, timeout=2.0) as s:
                    s.sendall(b"GET /live HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
                    out = b""
                    while chunk := s.recv(4096):
                        out += chunk
                if not out.startswith(b"HTTP/1.1 200"):
                    self.failures.append(out[:200])
            except OSError as e:
                self.failures.append(repr(e))
            self.worst, self.n = max(self.worst, time.monotonic() - t0), self.n + 1
            self._stop.wait(0.05)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join(5)


def _served_within_1s(st):
    """/live, /health and a keyed completion each answered 200 within 1 s."""
    for method, path, kw in (("GET", "/live", {}), ("GET", "/health", {}),
                             ("POST", "/v1/completions", {"headers": H, "json": {"model": MODEL, "prompt": [5, 6],
                                                                                    "max_tokens": 2}})):
        t0 = time.monotonic()
        r = httpx.request(method, st.http_url + path, timeout=1.0, **kw)
        dt = time.monotonic() - t0
        assert r.status_code == 200 and dt < 1.0, (path, r.status_code, r.text[:300], dt)


def _connect(st, source: str) -> socket.socket:
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(5)
    s.connect((st.host, st.port))
    return s


def _answers(socks, wait_s: float) -> list[bytes]:
    """What each socket has received within `wait_s` (b"" when closed with nothing, None when silent)."""
    out, deadline = [], time.monotonic() + wait_s
    for s in socks:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            out.append(s.recv(65536))
        except socket.timeout:
            out.append(None)
        except OSError:
            out.append(b"")
    return out


def _closed_by(socks, deadline_s: float) -> int:
    """How many of `socks` the server closed within `deadline_s` from now (reading what it sent)."""
    t_end, closed = time.monotonic() + deadline_s, 0
    for s in socks:
        try:
            while True:
                s.settimeout(max(0.01, t_end - time.monotonic()))
                if s.recv(65536) == b"":
                    closed += 1
                    break
        except socket.timeout:
            pass
        except OSError:
            closed += 1
    return closed


def _close_all(socks):
    for s in socks:
        s.close()
    time.sleep(0.2)  # the server sees them go


def test_flood_from_one_address_is_capped_per_client(stack):
    """300 sockets from one address, each `GET /health` declaring a 100 kB body, one byte, silence:
    over --max-connections-per-client at once they get a 503 naming the flag, the admitted ones are
    answered and closed without the body being drained, and the others are served within 1 s."""
    req = b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 100000\r\n\r\nx"
    with LivePoller(stack) as live:
        socks = []
        for _ in range(300):
            s = _connect(stack, "127.0.0.2")
            s.sendall(req)
            socks.append(s)
        got = _answers(socks, 1.0)
        _served_within_1s(stack)
        t0 = time.monotonic()
        closed = _closed_by(socks, BODY_S + 1.5)
        dt = time.monotonic() - t0
    refused = [a for a in got if a and a.startswith(b"HTTP/1.1 503")]
    admitted = [a for a in got if a and a.startswith(b"HTTP/1.1 200")]
    print(f"\n300 sockets from one address: {len(admitted)} admitted, {len(refused)} refused, {closed} closed "
          f"in {dt:.2f} s; /live worst {live.worst * 1000:.0f} ms over {live.n}")
    _close_all(socks)
    # every socket answered: refused (over the per-address cap) or /health answered and closed at once
    # without draining its body, which frees its slot for the next; none is left holding one
    assert len(admitted) + len(refused) == 300 and refused, (len(admitted), len(refused))
    assert b"--max-connections-per-client" in refused[0]
    assert closed == 300
    assert not live.failures and live.worst < 0.2


def test_idle_flood_from_many_addresses_evicts_idle(stack):
    """300 idle sockets (half a request line) from 10 addresses, past --max-connections: new
    connections take the place of the oldest idle ones, so /live, /health and a keyed request are
    served within 1 s."""
    evicted0 = stack.http.connections.evicted
    socks = []
    for i in range(300):
        s = _connect(stack, f"127.0.1.{i % 10 + 1}")
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost")
        socks.append(s)
    # polled once the flood is in: a connection made amid it can be the oldest idle one at the cap
    # before its request is read, and be evicted (the client sees a reset and retries)
    with LivePoller(stack) as live:
        time.sleep(0.6)  # idle past EVICT_AFTER_S
        _served_within_1s(stack)
        evicted = stack.http.connections.evicted - evicted0
        closed = _closed_by(socks, HEADER_S + 1.5)
    print(f"\n300 idle sockets from 10 addresses: {evicted} evicted; all {closed} closed by the header deadline; "
          f"/live worst {live.worst * 1000:.0f} ms")
    _close_all(socks)
    assert evicted >= 3 and closed == 300  # at least one per request above
    assert not live.failures and live.worst < 0.2


def test_slow_body_flood_keeps_room_for_probes(stack):
    """200 keyed sockets from 5 addresses sending a body at 1 byte per 0.2 s (paced so the server
    reads each head): past --max-connections minus the probes' room only /live and /health are
    served (503 naming --probe-connections), and every slow body is closed by the body deadline,
    with a 408 naming the flags."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode() +
            b"\r\ncontent-type: application/json\r\ncontent-length: 1000\r\n\r\n")
    with LivePoller(stack) as live:
        socks = []
        for i in range(200):
            s = _connect(stack, f"127.0.2.{i % 5 + 1}")
            s.sendall(head + b"{")
            socks.append(s)
            if i % 10 == 9:
                time.sleep(0.02)
        for path in ("/live", "/health"):
            assert httpx.get(stack.http_url + path, timeout=1.0).status_code == 200
        keyed = httpx.post(stack.http_url + "/v1/completions", headers=H, timeout=1.0,
                           json={"model": MODEL, "prompt": [5], "max_tokens": 1})
        t0 = time.monotonic()
        for _ in range(4):
            for s in socks:
                try:
                    s.send(b" ")
                except OSError:
                    pass
            time.sleep(0.2)
        got = _answers(socks, BODY_S + 1.0)
        closed = _closed_by(socks, 0.5)
        dt = time.monotonic() - t0
    n408 = [a for a in got if a and a.startswith(b"HTTP/1.1 408")]
    print(f"\n200 slow bodies: keyed request {keyed.status_code}; after {dt:.2f} s {closed} closed, "
          f"{len(n408)} x 408, {sum(bool(a) and a.startswith(b'HTTP/1.1 503') for a in got)} x 503; "
          f"/live worst {live.worst * 1000:.0f} ms")
    _close_all(socks)
    # served, or (the reserve in use by the slow bodies) refused at once naming the flag
    assert keyed.status_code == 200 or (keyed.status_code == 503 and "--probe-connections" in keyed.text)
    assert closed == 200 and len(n408) >= MAX_CONN - PROBES - 10 and b"--body-timeout" in n408[0]
    assert not live.failures and live.worst < 0.2
    _served_within_1s(stack)  # all gone: served again


def test_body_at_one_byte_per_second_closed_at_the_deadline(stack):
    """20 keyed sockets (within every cap) trickling a body: all closed at the body deadline."""
    head = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nauthorization: Bearer " + KEY.encode() +
            b"\r\ncontent-length: 500\r\n\r\n{")
    socks = [_connect(stack, "127.0.0.3") for _ in range(20)]
    t0 = time.monotonic()
    for s in socks:
        s.sendall(head)
    stop = threading.Event()

    def trickle():
        while not stop.wait(1.0):
            for s in socks:
                try:
                    s.send(b" ")
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    closed = _closed_by(socks, BODY_S + 1.5)
    dt = time.monotonic() - t0
    stop.set()
    t.join()
    print(f"\n20 bodies at 1 byte/s: {closed} closed after {dt:.2f} s (deadline {BODY_S:g} s)")
    _close_all(socks)
    assert closed == 20 and BODY_S - 0.1 <= dt < BODY_S + 1.5


def test_7mb_tokenize_refused_fast(stack):
    """A 7 MB /tokenize prompt (and 1M ids to /detokenize) is 413 in under 0.5 s; /live stays under 200 ms."""
    prompt = "hello world " * 600_000  # 7.2 MB
    with LivePoller(stack) as live:
        time.sleep(0.1)
        t0 = time.monotonic()
        r = httpx.post(stack.http_url + "/tokenize", headers=H, json={"prompt": prompt}, timeout=10)
        dt = time.monotonic() - t0
        body = json.dumps({"tokens": [5] * 1_000_000}).encode()  # encoded before the clock: the server's time
        t1 = time.monotonic()
        d = httpx.post(stack.http_url + "/detokenize", headers={**H, "Content-Type": "application/json"},
                       content=body, timeout=10)
        dt_d = time.monotonic() - t1
        time.sleep(0.2)
    print(f"\n7.2 MB /tokenize: {r.status_code} in {dt * 1000:.0f} ms; 1M-id /detokenize: {d.status_code} in "
          f"{dt_d * 1000:.0f} ms; /live worst {live.worst * 1000:.0f} ms")
    assert r.status_code == 413 and "--max-prompt-chars" in r.json()["error"]["message"] and dt < 0.5
    assert d.status_code == 413 and dt_d < 0.5
    assert not live.failures and live.worst < 0.2
    ok = httpx.post(stack.http_url + "/tokenize", headers=H, json={"prompt": "hello world"}, timeout=5)
    assert ok.status_code == 200 and ok.json()["count"] > 0


def test_grpc_server_options_bound_streams_and_pings():
    """The gRPC server's options: per-connection streams, handshake deadline, ping enforcement."""
    from gpu_service.api.connections import grpc_server_options
    from gpu_service.api.guard import ServerLimits

    opts = dict(grpc_server_options(ServerLimits(header_timeout_s=3, grpc_max_streams_per_connection=7)))
    assert opts["grpc.max_concurrent_streams"] == 7 and opts["grpc.server_handshake_timeout_ms"] == 3000
    assert opts["grpc.http2.min_recv_ping_interval_without_data_ms"] == 10_000 and opts["grpc.http2.max_ping_strikes"] > 0
    with pytest.raises(ValueError, match="--probe-connections"):
        ServerLimits(max_connections=8, probe_connections=8)
    with pytest.raises(ValueError, match="--body-timeout"):
        ServerLimits(body_timeout_s=0)
