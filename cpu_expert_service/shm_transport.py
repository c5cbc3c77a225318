"""The shard side of the shared-memory fast path: AttachShm checks and the per-client serving loop.

The file layout, doorbell and dtype codes are in `wire.shm` (shared with the GPU side); see its
docstring for the protocol.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import sys
import threading
import time

import numpy as np

from wire.shm import (
    _inside, allowed_peer_uids, CALL, check_region, DOORBELL, DTYPES, enabled, FLOAT_CODES, HEADER_BYTES,
    INT_CODES, INTERNAL, INVALID_ARGUMENT, Layout, MSG_OFFSET, OK, OP_FORWARD, PEER_UID_ENV, peer_uid, recv_spin,
    RESULT, RESULT_OFFSET, SLOT_META_BYTES, spin_seconds, TOKEN_BYTES, view,
)

log = logging.getLogger("moesplit.shm")


class Refused(Exception):
    """AttachShm refused: the reason goes back to the client, which stays on gRPC."""


def attach(servicer, path: str, token: bytes, socket_path: str, shm_dir: str | None) -> str:
    """Connect the client's doorbell, check its peer, receive its sealed memfd, check it, map it and
    serve it on a thread. Returns the thread's name; raises Refused with a reason. No path is
    opened: `path` must be empty (a client of the file-based protocol is refused, stays on gRPC)."""
    if not shm_dir or not enabled():
        raise Refused("the shared-memory fast path is disabled on this shard (--shm-dir '' or MOESPLIT_SHM=0)")
    if path:
        raise Refused("this shard takes the region as a sealed memfd over the doorbell socket, not a file path; "
                      "upgrade the GPU service")
    if not os.path.isabs(socket_path) or not _inside(socket_path, shm_dir):
        raise Refused(f"{socket_path!r} is not inside this shard's shared directory {shm_dir!r}")
    if len(token) != TOKEN_BYTES:
        raise Refused(f"token of {len(token)} bytes, expected {TOKEN_BYTES}")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    fds: list[int] = []
    mm = None
    try:
        try:
            sock.settimeout(5.0)
            sock.connect(socket_path)
        except OSError as e:
            raise Refused(f"cannot connect the doorbell {socket_path}: {e}") from None
        uid, allowed = peer_uid(sock), allowed_peer_uids()
        if uid not in allowed:  # another user on this host: never trust its memory
            raise Refused(f"the doorbell's peer runs as uid {uid}, not one of {sorted(allowed)} "
                          f"(allow it with {PEER_UID_ENV})")
        try:
            msg, fds, _, _ = socket.recv_fds(sock, 64, 4)
        except OSError as e:
            raise Refused(f"no region received on the doorbell: {e}") from None
        if len(fds) != 1 or msg != token:
            raise Refused(f"expected the token and one descriptor on the doorbell, got {len(msg)} bytes and "
                          f"{len(fds)} descriptors")
        fd = fds[0]
        head = os.pread(fd, HEADER_BYTES, 0) if check_region(fd, HEADER_BYTES) is None else b""
        if len(head) < HEADER_BYTES:
            raise Refused(check_region(fd, HEADER_BYTES) or "the region is shorter than its header")
        try:
            lay, tok = Layout.unpack_header(head)
        except (ValueError, struct.error) as e:
            raise Refused(f"region header: {e}") from None
        if tok != token:
            raise Refused("token mismatch: the region is not the one the AttachShm caller announced")
        cfg = servicer.cfg
        if lay.hidden_size != cfg.hidden_size:
            raise Refused(f"hidden_size {lay.hidden_size} != model hidden_size {cfg.hidden_size}")
        if not (1 <= lay.n_slots <= 64 and 1 <= lay.max_tokens <= servicer.max_tokens
                and 1 <= lay.max_k <= cfg.n_routed_experts):
            raise Refused(f"bad layout: {lay.n_slots} slots (1-64), {lay.max_tokens} tokens "
                          f"(1-{servicer.max_tokens}), k {lay.max_k} (1-{cfg.n_routed_experts})")
        why = check_region(fd, lay.file_bytes)  # sealed: it can never shrink under the mapping (no SIGBUS)
        if why is not None:
            raise Refused(why)
        try:
            mm = mmap.mmap(fd, lay.file_bytes)
        except OSError as e:
            raise Refused(f"cannot map the region: {e}") from None
        sock.settimeout(None)
    except BaseException:
        sock.close()
        if mm is not None:
            mm.close()
        raise
    finally:
        for fd in fds:
            os.close(fd)  # the mapping keeps the memory
    name = f"shm-{os.path.basename(socket_path)}"
    native = os.environ.get(NATIVE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    threading.Thread(target=_serve, args=(servicer, mm, lay, sock, native), name=name, daemon=True).start()
    return name


NATIVE_ENV = "MOESPLIT_SHM_NATIVE"  # "0": serve every doorbell in Python (comparisons, debugging)
RING = 1 << 16  # metric records between two drains (cpu_expert_service.metrics drains every 0.1 s)


def native_loop(servicer, mm, lay: Layout, sock: socket.socket, spin_s: float):
    """The C doorbell loop (kernels/moe_shm.c) for this client where the backend is the kernels
    (metered or not) and nothing overrides the servicer's checks; else None (Python serves)."""
    from cpu_expert_service.metrics import MeteredBackend
    try:
        from cpu_expert_service.kernel_backend import KernelExperts
        from cpu_expert_service.kernels import _moe
    except ImportError:  # no kernels on this machine: the numpy backend, served in Python
        return None
    be, metrics = servicer.backend, None
    if type(be) is MeteredBackend:
        be, metrics = be._backend, be._metrics
    if type(be) is not KernelExperts or "check_and_forward" in vars(servicer):
        return None
    whole = np.frombuffer(mm, dtype=np.uint8)  # the mapping's address; kept alive with the loop
    layout = (lay.n_slots, lay.max_tokens, lay.max_k, HEADER_BYTES, lay.slot_bytes, lay.hidden_off, lay.ids_off,
              lay.w_off, lay.out_off)
    cfg = servicer.cfg
    counts = metrics.counts.native_arrays(max(servicer.layers, default=0) + 1) if metrics is not None else None
    loop = _moe.ShmServe(be._engine, whole.ctypes.data, sock.fileno(), layout, cfg.hidden_size, cfg.n_routed_experts,
                         servicer.max_tokens, servicer.layers, spin_s, *(counts or (None, None, None)),
                         ring=RING if metrics is not None else 0)
    if metrics is not None:
        metrics.attach_native(loop)
    return loop, whole, metrics, _moe


