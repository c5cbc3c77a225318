/* moesplit CPU MoE: AVX2 + FMA kernels (any x86-64 from Haswell / Zen 1 on).
 * bf16 weights are widened to f32 (shift) and FMA'd; int8 uses the sign trick with
 * vpmaddubsw (|w| x sign(x, w), no saturation for |w|, |x| <= 127); int4 nibbles (0..15)
 * go straight into vpmaddubsw. bf16: micro-tiles of 5-6 tokens x 16 channels over an L1-resident
 * k-block; int8/int4: one token at a time over an L1-resident k-block. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "moe.h"

#include <string.h>

static void scale_channels_avx2(const float *chs, float *C, int n);

#define KC_BF 64 /* k-pairs per block: 64 ch x 128 k x 2 B = 16 KiB of weights, L1-resident */
#ifndef BF2_PF_HINT
#define BF2_PF_HINT _MM_HINT_T0
#endif
#define GC_INT 16 /* groups per block */
#define BF2_MR 6  /* tokens per micro-tile: 6 x 2 ymm = 12 accumulators, 2 widened weights, 1 broadcast, mask */

/* C[m][c0 .. c0+16) (+)= x[m] . W over the nkp k-pairs at w and x[m]: per k-pair the even halves of the
 * 16 channels are widened (shift, straight from L1) and feed all MR tokens, then the odd halves (and),
 * so only 2 widened weights are live beside MR x 2 accumulators and one broadcast (MR 6: 16 ymm), and
 * each activation is broadcast once per k-pair. Per output element the order is fixed whatever MR is
 * (batch invariance): for each k-pair ascending, the even product then the odd one, each a rounded
 * FMA into one f32 accumulator (bf16 x bf16 products are exact). */
static inline __attribute__((always_inline)) void mk_bf16_avx2(const int MR, const uint16_t *w, int nkp,
                                                                const float *const *x, float *C, int load) {
    __m256 acc[4][2];
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) acc[m][v] = load ? _mm256_loadu_ps(C + m * 64 + 8 * v) : _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int kp = 0; kp < nkp; kp++) {
        const __m256i *wr = (const __m256i *)(w + (size_t)kp * 128);
        __m256 we0 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wr), 16));
        __m256 we1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_loadu_si256(wr + 1), 16));
        for (int m = 0; m < MR; m++) {
            __m256 xb = _mm256_broadcast_ss(x[m] + 2 * kp);
            acc[m][0] = _mm256_fmadd_ps(we0, xb, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(we1, xb, acc[m][1]);
        }
        __m256 wo0 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wr), hi));
        __m256 wo1 = _mm256_castsi256_ps(_mm256_and_si256(_mm256_loadu_si256(wr + 1), hi));
        for (int m = 0; m < MR; m++) {
            __m256 xb = _mm256_broadcast_ss(x[m] + 2 * kp + 1);
            acc[m][0] = _mm256_fmadd_ps(wo0, xb, acc[m][0]);
            acc[m][1] = _mm256_fmadd_ps(wo1, xb, acc[m][1]);
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) _mm256_storeu_ps(C + m * 64 + 8 * v, acc[m][v]);
}

/* mk_bf16_asm's pieces, per token row F(C offset, accumulators A and B, activation row X) */
#define BF_C5(F) F("0", "0", "1", "x0") F("256", "2", "3", "x1") F("512", "4", "5", "x2") \
    F("768", "6", "7", "x3") F("1024", "8", "9", "x4")
