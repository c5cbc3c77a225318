/* moesplit: a software model of the AMX tile instructions that moe_amx.c uses, for testing the
 * AMX kernels (tiling, packed layouts, tails, the int8 offset algebra) on a CPU without AMX.
 *
 * Built only with -DMOE_AMX_EMULATE (tests/test_kernels.py builds such a copy of the extension);
 * the normal build uses the real instructions. Semantics follow the Intel SDM:
 *   tile config: palette 1, rows[t] rows of colsb[t] bytes per tile (at most 16 x 64 B);
 *   TDPBF16PS  for k ascending: C[m][n] (f32) += A[m][2k] * B[k][2n]; C[m][n] += A[m][2k+1] * B[k][2n+1]
 *              (bf16 inputs, each addition rounded to f32)
 *   TDPBSUD    C[m][n] (i32) += sum_k sum_i s8(A[m][4k+i]) * u8(B[k][4n+i])
 * with K = colsb(A) / 4 and N = colsb(C) / 4. State is per thread, like the real tile registers. */
#ifndef MOE_AMX_EMU_H
#define MOE_AMX_EMU_H

#include <stdint.h>
#include <string.h>

typedef struct {
    uint8_t rows[8];
    uint16_t colsb[8];
    uint8_t data[8][16][64];
} MoeAmxEmu;

static __thread MoeAmxEmu moe_amx_emu;
/* TDPBF16PS + TDPBSUD run so far, all threads (moe_amx_tile_ops: tests check which path ran) */
static long moe_amx_emu_ops;

static inline void moe_emu_loadconfig(const void *cfg) {
    const uint8_t *c = (const uint8_t *)cfg; /* palette 1 layout: colsb u16[16] at 16, rows u8[16] at 48 */
    for (int t = 0; t < 8; t++) {
        memcpy(&moe_amx_emu.colsb[t], c + 16 + 2 * t, 2);
        moe_amx_emu.rows[t] = c[48 + t];
    }
    memset(moe_amx_emu.data, 0, sizeof(moe_amx_emu.data));
}

static inline void moe_emu_zero(int t) { memset(moe_amx_emu.data[t], 0, sizeof(moe_amx_emu.data[t])); }

static inline void moe_emu_loadd(int t, const void *base, long stride) {
    for (int r = 0; r < moe_amx_emu.rows[t]; r++)
        memcpy(moe_amx_emu.data[t][r], (const uint8_t *)base + (long)r * stride, moe_amx_emu.colsb[t]);
}

static inline void moe_emu_stored(int t, void *base, long stride) {
    for (int r = 0; r < moe_amx_emu.rows[t]; r++)
        memcpy((uint8_t *)base + (long)r * stride, moe_amx_emu.data[t][r], moe_amx_emu.colsb[t]);
}

static inline float moe_emu_bf16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline void moe_emu_dpbf16ps(int dst, int a, int b) {
    __atomic_fetch_add(&moe_amx_emu_ops, 1, __ATOMIC_RELAXED);
    int M = moe_amx_emu.rows[dst], N = moe_amx_emu.colsb[dst] / 4, K = moe_amx_emu.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float acc;
            memcpy(&acc, &moe_amx_emu.data[dst][m][4 * n], 4);
            for (int k = 0; k < K; k++) {
                const uint8_t *ar = &moe_amx_emu.data[a][m][4 * k], *br = &moe_amx_emu.data[b][k][4 * n];
                /* the SDM's order: the even product, then the odd one, each added to the f32
                 * accumulator and rounded (bf16 x bf16 products are exact in f32) */
                float pe = moe_emu_bf16(ar) * moe_emu_bf16(br), po = moe_emu_bf16(ar + 2) * moe_emu_bf16(br + 2);
                acc += pe;
                acc += po;
            }
            memcpy(&moe_amx_emu.data[dst][m][4 * n], &acc, 4);
        }
}

static inline void moe_emu_dpbsud(int dst, int a, int b) {
    __atomic_fetch_add(&moe_amx_emu_ops, 1, __ATOMIC_RELAXED);
    int M = moe_amx_emu.rows[dst], N = moe_amx_emu.colsb[dst] / 4, K = moe_amx_emu.colsb[a] / 4;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            int32_t acc;
            memcpy(&acc, &moe_amx_emu.data[dst][m][4 * n], 4);
            for (int k = 0; k < K; k++)
                for (int i = 0; i < 4; i++)
                    acc += (int32_t)(int8_t)moe_amx_emu.data[a][m][4 * k + i] *
                           (int32_t)moe_amx_emu.data[b][k][4 * n + i];
            memcpy(&moe_amx_emu.data[dst][m][4 * n], &acc, 4);
        }
}

#undef _tile_loadconfig
#undef _tile_zero
#undef _tile_loadd
#undef _tile_stored
#undef _tile_dpbf16ps
#undef _tile_dpbsud
#undef _tile_release
#define _tile_loadconfig(cfg) moe_emu_loadconfig(cfg)
#define _tile_zero(t) moe_emu_zero(t)
#define _tile_loadd(t, base, stride) moe_emu_loadd((t), (base), (long)(stride))
#define _tile_stored(t, base, stride) moe_emu_stored((t), (base), (long)(stride))
#define _tile_dpbf16ps(d, a, b) moe_emu_dpbf16ps((d), (a), (b))
#define _tile_dpbsud(d, a, b) moe_emu_dpbsud((d), (a), (b))
#define _tile_release() ((void)0)

#endif
