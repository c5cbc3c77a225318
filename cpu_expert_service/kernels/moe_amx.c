/* moesplit CPU MoE: AMX kernels (Sapphire Rapids and later), for large token batches.
 *
 * Uses the same packed layouts as the AVX-512 path, which are already AMX B-tile layouts:
 *   bf16 panel [Kp/2][64][2]: a B tile is 16 k-pair rows x 16 channels x 2 bf16, row stride 256 B
 *   int8 panel [Kp/4][32][4]: a B tile is 8 quad rows x 16 channels x 4 u8,    row stride 128 B
 *   int4 / mxfp4: one group is unpacked to two 8 x 64 B u8 tiles in scratch (mxfp4's e2m1 codes
 *   through moe_mxfp4_u8 to 2 * value + 12, as the AVX-512 kernels' vpshufb).
 * Activations are gathered 16 tokens at a time into a contiguous A tile buffer in scratch.
 * int8/int4/mxfp4 use TDPBSUD (signed activations x unsigned weights, w + 128 / q + 8 / 2 * e2m1 + 12)
 * one group of 32 at a time, once per level of the two-level int8 activations (once only with 8-bit
 * activations, MoeRows.act8), so the per-group activation scale, the weight group scale (int4's bf16,
 * mxfp4's e8m0 byte) and the unsigned-offset correction apply exactly as in the AVX-512 path. bf16
 * runs every token count on the tiles; int8/int4/mxfp4 send fewer than 16 tokens to the AVX-512
 * kernels, and from 16 on give those kernels' bits (integer dot products, the same f32 epilogue in the
 * same order), so a row's bits do not depend on its expert's token count.
 *
 * The dispatcher only selects this file after moe_cpu_has(MOE_ISA_AMX), which also obtained
 * the XTILEDATA permission with arch_prctl(ARCH_REQ_XCOMP_PERM). Built with -DMOE_AMX_EMULATE,
 * the tile instructions are a software model (amx_emu.h) so tests run this file without AMX. */
#if defined(MOE_AMX_EMULATE) && defined(MOE_SIMDE) /* tests without AVX-512: portable intrinsics too */
#include "simde_x86.h"
#include "amx_emu.h"
#elif defined(MOE_AMX_EMULATE) /* tests: the tile instructions in software (amx_emu.h), on any AVX-512 CPU */
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni")
#include <immintrin.h>
#include "amx_emu.h"
#else
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx512vnni,amx-tile,amx-bf16,amx-int8")
#include <immintrin.h>
#endif
#include <string.h>

#include "moe.h"

void moe_panel_int8_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);
void moe_panel_int4_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);
void moe_panel_mxfp4_avx512(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch);
void moe_scale_channels_avx512(const float *chs, float *C, int n);

typedef struct {
    uint8_t palette_id;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) TileCfg;

static void cfg_tile(TileCfg *c, int t, int rows, int colsb) {
    c->rows[t] = (uint8_t)rows;
    c->colsb[t] = (uint16_t)colsb;
}

/* ---------------- bf16: tiles 0-3 = C (mr tokens x 64 ch), 4 = A, 5 = B ----------------
 * Every token count, 1 included, runs on the tiles (a tail block of mr < 16 tokens configures
 * mr-row A and C tiles): each output element is then the same TDPBF16PS chain over k whatever
 * else is in the call, so a row's bits do not depend on its neighbours (batch invariance). The
 * int8/int4/mxfp4 kernels below hand < 16 tokens to AVX-512 instead: integer dot products are exact, and
 * both paths apply the same f32 epilogue in the same order. */

static void cfg_bf16(TileCfg *cfg, int mr) {
    memset(cfg, 0, sizeof(*cfg));
    cfg->palette_id = 1;
    for (int t = 0; t < 4; t++) cfg_tile(cfg, t, mr, 64);
    cfg_tile(cfg, 4, mr, 64);
    cfg_tile(cfg, 5, 16, 64);
    _tile_loadconfig(cfg);
}

void moe_panel_bf16_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    int n = rows->n, Kp = W->Kp, cur = 0;
    const uint16_t *wp = (const uint16_t *)(W->data + W->panel_bytes * (size_t)p);
    uint16_t *A = (uint16_t *)scratch; /* [mr][Kp] bf16 */
    TileCfg cfg;
    for (int m0 = 0; m0 < n; m0 += 16) {
        int mr = n - m0 < 16 ? n - m0 : 16;
        if (mr != cur) cfg_bf16(&cfg, cur = mr);
        for (int m = 0; m < mr; m++) memcpy(A + (size_t)m * Kp, rows->b[m0 + m], (size_t)Kp * 2);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int kc = 0; kc < Kp; kc += 32) {
            const uint16_t *wb = wp + (size_t)(kc / 2) * 128;
            _tile_loadd(4, A + kc, Kp * 2);
            _tile_loadd(5, wb, 256);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(5, wb + 32, 256);
            _tile_dpbf16ps(1, 4, 5);
            _tile_loadd(5, wb + 64, 256);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(5, wb + 96, 256);
            _tile_dpbf16ps(3, 4, 5);
        }
        float *dst = C + (size_t)m0 * 64;
        _tile_stored(0, dst, 256);
        _tile_stored(1, dst + 16, 256);
        _tile_stored(2, dst + 32, 256);
        _tile_stored(3, dst + 48, 256);
    }
    _tile_release();
}

