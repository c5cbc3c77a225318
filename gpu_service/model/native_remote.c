/* native_remote.c: see native_remote.h. */
#define _GNU_SOURCE
#include "native_remote.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#define NR_MAX_PATHS 64

typedef NrMb Mb;

static size_t al64(size_t n) { return (n + 63) & ~(size_t)63; }

size_t nr_buf_bytes(int B, int H, int k) {
    return 4 * al64((size_t)B * H * 4) + al64((size_t)B * k * 4) + al64((size_t)B * k * 8) + al64((size_t)B * 4);
}

static void mb_init(Mb *m, const NrRun *r, int mb) {
    int B = r->steps[mb]->B, H = r->H, k = r->k;
    unsigned char *p = r->buf[mb];
    m->next = 0, m->pending = -1, m->B = B, m->call0 = m->ncall = 0, m->h_wire = 0, m->hsrc = NULL;
    m->x1 = (float *)p, p += al64((size_t)B * H * 4);
    m->h = (float *)p, p += al64((size_t)B * H * 4);
    m->sh = (float *)p, p += al64((size_t)B * H * 4);
    m->routed = (float *)p, p += al64((size_t)B * H * 4);
    m->w = (float *)p, p += al64((size_t)B * k * 4);
    m->ids = (int64_t *)p, p += al64((size_t)B * k * 8);
    m->rows = (int *)p;
}

/* ---- wire dtypes (the torch / ml_dtypes casts: round to nearest even) */
static uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

int nr_has_f16(void) {
#ifdef __FLT16_MAX__
    return 1;
#else
    return 0;
#endif
}

static size_t wire_size(int wire) { return wire == 0 ? 4 : 2; }

static void put_row(void *dst, int wire, const float *x, int n) {
    if (wire == 0) {
        memcpy(dst, x, (size_t)n * 4);
    } else if (wire == 1) {
        uint16_t *d = dst;
        for (int i = 0; i < n; i++) d[i] = f32_to_bf16(x[i]);
    } else {
#ifdef __FLT16_MAX__
        _Float16 *d = dst;
        for (int i = 0; i < n; i++) d[i] = (_Float16)x[i];
#endif
    }
}

static void get_row(float *y, const void *src, int wire, int n, int add) {
    for (int i = 0; i < n; i++) {
        float v;
        if (wire == 0) {
            memcpy(&v, (const char *)src + 4 * (size_t)i, 4);
        } else if (wire == 1) {
            uint16_t h;
            memcpy(&h, (const char *)src + 2 * (size_t)i, 2);
            v = bf16_to_f32(h);
        } else {
#ifdef __FLT16_MAX__
            _Float16 h;
            memcpy(&h, (const char *)src + 2 * (size_t)i, 2);
            v = (float)h;
#else
            v = 0.0f;
#endif
        }
        y[i] = add ? y[i] + v : v;
    }
}

/* the rows of a micro-batch that route to an expert path P holds (all rows without a mask) */
static int route_rows(const NrPath *P, const int64_t *ids, int B, int k, int *rows) {
    int n = 0;
    for (int b = 0; b < B; b++) {
        int hit = P->held == NULL;
        for (int j = 0; j < k && !hit; j++) hit = P->held[ids[(long)b * k + j]] != 0;
        if (hit) rows[n++] = b;
    }
    return n;
}

static int fail(NrRun *r, int code, int path, const char *what) {
    r->fail_path = path;
    snprintf(r->fail_msg, sizeof r->fail_msg, "%s", what);
    return code;
}

static int fail_errno(NrRun *r, int path, const char *what) {
    char msg[128];
    snprintf(msg, sizeof msg, "%s: %s", what, strerror(errno));
    return fail(r, NR_BROKEN, path, msg);
}