def _serve(servicer, mm, lay: Layout, sock: socket.socket, native: bool = True) -> None:
    """One client's fast path: doorbell in, slot validated and computed, doorbell out. With the
    kernels backend the loop runs in C (native_loop) and hands Python only the calls it does not
    take as plain valid calls (errors, odd dtypes): those are served here as before."""
    from cpu_expert_service.metrics import mark_arrival
    # the servicer's own module: the shard runs as `python -m cpu_expert_service.server` (__main__)
    RequestError = sys.modules[type(servicer).__module__].RequestError

    H = lay.hidden_size
    recv, send, pack, unpack = sock.recv, sock.send, DOORBELL.pack, DOORBELL.unpack
    spin_s = spin_seconds()
    native = native_loop(servicer, mm, lay, sock, spin_s) if native else None
    try:
        while True:
            t_start = None
            if native is not None:
                loop, _, _, M = native
                rc = loop.serve()
                if rc != M.SHM_PYTHON:
                    if rc == M.SHM_BAD_DOORBELL:
                        log.warning("shm fast path: bad doorbell (slot %d); closing it", loop.pending[0])
                    elif rc == M.SHM_NOMEM:
                        log.error("shard %s: shm fast path: out of memory in the kernels; closing it",
                                  servicer.shard_id)
                    break
                slot, seq, arrived_ns = loop.pending
                t_start = time.perf_counter() - max(0.0, (time.monotonic_ns() - arrived_ns) * 1e-9)
                msg = pack(OP_FORWARD, slot, seq)
            else:
                msg = recv_spin(sock, spin_s) if spin_s else None
                if msg is None:
                    msg = recv(DOORBELL.size)
            if len(msg) != DOORBELL.size:
                break  # EOF (client gone) or garbage: end this fast path
            if t_start is None:
                t_start = time.perf_counter()
            mark_arrival(t_start)  # metrics: queue wait counts from the doorbell (cpu_expert_service.metrics)
            op, slot, seq = unpack(msg)
            if op != OP_FORWARD or slot >= lay.n_slots:
                log.warning("shm fast path: bad doorbell (op %d, slot %d); closing it", op, slot)
                break
            base = lay.slot_base(slot)
            status, compute_us, err = OK, 0, b""
            try:
                layer, T, k, hc, ic, wc, oc, _, _, _ = CALL.unpack_from(mm, base)
                if T > lay.max_tokens or k > lay.max_k:
                    raise RequestError(f"{T} tokens x top-{k} exceed the shared slot ({lay.max_tokens} x {lay.max_k})")
                if hc not in FLOAT_CODES or oc not in FLOAT_CODES or wc not in FLOAT_CODES or ic not in INT_CODES:
                    raise RequestError(f"dtype codes hidden/ids/weights/output {hc}/{ic}/{wc}/{oc} not accepted")
                x = view(mm, base + lay.hidden_off, (T, H), DTYPES[hc])  # [T, H]
                ids = view(mm, base + lay.ids_off, (T, k), DTYPES[ic])  # [T, k]
                w = view(mm, base + lay.w_off, (T, k), DTYPES[wc])  # [T, k]
                out, compute_us = servicer.check_and_forward(layer, x, ids, w)  # [T, H] f32
                view(mm, base + lay.out_off, (T, H), DTYPES[oc])[...] = out  # cast to the wire dtype
            except RequestError as e:
                status, err = INVALID_ARGUMENT, f"shard {servicer.shard_id}: seq {seq}: {e}".encode()
            except Exception as e:  # noqa: BLE001 - a backend bug: say so, keep serving
                log.exception("shard %s: shm seq %d failed", servicer.shard_id, seq)
                status, err = INTERNAL, f"shard {servicer.shard_id}: seq {seq}: {type(e).__name__}: {e}".encode()
            err = err[:SLOT_META_BYTES - MSG_OFFSET]
            server_us = int((time.perf_counter() - t_start) * 1e6)
            RESULT.pack_into(mm, base + RESULT_OFFSET, compute_us, server_us, len(err))
            if err:
                mm[base + MSG_OFFSET:base + MSG_OFFSET + len(err)] = err
            send(pack(status, slot, seq))
    except OSError:
        pass  # client went away
    finally:
        if native is not None and native[2] is not None:
            native[2].detach_native(native[0])
        native = loop = None
        sock.close()
        try:
            mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass
