/* moesplit CPU MoE: AVX2 + FMA kernels (any x86-64 from Haswell / Zen 1 on).
 * bf16 weights are widened to f32 (shift) and FMA'd; int8 uses the sign trick with
 * vpmaddubsw (|w| x sign(x, w), no saturation for |w|, |x| <= 127); int4 nibbles (0..15)
 * go straight into vpmaddubsw. bf16: micro-tiles of 4 tokens x 16 channels over an L1-resident
 * k-block; int8/int4: one token at a time over an L1-resident k-block. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "moe.h"

#define KC_BF 128 /* k-pairs per block: 64 ch x 256 k x 2 B = 32 KiB of weights, L1-resident */
#define GC_INT 16 /* groups per block */
#define BF2_MR 4  /* tokens per micro-tile: 4 x 2 ymm = 8 accumulators + 4 widened weights + 2 broadcasts */

/* C[m][c0 .. c0+16) (+)= x[m] . W over k-pairs [kp0, kp0 + nkp): each loaded weight vector (8
 * channels x one k-pair) is widened to f32 once and feeds MR tokens. Per output element the
 * order is fixed whatever MR is (batch invariance): for each k-pair ascending, the even product
 * then the odd one, each a rounded FMA into one f32 accumulator (bf16 x bf16 products are exact). */
