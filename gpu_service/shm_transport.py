"""GPU side of the co-located shared-memory fast path (protocol: cpu_expert_service.shm_transport).

`FastPaths(mode, ...)` belongs to an `ExpertsClient`. At connect it offers every replica a shared
file + doorbell (`AttachShm`); a replica that accepts serves layer calls through shared memory,
one that refuses (another host, no shared directory, disabled, an old shard) stays on the gRPC
stream. Per call, `send()` returns None whenever the fast path cannot take it (not negotiated,
broken, more rows than a slot holds, every slot busy): the caller then uses gRPC. A fast path that
breaks mid-call (the doorbell socket fails) re-sends its pending calls over gRPC and is not used
again until the replica reconnects; a refused call (INVALID_ARGUMENT) fails like gRPC's; a call
past its deadline fails with DEADLINE_EXCEEDED (the client then fails over to another replica).

mode: "grpc" never negotiates; "auto" offers shared memory, then the cross-host TCP data path
(gpu_service.tcp_path; TLS when the client has TLS), and falls back silently (logged); "shm" / "tcp" insist on
that one: `connect()` fails if a replica refuses. numpy only, no torch.
"""
from __future__ import annotations

import itertools
import logging
import mmap
import os
import secrets
import select
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import grpc
import numpy as np

from cpu_expert_service import shm_transport as P
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

log = logging.getLogger("moesplit.shm")

MODES = ("auto", "grpc", "shm", "tcp")
DEFAULT_SLOTS = 4  # calls in flight per replica (micro-batch ping-pong needs 2)
DEFAULT_MAX_TOKENS = 512  # rows per fast-path call; larger calls (long prefill chunks) go over gRPC
WATCH_S = 0.05  # how often the reader checks deadlines while waiting


class FastResponse:
    """A layer call's answer over shared memory: output [T, H] float32 (a private copy)."""

    __slots__ = ("output", "compute_us", "server_us")

    def __init__(self, output: np.ndarray, compute_us: int, server_us: int):
        self.output, self.compute_us, self.server_us = output, compute_us, server_us

    def ByteSize(self) -> int:  # what the metrics observer counts as bytes received
        return int(self.output.nbytes)


