# cython: language_level=3, boundscheck=False, wraparound=False
"""Cython binding of native_decode.c (see native_decode.h): a `Layer` holds one layer's weight
pointers and dimensions (the tensors themselves are kept alive by the caller's `keep`), a `Step`
one decode step's slots, lengths, RoPE rows and scratch. Pointers are passed as ints
(`tensor.data_ptr()`); gpu_service.model.native_decode checks dtypes, shapes and contiguity.

Use gpu_service.model.native_decode, not this module directly."""
from libc.stdint cimport int64_t

cdef extern from "native_decode.h" nogil:
    ctypedef struct NdLayer:
        int H, nh, nope, rd, r, vd, qlr, interleave
        float eps_in, eps_q, eps_kv, eps_post, scaling
        const float *in_norm
        const float *q_norm
        const float *kv_norm
        const float *post_norm
        const float *w_q
        const float *w_kva
        const float *w_qb
        const float *w_kvb
        const float *w_o
        int E, k, n_group, topk_group, norm_topk
        float route_scale
        const float *w_router
        const float *router_bias
        int inter
        const float *w_gate
        const float *w_up
        const float *w_down
        int ih, ihd, itopk
        float ieps, iscale, iwscale
        const float *w_iq
        const float *w_ik
        const float *ik_norm_w
        const float *ik_norm_b
        const float *w_iw
    ctypedef struct NdStep:
        int B
        long smax
        const int64_t *write_slots
        const int64_t *key_slots
        const int64_t *lengths
        const float *cos
        const float *sin
        float *scratch
    size_t nd_scratch_floats(const NdLayer *L, int B, long smax)
    void nd_attn(const NdLayer *L, const NdStep *S, float *kv, float *ik, const float *x, float *x1, float *h,
                 int64_t *ids, float *w)
    void nd_mlp(const NdLayer *L, int B, const float *h, float *out, float *scratch)
    void nd_add(long n, const float *x, const float *a, const float *b, float *out)


cdef inline const float *fp(size_t p) noexcept nogil:
    return <const float *>p


cdef class Layer:
    """One layer: `dims` (ints / floats by NdLayer field name) and `ptrs` (data_ptr by field name,
    0 for NULL)."""
    cdef NdLayer L
    cdef readonly object keep

    def __init__(self, dict dims, dict ptrs, keep):
        self.keep = keep
        L = &self.L
        L.H, L.nh, L.nope, L.rd = dims["H"], dims["nh"], dims["nope"], dims["rd"]
        L.r, L.vd, L.qlr, L.interleave = dims["r"], dims["vd"], dims["qlr"], dims["interleave"]
        L.eps_in, L.eps_q, L.eps_kv, L.eps_post = dims["eps_in"], dims["eps_q"], dims["eps_kv"], dims["eps_post"]
        L.scaling = dims["scaling"]
        L.E, L.k, L.n_group, L.topk_group = dims["E"], dims["k"], dims["n_group"], dims["topk_group"]
        L.norm_topk, L.route_scale, L.inter = dims["norm_topk"], dims["route_scale"], dims["inter"]
        L.in_norm, L.q_norm, L.kv_norm, L.post_norm = (fp(ptrs["in_norm"]), fp(ptrs["q_norm"]),
                                                      fp(ptrs["kv_norm"]), fp(ptrs["post_norm"]))
        L.w_q, L.w_kva, L.w_qb, L.w_kvb, L.w_o = (fp(ptrs["w_q"]), fp(ptrs["w_kva"]), fp(ptrs["w_qb"]),
                                                 fp(ptrs["w_kvb"]), fp(ptrs["w_o"]))
        L.w_router, L.router_bias = fp(ptrs["w_router"]), fp(ptrs["router_bias"])
        L.w_gate, L.w_up, L.w_down = fp(ptrs["w_gate"]), fp(ptrs["w_up"]), fp(ptrs["w_down"])
        L.ih, L.ihd, L.itopk = dims.get("ih", 0), dims.get("ihd", 0), dims.get("itopk", 0)
        L.ieps, L.iscale, L.iwscale = dims.get("ieps", 0.0), dims.get("iscale", 0.0), dims.get("iwscale", 0.0)
        L.w_iq, L.w_ik, L.w_iw = fp(ptrs.get("w_iq", 0)), fp(ptrs.get("w_ik", 0)), fp(ptrs.get("w_iw", 0))
        L.ik_norm_w, L.ik_norm_b = fp(ptrs.get("ik_norm_w", 0)), fp(ptrs.get("ik_norm_b", 0))

    def scratch_floats(self, int B, long smax):
        """Scratch floats a step of B rows at `smax` key columns needs (nd_attn and nd_mlp)."""
        return nd_scratch_floats(&self.L, B, smax)

    def attn(self, Step st, size_t kv, size_t ik, size_t x, size_t x1, size_t h, size_t ids, size_t w):
        if self.L.ih and not ik:
            raise ValueError("a V3.2 layer needs its index-key cache")
        with nogil:
            nd_attn(&self.L, &st.S, <float *>kv, <float *>ik, fp(x), <float *>x1, <float *>h, <int64_t *>ids,
                    <float *>w)

    def mlp(self, int B, size_t h, size_t out, size_t scratch):
        with nogil:
            nd_mlp(&self.L, B, fp(h), <float *>out, <float *>scratch)


