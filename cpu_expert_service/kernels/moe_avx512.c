/* moesplit CPU MoE: AVX-512 kernels (F/BW/VL/DQ + BF16 vdpbf16ps + VNNI vpdpbusd).
 * This whole file is compiled for that target (pragma below); nothing here runs unless the
 * dispatcher has checked the CPU with moe_cpu_has(MOE_ISA_AVX512). */
#ifdef MOE_SIMDE /* tests on a CPU without AVX-512: the same code on portable intrinsics (simde_x86.h) */
#include "simde_x86.h"
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")
#include <immintrin.h>
#endif

#include "moe.h"

#define AI static inline __attribute__((always_inline))

/* ---------------- bf16: panel [Kp/2][64][2] ----------------
 * Batch invariance: every token row takes bf16 activations (rounded once, in moe_forward) and
 * every output element is one vdpbf16ps chain over the k-pairs in ascending order, started from
 * zero, whatever the number of tokens: the 1-token GEMV and the register-blocked micro-kernel run
 * the same chain (the micro-kernel only stores and reloads it between k-blocks, which is exact),
 * so a row's bits do not depend on what else is in the call.
 * 2+ tokens: micro-tiles of BF_MR tokens x 64 channels (4 zmm): each loaded weight vector (16
 * channels x one k-pair) feeds BF_MR vdpbf16ps, one per token, from a broadcast bf16 pair. */

#ifndef BF_MR
#define BF_MR 6 /* tokens per micro-tile: 6 x 4 = 24 accumulators + 4 weight vectors + 1 broadcast */
#endif
#define BF_KC 128 /* k-pairs per block: 64 ch x 256 k x 2 B = 32 KiB of weights, L1-resident */

/* C[m][0..64) (+)= x[m] . W[0..64) over k-pairs [kp0, kp0 + nkp), x bf16 rows */
AI void mk_bf16(const int MR, const uint16_t *w, int nkp, const uint16_t *const *x, int kp0, float *C, int load,
                const char *pf, int npf) {
    __m512 acc[BF_MR][4];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 4; v++) acc[m][v] = load ? _mm512_loadu_ps(C + m * 64 + 16 * v) : _mm512_setzero_ps();
    const int32_t *xr[BF_MR];
    for (int m = 0; m < MR; m++) xr[m] = (const int32_t *)x[m] + kp0;
    for (int kp = 0; kp < nkp; kp++) {
        const uint16_t *wr = w + (size_t)kp * 128;
        if (kp < npf) _mm_prefetch(pf + (size_t)kp * 64, _MM_HINT_T1); /* this tile's share of the next k-block */
        if (kp + nkp < npf) _mm_prefetch(pf + (size_t)(kp + nkp) * 64, _MM_HINT_T1);
        __m512bh wv[4];
        for (int v = 0; v < 4; v++) wv[v] = (__m512bh)_mm512_loadu_si512(wr + 32 * v);
        for (int m = 0; m < MR; m++) {
            __m512bh xb = (__m512bh)_mm512_set1_epi32(xr[m][kp]);
            for (int v = 0; v < 4; v++) acc[m][v] = _mm512_dpbf16_ps(acc[m][v], wv[v], xb);
        }
    }
    for (int m = 0; m < MR; m++) for (int v = 0; v < 4; v++) _mm512_storeu_ps(C + m * 64 + 16 * v, acc[m][v]);
}

/* Weight-stream prefetch of the 1-token paths (bf16 GEMV, int8 and int4 groups), in bytes ahead
 * of what is being read: every cache line STREAM_PF ahead into L1 and STREAM_PF2 ahead into L2.
 * Without it the streams ran at ~55% (int4) to ~80% (int8, bf16 on a good run) of the machine's
 * read bandwidth: the hardware streamer alone does not keep enough lines in flight while the core
 * is busy with vpdpbusd / vdpbf16ps; the far L2 level is worth ~20% over the L1 one alone (int4). */
#ifndef STREAM_PF
#define STREAM_PF 8192
#endif
#ifndef STREAM_PF2
#define STREAM_PF2 16384
#endif

/* prefetch the `lines` cache lines at p + STREAM_PF (L1) and p + STREAM_PF2 (L2) */
AI void stream_prefetch(const void *p, const int lines) {
#if STREAM_PF > 0
    for (int l = 0; l < lines; l++) _mm_prefetch((const char *)p + STREAM_PF + 64 * l, _MM_HINT_T0);
#endif
#if STREAM_PF2 > 0
    for (int l = 0; l < lines; l++) _mm_prefetch((const char *)p + STREAM_PF2 + 64 * l, _MM_HINT_T1);
#endif
}

/* 1 token: a pure weight stream, the micro-kernel's chains (one per 16 channels, k ascending);
 * each iteration reads 2 k-pairs x 64 channels = 512 B = 8 cache lines and prefetches the 8 ahead */
