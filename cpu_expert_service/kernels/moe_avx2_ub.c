/* moesplit CPU MoE: AVX2 8-bit-activation prefill micro-kernel for the nibble formats (int4, mxfp4), 2+
 * tokens: one-level vpmaddubsw on in-register unpacked nibbles, shared by UB_MR tokens; the group sums of
 * 6- and 4-token tiles are inline asm with hand-allocated registers (16 ymm), 1..3 tokens intrinsics. The
 * rest of the AVX2 kernels (and the dispatch that calls moe_panel_int_ub_avx2) are in moe_avx2.c. */
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "moe.h"

/* ---------------- 2+ tokens at 8-bit activations (int4, mxfp4): one-level vpmaddubsw ----------------
 * With rows->act8 every q2 is 0, so the 1-token path's group sum is its q1 half alone: the nibbles (u8
 * <= 15; mxfp4 2 * e2m1 + 12 <= 24) times q1 (s8) go straight into vpmaddubsw (no sign trick; two
 * products per int16 lane, 2 * 24 * 127 < 2^15: no saturation), and the unpacked nibbles of a
 * 16-channel slice are shared by UB_MR tokens. Per group the float steps are the 1-token path's in its
 * order (fma(cvt(ih), 254, cvt(0)), fmsub by xs and xc, fma by the group scale), so a row's bits
 * do not depend on the path or the batch. int8 keeps the vpmaddwd path: with the sign trick a
 * vpmaddubsw step costs the same uops per product as vpmaddwd on widened weights. */
#define UB_MR 6 /* tokens per micro-tile: 6 (ub_sums6) or 4 (ub_sums4; a remainder of 5 goes as 4 + 1) */

/* The 4-token group sums by hand-allocated registers (GCC's version of mk_ub's octet loop spills two
 * products and reloads the table and mask each octet: 16 ymm registers hold exactly 8 sums, the 4 nibble
 * vectors, 2 broadcasts, one product and the table; the mask is a memory operand). An octet: its 2 x 8
 * channels' codes unpacked (low, high nibbles; mx: through the table), then per token the two activation
 * quads broadcast and 4 vpmaddubsw, each product added into its token's int16 sum (wrapping adds: exact
 * mod 2^16 in any order, so the sums equal the intrinsics'). */
static const uint8_t ub_lo4[32] __attribute__((aligned(32), used)) = {
    15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15,
    15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15, 15};
#define UB_UNPACK(o0, o1, SHUF)                                                                              \
    "vmovdqu " o0 "(%[gb]), %[l0]\n\tvmovdqu " o1 "(%[gb]), %[l1]\n\t"                                     \
    "vpsrlw $4, %[l0], %[h0]\n\tvpsrlw $4, %[l1], %[h1]\n\t"                                               \
    "vpand %[lo4], %[l0], %[l0]\n\tvpand %[lo4], %[l1], %[l1]\n\t"                                         \
    "vpand %[lo4], %[h0], %[h0]\n\tvpand %[lo4], %[h1], %[h1]\n\t" SHUF
#define UB_SHUF "vpshufb %[l0], %[lut], %[l0]\n\tvpshufb %[l1], %[lut], %[l1]\n\t" \
                "vpshufb %[h0], %[lut], %[h0]\n\tvpshufb %[h1], %[lut], %[h1]\n\t"
#define UB_BCAST(X, xa, xb) "vpbroadcastd " xa "(%[" X "]), %[a]\n\tvpbroadcastd " xb "(%[" X "]), %[b]\n\t"
#define UB_MAC0(X, S0, S1, xa, xb) UB_BCAST(X, xa, xb)                                                        \
    "vpmaddubsw %[a], %[l0], %[" S0 "]\n\tvpmaddubsw %[a], %[l1], %[" S1 "]\n\t"                            \
    "vpmaddubsw %[b], %[h0], %[t]\n\tvpaddw %[t], %[" S0 "], %[" S0 "]\n\t"                                 \
    "vpmaddubsw %[b], %[h1], %[b]\n\tvpaddw %[b], %[" S1 "], %[" S1 "]\n\t"
#define UB_MAC(X, S0, S1, xa, xb) UB_BCAST(X, xa, xb)                                                         \
    "vpmaddubsw %[a], %[l0], %[t]\n\tvpaddw %[t], %[" S0 "], %[" S0 "]\n\t"                                 \
    "vpmaddubsw %[a], %[l1], %[a]\n\tvpaddw %[a], %[" S1 "], %[" S1 "]\n\t"                                 \
    "vpmaddubsw %[b], %[h0], %[t]\n\tvpaddw %[t], %[" S0 "], %[" S0 "]\n\t"                                 \
    "vpmaddubsw %[b], %[h1], %[b]\n\tvpaddw %[b], %[" S1 "], %[" S1 "]\n\t"
