/* moe_shm.c: see moe_shm.h. */
#define _GNU_SOURCE
#include "moe_shm.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

/* wire dtype codes (wire.shm.DTYPE_NAMES) */
enum { CODE_F32 = 0, CODE_BF16 = 1, CODE_F16 = 2, CODE_I32 = 3, CODE_I64 = 4 };

static int is_finite(float v) {
    uint32_t u;
    memcpy(&u, &v, 4);
    return (u & 0x7f800000u) != 0x7f800000u;
}

#ifdef __FLT16_MAX__
static float f16_to_f32(uint16_t h) {
    _Float16 v;
    memcpy(&v, &h, 2);
    return (float)v;
}
static uint16_t f32_to_f16(float f) {
    _Float16 v = (_Float16)f;
    uint16_t h;
    memcpy(&h, &v, 2);
    return h;
}
#else
/* without a compiler _Float16: numpy's casts in software (round to nearest even, subnormals) */
static float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, u;
    float f;
    if (e == 0x1f) {
        u = sign | 0x7f800000u | (m << 13);
    } else if (e) {
        u = sign | ((e + 112u) << 23) | (m << 13);
    } else {
        f = (float)m * 0x1p-24f; /* zero or subnormal: exact */
        memcpy(&u, &f, 4);
        u |= sign;
    }
    memcpy(&f, &u, 4);
    return f;
}
static uint16_t f32_to_f16(float f) {
    uint32_t u, a;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)(a >> 13);   /* NaN, quiet */
    if (a >= 0x477ff000u) return sign | 0x7c00u;                         /* >= 65520: inf */
    if (a < 0x38800000u) return sign | (uint16_t)lrintf(fabsf(f) * 0x1p24f); /* below 2^-14 */
    return sign | (uint16_t)(((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10));
}
#endif

/* n wire values -> f32; 0 if one is NaN / Inf */
static int get_floats(float *y, const unsigned char *src, uint32_t code, size_t n) {
    int ok = 1;
    if (code == CODE_F32) {
        memcpy(y, src, n * 4);
        for (size_t i = 0; i < n; i++) ok &= is_finite(y[i]);
        return ok;
    }
    for (size_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, 2);
        float v = code == CODE_BF16 ? moe_bf16_to_f32(h) : f16_to_f32(h);
        ok &= is_finite(v);
        y[i] = v;
    }
    return ok;
}

