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
