"""The cross-host TCP data path's wire format: frames, token hello, TLS contexts, socket helpers.

Both sides import this: the GPU service's client (gpu_service.experts.tcp) and the shard
(cpu_expert_service.tcp_transport). numpy only; it imports neither service.


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

A request whose header is invalid (T above the shard's --max-tokens, k outside [1,
num_experts_per_tok], unknown dtype codes) is answered with INVALID_ARGUMENT and the connection
closed, since its payload length cannot be trusted; once a frame's first byte arrived its rest must
arrive within MOESPLIT_TCP_FRAME_TIMEOUT_S (default 10 s) or the connection is closed, and the
payload buffer commits memory only as bytes arrive (a header alone costs nothing); a shard holds at
most MAX_CONNECTIONS data connections. The client checks each response header against its request
(known seq, the T it asked for, a bounded message) before reading the body.
Plaintext data connections are as trusted as plaintext gRPC: the Helm chart's NetworkPolicy admits
only the GPU pods; give the shards --tls-* (mutual TLS) where the network is shared.
 any other invalid call (layer not served, expert id out of range, NaN) is
answered with INVALID_ARGUMENT and the connection kept, like the shared-memory path. Validation
and compute are the gRPC path's (`ExpertServicer.check_and_forward`).

Receivers poll without blocking for MOESPLIT_SHM_SPIN_US before they block, as on the
shared-memory path (wire.shm.recv_spin).

The shard serves a data connection with a loop in C (cpu_expert_service/kernels/moe_tcp.c, the GIL
released, the shared-memory loop's validation and compute: same answers byte for byte) and the GPU
side sends and receives with a client in C (gpu_service/experts/tcp_client.c); both move their
bytes through wire/tcp_io.c, plaintext or mutual TLS (OpenSSL, the handshake and the token hello in
C too, with the same files as `server_context` / `client_context`). MOESPLIT_TCP_LOOP=python, or an
unbuilt extension, serves with the Python loop (cpu_expert_service.tcp_transport._serve, Python's
ssl for TLS); a Python end talks to a C end.
"""
from __future__ import annotations

import os
import select
import socket
import ssl
import struct
import time

import numpy as np

from wire import shm


TCP_ENV = "MOESPLIT_TCP"  # "0" disables the cross-host data path (shard: refuse AttachTcp; client: never ask)
REQUEST = struct.Struct("<QiIIII")
RESPONSE = struct.Struct("<QIQQII")
TOKEN_BYTES = 32
ACK = b"\x01"
TOKEN_TTL_S = 30.0
HELLO_TIMEOUT_S = 5.0
FRAME_TIMEOUT_ENV = "MOESPLIT_TCP_FRAME_TIMEOUT_S"  # once a frame's first byte came, the rest must within it
DEFAULT_FRAME_TIMEOUT_S = 10.0
MAX_CONNECTIONS = 64  # data connections (in their hello or serving) a shard holds at once; more are closed


def frame_timeout_s() -> float:
    """Seconds a shard waits for the rest of a frame once its first byte arrived (MOESPLIT_TCP_FRAME_TIMEOUT_S)."""
    raw = os.environ.get(FRAME_TIMEOUT_ENV, "").strip()
    try:
        v = float(raw) if raw else DEFAULT_FRAME_TIMEOUT_S
    except ValueError:
        v = -1.0
    if not 0 < v <= 3600:
        raise ValueError(f"{FRAME_TIMEOUT_ENV}={raw!r}: expected seconds in (0, 3600], e.g. 10")
    return v
MAX_MESSAGE = 4096
OK, INVALID_ARGUMENT, INTERNAL = shm.OK, shm.INVALID_ARGUMENT, shm.INTERNAL
DTYPES, FLOAT_CODES = shm.DTYPES, shm.FLOAT_CODES


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
