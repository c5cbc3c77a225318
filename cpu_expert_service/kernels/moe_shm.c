/* moe_shm.c: see moe_shm.h. */
#define _GNU_SOURCE
#include "moe_shm.h"

#include <errno.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>

static int is_finite(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (u & 0x7f800000u) != 0x7f800000u;
}

/* wire row -> f32; 0 where a value is NaN / Inf */
static int get_row(float *y, const unsigned char *src, int code, int n) {
    int ok = 1;
    for (int i = 0; i < n; i++) {
        float v;
        if (code == 0) {
            memcpy(&v, src + 4 * (size_t)i, 4);
        } else if (code == 1) {
            uint16_t h;
            memcpy(&h, src + 2 * (size_t)i, 2);
            v = moe_bf16_to_f32(h);
        } else {
#ifdef __FLT16_MAX__
            _Float16 h;
            memcpy(&h, src + 2 * (size_t)i, 2);
            v = (float)h;
#else
            return 0;
#endif
        }
        ok &= is_finite(v);
        y[i] = v;
    }
    return ok;
}

/* f32 -> wire (numpy / ml_dtypes casts: round to nearest even) */
static void put_rows(unsigned char *dst, int code, const float *x, size_t n) {
    if (code == 0) {
        memcpy(dst, x, n * 4);
    } else if (code == 1) {
        for (size_t i = 0; i < n; i++) {
            uint16_t h = moe_f32_to_bf16(x[i]);
            memcpy(dst + 2 * i, &h, 2);
        }
    } else {
#ifdef __FLT16_MAX__
        for (size_t i = 0; i < n; i++) {
            _Float16 h = (_Float16)x[i];
            memcpy(dst + 2 * i, &h, 2);
        }
#endif
    }
}

static int float_code_ok(uint32_t c) {
#ifdef __FLT16_MAX__
    return c <= 2;
#else
    return c <= 1;
#endif
}

/* receive one doorbell: 1, 0 at EOF / a wrong size, -1 on an error */
static int recv_doorbell(MoeShm *s, unsigned char *msg) {
    int64_t end = s->spin_s > 0 ? shm_now_ns() + (int64_t)(s->spin_s * 1e9) : 0;
    for (;;) {
        int spinning = end && shm_now_ns() < end;
        ssize_t n = recv(s->fd, msg, SHM_DOORBELL_BYTES, spinning ? MSG_DONTWAIT : 0);
        if (n == SHM_DOORBELL_BYTES) return 1;
        if (n >= 0) return 0;
        if (errno == EINTR) continue;
        if (spinning && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            sched_yield();
            continue;
        }
        return -1;
    }
}

static void record(MoeShm *s, int layer, int T, int64_t wait_ns, int64_t kernel_ns) {
    if (!s->ring) return;
    uint64_t head = s->head, tail = __atomic_load_n(&s->tail, __ATOMIC_ACQUIRE);
    if (head - tail >= s->ring_cap) {
        __atomic_fetch_add(&s->dropped, 1, __ATOMIC_RELAXED);
        return;
    }
    MoeShmRec *r = &s->ring[head & (s->ring_cap - 1)];
    r->layer = layer, r->T = T, r->wait_ns = wait_ns, r->kernel_ns = kernel_ns;
    __atomic_store_n(&s->head, head + 1, __ATOMIC_RELEASE);
}

