"""GPU side of the cross-host TCP data path (protocol: cpu_expert_service.tcp_transport).

`negotiate_tcp` asks a replica for its data port (`AttachTcp`), connects to the replica's host at
that port (with TLS: a handshake with the client's certificate, the shard's checked against the CA
and its name), presents the one-time token and returns a `TcpPath`: layer calls as binary frames on
that connection, answers received by the thread that waits for them (shm_transport.DrivenFuture),
with the same deadline, break-and-fall-back-to-gRPC and refusal semantics as the shared-memory
fast path (shm_transport._Path). numpy only, no torch.
"""
from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from concurrent.futures import Future

import grpc
import numpy as np

from gpu_service.experts.path import WATCH_S, FastResponse, _Path, shard_error
from wire import shm as P
from wire import tcp as T
from wire.channel import host_of
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

try:
    from gpu_service.experts import _tcp_client as _C
except ImportError:  # not built: plaintext connections use the Python client, and describe() says so
    _C = None
NOT_BUILT = "the C client gpu_service.experts._tcp_client is not built (make build)"
FRAME_MIN_S = 1.0  # an answer that began gets at least this long for its rest


class TcpPath(_Path):
    """One replica's data connection. Calls are answered in order; several may be in flight."""

    kind = "tcp"

    def __init__(self, address: str, sock: socket.socket, wire_dtype: str, hidden_size: int, max_tokens: int,
                 link=None):
        super().__init__(address, sock)
        self.hc = P.code_of(wire_dtype)
        self.wire = P.DTYPES[self.hc]
        self.H, self.max_tokens = hidden_size, max_tokens
        self.tx = threading.Lock()  # one frame at a time on the connection
        self.head = bytearray(T.RESPONSE.size)
        self.body = bytearray(0)
        # frames sent and received by the C client (the GIL released) over link (TLS there: negotiate_tcp) or a
        # plaintext socket's; Python's code only where the C client is not built (TLS: Python's ssl, sock wrapped)
        conn = link if link is not None else (None if isinstance(sock, ssl.SSLSocket) or _C is None else sock.fileno())
        self.c = None if conn is None else _C.Client(conn, hidden_size, self.hc, max_tokens)
        self.spin_ns = int(self.spin_s * 1e9)

    def describe(self) -> str:
        host, port = self.sock.getpeername()[:2]
        tls = isinstance(self.sock, ssl.SSLSocket) or (self.c is not None and self.c.link.tls)
        how = ("C client" if self.c is not None else "Python client" if _C is not None else
               f"Python client: {NOT_BUILT}") + (", TLS" if tls else "")
        return f"TCP data path ({host}:{port}, {how})"

    def send(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, timeout_s: float,
             fallback, hold=None):
        """Start one layer call (x [T, H], ids [T, k] int64, w [T, k] f32): a Future, or `hold`
        (call.Hold) resolved in its place; None: use gRPC. `fallback()` re-sends it over gRPC (a
        Future of a LayerResponse) if the connection breaks (None: `hold` gets Moved)."""
        n, k = ids.shape
        if not self.usable or n > self.max_tokens:
            return None
        xw = np.ascontiguousarray(x, dtype=self.wire)  # [T, H], cast like gRPC's encoding
        iw = np.ascontiguousarray(ids, dtype=np.int64)
        ww = np.ascontiguousarray(w, dtype=np.float32)
        fut = Future() if hold is None else hold
        # the call as sent, for a gRPC re-send (own copies: the caller may reuse its arrays)
        fut.inputs = (xw.copy() if xw is x else xw, iw.copy() if iw is ids else iw, ww.copy() if ww is w else ww)
        with self.tx:
            with self.lock:
                if not self.usable:
                    return None
                seq = next(self.seq)
                self.pending[seq] = (None, fut, time.monotonic() + timeout_s, n, fallback)
            try:
                if self.c is not None:
                    self.c.send(seq, layer, xw, iw, ww, max(1, int(timeout_s * 1000)))
                else:
                    T.send_parts(self.sock, [T.REQUEST.pack(seq, layer, n, k, self.hc, self.hc), xw, iw, ww])
            except OSError as e:
                self._send_failed(seq, f"send failed: {e}")
                return None
        self.calls += 1
        return fut

    def _receive(self) -> tuple | None:
        if self.c is not None:
            return self._receive_c()
        try:
            if not self._wait_readable():
                self.expire(time.monotonic())
                return None
            ok = T.recv_exact(self.sock, memoryview(self.head))
            if ok:
                seq, status, compute_us, server_us, mlen, n = T.RESPONSE.unpack(self.head)
                with self.lock:
                    entry = self.pending.get(seq)
                bad = _bad_response(entry, status, mlen, n, self.max_tokens)
                if bad:  # the header is not an answer to our request: the body length cannot be trusted
                    self._break(f"the shard sent a bad response header ({bad})")
                    return None
                size = n * self.H * self.wire.itemsize if status == P.OK else mlen
                if len(self.body) < size:
                    self.body = bytearray(max(size, 2 * len(self.body)))
                ok = T.recv_exact(self.sock, memoryview(self.body)[:size])
        except (OSError, ValueError) as e:
            self._break(f"data connection failed: {e}")
            return None
        if not ok:
            self._break("the shard closed the data connection")
            return None
        with self.lock:
            entry = self.pending.pop(seq, None)
        if entry is None:
            return None
        fut = entry[1]
        if status != P.OK:
            return fut, None, shard_error(self.address, status, bytes(self.body[:mlen]).decode(errors="replace"))
        out = np.frombuffer(self.body, self.wire, n * self.H).reshape(n, self.H).astype(np.float32)  # [T, H]
        return fut, FastResponse(out, compute_us, server_us), None

    @property
    def direct(self) -> bool:
        """Whether calls may be sent from raw addresses (send_at / finish: the C client's)."""
        return self.c is not None

    def send_at(self, layer: int, T: int, k: int, h: int, h_wire: bool, ids: int, w: int, timeout_s: float,
                hold) -> int | None:
        """A call from raw addresses (gpu_service.experts.handoff's direct calls, which checked the
        tensors behind them: h [T, H] float32 or the wire dtype, ids [T, k] int64, w [T, k] float32,
        C-contiguous), `hold` resolved in its place: 0, or None (not taken). The frame's contents are
        kept as hold.inputs for a re-send (no shared slot holds them)."""
        if self.c is None or not self.usable or T > self.max_tokens:
            return None
        x, i, ww = self.c.inputs(h, h_wire, ids, w, T, k)
        hold.inputs = (x.view(self.wire), i, ww)
        with self.tx:
            with self.lock:
                if not self.usable:
                    return None
                hold.seq = seq = next(self.seq)
                self.pending[seq] = (None, hold, time.monotonic() + timeout_s, T, None)
            try:
                self.c.send(seq, layer, *hold.inputs, max(1, int(timeout_s * 1000)))
            except OSError as e:
                self._send_failed(seq, f"send failed: {e}")
                return None
        self.calls += 1
        return 0

    def inputs(self, slot: int, T: int, k: int) -> tuple:
        """(never needed: send_at keeps each call's inputs in its hold)"""
        raise RuntimeError("TcpPath keeps a direct call's inputs in its hold")

    def finish(self, hold, T: int, out: int, mode: int) -> bool:
        """Wait for a send_at call's answer, receiving any other call's on the way: True when its T rows
        are in out (an address; mode: _shm_client's OUT_*), False when it failed (hold.err)."""
        while not hold.fin:
            if not self.rx.acquire(blocking=False):  # another thread receives: it resolves ours too
                time.sleep(0.0001)
                continue
            try:
                entry = self.pending.get(hold.seq) if self.usable and not hold.fin else None
                head = self._wait_c() if entry is not None else None
                if head and head[0] == hold.seq and head[1] == P.OK and head[5] == T:
                    self.c.read_into(T, out, mode)
                    with self.lock:
                        self.pending.pop(hold.seq, None)
                    return True
                done = self._settle_c(head) if head else None
            finally:
                self.rx.release()
            if done is not None:
                fut, res, err = done
                fut.set_result(res) if err is None else fut.set_exception(err)
            elif entry is None:
                time.sleep(0)
        return False

    def _wait_c(self) -> tuple | None:
        """One answer's header through the C client by the oldest pending call's deadline (the receive
        lock held); None: none came (expired, broken, or a signal)."""
        with self.lock:
            if not self.pending:
                return None
            deadline = next(iter(self.pending.values()))[2]  # the oldest call's: deadlines grow with seq
        frame_s = max(FRAME_MIN_S, deadline - time.monotonic())  # an answer that began: the rest of the deadline
        try:
            head = self.c.wait(self.spin_ns, int(deadline * 1e9), int(frame_s * 1e9))
        except OSError as e:  # closed, failed, a stalled frame or a header no request can have
            self._break(f"data connection failed: {e}")
            return None
        if head is None:  # nothing by the deadline (or a signal, handled)
            self.expire(time.monotonic())
        return head

    def _receive_c(self) -> tuple | None:
        """_receive through the C client: one answer by the oldest pending call's deadline."""
        head = self._wait_c()
        return self._settle_c(head) if head is not None else None

    def _settle_c(self, head: tuple) -> tuple | None:
        """The pending call an answer (its header; the body in the C client) belongs to: (future,
        response, None) or (future, None, error); None when it is no pending call's."""
        seq, status, compute_us, server_us, mlen, n = head
        with self.lock:
            entry = self.pending.get(seq)
        if entry is not None and status == P.OK and n != entry[3]:  # not an answer to our request
            self._break(f"the shard sent a bad response header ({n} rows for a call of {entry[3]})")
            return None
        with self.lock:
            entry = self.pending.pop(seq, None)
        if entry is None:
            return None  # a late answer to a call already failed or re-sent
        fut = entry[1]
        if status != P.OK:
            return fut, None, shard_error(self.address, status, self.c.message(mlen).decode(errors="replace"))
        return fut, FastResponse(self.c.read(n), compute_us, server_us), None

    def _close(self) -> None:
        """Shut the connection down first: the C client holds its own descriptor of it, which would
        keep it open (the shard never seeing the end) until that object goes, and a wait in C wakes."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        super()._close()

    def _wait_readable(self) -> bool:
        """Poll the connection for up to spin_s (yielding the CPU), then wait up to WATCH_S."""
        sock, end = self.sock, time.perf_counter() + self.spin_s
        while True:
            if T.readable(sock, 0):
                return True
            if time.perf_counter() >= end:
                return T.readable(sock, WATCH_S)
            os.sched_yield()


def _bad_response(entry, status: int, mlen: int, n: int, max_tokens: int) -> str | None:
    """Why a response header cannot answer the pending call `entry` (None when it can). A seq no
    longer pending (expired, re-sent over gRPC) is read and dropped if its size is plausible."""
    if status not in (P.OK, P.INVALID_ARGUMENT, P.INTERNAL):
        return f"status {status}"
    want = entry[3] if entry is not None else None
    if status == P.OK and (n != want if want is not None else n > max_tokens):
        return f"{n} rows for a call of {want if want is not None else f'at most {max_tokens}'}"
    if status != P.OK and mlen > T.MAX_MESSAGE:
        return f"a {mlen}-byte message"
    return None


def negotiate_tcp(channel: grpc.Channel, address: str, hidden_size: int, wire_dtype: str, max_tokens: int,
                  tls=None, server_name: str | None = None, timeout_s: float = 10.0) -> tuple[TcpPath | None, str]:
    """Ask `address` for its TCP data path (TLS with `tls`, a TLSFiles, checking the shard's
    certificate for `server_name` or the address's host). (TcpPath, "") or (None, why not)."""
    if not T.enabled():
        return None, f"disabled ({T.TCP_ENV}=0)"
    stub = experts_pb2_grpc.ExpertServiceStub(channel)
    try:
        resp = stub.AttachTcp(experts_pb2.AttachTcpRequest(), timeout=timeout_s)
    except grpc.RpcError as e:
        return None, f"AttachTcp failed: {e.code().name}: {e.details()}"
    if not resp.accepted:
        return None, f"shard refused: {resp.reason}"
    host = host_of(address)
    try:
        sock = socket.create_connection((host, resp.port), timeout=timeout_s)
    except OSError as e:
        return None, f"cannot connect to the data port {host}:{resp.port}: {e}"
    link = None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if tls is not None and _C is not None:  # the handshake, the token and the frames through the C client
            link = _C.Link(sock.fileno())
            link.start_tls(_C.TlsContext(False, tls.cert, tls.key, tls.ca), server_name or host, timeout_s)
            link.send(resp.token, timeout_s)
            ack = link.recv(1, timeout_s)
        else:
            if tls is not None:
                sock = T.client_context(tls).wrap_socket(sock, server_hostname=server_name or host)
            sock.sendall(resp.token)
            ack = sock.recv(1)
        if ack != T.ACK:
            raise OSError("the shard did not accept the token")
        if link is None:  # (a TLS link's socket stays non-blocking: OpenSSL waits in poll(), not in read())
            sock.settimeout(None)  # blocking: receivers poll with select() first (TcpPath._wait_readable)
    except (OSError, ValueError) as e:  # ValueError: a certificate file the C context cannot use
        if link is not None:
            link.close()
        sock.close()
        return None, f"data port {host}:{resp.port}: {e}"
    tp = TcpPath(address, sock, wire_dtype, hidden_size, max_tokens, link)
    tp.instance = resp.instance_id
    return tp, ""