/* ---------------- int8/int4/mxfp4: tiles 0,1 = C of q1 (16 tokens x 16 ch each), 2,3 = C of q2,
 * 4 = A q1 (16 x 32 B), 5 = A q2, 6,7 = B (8 quad rows x 16 ch x 4 u8) ----------------
 * KIND: 0 int8, 1 int4, 2 mxfp4 (moe_avx512.c's mk_int numbering). 8-bit activations (rows->act8,
 * every q2 0) skip tiles 2, 3 and 5, and the epilogue takes s = 254 * ih by a multiply like mk_int's
 * A8 branch (the two-level fma with il = 0 rounds the same product once: the same bits). */

/* one nibble group (int4: q + 8; mxfp4: e2m1 code, vpshufb'd through moe_mxfp4_u8 to 2 * value + 12)
 * -> two 8 quad-row x 64 B u8 B tiles in Bt: byte j of channel c in octet o holds k = 8o + j (low
 * nibble: quad row 2o) and k = 8o + 4 + j (high nibble: quad row 2o + 1); channels 0-15 in the first
 * tile, 16-31 in the second */
static inline void unpack_nibbles(const uint8_t *gb, uint8_t *Bt, int mxfp4) {
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    const __m512i lut = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)moe_mxfp4_u8));
    for (int o = 0; o < 4; o++)
        for (int v = 0; v < 2; v++) {
            __m512i pk = _mm512_loadu_si512(gb + o * 128 + 64 * v);
            __m512i l = _mm512_and_si512(pk, lo4), h = _mm512_and_si512(_mm512_srli_epi16(pk, 4), lo4);
            if (mxfp4) {
                l = _mm512_shuffle_epi8(lut, l);
                h = _mm512_shuffle_epi8(lut, h);
            }
            _mm512_storeu_si512(Bt + v * 512 + (2 * o) * 64, l);
            _mm512_storeu_si512(Bt + v * 512 + (2 * o + 1) * 64, h);
        }
}

/* the 32 per-channel group scales of a nibble group: int4's bf16, or mxfp4's e8m0 byte -> 2^(e - 127)
 * (moe_mxfp4_scale's two steps on 16 lanes, as moe_avx512.c's e8x16_to_ps; the 1/2 of the doubled
 * table values is in the mxfp4 rows' activation scale xs, not here) */
static inline void group_scales(const uint8_t *sp, int kind, __m512 *ws0, __m512 *ws1) {
    if (kind == 2) {
        __m512i b0 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)sp)), 23);
        __m512i b1 = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(sp + 16))), 23);
        *ws0 = _mm512_castsi512_ps(_mm512_max_epi32(b0, _mm512_set1_epi32(0x00400000)));
        *ws1 = _mm512_castsi512_ps(_mm512_max_epi32(b1, _mm512_set1_epi32(0x00400000)));
    } else {
        const uint16_t *s = (const uint16_t *)sp;
        *ws0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)s)), 16));
        *ws1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + 16))), 16));
    }
}

/* Cm[m][0..32) (+)= group g's term for the mr rows from m0, from the integer dots Ci (q1 at 0, q2 at
 * 512): mk_int's float steps in its order, s = 254 * ih (+ il), f = s * xs - xc, acc += ws * f (nibble
 * formats) or acc + f (int8) */
static inline void group_epilogue(const int32_t *Ci, const MoeRows *rows, int m0, int mr, int g, int kind, int a8,
                                  __m512 ws0, __m512 ws1, float *Cm) {
    const __m512 k254 = _mm512_set1_ps(254.f);
    for (int m = 0; m < mr; m++) {
        __m512 xs = _mm512_set1_ps(rows->xs[m0 + m][g]), xc = _mm512_set1_ps(rows->xc[m0 + m][g]);
        __m512 h0 = _mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + m * 32));
        __m512 h1 = _mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + m * 32 + 16));
        __m512 s0, s1;
        if (a8) {
            s0 = _mm512_mul_ps(h0, k254);
            s1 = _mm512_mul_ps(h1, k254);
        } else {
            s0 = _mm512_fmadd_ps(h0, k254, _mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + 512 + m * 32)));
            s1 = _mm512_fmadd_ps(h1, k254, _mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + 512 + m * 32 + 16)));
        }
        __m512 f0 = _mm512_fmsub_ps(s0, xs, xc), f1 = _mm512_fmsub_ps(s1, xs, xc);
        __m512 c0 = _mm512_loadu_ps(Cm + m * 32), c1 = _mm512_loadu_ps(Cm + m * 32 + 16);
        if (kind) {
            c0 = _mm512_fmadd_ps(ws0, f0, c0);
            c1 = _mm512_fmadd_ps(ws1, f1, c1);
        } else {
            c0 = _mm512_add_ps(c0, f0);
            c1 = _mm512_add_ps(c1, f1);
        }
        _mm512_storeu_ps(Cm + m * 32, c0);
        _mm512_storeu_ps(Cm + m * 32 + 16, c1);
    }
}

