/* moesplit CPU MoE kernels: shared declarations.
 *
 * Packed weight layouts (the same for every ISA, chosen at load time):
 *
 *   A weight matrix W [N out, K in] is padded to Np x Kp (Kp = K rounded up to 32) and cut
 *   into panels of NP output
 *   channels; panels are stored one after another, each a single contiguous stream, so a
 *   thread that owns panels [p0, p1) streams one contiguous range.
 *
 *   bf16 (NP = 64):  panel = [Kp/2][64 ch][2] bf16          (vdpbf16ps / AMX B-tile layout)
 *   int8 (NP = 32):  panel = [Kp/32 groups][8 quads][32 ch][4] u8 (w + 128)  (vpdpbusd layout)
 *                    + per-channel f32 scales in a separate array [Np]
 *   int4 (NP = 32):  panel = [Kp/32 groups] of { [4 octets][32 ch][4] u8, [32 ch] bf16 scale }  (576 B)
 *                    byte j of channel c in octet o: low nibble  = q+8 of k = 8o + j,
 *                                                    high nibble = q+8 of k = 8o + 4 + j
 *   mxfp4 (NP = 32): panel = [Kp/32 groups] of { the int4 nibble layout of the e2m1 codes as stored,
 *                    [32 ch] e8m0 byte as stored }  (544 B: 4.25 bits a weight, what the checkpoint holds)
 *
 *   gate and up are fused into one matrix whose panel holds NP/2 gate channels followed by
 *   the same NP/2 up channels, so silu(gate) * up is finished per panel.
 *
 * Activations (one format per weight format, whatever the batch, so a row's result does not
 * depend on its neighbours): bf16 rows [Kp] for bf16; for int8/int4, two-level int8 rows [2*Kp]: per group g
 * of 32, 32 bytes q1 then 32 bytes q2 with x ~= (254*q1 + q2) * xs[g], and a correction
 * xc[g] = offset * xs[g] * sum(254*q1 + q2) (offset 128 for int8, 8 for int4, 12 for mxfp4), so kernels that
 * multiply unsigned weights (vpdpbusd, tdpbsud) subtract it. With 8-bit activations (MoeKernels.act_bits
 * 8, chosen per engine) every q2 is 0: x ~= 254 * q1 * xs[g], the same layout, so every kernel computes
 * them unchanged; the AVX-512 micro-kernel then skips the q2 products (half the vpdpbusd).
 */
#ifndef MOESPLIT_MOE_H
#define MOESPLIT_MOE_H

#include <stddef.h>
#include <stdint.h>

#define MOE_FMT_BF16 0
#define MOE_FMT_INT8 1
#define MOE_FMT_INT4 2
#define MOE_FMT_MXFP4 3
#define MOE_NFMT 4

#define MOE_ISA_GENERIC 0
#define MOE_ISA_AVX2 1
#define MOE_ISA_AVX512 2
#define MOE_ISA_AMX 3

#define MOE_GROUP 32
/* floats between the f32 activation rows of K inputs: a line more than K, so rows a multiple of 4 KiB
 * long do not all fall in the same L1 sets (the AVX2 bf16 tile reads 6 rows at once) */
#define MOE_F32_ROW(K) ((K) + 16)
#define MOE_NP_BF16 64
#define MOE_NP_INT 32
#define MOE_INT4_GROUP_BYTES (4 * 32 * 4 + 32 * 2) /* weights + bf16 scales = 576 */
#define MOE_MXFP4_GROUP_BYTES (4 * 32 * 4 + 32)    /* e2m1 codes + e8m0 bytes = 544 */
#define MOE_MXFP4_OFFSET 12 /* the unsigned mxfp4 weight is 2 * e2m1 + 12 */
#define MOE_E8M0_NAN 255    /* the e8m0 NaN scale: refused at load (moe_expert_pack_mxfp4 -> -EDOM) */

/* e2m1 code (bit 3 sign) -> 2 * value + 12: 0,.5,1,1.5,2,3,4,6 doubled, offset to be unsigned */
#define MOE_MXFP4_U8_VALUES 12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0 /* also AVX2 asm's ub_lut */
static const uint8_t moe_mxfp4_u8[16] = {MOE_MXFP4_U8_VALUES};

/* Bytes of one 32-input group of a nibble format's panel (int4, mxfp4). */
static inline size_t moe_nibble_group_bytes(int fmt) {
    return fmt == MOE_FMT_MXFP4 ? MOE_MXFP4_GROUP_BYTES : MOE_INT4_GROUP_BYTES;
}

/* e8m0 byte e -> its value 2^(e - 127) in f32, exact for every e in 0..254 (2^-127 is an f32 subnormal):
 * bits(max(e << 23, 2^-127's)), the kernels' mxfp4 group scale. The table doubles the e2m1 values (2 *
 * value + 12); the halving is in the activation scale of mxfp4 rows (quant_row: xs = amax / 127 / 508),
 * not per group. The ISA files compute the same two steps on vectors of bytes (one definition). */