static void gemv_bf16(const uint16_t *w, int nkp, const uint16_t *x, float *C) {
    __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    const int32_t *xr = (const int32_t *)x;
    int kp = 0;
    for (; kp + 2 <= nkp; kp += 2) {
        const uint16_t *wr = w + (size_t)kp * 128;
        stream_prefetch(wr, 8);
        __m512bh x0 = (__m512bh)_mm512_set1_epi32(xr[kp]), x1 = (__m512bh)_mm512_set1_epi32(xr[kp + 1]);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wr), x0);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wr + 32), x0);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wr + 64), x0);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wr + 96), x0);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wr + 128), x1);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wr + 160), x1);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wr + 192), x1);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wr + 224), x1);
    }
    for (; kp < nkp; kp++) {
        const uint16_t *wr = w + (size_t)kp * 128;
        __m512bh x0 = (__m512bh)_mm512_set1_epi32(xr[kp]);
        a0 = _mm512_dpbf16_ps(a0, (__m512bh)_mm512_loadu_si512(wr), x0);
        a1 = _mm512_dpbf16_ps(a1, (__m512bh)_mm512_loadu_si512(wr + 32), x0);
        a2 = _mm512_dpbf16_ps(a2, (__m512bh)_mm512_loadu_si512(wr + 64), x0);
        a3 = _mm512_dpbf16_ps(a3, (__m512bh)_mm512_loadu_si512(wr + 96), x0);
    }
    _mm512_storeu_ps(C, a0);
    _mm512_storeu_ps(C + 16, a1);
    _mm512_storeu_ps(C + 32, a2);
    _mm512_storeu_ps(C + 48, a3);
}

#define MKB(R) \
    case R: mk_bf16(R, w, nkp, x, kp0, C, load, pf, npf); break;
static void mk_bf16_n(int mr, const uint16_t *w, int nkp, const uint16_t *const *x, int kp0, float *C, int load,
                      const char *pf, int npf) {
    switch (mr) {
    MKB(1) MKB(2) MKB(3) MKB(4) MKB(5)
    default: mk_bf16(BF_MR, w, nkp, x, kp0, C, load, pf, npf); break;
    }
}
#undef MKB

void moe_panel_bf16_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    const uint16_t *wp = (const uint16_t *)(W->data + W->panel_bytes * (size_t)p);
    int nkp = W->Kp / 2, n = rows->n;
    if (n == 1) {
        gemv_bf16(wp, nkp, rows->b[0], C);
        return;
    }
    int nb = (n + BF_MR - 1) / BF_MR; /* balanced m-blocks: 8 tokens = 4 + 4, not 6 + 2 */
    for (int k0 = 0; k0 < nkp; k0 += BF_KC) {
        int kc = nkp - k0 < BF_KC ? nkp - k0 : BF_KC;
        /* every micro-tile of this k-block prefetches its share of the next k-block into L2, so the
         * weight stream overlaps the dot products instead of stalling at each k-block start */
        int next = k0 + kc < nkp ? (nkp - k0 - kc < BF_KC ? nkp - k0 - kc : BF_KC) : 0;
        int lines = next * 4, share = (lines + nb - 1) / nb; /* 256 B = 4 lines per k-pair */
        const char *nb_base = (const char *)(wp + (size_t)(k0 + kc) * 128);
        for (int b = 0, m0 = 0; b < nb; b++) {
            int mr = n / nb + (b < n % nb);
            int l0 = b * share, npf = lines - l0 < share ? lines - l0 : share;
            mk_bf16_n(mr, wp + (size_t)k0 * 128, kc, rows->b + m0, k0, C + (size_t)m0 * 64, k0 > 0,
                      nb_base + (size_t)l0 * 64, npf > 0 ? (npf < 2 * kc ? npf : 2 * kc) : 0);
            m0 += mr;
        }
    }
}

/* ---------------- bf16, FMA form (cores whose vdpbf16ps runs at half the f32 FMA rate) ----------------
 * The bf16 weights of a k-pair are widened to f32 once (shift / mask) and reused by FMR tokens
 * with f32 FMAs on the same bf16-rounded activations held in f32 (rows->f, exact). Per output
 * element the chain is fixed whatever the token count (batch invariance): for each k-pair
 * ascending, the even product then the odd one, each a rounded FMA into one f32 accumulator; the
 * 1-token GEMV runs the same chain. Measured on a development CPU (AVX512_BF16, no AMX):
 * vdpbf16ps ~80 GFLOP/s per core, f32 FMA ~165; widening costs 4 uops per 48 FMAs of a 12 x 2
 * micro-tile, so this form reached ~1.6x the vdpbf16ps GEMM there (moe_bf16_dot_fma decides). */

#define FMR 12 /* tokens per micro-tile: 12 x 2 = 24 accumulators, 4 widened weights */