/* ---- one layer's calls of one micro-batch */
static int send_layer(NrRun *r, Mb *m, int mb, int32_t layer) {
    int B = m->B, H = r->H, k = r->k;
    m->call0 = r->n_calls, m->ncall = 0;
    for (int p = 0; p < r->n_paths; p++) {
        NrPath *P = &r->paths[p];
        int n = route_rows(P, m->ids, B, k, m->rows);
        if (n == 0) continue;
        if (r->n_calls >= r->calls_cap) return fail(r, NR_BROKEN, p, "more expert calls in one step than planned");
        unsigned char *s = P->base + P->slot_base[mb];
        size_t es = wire_size(P->wire);
        for (int i = 0; i < n; i++) {
            int b = m->rows[i];
            if (m->h_wire)
                memcpy(s + P->hidden_off + (size_t)i * H * es, (const char *)m->hsrc + (size_t)b * H * es, H * es);
            else
                put_row(s + P->hidden_off + (size_t)i * H * es, P->wire, m->h + (long)b * H, H);
            memcpy(s + P->ids_off + (size_t)i * k * 8, m->ids + (long)b * k, (size_t)k * 8);
            memcpy(s + P->w_off + (size_t)i * k * 4, m->w + (long)b * k, (size_t)k * 4);
        }
        /* the call header (wire.shm.CALL "<iIIIIIIQQI"): layer, T, k, dtype codes hidden / ids / weights /
         * output, compute_us, server_us, msg_len */
        uint32_t hdr[6] = {(uint32_t)n, (uint32_t)k, (uint32_t)P->wire, 4u, 0u, (uint32_t)P->wire};
        memcpy(s, &layer, 4);
        memcpy(s + 4, hdr, sizeof hdr);
        memset(s + SHM_RESULT_OFFSET, 0, 20);
        NrCall *c = &r->calls[r->n_calls];
        c->layer = layer, c->path = p, c->mb = mb, c->rows = n, c->status = -1, c->slot = P->slot[mb];
        c->seq = r->seq0 + (uint64_t)r->n_calls, c->rtt_ns = 0, c->compute_us = c->server_us = 0;
        unsigned char msg[SHM_DOORBELL_BYTES];
        uint32_t op = SHM_OP_FORWARD, slot = (uint32_t)P->slot[mb];
        memcpy(msg, &op, 4), memcpy(msg + 4, &slot, 4), memcpy(msg + 8, &c->seq, 8);
        c->sent_ns = shm_now_ns();
        for (;;) {
            ssize_t w = send(P->fd, msg, sizeof msg, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w == (ssize_t)sizeof msg) break;
            if (w >= 0) return fail(r, NR_BROKEN, p, "doorbell send: short write");
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) return fail_errno(r, p, "doorbell send failed");
            struct pollfd pf = {P->fd, POLLOUT, 0};
            int rc = poll(&pf, 1, (int)(r->timeout_s * 1000) + 1);
            if (rc == 0) return fail(r, NR_TIMEOUT, p, "doorbell send: the socket stayed full");
            if (rc < 0 && errno == EINTR) return fail(r, NR_INTR, -1, "interrupted");
        }
        r->n_calls++, m->ncall++;
    }
    return NR_OK;
}

/* one doorbell answer from path p if one is waiting: 1 received, 0 none, < 0 -(failure code) */
static int recv_one(NrRun *r, int p) {
    NrPath *P = &r->paths[p];
    unsigned char msg[SHM_DOORBELL_BYTES];
    ssize_t n = recv(P->fd, msg, sizeof msg, MSG_DONTWAIT);
    if (n < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
        return -fail_errno(r, p, "doorbell failed");
    }
    if (n != (ssize_t)sizeof msg) return -fail(r, NR_BROKEN, p, "the shard closed the fast path");
    uint32_t status, slot;
    uint64_t seq;
    memcpy(&status, msg, 4), memcpy(&slot, msg + 4, 4), memcpy(&seq, msg + 8, 8);
    uint64_t i = seq - r->seq0;
    if (seq < r->seq0 || i >= (uint64_t)r->n_calls) return 1;  /* not ours (as the Python path: ignored) */
    NrCall *c = &r->calls[i];
    if (c->path != p || c->status != -1 || (int)slot != c->slot) return 1;
    c->rtt_ns = shm_now_ns() - c->sent_ns;
    const unsigned char *s = P->base + P->slot_base[c->mb];
    uint32_t mlen;
    memcpy(&c->compute_us, s + SHM_RESULT_OFFSET, 8);
    memcpy(&c->server_us, s + SHM_RESULT_OFFSET + 8, 8);
    memcpy(&mlen, s + SHM_RESULT_OFFSET + 16, 4);
    c->status = (int32_t)status;
    if (status != 0) {
        if (mlen > SHM_MSG_MAX) mlen = SHM_MSG_MAX;
        memcpy(r->fail_msg, s + SHM_MSG_OFFSET, mlen);
        r->fail_msg[mlen] = 0;
        r->fail_path = p;
        return -NR_REFUSED;
    }
    return 1;
}

static int wait_layer(NrRun *r, Mb *m) {
    struct pollfd pf[NR_MAX_PATHS];
    int64_t spin_end = shm_now_ns() + (int64_t)(r->spin_s * 1e9);
    for (;;) {
        int out = 0, got = 0, first = -1;
        int64_t deadline = INT64_MAX;
        for (int i = m->call0; i < m->call0 + m->ncall; i++) {
            NrCall *c = &r->calls[i];
            if (c->status != -1) continue;
            int rc = recv_one(r, c->path);
            if (rc < 0) return -rc;
            got |= rc;
            if (c->status != -1) continue;
            if (first < 0) first = c->path;
            int64_t d = c->sent_ns + (int64_t)(r->timeout_s * 1e9);
            if (d < deadline) deadline = d;
            pf[out].fd = r->paths[c->path].fd, pf[out].events = POLLIN, pf[out].revents = 0;
            out++;
        }
        if (!out) return NR_OK;
        if (got) continue;
        int64_t t = shm_now_ns();
        if (t < spin_end) {
            sched_yield();
            continue;
        }
        if (t >= deadline) return fail(r, NR_TIMEOUT, first, "no answer within the deadline (shm)");
        int ms = (int)((deadline - t + 999999) / 1000000);
        if (poll(pf, (nfds_t)out, ms) < 0) {
            if (errno == EINTR) return fail(r, NR_INTR, -1, "interrupted");
            return fail_errno(r, first, "poll on the doorbells failed");
        }
    }
}

