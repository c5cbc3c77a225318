# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython binding of the shared-memory client in C (shm_client.h): `ShmClient` sends one layer
call and receives answers for gpu_service.experts.shm.FastPath, the GIL released while waiting.

Use gpu_service.experts.shm, not this module directly."""
import os

import numpy as np
cimport numpy as cnp
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from posix.unistd cimport close, dup

cnp.import_array()

include "call_check.pxi"

cdef extern from "shm_client.h" nogil:
    int SHM_DOORBELL_BYTES, SHM_OP_FORWARD, SHM_RESULT_OFFSET, SHM_MSG_OFFSET
    int SC_OK, SC_NONE, SC_CLOSED, SC_FAILED, SC_INTR, SC_FULL, SC_BAD, SC_OTHER
    int SC_OUT_WIRE, SC_OUT_F32, SC_OUT_ADD_F32
    ctypedef struct ShmClient "ShmClient":
        unsigned char *base
        long header_bytes, slot_bytes, hidden_off, ids_off, w_off, out_off
        int n_slots, H, max_tokens, max_k, fd, wire, err
        uint64_t sent, answered
    ctypedef struct ShmAnswer:
        uint32_t status, slot
        uint64_t seq
    int sc_send(ShmClient *c, int slot, uint64_t seq, int32_t layer, const void *h, int h_wire,
                const int64_t *ids, const float *w, int T, int k, int timeout_ms)
    int sc_wait(ShmClient *c, int64_t spin_end_ns, int64_t deadline_ns, ShmAnswer *a)
    void sc_read(const ShmClient *c, int slot, int T, float *out)
    int sc_finish(ShmClient *c, uint64_t seq, int slot, int T, void *out, int mode, int64_t spin_end_ns,
                  int64_t deadline_ns, ShmAnswer *a)
    int sc_has_f16()
    int64_t shm_now_ns()

SHM_WIRE = {"doorbell_bytes": SHM_DOORBELL_BYTES, "op_forward": SHM_OP_FORWARD,
            "result_offset": SHM_RESULT_OFFSET, "msg_offset": SHM_MSG_OFFSET}
HAS_F16 = bool(sc_has_f16())
OUT_WIRE, OUT_F32, OUT_ADD_F32 = SC_OUT_WIRE, SC_OUT_F32, SC_OUT_ADD_F32


def now_ns():
    """CLOCK_MONOTONIC in ns, the clock of the deadlines (Python's time.monotonic_ns)."""
    return shm_now_ns()


cdef class Client:
    """One fast path's C end. region: the writable shared mapping (kept referenced); fd: the
    doorbell, duplicated here (closed with this object, so a Python close while a wait runs never
    lets the number be reused under it: shut the socket down to wake the wait); layout: wire.shm
    Layout's (n_slots, max_tokens, max_k, header bytes, slot_bytes, hidden_off, ids_off, w_off,
    out_off); wire: 0 float32, 1 bfloat16, 2 float16."""

    cdef ShmClient c
    cdef unsigned char[::1] mem  # holds the mapping exported: it cannot be unmapped under the C side
    cdef ShmAnswer ans

    def __cinit__(self, region, int fd, tuple layout, int hidden_size, int wire):
        self.c.fd = -1
        self.mem = region
        n_slots, max_tokens, max_k, header_bytes, slot_bytes, hidden_off, ids_off, w_off, out_off = layout
        if header_bytes + n_slots * slot_bytes > self.mem.shape[0]:
            raise ValueError(f"the mapping has {self.mem.shape[0]} bytes, the layout needs "
                             f"{header_bytes + n_slots * slot_bytes}")
        if wire == 2 and not HAS_F16:
            raise ValueError("float16 wire dtype: this build's compiler has no _Float16; use bfloat16")
        self.c.base = &self.mem[0]
        self.c.n_slots, self.c.max_tokens, self.c.max_k, self.c.H = n_slots, max_tokens, max_k, hidden_size
        self.c.header_bytes, self.c.slot_bytes = header_bytes, slot_bytes
        self.c.hidden_off, self.c.ids_off, self.c.w_off, self.c.out_off = hidden_off, ids_off, w_off, out_off
        self.c.wire, self.c.err, self.c.sent, self.c.answered = wire, 0, 0, 0
        self.c.fd = dup(fd)
        if self.c.fd < 0:
            raise OSError(f"cannot duplicate the doorbell descriptor {fd}")

    def __dealloc__(self):
        if self.c.fd >= 0:
            close(self.c.fd)

    @property
    def sent(self):
        """Doorbells rung by this client (calls sent through C)."""
        return self.c.sent

    @property
    def answered(self):
        """Answers received by this client (through C)."""
        return self.c.answered

    def send(self, int slot, uint64_t seq, int32_t layer, cnp.ndarray h, cnp.ndarray ids, cnp.ndarray w,
             int timeout_ms):
        """Write a call into `slot` and ring the doorbell. h [T, H] C-contiguous float32 or the wire
        dtype, ids [T, k] int64, w [T, k] float32 (C-contiguous: the caller checks). Raises
        ConnectionError when the doorbell failed, TimeoutError when it stayed full."""
        cdef int T = h.shape[0], k = ids.shape[1]
        cdef int h_wire = check_call(h, ids, w, self.c.H, self.c.wire)
        self._send(slot, seq, layer, cnp.PyArray_DATA(h), h_wire, <const int64_t *>cnp.PyArray_DATA(ids),
                   <const float *>cnp.PyArray_DATA(w), T, k, timeout_ms)

    def send_at(self, int slot, uint64_t seq, int32_t layer, size_t h, bint h_wire, size_t ids, size_t w, int T,
                int k, int timeout_ms):
        """send() from raw addresses (a caller that has checked them: gpu_service.experts.shm
        FastPath.send_at): h [T, H] float32 (h_wire False) or in the wire dtype, ids [T, k] int64,
        w [T, k] float32, all C-contiguous."""
        self._send(slot, seq, layer, <const void *>h, h_wire, <const int64_t *>ids, <const float *>w, T, k,
                   timeout_ms)

    cdef _send(self, int slot, uint64_t seq, int32_t layer, const void *h, int h_wire, const int64_t *ids,
               const float *w, int T, int k, int timeout_ms):
        """sc_send, its failure raised (ConnectionError, TimeoutError when the doorbell stayed full)."""
        cdef int rc = sc_send(&self.c, slot, seq, layer, h, h_wire, ids, w, T, k, timeout_ms)
        if rc != SC_OK:
            raise _error(rc, self.c.err, "doorbell send")

    def finish(self, uint64_t seq, int slot, int T, size_t out, int mode, int64_t spin_ns, int64_t deadline_ns):
        """Wait for one answer (as wait()). True: it was call `seq`'s on `slot`, OK, and its T output
        rows are in out ([T, H] at that address: the wire dtype for OUT_WIRE, float32 written for
        OUT_F32 or added into for OUT_ADD_F32); (status, slot, seq): another answer, or this call's
        refusal (out untouched); None: nothing by deadline_ns or a signal. Raises as wait()."""
        cdef int rc
        with nogil:
            rc = sc_finish(&self.c, seq, slot, T, <void *>out, mode, shm_now_ns() + spin_ns, deadline_ns, &self.ans)
        return True if rc == SC_OK else self._answer(SC_OK if rc == SC_OTHER else rc)

    def wait(self, int64_t spin_ns, int64_t deadline_ns):
        """One answer as (status, slot, seq), or None: nothing by deadline_ns (CLOCK_MONOTONIC, as
        time.monotonic), or a signal came (its Python handler has run; an exception it raised
        propagates). Polls without blocking for spin_ns, then waits in poll() until deadline_ns,
        without the GIL. Raises ConnectionError when the shard closed the doorbell or it failed."""
        cdef int rc
        with nogil:
            rc = sc_wait(&self.c, shm_now_ns() + spin_ns, deadline_ns, &self.ans)
        return self._answer(rc)

    cdef _answer(self, int rc):
        """sc_wait's outcome: the answer (status, slot, seq), None (nothing by the deadline, or a
        signal: its handler run), or the doorbell's failure raised."""
        if rc == SC_OK:
            return self.ans.status, self.ans.slot, self.ans.seq
        if rc == SC_NONE:
            return None
        if rc == SC_INTR:
            PyErr_CheckSignals()
            return None
        raise _error(rc, self.c.err, "doorbell")

    def read(self, int slot, int T):
        """A float32 copy [T, H] of `slot`'s output rows."""
        if not 0 <= slot < self.c.n_slots or not 0 <= T <= self.c.max_tokens:
            raise ValueError(f"slot {slot} / {T} rows outside the layout")
        cdef cnp.ndarray out = np.empty((T, self.c.H), dtype=np.float32)
        sc_read(&self.c, slot, T, <float *>cnp.PyArray_DATA(out))
        return out


cdef object _error(int rc, int err, str what):
    if rc == SC_CLOSED:
        return ConnectionError("the shard closed the fast path")
    if rc == SC_FULL:
        return TimeoutError(f"{what}: the socket stayed full")
    if rc == SC_BAD:
        return ConnectionError(f"{what}: a slot outside the layout")
    return ConnectionError(f"{what} failed: {os.strerror(err)}")
