"""The shared-memory fast path's wire format: file layout, slot views, doorbell, dtype codes (numpy only).

Both sides import this: the GPU service's client (gpu_service.experts.shm) and the shard
(cpu_expert_service.shm_transport). It imports neither service.


When the GPU service and a shard share a host and a directory (`/dev/shm`, or in Kubernetes an
emptyDir / hostPath mounted at the same path in both containers), tensors need not cross the
gRPC stream. The GPU side creates the region as an anonymous memfd, sized for `n_slots` in-flight
calls of up to `max_tokens` rows, seals its size (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`),
writes a random token at its head and listens on a Unix socket (mode 0600) in that directory;
then it asks the shard with the `AttachShm` RPC (`path` empty, `token`, `socket_path`). The shard
connects to the socket (only inside its own `--shm-dir`), checks the peer's uid (`SO_PEERCRED`:
its own uid or one allowed by MOESPLIT_SHM_PEER_UID), receives the descriptor with the token
(`SCM_RIGHTS`), checks the seals, the size and the token, and maps it. No path is ever opened
and the mapping cannot shrink under the shard, so a hostile client cannot make it fault (SIGBUS);
every slot access is bounds-checked against the layout read once at attach. Both unlink the
socket name; the mapping and the socket live until either side closes. The gRPC stream stays for
control, health and every call that does not fit (more rows than a slot holds, no free slot).

Layout of the file (little-endian):

    [0, 4096)       header: magic, version, n_slots, hidden_size, max_tokens, max_k, slot_bytes,
                    token (32 bytes at offset 64)
    slot s at 4096 + s * slot_bytes:
      [0, 64)       call: layer, T, k, dtype codes of hidden / ids / weights / output,
                    compute_us, server_us, error message length
      [64, 4096)    error message (UTF-8) of a refused call
      hidden        [max_tokens, H] (wire dtype, <= 4 bytes)      then ids [max_tokens, max_k] (<= 8 bytes),
      weights       [max_tokens, max_k] (<= 4 bytes)              then output [max_tokens, H] (<= 4 bytes)

Doorbell: a SOCK_SEQPACKET Unix socket; every message is 16 bytes `<IIQ`: (op or status, slot,
seq). The client writes a slot and sends (OP_FORWARD, slot, seq); the shard validates and computes
as for a gRPC `LayerRequest` (`ExpertServicer.check_and_forward`'s checks and messages), writes the output (or
the error message) into the slot and answers (status, slot, seq) with a gRPC status code: 0 OK,
3 INVALID_ARGUMENT, 13 INTERNAL. A refused call does not end the fast path.

The shard serves this protocol with one loop per client, in C (cpu_expert_service/kernels/moe_shm.c)
for every backend: the kernels compute there without the GIL, any other backend's forward is called
back with the GIL. It makes check_and_forward's checks in its order with its messages (and the slot's
own: rows and top-k over the slot, dtype codes), converts int32 ids and 16-bit hidden rows and
weights itself, takes the doorbell and result constants from wire/shm_wire.h and the CALL layout and
dtype codes from its own code: change them together. A shard without the kernels extension refuses
AttachShm.
The GPU side's client is C as well (gpu_service/experts/shm_client.c, the only client).

Disable on the shard with `--shm-dir ''` or MOESPLIT_SHM=0 (AttachShm then refuses and the client
stays on gRPC).

Bounded spinning: a thread blocked in recv() on one CPU is woken by an inter-processor interrupt
when the peer on another CPU sends; on a virtual machine that wake-up alone costs ~50 µs each way.
So a receiver may first poll its doorbell without blocking (`recv_spin`) for up to
MOESPLIT_SHM_SPIN_US µs, yielding the CPU between polls, and only then block: the shard after each
answer (the next layer's call usually arrives within that window), the GPU side while it waits
for an answer. It pays where every process has cores of its own (the Helm chart sets 200 on its
Guaranteed pods; the pipeline bench pins the shards and sets 200): one-token round trip 227 ->
~60-80 µs transport-only. It costs where processes share cores: the pollers take the CPU the
others compute on (measured on this 2-core VM, `make demo`'s decode 116 -> 87-106 tok/s with 200),
so the default is 0. The messages and their order are the same either way.
"""
from __future__ import annotations