/* C[m][c0 .. c0 + 32) (+)= x[m] . W[c0 ..] over k-pairs [kp0, kp0 + nkp), x f32 rows of bf16 values */
AI void mk_bf16_fma(const int MR, const uint16_t *w, int nkp, const float *const *x, int kp0, float *C, int load,
                    const char *pf, int npf) {
    __m512 acc[FMR][2];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) acc[m][v] = load ? _mm512_loadu_ps(C + m * 64 + 16 * v) : _mm512_setzero_ps();
    const float *xr[FMR];
    for (int m = 0; m < MR; m++) xr[m] = x[m] + 2 * kp0;
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int kp = 0; kp < nkp; kp++) {
        const uint16_t *wr = w + (size_t)kp * 128;
        if (kp < npf) _mm_prefetch(pf + (size_t)kp * 64, _MM_HINT_T1);
        if (kp + nkp < npf) _mm_prefetch(pf + (size_t)(kp + nkp) * 64, _MM_HINT_T1);
        __m512 we[2], wo[2];
        for (int v = 0; v < 2; v++) {
            __m512i t = _mm512_loadu_si512(wr + 32 * v);
            we[v] = _mm512_castsi512_ps(_mm512_slli_epi32(t, 16));
            wo[v] = _mm512_castsi512_ps(_mm512_and_si512(t, hi));
        }
        for (int m = 0; m < MR; m++) {
            __m512 xe = _mm512_set1_ps(xr[m][2 * kp]), xo = _mm512_set1_ps(xr[m][2 * kp + 1]);
            for (int v = 0; v < 2; v++) acc[m][v] = _mm512_fmadd_ps(we[v], xe, acc[m][v]);
            for (int v = 0; v < 2; v++) acc[m][v] = _mm512_fmadd_ps(wo[v], xo, acc[m][v]);
        }
    }
    for (int m = 0; m < MR; m++) for (int v = 0; v < 2; v++) _mm512_storeu_ps(C + m * 64 + 16 * v, acc[m][v]);
}

/* 1 token: the micro-kernel's chains over all 64 channels (4 accumulators), one k-pair
 * (256 B = 4 cache lines) per iteration, prefetching the stream ahead */
static void gemv_bf16_fma(const uint16_t *w, int nkp, const float *x, float *C) {
    __m512 a[4];
    for (int v = 0; v < 4; v++) a[v] = _mm512_setzero_ps();
    const __m512i hi = _mm512_set1_epi32((int)0xffff0000u);
    for (int kp = 0; kp < nkp; kp++) {
        const uint16_t *wr = w + (size_t)kp * 128;
        stream_prefetch(wr, 4);
        __m512 xe = _mm512_set1_ps(x[2 * kp]), xo = _mm512_set1_ps(x[2 * kp + 1]);
        for (int v = 0; v < 4; v++) {
            __m512i t = _mm512_loadu_si512(wr + 32 * v);
            a[v] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(t, 16)), xe, a[v]);
            a[v] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(t, hi)), xo, a[v]);
        }
    }
    for (int v = 0; v < 4; v++) _mm512_storeu_ps(C + 16 * v, a[v]);
}

#define MKF(R) \
    case R: mk_bf16_fma(R, w, nkp, x, kp0, C, load, pf, npf); break;
static void mk_bf16_fma_n(int mr, const uint16_t *w, int nkp, const float *const *x, int kp0, float *C, int load,
                          const char *pf, int npf) {
    switch (mr) {
    MKF(1) MKF(2) MKF(3) MKF(4) MKF(5) MKF(6) MKF(7) MKF(8) MKF(9) MKF(10) MKF(11)
    default: mk_bf16_fma(FMR, w, nkp, x, kp0, C, load, pf, npf); break;
    }
}
#undef MKF

void moe_panel_bf16_fma_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    const uint16_t *wp = (const uint16_t *)(W->data + W->panel_bytes * (size_t)p);
    int nkp = W->Kp / 2, n = rows->n;
    if (n == 1) {
        gemv_bf16_fma(wp, nkp, rows->f[0], C);
        return;
    }
    int nb = (n + FMR - 1) / FMR; /* balanced m-blocks: 16 tokens = 8 + 8, not 12 + 4 */
    for (int k0 = 0; k0 < nkp; k0 += BF_KC) {
        int kc = nkp - k0 < BF_KC ? nkp - k0 : BF_KC;
        int ntile = nb * 2, tile = 0; /* 2 slices of 32 channels */
        int next = k0 + kc < nkp ? (nkp - k0 - kc < BF_KC ? nkp - k0 - kc : BF_KC) : 0;
        int lines = next * 4, share = (lines + ntile - 1) / ntile;
        const char *nb_base = (const char *)(wp + (size_t)(k0 + kc) * 128);
        for (int c0 = 0; c0 < 64; c0 += 32)
            for (int b = 0, m0 = 0; b < nb; b++, tile++) {
                int mr = n / nb + (b < n % nb);
                int l0 = tile * share, npf = lines - l0 < share ? lines - l0 : share;
                mk_bf16_fma_n(mr, wp + (size_t)k0 * 128 + 2 * c0, kc, rows->f + m0, k0, C + (size_t)m0 * 64 + c0,
                              k0 > 0, nb_base + (size_t)l0 * 64, npf > 0 ? (npf < 2 * kc ? npf : 2 * kc) : 0);
                m0 += mr;
            }
    }
}

