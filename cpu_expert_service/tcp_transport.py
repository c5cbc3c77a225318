"""Cross-host fast path: layer calls as binary frames on one plain TCP connection (no torch).

A Python gRPC stream costs ~0.4-0.6 ms per round trip on a small VM even for a bare echo (thread
hand-offs in grpcio), so shards on other hosts get a leaner data path beside it. The shard listens
on a data port (`--data-port`, default 0 = any free port; -1 = off). A client asks for it with the
`AttachTcp` RPC and gets the port and a one-time random token, connects to the shard's host at
that port, sends the token (32 bytes) and reads one byte 0x01; from then on the connection carries
layer calls. gRPC stays for control, health, reconnects, and every call the client does not send
here; if the connection breaks, pending calls are re-sent over gRPC.

With --tls-* the data connection is TLS as well, with the same files as gRPC: the shard presents
its certificate and requires the client's, signed by --tls-ca (`server_context` / `client_context`);
the token is only sent after the handshake. MOESPLIT_TCP=0 disables the path on either side.

Frames (little-endian), request then response, matched by seq (answers come in order):

    request   <QiIIII  seq, layer, T, k, hidden dtype code, output dtype code (28 bytes)
              then hidden [T, H] (that dtype), ids [T, k] int64, weights [T, k] float32
    response  <QIQQII  seq, status (gRPC code: 0 OK, 3 INVALID_ARGUMENT, 13 INTERNAL), compute_us,
                       server_us, message length, T (36 bytes)
              then output [T, H] (output dtype) if status is 0, else the UTF-8 message

A request whose header is invalid (T above the shard's --max-tokens, k outside [1, E], unknown
dtype codes) is answered with INVALID_ARGUMENT and the connection closed, since its payload length
cannot be trusted; any other invalid call (layer not served, expert id out of range, NaN) is
answered with INVALID_ARGUMENT and the connection kept, like the shared-memory path. Validation
and compute are the gRPC path's (`ExpertServicer.check_and_forward`).

Receivers poll without blocking for MOESPLIT_SHM_SPIN_US before they block, as on the
shared-memory path (cpu_expert_service.shm_transport.recv_spin).
"""
from __future__ import annotations

import logging
import os
import secrets
import select
import socket
import ssl
import struct
import sys
import threading
import time

import numpy as np

from cpu_expert_service import shm_transport as S

log = logging.getLogger("moesplit.tcp")

TCP_ENV = "MOESPLIT_TCP"  # "0" disables the cross-host data path (shard: refuse AttachTcp; client: never ask)
REQUEST = struct.Struct("<QiIIII")
RESPONSE = struct.Struct("<QIQQII")
TOKEN_BYTES = 32
ACK = b"\x01"
TOKEN_TTL_S = 30.0
HELLO_TIMEOUT_S = 5.0
MAX_MESSAGE = 4096
OK, INVALID_ARGUMENT, INTERNAL = S.OK, S.INVALID_ARGUMENT, S.INTERNAL
DTYPES, FLOAT_CODES = S.DTYPES, S.FLOAT_CODES