/* one call: 1 answered, 0 for Python, -1 out of memory */
static int serve_one(MoeShm *s, MoePool *pool, const MoeKernels *kern, uint32_t slot, uint64_t seq,
                     int64_t arrived) {
    unsigned char *b = s->base + s->header_bytes + (long)slot * s->slot_bytes;
    int32_t layer;
    uint32_t h[6]; /* T, k, hidden / ids / weights / output dtype codes (wire.shm.CALL) */
    memcpy(&layer, b, 4);
    memcpy(h, b + 4, sizeof h);
    uint32_t T = h[0], k = h[1];
    if (layer < 0 || layer >= s->n_layers || !s->experts[layer] || T == 0 || T > (uint32_t)s->max_tokens
        || T > (uint32_t)s->shard_max_tokens || k < 1 || k > (uint32_t)s->max_k || k > (uint32_t)s->E
        || !float_code_ok(h[2]) || h[3] != 4 || h[4] != 0 || !float_code_ok(h[5]))
        return 0;
    int H = s->H;
    const unsigned char *xs = b + s->hidden_off;
    size_t es = h[2] == 0 ? 4 : 2;
    for (uint32_t t = 0; t < T; t++)
        if (!get_row(s->x + (size_t)t * H, xs + (size_t)t * H * es, (int)h[2], H)) return 0;
    memcpy(s->ids, b + s->ids_off, (size_t)T * k * 8);
    memcpy(s->w, b + s->w_off, (size_t)T * k * 4);
    for (size_t i = 0; i < (size_t)T * k; i++) {
        if (s->ids[i] < 0 || s->ids[i] >= s->E || !is_finite(s->w[i])) return 0;
    }
    if (s->tokens) {  /* counted as the metered backend counts: every routed id, held ones only */
        __atomic_fetch_add(&s->tokens[layer], (int64_t)T, __ATOMIC_RELAXED);
        if (s->acts)
            for (size_t i = 0; i < (size_t)T * k; i++)
                if (s->held[s->ids[i]]) __atomic_fetch_add(&s->acts[(long)layer * s->E + s->ids[i]], 1, __ATOMIC_RELAXED);
    }
    for (size_t i = 0; i < (size_t)T * k; i++)
        if (s->w[i] == 0.0f) s->ids[i] = -1;  /* weight 0: computed on the GPU side (KernelExperts.forward) */
    memset(s->out, 0, (size_t)T * H * 4);
    int64_t t0 = shm_now_ns();
    int rc = moe_forward(pool, kern, s->experts[layer], s->cap[layer], s->fmt, H, s->inter[layer], s->x, (int)T,
                         s->ids, s->w, (int)k, s->out);
    int64_t t1 = shm_now_ns();
    if (rc != 0) return -1;
    put_rows(b + s->out_off, (int)h[5], s->out, (size_t)T * H);
    uint64_t compute_us = (uint64_t)((t1 - t0) / 1000), server_us = (uint64_t)((shm_now_ns() - arrived) / 1000);
    uint32_t mlen = 0;
    memcpy(b + SHM_RESULT_OFFSET, &compute_us, 8);
    memcpy(b + SHM_RESULT_OFFSET + 8, &server_us, 8);
    memcpy(b + SHM_RESULT_OFFSET + 16, &mlen, 4);
    record(s, layer, (int)T, t0 - arrived, t1 - t0);
    unsigned char msg[SHM_DOORBELL_BYTES];
    uint32_t status = 0;
    memcpy(msg, &status, 4), memcpy(msg + 4, &slot, 4), memcpy(msg + 8, &seq, 8);
    while (send(s->fd, msg, sizeof msg, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
    return 1;  /* a failed send shows as EOF at the next receive */
}

int moe_shm_serve(MoeShm *s, MoePool *pool, const MoeKernels *kern) {
    unsigned char msg[SHM_DOORBELL_BYTES];
    for (;;) {
        if (recv_doorbell(s, msg) <= 0) return MOE_SHM_CLOSED;
        int64_t arrived = shm_now_ns();
        uint32_t op, slot;
        uint64_t seq;
        memcpy(&op, msg, 4), memcpy(&slot, msg + 4, 4), memcpy(&seq, msg + 8, 8);
        s->slot = slot, s->seq = seq, s->arrived_ns = arrived;
        if (op != SHM_OP_FORWARD || slot >= (uint32_t)s->n_slots) return MOE_SHM_BAD_DOORBELL;
        int rc = serve_one(s, pool, kern, slot, seq, arrived);
        if (rc == 0) return MOE_SHM_PYTHON;
        if (rc < 0) return MOE_SHM_NOMEM;
    }
}