import os
import socket
import struct
import time

import ml_dtypes
import numpy as np


MAGIC = b"MOESHM01"
VERSION = 1
HEADER_BYTES = 4096
SLOT_META_BYTES = 4096  # call header (64) + error message
MSG_OFFSET = 64
ALIGN = 64
TOKEN_OFFSET = 64
TOKEN_BYTES = 32

SHM_ENV = "MOESPLIT_SHM"  # "0" disables the fast path (shard: refuse AttachShm; client: never ask)
SHM_DIR_ENV = "MOESPLIT_SHM_DIR"  # shared directory (default /dev/shm)
DEFAULT_SHM_DIR = "/dev/shm"
PEER_UID_ENV = "MOESPLIT_SHM_PEER_UID"  # further uids (comma-separated) allowed as the peer of a doorbell
SEALS = 0x0002 | 0x0004 | 0x0001  # F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL: the size can never change

OP_FORWARD = 1
OK, INVALID_ARGUMENT, INTERNAL = 0, 3, 13  # gRPC status code values

DOORBELL = struct.Struct("<IIQ")  # (op | status, slot, seq): 16 bytes
# header: magic 8s, version, n_slots, hidden_size, max_tokens, max_k (I), slot_bytes (Q)
HEADER = struct.Struct("<8sIIIIIQ")
# slot call header: layer i, T I, k I, dtype codes hidden/ids/w/out (4 x I), compute_us Q, server_us Q, msg_len I
CALL = struct.Struct("<iIIIIIIQQI")
RESULT = struct.Struct("<QQI")  # compute_us, server_us, msg_len: written by the shard at RESULT_OFFSET
RESULT_OFFSET = 28

DTYPE_NAMES = ("float32", "bfloat16", "float16", "int32", "int64")  # code = index
DTYPES = (np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16), np.dtype(np.int32),
          np.dtype(np.int64))
FLOAT_CODES = (0, 1, 2)
INT_CODES = (3, 4)


SPIN_ENV = "MOESPLIT_SHM_SPIN_US"
DEFAULT_SPIN_US = 0  # off unless the deployment has dedicated cores (see the module docstring)


def spin_seconds() -> float:
    """How long a receiver polls its doorbell before blocking (MOESPLIT_SHM_SPIN_US, µs)."""
    raw = os.environ.get(SPIN_ENV, "").strip()
    try:
        us = float(raw) if raw else DEFAULT_SPIN_US
    except ValueError:
        raise ValueError(f"{SPIN_ENV}={raw!r}: expected microseconds, e.g. 200 (0 disables spinning)") from None
    if not 0 <= us <= 1e6:
        raise ValueError(f"{SPIN_ENV}={raw!r}: expected 0 to 1000000 microseconds")
    return us * 1e-6


def recv_spin(sock: socket.socket, spin_s: float) -> bytes | None:
    """Poll a doorbell without blocking for up to spin_s: a message (b"" at EOF), or None if none
    came (the caller then blocks). Yields the CPU between polls, so a peer sharing it still runs."""
    recv, clock, yield_ = sock.recv, time.perf_counter, os.sched_yield
    end = clock() + spin_s
    while True:
        try:
            return recv(DOORBELL.size, socket.MSG_DONTWAIT)
        except (BlockingIOError, InterruptedError):
            if clock() >= end:
                return None
            yield_()


def code_of(name: str) -> int:
    return DTYPE_NAMES.index(name)


