/* moe_tcp.c: the TCP data path's shard loop (moe_shm.h: moe_tcp_serve; wire/tcp.py has the frames).
 *
 * One connection, without the GIL: a frame's first byte (bounded spin, then block: the connection
 * may idle between frames), the rest of its header and its payload under one deadline, the call
 * validated and computed by moe_shm_answer (the shared-memory loop's own path, so both answer alike),
 * the answer sent as one sendmsg. */
#define _GNU_SOURCE
#include "moe_shm.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

enum { REQ_BYTES = 28, RESP_BYTES = 36 }; /* wire.tcp.REQUEST "<QiIIII", RESPONSE "<QIQQII" */
enum { CODE_F32 = 0, CODE_F16 = 2, CODE_I64 = 4 };

/* readable before deadline_ns: 1, 0 past it, -1 on an error */
static int wait_readable(int fd, int64_t deadline_ns) {
    for (;;) {
        int64_t left = deadline_ns - shm_now_ns();
        if (left <= 0) return 0;
        struct pollfd p = {fd, POLLIN, 0};
        int r = poll(&p, 1, (int)((left + 999999) / 1000000));
        if (r > 0) return 1;
        if (r < 0 && errno != EINTR) return -1;
    }
}

/* n bytes into p before deadline_ns: 1, 0 at EOF, -1 on an error, -2 past the deadline */
static int recv_all(int fd, unsigned char *p, size_t n, int64_t deadline_ns) {
    while (n) {
        int w = wait_readable(fd, deadline_ns);
        if (w <= 0) return w == 0 ? -2 : -1;
        ssize_t r = recv(fd, p, n, MSG_DONTWAIT);
        if (r == 0) return 0;
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
            return -1;
        }
        p += r, n -= (size_t)r;
    }
    return 1;
}

/* a frame's first byte: polled for spin_s, then blocking. 1, or 0 at EOF / an error */
static int recv_first(const MoeShm *s, unsigned char *p) {
    int64_t end = s->spin_s > 0 ? shm_now_ns() + (int64_t)(s->spin_s * 1e9) : 0;
    for (;;) {
        int spinning = end && shm_now_ns() < end;
        ssize_t n = recv(s->fd, p, 1, spinning ? MSG_DONTWAIT : 0);
        if (n == 1) return 1;
        if (n == 0) return 0;
        if (errno == EINTR) continue;
        if (spinning && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            sched_yield();
            continue;
        }
        return 0;
    }
}

/* every byte of the iovecs (a short write goes on where it stopped): 0, or -1 */
static int send_all(int fd, struct iovec *iov, int n) {
    while (n > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov, m.msg_iovlen = (size_t)n;
        ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        while (n > 0 && (size_t)w >= iov->iov_len) w -= (ssize_t)iov->iov_len, iov++, n--;
        if (n > 0) iov->iov_base = (char *)iov->iov_base + w, iov->iov_len -= (size_t)w;
    }
    return 0;
}

static int respond(MoeShm *s, uint64_t seq, uint32_t status, uint64_t compute_us, int64_t arrived, uint32_t T,
                   const void *body, size_t len) {
    unsigned char h[RESP_BYTES];
    uint64_t server_us = (uint64_t)((shm_now_ns() - arrived) / 1000);
    uint32_t mlen = status ? (uint32_t)len : 0;
    memcpy(h, &seq, 8), memcpy(h + 8, &status, 4), memcpy(h + 12, &compute_us, 8), memcpy(h + 20, &server_us, 8);
    memcpy(h + 28, &mlen, 4), memcpy(h + 32, &T, 4);
    struct iovec iov[2] = {{h, RESP_BYTES}, {(void *)body, len}};
    return send_all(s->fd, iov, len ? 2 : 1);
}

int moe_tcp_serve(MoeShm *s, unsigned char *req, size_t req_cap, unsigned char *out, int K, double frame_timeout_s) {
    unsigned char h[REQ_BYTES];
    for (;;) {
        if (!recv_first(s, h)) return MOE_SHM_CLOSED;
        int64_t deadline = shm_now_ns() + (int64_t)(frame_timeout_s * 1e9);
        int r = recv_all(s->fd, h + 1, REQ_BYTES - 1, deadline);
        if (r <= 0) return r == -2 ? MOE_TCP_STALLED : MOE_SHM_CLOSED;
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
            respond(s, seq, 3, 0, arrived, T, s->msg, len);
            return MOE_TCP_BAD_FRAME;
        }
        r = recv_all(s->fd, req, n, deadline); /* the pages of req are committed as these bytes land */
        if (r <= 0) return r == -2 ? MOE_TCP_STALLED : MOE_SHM_CLOSED;
        s->hidden_off = 0, s->ids_off = (long)hb, s->w_off = (long)(hb + (size_t)T * k * 8);
        uint32_t c[4] = {hc, CODE_I64, CODE_F32, oc};
        uint64_t compute_us;
        uint32_t mlen, status = moe_shm_answer(s, req, layer, T, k, c, out, seq, arrived, &compute_us, &mlen);
        const void *body = status ? (const void *)s->msg : (const void *)out;
        size_t len = status ? mlen : (size_t)T * s->H * (oc == CODE_F32 ? 4 : 2);
        if (respond(s, seq, status, compute_us, arrived, T, body, len)) return MOE_SHM_CLOSED;
        if (status == 13) return MOE_SHM_INTERNAL;
    }
}