#define BF_C6(F) BF_C5(F) F("1280", "10", "11", "x5")
#define BF_L(T, A, B, X) "vmovups " T "(%[C]),%%ymm" A "\n\tvmovups " T "+32(%[C]),%%ymm" B "\n\t"
#define BF_S(T, A, B, X) "vmovups %%ymm" A "," T "(%[C])\n\tvmovups %%ymm" B "," T "+32(%[C])\n\t"
#define BF_Z(T, A, B, X) "vxorps %%ymm" A ",%%ymm" A ",%%ymm" A "\n\tvxorps %%ymm" B ",%%ymm" B ",%%ymm" B "\n\t"
#define BF_T(OFF, X, A, B) "vbroadcastss " OFF "(%[" X "],%[i]),%%ymm14\n\t" \
    "vfmadd231ps %%ymm12,%%ymm14,%%ymm" A "\n\tvfmadd231ps %%ymm13,%%ymm14,%%ymm" B "\n\t"
#define BF_E(T, A, B, X) BF_T("0", X, A, B)
#define BF_O(T, A, B, X) BF_T("4", X, A, B)
#define BF_ASM(CS) __asm__ volatile( \
    "vpcmpeqd %%ymm15,%%ymm15,%%ymm15\n\tvpslld $16,%%ymm15,%%ymm15\n\ttest %[load],%[load]\n\tjz 1f\n\t" \
    CS(BF_L) "jmp 2f\n1:\n\t" CS(BF_Z) "2:\n\ttest %[n],%[n]\n\tjz 4f\n3:\n\tvmovdqu (%[w]),%%ymm12\n\t" \
    "vmovdqu 32(%[w]),%%ymm13\n\tvpslld $16,%%ymm12,%%ymm12\n\tvpslld $16,%%ymm13,%%ymm13\n\t" CS(BF_E) \
    "vpand (%[w]),%%ymm15,%%ymm12\n\tvpand 32(%[w]),%%ymm15,%%ymm13\n\t" CS(BF_O) \
    "add $256,%[w]\n\tadd $8,%[i]\n\tdec %[n]\n\tjnz 3b\n4:\n\t" CS(BF_S) \
    : [w] "+r"(w), [i] "+r"(i), [n] "+r"(nkp) : [x0] "r"(x[0]), [x1] "r"(x[1]), [x2] "r"(x[2]), [x3] "r"(x[3]), \
      [x4] "r"(x[4]), [x5] "r"(x[mr - 1]), [C] "r"(C), [load] "r"(load) \
    : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11", \
      "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory")

/* mk_bf16_avx2 for 5 or 6 tokens, register-allocated by hand (GCC
 * spilled 5 of the 12 accumulators): ymm0-11 the accumulators, ymm12-13 the widened weights (even: load
 * + shift, odd: and from L1), ymm14 the broadcast, ymm15 the odd mask. The same FMA chain per element. */
static void mk_bf16_asm(int mr, const uint16_t *w, long nkp, const float *const *x, float *C, int load) {
    long i = 0;
    if (mr == 6) BF_ASM(BF_C6);
    else BF_ASM(BF_C5);
}

/* Weight-stream prefetch of the 1-token bf16 path, bytes ahead of the line being read (L1, L2) */
#ifndef STREAM2_PF
#define STREAM2_PF 4096
#endif
#ifndef STREAM2_PF2
#define STREAM2_PF2 16384
#endif

/* 1 token: the micro-kernel's chain per output element (each k-pair ascending: even product, then odd,
 * each a rounded FMA), over all 64 channels at once (8 accumulators, 16 independent FMAs per k-pair),
 * reading the panel front to back (256 B = 4 cache lines per k-pair) with the lines ahead prefetched,
 * so the widening (shift / and, 2 ops per 16 weights) hides under the memory stream. */
static void gemv_bf16_avx2(const uint16_t *w, int nkp, const float *x, float *C) {
    __m256 a[8];
    for (int v = 0; v < 8; v++) a[v] = _mm256_setzero_ps();
    const __m256i hi = _mm256_set1_epi32((int)0xffff0000u);
    for (int kp = 0; kp < nkp; kp++) {
        const uint16_t *wr = w + (size_t)kp * 128;
        for (int l = 0; l < 4; l++) {
            _mm_prefetch((const char *)wr + STREAM2_PF + 64 * l, _MM_HINT_T0);
            _mm_prefetch((const char *)wr + STREAM2_PF2 + 64 * l, _MM_HINT_T1);
        }
        __m256 xe = _mm256_broadcast_ss(x + 2 * kp), xo = _mm256_broadcast_ss(x + 2 * kp + 1);
        for (int v = 0; v < 8; v++) {
            __m256i t = _mm256_loadu_si256((const __m256i *)(wr + 16 * v));
            a[v] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_slli_epi32(t, 16)), xe, a[v]);
            a[v] = _mm256_fmadd_ps(_mm256_castsi256_ps(_mm256_and_si256(t, hi)), xo, a[v]);
        }
    }
    for (int v = 0; v < 8; v++) _mm256_storeu_ps(C + 8 * v, a[v]);
}

/* 2+ tokens: per k-block, each tile of 4-6 tokens (1-3 below 8) reads its rows in place (MOE_F32_ROW
 * apart: rows a multiple of 4 KiB long shared L1 sets and evicted the weights) and runs the
 * block's 4 16-channel slices, whose 16 KiB of weights stay in L1 across the block's tiles. */
void moe_panel_bf16_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    const uint16_t *wp = (const uint16_t *)(W->data + W->panel_bytes * (size_t)p);
    int nkp = W->Kp / 2, n = rows->n;
    if (n == 1) {
        gemv_bf16_avx2(wp, nkp, rows->f[0], C);
        return;
    }
    (void)scratch;
    const float *x[BF2_MR];
    int nt = (n + BF2_MR - 1) / BF2_MR, pf = (4 * KC_BF + nt - 1) / nt; /* tiles; weight lines each */
    for (int k0 = 0; k0 < nkp; k0 += KC_BF) {
        int kc = nkp - k0 < KC_BF ? nkp - k0 : KC_BF;
        for (int t = 0, m0 = 0, mr; t < nt; t++, m0 += mr) {
            mr = n / nt + (t < n % nt); /* 4-6 tokens from 8 on: no 1-3-token tail */
            for (int m = 0; m < mr; m++) x[m] = rows->f[m0 + m] + 2 * k0;
            for (int l = t * pf; l < (t + 1) * pf && l < 4 * (nkp - k0 - kc); l++) /* the next block's weights */
                _mm_prefetch((const char *)(wp + (size_t)(k0 + kc) * 128) + 64 * l, BF2_PF_HINT);
            for (int c0 = 0; c0 < 64; c0 += 16) { /* 16-channel slices of the panel */
                const uint16_t *w = wp + (size_t)k0 * 128 + 2 * c0;
                float *Cm = C + (size_t)m0 * 64 + c0;
                switch (mr) {
                case 1: mk_bf16_avx2(1, w, kc, x, Cm, k0 > 0); break;
                case 2: mk_bf16_avx2(2, w, kc, x, Cm, k0 > 0); break;
                case 3: mk_bf16_avx2(3, w, kc, x, Cm, k0 > 0); break;
                case 4: mk_bf16_avx2(4, w, kc, x, Cm, k0 > 0); break;
                default: mk_bf16_asm(mr, w, kc, x, Cm, k0 > 0); break;
                }
            }
        }
    }
}

static inline __m256 bf16x8_to_ps(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* 8 e8m0 bytes -> their mxfp4 group scales 2^(e - 127), moe_mxfp4_scale's steps on 8 lanes */
static inline __m256 e8x8_to_ps(const uint8_t *p) {
    __m256i b = _mm256_slli_epi32(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p)), 23);
    return _mm256_castsi256_ps(_mm256_max_epi32(b, _mm256_set1_epi32(0x00400000)));
}

/* a nibble group's bytes and its 32 scales from c0 (8 lanes): int4 (1) bf16, mxfp4 (2) e8m0 */
#define NIB_GB(int4) ((int4) == 2 ? MOE_MXFP4_GROUP_BYTES : MOE_INT4_GROUP_BYTES)
static inline __m256 group_scale8(const uint8_t *gb, int int4, int c0) {
    return int4 == 2 ? e8x8_to_ps(gb + 512 + c0) : bf16x8_to_ps((const uint16_t *)(gb + 512) + c0);
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
                if (n == 1) { /* a weight stream (decode): the lines ahead, as the bf16 GEMV */
                    const char *gp = (const char *)wp + (size_t)g * (int4 ? NIB_GB(int4) : 8 * 128);
                    for (int l = 0; l < (int4 ? 9 : 16); l++) {
                        _mm_prefetch(gp + STREAM2_PF + 64 * l, _MM_HINT_T0);
                        _mm_prefetch(gp + STREAM2_PF2 + 64 * l, _MM_HINT_T1);
                    }
                }
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
                    const uint8_t *gb = wp + (size_t)g * NIB_GB(int4);
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
                    const uint8_t *gs = wp + (size_t)g * NIB_GB(int4);
                    for (int v = 0; v < 4; v++)
                        acc[v] = _mm256_fmadd_ps(group_scale8(gs, int4, 8 * v),
                                                 _mm256_fmsub_ps(SUM16(v), xs, xc), acc[v]);
                }
            }
            for (int v = 0; v < 4; v++) _mm256_storeu_ps(c + 8 * v, acc[v]);
        }
    }
    if (!int4) scale_channels_avx2(W->chscale + p * 32, C, n);
}

/* ---------------- 2+ tokens: vpmaddwd on a widened weight tile ----------------
 * The two-level activation 254 * q1 + q2 fits int16 (|.| <= 32385), so one vpmaddwd multiplies 16
 * weights by whole 16-bit activations (the 1-token path needs two vpmaddubsw levels and the sign
 * trick). Per k-block of WGC groups, the panel's weights are widened once to int16 in scratch (int8:
 * w, signed; int4: the nibble q + 8; mxfp4: 2 * e2m1 + 12) and reused by every token of the call;
 * each token's activations of the block are widened once to x16. A micro-tile is W_MR tokens x 8
 * channels: per quad of k, 2 tile vectors (the k-pairs (0, 1), then (2, 3), of the 8 channels: a
 * vpmaddwd lane is one channel's pair) x W_MR tokens (two 32-bit broadcasts each) of vpmaddwd + vpaddd.
 * The integer group sum is the 1-token path's 254 * ih + il exactly
 * (integer adds in any order are exact; no overflow: |sum| < 32 * 127 * 32385 < 2^31), and
 * cvt(254 * ih + il) == fma(cvt(ih), 254, cvt(il)) (both round the same integer once), so the float
 * steps per group are the 1-token path's in its order: a row's bits do not depend on the path. */
#define WGC 8   /* groups per k-block: the int16 tile is WGC x 8 quads x 256 B = 16 KiB, L1-resident */
#define W_MR 6  /* tokens per micro-tile (mk_wd_n: at most 6): 6 int32 + 6 f32 accumulators, 2 weights, 2 broadcasts */

/* tile[(g * 8 + qd) * 128 + 32 (c / 8) + 16 p + 2 (c % 8) + j] = weight of channel c, k = 32 g + 4 qd + 2 p + j,
 * int16, g < ng: per quad and 8 channels, their k-pairs (0, 1) then (2, 3), so a vpmaddwd's lane is one channel */
static void widen_tile(const uint8_t *wp, int g0, int ng, int int4, int16_t *tile) {
    const __m256i x80 = _mm256_set1_epi8((char)0x80), lo4 = _mm256_set1_epi8(0x0f);
    const __m256i pairs = /* per 4 channels x 4 k: the k-pairs (0, 1), then (2, 3) */
        _mm256_broadcastsi128_si256(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)moe_mxfp4_u8));
    for (int g = 0; g < ng; g++) {
        int16_t *tg = tile + (size_t)g * 8 * 128;
        for (int h = 0; h < 4; h++) { /* int8: quads 2h, 2h + 1; int4: octet h (lo = quad 2h, hi = 2h + 1) */
            for (int v = 0; v < 4; v++) { /* 8 channels x 4 bytes */
                __m256i a, b;
                if (!int4) {
                    const uint8_t *gb = wp + (size_t)(g0 + g) * 8 * 128;
                    a = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(gb + 2 * h * 128 + 32 * v)), x80);
                    b = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(gb + (2 * h + 1) * 128 + 32 * v)), x80);
                } else {
                    const uint8_t *gb = wp + (size_t)(g0 + g) * NIB_GB(int4);
                    __m256i pk = _mm256_loadu_si256((const __m256i *)(gb + h * 128 + 32 * v));
                    a = _mm256_and_si256(pk, lo4);
                    b = _mm256_and_si256(_mm256_srli_epi16(pk, 4), lo4);
                    if (int4 == 2) {
                        a = _mm256_shuffle_epi8(lut, a);
                        b = _mm256_shuffle_epi8(lut, b);
                    }
                }
                __m256i q[2] = {a, b};
                for (int i = 0; i < 2; i++) { /* per lane (4 channels x 4 k): the k-pairs (0, 1), then (2, 3) */
                    __m256i r = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(q[i], pairs), 0xd8);
                    __m128i l = _mm256_castsi256_si128(r), u = _mm256_extracti128_si256(r, 1);
                    __m256i wl = int4 ? _mm256_cvtepu8_epi16(l) : _mm256_cvtepi8_epi16(l);
                    __m256i wu = int4 ? _mm256_cvtepu8_epi16(u) : _mm256_cvtepi8_epi16(u);
                    int16_t *d = tg + (2 * h + i) * 128 + 32 * v;
                    _mm256_store_si256((__m256i *)d, wl);
                    _mm256_store_si256((__m256i *)(d + 16), wu);
                }
            }
        }
    }
}

/* the f32 scales of groups [g0, g0 + ng) of a nibble panel into wsc[g][32] (int4 1: bf16, mxfp4 2: e8m0),
 * once per k-block (or panel) instead of in every micro-tile, where the conversion's constants would
 * spill the accumulators (moe_avx2_ub.c's micro-kernel reads them too) */
void moe_group_scales_avx2(const uint8_t *wp, int g0, int ng, int int4, float *wsc) {
    for (int g = 0; g < ng; g++)
        for (int c0 = 0; c0 < 32; c0 += 8)
            _mm256_store_ps(wsc + (size_t)g * 32 + c0, group_scale8(wp + (size_t)(g0 + g) * NIB_GB(int4), int4, c0));
}

/* x16[k] = 254 * q1 + q2 for the groups [g0, g0 + ng) of a two-level row */
static void widen_x(const int8_t *xr, int g0, int ng, int16_t *x16) {
    const __m256i k254 = _mm256_set1_epi16(254);
    for (int g = 0; g < ng; g++) {
        const int8_t *q = xr + (size_t)(g0 + g) * 64;
        for (int h = 0; h < 2; h++) {
            __m256i q1 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 16 * h)));
            __m256i q2 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(q + 32 + 16 * h)));
            _mm256_store_si256((__m256i *)(x16 + g * 32 + 16 * h), _mm256_add_epi16(_mm256_mullo_epi16(q1, k254), q2));
        }
    }
}

/* channels [c0, c0 + 8) of MR tokens over the block's ng groups: C (+)= the 1-token path's float steps */
static inline __attribute__((always_inline)) void mk_wd(const int MR, const int int4, const int16_t *tile,
                                                       const int16_t *x16, int ng, const float *wsc, int g0,
                                                       const MoeRows *rows, int m0, int c0, float *C, int load) {
    __m256 acc[W_MR];
    for (int m = 0; m < MR; m++)
        acc[m] = load ? _mm256_loadu_ps(C + (size_t)(m0 + m) * 32 + c0) : _mm256_setzero_ps();
    for (int g = 0; g < ng; g++) {
        __m256i ia[W_MR];
        for (int m = 0; m < MR; m++) ia[m] = _mm256_setzero_si256();
#pragma GCC unroll 1 /* unrolled, GCC regroups the integer adds into trees and spills the products */
        for (int qd = 0; qd < 8; qd++) {
            const int16_t *tq = tile + (size_t)(g * 8 + qd) * 128 + c0 * 4;
            __m256i w0 = _mm256_load_si256((const __m256i *)tq), w1 = _mm256_load_si256((const __m256i *)(tq + 16));
            for (int m = 0; m < MR; m++) {
                int32_t x01, x23;
                memcpy(&x01, x16 + (size_t)m * WGC * 32 + g * 32 + qd * 4, 4);
                memcpy(&x23, x16 + (size_t)m * WGC * 32 + g * 32 + qd * 4 + 2, 4);
                __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, _mm256_set1_epi32(x01)),
                                             _mm256_madd_epi16(w1, _mm256_set1_epi32(x23)));
                ia[m] = _mm256_add_epi32(ia[m], p);
            }
        }
        __m256 ws = _mm256_setzero_ps();
        if (int4) ws = _mm256_load_ps(wsc + (size_t)g * 32 + c0);
        for (int m = 0; m < MR; m++) {
            __m256 sf = _mm256_cvtepi32_ps(ia[m]), xs = _mm256_set1_ps(rows->xs[m0 + m][g0 + g]);
            if (!int4) acc[m] = _mm256_fmadd_ps(sf, xs, acc[m]);
            else acc[m] = _mm256_fmadd_ps(ws, _mm256_fmsub_ps(sf, xs, _mm256_set1_ps(rows->xc[m0 + m][g0 + g])), acc[m]);
        }
    }
    for (int m = 0; m < MR; m++) _mm256_storeu_ps(C + (size_t)(m0 + m) * 32 + c0, acc[m]);
}

static void mk_wd_n(int mr, int int4, const int16_t *tile, const int16_t *x16, int ng, const float *wsc, int g0,
                    const MoeRows *rows, int m0, float *C) {
#define MKWD(R, F) \
    for (int c0 = 0; c0 < 32; c0 += 8) mk_wd(R < W_MR ? R : W_MR, F, tile, x16, ng, wsc, g0, rows, m0, c0, C, g0 > 0)
#define MKWD_MR(F) switch (mr) { \
    case 1: MKWD(1, F); break; case 2: MKWD(2, F); break; case 3: MKWD(3, F); break; \
    case 4: MKWD(4, F); break; case 5: MKWD(5, F); break; default: MKWD(6, F); break; }
    if (int4 == 0) MKWD_MR(0)
    else if (int4 == 1) MKWD_MR(1)
    else MKWD_MR(2)
#undef MKWD_MR
#undef MKWD
}

/* int8 epilogue: C[m][0..32) *= the panel's 32 per-output-channel scales, for n tokens */
static void scale_channels_avx2(const float *chs, float *C, int n) {
    for (int m = 0; m < n; m++)
        for (int v = 0; v < 4; v++)
            _mm256_storeu_ps(C + m * 32 + 8 * v, _mm256_mul_ps(_mm256_loadu_ps(C + m * 32 + 8 * v), _mm256_loadu_ps(chs + 8 * v)));
}

/* int4: 0 int8, 1 int4, 2 mxfp4; scratch holds the int16 tile (16 KiB), W_MR x16 rows (3 KiB) and the
 * block's group scales (1 KiB) */
static void panel_int_wd(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch, int int4) {
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    int G = W->Kp / MOE_GROUP, n = rows->n;
    int16_t *tile = scratch, *x16 = tile + WGC * 8 * 128;
    float *wsc = (float *)(x16 + W_MR * WGC * 32);
    for (int g0 = 0; g0 < G; g0 += WGC) {
        int ng = G - g0 < WGC ? G - g0 : WGC;
        widen_tile(wp, g0, ng, int4, tile);
        if (int4) moe_group_scales_avx2(wp, g0, ng, int4, wsc);
        for (int m0 = 0; m0 < n; m0 += W_MR) {
            int mr = n - m0 < W_MR ? n - m0 : W_MR;
            for (int m = 0; m < mr; m++) widen_x(rows->q[m0 + m], g0, ng, x16 + (size_t)m * WGC * 32);
            mk_wd_n(mr, int4, tile, x16, ng, wsc, g0, rows, m0, C);
        }
    }
    if (!int4) scale_channels_avx2(W->chscale + p * 32, C, n);
}

void moe_panel_int8_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n == 1) panel_int_avx2(W, p, rows, C, 0);
    else panel_int_wd(W, p, rows, C, scratch, 0);
}
void moe_panel_int4_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n == 1) panel_int_avx2(W, p, rows, C, 1);
    else if (rows->act8) moe_panel_int_ub_avx2(W, p, rows, C, scratch, 0);
    else panel_int_wd(W, p, rows, C, scratch, 1);
}
void moe_panel_mxfp4_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n == 1) panel_int_avx2(W, p, rows, C, 2);
    else if (rows->act8 && rows->xo) moe_panel_int_ub_avx2(W, p, rows, C, scratch, 1);
    else panel_int_wd(W, p, rows, C, scratch, 2);
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
#define PROBE2_CHAINS 12

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

/* The exact s8 x s8 dot's own ceilings on AVX2 (kinds 2, 3 of moe_probe_avx2): vpmaddubsw's u8 x s8 pairs
 * saturate for signed 8-bit weights (2 * 255 * 127 > 2^15), so an exact int8 dot takes at least two
 * multiply-port ops per 32 products. 2: vpmaddwd + vpaddd on int16 weights (16 products: the int8
 * tile's loop); 3: vpsignb + vpmaddubsw + vpmaddwd (widening, the pair sums are up to 2 * 128 * 127)
 * + vpaddd (32 products: the sign trick), each in 12 chains. Returns the operations done. */
static double probe_int8_exact(int kind, long iters) {
    __m256i acc[PROBE2_CHAINS];
    for (int c = 0; c < PROBE2_CHAINS; c++) acc[c] = _mm256_set1_epi8((char)(1 + c));
    const __m256i w = _mm256_set1_epi8(-3), aw = _mm256_abs_epi8(w), ones = _mm256_set1_epi16(1);
    for (long i = 0; i < iters; i++)
        for (int c = 0; c < PROBE2_CHAINS; c++) {
            __m256i p = kind == 2 ? _mm256_madd_epi16(acc[c], w)
                                  : _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(acc[c], w)), ones);
            acc[c] = _mm256_add_epi32(acc[c], p);
        }
    __m256i t = acc[0];
    for (int c = 1; c < PROBE2_CHAINS; c++) t = _mm256_xor_si256(t, acc[c]);
    volatile int sink = _mm256_extract_epi32(t, 0);
    (void)sink;
    return (double)iters * PROBE2_CHAINS * (kind == 2 ? 32.0 : 64.0);
}

/* `iters` rounds of 12 independent 256-bit chains: kind 0 f32 FMA (the AVX2 bf16 kernel's
 * instruction), 1 vpmaddubsw u8 x s8 (the AVX2 int8/int4 kernels' multiply); 2, 3 the exact int8
 * dot's sequences (probe_int8_exact). Returns the operations done (2 per multiply-add); the caller
 * times it on every thread at once. */
double moe_probe_avx2(int kind, long iters) {
    if (kind >= 2) return probe_int8_exact(kind, iters);
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

