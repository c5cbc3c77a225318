# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython binding of the C MoE kernels (moe.h): one `Engine` per backend, holding its thread
pool, its kernel table (fixed at construction) and the packed experts of every layer; `ShmServe`,
the shard's C serving loops (shared memory, and the TCP data path over a `Link`, plaintext or
mutual TLS: wire/tcp_link.pxi).

Use cpu_expert_service.kernel_backend.KernelExperts, not this module directly."""
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t
from libc.stdlib cimport calloc, free, realloc
from libc.errno cimport EDOM

import os

import numpy as np

include "tcp_link.pxi"

cdef extern from "moe.h" nogil:
    int MOE_FMT_BF16, MOE_FMT_INT8, MOE_FMT_INT4, MOE_FMT_MXFP4
    int MOE_ISA_GENERIC, MOE_ISA_AVX2, MOE_ISA_AVX512, MOE_ISA_AMX
    ctypedef struct MoePool:
        pass
    ctypedef struct MoeKernels:
        int isa
        float swiglu_limit
        int act_bits
    ctypedef struct MoeMat:
        int Np, Kp
    ctypedef struct MoeExpert:
        int H, I
        MoeMat gu, dn
    void moe_kernels_generic(MoeKernels *k)
    void moe_kernels_avx2(MoeKernels *k)
    void moe_kernels_avx512(MoeKernels *k)
    void moe_kernels_amx(MoeKernels *k)
    int moe_cpu_has(int isa)
    int moe_bf16_dot_fma()
    long moe_amx_tile_ops()
    double moe_probe_avx512(int kind, long iters)
    double moe_probe_avx2(int kind, long iters)
    double moe_probe_read(MoePool *pool, const unsigned char *buf, size_t nbytes)
    MoePool *moe_pool_create(int nthreads, const int *cpus, int ncpus)
    void moe_pool_destroy(MoePool *pool)
    int moe_expert_pack_float(MoePool *pool, MoeExpert *e, int fmt, int H, int I,
                              const float *gate, const float *up, const float *down)
    int moe_expert_pack_int4(MoePool *pool, MoeExpert *e, int H, int I,
                             const int32_t *gp, const uint16_t *gs, const int32_t *upk,
                             const uint16_t *us, const int32_t *dp, const uint16_t *ds)
    int moe_expert_pack_mxfp4(MoePool *pool, MoeExpert *e, int H, int I,
                              const uint8_t *gb, const uint8_t *gs, const uint8_t *ub,
                              const uint8_t *us, const uint8_t *db, const uint8_t *ds)
    void moe_expert_free(MoeExpert *e)
    size_t moe_expert_bytes(const MoeExpert *e)
    void moe_expert_unpack(const MoeExpert *e, int which, float *out)
    int moe_forward(MoePool *pool, const MoeKernels *kern, MoeExpert *const *experts, int n_experts,
                    int fmt, int H, int I, const float *x, int T, const int64_t *ids, const float *w,
                    int k, float *out)

ISAS = {"generic": MOE_ISA_GENERIC, "avx2": MOE_ISA_AVX2, "avx512": MOE_ISA_AVX512, "amx": MOE_ISA_AMX}
FORMATS = {"bf16": MOE_FMT_BF16, "int8": MOE_FMT_INT8, "int4": MOE_FMT_INT4, "mxfp4": MOE_FMT_MXFP4}


def cpu_has(str isa):
    """True if this CPU and OS can run the kernels of `isa` (for amx: also asks the kernel for
    XTILEDATA permission, which is what makes it usable)."""
    return bool(moe_cpu_has(ISAS[isa]))


def bf16_dot_form():
    """The form an AVX-512 bf16 kernel table made now takes: "fma" (widened weights x f32 FMA)
    or "dpbf16" (vdpbf16ps); see moe_bf16_dot_fma in moe.h ($MOESPLIT_BF16_DOT overrides)."""
    return "fma" if moe_bf16_dot_fma() else "dpbf16"


def amx_tile_ops():
    """Tile multiplies (TDPBF16PS, TDPBSUD) run so far in this process by a build with
    -DMOE_AMX_EMULATE (software tiles, amx_emu.h), all threads: tests check which kernel path a call
    took. -1 in a normal build, which does not count the real instructions."""
    return moe_amx_tile_ops()


# compute-ceiling probes: kind -> (ISA it needs, index in that ISA's probe function)
PROBES = {"fma_f32": ("avx512", 0), "dpbf16": ("avx512", 1), "vnni_int8": ("avx512", 2),
          "fma_f32_avx2": ("avx2", 0), "maddubs_int8_avx2": ("avx2", 1),
          "int8_exact_wd_avx2": ("avx2", 2), "int8_exact_sign_avx2": ("avx2", 3)}


def probe_peak(str kind, long iters):
    """Run `iters` rounds of a compute-ceiling probe (a key of PROBES: 12 independent vector
    chains of one instruction) on this thread without the GIL; returns the operations done
    (2 per multiply-add; the caller times it, on several threads)."""
    isa, k = PROBES[kind]
    cdef double ops
    cdef int ki = k, wide = isa == "avx512"
    if not moe_cpu_has(ISAS[isa]):
        raise RuntimeError(f"probe_peak({kind!r}) needs {'AVX-512 BF16/VNNI' if isa == 'avx512' else 'AVX2'} "
                           "(this CPU lacks it)")
    with nogil:
        ops = moe_probe_avx512(ki, iters) if wide else moe_probe_avx2(ki, iters)
    return ops


cdef class _Layer:
    """Packed experts of one layer, indexed by global expert id."""
    cdef MoeExpert **by_id
    cdef int cap
    cdef public int H, I

    def __cinit__(self):
        self.by_id = NULL
        self.cap = 0
        self.H = -1
        self.I = -1

    cdef MoeExpert *slot(self, int expert) except NULL:
        cdef int newcap, i
        if expert >= self.cap:
            newcap = max(expert + 1, 2 * self.cap, 16)
            p = <MoeExpert **>realloc(self.by_id, newcap * sizeof(MoeExpert *))
            if p == NULL:
                raise MemoryError()
            self.by_id = p
            for i in range(self.cap, newcap):
                self.by_id[i] = NULL
            self.cap = newcap
        if self.by_id[expert] == NULL:
            self.by_id[expert] = <MoeExpert *>calloc(1, sizeof(MoeExpert))
            if self.by_id[expert] == NULL:
                raise MemoryError()
        else:
            moe_expert_free(self.by_id[expert])
        return self.by_id[expert]

    cdef MoeExpert *get(self, int expert):
        if expert < 0 or expert >= self.cap:
            return NULL
        return self.by_id[expert]

    def __dealloc__(self):
        cdef int i
        if self.by_id != NULL:
            for i in range(self.cap):
                if self.by_id[i] != NULL:
                    moe_expert_free(self.by_id[i])
                    free(self.by_id[i])
            free(self.by_id)


cdef class Engine:
    """Thread pool + kernel table + packed experts. fmt: bf16|int8|int4|mxfp4 (mxfp4: add_mxfp4 only); isa: a key of ISAS that
    cpu_has() accepted; cpus: the CPUs to pin thread i to (cpus[i % len]); swiglu_limit: L > 0
    clamps gate to <= L and up to [-L, L] before silu(gate) * up (DeepSeek-V4), 0 = off; act_bits: the
    integer formats' activation quantisation, 16 (two-level int8) or 8 (one level; not for bf16)."""
    cdef MoePool *pool
    cdef MoeKernels kern
    cdef int fmt
    cdef dict layers
    cdef readonly int num_threads
    cdef readonly str isa, format
    cdef readonly float swiglu_limit
    cdef readonly int act_bits

    def __cinit__(self, str fmt, str isa, int num_threads, cpus, float swiglu_limit=0.0, int act_bits=16):
        self.pool = NULL
        if fmt not in FORMATS:
            raise ValueError(f"unknown weight format {fmt!r}; expected one of {sorted(FORMATS)}")
        if isa not in ISAS:
            raise ValueError(f"unknown ISA {isa!r}; expected one of {sorted(ISAS)}")
        if not moe_cpu_has(ISAS[isa]):
            raise RuntimeError(f"this CPU/OS cannot run the {isa} kernels")
        self.fmt = FORMATS[fmt]
        self.format = fmt
        self.isa = isa
        if isa == "amx":
            moe_kernels_amx(&self.kern)
        elif isa == "avx512":
            moe_kernels_avx512(&self.kern)
        elif isa == "avx2":
            moe_kernels_avx2(&self.kern)
        else:
            moe_kernels_generic(&self.kern)
        if not swiglu_limit >= 0.0 or swiglu_limit == float("inf"):
            raise ValueError(f"swiglu_limit {swiglu_limit} must be finite and >= 0 (0 = off)")
        self.kern.swiglu_limit = swiglu_limit
        self.swiglu_limit = swiglu_limit
        if act_bits not in (8, 16) or (act_bits == 8 and fmt == "bf16"):
            raise ValueError(f"act_bits {act_bits} for {fmt} weights: use 16 (two-level int8 activations), or 8 "
                             f"(one level) with int8/int4/mxfp4 weights; bf16 weights take bf16 activations")
        self.kern.act_bits = act_bits
        self.act_bits = act_bits
        cdef int[::1] cpuv = np.ascontiguousarray(np.asarray(list(cpus), dtype=np.int32))
        self.num_threads = max(1, num_threads)
        self.pool = moe_pool_create(self.num_threads, &cpuv[0] if cpuv.shape[0] else NULL, cpuv.shape[0])
        if self.pool == NULL:
            raise MemoryError()
        self.layers = {}

    def __dealloc__(self):
        self.layers = None  # free experts before the pool
        if self.pool != NULL:
            moe_pool_destroy(self.pool)

    cdef _Layer _layer(self, int layer, int H, int I):
        cdef _Layer L = self.layers.get(layer)
        if L is None:
            L = _Layer()
            L.H, L.I = H, I
            self.layers[layer] = L
        elif (L.H, L.I) != (H, I):
            raise ValueError(f"layer {layer}: expert shape H={H}, I={I} differs from the layer's "
                             f"H={L.H}, I={L.I}; all experts of a layer must share one shape")
        return L

    def add_float(self, int layer, int expert, const float[:, ::1] gate, const float[:, ::1] up,
                  const float[:, ::1] down):
        cdef int I = gate.shape[0], H = gate.shape[1], rc
        if self.fmt == MOE_FMT_MXFP4:
            raise ValueError("an mxfp4 engine takes the checkpoint's blocks and scales: use add_mxfp4")
        cdef _Layer L = self._layer(layer, H, I)
        cdef MoeExpert *e = L.slot(expert)
        with nogil:
            rc = moe_expert_pack_float(self.pool, e, self.fmt, H, I, &gate[0, 0], &up[0, 0], &down[0, 0])
        if rc != 0:
            raise MemoryError(f"packing layer {layer} expert {expert} failed ({rc})")

    def add_int4(self, int layer, int expert, int H, int I,
                 const int32_t[:, ::1] gp, const uint16_t[:, ::1] gs,
                 const int32_t[:, ::1] upk, const uint16_t[:, ::1] us,
                 const int32_t[:, ::1] dp, const uint16_t[:, ::1] ds):
        if self.fmt != MOE_FMT_INT4:
            raise ValueError("add_int4 needs an int4 engine")
        cdef int rc
        cdef _Layer L = self._layer(layer, H, I)
        cdef MoeExpert *e = L.slot(expert)
        with nogil:
            rc = moe_expert_pack_int4(self.pool, e, H, I, &gp[0, 0], &gs[0, 0], &upk[0, 0], &us[0, 0],
                                      &dp[0, 0], &ds[0, 0])
        if rc != 0:
            raise MemoryError(f"packing layer {layer} expert {expert} failed ({rc})")

    def add_mxfp4(self, int layer, int expert, int H, int I,
                  const uint8_t[:, ::1] gb, const uint8_t[:, ::1] gs,
                  const uint8_t[:, ::1] ub, const uint8_t[:, ::1] us,
                  const uint8_t[:, ::1] db, const uint8_t[:, ::1] ds):
        """Pack one expert from its MXFP4 tensors as stored: blocks u8 [out, in/2] (low nibble = element
        2j), e8m0 scales u8 [out, in/32]; gate/up [I, H], down [H, I]; H and I multiples of 32."""
        if self.fmt != MOE_FMT_MXFP4:
            raise ValueError("add_mxfp4 needs an mxfp4 engine")
        if H % 32 or I % 32:
            raise ValueError(f"mxfp4 needs H ({H}) and I ({I}) multiples of 32 (one e8m0 scale per 32 inputs)")
        for name, t, rows, cols in (("gate blocks", gb, I, H // 2), ("gate scales", gs, I, H // 32),
                                    ("up blocks", ub, I, H // 2), ("up scales", us, I, H // 32),
                                    ("down blocks", db, H, I // 2), ("down scales", ds, H, I // 32)):
            if t.shape[0] != rows or t.shape[1] != cols:
                raise ValueError(f"{name} shape ({t.shape[0]}, {t.shape[1]}) != ({rows}, {cols}) for H={H}, I={I}")
        cdef int rc
        cdef _Layer L = self._layer(layer, H, I)
        cdef MoeExpert *e = L.slot(expert)
        with nogil:
            rc = moe_expert_pack_mxfp4(self.pool, e, H, I, &gb[0, 0], &gs[0, 0], &ub[0, 0], &us[0, 0],
                                       &db[0, 0], &ds[0, 0])
        if rc == -EDOM:
            raise ValueError(f"layer {layer} expert {expert}: an e8m0 scale is 255 (NaN in OCP MX): the checkpoint's "
                             f"block scales are corrupt; re-export it")
        if rc != 0:
            raise MemoryError(f"packing layer {layer} expert {expert} failed ({rc})")

    def read_probe(self, const unsigned char[::1] buf):
        """Seconds for this engine's threads (pinned as for the kernels) to stream-read `buf` once,
        each its contiguous share: the read-bandwidth ceiling of a weight stream. buf: 64-byte
        aligned, its length a multiple of 256 x threads."""
        cdef size_t n = buf.shape[0]
        cdef double s
        if n % (256 * self.num_threads) or (<size_t>&buf[0]) % 64:
            raise ValueError(f"read_probe: buffer must be 64-byte aligned and a multiple of {256 * self.num_threads} bytes")
        with nogil:
            s = moe_probe_read(self.pool, &buf[0], n)
        return s

    def has_layer(self, int layer):
        return layer in self.layers

    def layer_shape(self, int layer):
        cdef _Layer L = self.layers[layer]
        return L.H, L.I

    def forward(self, int layer, const float[:, ::1] x, const int64_t[:, ::1] ids, const float[:, ::1] w):
        cdef int T = x.shape[0], H = x.shape[1], k = ids.shape[1], rc = 0
        out = np.zeros((T, H), dtype=np.float32)
        cdef float[:, ::1] ov = out
        cdef _Layer L = self.layers.get(layer)
        if L is None or T == 0 or k == 0:
            return out
        if H != L.H:
            raise ValueError(f"layer {layer}: x has hidden size {H}, the experts have {L.H}")
        with nogil:
            rc = moe_forward(self.pool, &self.kern, L.by_id, L.cap, self.fmt, H, L.I, &x[0, 0], T,
                             &ids[0, 0], &w[0, 0], k, &ov[0, 0])
        if rc != 0:
            raise MemoryError(f"moe_forward failed ({rc})")
        return out

    def unpack(self, int layer, int expert, str which):
        """The dequantised weight the kernels use: gate/up [I, H], down [H, I] f32."""
        cdef _Layer L = self.layers[layer]
        cdef MoeExpert *e = L.get(expert)
        if e == NULL:
            raise KeyError(f"layer {layer} has no expert {expert}")
        idx = {"gate": 0, "up": 1, "down": 2}[which]
        out = np.empty((L.I, L.H) if idx < 2 else (L.H, L.I), dtype=np.float32)
        cdef float[:, ::1] ov = out
        moe_expert_unpack(e, idx, &ov[0, 0])
        return out

    def weight_bytes(self, layer=None):
        cdef size_t total = 0
        cdef _Layer L
        cdef int i
        for lid, L in self.layers.items():
            if layer is not None and lid != layer:
                continue
            for i in range(L.cap):
                if L.by_id[i] != NULL:
                    total += moe_expert_bytes(L.by_id[i])
        return total

    def expert_bytes(self, int layer, int expert):
        cdef _Layer L = self.layers[layer]
        cdef MoeExpert *e = L.get(expert)
        return 0 if e == NULL else moe_expert_bytes(e)


# ---- moe_shm.h: one client's shared-memory doorbell loop, without the GIL
from libc.stdint cimport uint32_t, uint64_t
from libc.string cimport memcpy

cdef extern from "shm_wire.h" nogil:
    int SHM_DOORBELL_BYTES, SHM_OP_FORWARD, SHM_RESULT_OFFSET, SHM_MSG_OFFSET, SHM_MSG_MAX

cdef extern from "moe_shm.h" nogil:
    int MOE_SHM_CLOSED, MOE_SHM_BAD_DOORBELL, MOE_SHM_INTERNAL, MOE_TCP_BAD_FRAME, MOE_TCP_STALLED
    ctypedef struct MoeShmRec:
        int32_t layer, T
        int64_t wait_ns, kernel_ns
    cdef struct MoeShm
    ctypedef int (*MoeShmCompute)(MoeShm *s, int layer, int T, int k, char *err, size_t cap) noexcept
    cdef struct MoeShm:
        unsigned char *base
        int fd, n_slots, max_tokens, max_k
        long header_bytes, slot_bytes, hidden_off, ids_off, w_off, out_off
        int H, E, shard_max_tokens, n_layers
        const unsigned char *served
        const char *shard_id
        const char *served_text
        double spin_s
        MoeShmCompute compute
        void *ctx
        MoePool *pool
        const MoeKernels *kern
        int fmt
        MoeExpert *const *const *experts
        const int *cap
        const int *inter
        const int *hid
        float *x
        float *w
        float *out
        int64_t *ids
        int64_t *kids
        int64_t *tokens
        int64_t *acts
        const unsigned char *held
        MoeShmRec *ring
        uint64_t ring_cap, head, tail, dropped
        uint32_t slot
        uint64_t seq
        char msg[1]
    uint64_t moe_shm_head(const MoeShm *s)
    void moe_shm_set_tail(MoeShm *s, uint64_t t)
    uint64_t moe_shm_dropped(const MoeShm *s)
    int moe_shm_kernels(MoeShm *s, int layer, int T, int k, char *err, size_t cap) noexcept
    int moe_shm_serve(MoeShm *s)
    int moe_tcp_serve(MoeShm *s, TcpIo *io, unsigned char *req, size_t req_cap, unsigned char *out, int K,
                      double frame_timeout_s)

SHM_CLOSED, SHM_BAD_DOORBELL, SHM_INTERNAL = MOE_SHM_CLOSED, MOE_SHM_BAD_DOORBELL, MOE_SHM_INTERNAL
TCP_BAD_FRAME, TCP_STALLED = MOE_TCP_BAD_FRAME, MOE_TCP_STALLED
# wire.shm's constants as shm_wire.h has them (tests compare them)
SHM_WIRE = {"doorbell_bytes": SHM_DOORBELL_BYTES, "op_forward": SHM_OP_FORWARD,
            "result_offset": SHM_RESULT_OFFSET, "msg_offset": SHM_MSG_OFFSET, "msg_max": SHM_MSG_MAX}


cdef int _py_compute(MoeShm *s, int layer, int T, int k, char *err, size_t cap) noexcept nogil:
    """moe_shm.h's compute for a backend that is not the kernels: its forward, with the GIL."""
    with gil:
        return (<ShmServe><object>s.ctx).py_forward(layer, T, k, err, cap)


cdef class ShmServe:
    """One client's doorbell loop (moe_shm_serve): the shard's only shared-memory loop.

    base: the mapping's address (kept mapped by the caller); layout: wire.shm.Layout's (n_slots,
    max_tokens, max_k, header_bytes, slot_bytes, hidden_off, ids_off, w_off, out_off); layers: the
    layer ids the shard serves, served_text their compact form for the refusal message; the compute:
    `eng` (an Engine: all in C) or `forward` (a backend's forward(layer, x, ids, w) -> [T, H], called
    with the GIL on the converted rows); tokens [n_layers] / acts [n_layers, E] int64 / held [E]
    uint8: metric counts (None: not counted); ring: records the drainer takes (0: none)."""
    cdef MoeShm S
    cdef Engine eng
    cdef object forward
    cdef MoeExpert ***tab
    cdef int *capv
    cdef int *interv
    cdef int *hidv
    cdef object keep, xs, ids, ws, outs
    cdef public object error  # the exception of the last call answered INTERNAL by `forward`

    def __init__(self, size_t base, int fd, tuple layout, int H, int E, int shard_max_tokens, layers,
                 double spin_s, str shard_id, str served_text, Engine eng=None, forward=None, tokens=None,
                 acts=None, held=None, int ring=0):
        cdef int n
        cdef int64_t[::1] tv
        cdef int64_t[:, ::1] av
        cdef const unsigned char[::1] hv, sv
        if (eng is None) == (forward is None):
            raise ValueError("ShmServe computes with an Engine or a forward callable: pass exactly one")
        S = &self.S
        (S.n_slots, S.max_tokens, S.max_k, S.header_bytes, S.slot_bytes, S.hidden_off, S.ids_off, S.w_off,
         S.out_off) = layout
        S.base, S.fd, S.H, S.E, S.shard_max_tokens, S.spin_s = <unsigned char *>base, fd, H, E, shard_max_tokens, \
            spin_s
        served = sorted(l for l in layers if l >= 0)
        n = (max(served) + 1) if served else 0
        S.n_layers = n
        mask = np.zeros(max(1, n), dtype=np.uint8)
        mask[served] = 1
        sid, stext = shard_id.encode(), served_text.encode()
        self.keep = [mask, sid, stext, tokens, acts, held]
        sv = mask
        S.served, S.shard_id, S.served_text = &sv[0], sid, stext
        # scratch rows, owned here as numpy arrays (the views `forward` gets are read-only)
        cdef float[::1] xv, wv, ov
        cdef int64_t[::1] iv, kv
        xs, ws = np.zeros(S.max_tokens * H, np.float32), np.zeros(S.max_tokens * S.max_k, np.float32)
        outs = np.zeros(S.max_tokens * H, np.float32)
        ids, kids = np.zeros(S.max_tokens * S.max_k, np.int64), np.zeros(S.max_tokens * S.max_k, np.int64)
        xv, wv, ov, iv, kv = xs, ws, outs, ids, kids
        S.x, S.w, S.out, S.ids, S.kids = &xv[0], &wv[0], &ov[0], &iv[0], &kv[0]
        self.keep += [kids]
        self.xs, self.ws, self.ids, self.outs = xs.view(), ws.view(), ids.view(), outs.reshape(S.max_tokens, H)
        for a in (self.xs, self.ws, self.ids):
            a.flags.writeable = False
        self.xs = self.xs.reshape(S.max_tokens, H)
        if ring:
            if ring & (ring - 1):
                raise ValueError("ring must be a power of two")
            S.ring = <MoeShmRec *>calloc(ring, sizeof(MoeShmRec))
            if S.ring == NULL:
                raise MemoryError()
            S.ring_cap = ring
        if forward is not None:
            self.forward = forward
            S.compute, S.ctx = _py_compute, <void *>self
        else:
            self._tables(eng, n)
        if tokens is not None:
            tv = tokens
            if tv.shape[0] < n:
                raise ValueError("tokens: one counter per layer id")
            S.tokens = &tv[0]
            if acts is not None:
                av = acts
                hv = held
                if av.shape[0] < n or av.shape[1] != E or hv.shape[0] != E:
                    raise ValueError("acts [layers, E] and held [E]")
                S.acts, S.held = &av[0, 0], &hv[0]

    cdef _tables(self, Engine eng, int n):
        """moe_shm_kernels' per-layer expert tables over `eng` (NULL where it holds no layer)."""
        cdef _Layer L
        cdef int i
        S = &self.S
        self.eng = eng
        self.tab = <MoeExpert ***>calloc(max(1, n), sizeof(MoeExpert **))
        self.capv = <int *>calloc(max(1, n), sizeof(int))
        self.interv = <int *>calloc(max(1, n), sizeof(int))
        self.hidv = <int *>calloc(max(1, n), sizeof(int))
        if not (self.tab and self.capv and self.interv and self.hidv):
            raise MemoryError()
        for i in range(n):
            if S.served[i] and i in eng.layers:
                L = eng.layers[i]
                self.tab[i], self.capv[i], self.interv[i], self.hidv[i] = L.by_id, L.cap, L.I, L.H
        S.experts, S.cap, S.inter, S.hid = <MoeExpert *const *const *>self.tab, self.capv, self.interv, self.hidv
        S.pool, S.kern, S.fmt, S.compute = eng.pool, &eng.kern, eng.fmt, moe_shm_kernels

    cdef int py_forward(self, int layer, int T, int k, char *err, size_t cap) noexcept:
        try:
            self.outs[:T] = self.forward(layer, self.xs[:T], self.ids[:T * k].reshape(T, k),
                                         self.ws[:T * k].reshape(T, k))  # [T, H], cast as numpy casts
            return 0
        except BaseException as e:  # noqa: BLE001 - a backend bug: an INTERNAL answer, the loop serves on
            self.error = e
            m = f"{type(e).__name__}: {e}".encode()[:cap - 1]
            memcpy(err, <const char *>m, len(m))
            err[len(m)] = 0
            return -1

    def __dealloc__(self):
        free(self.tab)
        free(self.capv)
        free(self.interv)
        free(self.hidv)
        free(self.S.ring)

    def serve(self):
        """Serve until the client goes (SHM_CLOSED), a bad doorbell (SHM_BAD_DOORBELL) or right after
        a call answered INTERNAL (SHM_INTERNAL: `last` says which and why; call serve() again)."""
        cdef int rc
        self.error = None
        with nogil:
            rc = moe_shm_serve(&self.S)
        return rc

    def serve_tcp(self, Link link, size_t req, size_t req_cap, size_t out, int K, double frame_timeout_s):
        """The TCP data path's loop on link (moe_tcp_serve: plaintext or TLS; built with layout (1,
        max_tokens, K, 0, req_cap, 0, 0, 0, 0)): frames' payloads into the buffer at `req` (req_cap bytes),
        answers from `out` (max_tokens x H x 4 bytes); both kept alive by the caller. SHM_CLOSED when
        the client goes, TCP_BAD_FRAME / TCP_STALLED (`last` says which seq), or SHM_INTERNAL after a call answered
        INTERNAL (call serve_tcp() again)."""
        cdef int rc
        self.error = None
        with nogil:
            rc = moe_tcp_serve(&self.S, &link.io, <unsigned char *>req, req_cap, <unsigned char *>out, K,
                               frame_timeout_s)
        return rc

    @property
    def compute(self):
        """"kernels" (moe_forward over the Engine, all in C) or "forward" (the backend's, with the GIL)."""
        return "forward" if self.forward is not None else "kernels"

    @property
    def last(self):
        """(slot, seq, message) of the bad doorbell or the call last answered INTERNAL."""
        return self.S.slot, self.S.seq, self.S.msg.decode("utf-8", "replace")

    def drain(self):
        """The records since the last drain: int64 [n, 4] (layer, T, queue wait ns, kernel ns or -1
        when the compute failed), and how many were dropped so far (the ring was full)."""
        cdef uint64_t head = moe_shm_head(&self.S), tail = self.S.tail, i
        cdef MoeShmRec *r
        out = np.empty((head - tail, 4), dtype=np.int64)
        cdef int64_t[:, ::1] ov = out
        for i in range(head - tail):
            r = &self.S.ring[(tail + i) & (self.S.ring_cap - 1)]
            ov[i, 0], ov[i, 1], ov[i, 2], ov[i, 3] = r.layer, r.T, r.wait_ns, r.kernel_ns
        moe_shm_set_tail(&self.S, head)
        return out, moe_shm_dropped(&self.S)
