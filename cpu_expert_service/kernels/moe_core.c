/* moesplit CPU MoE: ISA-independent parts, compiled for baseline x86-64.
 *
 * - CPU feature detection (cpuid + xgetbv, AMX tile permission via arch_prctl)
 * - a small pthread pool: workers pinned one per allowed CPU, the calling thread is thread 0,
 *   idle workers sleep on a condition variable (no spinning dispatcher), barriers are
 *   pthread_barrier (futex, passive)
 * - the fused MoE op: bucket tokens per expert, gate+up panels -> silu(gate)*up, down panels
 *   -> weighted accumulation into the output (each thread owns whole output columns)
 *
 * Weight quantisation + packing live in moe_pack.c, the portable (generic) kernels in moe_generic.c.
 */
#define _GNU_SOURCE
#include "moe.h"

#include <cpuid.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* ------------------------------------------------------------------ CPU features */

static uint64_t xgetbv0(void) {
    uint32_t lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

#define ARCH_GET_XCOMP_PERM 0x1022
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int moe_amx_request_permission(void) {
    unsigned long bitmask = 0;
    if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) return -errno;
    if (syscall(SYS_arch_prctl, ARCH_GET_XCOMP_PERM, &bitmask) != 0) return -errno;
    return (bitmask & (1ul << XFEATURE_XTILEDATA)) ? 0 : -EPERM;
}

int moe_cpu_has(int isa) {
    unsigned a, b, c, d;
    if (isa == MOE_ISA_GENERIC) return 1;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int osxsave = (c >> 27) & 1, fma = (c >> 12) & 1;
    if (!osxsave) return 0;
    uint64_t xcr0 = xgetbv0();
    if ((xcr0 & 0x6) != 0x6) return 0; /* SSE + AVX state */
    unsigned b7, c7, d7, a71 = 0, b71, c71, d71;
    if (!__get_cpuid_count(7, 0, &a, &b7, &c7, &d7)) return 0;
    int avx2 = (b7 >> 5) & 1;
    if (isa == MOE_ISA_AVX2) return avx2 && fma;
    __get_cpuid_count(7, 1, &a71, &b71, &c71, &d71);
    int avx512 = ((b7 >> 16) & 1) /*F*/ && ((b7 >> 17) & 1) /*DQ*/ && ((b7 >> 30) & 1) /*BW*/ &&
                 ((b7 >> 31) & 1) /*VL*/ && ((c7 >> 11) & 1) /*VNNI*/ && ((a71 >> 5) & 1) /*BF16*/;
    int os512 = (xcr0 & 0xe0) == 0xe0; /* opmask, ZMM_Hi256, Hi16_ZMM */
#ifdef MOE_SIMDE /* test build: the AVX-512 files run on portable intrinsics (simde_x86.h) */
    avx512 = os512 = 1;
#endif
    if (isa == MOE_ISA_AVX512) return avx2 && fma && avx512 && os512;
    if (isa == MOE_ISA_AMX) {
#ifdef MOE_AMX_EMULATE /* test build: tiles emulated in software (amx_emu.h) */
        return avx2 && fma && avx512 && os512;
#endif
        int amx = ((d7 >> 22) & 1) /*AMX-BF16*/ && ((d7 >> 24) & 1) /*TILE*/ && ((d7 >> 25) & 1) /*INT8*/;
        if (!(avx2 && fma && avx512 && os512 && amx)) return 0;
        /* the OS must enable XTILECFG + XTILEDATA in XCR0 (Linux >= 5.16), and each process must
         * still ask for XTILEDATA permission before touching the tiles */
        if ((xcr0 & (3ull << 17)) != (3ull << 17)) return 0;
        return moe_amx_request_permission() == 0;
    }
    return 0;
}

