/* moesplit CPU MoE: weight quantisation + packing into the panel layouts of moe.h (ISA-independent).
 *
 * Packing runs in parallel on the pool with the partitioning the compute uses, so each packed panel is
 * first touched by the thread that will stream it. Also: an expert's resident bytes and its unpacking
 * back to float (tests, reference checks).
 */
#define _GNU_SOURCE
#include "moe.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

/* ------------------------------------------------------------------ packing */

static void *big_alloc(size_t bytes) {
    void *p = NULL;
    size_t align = bytes >= (4u << 20) ? (2u << 20) : 64;
    bytes = (bytes + align - 1) / align * align;
    if (posix_memalign(&p, align, bytes) != 0) return NULL;
#ifdef MADV_HUGEPAGE
    if (align == (2u << 20)) madvise(p, bytes, MADV_HUGEPAGE);
#endif
    return p; /* not touched: the packing threads touch it first */
}

static int mat_init(MoeMat *m, int fmt, int N, int K, int Np) {
    memset(m, 0, sizeof(*m));
    m->fmt = fmt;
    m->N = N;
    m->K = K;
    m->NP = fmt == MOE_FMT_BF16 ? MOE_NP_BF16 : MOE_NP_INT;
    m->Np = Np;
    m->Kp = moe_rup(K, MOE_GROUP);
    if (fmt == MOE_FMT_BF16) m->panel_bytes = (size_t)m->Kp * m->NP * 2;
    else if (fmt == MOE_FMT_INT8) m->panel_bytes = (size_t)m->Kp * m->NP;
    else m->panel_bytes = (size_t)(m->Kp / MOE_GROUP) * moe_nibble_group_bytes(fmt);
    m->data = big_alloc(m->panel_bytes * (size_t)(m->Np / m->NP));
    if (!m->data) return -ENOMEM;
    if (fmt == MOE_FMT_INT8) {
        m->chscale = malloc(sizeof(float) * m->Np);
        if (!m->chscale) return -ENOMEM;
    }
    return 0;
}

/* Source of one logical matrix row (output channel): float, int4 native or mxfp4 native. */
typedef struct {
    const float *f; /* [N][K] */
    const int32_t *q4;
    const uint16_t *s4; /* int4: packed [N][ceil(K/8)], scale [N][ceil(K/32)] */
    int N, K;
    const uint8_t *fp4, *e8; /* mxfp4: blocks [N][K/2], e8m0 scales [N][K/32] */
} Src;


/* Fused gate/up: panel channel c of panel p -> (source, row) */
static void gu_row(const MoeMat *m, const Src *g, const Src *u, int p, int c, const Src **s, int *row) {
    int half = m->NP / 2;
    if (c < half) {
        *s = g;
        *row = p * half + c;
    } else {
        *s = u;
        *row = p * half + c - half;
    }
}

/* Quantise/convert one channel row into a temporary: bf16 values, or u8 (int8: w+128, int4: q+8)
 * with scales (int8: one in *chs, int4: per group in gsc[bf16]). row >= N gives zeros. */
