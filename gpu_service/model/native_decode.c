/* native_decode.c: see native_decode.h. Built with -ffp-contract=off: a * b + c is a multiply and
 * an add everywhere, so the generic and the AVX2 clones give the same bits. */
#include "native_decode.h"

#include <math.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define ND_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define ND_CLONES
#endif

typedef float v8 __attribute__((vector_size(32)));
#define INL static inline __attribute__((always_inline))

INL v8 ld8(const float *p) { v8 v; memcpy(&v, p, sizeof v); return v; }
INL void st8(float *p, v8 v) { memcpy(p, &v, sizeof v); }

/* sum_i a[i] b[i] in a fixed order: two 8-lane accumulators, a fixed reduction tree, then the tail */
INL float dot(const float *a, const float *b, int n) {
    v8 s0 = {0}, s1 = {0};
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 += ld8(a + i) * ld8(b + i);
        s1 += ld8(a + i + 8) * ld8(b + i + 8);
    }
    if (i + 8 <= n) {
        s0 += ld8(a + i) * ld8(b + i);
        i += 8;
    }
    v8 s = s0 + s1;
    float t = ((s[0] + s[4]) + (s[2] + s[6])) + ((s[1] + s[5]) + (s[3] + s[7]));
    for (; i < n; i++) t += a[i] * b[i];
    return t;
}

/* y[i] += a x[i] */
INL void axpy(float *y, float a, const float *x, int n) {
    int i = 0;
    v8 va = {a, a, a, a, a, a, a, a};
    for (; i + 8 <= n; i += 8) st8(y + i, ld8(y + i) + va * ld8(x + i));
    for (; i < n; i++) y[i] += a * x[i];
}

/* Y[b, j] = W[j, :] . X[b, :] for B rows (each weight row read once for all rows) */
INL void matvec(const float *W, int N, int K, const float *X, long ldx, float *Y, long ldy, int B) {
    for (int j = 0; j < N; j++) {
        const float *w = W + (long)j * K;
        for (int b = 0; b < B; b++) Y[b * ldy + j] = dot(X + b * ldx, w, K);
    }
}

INL void rmsnorm(const float *x, const float *w, int n, float eps, float *y) {
    float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = w[i] * (x[i] * inv);
}

/* RoPE of one rd-vector into the half-split layout (Rope.apply) */
INL void rope(const float *x, const float *c, const float *s, int rd, int inter, float *y) {
    int h = rd / 2;
    for (int i = 0; i < h; i++) {
        float x1 = inter ? x[2 * i] : x[i], x2 = inter ? x[2 * i + 1] : x[h + i];
        y[i] = x1 * c[i] - x2 * s[i];
        y[h + i] = x2 * c[i] + x1 * s[i];
    }
}

/* the index of the largest v[i] with allowed[i] (ties: the lowest i; NaN never wins over a number) */
INL int argmax_allowed(const float *v, const unsigned char *allowed, int n) {
    int best = -1;
    for (int i = 0; i < n; i++) {
        if (!allowed[i]) continue;
        if (best < 0 || v[i] > v[best] || (v[best] != v[best] && v[i] == v[i])) best = i;
    }
    return best;
}

/* per-row scratch layout (floats) */
typedef struct { long xn, qa, kva, qn, q, qcat, olat, ov, rs, rc, gs, iq, iw, ikn, n; } Lay;

static Lay layout(const NdLayer *L) {
    Lay o;
    long qdim = (long)L->nh * (L->nope + L->rd);
    long qa = L->qlr ? L->qlr : qdim;
    o.xn = 0;
    o.qa = o.xn + L->H;
    o.kva = o.qa + qa;
    o.qn = o.kva + L->r + L->rd;
    o.q = o.qn + (L->qlr ? L->qlr : 0);
    o.qcat = o.q + (L->qlr ? qdim : 0);
    o.olat = o.qcat + (long)L->nh * (L->r + L->rd);
    o.ov = o.olat + (long)L->nh * L->r;
    o.rs = o.ov + (long)L->nh * L->vd;
    o.rc = o.rs + L->E;
    o.gs = o.rc + L->E;
    o.iq = o.gs + L->n_group + 2 * (long)L->E;  /* group scores, allowed / chosen flags (as floats' room) */
    o.iw = o.iq + (long)L->ih * L->ihd;
    o.ikn = o.iw + L->ih;
    o.n = o.ikn + L->ihd;
    o.n = (o.n + 15) & ~15L;
    return o;
}