/* ---------------- int8 / int4: panel of 32 channels, group-32 activation scales ---------------- */

#define IN_MR 3 /* tokens per micro-tile, 16-bit activations: 12 int32 + 6 f32 accumulators */
#ifndef IN_MR8
#define IN_MR8 5 /* the same, 8-bit activations (one int32 chain per output vector) */
#endif
#define IN_MRMAX (IN_MR > IN_MR8 ? IN_MR : IN_MR8)
#define IN_GC 16 /* groups per k-block */

/* the 9 cache lines (576 B, 64-byte aligned) of an int4 group; the 16 (1 KiB) of an int8 group */
AI void int4_prefetch(const uint8_t *gb) { stream_prefetch(gb, 9); }
AI void int8_prefetch(const uint8_t *gb) { stream_prefetch(gb, 16); }

AI __m512 bf16x16_to_ps(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* 16 e8m0 bytes -> their mxfp4 group scales 2^(e - 127), moe_mxfp4_scale's steps on 16 lanes */
AI __m512 e8x16_to_ps(const uint8_t *p) {
    __m512i b = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p)), 23);
    return _mm512_castsi512_ps(_mm512_max_epi32(b, _mm512_set1_epi32(0x00400000)));
}

/* acc[m][v] (+)= sum over groups [g0, g0+ng) of the group partial products. Activations are
 * two-level int8 (q1 at 64g, q2 at 64g + 32): two vpdpbusd chains per weight vector; A8 (8-bit
 * activations, every q2 0): the q1 chain only, and s = 254 * ih by a multiply, which is the
 * two-level fma(ih, 254, il = 0) exactly (one rounding of the same product), so a row's bits equal
 * the 1-token paths' on the same rows.
 * INT4: 0 int8, 1 int4 (nibble = q + 8), 2 mxfp4 (nibble = e2m1 code, vpshufb'd through
 * moe_mxfp4_u8 to 2 * value + 12; 544-byte groups whose scales are the e8m0 bytes; the correction is
 * int4's with offset 12). */
