"""The shard side of the shared-memory fast path: AttachShm checks and the per-client serving loop.

The file layout, doorbell and dtype codes are in `wire.shm` (shared with the GPU side); see its
docstring for the protocol.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import stat
import sys
import threading
import time

from wire.shm import (
    _inside, CALL, DOORBELL, DTYPES, enabled, FLOAT_CODES, HEADER_BYTES, INT_CODES, INTERNAL,
    INVALID_ARGUMENT, Layout, MSG_OFFSET, OK, OP_FORWARD, recv_spin, RESULT, RESULT_OFFSET,
    SLOT_META_BYTES, spin_seconds, TOKEN_BYTES, view,
)

log = logging.getLogger("moesplit.shm")


class Refused(Exception):
    """AttachShm refused: the reason goes back to the client, which stays on gRPC."""


def attach(servicer, path: str, token: bytes, socket_path: str, shm_dir: str | None) -> str:
    """Open the client's shared file, check it, connect its doorbell and serve it on a thread.
    Returns the thread's name; raises Refused with a reason."""
    if not shm_dir or not enabled():
        raise Refused("the shared-memory fast path is disabled on this shard (--shm-dir '' or MOESPLIT_SHM=0)")
    for p in (path, socket_path):
        if not os.path.isabs(p) or not _inside(p, shm_dir):
            raise Refused(f"{p!r} is not inside this shard's shared directory {shm_dir!r}")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:  # another host, another volume, permissions
        raise Refused(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < HEADER_BYTES:
            raise Refused(f"{path} is not a shared-memory file of this protocol")
        mm = mmap.mmap(fd, st.st_size)
    finally:
        os.close(fd)
    try:
        lay, tok = Layout.unpack_header(mm)
        if len(token) != TOKEN_BYTES or tok != token:
            raise Refused(f"{path}: token mismatch (a different file of the same name: not the client's host?)")
        if lay.file_bytes > len(mm):
            raise Refused(f"{path}: {len(mm)} bytes, the header needs {lay.file_bytes}")
        if lay.hidden_size != servicer.cfg.hidden_size:
            raise Refused(f"hidden_size {lay.hidden_size} != model hidden_size {servicer.cfg.hidden_size}")
        if not 1 <= lay.n_slots <= 64 or lay.max_tokens < 1 or lay.max_k < 1:
            raise Refused(f"bad layout: {lay.n_slots} slots, {lay.max_tokens} tokens, k {lay.max_k}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(5.0)
            sock.connect(socket_path)
            sock.settimeout(None)
        except OSError as e:
            sock.close()
            raise Refused(f"cannot connect the doorbell {socket_path}: {e}") from None
    except (Refused, ValueError) as e:
        mm.close()
        raise e if isinstance(e, Refused) else Refused(f"{path}: {e}") from None
    name = f"shm-{os.path.basename(path)}"
    threading.Thread(target=_serve, args=(servicer, mm, lay, sock), name=name, daemon=True).start()
    return name


def _serve(servicer, mm, lay: Layout, sock: socket.socket) -> None:
    """One client's fast path: doorbell in, slot validated and computed, doorbell out."""
    from cpu_expert_service.metrics import mark_arrival
    # the servicer's own module: the shard runs as `python -m cpu_expert_service.server` (__main__)
    RequestError = sys.modules[type(servicer).__module__].RequestError

    H = lay.hidden_size
    recv, send, pack, unpack = sock.recv, sock.send, DOORBELL.pack, DOORBELL.unpack
    spin_s = spin_seconds()
    try:
        while True:
            msg = recv_spin(sock, spin_s) if spin_s else None
            if msg is None:
                msg = recv(DOORBELL.size)
            if len(msg) != DOORBELL.size:
                break  # EOF (client gone) or garbage: end this fast path
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
        sock.close()
        try:
            mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass
