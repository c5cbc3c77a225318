"""GPU side of the co-located shared-memory fast path (wire format: wire.shm; shard side:
cpu_expert_service.shm_transport).

A replica on the same host that accepts `AttachShm` gets a sealed memfd of slots, passed over a
doorbell socket (`negotiate`); `FastPath` sends layer calls through it with the C client
(`_shm_client`, built from shm_client.c by setup.py): the only client of this protocol.
"""
from __future__ import annotations

import logging
import mmap
import os
import secrets
import socket
import time
from concurrent.futures import Future

import grpc
import numpy as np

from gpu_service.experts.path import _Path, DEFAULT_MAX_TOKENS, DEFAULT_SLOTS, FastResponse, shard_error
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc
from wire import shm as P

try:
    from gpu_service.experts import _shm_client as _C
except ImportError:  # not built: every replica stays on TCP / gRPC, and transport="shm" says why
    _C = None

log = logging.getLogger("moesplit.shm")
_BUSY = object()  # FastPath.finish: the call is being resolved by the thread that received its answer
NOT_BUILT = ("the C shared-memory client gpu_service.experts._shm_client is not built: "
             "run `make build` (python setup.py build_ext --inplace)")


class FastPath(_Path):
    """One replica's shared mapping (n_slots slots) and doorbell socket (same host). Slots, pending
    calls, deadlines and breaks are kept here; every call is written and its doorbell rung, and
    every answer received, by the C client (`_shm_client.Client`: the GIL released while waiting)."""

    kind = "shm"
    direct = True

    def __init__(self, address: str, mm: mmap.mmap, lay: P.Layout, sock: socket.socket, wire_dtype: str):
        super().__init__(address, sock)
        self.mm, self.lay = mm, lay
        self.hc = P.code_of(wire_dtype)
        self.wire = P.DTYPES[self.hc]
        H, M, K = lay.hidden_size, lay.max_tokens, lay.max_k
        bases = [lay.slot_base(s) for s in range(lay.n_slots)]
        # zero-copy views of every slot's inputs, made once (a gRPC re-send encodes what the shard saw):
        # hidden [M, H], ids / weights flat [M * K]
        self.hidden = [P.view(mm, b + lay.hidden_off, (M, H), self.wire) for b in bases]
        self.ids = [P.view(mm, b + lay.ids_off, (M * K,), np.dtype(np.int64)) for b in bases]
        self.w = [P.view(mm, b + lay.w_off, (M * K,), np.dtype(np.float32)) for b in bases]
        self.bases = bases
        self.free = list(range(lay.n_slots))
        self.c = _C.Client(mm, sock.fileno(), (lay.n_slots, M, K, P.HEADER_BYTES, lay.slot_bytes, lay.hidden_off,
                                               lay.ids_off, lay.w_off, lay.out_off), H, self.hc)
        self.spin_ns = int(self.spin_s * 1e9)
        self.send_timeout_ms = 1000
        sock.setblocking(False)  # (several busy paths: DrivenFuture selects the ready doorbells)

    def describe(self) -> str:
        return f"shared-memory fast path ({self.lay.n_slots} slots x {self.lay.max_tokens} tokens, C client)"

    def send(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray, timeout_s: float,
             fallback, hold=None):
        """Start one layer call (x [T, H] f32 or the wire dtype, ids [T, k] int64, w [T, k] f32): a
        Future, or `hold` (call.Hold) resolved in its place; None: use gRPC. `fallback()` re-sends the
        call over gRPC (a Future of a LayerResponse) if the fast path breaks (None: `hold` gets Moved)."""
        T, k = ids.shape
        if not self.usable or T > self.lay.max_tokens or k > self.lay.max_k:
            return None
        if x.dtype != self.wire and x.dtype != np.float32 or not x.flags.c_contiguous:
            x = np.ascontiguousarray(x, dtype=np.float32)  # (C casts float32 to the wire dtype like numpy)
        if ids.dtype != np.int64 or not ids.flags.c_contiguous:
            ids = np.ascontiguousarray(ids, dtype=np.int64)
        if w.dtype != np.float32 or not w.flags.c_contiguous:
            w = np.ascontiguousarray(w, dtype=np.float32)
        fut = Future() if hold is None else hold
        with self.lock:
            if not self.free or not self.usable:
                return None
            slot = self.free.pop()
            seq = next(self.seq)
        # the call as the shard sees it, stable while it is pending (a gRPC re-send encodes these)
        fut.inputs = (self.hidden[slot][:T], self.ids[slot][:T * k].reshape(T, k), self.w[slot][:T * k].reshape(T, k))
        with self.lock:
            self.pending[seq] = (slot, fut, time.monotonic() + timeout_s, T, fallback)
        try:
            self.c.send(slot, seq, layer, x, ids, w, max(1, int(timeout_s * 1000)))
        except OSError as e:  # ConnectionError / TimeoutError: the doorbell failed or stayed full
            self._send_failed(seq, str(e))
            return None
        self.calls += 1
        return fut

    def send_at(self, layer: int, T: int, k: int, h: int, h_wire: bool, ids: int, w: int, timeout_s: float,
                hold) -> int | None:
        """send() from raw addresses (gpu_service.experts.handoff's direct calls, which checked the
        tensors behind them: h [T, H] float32 or the wire dtype (h_wire), ids [T, k] int64, w [T, k]
        float32, C-contiguous): `hold` is resolved in its place; the slot, or None (not taken: the
        caller uses another way). The inputs the shard saw are `inputs(slot, T, k)` while pending."""
        if T > self.lay.max_tokens or k > self.lay.max_k:
            return None
        with self.lock:
            if not self.free or not self.usable:
                return None
            slot = self.free.pop()
            seq = next(self.seq)
            hold.seq, hold.slot = seq, slot
            self.pending[seq] = (slot, hold, time.monotonic() + timeout_s, T, None)
        try:
            self.c.send_at(slot, seq, layer, h, h_wire, ids, w, T, k, max(1, int(timeout_s * 1000)))
        except OSError as e:
            self._send_failed(seq, str(e))
            return None
        self.calls += 1
        return slot

    def inputs(self, slot: int, T: int, k: int) -> tuple:
        """Views of the call in `slot` as the shard saw it: hidden [T, H], ids [T, k], weights [T, k]."""
        return self.hidden[slot][:T], self.ids[slot][:T * k].reshape(T, k), self.w[slot][:T * k].reshape(T, k)

    def finish(self, hold, T: int, out: int, mode: int) -> bool:
        """Wait for a send_at call's answer, receiving any other call's on the way: True when its T
        output rows are in out (an address: _shm_client.OUT_* says how), False when it failed
        (hold.err: a refusal, DEADLINE_EXCEEDED, or Moved when the fast path broke)."""
        while not hold.fin:
            if not self.rx.acquire(blocking=False):  # another thread receives: it resolves ours too
                time.sleep(0.0001)
                continue
            try:
                entry = self.pending.get(hold.seq) if self.usable and not hold.fin else None  # (atomic: no lock)
                if entry is None:  # resolved, or being resolved by the thread that received it
                    msg, done = _BUSY, None
                else:
                    try:
                        msg = self.c.finish(hold.seq, hold.slot, T, out, mode, self.spin_ns, int(entry[2] * 1e9))
                    except OSError as e:
                        msg, why = False, str(e)
                    if msg is True:
                        with self.lock:
                            self.pending.pop(hold.seq, None)
                            self.free.append(hold.slot)
                        return True
                    done = self._settle(msg) if msg else None
            finally:
                self.rx.release()
            if msg is False:
                self._break(why)
            elif msg is None:
                self.expire(time.monotonic())
            elif msg is _BUSY:
                time.sleep(0)
            elif done is not None:
                fut, res, err = done
                fut.set_result(res) if err is None else fut.set_exception(err)
        return False

    def _receive(self) -> tuple | None:
        with self.lock:
            if not self.pending:
                return None
            deadline = next(iter(self.pending.values()))[2]  # the oldest call's: deadlines grow with seq
        try:
            msg = self.c.wait(self.spin_ns, int(deadline * 1e9))  # spin, then poll() to the deadline
        except OSError as e:  # ConnectionError: the shard closed the doorbell, or it failed
            self._break(str(e))
            return None
        if msg is None:  # nothing by the deadline (or a signal, handled): expire what is past it
            self.expire(time.monotonic())
            return None
        return self._settle(msg)

    def _settle(self, msg: tuple) -> tuple | None:
        """The pending call an answer (status, slot, seq) belongs to, resolved: (future, response,
        None) or (future, None, error); its slot freed. None: a late answer to a call already failed."""
        status = msg[0]
        with self.lock:
            entry = self.pending.pop(msg[2], None)
        if entry is None:
            return None
        slot, fut, _, T, _ = entry
        base = self.bases[slot]
        compute_us, server_us, mlen = P.RESULT.unpack_from(self.mm, base + P.RESULT_OFFSET)
        if status == P.OK:
            done = (fut, FastResponse(self.c.read(slot, T), compute_us, server_us), None)
        else:
            mlen = min(mlen, P.SLOT_META_BYTES - P.MSG_OFFSET)
            text = bytes(self.mm[base + P.MSG_OFFSET:base + P.MSG_OFFSET + mlen]).decode(errors="replace")
            done = (fut, None, shard_error(self.address, status, text))
            # the failover re-sends the inputs: copies, as the slot is free now
            if fut.inputs is not None:
                fut.inputs = tuple(a.copy() for a in fut.inputs)
            elif getattr(fut, "k", None) is not None:  # a send_at call's
                fut.inputs = tuple(a.copy() for a in self.inputs(slot, T, fut.k))
        with self.lock:
            self.free.append(slot)
        return done

    def _close(self) -> None:
        try:  # wakes a C wait on this doorbell in another thread (its own descriptor: EOF)
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        super()._close()


def negotiate(channel: grpc.Channel, address: str, hidden_size: int, max_k: int, shm_dir: str, wire_dtype: str,
              max_tokens: int = DEFAULT_MAX_TOKENS, n_slots: int = DEFAULT_SLOTS,
              timeout_s: float = 10.0) -> tuple[FastPath | None, str]:
    """Offer `address` a shared file + doorbell in shm_dir. (FastPath, "") or (None, why not)."""
    if not P.enabled():
        return None, f"disabled ({P.SHM_ENV}=0)"
    if _C is None:
        return None, NOT_BUILT
    if not os.path.isdir(shm_dir) or not os.access(shm_dir, os.W_OK):
        return None, f"shared directory {shm_dir!r} missing or not writable here"
    lay = P.Layout(n_slots, hidden_size, max_tokens, max_k)
    sock_path = os.path.join(os.path.abspath(shm_dir), f"moesplit-{os.getpid()}-{secrets.token_hex(6)}.sock")
    if len(sock_path.encode()) > 100:
        return None, f"socket path {sock_path!r} too long for a Unix socket"
    token = secrets.token_bytes(P.TOKEN_BYTES)
    listener = mm = conn = None
    fd = -1
    try:
        fd = P.create_region(lay.file_bytes)  # sealed memfd: no name to find, a size nobody can change
        mm = mmap.mmap(fd, lay.file_bytes)
        header = lay.pack_header(token)
        mm[:len(header)] = header
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        listener.bind(sock_path)
        os.chmod(sock_path, 0o600 if not os.environ.get(P.PEER_UID_ENV) else 0o666)  # the peer's uid is checked
        listener.listen(1)
        listener.settimeout(timeout_s)
        stub = experts_pb2_grpc.ExpertServiceStub(channel)
        call = stub.AttachShm.future(experts_pb2.AttachShmRequest(path="", token=token, socket_path=sock_path),
                                     timeout=timeout_s)
        # the shard connects while the RPC runs, checks our uid and waits for the descriptor
        deadline = time.monotonic() + timeout_s
        while conn is None and not call.done():
            listener.settimeout(max(0.01, min(0.1, deadline - time.monotonic())))
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                if time.monotonic() > deadline:
                    break
        if conn is not None:
            uid, allowed = P.peer_uid(conn), P.allowed_peer_uids()
            if uid not in allowed:
                call.cancel()
                return None, f"the doorbell's peer runs as uid {uid}, not one of {sorted(allowed)} ({P.PEER_UID_ENV})"
            conn.settimeout(timeout_s)
            socket.send_fds(conn, [token], [fd])
        try:
            resp = call.result()
        except grpc.RpcError as e:
            return None, f"AttachShm failed: {e.code().name}: {e.details()}"
        if not resp.accepted:
            return None, f"shard refused: {resp.reason}"
        if conn is None:
            return None, "the shard accepted but never connected its doorbell"
        conn.settimeout(None)
        fp = FastPath(address, mm, lay, conn, wire_dtype)
        fp.instance = resp.instance_id
        mm = conn = None  # owned by the fast path now
        return fp, ""
    except OSError as e:
        return None, f"cannot set up shared memory in {shm_dir}: {e}"
    finally:
        if fd >= 0:
            os.close(fd)  # the mappings keep the memory
        if listener is not None:
            listener.close()
        try:
            os.unlink(sock_path)  # both sides hold what they need; leave nothing behind
        except OSError:
            pass
        if conn is not None:
            conn.close()
        if mm is not None:
            mm.close()