def enabled() -> bool:
    return os.environ.get(TCP_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def server_context(tls) -> ssl.SSLContext:
    """The shard's side of a TLS data connection: its certificate, the client's required (mTLS)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(tls.ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(tls) -> ssl.SSLContext:
    """The GPU side of a TLS data connection: the shard's certificate checked against --tls-ca
    (and its name), this client's presented."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_cert_chain(tls.cert, tls.key)
    ctx.load_verify_locations(tls.ca)
    return ctx


def readable(sock: socket.socket, timeout: float) -> bool:
    """Bytes to read now (TLS: decrypted ones buffered, or more on the wire) or within timeout."""
    if isinstance(sock, ssl.SSLSocket) and sock.pending():
        return True
    return bool(select.select([sock], [], [], timeout)[0])


def recv_exact(sock: socket.socket, buf: memoryview, spin_s: float = 0.0) -> bool:
    """Fill buf from a blocking socket; polls first for spin_s (no wake-up if the bytes come soon).
    False at EOF (the peer closed)."""
    got, n = 0, len(buf)
    if spin_s and n and isinstance(sock, ssl.SSLSocket):  # TLS: no MSG_DONTWAIT; poll, then read
        end = time.perf_counter() + spin_s
        while not readable(sock, 0) and time.perf_counter() < end:
            os.sched_yield()
    elif spin_s and n:
        end = time.perf_counter() + spin_s
        while True:
            try:
                k = sock.recv_into(buf, n, socket.MSG_DONTWAIT)
            except (BlockingIOError, InterruptedError):
                if time.perf_counter() >= end:
                    break
                os.sched_yield()
                continue
            if k == 0:
                return False
            got = k
            break
    while got < n:
        k = sock.recv_into(buf[got:], n - got)
        if k == 0:
            return False
        got += k
    return True


def send_parts(sock: socket.socket, parts) -> None:
    """Send the byte-like parts in order as one write when the kernel takes it (sendmsg), the rest
    after a short write."""
    # numpy arrays as raw bytes (bfloat16 has no buffer-protocol format of its own)
    views = [memoryview(p.reshape(-1).view(np.uint8)) if isinstance(p, np.ndarray) else memoryview(p).cast("B")
             for p in parts]
    if isinstance(sock, ssl.SSLSocket):  # no sendmsg on TLS sockets: one record write
        sock.sendall(b"".join(views))
        return
    sent = sock.sendmsg(views)
    total = sum(len(v) for v in views)
    if sent < total:
        sock.sendall(b"".join(bytes(v) for v in views)[sent:])


class DataServer:
    """The shard's data port: accepts connections that present a token from `offer()` and serves
    each on its own thread."""

    def __init__(self, servicer, host: str, port: int, tls=None):
        self.servicer = servicer
        self.ctx = server_context(tls) if tls is not None else None  # mTLS data connections
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.tokens: dict[bytes, float] = {}  # token -> expiry (monotonic)
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, name=f"tcp-data-{self.port}", daemon=True).start()

    def offer(self) -> tuple[int, bytes]:
        token = secrets.token_bytes(TOKEN_BYTES)
        now = time.monotonic()
        with self.lock:
            self.tokens = {t: e for t, e in self.tokens.items() if e > now}
            self.tokens[token] = now + TOKEN_TTL_S
        return self.port, token

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._hello, args=(conn, peer), name=f"tcp-data-{peer[0]}:{peer[1]}",
                             daemon=True).start()

    def _hello(self, conn: socket.socket, peer) -> None:
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            if self.ctx is not None:  # the handshake (client certificate required) before anything else
                conn = self.ctx.wrap_socket(conn, server_side=True)
            tok = bytearray(TOKEN_BYTES)
            ok = recv_exact(conn, memoryview(tok))
            with self.lock:
                expiry = self.tokens.pop(bytes(tok), 0.0) if ok else 0.0
            if expiry <= time.monotonic():
                log.warning("tcp data path: %s:%s presented no valid token; closed", *peer[:2])
                conn.close()
                return
            conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(ACK)
        except OSError as e:  # ssl.SSLError included: no or a wrong client certificate
            log.warning("tcp data path: %s:%s: %s; closed", peer[0], peer[1], e)
            conn.close()
            return
        log.info("shard %s: tcp data path from %s:%s%s", self.servicer.shard_id, peer[0], peer[1],
                 " (TLS)" if self.ctx is not None else "")
        _serve(self.servicer, conn)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def _serve(servicer, conn: socket.socket) -> None:
    """One client's connection: frame in, validated and computed, frame out."""
    from cpu_expert_service.metrics import mark_arrival
    RequestError = sys.modules[type(servicer).__module__].RequestError

    cfg = servicer.cfg
    H, E = cfg.hidden_size, cfg.n_routed_experts
    hdr = bytearray(REQUEST.size)
    hv = memoryview(hdr)
    payload = bytearray(0)
    spin_s = S.spin_seconds()
    try:
        while True:
            if not recv_exact(conn, hv, spin_s):
                return
            t_start = time.perf_counter()
            mark_arrival(t_start)
            seq, layer, T, k, hc, oc = REQUEST.unpack(hdr)
            if T > servicer.max_tokens or not 1 <= k <= E or hc not in FLOAT_CODES or oc not in FLOAT_CODES:
                msg = (f"shard {servicer.shard_id}: seq {seq}: bad frame header (T {T} of at most {servicer.max_tokens}, "
                       f"k {k} of 1-{E}, dtype codes {hc}/{oc}); closing the data connection").encode()
                send_parts(conn, [RESPONSE.pack(seq, INVALID_ARGUMENT, 0, 0, len(msg), T), msg])
                return
            hb = T * H * DTYPES[hc].itemsize
            n = hb + T * k * 12
            if len(payload) < n:
                payload = bytearray(max(n, 2 * len(payload)))
            pv = memoryview(payload)
            if not recv_exact(conn, pv[:n]):
                return
            status, compute_us, body = OK, 0, b""
            try:
                x = np.frombuffer(payload, DTYPES[hc], T * H, 0).reshape(T, H)
                ids = np.frombuffer(payload, np.int64, T * k, hb).reshape(T, k)
                w = np.frombuffer(payload, np.float32, T * k, hb + T * k * 8).reshape(T, k)
                out, compute_us = servicer.check_and_forward(layer, x, ids, w)  # [T, H] f32
                body = np.ascontiguousarray(out, DTYPES[oc])
            except RequestError as e:
                status, body = INVALID_ARGUMENT, f"shard {servicer.shard_id}: seq {seq}: {e}".encode()[:MAX_MESSAGE]
            except Exception as e:  # noqa: BLE001 - a backend bug: say so, keep serving
                log.exception("shard %s: tcp seq %d failed", servicer.shard_id, seq)
                status = INTERNAL
                body = f"shard {servicer.shard_id}: seq {seq}: {type(e).__name__}: {e}".encode()[:MAX_MESSAGE]
            server_us = int((time.perf_counter() - t_start) * 1e6)
            send_parts(conn, [RESPONSE.pack(seq, status, compute_us, server_us, 0 if status == OK else len(body), T),
                              body])  # body: the [T, H] answer in the output dtype, or the message
    except OSError:
        pass  # client went away
    finally:
        conn.close()