/* routed = the answers summed in path order, as ExpertsClient.forward_async sums them */
static void sum_layer(const NrRun *r, Mb *m) {
    int B = m->B, H = r->H, init = 0;
    for (int i = m->call0; i < m->call0 + m->ncall; i++) {
        const NrCall *c = &r->calls[i];
        const NrPath *P = &r->paths[c->path];
        const unsigned char *y = P->base + P->slot_base[c->mb] + P->out_off;
        size_t row = (size_t)H * wire_size(P->wire);
        int n = route_rows(P, m->ids, B, r->k, m->rows);
        if (!init && n == B) {  /* the first full answer is the sum so far */
            for (int b = 0; b < B; b++) get_row(m->routed + (long)b * H, y + b * row, P->wire, H, 0);
            init = 1;
            continue;
        }
        if (!init) {
            memset(m->routed, 0, (size_t)B * H * 4);
            init = 1;
        }
        for (int j = 0; j < n; j++) get_row(m->routed + (long)m->rows[j] * H, y + j * row, P->wire, H, 1);
    }
    if (!init) memset(m->routed, 0, (size_t)B * H * 4);
}

static int finish_layer(NrRun *r, Mb *m, int mb) {
    const NdLayer *L = r->layers[m->pending];
    const NdStep *S = r->steps[mb];
    if (L->w_gate) nd_mlp(L, m->B, m->h, m->sh, S->scratch);  /* the shared expert, while the shards work */
    int rc = wait_layer(r, m);
    if (rc != NR_OK) return rc;
    sum_layer(r, m);
    nd_add((long)m->B * r->H, m->x1, m->routed, L->w_gate ? m->sh : NULL, r->x[mb]);
    m->pending = -1;
    return NR_OK;
}

/* run micro-batch mb up to its next expert hand-off (deepseek.Block.steps' yield), or to its end */
static int advance(NrRun *r, Mb *m, int mb, int *done) {
    const NdStep *S = r->steps[mb];
    if (m->pending >= 0) {
        int rc = finish_layer(r, m, mb);
        if (rc != NR_OK) return rc;
    }
    while (m->next < r->n_layers) {
        int li = m->next++;
        const NdLayer *L = r->layers[li];
        float *x = r->x[mb];
        if (r->moe_layer[li] < 0) {  /* dense layer */
            nd_attn(L, S, r->kv[li], r->ik[li], x, m->x1, m->h, NULL, NULL);
            nd_mlp(L, m->B, m->h, m->sh, S->scratch);
            nd_add((long)m->B * r->H, m->x1, m->sh, NULL, x);
            continue;
        }
        nd_attn(L, S, r->kv[li], r->ik[li], x, m->x1, m->h, m->ids, m->w);
        int rc = send_layer(r, m, mb, r->moe_layer[li]);
        if (rc != NR_OK) return rc;
        m->pending = li;
        return NR_OK;
    }
    *done = 1;
    return NR_OK;
}

int nr_send(NrRun *r, int mb, int layer, const void *h, int h_wire, int64_t *ids, float *w, int B, int *rows) {
    if (mb < 0 || mb > 1 || r->n_paths > NR_MAX_PATHS) return fail(r, NR_BROKEN, -1, "bad call description");
    Mb *m = &r->mb[mb];
    m->B = B, m->h_wire = h_wire, m->hsrc = h, m->h = (float *)h, m->ids = ids, m->w = w, m->rows = rows;
    m->pending = 0;
    return send_layer(r, m, mb, layer);
}

int nr_wait(NrRun *r, int mb, float *routed) {
    if (mb < 0 || mb > 1) return fail(r, NR_BROKEN, -1, "bad call description");
    Mb *m = &r->mb[mb];
    int rc = wait_layer(r, m);
    if (rc != NR_OK) return rc;
    m->routed = routed;
    sum_layer(r, m);
    m->pending = -1;
    return NR_OK;
}

int nr_run(NrRun *r) {
    Mb *mbs = r->mb;
    int active[2] = {1, r->n_mb > 1};
    r->fail_path = -1, r->fail_msg[0] = 0;
    if (r->n_paths > NR_MAX_PATHS || r->n_mb < 1 || r->n_mb > 2) return fail(r, NR_BROKEN, -1, "bad step description");
    for (int mb = 0; mb < r->n_mb; mb++) mb_init(&mbs[mb], r, mb);
    while (active[0] || active[1]) {
        for (int mb = 0; mb < r->n_mb; mb++) {
            if (!active[mb]) continue;
            int done = 0, rc = advance(r, &mbs[mb], mb, &done);
            if (rc != NR_OK) return rc;
            if (done) active[mb] = 0;
        }
    }
    return NR_OK;
}