cdef class Step:
    """One decode step's metadata (pointers into tensors the caller keeps alive)."""
    cdef NdStep S

    def __init__(self, int B, long smax, size_t write_slots, size_t key_slots, size_t lengths,
                 size_t cos, size_t sin, size_t scratch):
        self.S.B, self.S.smax = B, smax
        self.S.write_slots, self.S.key_slots = <const int64_t *>write_slots, <const int64_t *>key_slots
        self.S.lengths = <const int64_t *>lengths
        self.S.cos, self.S.sin, self.S.scratch = fp(cos), fp(sin), <float *>scratch


def add(long n, size_t x, size_t a, size_t b, size_t out):
    """out = (a + b) + x, or x + a when b is 0 (n floats)."""
    with nogil:
        nd_add(n, fp(x), fp(a), fp(b), <float *>out)


# ---- native_remote.h: the whole step with its expert hand-offs over shared memory
from libc.stdint cimport int32_t, uint64_t
from libc.stdlib cimport calloc, free

cdef extern from "shm_wire.h" nogil:
    int SHM_DOORBELL_BYTES, SHM_OP_FORWARD, SHM_RESULT_OFFSET, SHM_MSG_OFFSET

cdef extern from "native_remote.h" nogil:
    ctypedef struct NrPath:
        unsigned char *base
        long slot_base[2]
        long hidden_off, ids_off, w_off, out_off
        int fd
        int slot[2]
        int wire
        const unsigned char *held
    ctypedef struct NrCall:
        int32_t layer, path, mb, rows, status, slot
        uint64_t seq
        int64_t sent_ns, rtt_ns
        uint64_t compute_us, server_us
    ctypedef struct NrRun:
        int n_layers, H, k
        const NdLayer *const *layers
        const int *moe_layer
        float *const *kv
        float *const *ik
        int n_mb
        const NdStep *steps[2]
        float *x[2]
        void *buf[2]
        int n_paths
        NrPath *paths
        double timeout_s, spin_s
        uint64_t seq0
        NrCall *calls
        int calls_cap, n_calls
        int fail_path
        char fail_msg[4033]
    size_t nr_buf_bytes(int B, int H, int k)
    int nr_has_f16()
    int nr_run(NrRun *r)
    int nr_send(NrRun *r, int mb, int layer, const void *h, int h_wire, int64_t *ids, float *w, int B, int *rows)
    int nr_wait(NrRun *r, int mb, float *routed)


# wire.shm's constants as the C ends have them (wire/shm_wire.h; tests compare them)
WIRE = {"doorbell_bytes": SHM_DOORBELL_BYTES, "op_forward": SHM_OP_FORWARD, "result_offset": SHM_RESULT_OFFSET,
        "msg_offset": SHM_MSG_OFFSET}


def buf_bytes(int B, int H, int k):
    """Scratch bytes one micro-batch of B rows needs in RemoteRun (nr_buf_bytes)."""
    return nr_buf_bytes(B, H, k)


def has_f16():
    return bool(nr_has_f16())


cdef class _Calls:
    """What both modes share: the claimed paths (per shard group: base, slot_base0, slot_base1,
    hidden_off, ids_off, w_off, out_off, fd, slot0, slot1, wire code, held mask pointer or 0), the
    call records and the failure."""
    cdef NrRun R
    cdef NrPath *pp
    cdef NrCall *cp

    cdef _init_calls(self, int H, int k, list paths, int cap, double timeout_s, double spin_s, uint64_t seq0):
        cdef int j
        cdef NrPath *p
        self.pp = <NrPath *>calloc(max(1, len(paths)), sizeof(NrPath))
        self.cp = <NrCall *>calloc(max(1, cap), sizeof(NrCall))
        if not (self.pp and self.cp):
            raise MemoryError()
        for j, t in enumerate(paths):
            p = &self.pp[j]
            p.base = <unsigned char *><size_t>t[0]
            p.slot_base[0], p.slot_base[1] = t[1], t[2]
            p.hidden_off, p.ids_off, p.w_off, p.out_off = t[3], t[4], t[5], t[6]
            p.fd, p.slot[0], p.slot[1], p.wire = t[7], t[8], t[9], t[10]
            p.held = <const unsigned char *><size_t>t[11]
        R = &self.R
        R.H, R.k = H, k
        R.n_paths, R.paths = len(paths), self.pp
        R.timeout_s, R.spin_s, R.seq0 = timeout_s, spin_s, seq0
        R.calls, R.calls_cap, R.n_calls, R.fail_path = self.cp, cap, 0, -1

    def __dealloc__(self):
        free(self.pp)
        free(self.cp)

    @property
    def fail_path(self):
        return self.R.fail_path

    @property
    def fail_msg(self):
        return (<bytes>self.R.fail_msg).decode("utf-8", "replace")

    def calls(self):
        """[(layer, path, mb, rows, status (-1: no answer yet), slot, seq, sent_ns, rtt_ns, compute_us,
        server_us)] in the order sent."""
        cdef int i
        cdef NrCall *c
        out = []
        for i in range(self.R.n_calls):
            c = &self.cp[i]
            out.append((c.layer, c.path, c.mb, c.rows, c.status, c.slot, c.seq, c.sent_ns, c.rtt_ns,
                        c.compute_us, c.server_us))
        return out

    def path_calls(self):
        """Calls sent per path."""
        cdef int i
        out = [0] * self.R.n_paths
        for i in range(self.R.n_calls):
            out[self.cp[i].path] += 1
        return out