int moe_bf16_dot_fma(void) {
    const char *env = getenv("MOESPLIT_BF16_DOT");
    if (env && strcmp(env, "fma") == 0) return 1;
    if (env && strcmp(env, "dpbf16") == 0) return 0;
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d)) return 0;
    int amd = b == 0x68747541u && d == 0x69746e65u && c == 0x444d4163u; /* "AuthenticAMD" */
    if (!amd || !__get_cpuid(1, &a, &b, &c, &d)) return 0;
    int family = (int)((a >> 8) & 0xf) + (((a >> 8) & 0xf) == 0xf ? (int)((a >> 20) & 0xff) : 0);
    return family == 0x19;
}

/* ------------------------------------------------------------------ thread pool */

struct MoePool {
    int n;
    int *cpus; /* cpu of thread i (i < n), -1 = unpinned */
    pthread_t *th;
    pthread_mutex_t mu;
    pthread_cond_t cv_start, cv_done;
    pthread_mutex_t run_mu; /* one op at a time */
    pthread_barrier_t bar;
    unsigned gen;
    int remaining, stop;
    /* per-call activation buffers, kept between calls (fresh pages fault at every call otherwise) */
    pthread_mutex_t ws_mu;
    uint8_t *ws;
    size_t ws_cap;
    moe_job_fn fn;
    void *arg;
};

typedef struct {
    MoePool *pool;
    int tid;
} WorkerArg;

static void pin_self(int cpu) {
    if (cpu < 0) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(cpu, &set);
    pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

static void *worker_main(void *p) {
    WorkerArg wa = *(WorkerArg *)p;
    free(p);
    MoePool *pool = wa.pool;
    pin_self(pool->cpus[wa.tid]);
    unsigned seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool->mu);
        while (pool->gen == seen && !pool->stop) pthread_cond_wait(&pool->cv_start, &pool->mu);
        if (pool->stop) {
            pthread_mutex_unlock(&pool->mu);
            break;
        }
        seen = pool->gen;
        moe_job_fn fn = pool->fn;
        void *arg = pool->arg;
        pthread_mutex_unlock(&pool->mu);
        fn(arg, wa.tid, pool->n);
        pthread_mutex_lock(&pool->mu);
        if (--pool->remaining == 0) pthread_cond_signal(&pool->cv_done);
        pthread_mutex_unlock(&pool->mu);
    }
    return NULL;
}

MoePool *moe_pool_create(int nthreads, const int *cpus, int ncpus) {
    if (nthreads < 1) nthreads = 1;
    MoePool *pool = calloc(1, sizeof(MoePool));
    if (!pool) return NULL;
    pool->n = nthreads;
    pool->cpus = malloc(sizeof(int) * nthreads);
    pool->th = calloc(nthreads, sizeof(pthread_t));
    for (int i = 0; i < nthreads; i++) pool->cpus[i] = ncpus > 0 ? cpus[i % ncpus] : -1;
    pthread_mutex_init(&pool->mu, NULL);
    pthread_mutex_init(&pool->run_mu, NULL);
    pthread_mutex_init(&pool->ws_mu, NULL);
    pthread_cond_init(&pool->cv_start, NULL);
    pthread_cond_init(&pool->cv_done, NULL);
    pthread_barrier_init(&pool->bar, NULL, nthreads);
    for (int i = 1; i < nthreads; i++) {
        WorkerArg *wa = malloc(sizeof(WorkerArg));
        wa->pool = pool;
        wa->tid = i;
        pthread_create(&pool->th[i], NULL, worker_main, wa);
    }
    return pool;
}

void moe_pool_destroy(MoePool *pool) {
    if (!pool) return;
    pthread_mutex_lock(&pool->mu);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->cv_start);
    pthread_mutex_unlock(&pool->mu);
    for (int i = 1; i < pool->n; i++) pthread_join(pool->th[i], NULL);
    pthread_barrier_destroy(&pool->bar);
    free(pool->ws);
    free(pool->cpus);
    free(pool->th);
    free(pool);
}

int moe_pool_size(const MoePool *pool) { return pool->n; }

void moe_pool_barrier(MoePool *pool) {
    if (pool->n > 1) pthread_barrier_wait(&pool->bar);
}

void moe_pool_run(MoePool *pool, moe_job_fn fn, void *arg) { moe_pool_run_n(pool, fn, arg, pool->n); }

