/* moesplit CPU MoE: AMX kernels (Sapphire Rapids and later), for large token batches.
 *
 * Uses the same packed layouts as the AVX-512 path, which are already AMX B-tile layouts:
 *   bf16 panel [Kp/2][64][2]: a B tile is 16 k-pair rows x 16 channels x 2 bf16, row stride 256 B
 *   int8 panel [Kp/4][32][4]: a B tile is 8 quad rows x 16 channels x 4 u8,    row stride 128 B
 *   int4: one group is unpacked to two 8 x 64 B u8 tiles in scratch.
 * Activations are gathered 16 tokens at a time into a contiguous A tile buffer in scratch.
 * int8/int4 use TDPBSUD (signed activations x unsigned weights, w + 128 / q + 8) one group of 32
 * at a time, once per level of the two-level int8 activations, so the per-group activation scale and the unsigned-offset correction apply exactly
 * as in the AVX-512 path. bf16 runs every token count on the tiles; int8/int4 send fewer than 16
 * tokens to the AVX-512 kernels (same bits: integer dot products, the same f32 epilogue).
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
 * int8/int4 kernels below hand < 16 tokens to AVX-512 instead: integer dot products are exact, and
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

/* ---------------- int8/int4: tiles 0,1 = C of q1 (16 tokens x 16 ch each), 2,3 = C of q2,
 * 4 = A q1 (16 x 32 B), 5 = A q2, 6,7 = B (8 quad rows x 16 ch x 4 u8) ---------------- */

static void panel_int_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch, int int4) {
    int n = rows->n, Kp = W->Kp, G = Kp / MOE_GROUP;
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    int8_t *A = (int8_t *)scratch;                                      /* [16][2*Kp] two-level s8 */
    int32_t *Ci = (int32_t *)((uint8_t *)scratch + (size_t)16 * Kp * 2); /* [2][16][32] i32 */
    uint8_t *Bt = (uint8_t *)(Ci + 2 * 16 * 32);                        /* [2][8][64] u8 */
    const __m512i lo4 = _mm512_set1_epi8(0x0f);
    const __m512 k254 = _mm512_set1_ps(254.f);
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
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            _tile_loadd(4, A + g * 64, 2 * Kp);
            _tile_loadd(5, A + g * 64 + 32, 2 * Kp);
            __m512 ws0 = _mm512_setzero_ps(), ws1 = ws0;
            if (!int4) {
                const uint8_t *gb = wp + (size_t)g * 8 * 128;
                _tile_loadd(6, gb, 128);
                _tile_loadd(7, gb + 64, 128);
            } else {
                const uint8_t *gb = wp + (size_t)g * MOE_INT4_GROUP_BYTES;
                for (int o = 0; o < 4; o++)
                    for (int v = 0; v < 2; v++) {
                        __m512i pk = _mm512_loadu_si512(gb + o * 128 + 64 * v);
                        _mm512_storeu_si512(Bt + v * 512 + (2 * o) * 64, _mm512_and_si512(pk, lo4));
                        _mm512_storeu_si512(Bt + v * 512 + (2 * o + 1) * 64,
                                            _mm512_and_si512(_mm512_srli_epi16(pk, 4), lo4));
                    }
                _tile_loadd(6, Bt, 64);
                _tile_loadd(7, Bt + 512, 64);
                const uint16_t *sp = (const uint16_t *)(gb + 512);
                ws0 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)sp)), 16));
                ws1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(sp + 16))), 16));
            }
            _tile_dpbsud(0, 4, 6);
            _tile_dpbsud(1, 4, 7);
            _tile_dpbsud(2, 5, 6);
            _tile_dpbsud(3, 5, 7);
            _tile_stored(0, Ci, 128);
            _tile_stored(1, Ci + 16, 128);
            _tile_stored(2, Ci + 512, 128);
            _tile_stored(3, Ci + 512 + 16, 128);
            for (int m = 0; m < mr; m++) {
                __m512 xs = _mm512_set1_ps(rows->xs[m0 + m][g]), xc = _mm512_set1_ps(rows->xc[m0 + m][g]);
                __m512 s0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + m * 32)), k254,
                                            _mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + 512 + m * 32)));
                __m512 s1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + m * 32 + 16)), k254,
                                            _mm512_cvtepi32_ps(_mm512_loadu_si512(Ci + 512 + m * 32 + 16)));
                __m512 f0 = _mm512_fmsub_ps(s0, xs, xc), f1 = _mm512_fmsub_ps(s1, xs, xc);
                __m512 c0 = _mm512_loadu_ps(Cm + m * 32), c1 = _mm512_loadu_ps(Cm + m * 32 + 16);
                if (int4) {
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
    }
    _tile_release();
    if (!int4) moe_scale_channels_avx512(W->chscale + p * 32, C, n);
}

void moe_panel_int8_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n < 16) moe_panel_int8_avx512(W, p, rows, C, scratch);
    else panel_int_amx(W, p, rows, C, scratch, 0);
}

void moe_panel_int4_amx(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    if (rows->n < 16) moe_panel_int4_avx512(W, p, rows, C, scratch);
    else panel_int_amx(W, p, rows, C, scratch, 1);
}

void moe_kernels_amx(MoeKernels *k) {
    moe_kernels_avx512(k); /* activation epilogue and the < 16-token int8/int4 paths */
    k->isa = MOE_ISA_AMX;
    k->panel[MOE_FMT_BF16] = moe_panel_bf16_amx;
    k->panel[MOE_FMT_INT8] = moe_panel_int8_amx;
    k->panel[MOE_FMT_INT4] = moe_panel_int4_amx;
    /* mxfp4 keeps moe_kernels_avx512's panel (vpdpbusd) at every token count: a tile path would
     * unpack each group through moe_mxfp4_u8 into scratch like int4's, with offset 12 */
}