class _Path:
    """What every fast path to one replica shares: its socket, pending calls with their deadlines,
    and failing over to gRPC when it breaks. There is no reader thread: answers are received by the
    thread that waits for a result (`pump`, called from `DrivenFuture.result`), which saves two
    thread wake-ups per call. Pending entries: seq -> (slot, future, deadline, T, fallback)."""

    kind = "?"

    def __init__(self, address: str, sock: socket.socket):
        self.address, self.sock = address, sock
        self.lock = threading.Lock()  # slots and pending
        self.rx = threading.Lock()  # held by the one thread receiving answers
        self.pending: dict[int, tuple] = {}
        self.seq = itertools.count(1)
        self.usable = True
        self.calls = 0
        self.spin_s = P.spin_seconds()

    def describe(self) -> str:
        return self.kind

    def pump(self) -> None:
        """Receive one answer (or wait up to WATCH_S) and resolve its future. If another thread is
        receiving, just yield to it briefly."""
        if not self.rx.acquire(blocking=False):
            time.sleep(0.0002)
            return
        try:
            done = self._receive() if self.usable else None
        finally:
            self.rx.release()
        if done is not None:  # callbacks run outside the receive lock
            fut, res, err = done
            if err is None:
                fut.set_result(res)
            else:
                fut.set_exception(err)

    def _receive(self) -> tuple | None:
        """One answer as (future, response, None) or (future, None, error); None if none came."""
        raise NotImplementedError

    def _send_failed(self, seq: int, why: str) -> None:
        with self.lock:
            self.pending.pop(seq, None)
        self._break(why)

    def expire(self, now: float) -> None:
        """A call past its deadline: the shard stopped answering. Fail them all; stop the fast path."""
        from gpu_service.experts_client import ShardError

        with self.lock:
            if not any(d <= now for _, _, d, _, _ in self.pending.values()):
                return
            self.usable = False
            failed = list(self.pending.values())
            self.pending.clear()
        self._close()
        log.warning("%s fast path to %s: no answer within the deadline; using gRPC", self.kind, self.address)
        err = ShardError(self.address, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within the deadline ({self.kind})")
        for _, fut, _, _, _ in failed:
            if not fut.done():
                fut.set_exception(err)

    def _break(self, why: str) -> None:
        """Transport failure: re-send every pending call over gRPC; never use this fast path again."""
        with self.lock:
            was = self.usable
            self.usable = False
            moved = list(self.pending.values())
            self.pending.clear()
        if was:
            log.warning("%s fast path to %s stopped (%s); using gRPC", self.kind, self.address, why)
        self._close()
        for _, fut, _, _, fallback in moved:
            _chain(fut, fallback, self.address)

    def _close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def close(self) -> None:
        from gpu_service.experts_client import ShardError

        with self.lock:
            self.usable = False
            failed = list(self.pending.values())
            self.pending.clear()
        self._close()
        for _, fut, _, _, _ in failed:
            if not fut.done():
                fut.set_exception(ShardError(self.address, grpc.StatusCode.CANCELLED, "experts client closed"))


class FastPath(_Path):
    """One replica's shared mapping (n_slots slots) and doorbell socket (same host)."""

    kind = "shm"

    def __init__(self, address: str, mm: mmap.mmap, lay: P.Layout, sock: socket.socket, wire_dtype: str):
        super().__init__(address, sock)
        self.mm, self.lay = mm, lay
        self.hc = P.code_of(wire_dtype)
        H, M, K = lay.hidden_size, lay.max_tokens, lay.max_k
        bases = [lay.slot_base(s) for s in range(lay.n_slots)]
        # zero-copy views of every slot, made once: hidden [M, H], ids / weights flat [M * K], output [M, H]
        self.hidden = [P.view(mm, b + lay.hidden_off, (M, H), P.DTYPES[self.hc]) for b in bases]
        self.ids = [P.view(mm, b + lay.ids_off, (M * K,), np.dtype(np.int64)) for b in bases]
        self.w = [P.view(mm, b + lay.w_off, (M * K,), np.dtype(np.float32)) for b in bases]
        self.out = [P.view(mm, b + lay.out_off, (M, H), P.DTYPES[self.hc]) for b in bases]
        self.bases = bases
        self.free = list(range(lay.n_slots))
        sock.setblocking(False)  # receivers poll (spin), then wait in select() up to WATCH_S

    def describe(self) -> str:
        return f"shared-memory fast path ({self.lay.n_slots} slots x {self.lay.max_tokens} tokens)"

    def send(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, timeout_s: float,
             fallback) -> Future | None:
        """Start one layer call (x [T, H] f32, ids [T, k] int64, w [T, k] f32); None: use gRPC.
        `fallback()` re-sends the call over gRPC (a Future of a LayerResponse) if the fast path breaks."""
        T, k = ids.shape
        if not self.usable or T > self.lay.max_tokens or k > self.lay.max_k:
            return None
        fut: Future = Future()
        with self.lock:
            if not self.free or not self.usable:
                return None
            slot = self.free.pop()
            seq = next(self.seq)
            self.pending[seq] = (slot, fut, time.monotonic() + timeout_s, T, fallback)
        self.hidden[slot][:T] = x  # [T, H], cast to the wire dtype like gRPC's encoding
        self.ids[slot][:T * k] = ids.reshape(-1)
        self.w[slot][:T * k] = w.reshape(-1)
        P.CALL.pack_into(self.mm, self.bases[slot], layer, T, k, self.hc, 4, 0, self.hc, 0, 0, 0)
        # the call as the shard sees it, stable while it is pending (a gRPC re-send encodes these)
        fut.inputs = (self.hidden[slot][:T], self.ids[slot][:T * k].reshape(T, k), self.w[slot][:T * k].reshape(T, k))
        try:
            self.sock.send(P.DOORBELL.pack(P.OP_FORWARD, slot, seq))
        except OSError as e:
            self._send_failed(seq, f"doorbell send failed: {e}")
            return None
        self.calls += 1
        return fut

    def _receive(self) -> tuple | None:
        try:
            msg = P.recv_spin(self.sock, self.spin_s)  # poll first: no wake-up when the answer is quick
            if msg is None:
                if not select.select([self.sock], [], [], WATCH_S)[0]:
                    self.expire(time.monotonic())
                    return None
                msg = self.sock.recv(P.DOORBELL.size)
        except (BlockingIOError, InterruptedError):
            return None  # a spurious wake-up: the caller pumps again
        except (OSError, ValueError) as e:  # ValueError: select() on a socket closed meanwhile
            msg, why = b"", f"doorbell failed: {e}"
        else:
            why = "the shard closed the fast path"
        if len(msg) != P.DOORBELL.size:
            self._break(why)
            return None
        status, slot, seq = P.DOORBELL.unpack(msg)
        with self.lock:
            entry = self.pending.pop(seq, None)
        if entry is None:
            return None
        _, fut, _, T, _ = entry
        base = self.bases[slot]
        compute_us, server_us, mlen = P.RESULT.unpack_from(self.mm, base + P.RESULT_OFFSET)
        if status == P.OK:
            done = (fut, FastResponse(self.out[slot][:T].astype(np.float32), compute_us, server_us), None)
        else:
            text = bytes(self.mm[base + P.MSG_OFFSET:base + P.MSG_OFFSET + mlen]).decode(errors="replace")
            done = (fut, None, shard_error(self.address, status, text))
        with self.lock:
            self.free.append(slot)
        return done

def shard_error(address: str, status: int, text: str):
    """A fast path's refusal (status: gRPC code INVALID_ARGUMENT or INTERNAL) as a ShardError."""
    from gpu_service.experts_client import ShardError

    code = grpc.StatusCode.INVALID_ARGUMENT if status == P.INVALID_ARGUMENT else grpc.StatusCode.INTERNAL
    return ShardError(address, code, text)


class DrivenFuture(Future):
    """A Future whose waiters receive the fast paths' answers themselves (no reader thread)."""

    def __init__(self, paths: "FastPaths"):
        super().__init__()
        self._paths = paths

    def _drive(self, timeout: float | None) -> float | None:
        end = None if timeout is None else time.monotonic() + timeout
        while not self.done():
            busy = [fp for fp, _ in list(self._paths.paths.values()) if fp is not None and fp.pending and fp.usable]
            if not busy:
                # nothing on a fast path now: the answer comes from gRPC, unless a failover (run from a gRPC
                # callback thread) puts the call on another replica's fast path meanwhile, which we must pump
                wait_s = WATCH_S if end is None else min(WATCH_S, max(0.0, end - time.monotonic()))
                futures_wait([self], timeout=wait_s)
                if end is not None and time.monotonic() >= end:
                    break
                continue
            if len(busy) > 1:  # receive from whichever shard answers first
                try:
                    ready = _select_spin([fp.sock for fp in busy], busy[0].spin_s)
                except (OSError, ValueError):  # a socket closed meanwhile
                    ready = [fp.sock for fp in busy]
                if not ready:
                    now = time.monotonic()
                    for fp in busy:
                        fp.expire(now)
                busy = [fp for fp in busy if fp.sock in ready]
            for fp in busy:
                fp.pump()
                if self.done():
                    break
            if end is not None and time.monotonic() >= end:
                break
        return None if end is None else max(0.0, end - time.monotonic())

    def result(self, timeout: float | None = None):
        return super().result(self._drive(timeout))

    def exception(self, timeout: float | None = None):
        return super().exception(self._drive(timeout))


def _select_spin(socks: list, spin_s: float) -> list:
    """The doorbells with an answer waiting: polled for up to spin_s (yielding the CPU between
    polls, see cpu_expert_service.shm_transport), then waited for up to WATCH_S."""
    end = time.perf_counter() + spin_s
    while True:
        ready = select.select(socks, [], [], 0)[0]
        if ready or time.perf_counter() >= end:
            break
        os.sched_yield()
    return ready or select.select(socks, [], [], WATCH_S)[0]


def _chain(fut: Future, fallback, address: str) -> None:
    from gpu_service.experts_client import ShardError

    try:
        g = fallback()
    except Exception as e:  # noqa: BLE001
        fut.set_exception(ShardError(address, grpc.StatusCode.UNAVAILABLE, f"gRPC fallback failed: {e!r}"))
        return

    def done(g: Future) -> None:
        e = g.exception()
        if e is None:
            fut.set_result(g.result())
        else:
            fut.set_exception(e)

    g.add_done_callback(done)


def negotiate(channel: grpc.Channel, address: str, hidden_size: int, max_k: int, shm_dir: str, wire_dtype: str,
              max_tokens: int = DEFAULT_MAX_TOKENS, n_slots: int = DEFAULT_SLOTS,
              timeout_s: float = 10.0) -> tuple[FastPath | None, str]:
    """Offer `address` a shared file + doorbell in shm_dir. (FastPath, "") or (None, why not)."""
    if not P.enabled():
        return None, f"disabled ({P.SHM_ENV}=0)"
    if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK):
        return None, f"shared directory {shm_dir!r} missing or not writable here"
    lay = P.Layout(n_slots, hidden_size, max_tokens, max_k)
    path = os.path.join(os.path.abspath(shm_dir), f"moesplit-{os.getpid()}-{secrets.token_hex(6)}")
    sock_path = path + ".sock"
    if len(sock_path.encode()) > 100:
        return None, f"socket path {sock_path!r} too long for a Unix socket"
    token = secrets.token_bytes(P.TOKEN_BYTES)
    listener = mm = None
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | getattr(os, "O_CLOEXEC", 0), 0o600)
        try:
            os.ftruncate(fd, lay.file_bytes)  # sparse: pages exist once written
            mm = mmap.mmap(fd, lay.file_bytes)
        finally:
            os.close(fd)
        header = lay.pack_header(token)
        mm[:len(header)] = header
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(sock_path)
        listener.listen(1)
        listener.settimeout(timeout_s)
        stub = experts_pb2_grpc.ExpertServiceStub(channel)
        try:
            resp = stub.AttachShm(experts_pb2.AttachShmRequest(path=path, token=token, socket_path=sock_path),
                                  timeout=timeout_s)
        except grpc.RpcError as e:
            return None, f"AttachShm failed: {e.code().name}: {e.details()}"
        if not resp.accepted:
            return None, f"shard refused: {resp.reason}"
        conn, _ = listener.accept()
        fp = FastPath(address, mm, lay, conn, wire_dtype)
        mm = None  # owned by the fast path now
        return fp, ""
    except OSError as e:
        return None, f"cannot set up shared memory in {shm_dir}: {e}"
    finally:
        if listener is not None:
            listener.close()
        for p in (path, sock_path):  # both sides hold what they need; leave nothing behind
            try:
                os.unlink(p)
            except OSError:
                pass
        if mm is not None:
            mm.close()