/* run fn on `threads` threads: 1 = on the caller alone (no worker woken; its job must not call
 * moe_pool_barrier then), else the whole pool */
void moe_pool_run_n(MoePool *pool, moe_job_fn fn, void *arg, int threads) {
    pthread_mutex_lock(&pool->run_mu);
    if (pool->n == 1 || threads <= 1) {
        fn(arg, 0, 1);
        pthread_mutex_unlock(&pool->run_mu);
        return;
    }
    pthread_mutex_lock(&pool->mu);
    pool->fn = fn;
    pool->arg = arg;
    pool->remaining = pool->n - 1;
    pool->gen++;
    pthread_cond_broadcast(&pool->cv_start);
    pthread_mutex_unlock(&pool->mu);
    /* the caller works as thread 0, pinned to the first CPU for the duration of the op */
    cpu_set_t saved;
    int have_saved = pool->cpus[0] >= 0 &&
                     pthread_getaffinity_np(pthread_self(), sizeof(saved), &saved) == 0;
    if (have_saved) pin_self(pool->cpus[0]);
    fn(arg, 0, pool->n);
    if (have_saved) pthread_setaffinity_np(pthread_self(), sizeof(saved), &saved);
    pthread_mutex_lock(&pool->mu);
    while (pool->remaining > 0) pthread_cond_wait(&pool->cv_done, &pool->mu);
    pthread_mutex_unlock(&pool->mu);
    pthread_mutex_unlock(&pool->run_mu);
}

/* ------------------------------------------------------------------ read-bandwidth probe */

typedef struct {
    const uint8_t *buf;
    size_t bytes;
    int avx2;
    uint64_t sink[64];
} ReadJob;

static void read_job(void *arg, int tid, int nt) {
    ReadJob *j = arg;
    size_t chunk = j->bytes / (size_t)nt / 256 * 256;
    const uint8_t *p = j->buf + chunk * (size_t)tid;
    uint64_t x = 0;
    if (j->avx2) x = moe_read_avx2(p, chunk);
    else
        for (size_t i = 0; i < chunk; i += 8) x ^= *(const uint64_t *)(p + i);
    j->sink[tid & 63] ^= x;
}