static long row_floats(const NdLayer *L) {
    long a = layout(L).n, m = (2L * L->inter + 15) & ~15L;
    return a > m ? a : m;
}

size_t nd_scratch_floats(const NdLayer *L, int B, long smax) {
    /* rows, then one score block [nh, smax]; V3.2: index scores, a copy, the selected positions */
    return (size_t)(B * row_floats(L) + (long)L->nh * smax + (L->ih ? 4 * smax + 1 : 0));
}

INL void route(const NdLayer *L, const float *h, float *sc, float *ch, float *gs, unsigned char *flags,
                  int64_t *ids, float *w) {
    int E = L->E, G = L->n_group > 1 ? L->n_group : 1, per = E / G;
    unsigned char *allowed = flags, *gallow = flags + E;
    matvec(L->w_router, E, L->H, h, 0, sc, 1, 1);
    for (int e = 0; e < E; e++) {
        sc[e] = 1.0f / (1.0f + expf(-sc[e]));
        ch[e] = sc[e] + L->router_bias[e];
        allowed[e] = 1;
    }
    if (G > 1) {
        for (int g = 0; g < G; g++) {  /* group score: the sum of its two best choices */
            const float *c = ch + g * per;
            int i1 = argmax_allowed(c, allowed + g * per, per);
            allowed[g * per + i1] = 0;
            int i2 = argmax_allowed(c, allowed + g * per, per);
            allowed[g * per + i1] = 1;
            gs[g] = c[i1] + (i2 >= 0 ? c[i2] : 0.0f);
            gallow[g] = 1;
        }
        memset(allowed, 0, (size_t)E);
        for (int t = 0; t < L->topk_group && t < G; t++) {
            int g = argmax_allowed(gs, gallow, G);
            gallow[g] = 0;
            memset(allowed + g * per, 1, (size_t)per);
        }
    }
    float sum = 0.0f;
    for (int j = 0; j < L->k; j++) {
        int e = argmax_allowed(ch, allowed, E);
        if (e < 0) e = 0;  /* k > allowed experts: not a DeepSeek config (the shards reject duplicates) */
        allowed[e] = 0;
        ids[j] = e;
        w[j] = sc[e];
        sum += sc[e];
    }
    for (int j = 0; j < L->k; j++) {
        if (L->norm_topk) w[j] = w[j] / (sum + 1e-20f);
        w[j] = w[j] * L->route_scale;
    }
}