class FastPaths:
    """The fast paths of one ExpertsClient, by replica address."""

    def __init__(self, mode: str = "auto", shm_dir: str | None = None, wire_dtype: str = "float32",
                 max_tokens: int = DEFAULT_MAX_TOKENS, n_slots: int = DEFAULT_SLOTS, tls=None,
                 tls_server_name: str | None = None, tcp_max_tokens: int = DEFAULT_MAX_TOKENS):
        if mode not in MODES:
            raise ValueError(f"transport {mode!r}: expected one of {', '.join(MODES)}")
        self.mode = mode
        self.tls, self.tls_server_name = tls, tls_server_name  # TLSFiles: the TCP data path is TLS too
        self.tcp_max_tokens = int(tcp_max_tokens)  # rows per TCP call (the shard's --max-tokens bounds it too)
        self.shm_dir = shm_dir or P.default_dir()
        self.wire_dtype = wire_dtype
        self.max_tokens, self.n_slots = int(max_tokens), int(n_slots)
        self.paths: dict[str, tuple[FastPath | None, object]] = {}  # address -> (fast path, stream it went with)
        self.reasons: dict[str, str] = {}  # address -> why it is on gRPC
        self._renegotiating: set[str] = set()
        self._lock = threading.Lock()

    def _negotiate(self, r, cfg) -> tuple[_Path | None, str]:
        """Shared memory (same host), else the TCP data path (any host, not with TLS), else gRPC."""
        why = []
        if self.mode in ("auto", "shm"):
            fp, w = negotiate(r.channel, r.address, cfg.hidden_size, cfg.num_experts_per_tok, self.shm_dir,
                              self.wire_dtype, self.max_tokens, self.n_slots)
            if fp is not None:
                return fp, ""
            why.append(f"shm: {w}")
        if self.mode in ("auto", "tcp"):
            from gpu_service.tcp_path import negotiate_tcp

            tp, w = negotiate_tcp(r.channel, r.address, cfg.hidden_size, self.wire_dtype, self.tcp_max_tokens,
                                  self.tls, self.tls_server_name)
            if tp is not None:
                return tp, "; ".join(why)  # (auto: why shared memory was refused)
            why.append(f"tcp: {w}")
        return None, "; ".join(why)

    def attach_all(self, replicas, cfg) -> None:
        """At connect: offer every healthy replica a fast path (in parallel)."""
        if self.mode == "grpc":
            return
        live = [r for r in replicas if r.healthy and r.channel is not None]
        results: dict[str, tuple] = {}
        threads = [threading.Thread(target=lambda r=r: results.__setitem__(r.address, self._negotiate(r, cfg)))
                   for r in live]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for r in live:
            fp, why = results[r.address]
            self._set(r, fp, why)
        refused = {a: w for a, w in self.reasons.items() if self.transport_of(a) != self.mode}
        if self.mode in ("shm", "tcp") and refused:
            self.close()
            from gpu_service.experts_client import ExpertsClientError

            what = "the shared-memory fast path" if self.mode == "shm" else "the TCP data path"
            raise ExpertsClientError(f"transport {self.mode!r}: {what} was refused by "
                                     + "; ".join(f"{a}: {w}" for a, w in refused.items()))

    def _set(self, r, fp: _Path | None, why: str) -> None:
        with self._lock:
            old = self.paths.get(r.address)
            self.paths[r.address] = (fp, r.stream)
            self.reasons[r.address] = why
        if old is not None and old[0] is not None and old[0] is not fp:
            old[0].close()
        if fp is not None:
            log.info("expert shard %s: %s", r.address, fp.describe())
        else:
            log.info("expert shard %s: gRPC transport (%s)", r.address, why)

    def transport_of(self, address: str) -> str:
        fp = self.paths.get(address, (None, None))[0]
        return fp.kind if fp is not None and fp.usable else "grpc"

    def send(self, r, cfg, layer: int, x, ids, w, timeout_s: float, fallback) -> Future | None:
        """A fast-path call to replica r, or None (use the gRPC stream)."""
        entry = self.paths.get(r.address)
        if entry is not None and entry[0] is not None and entry[0].usable and entry[1] is r.stream:
            return entry[0].send(layer, x, ids, w, timeout_s, fallback)
        if self.mode != "grpc" and (entry is None or entry[1] is not r.stream):
            self._renegotiate(r, cfg)  # the replica reconnected since: offer it a fresh fast path
        return None

    def _renegotiate(self, r, cfg) -> None:
        with self._lock:
            if r.address in self._renegotiating:
                return
            self._renegotiating.add(r.address)

        def run():
            try:
                if r.channel is not None:
                    fp, why = self._negotiate(r, cfg)
                    self._set(r, fp, why)
            finally:
                with self._lock:
                    self._renegotiating.discard(r.address)

        threading.Thread(target=run, name=f"shm-negotiate-{r.address}", daemon=True).start()

    def future(self) -> Future:
        """A future for a layer call's combined result: waiting on it drives the fast paths."""
        return DrivenFuture(self) if self.mode != "grpc" else Future()

    def close(self) -> None:
        with self._lock:
            paths, self.paths = self.paths, {}
        for fp, _ in paths.values():
            if fp is not None:
                fp.close()