AI void mk_int(const int MR, const int INT4, const int A8, const uint8_t *wp, int g0, int ng, const MoeRows *rows,
               int m0, float *C, int load) {
    __m512 acc[IN_MRMAX][2];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) acc[m][v] = load ? _mm512_loadu_ps(C + m * 32 + 16 * v) : _mm512_setzero_ps();
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    const __m512 k254 = _mm512_set1_ps(254.f);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)moe_mxfp4_u8));
    for (int g = g0; g < g0 + ng; g++) {
        __m512i ih[IN_MRMAX][2], il[IN_MRMAX][2];
        for (int m = 0; m < MR; m++) ih[m][0] = ih[m][1] = il[m][0] = il[m][1] = _mm512_setzero_si512();
        if (!INT4) {
            const uint8_t *gb = wp + (size_t)g * 8 * 128;
            int8_prefetch(gb);
            for (int qd = 0; qd < 8; qd++) {
                __m512i w0 = _mm512_loadu_si512(gb + qd * 128), w1 = _mm512_loadu_si512(gb + qd * 128 + 64);
                for (int m = 0; m < MR; m++) {
                    const int8_t *xq = rows->q[m0 + m] + g * 64 + qd * 4;
                    __m512i bh = _mm512_set1_epi32(*(const int32_t *)xq);
                    ih[m][0] = _mm512_dpbusd_epi32(ih[m][0], w0, bh);
                    ih[m][1] = _mm512_dpbusd_epi32(ih[m][1], w1, bh);
                    if (!A8) {
                        __m512i bl = _mm512_set1_epi32(*(const int32_t *)(xq + 32));
                        il[m][0] = _mm512_dpbusd_epi32(il[m][0], w0, bl);
                        il[m][1] = _mm512_dpbusd_epi32(il[m][1], w1, bl);
                    }
                }
            }
        } else {
            const uint8_t *gb = wp + (size_t)g * (INT4 == 2 ? MOE_MXFP4_GROUP_BYTES : MOE_INT4_GROUP_BYTES);
            int4_prefetch(gb);
            for (int o = 0; o < 4; o++) {
                __m512i p0 = _mm512_loadu_si512(gb + o * 128), p1 = _mm512_loadu_si512(gb + o * 128 + 64);
                __m512i l0 = _mm512_and_si512(p0, lo4), h0 = _mm512_and_si512(_mm512_srli_epi16(p0, 4), lo4);
                __m512i l1 = _mm512_and_si512(p1, lo4), h1 = _mm512_and_si512(_mm512_srli_epi16(p1, 4), lo4);
                if (INT4 == 2) {
                    l0 = _mm512_shuffle_epi8(lut, l0);
                    h0 = _mm512_shuffle_epi8(lut, h0);
                    l1 = _mm512_shuffle_epi8(lut, l1);
                    h1 = _mm512_shuffle_epi8(lut, h1);
                }
                for (int m = 0; m < MR; m++) {
                    const int8_t *xq = rows->q[m0 + m] + g * 64 + 8 * o;
                    __m512i a = _mm512_set1_epi32(*(const int32_t *)xq), b = _mm512_set1_epi32(*(const int32_t *)(xq + 4));
                    ih[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ih[m][0], l0, a), h0, b);
                    ih[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(ih[m][1], l1, a), h1, b);
                    if (!A8) {
                        __m512i c = _mm512_set1_epi32(*(const int32_t *)(xq + 32)), d = _mm512_set1_epi32(*(const int32_t *)(xq + 36));
                        il[m][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(il[m][0], l0, c), h0, d);
                        il[m][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(il[m][1], l1, c), h1, d);
                    }
                }
            }
        }
        __m512 ws0 = _mm512_setzero_ps(), ws1 = ws0;
        if (INT4 == 2) {
            const uint8_t *ep = wp + (size_t)g * MOE_MXFP4_GROUP_BYTES + 512;
            ws0 = e8x16_to_ps(ep);
            ws1 = e8x16_to_ps(ep + 16);
        } else if (INT4) {
            const uint16_t *sp = (const uint16_t *)(wp + (size_t)g * MOE_INT4_GROUP_BYTES + 512);
            ws0 = bf16x16_to_ps(sp);
            ws1 = bf16x16_to_ps(sp + 16);
        }
        for (int m = 0; m < MR; m++) {
            __m512 xs = _mm512_set1_ps(rows->xs[m0 + m][g]), xc = _mm512_set1_ps(rows->xc[m0 + m][g]);
            __m512 s0, s1;
            if (A8) {
                s0 = _mm512_mul_ps(_mm512_cvtepi32_ps(ih[m][0]), k254);
                s1 = _mm512_mul_ps(_mm512_cvtepi32_ps(ih[m][1]), k254);
            } else {
                s0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih[m][0]), k254, _mm512_cvtepi32_ps(il[m][0]));
                s1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih[m][1]), k254, _mm512_cvtepi32_ps(il[m][1]));
            }
            __m512 f0 = _mm512_fmsub_ps(s0, xs, xc), f1 = _mm512_fmsub_ps(s1, xs, xc);
            if (INT4) {
                acc[m][0] = _mm512_fmadd_ps(ws0, f0, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(ws1, f1, acc[m][1]);
            } else {
                acc[m][0] = _mm512_add_ps(acc[m][0], f0);
                acc[m][1] = _mm512_add_ps(acc[m][1], f1);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) _mm512_storeu_ps(C + m * 32 + 16 * v, acc[m][v]);
}

/* 1 token, int4: a pure weight stream (T = 1 decode). Each 576-byte group is exactly 9 cache lines
 * (panels and groups are 64-byte aligned); the lines STREAM_PF (L1) and STREAM_PF2 (L2) bytes ahead are
 * prefetched, so the stream overlaps the vpdpbusd work instead of stalling on demand misses
 * (a thread's panels are contiguous, so this runs on into its next panel).
 * Nibbles: low = p & 0x0f, high kept in place as 16 * h = p & 0xf0 (one op instead of shift + and);
 * the two kinds accumulate in separate (independent) chains and meet once per group as
 * 16 * lo + hi16, so the accumulated sum is 16x the true one (undone once at the end). */
