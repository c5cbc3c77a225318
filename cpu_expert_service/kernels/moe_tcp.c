/* moe_tcp.c: the TCP data path's shard loop (moe_shm.h: moe_tcp_serve; wire/tcp.py has the frames).
 *
 * One connection, without the GIL: a frame's first bytes (bounded spin, then wait: the connection
 * may idle between frames), the rest of its header and its payload under one deadline, the call
 * validated and computed by moe_shm_answer (the shared-memory loop's own path, so both answer alike),
 * the answer sent under a deadline as long (plaintext: one sendmsg). The bytes move through
 * wire/tcp_io.h: plaintext or mutual TLS, the same frames either way. */
#define _GNU_SOURCE
#include "moe_shm.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>

enum { REQ_BYTES = 28, RESP_BYTES = 36 }; /* wire.tcp.REQUEST "<QiIIII", RESPONSE "<QIQQII" */
enum { CODE_F32 = 0, CODE_F16 = 2, CODE_I64 = 4 };

/* a frame's first bytes (its whole header when it is there: one recv), at most n: polled for spin_s, then
 * waited for without a deadline (the connection may idle between frames). How many came, or 0 at EOF /
 * an error */
static long recv_first(const MoeShm *s, TcpIo *io, unsigned char *p, size_t n) {
    int64_t end = s->spin_s > 0 ? shm_now_ns() + (int64_t)(s->spin_s * 1e9) : 0;
    for (;;) {
        short want = POLLIN;
        long got = tio_recv_some(io, p, n, &want);
        if (got > 0) return got;
        if (got != TIO_AGAIN) return 0;
        if (end && want == POLLIN && shm_now_ns() < end) {
            sched_yield();
            continue;
        }
        int w = tio_wait(io, want, TIO_FOREVER);
        if (w != TIO_OK && w != TIO_INTR) return 0;
    }
}

/* one answer frame by deadline_ns: 0, or -1 (the client stopped reading or went) */
static int respond(MoeShm *s, TcpIo *io, int64_t deadline_ns, uint64_t seq, uint32_t status, uint64_t compute_us,
                   int64_t arrived, uint32_t T, const void *body, size_t len) {
    unsigned char h[RESP_BYTES];
    uint64_t server_us = (uint64_t)((shm_now_ns() - arrived) / 1000);
    uint32_t mlen = status ? (uint32_t)len : 0;
    memcpy(h, &seq, 8), memcpy(h + 8, &status, 4), memcpy(h + 12, &compute_us, 8), memcpy(h + 20, &server_us, 8);
    memcpy(h + 28, &mlen, 4), memcpy(h + 32, &T, 4);
    struct iovec iov[2] = {{h, RESP_BYTES}, {(void *)body, len}};
    return tio_send_all(io, iov, len ? 2 : 1, deadline_ns) == TIO_OK ? 0 : -1;
}

int moe_tcp_serve(MoeShm *s, TcpIo *io, unsigned char *req, size_t req_cap, unsigned char *out, int K,
                  double frame_timeout_s) {
    unsigned char h[REQ_BYTES];
    for (;;) {
        long got = recv_first(s, io, h, REQ_BYTES);
        if (!got) return MOE_SHM_CLOSED;
        int64_t deadline = shm_now_ns() + (int64_t)(frame_timeout_s * 1e9);
        int r = tio_recv_all(io, h + got, REQ_BYTES - (size_t)got, deadline, 0);
        if (r != TIO_OK) return r == TIO_TIMEOUT ? MOE_TCP_STALLED : MOE_SHM_CLOSED;
        int64_t arrived = shm_now_ns();
        uint64_t seq;
        int32_t layer;
        uint32_t T, k, hc, oc;
        memcpy(&seq, h, 8), memcpy(&layer, h + 8, 4), memcpy(&T, h + 12, 4), memcpy(&k, h + 16, 4);
        memcpy(&hc, h + 20, 4), memcpy(&oc, h + 24, 4);
        s->seq = seq, s->slot = 0;
        size_t hb = (size_t)T * s->H * (hc == CODE_F32 ? 4 : 2), n = hb + (size_t)T * k * 12;
        if (T > (uint32_t)s->shard_max_tokens || k < 1 || k > (uint32_t)K || hc > CODE_F16 || oc > CODE_F16
                || n > req_cap) { /* the payload's length cannot be trusted: answer, then close */
            int m = snprintf(s->msg, sizeof s->msg, "shard %s: seq %" PRIu64 ": bad frame header (T %" PRIu32
                             " of at most %d, k %" PRIu32 " of 1-%d, dtype codes %" PRIu32 "/%" PRIu32
                             "); closing the data connection", s->shard_id, seq, T, s->shard_max_tokens, k, K, hc, oc);
            size_t len = m < 0 ? 0 : (size_t)m < SHM_MSG_MAX ? (size_t)m : SHM_MSG_MAX;
            respond(s, io, shm_now_ns() + (int64_t)(frame_timeout_s * 1e9), seq, 3, 0, arrived, T, s->msg, len);
            return MOE_TCP_BAD_FRAME;
        }
        r = tio_recv_all(io, req, n, deadline, 0); /* the pages of req are committed as these bytes land */
        if (r != TIO_OK) return r == TIO_TIMEOUT ? MOE_TCP_STALLED : MOE_SHM_CLOSED;
        s->hidden_off = 0, s->ids_off = (long)hb, s->w_off = (long)(hb + (size_t)T * k * 8);
        uint32_t c[4] = {hc, CODE_I64, CODE_F32, oc};
        uint64_t compute_us;
        uint32_t mlen, status = moe_shm_answer(s, req, layer, T, k, c, out, seq, arrived, &compute_us, &mlen);
        const void *body = status ? (const void *)s->msg : (const void *)out;
        size_t len = status ? mlen : (size_t)T * s->H * (oc == CODE_F32 ? 4 : 2);
        /* the answer under a deadline of its own: a client that stopped reading is given up */
        if (respond(s, io, shm_now_ns() + (int64_t)(frame_timeout_s * 1e9), seq, status, compute_us, arrived, T, body,
                    len))
            return MOE_SHM_CLOSED;
        if (status == 13) return MOE_SHM_INTERNAL;
    }
}