double moe_probe_read(MoePool *pool, const uint8_t *buf, size_t bytes) {
    static volatile uint64_t keep;
    ReadJob j = {buf, bytes, moe_cpu_has(MOE_ISA_AVX2), {0}};
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    moe_pool_run(pool, read_job, &j);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    for (int i = 0; i < 64; i++) keep ^= j.sink[i];
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

/* ------------------------------------------------------------------ activations */

/* float row [K] -> two-level int8 row [2*Kp] + per-group scale and correction.
 * Per group g of 32: q1 = round(x / s) with s = amax / 127, then the residual q2 =
 * round((x / s - q1) * 254), so x ~= (254 * q1 + q2) * s / 254: a 16-bit activation that
 * VNNI multiplies as two int8 halves (one int8 level alone costs ~0.8% relative error per
 * projection). Layout per group: [32 x q1][32 x q2]. xs[g] = s / div (254; 508 for mxfp4, whose table
 * doubles the e2m1 values: exactly half, so the e8m0 value scales a group as is); xc[g] = offset * xs[g] *
 * sum(254 q1 + q2), the correction for unsigned (offset) weights. levels 1 (8-bit activations): q2 = 0. */
static void quant_row(const float *x, int K, int Kp, int offset, int levels, float div, int8_t *q, float *xs, float *xc,
                      int32_t *xo) {
    for (int g = 0; g < Kp / MOE_GROUP; g++) {
        float amax = 0.f;
        int k0 = g * MOE_GROUP;
        for (int k = k0; k < k0 + MOE_GROUP && k < K; k++) amax = fmaxf(amax, fabsf(x[k]));
        float s = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        int8_t *qh = q + 2 * k0, *ql = qh + MOE_GROUP;
        for (int k = k0; k < k0 + MOE_GROUP; k++) {
            int v1 = 0, v2 = 0;
            if (k < K) {
                float t = x[k] * inv;
                v1 = (int)nearbyintf(t);
                v1 = v1 < -127 ? -127 : v1 > 127 ? 127 : v1;
                v2 = levels == 1 ? 0 : (int)nearbyintf((t - (float)v1) * 254.f);
                v2 = v2 < -127 ? -127 : v2 > 127 ? 127 : v2;
            }
            qh[k - k0] = (int8_t)v1;
            ql[k - k0] = (int8_t)v2;
            sum += 254 * v1 + v2;
        }
        xs[g] = s / div;
        xc[g] = (float)offset * xs[g] * (float)sum;
        if (xo) { /* MoeRows.xo (levels 1: sum = 254 * sum(q1)) */
            int h[2] = {0, 0};
            for (int k = 0; k < MOE_GROUP; k++) h[(k >> 1) & 1] += qh[k];
            xo[2 * g] = (int32_t)((uint32_t)(uint16_t)(offset * h[0]) | (uint32_t)(uint16_t)(offset * h[1]) << 16);
            xo[2 * g + 1] = offset * sum;
        }
    }
}

/* SwiGLU limit on one panel's outputs c = [half gate | half up]: gate = min(gate, L), up clamped to
 * [-L, L] (torch's clamp: a NaN stays NaN); exact, so bit-compatible with the f32 reference */
static void swiglu_clamp(float *c, int half, float lim) {
    for (int i = 0; i < half; i++) c[i] = c[i] > lim ? lim : c[i];
    for (int i = half; i < 2 * half; i++) c[i] = c[i] > lim ? lim : c[i] < -lim ? -lim : c[i];
}

/* ------------------------------------------------------------------ the fused op */

typedef struct {
    MoePool *pool;
    const MoeKernels *kern;
    int fmt, H, I, Kx, Ka, T, k, ne, na, nmax;
    const float *x;
    float *out;
    MoeExpert **ex; /* used experts, in id order */
    int *off;       /* [ne + 1] assignment offsets */
    int *tok;       /* [na] token of assignment */
    float *wt;      /* [na] weight */
    /* activations: token rows (x) and assignment rows (a) */
    uint16_t *xb, *ab;
    float *xf; /* bf16 format: the bf16 token rows in f32 (af: the bf16 assignment rows in f32) */
    int8_t *xq, *aq;
    float *xs, *xc, *as, *ac, *af;
    int32_t *xo, *ao; /* 8-bit-activation mxfp4: MoeRows.xo of the token and assignment rows; else NULL */
    /* per thread */
    const void **ptrs; /* [nt][4 * nmax] */
    float *C;          /* [nt][nmax * 64] */
    uint8_t *scratch;  /* [nt][scratch_bytes] */
    size_t scratch_bytes;
} Fwd;

static void fwd_job(void *arg, int tid, int nt) {
    Fwd *f = arg;
    int fmt = f->fmt, isint = fmt != MOE_FMT_BF16;
    int off = fmt == MOE_FMT_INT8 ? 128 : fmt == MOE_FMT_MXFP4 ? MOE_MXFP4_OFFSET : 8;
    int levels = f->kern->act_bits == 8 ? 1 : 2;
    float div = fmt == MOE_FMT_MXFP4 ? 508.f : 254.f; /* mxfp4: the table's doubled values halved here */
    int Kx = f->Kx, Ka = f->Ka, gx = Kx / MOE_GROUP, ga = Ka / MOE_GROUP;
    int r0, r1;
    /* phase 0: convert token rows */
    moe_part(f->T, tid, nt, &r0, &r1);
    for (int t = r0; t < r1; t++) {
        const float *xr = f->x + (size_t)t * f->H;
        if (!isint) {
            uint16_t *d = f->xb + (size_t)t * Kx; /* the one activation format of bf16 weights */
            float *df = f->xf + (size_t)t * MOE_F32_ROW(Kx); /* the same values in f32 (exact) */
            for (int kk = 0; kk < Kx; kk++) {
                d[kk] = kk < f->H ? moe_f32_to_bf16(xr[kk]) : 0;
                df[kk] = moe_bf16_to_f32(d[kk]);
            }
        } else
            quant_row(xr, f->H, Kx, off, levels, div, f->xq + (size_t)t * 2 * Kx, f->xs + (size_t)t * gx, f->xc + (size_t)t * gx,
                      f->xo ? f->xo + (size_t)t * 2 * gx : NULL);
    }
    if (nt > 1) moe_pool_barrier(f->pool);

    const void **ptr = f->ptrs + (size_t)tid * 4 * f->nmax;
    float *C = f->C + (size_t)tid * f->nmax * 64;
    void *scr = f->scratch + (size_t)tid * f->scratch_bytes;
    MoeRows rows;
    rows.act8 = levels == 1;
    rows.b = (const uint16_t *const *)ptr;
    rows.q = (const int8_t *const *)ptr;
    rows.xs = (const float *const *)(ptr + f->nmax);
    rows.xc = (const float *const *)(ptr + 2 * f->nmax);
    rows.f = (const float *const *)(ptr + 3 * f->nmax);
    rows.xo = isint && f->xo ? (const int32_t *const *)(ptr + 3 * f->nmax) : NULL; /* the slot rows.f has for bf16 */

    /* phase 1: gate+up, [clamp,] silu(gate) * up */
    const float lim = f->kern->swiglu_limit;
    for (int e = 0; e < f->ne; e++) {
        const MoeMat *W = &f->ex[e]->gu;
        int a0 = f->off[e], n = f->off[e + 1] - a0, half = W->NP / 2, p0, p1;
        rows.n = n;
        for (int m = 0; m < n; m++) {
            int t = f->tok[a0 + m];
            if (!isint) {
                ptr[m] = f->xb + (size_t)t * Kx;
                ptr[3 * f->nmax + m] = f->xf + (size_t)t * MOE_F32_ROW(Kx);
            } else {
                ptr[m] = f->xq + (size_t)t * 2 * Kx;
                ptr[f->nmax + m] = f->xs + (size_t)t * gx;
                ptr[2 * f->nmax + m] = f->xc + (size_t)t * gx;
                ptr[3 * f->nmax + m] = f->xo ? f->xo + (size_t)t * 2 * gx : NULL;
            }
        }
        moe_part(W->Np / W->NP, tid, nt, &p0, &p1);
        for (int p = p0; p < p1; p++) {
            f->kern->panel[fmt](W, p, &rows, C, scr);
            for (int m = 0; m < n; m++) {
                float *cr = C + (size_t)m * W->NP;
                float *af = f->af + (size_t)(a0 + m) * MOE_F32_ROW(Ka) + p * half;
                uint16_t *ab = isint ? NULL : f->ab + (size_t)(a0 + m) * Ka + p * half;
                if (lim > 0.f) swiglu_clamp(cr, half, lim);
                f->kern->act(cr, cr + half, half, af, ab);
                if (ab) /* bf16: the f32 row holds the bf16-rounded values too */
                    for (int i = 0; i < half; i++) af[i] = moe_bf16_to_f32(ab[i]);
            }
        }
    }
    if (nt > 1) moe_pool_barrier(f->pool);
    if (isint) { /* phase 1b: quantise the intermediate rows */
        moe_part(f->na, tid, nt, &r0, &r1);
        for (int a = r0; a < r1; a++)
            quant_row(f->af + (size_t)a * MOE_F32_ROW(Ka), Ka, Ka, off, levels, div, f->aq + (size_t)a * 2 * Ka, f->as + (size_t)a * ga,
                      f->ac + (size_t)a * ga, f->ao ? f->ao + (size_t)a * 2 * ga : NULL);
        if (nt > 1) moe_pool_barrier(f->pool);
    }
    /* phase 2: down, weighted accumulation; this thread owns output columns of its panels, so a
     * token's out[c] gets its experts' terms in one fixed order, ascending expert id (then k slot
     * for an expert routed twice), whatever the other tokens, the thread count or timing are */
    for (int e = 0; e < f->ne; e++) {
        const MoeMat *W = &f->ex[e]->dn;
        int a0 = f->off[e], n = f->off[e + 1] - a0, NP = W->NP, p0, p1;
        rows.n = n;
        for (int m = 0; m < n; m++) {
            int a = a0 + m;
            if (!isint) {
                ptr[m] = f->ab + (size_t)a * Ka;
                ptr[3 * f->nmax + m] = f->af + (size_t)a * MOE_F32_ROW(Ka);
            } else {
                ptr[m] = f->aq + (size_t)a * 2 * Ka;
                ptr[f->nmax + m] = f->as + (size_t)a * ga;
                ptr[2 * f->nmax + m] = f->ac + (size_t)a * ga;
                ptr[3 * f->nmax + m] = f->ao ? f->ao + (size_t)a * 2 * ga : NULL;
            }
        }
        moe_part(W->Np / NP, tid, nt, &p0, &p1);
        for (int p = p0; p < p1; p++) {
            f->kern->panel[fmt](W, p, &rows, C, scr);
            int c1 = f->H - p * NP;
            if (c1 > NP) c1 = NP;
            for (int m = 0; m < n; m++) {
                float wv = f->wt[a0 + m];
                float *o = f->out + (size_t)f->tok[a0 + m] * f->H + p * NP;
                const float *cr = C + (size_t)m * NP;
                for (int c = 0; c < c1; c++) o[c] += wv * cr[c];
            }
        }
    }
}

/* carve 64-byte aligned buffers out of one block: first pass with base NULL only sizes */
typedef struct {
    uint8_t *base;
    size_t off;
} Arena;

static void *take(Arena *a, size_t bytes) {
    void *p = a->base ? a->base + a->off : NULL;
    a->off += (bytes + 63) / 64 * 64;
    return p;
}

/* the pool's workspace, at least `bytes`; caller holds ws_mu */
static uint8_t *workspace(MoePool *pool, size_t bytes) {
    if (bytes > pool->ws_cap) {
        free(pool->ws);
        pool->ws = NULL;
        pool->ws_cap = 0;
        size_t cap = bytes + bytes / 4;
        void *p = NULL;
        if (posix_memalign(&p, 2u << 20, cap) != 0) return NULL;
#ifdef MADV_HUGEPAGE
        madvise(p, cap, MADV_HUGEPAGE);
#endif
        pool->ws = p;
        pool->ws_cap = cap;
    }
    return pool->ws;
}

int moe_forward(MoePool *pool, const MoeKernels *kern, MoeExpert *const *experts, int n_experts, int fmt,
                int H, int I, const float *x, int T, const int64_t *ids, const float *w, int k, float *out) {
    int rc = 0;
    int *cnt = calloc(n_experts + 1, sizeof(int));
    if (!cnt) return -ENOMEM;
    for (size_t i = 0; i < (size_t)T * k; i++) {
        int64_t id = ids[i];
        if (id >= 0 && id < n_experts && experts[id]) cnt[id]++;
    }
    Fwd f;
    memset(&f, 0, sizeof(f));
    f.pool = pool;
    f.kern = kern;
    f.fmt = fmt;
    f.H = H;
    f.I = I;
    f.T = T;
    f.k = k;
    f.x = x;
    f.out = out;
    for (int e = 0; e < n_experts; e++)
        if (cnt[e]) {
            f.ne++;
            f.na += cnt[e];
            if (cnt[e] > f.nmax) f.nmax = cnt[e];
        }
    if (f.na == 0) {
        free(cnt);
        return 0;
    }
    int nt = moe_pool_size(pool);
    f.Kx = moe_rup(H, MOE_GROUP);
    f.Ka = moe_rup(I, MOE_GROUP);
    int Kmax = f.Kx > f.Ka ? f.Kx : f.Ka;
    f.scratch_bytes = (moe_scratch_bytes(Kmax) + 63) / 64 * 64;
    f.ex = malloc(sizeof(MoeExpert *) * f.ne);
    f.off = malloc(sizeof(int) * (f.ne + 1));
    f.tok = malloc(sizeof(int) * f.na);
    f.wt = malloc(sizeof(float) * f.na);
    int *slot = malloc(sizeof(int) * (n_experts + 1));
    f.ptrs = malloc(sizeof(void *) * 4 * f.nmax * nt);
    pthread_mutex_lock(&pool->ws_mu);
    Arena ar = {NULL, 0};
    for (int pass = 0; pass < 2; pass++) {
        if (pass == 1) {
            ar.base = workspace(pool, ar.off);
            ar.off = 0;
            if (!ar.base) break;
        }
        f.C = take(&ar, sizeof(float) * 64 * f.nmax * nt);
        f.scratch = take(&ar, f.scratch_bytes * nt);
        if (fmt == MOE_FMT_BF16) {
            f.xb = take(&ar, sizeof(uint16_t) * T * f.Kx);
            f.ab = take(&ar, sizeof(uint16_t) * f.na * f.Ka);
            f.af = take(&ar, sizeof(float) * f.na * MOE_F32_ROW(f.Ka));
            f.xf = take(&ar, sizeof(float) * T * MOE_F32_ROW(f.Kx));
        } else {
            int gx = f.Kx / MOE_GROUP, ga = f.Ka / MOE_GROUP;
            f.xq = take(&ar, (size_t)T * 2 * f.Kx);
            f.xs = take(&ar, sizeof(float) * T * gx);
            f.xc = take(&ar, sizeof(float) * T * gx);
            f.af = take(&ar, sizeof(float) * f.na * MOE_F32_ROW(f.Ka));
            f.aq = take(&ar, (size_t)f.na * 2 * f.Ka);
            f.as = take(&ar, sizeof(float) * f.na * ga);
            f.ac = take(&ar, sizeof(float) * f.na * ga);
            if (fmt == MOE_FMT_MXFP4 && kern->act_bits == 8 && kern->isa == MOE_ISA_AVX2) { /* only its ub panel reads xo */
                f.xo = take(&ar, sizeof(int32_t) * 2 * T * gx);
                f.ao = take(&ar, sizeof(int32_t) * 2 * f.na * ga);
            }
        }
    }
    if (!ar.base || !f.ex || !f.off || !f.tok || !f.wt || !slot || !f.ptrs || !f.C || !f.scratch ||
        (fmt == MOE_FMT_BF16 ? (!f.xb || !f.ab || !f.af || !f.xf) : (!f.xq || !f.xs || !f.xc || !f.af || !f.aq || !f.as || !f.ac))) {
        rc = -ENOMEM;
        goto done;
    }
    /* bucket: assignments grouped by expert (ascending id), tokens in order within one */
    {
        int j = 0, o = 0;
        for (int e = 0; e < n_experts; e++)
            if (cnt[e]) {
                f.ex[j] = experts[e];
                f.off[j] = o;
                slot[e] = o;
                o += cnt[e];
                j++;
            }
        f.off[j] = o;
        for (int t = 0; t < T; t++)
            for (int i = 0; i < k; i++) {
                int64_t id = ids[(size_t)t * k + i];
                if (id >= 0 && id < n_experts && experts[id]) {
                    int a = slot[id]++;
                    f.tok[a] = t;
                    f.wt[a] = w[(size_t)t * k + i];
                }
            }
    }
    /* a call this small (a tiny model's decode step) runs on the calling thread: waking the pool
     * costs more than the work (~25 us a call on a 2-core VM). The result is the same bits: a row's
     * arithmetic does not depend on the thread count (threads split output channels, never k). */
    moe_pool_run_n(pool, fwd_job, &f, (long)f.na * 3 * H * I < MOE_SMALL_CALL_MACS ? 1 : nt);
done:
    free(cnt);
    free(slot);
    free(f.ex);
    free(f.off);
    free(f.tok);
    free(f.wt);
    free(f.ptrs);
    pthread_mutex_unlock(&pool->ws_mu);
    return rc;
}