cdef class RemoteRun(_Calls):
    """One step of every layer with its expert hand-offs (nr_run). layers: the Layer of each model
    layer; moe_layer: the id sent to the shards (-1: dense); kv / ik: cache pointers (ik 0: none);
    steps / x / bufs: per micro-batch (1 or 2); paths: see _Calls."""
    cdef const NdLayer **lp
    cdef int *moe
    cdef float **kvp
    cdef float **ikp
    cdef readonly object keep

    def __init__(self, list layers, list moe_layer, list kv, list ik, int H, int k, list steps, list x, list bufs,
                 list paths, double timeout_s, double spin_s, uint64_t seq0):
        cdef int n = len(layers), i
        cdef Layer L
        cdef Step S
        if not (len(moe_layer) == len(kv) == len(ik) == n) or not 1 <= len(steps) == len(x) == len(bufs) <= 2:
            raise ValueError("RemoteRun: inconsistent lengths")
        self._init_calls(H, k, paths, n * len(paths) * len(steps), timeout_s, spin_s, seq0)
        self.keep = (layers, steps)
        self.lp = <const NdLayer **>calloc(n, sizeof(NdLayer *))
        self.moe = <int *>calloc(n, sizeof(int))
        self.kvp = <float **>calloc(n, sizeof(float *))
        self.ikp = <float **>calloc(n, sizeof(float *))
        if not (self.lp and self.moe and self.kvp and self.ikp):
            raise MemoryError()
        for i in range(n):
            L = layers[i]
            self.lp[i] = &L.L
            self.moe[i] = moe_layer[i]
            self.kvp[i] = <float *><size_t>kv[i]
            self.ikp[i] = <float *><size_t>ik[i]
            if L.L.ih and not ik[i]:
                raise ValueError("a V3.2 layer needs its index-key cache")
        R = &self.R
        R.n_layers = n
        R.layers, R.moe_layer, R.kv, R.ik = self.lp, self.moe, self.kvp, self.ikp
        R.n_mb = len(steps)
        for i in range(R.n_mb):
            S = steps[i]
            R.steps[i] = &S.S
            R.x[i] = <float *><size_t>x[i]
            R.buf[i] = <void *><size_t>bufs[i]

    def __dealloc__(self):
        free(self.lp)
        free(self.moe)
        free(self.kvp)
        free(self.ikp)

    def run(self):
        """0: done; else the failure (1 broken doorbell, 2 deadline, 3 refused, 4 signal)."""
        cdef int rc
        with nogil:
            rc = nr_run(&self.R)
        return rc


cdef class RemoteCalls(_Calls):
    """Per-call hand-offs over the claimed paths (nr_send / nr_wait), for layer paths driven from
    Python; room for `cap` calls. Pointers: host memory the caller keeps alive until wait()."""
    cdef int *rows[2]
    cdef int rows_cap

    def __init__(self, int H, int k, list paths, int cap, int max_rows, double timeout_s, double spin_s,
                 uint64_t seq0):
        self._init_calls(H, k, paths, cap, timeout_s, spin_s, seq0)
        self.rows[0] = <int *>calloc(max(1, max_rows), sizeof(int))
        self.rows[1] = <int *>calloc(max(1, max_rows), sizeof(int))
        if not (self.rows[0] and self.rows[1]):
            raise MemoryError()
        self.rows_cap = max_rows

    def __dealloc__(self):
        free(self.rows[0])
        free(self.rows[1])

    def send(self, int mb, int layer, size_t h, int h_wire, size_t ids, size_t w, int B):
        cdef int rc
        if not 0 <= mb <= 1 or not 0 < B <= self.rows_cap:
            raise ValueError(f"RemoteCalls.send: micro-batch {mb}, {B} rows (at most {self.rows_cap})")
        with nogil:
            rc = nr_send(&self.R, mb, layer, <const void *>h, h_wire, <int64_t *>ids, <float *>w, B, self.rows[mb])
        return rc

    def wait(self, int mb, size_t routed):
        cdef int rc
        if not 0 <= mb <= 1:
            raise ValueError(f"RemoteCalls.wait: micro-batch {mb}")
        with nogil:
            rc = nr_wait(&self.R, mb, <float *>routed)
        return rc
