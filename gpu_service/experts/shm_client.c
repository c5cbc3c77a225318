/* shm_client.c: see shm_client.h. */
#define _GNU_SOURCE
#include "shm_client.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>

int sc_has_f16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

/* ---- wire dtypes: the numpy / ml_dtypes casts (round to nearest even) */
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 31) ? 0xffc0 : 0x7fc0;  /* a quiet NaN, as ml_dtypes */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

void sc_put_rows(void *dst, int wire, const float *x, size_t n) {
    if (wire == 0) {
        memcpy(dst, x, n * 4);
    } else if (wire == 1) {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = f32_to_bf16(x[i]);
    } else {
#ifdef __FLT16_MAX__
        _Float16 *d = dst;
        for (size_t i = 0; i < n; i++) d[i] = (_Float16)x[i];
#endif
    }
}

/* y = the n wire values as float32, or y += them (add) */
void sc_get_rows(float *y, const void *src, int wire, size_t n, int add) {
    if (wire == 0) {
        const float *s = src;
        if (!add) memcpy(y, src, n * 4);
        else for (size_t i = 0; i < n; i++) y[i] += s[i];
    } else if (wire == 1) {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++) {
            uint32_t u = (uint32_t)s[i] << 16;
            float f;
            memcpy(&f, &u, 4);
            y[i] = add ? y[i] + f : f;
        }
    } else {
#ifdef __FLT16_MAX__
        const _Float16 *s = src;
        for (size_t i = 0; i < n; i++) y[i] = add ? y[i] + (float)s[i] : (float)s[i];
#endif
    }
}

static unsigned char *slot_at(const ShmClient *c, int slot) {
    return c->base + c->header_bytes + (long)slot * c->slot_bytes;
}

int sc_send(ShmClient *c, int slot, uint64_t seq, int32_t layer, const void *h, int h_wire,
            const int64_t *ids, const float *w, int T, int k, int timeout_ms) {
    if (slot < 0 || slot >= c->n_slots || T < 0 || T > c->max_tokens || k < 0 || k > c->max_k) return SC_BAD;
    unsigned char *s = slot_at(c, slot);
    size_t n = (size_t)T * c->H, es = c->wire == 0 ? 4 : 2;
    if (h_wire)
        memcpy(s + c->hidden_off, h, n * es);
    else
        sc_put_rows(s + c->hidden_off, c->wire, h, n);
    memcpy(s + c->ids_off, ids, (size_t)T * k * 8);
    memcpy(s + c->w_off, w, (size_t)T * k * 4);
    /* the call header (wire.shm.CALL "<iIIIIIIQQI"): layer, T, k, dtype codes hidden / ids /
     * weights / output, then compute_us, server_us, msg_len (the result, zeroed) */
    uint32_t hdr[6] = {(uint32_t)T, (uint32_t)k, (uint32_t)c->wire, 4u, 0u, (uint32_t)c->wire};
    memcpy(s, &layer, 4);
    memcpy(s + 4, hdr, sizeof hdr);
    memset(s + SHM_RESULT_OFFSET, 0, 20);
    unsigned char msg[SHM_DOORBELL_BYTES];
    uint32_t op = SHM_OP_FORWARD, sl = (uint32_t)slot;
    memcpy(msg, &op, 4), memcpy(msg + 4, &sl, 4), memcpy(msg + 8, &seq, 8);
    for (;;) {
        ssize_t r = send(c->fd, msg, sizeof msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (r == (ssize_t)sizeof msg) break;
        if (r >= 0) return SC_CLOSED;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            c->err = errno;
            return errno == EPIPE || errno == ECONNRESET ? SC_CLOSED : SC_FAILED;
        }
        struct pollfd pf = {c->fd, POLLOUT, 0};
        int rc = poll(&pf, 1, timeout_ms);
        if (rc == 0) return SC_FULL;
        if (rc < 0 && errno != EINTR) {
            c->err = errno;
            return SC_FAILED;
        }
    }
    c->sent++;
    return SC_OK;
}

int sc_wait(ShmClient *c, int64_t spin_end_ns, int64_t deadline_ns, ShmAnswer *a) {
    unsigned char msg[SHM_DOORBELL_BYTES];
    for (;;) {
        ssize_t n = recv(c->fd, msg, sizeof msg, MSG_DONTWAIT);
        if (n == (ssize_t)sizeof msg) {
            memcpy(&a->status, msg, 4), memcpy(&a->slot, msg + 4, 4), memcpy(&a->seq, msg + 8, 8);
            if (a->slot >= (uint32_t)c->n_slots) return SC_BAD;
            c->answered++;
            return SC_OK;
        }
        if (n >= 0) return SC_CLOSED;  /* EOF (0) or a short message */
        if (errno == EINTR) return SC_INTR;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            c->err = errno;
            return errno == ECONNRESET ? SC_CLOSED : SC_FAILED;
        }
        int64_t t = shm_now_ns();
        if (t < spin_end_ns) {
            sched_yield();
            continue;
        }
        if (t >= deadline_ns) return SC_NONE;
        struct pollfd pf = {c->fd, POLLIN, 0};
        int64_t ms = (deadline_ns - t + 999999) / 1000000;
        if (poll(&pf, 1, ms > 1000000 ? 1000000 : (int)ms) < 0) {
            if (errno == EINTR) return SC_INTR;
            c->err = errno;
            return SC_FAILED;
        }
    }
}

void sc_read(const ShmClient *c, int slot, int T, float *out) {
    sc_get_rows(out, slot_at(c, slot) + c->out_off, c->wire, (size_t)T * c->H, 0);
}

int sc_finish(ShmClient *c, uint64_t seq, int slot, int T, void *out, int mode, int64_t spin_end_ns,
              int64_t deadline_ns, ShmAnswer *a) {
    int rc = sc_wait(c, spin_end_ns, deadline_ns, a);
    if (rc != SC_OK) return rc;
    if (a->seq != seq || a->slot != (uint32_t)slot || a->status != 0 || T < 0 || T > c->max_tokens) return SC_OTHER;
    const unsigned char *src = slot_at(c, slot) + c->out_off;
    size_t n = (size_t)T * c->H;
    if (mode == SC_OUT_WIRE)
        memcpy(out, src, n * (c->wire == 0 ? 4 : 2));
    else /* as float32: written (SC_OUT_F32) or added into out (SC_OUT_ADD_F32, in the order of the caller's calls) */
        sc_get_rows(out, src, c->wire, n, mode == SC_OUT_ADD_F32);
    return SC_OK;
}