static void gemv_int4(const uint8_t *wp, int G, const int8_t *xq, const float *xs, const float *xc, float *C) {
    const __m512i lo4 = _mm512_set1_epi8(0x0f), hi4 = _mm512_set1_epi8((char)0xf0);
    const __m512 k254 = _mm512_set1_ps(254.f);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    for (int g = 0; g < G; g++) {
        const uint8_t *gb = wp + (size_t)g * MOE_INT4_GROUP_BYTES;
        const int8_t *xg = xq + (size_t)g * 64;
        int4_prefetch(gb);
        __m512i hl0 = _mm512_setzero_si512(), hl1 = hl0, hh0 = hl0, hh1 = hl0; /* level 1 (q1): lo / hi16 */
        __m512i ll0 = hl0, ll1 = hl0, lh0 = hl0, lh1 = hl0;                  /* level 2 (q2) */
        for (int o = 0; o < 4; o++) {
            __m512i p0 = _mm512_loadu_si512(gb + o * 128), p1 = _mm512_loadu_si512(gb + o * 128 + 64);
            __m512i l0 = _mm512_and_si512(p0, lo4), h0 = _mm512_and_si512(p0, hi4);
            __m512i l1 = _mm512_and_si512(p1, lo4), h1 = _mm512_and_si512(p1, hi4);
            __m512i a = _mm512_set1_epi32(*(const int32_t *)(xg + 8 * o)), b = _mm512_set1_epi32(*(const int32_t *)(xg + 8 * o + 4));
            __m512i c = _mm512_set1_epi32(*(const int32_t *)(xg + 32 + 8 * o)), d = _mm512_set1_epi32(*(const int32_t *)(xg + 36 + 8 * o));
            hl0 = _mm512_dpbusd_epi32(hl0, l0, a);
            hl1 = _mm512_dpbusd_epi32(hl1, l1, a);
            hh0 = _mm512_dpbusd_epi32(hh0, h0, b);
            hh1 = _mm512_dpbusd_epi32(hh1, h1, b);
            ll0 = _mm512_dpbusd_epi32(ll0, l0, c);
            ll1 = _mm512_dpbusd_epi32(ll1, l1, c);
            lh0 = _mm512_dpbusd_epi32(lh0, h0, d);
            lh1 = _mm512_dpbusd_epi32(lh1, h1, d);
        }
        __m512i ih0 = _mm512_add_epi32(_mm512_slli_epi32(hl0, 4), hh0), ih1 = _mm512_add_epi32(_mm512_slli_epi32(hl1, 4), hh1);
        __m512i il0 = _mm512_add_epi32(_mm512_slli_epi32(ll0, 4), lh0), il1 = _mm512_add_epi32(_mm512_slli_epi32(ll1, 4), lh1);
        const uint16_t *sp = (const uint16_t *)(gb + 512);
        __m512 ws0 = bf16x16_to_ps(sp), ws1 = bf16x16_to_ps(sp + 16);
        __m512 vxs = _mm512_set1_ps(xs[g]), vxc = _mm512_set1_ps(16.f * xc[g]);
        __m512 s0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih0), k254, _mm512_cvtepi32_ps(il0));
        __m512 s1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih1), k254, _mm512_cvtepi32_ps(il1));
        acc0 = _mm512_fmadd_ps(ws0, _mm512_fmsub_ps(s0, vxs, vxc), acc0);
        acc1 = _mm512_fmadd_ps(ws1, _mm512_fmsub_ps(s1, vxs, vxc), acc1);
    }
    const __m512 r16 = _mm512_set1_ps(0.0625f);
    _mm512_storeu_ps(C, _mm512_mul_ps(acc0, r16));
    _mm512_storeu_ps(C + 16, _mm512_mul_ps(acc1, r16));
}

/* 1 token, mxfp4: the weight stream of gemv_int4 (544-byte groups, e8m0 scales; the prefetch of 9 lines
 * per group runs ahead of the stream), each nibble
 * decoded through moe_mxfp4_u8 (vpshufb), lo and hi codes in 8 independent vpdpbusd chains. The
 * integer group sums equal mk_int's exactly (no overflow: |sum| < 32 * 24 * 127 * 2), and the float
 * steps per group are mk_int's, in its order, so a row's bits match the multi-token path. */