INL void layernorm(const float *x, const float *w, const float *b, int n, float eps, float *y) {
    float mean = 0.0f, var = 0.0f;
    for (int i = 0; i < n; i++) mean += x[i];
    mean /= (float)n;
    for (int i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
    float inv = 1.0f / sqrtf(var / (float)n + eps);
    for (int i = 0; i < n; i++) y[i] = (x[i] - mean) * inv * w[i] + b[i];
}

/* the k-th largest of a[0..n) (0-based k < n), reordering a (quickselect, fixed pivots) */
static float kth_largest(float *a, long n, long k) {
    long lo = 0, hi = n - 1;
    while (lo < hi) {
        float p = a[lo + (hi - lo) / 2];
        long i = lo, j = hi;
        while (i <= j) {
            while (a[i] > p) i++;
            while (a[j] < p) j--;
            if (i <= j) {
                float t = a[i]; a[i] = a[j]; a[j] = t;
                i++; j--;
            }
        }
        if (k <= j) hi = j;
        else if (k >= i) lo = i;
        else return a[k];
    }
    return a[k];
}

/* positions [0, n) of the topk best index scores, in position order (ties: the earlier ones) */
static long select_topk(const float *index, long n, long topk, float *tmp, int64_t *sel) {
    memcpy(tmp, index, sizeof(float) * n);
    float thr = kth_largest(tmp, n, topk - 1);
    long above = 0, m = 0;
    for (long t = 0; t < n; t++) above += index[t] > thr;
    long ties = topk - above;
    for (long t = 0; t < n; t++) {
        if (index[t] > thr) sel[m++] = t;
        else if (index[t] == thr && ties > 0) { sel[m++] = t; ties--; }
    }
    return m;
}

ND_CLONES
void nd_attn(const NdLayer *L, const NdStep *S, float *kv, float *ik, const float *x, float *x1, float *h,
             int64_t *ids, float *w) {
    const int B = S->B, H = L->H, nh = L->nh, nope = L->nope, rd = L->rd, r = L->r, vd = L->vd;
    const int kvw = r + rd, qh = nope + rd, qdim = nh * qh, qa = L->qlr ? L->qlr : qdim, hr = rd / 2;
    const Lay o = layout(L);
    const long ld = row_floats(L);
    float *s0 = S->scratch, *sc = S->scratch + B * ld;  /* sc: the row being attended's scores */
    float *idx = sc + (long)nh * S->smax, *itmp = idx + S->smax;  /* V3.2: index scores, a copy */
    /* the selected positions (2 floats' room each, 8-byte aligned) */
    int64_t *sel = (int64_t *)(S->scratch + ((B * ld + ((long)nh + 2) * S->smax + 1) & ~1L));
    const int ihd = L->ihd, ih = L->ih;
    for (int b = 0; b < B; b++) rmsnorm(x + (long)b * H, L->in_norm, H, L->eps_in, s0 + b * ld + o.xn);
    matvec(L->w_q, qa, H, s0 + o.xn, ld, s0 + o.qa, ld, B);
    matvec(L->w_kva, kvw, H, s0 + o.xn, ld, s0 + o.kva, ld, B);
    long qoff = o.qa;
    if (L->qlr) {
        for (int b = 0; b < B; b++) rmsnorm(s0 + b * ld + o.qa, L->q_norm, L->qlr, L->eps_q, s0 + b * ld + o.qn);
        matvec(L->w_qb, qdim, L->qlr, s0 + o.qn, ld, s0 + o.q, ld, B);
        qoff = o.q;
    }
    if (ih) {  /* the indexer: query from q_resid, head weights and the new key from the normed input */
        matvec(L->w_iq, ih * ihd, L->qlr, s0 + o.qn, ld, s0 + o.iq, ld, B);
        matvec(L->w_iw, ih, H, s0 + o.xn, ld, s0 + o.iw, ld, B);
        matvec(L->w_ik, ihd, H, s0 + o.xn, ld, s0 + o.ikn, ld, B);
        for (int b = 0; b < B; b++) {
            float *s = s0 + b * ld, tmp[ihd > 0 ? ihd : 1];
            const float *c = S->cos + (long)b * hr, *sn = S->sin + (long)b * hr;
            for (int j = 0; j < ih; j++) {
                float *qj = s + o.iq + (long)j * ihd;
                memcpy(tmp, qj, sizeof(float) * rd);
                rope(tmp, c, sn, rd, 0, qj);  /* half-split RoPE on the first rd dims */
                s[o.iw + j] = s[o.iw + j] * L->iwscale;
            }
            float *krow = ik + S->write_slots[b] * ihd;
            layernorm(s + o.ikn, L->ik_norm_w, L->ik_norm_b, ihd, L->ieps, krow);
            memcpy(tmp, krow, sizeof(float) * rd);
            rope(tmp, c, sn, rd, 0, krow);
        }
    }
    for (int b = 0; b < B; b++) {  /* new cache row; RoPE'd q_pe and absorbed q_nope per head */
        float *s = s0 + b * ld;
        const float *c = S->cos + (long)b * hr, *sn = S->sin + (long)b * hr;
        float *row = kv + S->write_slots[b] * kvw;
        rmsnorm(s + o.kva, L->kv_norm, r, L->eps_kv, row);
        rope(s + o.kva + r, c, sn, rd, L->interleave, row + r);
        for (int hd = 0; hd < nh; hd++) {
            const float *qv = s + qoff + (long)hd * qh;
            float *qc = s + o.qcat + (long)hd * kvw;
            memset(qc, 0, sizeof(float) * r);
            for (int i = 0; i < nope; i++) axpy(qc, qv[i], L->w_kvb + ((long)hd * (nope + vd) + i) * r, r);
            rope(qv + nope, c, sn, rd, L->interleave, qc + r);
        }
    }
    for (int b = 0; b < B; b++) {  /* attention over the row's own keys */
        float *s = s0 + b * ld, *ol = s + o.olat;
        const int64_t *slots = S->key_slots + b * S->smax;
        long n = S->lengths[b];
        const int64_t *pos = NULL;  /* V3.2 with more than itopk keys: the selected positions */
        if (ih && n > L->itopk) {
            for (long t = 0; t < n; t++) {
                const float *kt = ik + slots[t] * ihd;
                float v = 0.0f;
                for (int j = 0; j < ih; j++) {
                    float d = dot(s + o.iq + (long)j * ihd, kt, ihd) * L->iscale;
                    v += s[o.iw + j] * (d > 0.0f ? d : 0.0f);
                }
                idx[t] = v == v ? v : -INFINITY;  /* NaN never selected over a number */
            }
            n = select_topk(idx, n, L->itopk, itmp, sel);
            pos = sel;
        }
        for (long t = 0; t < n; t++) {
            const float *kr = kv + slots[pos ? pos[t] : t] * kvw;
            for (int hd = 0; hd < nh; hd++) sc[hd * S->smax + t] = dot(s + o.qcat + (long)hd * kvw, kr, kvw) * L->scaling;
        }
        for (int hd = 0; hd < nh; hd++) {
            float *p = sc + hd * S->smax, m = p[0], sum = 0.0f;
            for (long t = 1; t < n; t++) m = p[t] > m ? p[t] : m;
            for (long t = 0; t < n; t++) {
                p[t] = expf(p[t] - m);
                sum += p[t];
            }
            float inv = 1.0f / sum;
            for (long t = 0; t < n; t++) p[t] *= inv;
        }
        memset(ol, 0, sizeof(float) * nh * r);
        for (long t = 0; t < n; t++) {
            const float *kr = kv + slots[pos ? pos[t] : t] * kvw;
            for (int hd = 0; hd < nh; hd++) axpy(ol + (long)hd * r, sc[hd * S->smax + t], kr, r);
        }
        for (int hd = 0; hd < nh; hd++)  /* W_UV */
            for (int v = 0; v < vd; v++)
                s[o.ov + (long)hd * vd + v] = dot(ol + (long)hd * r, L->w_kvb + ((long)hd * (nope + vd) + nope + v) * r, r);
    }
    matvec(L->w_o, H, nh * vd, s0 + o.ov, ld, x1, H, B);
    for (int b = 0; b < B; b++) {
        float *xr = x1 + (long)b * H;
        const float *xi = x + (long)b * H;
        for (int i = 0; i < H; i++) xr[i] = xr[i] + xi[i];
        rmsnorm(xr, L->post_norm, H, L->eps_post, h + (long)b * H);
        if (L->w_router) {
            float *s = s0 + b * ld;
            route(L, h + (long)b * H, s + o.rs, s + o.rc, s + o.gs, (unsigned char *)(s + o.gs + L->n_group),
                  ids + (long)b * L->k, w + (long)b * L->k);
        }
    }
}

ND_CLONES
void nd_mlp(const NdLayer *L, int B, const float *h, float *out, float *scratch) {
    const int I = L->inter, H = L->H;
    const long ld = row_floats(L);
    matvec(L->w_gate, I, H, h, H, scratch, ld, B);
    matvec(L->w_up, I, H, h, H, scratch + I, ld, B);
    for (int b = 0; b < B; b++) {
        float *g = scratch + b * ld;
        for (int i = 0; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * g[I + i];
    }
    matvec(L->w_down, H, I, scratch, ld, out, H, B);
}

void nd_add(long n, const float *x, const float *a, const float *b, float *out) {
    if (b)
        for (long i = 0; i < n; i++) out[i] = (a[i] + b[i]) + x[i];
    else
        for (long i = 0; i < n; i++) out[i] = x[i] + a[i];
}