static void panel_int_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch, int kind) {
    int n = rows->n, Kp = W->Kp, G = Kp / MOE_GROUP, a8 = rows->act8;
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    size_t gbytes = kind ? moe_nibble_group_bytes(kind == 2 ? MOE_FMT_MXFP4 : MOE_FMT_INT4) : 8 * 128;
    int8_t *A = (int8_t *)scratch;                                      /* [16][2*Kp] two-level s8 */
    int32_t *Ci = (int32_t *)((uint8_t *)scratch + (size_t)16 * Kp * 2); /* [2][16][32] i32 */
    uint8_t *Bt = (uint8_t *)(Ci + 2 * 16 * 32);                        /* [2][8][64] u8 */
    TileCfg cfg;
    memset(&cfg, 0, sizeof(cfg));
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) cfg_tile(&cfg, t, 16, 64);
    cfg_tile(&cfg, 4, 16, 32);
    cfg_tile(&cfg, 5, 16, 32);
    cfg_tile(&cfg, 6, 8, 64);
    cfg_tile(&cfg, 7, 8, 64);
    _tile_loadconfig(&cfg);
    for (int m0 = 0; m0 < n; m0 += 16) {
        int mr = n - m0 < 16 ? n - m0 : 16;
        for (int m = 0; m < 16; m++) {
            if (m < mr) memcpy(A + (size_t)m * 2 * Kp, rows->q[m0 + m], (size_t)2 * Kp);
            else memset(A + (size_t)m * 2 * Kp, 0, (size_t)2 * Kp);
        }
        float *Cm = C + (size_t)m0 * 32;
        for (int m = 0; m < mr; m++) {
            _mm512_storeu_ps(Cm + m * 32, _mm512_setzero_ps());
            _mm512_storeu_ps(Cm + m * 32 + 16, _mm512_setzero_ps());
        }
        for (int g = 0; g < G; g++) {
            const uint8_t *gb = wp + (size_t)g * gbytes;
            __m512 ws0 = _mm512_setzero_ps(), ws1 = ws0;
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(4, A + g * 64, 2 * Kp);
            if (!kind) {
                _tile_loadd(6, gb, 128);
                _tile_loadd(7, gb + 64, 128);
            } else {
                unpack_nibbles(gb, Bt, kind == 2);
                _tile_loadd(6, Bt, 64);
                _tile_loadd(7, Bt + 512, 64);
                group_scales(gb + 512, kind, &ws0, &ws1);
            }
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            _tile_stored(0, Ci, 128);
            _tile_stored(1, Ci + 16, 128);
            if (!a8) {
                _tile_zero(2);
                _tile_zero(3);
                _tile_loadd(5, A + g * 64 + 32, 2 * Kp);
                _tile_dpbsud(2, 5, 6);
                _tile_dpbsud(3, 5, 7);
                _tile_stored(2, Ci + 512, 128);
                _tile_stored(3, Ci + 512 + 16, 128);
            }
            group_epilogue(Ci, rows, m0, mr, g, kind, a8, ws0, ws1, Cm);
        }
    }
    _tile_release();
    if (!kind) moe_scale_channels_avx512(W->chscale + p * 32, C, n);
}

void moe_panel_int8_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n < 16) moe_panel_int8_avx512(W, p, rows, C, scratch);
    else panel_int_amx(W, p, rows, C, scratch, 0);
}

void moe_panel_int4_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n < 16) moe_panel_int4_avx512(W, p, rows, C, scratch);
    else panel_int_amx(W, p, rows, C, scratch, 1);
}

void moe_panel_mxfp4_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n < 16) moe_panel_mxfp4_avx512(W, p, rows, C, scratch);
    else panel_int_amx(W, p, rows, C, scratch, 2);
}

long moe_amx_tile_ops(void) {
#ifdef MOE_AMX_EMULATE
    return __atomic_load_n(&moe_amx_emu_ops, __ATOMIC_RELAXED);
#else
    return -1;
#endif
}

void moe_kernels_amx(MoeKernels *k) {
    moe_kernels_avx512(k); /* activation epilogue and the < 16-token int8/int4/mxfp4 paths */
    k->isa = MOE_ISA_AMX;
    k->panel[MOE_FMT_BF16] = moe_panel_bf16_amx;
    k->panel[MOE_FMT_INT8] = moe_panel_int8_amx;
    k->panel[MOE_FMT_INT4] = moe_panel_int4_amx;
    k->panel[MOE_FMT_MXFP4] = moe_panel_mxfp4_amx;
}