static void gemv_mxfp4(const uint8_t *wp, int G, const int8_t *xq, const float *xs, const float *xc, float *C) {
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)moe_mxfp4_u8));
    const __m512 k254 = _mm512_set1_ps(254.f);
    __m512 acc0 = _mm512_setzero_ps(), acc1 = acc0;
    for (int g = 0; g < G; g++) {
        const uint8_t *gb = wp + (size_t)g * MOE_MXFP4_GROUP_BYTES;
        const int8_t *xg = xq + (size_t)g * 64;
        int4_prefetch(gb);
        __m512i hl0 = _mm512_setzero_si512(), hl1 = hl0, hh0 = hl0, hh1 = hl0; /* level 1 (q1): lo / hi codes */
        __m512i ll0 = hl0, ll1 = hl0, lh0 = hl0, lh1 = hl0;                  /* level 2 (q2) */
        for (int o = 0; o < 4; o++) {
            __m512i p0 = _mm512_loadu_si512(gb + o * 128), p1 = _mm512_loadu_si512(gb + o * 128 + 64);
            __m512i l0 = _mm512_shuffle_epi8(lut, _mm512_and_si512(p0, lo4));
            __m512i h0 = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p0, 4), lo4));
            __m512i l1 = _mm512_shuffle_epi8(lut, _mm512_and_si512(p1, lo4));
            __m512i h1 = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16(p1, 4), lo4));
            __m512i a = _mm512_set1_epi32(*(const int32_t *)(xg + 8 * o)), b = _mm512_set1_epi32(*(const int32_t *)(xg + 8 * o + 4));
            __m512i c = _mm512_set1_epi32(*(const int32_t *)(xg + 32 + 8 * o)), d = _mm512_set1_epi32(*(const int32_t *)(xg + 36 + 8 * o));
            hl0 = _mm512_dpbusd_epi32(hl0, l0, a);
            hl1 = _mm512_dpbusd_epi32(hl1, l1, a);
            hh0 = _mm512_dpbusd_epi32(hh0, h0, b);
            hh1 = _mm512_dpbusd_epi32(hh1, h1, b);
            ll0 = _mm512_dpbusd_epi32(ll0, l0, c);
            ll1 = _mm512_dpbusd_epi32(ll1, l1, c);
            lh0 = _mm512_dpbusd_epi32(lh0, h0, d);
            lh1 = _mm512_dpbusd_epi32(lh1, h1, d);
        }
        __m512i ih0 = _mm512_add_epi32(hl0, hh0), ih1 = _mm512_add_epi32(hl1, hh1);
        __m512i il0 = _mm512_add_epi32(ll0, lh0), il1 = _mm512_add_epi32(ll1, lh1);
        __m512 ws0 = e8x16_to_ps(gb + 512), ws1 = e8x16_to_ps(gb + 528);
        __m512 vxs = _mm512_set1_ps(xs[g]), vxc = _mm512_set1_ps(xc[g]);
        __m512 s0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih0), k254, _mm512_cvtepi32_ps(il0));
        __m512 s1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ih1), k254, _mm512_cvtepi32_ps(il1));
        acc0 = _mm512_fmadd_ps(ws0, _mm512_fmsub_ps(s0, vxs, vxc), acc0);
        acc1 = _mm512_fmadd_ps(ws1, _mm512_fmsub_ps(s1, vxs, vxc), acc1);
    }
    _mm512_storeu_ps(C, acc0);
    _mm512_storeu_ps(C + 16, acc1);
}

