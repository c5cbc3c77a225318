# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython binding of the TCP data path's client in C (tcp_client.h): `Client` sends one layer call
and receives answers for gpu_service.experts.tcp.TcpPath, the GIL released while sending and
waiting; its bytes go through a `Link` (wire/tcp_link.pxi: plaintext, or mutual TLS with a
`TlsContext` over the gRPC path's certificate files).

Use gpu_service.experts.tcp, not this module directly."""
import os

import numpy as np
cimport numpy as cnp
from cpython.exc cimport PyErr_CheckSignals
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from libc.stdlib cimport free, malloc

cnp.import_array()

include "call_check.pxi"
include "tcp_link.pxi"

cdef extern from "tcp_client.h" nogil:
    int SC_OK, SC_NONE, SC_CLOSED, SC_FAILED, SC_INTR, SC_FULL, SC_BAD, TC_STALLED, TC_BAD_HEADER
    int TC_MAX_MESSAGE
    ctypedef struct TcpClient:
        TcpIo *io
        int H, wire, max_tokens, err
        unsigned char *body
        size_t body_cap
        unsigned char *cast
        uint64_t sent, answered
    ctypedef struct TcpAnswer:
        uint64_t seq, compute_us, server_us
        uint32_t status, mlen, T
    int tc_send(TcpClient *c, uint64_t seq, int32_t layer, const void *h, int h_wire, const int64_t *ids,
                const float *w, int T, int k, int timeout_ms)
    int tc_wait(TcpClient *c, int64_t spin_end_ns, int64_t deadline_ns, int64_t frame_ns, TcpAnswer *a)
    void tc_read(const TcpClient *c, int T, float *out)
    int sc_has_f16()
    int64_t shm_now_ns()
    void sc_put_rows(void *dst, int wire, const float *x, size_t n)
    void sc_get_rows(float *y, const void *src, int wire, size_t n, int add)

from libc.string cimport memcpy

cdef extern from "shm_client.h" nogil:
    int SC_OUT_WIRE, SC_OUT_F32, SC_OUT_ADD_F32

MAX_MESSAGE = TC_MAX_MESSAGE


cdef class Client:
    """One data connection's C end. link: a Link (plaintext, or TLS after its start_tls()) or a connected
    socket's fd (a plaintext Link of its own duplicate: shut the socket down to wake a wait); wire: 0
    float32, 1 bfloat16, 2 float16; answers of at most max_tokens rows of hidden_size."""

    cdef TcpClient c
    cdef TcpAnswer ans
    cdef readonly Link link

    def __cinit__(self, link, int hidden_size, int wire, int max_tokens):
        if wire == 2 and not sc_has_f16():
            raise ValueError("float16 wire dtype: this build's compiler has no _Float16; use bfloat16")
        self.link = link if isinstance(link, Link) else Link(link)
        self.c.io = &self.link.io
        self.c.H, self.c.wire, self.c.max_tokens, self.c.err, self.c.sent, self.c.answered = \
            hidden_size, wire, max_tokens, 0, 0, 0
        self.c.body_cap = max(<size_t>max_tokens * hidden_size * 4, <size_t>TC_MAX_MESSAGE)
        self.c.body = <unsigned char *>malloc(self.c.body_cap)  # bounded; pages committed as answers land
        self.c.cast = <unsigned char *>malloc(<size_t>max_tokens * hidden_size * 2 + 2)
        if self.c.body == NULL or self.c.cast == NULL:
            raise MemoryError()

    def __dealloc__(self):
        free(self.c.body)
        free(self.c.cast)

    @property
    def sent(self):
        """Frames sent through C."""
        return self.c.sent

    @property
    def answered(self):
        """Answers received through C."""
        return self.c.answered

    def send(self, uint64_t seq, int32_t layer, cnp.ndarray h, cnp.ndarray ids, cnp.ndarray w, int timeout_ms):
        """Send one request frame. h [T, H] C-contiguous float32 or the wire dtype, ids [T, k] int64,
        w [T, k] float32. Raises ConnectionError when the connection failed, TimeoutError when it
        stayed full (the frame may be cut: the connection is unusable either way)."""
        cdef int T = h.shape[0], k = ids.shape[1], rc
        cdef int h_wire = check_call(h, ids, w, self.c.H, self.c.wire)
        cdef const void *hp = cnp.PyArray_DATA(h)
        cdef const int64_t *ip = <const int64_t *>cnp.PyArray_DATA(ids)
        cdef const float *wp = <const float *>cnp.PyArray_DATA(w)
        with nogil:
            rc = tc_send(&self.c, seq, layer, hp, h_wire, ip, wp, T, k, timeout_ms)
        if rc != SC_OK:
            raise _error(rc, self.c.err, "data connection send", self.link)

    def wait(self, int64_t spin_ns, int64_t deadline_ns, int64_t frame_ns):
        """One answer's header as (seq, status, compute_us, server_us, message length, T), its body
        kept here (read() / message()); None: nothing began by deadline_ns (CLOCK_MONOTONIC) or a
        signal came (its handler has run). Raises ConnectionError when the connection closed or
        failed, a frame stalled past frame_ns, or a header no request can have."""
        cdef int rc
        with nogil:
            rc = tc_wait(&self.c, shm_now_ns() + spin_ns, deadline_ns, frame_ns, &self.ans)
        if rc == SC_OK:
            a = self.ans
            return a.seq, a.status, a.compute_us, a.server_us, a.mlen, a.T
        if rc == SC_NONE:
            return None
        if rc == SC_INTR:
            PyErr_CheckSignals()
            return None
        if rc == TC_BAD_HEADER:
            raise ConnectionError(f"the shard sent a bad response header (status {self.ans.status}, "
                                  f"{self.ans.T} rows, a {self.ans.mlen}-byte message)")
        raise _error(rc, self.c.err, "data connection", self.link)

    def read(self, int T):
        """A float32 copy [T, H] of the last answer's rows."""
        if not 0 <= T <= self.c.max_tokens:
            raise ValueError(f"{T} rows outside [0, {self.c.max_tokens}]")
        cdef cnp.ndarray out = np.empty((T, self.c.H), dtype=np.float32)
        tc_read(&self.c, T, <float *>cnp.PyArray_DATA(out))
        return out

    def read_into(self, int T, size_t out, int mode):
        """The last answer's T rows into out ([T, H] at that address): as they are (SC_OUT_WIRE, the
        wire dtype), as float32 (SC_OUT_F32) or added into float32 (SC_OUT_ADD_F32)."""
        if not 0 <= T <= self.c.max_tokens:
            raise ValueError(f"{T} rows outside [0, {self.c.max_tokens}]")
        cdef size_t n = <size_t>T * self.c.H
        if mode == SC_OUT_WIRE:
            memcpy(<void *>out, self.c.body, n * (4 if self.c.wire == 0 else 2))
        else:
            sc_get_rows(<float *>out, self.c.body, self.c.wire, n, mode == SC_OUT_ADD_F32)

    def inputs(self, size_t h, bint h_wire, size_t ids, size_t w, int T, int k):
        """Copies of a call given by raw addresses (h [T, H] float32, or the wire dtype with h_wire;
        ids [T, k] int64; w [T, k] float32, C-contiguous): hidden [T, H] in the wire dtype (cast as
        numpy casts), ids, weights: the frame's contents, kept for a re-send."""
        if not 0 <= T <= self.c.max_tokens or k < 0:
            raise ValueError(f"{T} rows x top-{k} outside the connection's bounds")
        cdef cnp.ndarray x = np.empty((T, self.c.H), dtype=np.uint16 if self.c.wire else np.float32)
        cdef cnp.ndarray i = np.empty((T, k), dtype=np.int64)
        cdef cnp.ndarray ww = np.empty((T, k), dtype=np.float32)
        cdef size_t n = <size_t>T * self.c.H
        if h_wire or self.c.wire == 0:
            memcpy(cnp.PyArray_DATA(x), <const void *>h, n * (4 if self.c.wire == 0 else 2))
        else:
            sc_put_rows(cnp.PyArray_DATA(x), self.c.wire, <const float *>h, n)
        memcpy(cnp.PyArray_DATA(i), <const void *>ids, <size_t>T * k * 8)
        memcpy(cnp.PyArray_DATA(ww), <const void *>w, <size_t>T * k * 4)
        return x, i, ww

    def message(self, uint32_t n):
        """The last answer's message (a refusal), n bytes."""
        return (<char *>self.c.body)[:min(n, <uint32_t>TC_MAX_MESSAGE)]


cdef object _error(int rc, int err, str what, Link link):
    if rc == SC_CLOSED:
        return ConnectionError("the shard closed the data connection")
    if rc == SC_FULL:
        return TimeoutError(f"{what}: the socket stayed full")
    if rc == SC_BAD:
        return ConnectionError(f"{what}: more rows than the connection takes")
    if rc == TC_STALLED:
        return ConnectionError(f"{what}: an answer began and its rest did not come in time")
    return ConnectionError(f"{what} failed: {link._why(TIO_ERR) if err == 0 else os.strerror(err)}")