static void prep_row(int fmt, const Src *s, int row, int Kp, uint16_t *bf, uint8_t *u, float *chs,
                     uint16_t *gsc) {
    int K = s->K;
    if (row >= s->N) {
        if (fmt == MOE_FMT_BF16) memset(bf, 0, sizeof(uint16_t) * Kp);
        else if (fmt == MOE_FMT_INT8) {
            memset(u, 128, Kp);
            *chs = 0.f;
        } else {
            memset(u, fmt == MOE_FMT_MXFP4 ? 0 : 8, Kp); /* int4 q = 0; mxfp4 code 0 (+0) */
            memset(gsc, 0, sizeof(uint16_t) * (Kp / MOE_GROUP));
        }
        return;
    }
    if (fmt == MOE_FMT_MXFP4) { /* e2m1 codes and e8m0 bytes as stored (the kernels decode both) */
        const uint8_t *pr = s->fp4 + (size_t)row * (K / 2);
        for (int k = 0; k < Kp; k++) u[k] = k < K ? (uint8_t)((pr[k >> 1] >> (4 * (k & 1))) & 15u) : 0;
        for (int g = 0; g < Kp / MOE_GROUP; g++) gsc[g] = g < K / MOE_GROUP ? s->e8[(size_t)row * (K / MOE_GROUP) + g] : 0;
        return;
    }
    if (fmt == MOE_FMT_INT4 && s->q4) { /* native compressed-tensors int4 */
        int nw = (K + 7) / 8, ng = (K + MOE_GROUP - 1) / MOE_GROUP;
        const int32_t *pr = s->q4 + (size_t)row * nw;
        for (int k = 0; k < Kp; k++)
            u[k] = k < K ? (uint8_t)(((uint32_t)pr[k >> 3] >> (4 * (k & 7))) & 15u) : 8;
        for (int g = 0; g < Kp / MOE_GROUP; g++) gsc[g] = g < ng ? s->s4[(size_t)row * ng + g] : 0;
        return;
    }
    const float *w = s->f + (size_t)row * K;
    if (fmt == MOE_FMT_BF16) {
        for (int k = 0; k < Kp; k++) bf[k] = k < K ? moe_f32_to_bf16(w[k]) : 0;
    } else if (fmt == MOE_FMT_INT8) {
        float amax = 0.f;
        for (int k = 0; k < K; k++) amax = fmaxf(amax, fabsf(w[k]));
        float sc = amax / 127.f;
        *chs = sc;
        for (int k = 0; k < Kp; k++) {
            int q = 0;
            if (k < K && sc > 0.f) {
                q = (int)nearbyintf(w[k] / sc);
                q = q < -127 ? -127 : q > 127 ? 127 : q;
            }
            u[k] = (uint8_t)(q + 128);
        }
    } else { /* int4 from float: symmetric group-32, scale = amax / 7.5 rounded to bf16 */
        for (int g = 0; g < Kp / MOE_GROUP; g++) {
            float amax = 0.f;
            for (int k = g * MOE_GROUP; k < (g + 1) * MOE_GROUP && k < K; k++) amax = fmaxf(amax, fabsf(w[k]));
            float sc = amax / 7.5f;
            if (sc < 1.1920929e-07f) sc = 1.1920929e-07f;
            uint16_t sb = moe_f32_to_bf16(sc);
            float scf = moe_bf16_to_f32(sb);
            gsc[g] = sb;
            for (int k = g * MOE_GROUP; k < (g + 1) * MOE_GROUP; k++) {
                int q = 0;
                if (k < K) {
                    q = (int)nearbyintf(w[k] / scf);
                    q = q < -8 ? -8 : q > 7 ? 7 : q;
                }
                u[k] = (uint8_t)(q + 8);
            }
        }
    }
}

/* Pack panel p of m; rowsrc(c) -> (src, row). */
typedef struct {
    const Src *a, *b; /* gate, up (fused) or down (a only) */
    int fused;
} PanelSrc;