/* f32 -> wire (numpy / ml_dtypes casts: round to nearest even) */
static void put_floats(unsigned char *dst, uint32_t code, const float *x, size_t n) {
    if (code == CODE_F32) {
        memcpy(dst, x, n * 4);
        return;
    }
    for (size_t i = 0; i < n; i++) {
        uint16_t h = code == CODE_BF16 ? moe_f32_to_bf16(x[i]) : f32_to_f16(x[i]);
        memcpy(dst + 2 * i, &h, 2);
    }
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

/* counted as the metered backend counts: every routed id of a computed call, held experts only */
static void count(MoeShm *s, int layer, size_t T, size_t k) {
    if (!s->tokens) return;
    __atomic_fetch_add(&s->tokens[layer], (int64_t)T, __ATOMIC_RELAXED);
    if (s->acts)
        for (size_t i = 0; i < T * k; i++)
            if (s->held[s->ids[i]]) __atomic_fetch_add(&s->acts[(long)layer * s->E + s->ids[i]], 1, __ATOMIC_RELAXED);
}

/* The validator's checks (ExpertServicer.check_and_forward, after the slot's bounds and dtype codes),
 * in its order and with its messages, converting the slot into the scratch rows on the way: 0, or 1
 * with the refusal in text. c: dtype codes hidden / ids / weights / output. */
static int check(MoeShm *s, const unsigned char *b, int32_t layer, uint32_t T, uint32_t k, const uint32_t *c,
                 char *text, size_t cap) {
    if (T > (uint32_t)s->max_tokens || k > (uint32_t)s->max_k)
        return snprintf(text, cap, "%" PRIu32 " tokens x top-%" PRIu32 " exceed the shared slot (%d x %d)", T, k,
                        s->max_tokens, s->max_k), 1;
    if (c[0] > CODE_F16 || c[3] > CODE_F16 || c[2] > CODE_F16 || (c[1] != CODE_I32 && c[1] != CODE_I64))
        return snprintf(text, cap, "dtype codes hidden/ids/weights/output %" PRIu32 "/%" PRIu32 "/%" PRIu32 "/%" PRIu32
                        " not accepted", c[0], c[1], c[2], c[3]), 1;
    if (layer < 0 || layer >= s->n_layers || !s->served[layer])
        return snprintf(text, cap, "layer %" PRId32 " is not an MoE layer served by shard %s (serves layers %s)", layer,
                        s->shard_id, s->served_text), 1;
    if (T > (uint32_t)s->shard_max_tokens)
        return snprintf(text, cap, "hidden: %" PRIu32 " tokens exceed this shard's maximum of %d per request", T,
                        s->shard_max_tokens), 1;
    if (k < 1 || k > (uint32_t)s->E)
        return snprintf(text, cap, "topk_ids: k=%" PRIu32 " must be in [1, %d]", k, s->E), 1;
    size_t n = (size_t)T * k;
    const unsigned char *ids = b + s->ids_off;
    for (size_t i = 0; i < n; i++) {
        int64_t id;
        if (c[1] == CODE_I32) {
            int32_t v;
            memcpy(&v, ids + 4 * i, 4);
            id = v;
        } else {
            memcpy(&id, ids + 8 * i, 8);
        }
        if (id < 0 || id >= s->E)
            return snprintf(text, cap, "topk_ids: expert id %" PRId64 " outside [0, %d)", id, s->E), 1;
        s->ids[i] = id;
    }
    if (!get_floats(s->x, b + s->hidden_off, c[0], (size_t)T * s->H))
        return snprintf(text, cap, "hidden contains NaN or Inf"), 1;
    if (!get_floats(s->w, b + s->w_off, c[2], n))
        return snprintf(text, cap, "topk_weights contain NaN or Inf"), 1;
    return 0;
}

int moe_shm_kernels(MoeShm *s, int layer, int T, int k, char *err, size_t cap) {
    if (!s->experts[layer] || T == 0) return 0; /* no experts of that layer here: zeros (Engine.forward) */
    if (s->hid[layer] != s->H)
        return snprintf(err, cap, "ValueError: layer %d: x has hidden size %d, the experts have %d", layer, s->H,
                        s->hid[layer]), -1;
    for (size_t i = 0; i < (size_t)T * k; i++) /* weight 0: computed on the GPU side (KernelExperts.forward) */
        s->kids[i] = s->w[i] == 0.0f ? -1 : s->ids[i];
    int rc = moe_forward(s->pool, s->kern, s->experts[layer], s->cap[layer], s->fmt, s->H, s->inter[layer], s->x, T,
                         s->kids, s->w, k, s->out);
    if (rc != 0) return snprintf(err, cap, "MemoryError: moe_forward failed (%d)", rc), -1;
    return 0;
}

uint32_t moe_shm_answer(MoeShm *s, const unsigned char *b, int32_t layer, uint32_t T, uint32_t k, const uint32_t *c,
                        unsigned char *out, uint64_t seq, int64_t arrived, uint64_t *compute_us, uint32_t *mlen) {
    uint32_t status = 0; /* gRPC status codes: 0 OK, 3 INVALID_ARGUMENT, 13 INTERNAL */
    char text[SHM_MSG_MAX + 1];
    *compute_us = 0, *mlen = 0;
    if (check(s, b, layer, T, k, c, text, sizeof text)) {
        status = 3;
    } else {
        memset(s->out, 0, (size_t)T * s->H * 4);
        int64_t t0 = shm_now_ns();
        int rc = s->compute(s, layer, (int)T, (int)k, text, sizeof text);
        int64_t t1 = shm_now_ns();
        if (rc != 0) {
            status = 13;
            record(s, layer, (int)T, t0 - arrived, -1); /* the queue wait only, as MeteredBackend */
        } else {
            *compute_us = (uint64_t)((t1 - t0) / 1000);
            count(s, layer, T, k);
            put_floats(out, c[3], s->out, (size_t)T * s->H);
            record(s, layer, (int)T, t0 - arrived, t1 - t0);
        }
    }
    if (status) { /* "shard S: seq N: ..." (the gRPC servicer's form), cut to SHM_MSG_MAX */
        int n = snprintf(s->msg, sizeof s->msg, "shard %s: seq %" PRIu64 ": %s", s->shard_id, seq, text);
        *mlen = n < 0 ? 0 : (uint32_t)n < SHM_MSG_MAX ? (uint32_t)n : SHM_MSG_MAX;
    }
    return status;
}

/* one call, answered: 0, or 1 when its compute failed (INTERNAL; s->msg says why) */
static int serve_one(MoeShm *s, uint32_t slot, uint64_t seq, int64_t arrived) {
    unsigned char *b = s->base + s->header_bytes + (long)slot * s->slot_bytes;
    int32_t layer;
    uint32_t h[6]; /* T, k, hidden / ids / weights / output dtype codes (wire.shm.CALL) */
    memcpy(&layer, b, 4);
    memcpy(h, b + 4, sizeof h);
    uint64_t compute_us;
    uint32_t mlen, status = moe_shm_answer(s, b, layer, h[0], h[1], h + 2, b + s->out_off, seq, arrived, &compute_us,
                                           &mlen);
    if (status) memcpy(b + SHM_MSG_OFFSET, s->msg, mlen);
    uint64_t server_us = (uint64_t)((shm_now_ns() - arrived) / 1000);
    memcpy(b + SHM_RESULT_OFFSET, &compute_us, 8);
    memcpy(b + SHM_RESULT_OFFSET + 8, &server_us, 8);
    memcpy(b + SHM_RESULT_OFFSET + 16, &mlen, 4);
    unsigned char msg[SHM_DOORBELL_BYTES];
    memcpy(msg, &status, 4), memcpy(msg + 4, &slot, 4), memcpy(msg + 8, &seq, 8);
    while (send(s->fd, msg, sizeof msg, MSG_NOSIGNAL) < 0 && errno == EINTR) {
    }
    return status == 13; /* a failed send shows as EOF at the next receive */
}

int moe_shm_serve(MoeShm *s) {
    unsigned char msg[SHM_DOORBELL_BYTES];
    for (;;) {
        if (recv_doorbell(s, msg) <= 0) return MOE_SHM_CLOSED;
        int64_t arrived = shm_now_ns();
        uint32_t op, slot;
        uint64_t seq;
        memcpy(&op, msg, 4), memcpy(&slot, msg + 4, 4), memcpy(&seq, msg + 8, 8);
        s->slot = slot, s->seq = seq;
        if (op != SHM_OP_FORWARD || slot >= (uint32_t)s->n_slots) return MOE_SHM_BAD_DOORBELL;
        if (serve_one(s, slot, seq, arrived)) return MOE_SHM_INTERNAL;
    }
}
