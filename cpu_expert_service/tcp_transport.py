"""The shard side of the cross-host TCP data path: the data port (`DataServer`) and the per-connection loop.

Frames, the token hello and the TLS contexts are in `wire.tcp` (shared with the GPU side); see its
docstring for the protocol.

A connection is served only after it presents a one-time token from `AttachTcp` (a gRPC call,
itself refused without the shard's shared token when it has one). Connections still in their
hello do not hold serving slots: at most MAX_PENDING of them wait at once, and one more closes
the oldest, so idle or silent sockets cannot keep the GPU service's connection out.
"""
from __future__ import annotations

import collections
import logging
import os
import secrets
import socket
import sys
import threading
import time

import numpy as np

from wire.tcp import (
    ACK, DTYPES, FLOAT_CODES, frame_timeout_s, HELLO_TIMEOUT_S, INTERNAL, INVALID_ARGUMENT, MAX_CONNECTIONS,
    MAX_MESSAGE, OK, recv_exact, REQUEST, RESPONSE, send_parts, server_context, TOKEN_BYTES, TOKEN_TTL_S,
)
from wire.ratelog import RateLimitedLog
from wire.shm import spin_seconds

log = logging.getLogger("moesplit.tcp")
client_errors = RateLimitedLog(log)
MAX_PENDING = 16  # connections in their hello at once; one more closes the oldest


class DataServer:
    """The shard's data port: accepts connections that present a token from `offer()` and serves
    each on its own thread; at most `max_connections` served at once (more are closed after their
    hello) and MAX_PENDING in their hello (the oldest closed beyond)."""

    def __init__(self, servicer, host: str, port: int, tls=None, max_connections: int = MAX_CONNECTIONS):
        self.servicer = servicer
        self.ctx = server_context(tls) if tls is not None else None  # mTLS data connections
        self.sock = socket.create_server((host, port), reuse_port=False)
        self.port = self.sock.getsockname()[1]
        self.tokens: dict[bytes, float] = {}  # token -> expiry (monotonic)
        self.lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(max_connections)
        self.max_connections = max_connections
        self.pending: collections.OrderedDict[int, socket.socket] = collections.OrderedDict()  # in their hello
        self.evicted = 0
        self.frame_timeout_s = frame_timeout_s()
        self.loop = loop_kind()  # a bad MOESPLIT_TCP_LOOP stops the shard at start, naming it
        # the C loop's ends (hello, TLS handshake and frames in C: kernels/moe_tcp.c over wire/tcp_io.c), or why not
        self.c_why, self.c_tls = _c_ends(self.loop, tls)
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
            with self.lock:
                self.pending[id(conn)] = conn
                oldest = self.pending.popitem(last=False)[1] if len(self.pending) > MAX_PENDING else None
            if oldest is not None:  # its recv returns at once: that thread closes it
                self.evicted += 1
                client_errors.warning("evict", "tcp data path: %d connections in their hello; closed the oldest",
                                      MAX_PENDING)
                try:
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threading.Thread(target=self._hello_and_serve, args=(conn, peer), name=f"tcp-data-{peer[0]}:{peer[1]}",
                             daemon=True).start()

    def _hello(self, conn: socket.socket, peer):
        """The connection's handshake (TLS: the client's certificate required) and token: (conn, link)
        past it, link the C end (None: the Python loop serves, conn TLS-wrapped when TLS); None when
        refused (closed, logged)."""
        link = None
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            if not self.c_why:  # the C loop's end: the handshake and the token through it
                from cpu_expert_service.kernels import _moe

                link = _moe.Link(conn.fileno())
                if self.c_tls is not None:
                    link.start_tls(self.c_tls, "", HELLO_TIMEOUT_S)
                tok = link.recv(TOKEN_BYTES, HELLO_TIMEOUT_S)
                ok = len(tok) == TOKEN_BYTES
            else:
                if self.ctx is not None:  # the handshake (client certificate required) before anything else
                    conn = self.ctx.wrap_socket(conn, server_side=True)
                tok = bytearray(TOKEN_BYTES)
                ok = recv_exact(conn, memoryview(tok))
            with self.lock:
                expiry = self.tokens.pop(bytes(tok), 0.0) if ok else 0.0
            if expiry <= time.monotonic():
                client_errors.warning(("token", peer[0]), "tcp data path: %s:%s presented no valid token; closed",
                                      *peer[:2])
                raise _Refused()
            if link is None:
                conn.settimeout(None)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return conn, link
        except (OSError, _Refused) as e:  # ssl.SSLError / ConnectionError: no or a wrong client certificate
            if not isinstance(e, _Refused):
                client_errors.warning(("hello", peer[0]), "tcp data path: %s:%s: %s; closed", peer[0], peer[1], e)
            _close(conn, link)
            return None

    def _hello_and_serve(self, conn: socket.socket, peer) -> None:
        """One accepted connection: its hello, a serving slot, the ACK, then its loop until it ends."""
        key = id(conn)
        got = self._hello(conn, peer)
        with self.lock:
            self.pending.pop(key, None)
        if got is None:
            return
        conn, link = got
        if not self.slots.acquire(blocking=False):
            client_errors.warning("full", "tcp data path: %s:%s closed: %d data connections open already",
                                  peer[0], peer[1], self.max_connections)
            _close(conn, link)
            return
        try:
            link.send(ACK, HELLO_TIMEOUT_S) if link is not None else conn.sendall(ACK)
        except OSError:
            self.slots.release()
            _close(conn, link)
            return
        try:
            self._log_and_serve(conn, peer, link)
        finally:
            self.slots.release()

    def _log_and_serve(self, conn: socket.socket, peer, link) -> None:
        """Serve one connection: the C loop (moe_tcp.c; plaintext or TLS, over link), or the Python loop
        where MOESPLIT_TCP_LOOP=python or the kernels extension is not built."""
        loop, why = None, self.c_why
        if link is not None:
            try:
                loop = _c_loop(self.servicer, conn.fileno())
            except Exception as e:  # noqa: BLE001 - shm_transport.Refused or a bad backend: say so
                why = f"the Python loop ({e})"
                if link.tls:  # the session's keys are in C: no Python loop can take it over
                    log.error("shard %s: tcp data path from %s:%s: the C loop cannot serve (%s); closed (set "
                              "%s=python to serve TLS data connections in Python)", self.servicer.shard_id,
                              peer[0], peer[1], e, LOOP_ENV)
                    _close(conn, link)
                    return
                link.close()
                conn.settimeout(None)
        log.info("shard %s: tcp data path from %s:%s, %s", self.servicer.shard_id, peer[0], peer[1],
                 why or (f"the C loop, {link.version}" if link.tls else "the C loop"))
        if loop is None:
            _serve(self.servicer, conn, self.frame_timeout_s)
        else:
            _serve_c(self.servicer, conn, link, self.frame_timeout_s, *loop)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