static void pack_panel(MoeMat *m, const PanelSrc *ps, int p) {
    /* prepare the NP channel rows first, then write the panel front to back (sequential stores) */
    int NP = m->NP, Kp = m->Kp, ng = Kp / MOE_GROUP;
    uint16_t *bf = m->fmt == MOE_FMT_BF16 ? malloc(sizeof(uint16_t) * Kp * NP) : NULL;
    uint8_t *u = m->fmt != MOE_FMT_BF16 ? malloc((size_t)Kp * NP) : NULL;
    uint16_t *gsc = malloc(sizeof(uint16_t) * ng * NP);
    float *chs = malloc(sizeof(float) * NP);
    uint8_t *base = m->data + m->panel_bytes * (size_t)p;
    for (int c = 0; c < NP; c++) {
        const Src *s;
        int row;
        if (ps->fused) gu_row(m, ps->a, ps->b, p, c, &s, &row);
        else {
            s = ps->a;
            row = p * NP + c;
        }
        chs[c] = 0.f;
        prep_row(m->fmt, s, row, Kp, bf ? bf + (size_t)c * Kp : NULL, u ? u + (size_t)c * Kp : NULL, &chs[c],
                 gsc + (size_t)c * ng);
    }
    if (m->fmt == MOE_FMT_BF16) {
        uint32_t *d = (uint32_t *)base; /* one k-pair of one channel per 32-bit word */
        for (int kp = 0; kp < Kp / 2; kp++)
            for (int c = 0; c < NP; c++) {
                const uint16_t *r = bf + (size_t)c * Kp + 2 * kp;
                d[(size_t)kp * NP + c] = (uint32_t)r[0] | ((uint32_t)r[1] << 16);
            }
    } else if (m->fmt == MOE_FMT_INT8) {
        for (int c = 0; c < NP; c++) m->chscale[p * NP + c] = chs[c];
        uint32_t *d = (uint32_t *)base; /* one k-quad of one channel per 32-bit word */
        for (int qd = 0; qd < Kp / 4; qd++)
            for (int c = 0; c < NP; c++) memcpy(&d[(size_t)qd * NP + c], u + (size_t)c * Kp + 4 * qd, 4);
    } else {
        for (int g = 0; g < ng; g++) {
            uint8_t *gb = base + (size_t)g * moe_nibble_group_bytes(m->fmt);
            for (int o = 0; o < 4; o++)
                for (int c = 0; c < NP; c++) {
                    const uint8_t *r = u + (size_t)c * Kp + g * MOE_GROUP + 8 * o;
                    for (int j = 0; j < 4; j++) gb[o * NP * 4 + c * 4 + j] = (uint8_t)(r[j] | (r[j + 4] << 4));
                }
            for (int c = 0; c < NP; c++) { /* int4: bf16 scales; mxfp4: the e8m0 bytes */
                if (m->fmt == MOE_FMT_MXFP4) gb[4 * NP * 4 + c] = (uint8_t)gsc[(size_t)c * ng + g];
                else ((uint16_t *)(gb + 4 * NP * 4))[c] = gsc[(size_t)c * ng + g];
            }
        }
    }
    free(bf);
    free(u);
    free(gsc);
    free(chs);
}

typedef struct {
    MoeExpert *e;
    PanelSrc gu, dn;
} PackJob;

static void pack_job(void *arg, int tid, int nt) {
    PackJob *j = arg;
    int p0, p1;
    moe_part(j->e->gu.Np / j->e->gu.NP, tid, nt, &p0, &p1);
    for (int p = p0; p < p1; p++) pack_panel(&j->e->gu, &j->gu, p);
    moe_part(j->e->dn.Np / j->e->dn.NP, tid, nt, &p0, &p1);
    for (int p = p0; p < p1; p++) pack_panel(&j->e->dn, &j->dn, p);
}

static int expert_alloc(MoeExpert *e, int fmt, int H, int I) {
    memset(e, 0, sizeof(*e));
    e->H = H;
    e->I = I;
    int Ip = moe_rup(I, MOE_GROUP);
    int NP = fmt == MOE_FMT_BF16 ? MOE_NP_BF16 : MOE_NP_INT;
    int rc = mat_init(&e->gu, fmt, 2 * I, H, 2 * Ip); /* Ip is a multiple of NP/2 */
    if (rc == 0) rc = mat_init(&e->dn, fmt, H, Ip, moe_rup(H, NP));
    e->dn.K = I;
    if (rc != 0) moe_expert_free(e);
    return rc;
}

int moe_expert_pack_float(MoePool *pool, MoeExpert *e, int fmt, int H, int I, const float *gate,
                          const float *up, const float *down) {
    if (fmt == MOE_FMT_MXFP4) return -EINVAL; /* mxfp4 packs only as stored (moe_expert_pack_mxfp4) */
    int rc = expert_alloc(e, fmt, H, I);
    if (rc) return rc;
    Src g = {gate, NULL, NULL, I, H, NULL, NULL}, u = {up, NULL, NULL, I, H, NULL, NULL}, d = {down, NULL, NULL, H, I, NULL, NULL};
    PackJob j = {e, {&g, &u, 1}, {&d, NULL, 0}};
    moe_pool_run(pool, pack_job, &j);
    return 0;
}

int moe_expert_pack_int4(MoePool *pool, MoeExpert *e, int H, int I, const int32_t *gp,
                         const uint16_t *gs, const int32_t *upk, const uint16_t *us, const int32_t *dp,
                         const uint16_t *ds) {
    int rc = expert_alloc(e, MOE_FMT_INT4, H, I);
    if (rc) return rc;
    Src g = {NULL, gp, gs, I, H, NULL, NULL}, u = {NULL, upk, us, I, H, NULL, NULL}, d = {NULL, dp, ds, H, I, NULL, NULL};
    PackJob j = {e, {&g, &u, 1}, {&d, NULL, 0}};
    moe_pool_run(pool, pack_job, &j);
    return 0;
}