#define MK_INT_CASES(INT4)                                                                    \
    if (!a8) switch (mr) {                                                                    \
        case 1: mk_int(1, INT4, 0, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break;   \
        case 2: mk_int(2, INT4, 0, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break;   \
        default: mk_int(IN_MR, INT4, 0, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break; \
        }                                                                                     \
    else switch (mr) {                                                                        \
        case 1: mk_int(1, INT4, 1, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break;   \
        case 2: mk_int(2, INT4, 1, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break;   \
        case 3: mk_int(3, INT4, 1, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break;   \
        case 4: mk_int(4, INT4, 1, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break;   \
        default: mk_int(IN_MR8, INT4, 1, wp, g0, ng, rows, m0, C + (size_t)m0 * 32, load); break; \
        }

/* mr tokens from m0 (mr <= the micro-tile height of the activation width a8) */
static void mk_int8_n(int mr, int a8, const uint8_t *wp, int g0, int ng, const MoeRows *rows, int m0, float *C, int load) {
    MK_INT_CASES(0)
}
static void mk_int4_n(int mr, int a8, const uint8_t *wp, int g0, int ng, const MoeRows *rows, int m0, float *C, int load) {
    MK_INT_CASES(1)
}
static void mk_mxfp4_n(int mr, int a8, const uint8_t *wp, int g0, int ng, const MoeRows *rows, int m0, float *C, int load) {
    MK_INT_CASES(2)
}
#undef MK_INT_CASES

/* int8 epilogue: C[m][0..32) *= the panel's 32 per-output-channel scales, for n tokens (also the AMX path's) */
void moe_scale_channels_avx512(const float *chs, float *C, int n) {
    __m512 s0 = _mm512_loadu_ps(chs), s1 = _mm512_loadu_ps(chs + 16);
    for (int m = 0; m < n; m++) {
        _mm512_storeu_ps(C + m * 32, _mm512_mul_ps(_mm512_loadu_ps(C + m * 32), s0));
        _mm512_storeu_ps(C + m * 32 + 16, _mm512_mul_ps(_mm512_loadu_ps(C + m * 32 + 16), s1));
    }
}

/* int4: 0 int8, 1 int4, 2 mxfp4 */
static void panel_int(const MoeMat *W, int p, const MoeRows *rows, float *C, int int4) {
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    int G = W->Kp / MOE_GROUP, n = rows->n;
    if (int4 == 1 && n == 1) {
        gemv_int4(wp, G, rows->q[0], rows->xs[0], rows->xc[0], C);
        return;
    }
    if (int4 == 2 && n == 1) {
        gemv_mxfp4(wp, G, rows->q[0], rows->xs[0], rows->xc[0], C);
        return;
    }
    int a8 = rows->act8, MR = a8 ? IN_MR8 : IN_MR;
    for (int g0 = 0; g0 < G; g0 += (n <= MR ? G : IN_GC)) {
        int ng = n <= MR ? G : (G - g0 < IN_GC ? G - g0 : IN_GC);
        for (int m0 = 0; m0 < n; m0 += MR) {
            int mr = n - m0 < MR ? n - m0 : MR;
            if (int4 == 2) mk_mxfp4_n(mr, a8, wp, g0, ng, rows, m0, C, g0 > 0);
            else if (int4) mk_int4_n(mr, a8, wp, g0, ng, rows, m0, C, g0 > 0);
            else mk_int8_n(mr, a8, wp, g0, ng, rows, m0, C, g0 > 0);
        }
    }
    if (!int4) moe_scale_channels_avx512(W->chscale + p * 32, C, n);
}

void moe_panel_int8_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_int(W, p, rows, C, 0);
}

void moe_panel_int4_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_int(W, p, rows, C, 1);
}

void moe_panel_mxfp4_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_int(W, p, rows, C, 2);
}

/* ---------------- silu(g) * u: exp by range reduction + degree-6 polynomial + vscalefps ---------------- */

AI __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.f)), _mm512_set1_ps(-88.f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

static void act_avx512(const float *g, const float *u, int n, float *out, uint16_t *outb) {
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 gv = _mm512_loadu_ps(g + i);
        __m512 s = _mm512_div_ps(gv, _mm512_add_ps(_mm512_set1_ps(1.f), exp512(_mm512_sub_ps(_mm512_setzero_ps(), gv))));
        __m512 a = _mm512_mul_ps(s, _mm512_loadu_ps(u + i));
        _mm512_storeu_ps(out + i, a);
        if (outb) _mm256_storeu_si256((__m256i *)(outb + i), (__m256i)_mm512_cvtneps_pbh(a));
    }
    if (i < n) moe_act_generic(g + i, u + i, n - i, out + i, outb ? outb + i : NULL);
}

void moe_kernels_avx512(MoeKernels *k) {
    k->isa = MOE_ISA_AVX512;
    k->act = act_avx512;
    k->panel[MOE_FMT_BF16] = moe_bf16_dot_fma() ? moe_panel_bf16_fma_avx512 : moe_panel_bf16_avx512;
    k->panel[MOE_FMT_INT8] = moe_panel_int8_avx512;
    k->panel[MOE_FMT_INT4] = moe_panel_int4_avx512;
    k->panel[MOE_FMT_MXFP4] = moe_panel_mxfp4_avx512;
}

/* ---------------- compute-ceiling probes (for bench/bench_kernels.py) ----------------
 * `iters` rounds of 12 independent 512-bit chains per thread (more than the latency x ports of any
 * current core needs: 4-6 cycles x 2 ports): kind 0 f32 FMA, 1 vdpbf16ps (the bf16 kernels'
 * instruction), 2 vpdpbusd (the int8/int4 kernels'). Returns the operations done (2 per
 * multiply-add); the caller times it on every thread at once. */
#define PROBE_CHAINS 12
double moe_probe_avx512(int kind, long iters) {
    if (kind == 2) {
        __m512i acc[PROBE_CHAINS];
        for (int c = 0; c < PROBE_CHAINS; c++) acc[c] = _mm512_set1_epi32(c);
        const __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
        for (long i = 0; i < iters; i++)
            for (int c = 0; c < PROBE_CHAINS; c++) acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        __m512i s = acc[0];
        for (int c = 1; c < PROBE_CHAINS; c++) s = _mm512_xor_si512(s, acc[c]);
        int32_t r[16];
        _mm512_storeu_si512(r, s);
        volatile int32_t sink = r[0];
        (void)sink;
        return (double)iters * PROBE_CHAINS * 128.0; /* 64 u8 x s8 products x 2 */
    }
    __m512 acc[PROBE_CHAINS];
    for (int c = 0; c < PROBE_CHAINS; c++) acc[c] = _mm512_set1_ps(1e-3f * (float)c);
    const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-6f);
    const __m512bh ab = _mm512_cvtne2ps_pbh(a, a), bb = _mm512_cvtne2ps_pbh(b, b);
    for (long i = 0; i < iters; i++) {
        if (kind == 0)
            for (int c = 0; c < PROBE_CHAINS; c++) acc[c] = _mm512_fmadd_ps(acc[c], a, b);
        else
            for (int c = 0; c < PROBE_CHAINS; c++) acc[c] = _mm512_dpbf16_ps(acc[c], ab, bb);
    }
    __m512 s = acc[0];
    for (int c = 1; c < PROBE_CHAINS; c++) s = _mm512_add_ps(s, acc[c]);
    volatile float sink = _mm512_reduce_add_ps(s);
    (void)sink;
    /* per chain per round: 16 lanes x 2 (FMA) or 32 pairs x 2 (dpbf16) */
    return (double)iters * PROBE_CHAINS * (kind == 0 ? 32.0 : 64.0);
}