LOOP_ENV = "MOESPLIT_TCP_LOOP"  # "c" (default): the C loop (plaintext and TLS); "python": the Python loop


class _Refused(Exception):
    """A data connection's hello refused (logged already)."""


def _close(conn: socket.socket, link) -> None:
    """A data connection's ends closed: the C one (its own descriptor) and the socket."""
    if link is not None:
        link.close()
    conn.close()


def _c_ends(loop: str, tls) -> tuple:
    """("", the C TLS context or None) when the C loop serves data connections; (why not, None) else.
    A certificate file the C context cannot use stops the shard at start, naming it."""
    if loop == "python":
        return f"the Python loop ({LOOP_ENV}=python)", None
    try:
        from cpu_expert_service.kernels import _moe
    except ImportError as e:
        return f"the Python loop (the kernels extension is not built: {e}; build it with `make build`)", None
    return "", (_moe.TlsContext(True, tls.cert, tls.key, tls.ca) if tls is not None else None)


def loop_kind() -> str:
    """Which loop serves a data connection: "c" or "python" (MOESPLIT_TCP_LOOP)."""
    raw = os.environ.get(LOOP_ENV, "c").strip().lower() or "c"
    if raw not in ("c", "python"):
        raise ValueError(f"{LOOP_ENV}={raw!r}: expected c or python")
    return raw


def _c_loop(servicer, fd: int) -> tuple:
    """(ShmServe, request buffer, output buffer, metrics) for one connection's C loop. The buffers hold the
    largest frame this shard takes (--max-tokens rows of top-k) and commit memory only as bytes land."""
    from cpu_expert_service.shm_transport import native_loop

    cfg = servicer.cfg
    T, H, K = servicer.max_tokens, cfg.hidden_size, cfg.num_experts_per_tok
    req = np.empty(T * (H * 4 + K * 12), np.uint8)  # hidden [T, H] (f32 at most), ids int64 + weights f32 [T, K]
    out = np.empty(T * H * 4, np.uint8)  # the answer [T, H] in the output dtype
    return (*native_loop(servicer, req.ctypes.data, (1, T, K, 0, req.nbytes, 0, 0, 0, 0), fd), req, out)