int moe_expert_pack_mxfp4(MoePool *pool, MoeExpert *e, int H, int I, const uint8_t *gb, const uint8_t *gs,
                          const uint8_t *ub, const uint8_t *us, const uint8_t *db, const uint8_t *ds) {
    if (H % MOE_GROUP || I % MOE_GROUP) return -EINVAL;
    const uint8_t *sc[3] = {gs, us, ds};
    for (int t = 0; t < 3; t++) /* a NaN block scale (e8m0 255) is corrupt data, refused */
        for (size_t i = 0; i < (size_t)H * I / MOE_GROUP; i++)
            if (sc[t][i] == MOE_E8M0_NAN) return -EDOM;
    int rc = expert_alloc(e, MOE_FMT_MXFP4, H, I);
    if (rc) return rc;
    Src g = {NULL, NULL, NULL, I, H, gb, gs}, u = {NULL, NULL, NULL, I, H, ub, us}, d = {NULL, NULL, NULL, H, I, db, ds};
    PackJob j = {e, {&g, &u, 1}, {&d, NULL, 0}};
    moe_pool_run(pool, pack_job, &j);
    return 0;
}

void moe_expert_free(MoeExpert *e) {
    free(e->gu.data);
    free(e->gu.chscale);
    free(e->dn.data);
    free(e->dn.chscale);
    memset(e, 0, sizeof(*e));
}

size_t moe_expert_bytes(const MoeExpert *e) {
    size_t b = 0;
    const MoeMat *ms[2] = {&e->gu, &e->dn};
    for (int i = 0; i < 2; i++) {
        b += ms[i]->panel_bytes * (size_t)(ms[i]->Np / ms[i]->NP);
        if (ms[i]->chscale) b += sizeof(float) * ms[i]->Np;
    }
    return b;
}

/* value of packed element (panel channel c of panel p, input k) as float */
static float mat_get(const MoeMat *m, int p, int c, int k) {
    const uint8_t *base = m->data + m->panel_bytes * (size_t)p;
    int NP = m->NP;
    if (m->fmt == MOE_FMT_BF16)
        return moe_bf16_to_f32(((const uint16_t *)base)[(size_t)(k / 2) * NP * 2 + c * 2 + (k & 1)]);
    if (m->fmt == MOE_FMT_INT8)
        return ((int)base[(size_t)(k / 4) * NP * 4 + c * 4 + (k & 3)] - 128) * m->chscale[p * NP + c];
    int g = k / MOE_GROUP, r = k % MOE_GROUP, o = r / 8, j = r % 8;
    const uint8_t *gb = base + (size_t)g * moe_nibble_group_bytes(m->fmt);
    uint8_t byte = gb[o * NP * 4 + c * 4 + (j & 3)];
    int nib = j < 4 ? (byte & 15) : (byte >> 4);
    if (m->fmt == MOE_FMT_MXFP4) /* (2 * value) / 2: exact, then one rounding of value * 2^(e-127), as numpy's */
        return ((float)((int)moe_mxfp4_u8[nib] - MOE_MXFP4_OFFSET) * 0.5f) * moe_mxfp4_scale(gb[4 * NP * 4 + c]);
    return (nib - 8) * moe_bf16_to_f32(((const uint16_t *)(gb + 4 * NP * 4))[c]);
}

void moe_expert_unpack(const MoeExpert *e, int which, float *out) {
    if (which < 2) {
        const MoeMat *m = &e->gu;
        int half = m->NP / 2;
        for (int i = 0; i < e->I; i++) {
            int p = i / half, c = i % half + (which == 1 ? half : 0);
            for (int k = 0; k < e->H; k++) out[(size_t)i * e->H + k] = mat_get(m, p, c, k);
        }
    } else {
        const MoeMat *m = &e->dn;
        for (int h = 0; h < e->H; h++)
            for (int k = 0; k < e->I; k++)
                out[(size_t)h * e->I + k] = mat_get(m, h / m->NP, h % m->NP, k);
    }
}