static inline float moe_mxfp4_scale(uint8_t e) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)e << 23;
    if (v.u < 0x00400000u) v.u = 0x00400000u;
    return v.f;
}

/* a rounded up to a multiple of b */
static inline int moe_rup(int a, int b) { return (a + b - 1) / b * b; }

/* thread tid's share [*p0, *p1) of P items split over nt threads (packing and compute split alike) */
static inline void moe_part(int P, int tid, int nt, int *p0, int *p1) {
    *p0 = (int)((long)P * tid / nt);
    *p1 = (int)((long)P * (tid + 1) / nt);
}

/* One packed matrix. */
typedef struct {
    int fmt;
    int N, K;   /* logical */
    int Np, Kp; /* padded: Np multiple of NP, Kp multiple of 32 */
    int NP;     /* channels per panel */
    size_t panel_bytes;
    uint8_t *data;  /* n_panels * panel_bytes */
    float *chscale; /* int8: [Np] per-channel scale; else NULL */
} MoeMat;

/* Activation rows handed to a kernel: n rows, each Kp long. */
typedef struct {
    int n;
    const uint16_t *const *b;  /* bf16 rows */
    const float *const *f;     /* the same bf16 values in f32 (exact; bf16 format only) */
    const int8_t *const *q;    /* two-level int8 rows [2*Kp] */
    const float *const *xs;    /* [Kp/32] group scales per row */
    const float *const *xc;    /* [Kp/32] corrections per row */
    int act8;                  /* 1: every q2 is 0 (8-bit activations); kernels may skip them */
    /* 8-bit-activation mxfp4 only (else NULL): [2 * Kp/32] per row; per group g, xo[2g] = two int16,
     * offset * the sum of q1[k] over k % 4 < 2 (low half) and over k % 4 >= 2 (high half), and xo[2g + 1]
     * = offset * 254 * sum(q1): the offset's part of the AVX2 micro-kernel's sums */
    const int32_t *const *xo;
} MoeRows;

/* Kernel: C[m][c] (m < rows->n, c < NP, row stride NP) = sum_k x[m][k] * W[panel*NP + c][k]
 * for panel p of W.  scratch: per-thread, 64-byte aligned, at least moe_scratch_bytes(Kp). */
typedef void (*moe_panel_fn)(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);

static inline size_t moe_scratch_bytes(int Kp) { return (size_t)16 * Kp * 2 + 65536; }

/* out[i] = silu(g[i]) * u[i] for i < n; if outb, also its bf16 (round to nearest even) */
typedef void (*moe_act_fn)(const float *g, const float *u, int n, float *out, uint16_t *outb);

typedef struct {
    int isa;
    moe_panel_fn panel[MOE_NFMT]; /* by format */
    moe_act_fn act;
    /* SwiGLU clamp before act (DeepSeek-V4's swiglu_limit L): gate = min(gate, L), up = min(max(up, -L), L),
     * as transformers' DeepseekV4Experts; 0 = off (no clamp: V3). Set by the owner after the table. */
    float swiglu_limit;
    /* Integer formats' activations: 16 = two-level int8 (q1, q2: ~2^-15 relative per group), 8 = one
     * level (q2 = 0: ~2^-8, the usual int8 activation quantisation, half the integer products in the
     * AVX-512 micro-kernel). Set by the owner after the table; any other value means 16. */
    int act_bits;
} MoeKernels;

void moe_act_generic(const float *g, const float *u, int n, float *out, uint16_t *outb);

/* per-ISA tables (each defined in its own file, compiled for its own target) */
void moe_kernels_generic(MoeKernels *k);
void moe_kernels_avx2(MoeKernels *k);
/* AVX2 helpers shared by moe_avx2.c and moe_avx2_ub.c: the f32 group scales of groups [g0, g0 + ng) of a
 * nibble panel (int4 1: bf16, mxfp4 2: e8m0) into wsc[g][32]; the 2+-token 8-bit-activation nibble panel
 * (mx 0 int4, 1 mxfp4; scratch: Kp / 32 x 32 floats) */
void moe_group_scales_avx2(const uint8_t *wp, int g0, int ng, int int4, float *wsc);
void moe_panel_int_ub_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch, int mx);
void moe_kernels_avx512(MoeKernels *k);
double moe_probe_avx512(int kind, long iters); /* compute-ceiling probe: 0 f32 FMA, 1 vdpbf16ps, 2 vpdpbusd; returns ops */
double moe_probe_avx2(int kind, long iters);   /* 0 f32 FMA (ymm), 1 vpmaddubsw, 2 / 3 the exact int8 dot; returns ops */
uint64_t moe_read_avx2(const uint8_t *p, size_t n);
void moe_kernels_amx(MoeKernels *k);
/* tile multiplies (TDPBF16PS, TDPBSUD) run so far by a -DMOE_AMX_EMULATE build, all threads; -1 in a
 * normal build (the real instructions are not counted) */
long moe_amx_tile_ops(void);

/* generic panels, used by the others for odd cases */
void moe_panel_bf16_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);
void moe_panel_int8_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);
void moe_panel_int4_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);
void moe_panel_mxfp4_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);

/* bf16 helpers */
static inline float moe_bf16_to_f32(uint16_t h) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)h << 16;
    return v.f;
}
static inline uint16_t moe_f32_to_bf16(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 0x40); /* NaN */
    uint32_t r = 0x7fffu + ((v.u >> 16) & 1u);
    return (uint16_t)((v.u + r) >> 16);
}

/* CPU features */
/* Which form the AVX-512 bf16 kernels take, decided once per kernel table: 1 = widened weights x
 * f32 FMA (AMD family 19h, Zen 4: vdpbf16ps at half the FMA rate), 0 = vdpbf16ps (elsewhere).
 * $MOESPLIT_BF16_DOT=fma|dpbf16 overrides (tests, tuning). Each form is batch-invariant on its
 * own; two processes compare bit for bit only when they took the same form. */
int moe_bf16_dot_fma(void);
int moe_cpu_has(int isa);          /* 1 if the CPU and OS support the ISA path */
int moe_amx_request_permission(void); /* 0 on success */

/* ---------------- thread pool ---------------- */
typedef struct MoePool MoePool;
typedef void (*moe_job_fn)(void *arg, int tid, int nt);
MoePool *moe_pool_create(int nthreads, const int *cpus, int ncpus);
void moe_pool_destroy(MoePool *pool);
int moe_pool_size(const MoePool *pool);
void moe_pool_run(MoePool *pool, moe_job_fn fn, void *arg); /* caller is thread 0 */
void moe_pool_run_n(MoePool *pool, moe_job_fn fn, void *arg, int threads); /* threads 1: the caller alone */
/* multiply-adds below which a forward call runs on the calling thread alone (moe_forward) */
#define MOE_SMALL_CALL_MACS (1L << 21)
void moe_pool_barrier(MoePool *pool);
/* Streaming-read probe: every pool thread reads its contiguous share of buf (64-byte aligned,
 * bytes a multiple of 256 * threads) once, with 256-bit loads where the CPU has AVX2; returns the
 * wall seconds of the pass. */
double moe_probe_read(MoePool *pool, const uint8_t *buf, size_t bytes);

/* ---------------- experts ---------------- */
typedef struct {
    int H, I;
    MoeMat gu; /* [2I -> fused panels, H] */
    MoeMat dn; /* [H, I] */
} MoeExpert;

/* Allocate (untouched) and pack in parallel with the compute partitioning.
 * Float sources: gate/up [I][H], down [H][I] f32 row-major.  Returns 0 or -errno. */
int moe_expert_pack_float(MoePool *pool, MoeExpert *e, int fmt, int H, int I,
                          const float *gate, const float *up, const float *down);
/* INT4 compressed-tensors sources: packed int32 [out][ceil(in/8)], scale bf16 [out][ceil(in/32)] */
int moe_expert_pack_int4(MoePool *pool, MoeExpert *e, int H, int I,
                         const int32_t *gp, const uint16_t *gs, const int32_t *upk,
                         const uint16_t *us, const int32_t *dp, const uint16_t *ds);
/* MXFP4 (OCP MX) sources: blocks u8 [out][in/2] (low nibble = element 2j), e8m0 scales u8 [out][in/32];
 * in must be a multiple of 32 (H and I) */
int moe_expert_pack_mxfp4(MoePool *pool, MoeExpert *e, int H, int I, const uint8_t *gb, const uint8_t *gs,
                          const uint8_t *ub, const uint8_t *us, const uint8_t *db, const uint8_t *ds);
void moe_expert_free(MoeExpert *e);
size_t moe_expert_bytes(const MoeExpert *e);
/* Dequantised weight as the kernels see it: which 0 gate, 1 up, 2 down; out [N][K] f32 */
void moe_expert_unpack(const MoeExpert *e, int which, float *out);

/* The fused MoE op.  experts[j] for j < n_experts are indexed by global id (NULL = not held).
 * x [T][H] f32, ids [T][k], w [T][k]; out [T][H] f32 is accumulated into (caller zeroes).
 * Returns 0, or -ENOMEM. */
int moe_forward(MoePool *pool, const MoeKernels *kern, MoeExpert *const *experts, int n_experts,
                int fmt, int H, int I, const float *x, int T, const int64_t *ids, const float *w,
                int k, float *out);

#endif