def _serve_c(servicer, conn: socket.socket, link, frame_timeout_s: float, loop, metrics, req, out) -> None:
    """One connection served by the C loop (kernels/moe_tcp.c over link, the GIL released): it answers every call
    itself, refused ones included; returns here after a call answered INTERNAL (logged, then it serves
    on), a bad frame header (answered, then closed), a stalled frame or the client going."""
    from cpu_expert_service.kernels import _moe

    K = servicer.cfg.num_experts_per_tok
    try:
        while (rc := loop.serve_tcp(link, req.ctypes.data, req.nbytes, out.ctypes.data, K, frame_timeout_s)) \
                == _moe.SHM_INTERNAL:
            _, seq, msg = loop.last
            e = loop.error  # the backend's exception (None: the kernels failed)
            log.error("shard %s: tcp seq %d failed: %s", servicer.shard_id, seq, msg,
                      exc_info=(type(e), e, e.__traceback__) if e is not None else None)
        if rc in (_moe.TCP_BAD_FRAME, _moe.TCP_STALLED):
            client_errors.warning(rc, "shard %s: tcp data path: %s; closed", servicer.shard_id,
                                  loop.last[2] if rc == _moe.TCP_BAD_FRAME else
                                  f"the rest of a frame did not come within {frame_timeout_s}s")
    finally:
        if metrics is not None:
            metrics.detach_native(loop)
        _close(conn, link)


def _serve(servicer, conn: socket.socket, frame_timeout_s: float = 10.0) -> None:
    """One client's connection: frame in, validated and computed, frame out. Between frames the
    connection may idle; once a frame's first byte came, the rest must within frame_timeout_s."""
    from cpu_expert_service.metrics import mark_arrival
    RequestError = sys.modules[type(servicer).__module__].RequestError

    cfg = servicer.cfg
    H, K = cfg.hidden_size, cfg.num_experts_per_tok
    hdr = bytearray(REQUEST.size)
    hv = memoryview(hdr)
    payload = np.empty(0, np.uint8)  # np.empty: pages are committed as bytes arrive, not by the header
    spin_s = spin_seconds()
    try:
        while True:
            if not recv_exact(conn, hv[:1], spin_s):
                return
            conn.settimeout(frame_timeout_s)  # the rest of the frame under a deadline (socket.timeout: closed)
            if not recv_exact(conn, hv[1:]):
                return
            t_start = time.perf_counter()
            mark_arrival(t_start)
            seq, layer, T, k, hc, oc = REQUEST.unpack(hdr)
            if T > servicer.max_tokens or not 1 <= k <= K or hc not in FLOAT_CODES or oc not in FLOAT_CODES:
                msg = (f"shard {servicer.shard_id}: seq {seq}: bad frame header (T {T} of at most {servicer.max_tokens}, "
                       f"k {k} of 1-{K}, dtype codes {hc}/{oc}); closing the data connection").encode()
                send_parts(conn, [RESPONSE.pack(seq, INVALID_ARGUMENT, 0, 0, len(msg), T), msg])
                return
            hb = T * H * DTYPES[hc].itemsize
            n = hb + T * k * 12
            if len(payload) < n:
                payload = np.empty(max(n, min(2 * len(payload), servicer.max_tokens * H * 4 + servicer.max_tokens * K * 12)),
                                   np.uint8)
            pv = memoryview(payload)
            if not recv_exact(conn, pv[:n]):
                return
            conn.settimeout(None)
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
                client_errors.warning(type(e).__name__, "shard %s: tcp seq %d failed: %s: %s", servicer.shard_id,
                                      seq, type(e).__name__, e)
                status = INTERNAL
                body = f"shard {servicer.shard_id}: seq {seq}: {type(e).__name__}: {e}".encode()[:MAX_MESSAGE]
            server_us = int((time.perf_counter() - t_start) * 1e6)
            send_parts(conn, [RESPONSE.pack(seq, status, compute_us, server_us, 0 if status == OK else len(body), T),
                              body])  # body: the [T, H] answer in the output dtype, or the message
    except OSError:
        pass  # client went away, or a frame stalled past its deadline (socket.timeout)
    finally:
        conn.close()
