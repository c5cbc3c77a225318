/* moesplit CPU MoE: the portable kernels (scalar C, any x86-64): one panel product per weight format and
 * silu(gate) * up. The reference the ISA files are tested against, and the fallback where none applies.
 */
#include "moe.h"

#include <math.h>

static inline float silu(float g) { return g / (1.f + expf(-g)); }

/* ------------------------------------------------------------------ generic kernels */

/* the 16-bit activation at p[j] of a two-level int8 group (q1 at p, q2 at p + 32) */
#define X16(p, j) (254 * (int)(p)[j] + (int)(p)[(j) + MOE_GROUP])

void moe_panel_bf16_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    enum { NP = MOE_NP_BF16 };
    const uint16_t *wp = (const uint16_t *)(W->data + W->panel_bytes * (size_t)p);
    for (int m = 0; m < rows->n; m++) {
        float acc[NP];
        for (int c = 0; c < NP; c++) acc[c] = 0.f;
        const uint16_t *xr = rows->b[m];
        for (int kp = 0; kp < W->Kp / 2; kp++) {
            float x0 = moe_bf16_to_f32(xr[2 * kp]), x1 = moe_bf16_to_f32(xr[2 * kp + 1]);
            const uint16_t *wr = wp + (size_t)kp * NP * 2;
            for (int c = 0; c < NP; c++)
                acc[c] += x0 * moe_bf16_to_f32(wr[2 * c]) + x1 * moe_bf16_to_f32(wr[2 * c + 1]);
        }
        for (int c = 0; c < NP; c++) C[(size_t)m * NP + c] = acc[c];
    }
}

void moe_panel_int8_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    enum { NP = MOE_NP_INT };
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    const float *chs = W->chscale + p * NP;
    for (int m = 0; m < rows->n; m++) {
        float acc[NP];
        for (int c = 0; c < NP; c++) acc[c] = 0.f;
        const int8_t *xr = rows->q[m];
        for (int g = 0; g < W->Kp / MOE_GROUP; g++) {
            int32_t ia[NP];
            for (int c = 0; c < NP; c++) ia[c] = 0;
            for (int qd = 0; qd < 8; qd++) {
                const uint8_t *wr = wp + (size_t)(g * 8 + qd) * NP * 4;
                const int8_t *xq = xr + 2 * g * MOE_GROUP + qd * 4;
                for (int c = 0; c < NP; c++)
                    for (int j = 0; j < 4; j++) ia[c] += ((int)wr[c * 4 + j] - 128) * X16(xq, j);
            }
            float s = rows->xs[m][g];
            for (int c = 0; c < NP; c++) acc[c] += s * (float)ia[c];
        }
        for (int c = 0; c < NP; c++) C[(size_t)m * NP + c] = acc[c] * chs[c];
    }
}

/* int4 (lut NULL: nibble - 8) or mxfp4 (lut: moe_mxfp4_u8, minus its offset) */
static void panel_nibble_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, const uint8_t *lut) {
    enum { NP = MOE_NP_INT };
    const uint8_t *wp = W->data + W->panel_bytes * (size_t)p;
    for (int m = 0; m < rows->n; m++) {
        float acc[NP];
        for (int c = 0; c < NP; c++) acc[c] = 0.f;
        const int8_t *xr = rows->q[m];
        for (int g = 0; g < W->Kp / MOE_GROUP; g++) {
            const uint8_t *gb = wp + (size_t)g * moe_nibble_group_bytes(W->fmt);
            int32_t ia[NP];
            for (int c = 0; c < NP; c++) ia[c] = 0;
            for (int o = 0; o < 4; o++) {
                const int8_t *xq = xr + 2 * g * MOE_GROUP + 8 * o;
                for (int c = 0; c < NP; c++)
                    for (int j = 0; j < 4; j++) {
                        uint8_t b = gb[o * NP * 4 + c * 4 + j];
                        int lo = lut ? (int)lut[b & 15] - MOE_MXFP4_OFFSET : (int)(b & 15) - 8;
                        int hi = lut ? (int)lut[b >> 4] - MOE_MXFP4_OFFSET : (int)(b >> 4) - 8;
                        ia[c] += lo * X16(xq, j) + hi * X16(xq, j + 4);
                    }
            }
            float s = rows->xs[m][g];
            for (int c = 0; c < NP; c++) { /* int4: bf16 scales; mxfp4: e8m0 bytes */
                float ws = lut ? moe_mxfp4_scale(gb[4 * NP * 4 + c]) : moe_bf16_to_f32(((const uint16_t *)(gb + 4 * NP * 4))[c]);
                acc[c] += ws * s * (float)ia[c];
            }
        }
        for (int c = 0; c < NP; c++) C[(size_t)m * NP + c] = acc[c];
    }
}

void moe_panel_int4_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_nibble_generic(W, p, rows, C, NULL);
}

void moe_panel_mxfp4_generic(const MoeMat *W, int p, const MoeRows *rows, float *C, void *scratch) {
    (void)scratch;
    panel_nibble_generic(W, p, rows, C, moe_mxfp4_u8);
}

void moe_act_generic(const float *g, const float *u, int n, float *out, uint16_t *outb) {
    for (int i = 0; i < n; i++) out[i] = silu(g[i]) * u[i];
    if (outb)
        for (int i = 0; i < n; i++) outb[i] = moe_f32_to_bf16(out[i]);
}

void moe_kernels_generic(MoeKernels *k) {
    k->isa = MOE_ISA_GENERIC;
    k->act = moe_act_generic;
    k->panel[MOE_FMT_BF16] = moe_panel_bf16_generic;
    k->panel[MOE_FMT_INT8] = moe_panel_int8_generic;
    k->panel[MOE_FMT_INT4] = moe_panel_int4_generic;
    k->panel[MOE_FMT_MXFP4] = moe_panel_mxfp4_generic;
}
