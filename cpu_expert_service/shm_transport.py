"""The shard side of the shared-memory fast path: AttachShm checks and the per-client serving loop.

The file layout, doorbell and dtype codes are in `wire.shm` (shared with the GPU side); see its
docstring for the protocol. Every client's doorbells are served by one loop, in C
(cpu_expert_service/kernels/moe_shm.c, bound as `_moe.ShmServe`): it validates each call as
`ExpertServicer.check_and_forward` does and answers a refused one with the same message; it computes
with the kernels backend's experts without the GIL, or calls back into any other backend's forward
(numpy reference) with the GIL for the compute only, so every backend keeps the fast path.
"""
from __future__ import annotations

import logging
import mmap
import os
import socket
import struct
import threading

import numpy as np

from wire.shm import (
    _inside, allowed_peer_uids, check_region, enabled, HEADER_BYTES, Layout, PEER_UID_ENV, peer_uid, spin_seconds,
    TOKEN_BYTES,
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
        loop, whole, metrics = shard_loop(servicer, mm, lay, sock)
    except BaseException:
        sock.close()
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # the refused loop's view of it: the mapping goes with it
                pass
        raise
    finally:
        for fd in fds:
            os.close(fd)  # the mapping keeps the memory
    name = f"shm-{os.path.basename(socket_path)}"
    threading.Thread(target=_serve, args=(servicer, loop, whole, metrics, mm, sock), name=name, daemon=True).start()
    return name


RING = 1 << 16  # metric records between two drains (cpu_expert_service.metrics drains every 0.1 s)


def shard_loop(servicer, mm, lay: Layout, sock: socket.socket):
    """The C doorbell loop (kernels/moe_shm.c, the shard's only shared-memory loop) for this client.
    Returns (loop, the mapping's array it keeps alive, metrics or None); raises Refused where the
    kernels extension is not built."""
    whole = np.frombuffer(mm, dtype=np.uint8)  # the mapping's address; kept alive with the loop
    layout = (lay.n_slots, lay.max_tokens, lay.max_k, HEADER_BYTES, lay.slot_bytes, lay.hidden_off, lay.ids_off,
              lay.w_off, lay.out_off)
    loop, metrics = native_loop(servicer, whole.ctypes.data, layout, sock.fileno())
    return loop, whole, metrics


def native_loop(servicer, base: int, layout: tuple, fd: int):
    """A C serving loop over fd (`_moe.ShmServe`: the shared-memory doorbells, or the TCP data path's
    frames with serve_tcp): all in C over the kernels backend's packed experts (metered or not), else
    calling the backend's own forward for the compute only. base/layout: the slots' memory as
    ShmServe takes it. Returns (loop, metrics or None); raises Refused where the kernels extension
    is not built."""
    from checkpoint.names import compact_ranges
    from cpu_expert_service.metrics import MeteredBackend
    try:
        from cpu_expert_service.kernel_backend import KernelExperts
        from cpu_expert_service.kernels import _moe
    except ImportError as e:
        raise Refused(f"the shared-memory fast path is served by the C doorbell loop of the kernels extension, "
                      f"which is not built on this shard ({e}); build it with `make build`") from None
    be, metrics = servicer.backend, None
    if type(be) is MeteredBackend:  # counted in C instead: the loop calls the backend under it
        be, metrics = be._backend, be._metrics
    kernels = type(be) is KernelExperts and "forward" not in vars(be)
    compute = dict(eng=be._engine) if kernels else dict(forward=be.forward)
    cfg = servicer.cfg
    tokens, acts, held = (metrics.counts.native_arrays(max(servicer.layers, default=0) + 1) if metrics is not None
                          else (None, None, None))
    loop = _moe.ShmServe(base, fd, layout, cfg.hidden_size, cfg.n_routed_experts,
                         servicer.max_tokens, servicer.layers, spin_seconds(), str(servicer.shard_id),
                         compact_ranges(servicer.layers) or "none", **compute, tokens=tokens, acts=acts, held=held,
                         ring=RING if metrics is not None else 0)
    if metrics is not None:
        metrics.attach_native(loop)
    return loop, metrics


def _serve(servicer, loop, whole, metrics, mm, sock: socket.socket) -> None:
    """Run one client's C loop on this thread until the client goes or rings a bad doorbell, logging
    each call it answered INTERNAL (it answers every call itself, then serves on)."""
    from cpu_expert_service.kernels import _moe

    try:
        while (rc := loop.serve()) == _moe.SHM_INTERNAL:
            _slot, seq, msg = loop.last
            e = loop.error  # the backend's exception (None: the kernels failed)
            log.error("shard %s: shm seq %d failed: %s", servicer.shard_id, seq, msg,
                      exc_info=(type(e), e, e.__traceback__) if e is not None else None)
        if rc == _moe.SHM_BAD_DOORBELL:
            slot, seq, _ = loop.last
            log.warning("shm fast path: bad doorbell (slot %d, seq %d); closing it", slot, seq)
    finally:
        if metrics is not None:
            metrics.detach_native(loop)
        loop = whole = None
        sock.close()
        try:
            mm.close()
        except BufferError:  # a view still alive somewhere: the mapping goes with it
            pass