#define UB_OCTET(MAC, o0, o1, xa, xb, SHUF) UB_UNPACK(o0, o1, SHUF)                                         \
    MAC("x0", "s00", "s01", xa, xb) MAC("x1", "s10", "s11", xa, xb)                                        \
    MAC("x2", "s20", "s21", xa, xb) MAC("x3", "s30", "s31", xa, xb)
#define UB_GROUP(SHUF)                                                                                       \
    UB_OCTET(UB_MAC0, "0", "32", "0", "4", SHUF) UB_OCTET(UB_MAC, "128", "160", "8", "12", SHUF)           \
    UB_OCTET(UB_MAC, "256", "288", "16", "20", SHUF) UB_OCTET(UB_MAC, "384", "416", "24", "28", SHUF)
#define UB_OPERANDS                                                                                          \
    : [s00] "=&x"(s[0][0]), [s01] "=&x"(s[0][1]), [s10] "=&x"(s[1][0]), [s11] "=&x"(s[1][1]),               \
      [s20] "=&x"(s[2][0]), [s21] "=&x"(s[2][1]), [s30] "=&x"(s[3][0]), [s31] "=&x"(s[3][1]),               \
      [l0] "=&x"(l0), [l1] "=&x"(l1), [h0] "=&x"(h0), [h1] "=&x"(h1), [a] "=&x"(a), [b] "=&x"(b), [t] "=&x"(t) \
    : [gb] "r"(gb), [x0] "r"(x[0]), [x1] "r"(x[1]), [x2] "r"(x[2]), [x3] "r"(x[3]), [lut] "x"(lut),        \
      [lo4] "m"(*lo4), "m"(*(const uint8_t(*)[448])gb), "m"(*(const int8_t(*)[32])x[0]),                    \
      "m"(*(const int8_t(*)[32])x[1]), "m"(*(const int8_t(*)[32])x[2]), "m"(*(const int8_t(*)[32])x[3])
static inline __attribute__((always_inline)) void ub_sums4(const int mx, const uint8_t *gb, const int8_t *const *x,
                                                          __m256i lut, const __m256i *lo4, __m256i s[UB_MR][2]) {
    __m256i l0, l1, h0, h1, a, b, t;
    if (mx) __asm__(UB_GROUP(UB_SHUF) UB_OPERANDS);
    else __asm__(UB_GROUP("") UB_OPERANDS);
}

/* 6 tokens: 12 int16 sums leave room for one half-octet's 2 nibble vectors, a broadcast and a product, so
 * each octet goes as its low nibbles (activations k 0..3) then its high ones (k 4..7), the table reloaded
 * into the product register before each unpack: the unpack (10 ops an octet, 14 with the table) is shared
 * by 6 tokens instead of 4. The table and mask are read by name (30 operands at most). */
static const uint8_t ub_lut[32] __attribute__((aligned(32), used)) = {MOE_MXFP4_U8_VALUES, MOE_MXFP4_U8_VALUES};
#define UB6_LUT "vmovdqa ub_lut(%%rip), %[t]\n\t"
#define UB6_SHUF "vpshufb %[l0], %[t], %[l0]\n\tvpshufb %[l1], %[t], %[l1]\n\t"
#define UB6_LO(o0, o1, LUT, SHUF) LUT "vmovdqu " o0 "(%[gb]), %[l0]\n\tvmovdqu " o1 "(%[gb]), %[l1]\n\t"            \
    "vpand ub_lo4(%%rip), %[l0], %[l0]\n\tvpand ub_lo4(%%rip), %[l1], %[l1]\n\t" SHUF
#define UB6_HI(o0, o1, LUT, SHUF) LUT "vmovdqu " o0 "(%[gb]), %[l0]\n\tvmovdqu " o1 "(%[gb]), %[l1]\n\t"            \
    "vpsrlw $4, %[l0], %[l0]\n\tvpsrlw $4, %[l1], %[l1]\n\t"                                                  \
    "vpand ub_lo4(%%rip), %[l0], %[l0]\n\tvpand ub_lo4(%%rip), %[l1], %[l1]\n\t" SHUF
#define UB6_MAC0(X, S0, S1, xa) "vpbroadcastd " xa "(%[" X "]), %[a]\n\t"                                      \
    "vpmaddubsw %[a], %[l0], %[" S0 "]\n\tvpmaddubsw %[a], %[l1], %[" S1 "]\n\t"
#define UB6_MAC(X, S0, S1, xa) "vpbroadcastd " xa "(%[" X "]), %[a]\n\t"                                       \
    "vpmaddubsw %[a], %[l0], %[t]\n\tvpaddw %[t], %[" S0 "], %[" S0 "]\n\t"                                 \
    "vpmaddubsw %[a], %[l1], %[a]\n\tvpaddw %[a], %[" S1 "], %[" S1 "]\n\t"
#define UB6_HALF(MAC, xa) MAC("x0", "s00", "s01", xa) MAC("x1", "s10", "s11", xa) MAC("x2", "s20", "s21", xa) \
    MAC("x3", "s30", "s31", xa) MAC("x4", "s40", "s41", xa) MAC("x5", "s50", "s51", xa)
#define UB6_OCTET(MAC, o0, o1, xa, xb, LUT, SHUF) \
    UB6_LO(o0, o1, LUT, SHUF) UB6_HALF(MAC, xa) UB6_HI(o0, o1, LUT, SHUF) UB6_HALF(UB6_MAC, xb)
#define UB6_GROUP(LUT, SHUF)                                                                                  \
    UB6_OCTET(UB6_MAC0, "0", "32", "0", "4", LUT, SHUF) UB6_OCTET(UB6_MAC, "128", "160", "8", "12", LUT, SHUF) \
    UB6_OCTET(UB6_MAC, "256", "288", "16", "20", LUT, SHUF) UB6_OCTET(UB6_MAC, "384", "416", "24", "28", LUT, SHUF)
#define UB6_OPERANDS                                                                                         \
    : [s00] "=&x"(s[0][0]), [s01] "=&x"(s[0][1]), [s10] "=&x"(s[1][0]), [s11] "=&x"(s[1][1]),               \
      [s20] "=&x"(s[2][0]), [s21] "=&x"(s[2][1]), [s30] "=&x"(s[3][0]), [s31] "=&x"(s[3][1]),               \
      [s40] "=&x"(s[4][0]), [s41] "=&x"(s[4][1]), [s50] "=&x"(s[5][0]), [s51] "=&x"(s[5][1]),               \
      [l0] "=&x"(l0), [l1] "=&x"(l1), [a] "=&x"(a), [t] "=&x"(t)                                              \
    : [gb] "r"(gb), [x0] "r"(x[0]), [x1] "r"(x[1]), [x2] "r"(x[2]), [x3] "r"(x[3]), [x4] "r"(x[4]),          \
      [x5] "r"(x[5]), "m"(*(const uint8_t(*)[448])gb), "m"(*(const int8_t(*)[32])x[0]),                     \
      "m"(*(const int8_t(*)[32])x[1]), "m"(*(const int8_t(*)[32])x[2]), "m"(*(const int8_t(*)[32])x[3]),     \
      "m"(*(const int8_t(*)[32])x[4]), "m"(*(const int8_t(*)[32])x[5])
static inline __attribute__((always_inline)) void ub_sums6(const int mx, const uint8_t *gb, const int8_t *const *x,
                                                          __m256i s[UB_MR][2]) {
    __m256i l0, l1, a, t;
    if (mx) __asm__(UB6_GROUP(UB6_LUT, UB6_SHUF) UB6_OPERANDS);
    else __asm__(UB6_GROUP("", "") UB6_OPERANDS);
}

/* 16 channels [c0, c0 + 16) of MR tokens over all G groups (mx 0 int4, 1 mxfp4), each unpacked
 * 16-channel slice shared by MR tokens; a group's vpmaddubsw pairs summed in int16 over all 4 octets
 * (16 products per lane), then one vpmaddwd by 254: 254 * the group sum, exact in int32, whose cvt rounds
 * the same integer as the 1-token path's fma(cvt(sum), 254, 0). int4: <= 16 * 15 * 127 < 2^15. mxfp4
 * (2v + 12 <= 24): the int16 adds wrap (16 * 24 * 127 > 2^15), but the signed part sum(2v * q1) is <= 16 *
 * 12 * 127 < 2^15, so subtracting each lane's offset part 12 * sum(q1) (rows->xo, mod 2^16) leaves it
 * exact, and 254 * 12 * sum(q1) (rows->xo) is added back in int32. The integer sums are exact in any
 * order, so the bits equal the 1-token path's. MR 6 and 4: ub_sums6 / ub_sums4; else the intrinsics. */
static inline __attribute__((always_inline)) void mk_ub(const int MR, const int mx, const uint8_t *wp, const float *wsc,
                                                       int G, const MoeRows *rows, int m0, int c0, float *C) {
    const __m256i k254 = _mm256_set1_epi16(254), lo4 = _mm256_set1_epi8(0x0f);
    const __m256i lut = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)moe_mxfp4_u8));
    __m256 acc[UB_MR][2];
    for (int m = 0; m < MR; m++) acc[m][0] = acc[m][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const uint8_t *gb = wp + (size_t)g * (mx ? MOE_MXFP4_GROUP_BYTES : MOE_INT4_GROUP_BYTES);
        __m256i s[UB_MR][2];
        if (MR == 4 || MR == 6) {
            const int8_t *x[UB_MR];
            for (int m = 0; m < MR; m++) x[m] = rows->q[m0 + m] + (size_t)g * 64;
            if (MR == 6) ub_sums6(mx, gb + 4 * c0, x, s);
            else ub_sums4(mx, gb + 4 * c0, x, lut, (const __m256i *)ub_lo4, s);
        } else for (int o = 0; o < 4; o++) {
            __m256i l[2], h[2];
            for (int v = 0; v < 2; v++) {
                __m256i pk = _mm256_loadu_si256((const __m256i *)(gb + o * 128 + 4 * c0 + 32 * v));
                l[v] = _mm256_and_si256(pk, lo4);
                h[v] = _mm256_and_si256(_mm256_srli_epi16(pk, 4), lo4);
                if (mx) {
                    l[v] = _mm256_shuffle_epi8(lut, l[v]);
                    h[v] = _mm256_shuffle_epi8(lut, h[v]);
                }
            }
            for (int m = 0; m < MR; m++) {
                const int8_t *xq = rows->q[m0 + m] + (size_t)g * 64 + 8 * o;
                __m256i a = _mm256_set1_epi32(*(const int32_t *)xq), b = _mm256_set1_epi32(*(const int32_t *)(xq + 4));
                for (int v = 0; v < 2; v++) {
                    __m256i ph = _mm256_add_epi16(_mm256_maddubs_epi16(l[v], a), _mm256_maddubs_epi16(h[v], b));
                    s[m][v] = o == 0 ? ph : _mm256_add_epi16(s[m][v], ph);
                }
            }
            /* each octet's sums in registers before the next: otherwise GCC regroups the adds of the
             * unrolled octets into trees and spills the products */
            for (int m = 0; m < MR; m++)
                for (int v = 0; v < 2; v++) __asm__("" : "+x"(s[m][v]));
        }
        __m256 ws[2] = {_mm256_load_ps(wsc + (size_t)g * 32 + c0), _mm256_load_ps(wsc + (size_t)g * 32 + c0 + 8)};
        for (int m = 0; m < MR; m++) { /* 254 * the group sum, exact in int32 (< 2^31), then the float steps */
            __m256i off = mx ? _mm256_set1_epi32(rows->xo[m0 + m][2 * g]) : _mm256_setzero_si256();
            __m256i fo = mx ? _mm256_set1_epi32(rows->xo[m0 + m][2 * g + 1]) : _mm256_setzero_si256();
            __m256 xs = _mm256_set1_ps(rows->xs[m0 + m][g]), xc = _mm256_set1_ps(rows->xc[m0 + m][g]);
            for (int v = 0; v < 2; v++) {
                __m256i ia = mx ? _mm256_add_epi32(_mm256_madd_epi16(_mm256_sub_epi16(s[m][v], off), k254), fo)
                                : _mm256_madd_epi16(s[m][v], k254);
                acc[m][v] = _mm256_fmadd_ps(ws[v], _mm256_fmsub_ps(_mm256_cvtepi32_ps(ia), xs, xc), acc[m][v]);
            }
        }
    }
    for (int m = 0; m < MR; m++)
        for (int v = 0; v < 2; v++) _mm256_storeu_ps(C + (size_t)(m0 + m) * 32 + c0 + 8 * v, acc[m][v]);
}

/* int4 (mx 0) / mxfp4 (mx 1) panel for 2+ rows at 8-bit activations; scratch: the panel's group scales */
void moe_panel_int_ub_avx2(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch, int mx) {
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    int G = W->Kp / MOE_GROUP, n = rows->n;
    float *wsc = scratch; /* G x 32 floats: 4 KiB per 1024 inputs, within moe_scratch_bytes */
    moe_group_scales_avx2(wp, 0, G, mx ? 2 : 1, wsc);
    for (int m0 = 0, mr; m0 < n; m0 += mr) {
        mr = n - m0 < UB_MR ? n - m0 : UB_MR;
        if (mr == 5) mr = 4;
        for (int c0 = 0; c0 < 32; c0 += 16) {
#define MKUB(R) (mx ? mk_ub(R, 1, wp, wsc, G, rows, m0, c0, C) : mk_ub(R, 0, wp, wsc, G, rows, m0, c0, C))
            switch (mr) {
            case 1: MKUB(1); break;
            case 2: MKUB(2); break;
            case 3: MKUB(3); break;
            case 4: MKUB(4); break;
            default: MKUB(6); break;
            }
#undef MKUB
        }
    }
}