static inline __attribute__((always_inline)) void mk_bf16_avx2(const int MR, const uint16_t *w, int nkp,
                                                                const float *const *x, int kp0, float *C, int load) {
    __m256 acc[BF2_MR][2];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) acc[m][v] = load ? _mm256_loadu_ps(C + m * 64 + 8 * v) : _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int kp = 0; kp < nkp; kp++) {
        const uint16_t *wr = w + (size_t)kp * 128;
        __m256 we[2], wo[2];
        for (int v = 0; v < 2; v++) {
            __m256i t = _mm256_loadu_si256((const __m256i *)(wr + 16 * v));
            we[v] = _mm256_castsi256_ps(_mm256_slli_epi32(t, 16));
            wo[v] = _mm256_castsi256_ps(_mm256_and_si256(t, hi));
        }
        for (int m = 0; m < MR; m++) {
            __m256 xe = _mm256_broadcast_ss(x[m] + 2 * (kp0 + kp)), xo = _mm256_broadcast_ss(x[m] + 2 * (kp0 + kp) + 1);
            for (int v = 0; v < 2; v++) {
                acc[m][v] = _mm256_fmadd_ps(we[v], xe, acc[m][v]);
                acc[m][v] = _mm256_fmadd_ps(wo[v], xo, acc[m][v]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) _mm256_storeu_ps(C + m * 64 + 8 * v, acc[m][v]);
}

void moe_panel_bf16_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    const uint16_t *wp = (const uint16_t *)(W->data + W->panel_bytes * (size_t)p);
    int nkp = W->Kp / 2, n = rows->n;
    for (int k0 = 0; k0 < nkp; k0 += KC_BF) {
        int kc = nkp - k0 < KC_BF ? nkp - k0 : KC_BF;
        for (int c0 = 0; c0 < 64; c0 += 16) /* 16-channel slices of the panel */
            for (int m0 = 0; m0 < n; m0 += BF2_MR) {
                const uint16_t *w = wp + (size_t)k0 * 128 + 2 * c0;
                const float *const *x = rows->f + m0;
                float *Cm = C + (size_t)m0 * 64 + c0;
                switch (n - m0 < BF2_MR ? n - m0 : BF2_MR) {
                case 1: mk_bf16_avx2(1, w, kc, x, k0, Cm, k0 > 0); break;
                case 2: mk_bf16_avx2(2, w, kc, x, k0, Cm, k0 > 0); break;
                case 3: mk_bf16_avx2(3, w, kc, x, k0, Cm, k0 > 0); break;
                default: mk_bf16_avx2(BF2_MR, w, kc, x, k0, Cm, k0 > 0); break;
                }
            }
    }
}

static inline __m256 bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* int4: 0 int8, 1 int4 (nibble = q + 8), 2 mxfp4 (nibble = e2m1 code, vpshufb'd through moe_mxfp4_u8 to
 * 2 * value + 12 <= 24: four vpmaddubsw products stay under 4 * 24 * 127 < 2^15, no saturation) */
static void panel_int_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, int int4) {
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    int G = W->Kp / MOE_GROUP, n = rows->n;
    const __m256i ones = _mm256_set1_epi16(1), lo4 = _mm256_set1_epi8(0x0f), x80 = _mm256_set1_epi8((char)0x80);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)moe_mxfp4_u8));
    for (int g0 = 0; g0 < G; g0 += GC_INT) {
        int g1 = g0 + GC_INT < G ? g0 + GC_INT : G;
        for (int m = 0; m < n; m++) {
            const int8_t *xr = rows->q[m];
            float *c = C + (size_t)m * 32;
            __m256 acc[4];
            for (int v = 0; v < 4; v++) acc[v] = g0 > 0 ? _mm256_loadu_ps(c + 8 * v) : _mm256_setzero_ps();
            for (int g = g0; g < g1; g++) {
                __m256i ia[4], il[4]; /* q1 and q2 halves of the two-level activations */
                for (int v = 0; v < 4; v++) ia[v] = il[v] = _mm256_setzero_si256();
                if (!int4) {
                    const uint8_t *gb = wp + (size_t)g * 8 * 128;
                    for (int qd = 0; qd < 8; qd++) {
                        __m256i bh = _mm256_set1_epi32(*(const int32_t *)(xr + g * 64 + qd * 4));
                        __m256i bl = _mm256_set1_epi32(*(const int32_t *)(xr + g * 64 + 32 + qd * 4));
                        for (int v = 0; v < 4; v++) {
                            __m256i ws = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(gb + qd * 128 + 32 * v)), x80);
                            __m256i aw = _mm256_abs_epi8(ws);
                            __m256i ph = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bh, ws));
                            __m256i pl = _mm256_maddubs_epi16(aw, _mm256_sign_epi8(bl, ws));
                            ia[v] = _mm256_add_epi32(ia[v], _mm256_madd_epi16(ph, ones));
                            il[v] = _mm256_add_epi32(il[v], _mm256_madd_epi16(pl, ones));
                        }
                    }
                } else {
                    const uint8_t *gb = wp + (size_t)g * MOE_INT4_GROUP_BYTES;
                    for (int o = 0; o < 4; o++) {
                        const int8_t *xq = xr + g * 64 + 8 * o;
                        __m256i a = _mm256_set1_epi32(*(const int32_t *)xq), b = _mm256_set1_epi32(*(const int32_t *)(xq + 4));
                        __m256i c = _mm256_set1_epi32(*(const int32_t *)(xq + 32)), d = _mm256_set1_epi32(*(const int32_t *)(xq + 36));
                        for (int v = 0; v < 4; v++) {
                            __m256i pk = _mm256_loadu_si256((const __m256i *)(gb + o * 128 + 32 * v));
                            __m256i l = _mm256_and_si256(pk, lo4), h = _mm256_and_si256(_mm256_srli_epi16(pk, 4), lo4);
                            if (int4 == 2) {
                                l = _mm256_shuffle_epi8(lut, l);
                                h = _mm256_shuffle_epi8(lut, h);
                            }
                            __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(l, a), _mm256_maddubs_epi16(h, b));
                            __m256i pl = _mm256_add_epi16(_mm256_maddubs_epi16(l, c), _mm256_maddubs_epi16(h, d));
                            ia[v] = _mm256_add_epi32(ia[v], _mm256_madd_epi16(ph, ones));
                            il[v] = _mm256_add_epi32(il[v], _mm256_madd_epi16(pl, ones));
                        }
                    }
                }
                __m256 xs = _mm256_set1_ps(rows->xs[m][g]), k254 = _mm256_set1_ps(254.f);
                for (int v = 0; v < 4; v++) /* reuse ia as the float-exact 16-bit sum */
                    ia[v] = _mm256_castps_si256(_mm256_fmadd_ps(_mm256_cvtepi32_ps(ia[v]), k254, _mm256_cvtepi32_ps(il[v])));
#define SUM16(v) _mm256_castsi256_ps(ia[v])
                if (!int4) {
                    for (int v = 0; v < 4; v++) acc[v] = _mm256_fmadd_ps(SUM16(v), xs, acc[v]);
                } else {
                    __m256 xc = _mm256_set1_ps(rows->xc[m][g]);
                    const uint16_t *sp = (const uint16_t *)(wp + (size_t)g * MOE_INT4_GROUP_BYTES + 512);
                    for (int v = 0; v < 4; v++)
                        acc[v] = _mm256_fmadd_ps(bf16x8_to_ps(sp + 8 * v),
                                                 _mm256_fmsub_ps(SUM16(v), xs, xc), acc[v]);
                }
            }
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(c + 8 * v, acc[v]);
        }
    }
    if (!int4) {
        const float *chs = W->chscale + p * 32;
        for (int m = 0; m < n; m++)
            for (int v = 0; v < 4; v++)
                _mm256_storeu_ps(C + m * 32 + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(C + m * 32 + 8 * v), _mm256_loadu_ps(chs + 8 * v)));
    }
}

void moe_panel_int8_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_int_avx2(W, p, rows, C, 0);
}
void moe_panel_int4_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_int_avx2(W, p, rows, C, 1);
}
void moe_panel_mxfp4_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_int_avx2(W, p, rows, C, 2);
}

void moe_kernels_avx2(MoeKernels *k) {
    k->isa = MOE_ISA_AVX2;
    k->act = moe_act_generic;
    k->panel[MOE_FMT_BF16] = moe_panel_bf16_avx2;
    k->panel[MOE_FMT_INT8] = moe_panel_int8_avx2;
    k->panel[MOE_FMT_INT4] = moe_panel_int4_avx2;
    k->panel[MOE_FMT_MXFP4] = moe_panel_mxfp4_avx2;
}

/* ---------------- machine-ceiling probes (for bench/bench_kernels.py) ---------------- */

/* Stream-read [p, p + n) (n a multiple of 256) with 256-bit loads into 4 independent xor chains:
 * what a weight stream can get from memory on one core. Returns the xor (so nothing is elided). */
uint64_t moe_read_avx2(const uint8_t *p, size_t n) {
    __m256i a = _mm256_setzero_si256(), b = a, c = a, d = a;
    for (size_t i = 0; i + 256 <= n; i += 256) {
        const __m256i *q = (const __m256i *)(p + i);
        a = _mm256_xor_si256(a, _mm256_xor_si256(_mm256_load_si256(q), _mm256_load_si256(q + 1)));
        b = _mm256_xor_si256(b, _mm256_xor_si256(_mm256_load_si256(q + 2), _mm256_load_si256(q + 3)));
        c = _mm256_xor_si256(c, _mm256_xor_si256(_mm256_load_si256(q + 4), _mm256_load_si256(q + 5)));
        d = _mm256_xor_si256(d, _mm256_xor_si256(_mm256_load_si256(q + 6), _mm256_load_si256(q + 7)));
    }
    __m256i x = _mm256_xor_si256(_mm256_xor_si256(a, b), _mm256_xor_si256(c, d));
    uint64_t r[4];
    _mm256_storeu_si256((__m256i *)r, x);
    return r[0] ^ r[1] ^ r[2] ^ r[3];
}

/* `iters` rounds of 12 independent 256-bit chains: kind 0 f32 FMA (the AVX2 bf16 kernel's
 * instruction), 1 vpmaddubsw u8 x s8 (the AVX2 int8/int4 kernels' multiply). Returns the
 * operations done (2 per multiply-add); the caller times it on every thread at once. */
#define PROBE2_CHAINS 12
double moe_probe_avx2(int kind, long iters) {
    if (kind == 0) {
        __m256 acc[PROBE2_CHAINS];
        for (int c = 0; c < PROBE2_CHAINS; c++) acc[c] = _mm256_set1_ps(1e-3f * (float)c);
        const __m256 a = _mm256_set1_ps(0.999f), b = _mm256_set1_ps(1e-6f);
        for (long i = 0; i < iters; i++)
            for (int c = 0; c < PROBE2_CHAINS; c++) acc[c] = _mm256_fmadd_ps(acc[c], a, b);
        __m256 s = acc[0];
        for (int c = 1; c < PROBE2_CHAINS; c++) s = _mm256_add_ps(s, acc[c]);
        volatile float sink = _mm256_cvtss_f32(s);
        (void)sink;
        return (double)iters * PROBE2_CHAINS * 16.0; /* 8 lanes x 2 */
    }
    __m256i acc[PROBE2_CHAINS];
    for (int c = 0; c < PROBE2_CHAINS; c++) acc[c] = _mm256_set1_epi8((char)(1 + c));
    const __m256i s8 = _mm256_set1_epi8(1);
    for (long i = 0; i < iters; i++)
        for (int c = 0; c < PROBE2_CHAINS; c++) acc[c] = _mm256_maddubs_epi16(acc[c], s8);
    __m256i t = acc[0];
    for (int c = 1; c < PROBE2_CHAINS; c++) t = _mm256_xor_si256(t, acc[c]);
    volatile int sink = _mm256_extract_epi32(t, 0);
    (void)sink;
    return (double)iters * PROBE2_CHAINS * 64.0; /* 32 u8 x s8 products x 2 */
}