def enabled() -> bool:
    return os.environ.get(SHM_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def default_dir() -> str:
    return os.environ.get(SHM_DIR_ENV, DEFAULT_SHM_DIR)


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class Layout:
    """Offsets of one shared file: n_slots slots of max_tokens rows of hidden_size, top-k <= max_k."""

    def __init__(self, n_slots: int, hidden_size: int, max_tokens: int, max_k: int):
        self.n_slots, self.hidden_size, self.max_tokens, self.max_k = n_slots, hidden_size, max_tokens, max_k
        self.hidden_off = SLOT_META_BYTES
        self.ids_off = self.hidden_off + _round(max_tokens * hidden_size * 4)
        self.w_off = self.ids_off + _round(max_tokens * max_k * 8)
        self.out_off = self.w_off + _round(max_tokens * max_k * 4)
        self.slot_bytes = _round(self.out_off + max_tokens * hidden_size * 4)
        self.file_bytes = HEADER_BYTES + n_slots * self.slot_bytes

    def slot_base(self, slot: int) -> int:
        return HEADER_BYTES + slot * self.slot_bytes

    def pack_header(self, token: bytes) -> bytes:
        h = HEADER.pack(MAGIC, VERSION, self.n_slots, self.hidden_size, self.max_tokens, self.max_k, self.slot_bytes)
        return h + b"\0" * (TOKEN_OFFSET - len(h)) + token

    @classmethod
    def unpack_header(cls, buf) -> tuple["Layout", bytes]:
        magic, version, n_slots, h, max_tokens, max_k, slot_bytes = HEADER.unpack_from(buf, 0)
        if magic != MAGIC or version != VERSION:
            raise ValueError(f"not a moesplit shared-memory file (magic {magic!r}, version {version})")
        lay = cls(n_slots, h, max_tokens, max_k)
        if lay.slot_bytes != slot_bytes:
            raise ValueError(f"slot size {slot_bytes} != {lay.slot_bytes} implied by the header")
        return lay, bytes(buf[TOKEN_OFFSET:TOKEN_OFFSET + TOKEN_BYTES])


def view(mm, offset: int, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A zero-copy numpy view of the shared mapping."""
    return np.ndarray(shape, dtype=dtype, buffer=mm, offset=offset)


def allowed_peer_uids() -> frozenset[int]:
    """This process's uid and the ones in MOESPLIT_SHM_PEER_UID (e.g. the GPU service's uid when the
    shard runs as another user): the only peers a doorbell is accepted from."""
    raw = os.environ.get(PEER_UID_ENV, "").strip()
    try:
        extra = {int(u) for u in raw.split(",") if u.strip()}
    except ValueError:
        raise ValueError(f"{PEER_UID_ENV}={raw!r}: expected comma-separated numeric uids, e.g. 1000") from None
    return frozenset({os.getuid(), *extra})


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (SO_PEERCRED)."""
    _pid, uid, _gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
    return uid


def create_region(size: int) -> int:
    """A sealed anonymous shared-memory file of `size` bytes (its descriptor): no name, and a
    size that neither side can change afterwards."""
    import fcntl

    fd = os.memfd_create("moesplit-shm", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)  # sparse: pages exist once written
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_region(fd: int, need: int) -> str | None:
    """Why a received descriptor is not a usable region (None when it is): it must be a memfd whose
    size is sealed and at least `need` bytes."""
    import fcntl
    import stat

    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return "the descriptor is not a sealable memfd (send one from os.memfd_create)"
    if seals & (SEALS & ~0x0001) != SEALS & ~0x0001:
        return f"the memfd's size is not sealed (seals {seals:#x}; need F_SEAL_SHRINK | F_SEAL_GROW)"
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_size < need:
        return f"the memfd has {st.st_size} bytes, the layout needs {need}"
    return None


def _inside(path: str, directory: str) -> bool:
    d = os.path.realpath(directory)
    return os.path.commonpath([os.path.realpath(os.path.dirname(path)), d]) == d
