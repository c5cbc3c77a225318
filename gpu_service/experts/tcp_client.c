/* tcp_client.c: see tcp_client.h. */
#define _GNU_SOURCE
#include "tcp_client.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* poll fd for `events` until deadline_ns: 1 ready, 0 past the deadline, SC_INTR, -1 an error (c->err) */
static int wait_fd(TcpClient *c, short events, int64_t deadline_ns) {
    int64_t left = deadline_ns - shm_now_ns();
    if (left <= 0) return 0;
    struct pollfd p = {c->fd, events, 0};
    int64_t ms = (left + 999999) / 1000000;
    int r = poll(&p, 1, ms > 1000000 ? 1000000 : (int)ms);
    if (r > 0) return 1;
    if (r == 0) return shm_now_ns() >= deadline_ns ? 0 : 1; /* (woken early: try again) */
    if (errno == EINTR) return -SC_INTR;
    c->err = errno;
    return -1;
}

int tc_send(TcpClient *c, uint64_t seq, int32_t layer, const void *h, int h_wire, const int64_t *ids, const float *w,
            int T, int k, int timeout_ms) {
    if (T < 0 || T > c->max_tokens || k < 0) return SC_BAD;
    size_t n = (size_t)T * c->H, es = c->wire == 0 ? 4 : 2;
    if (!h_wire && c->wire != 0) { /* float32 rows cast here, as numpy casts them */
        sc_put_rows(c->cast, c->wire, h, n);
        h = c->cast;
    }
    unsigned char hdr[TC_REQUEST_BYTES];
    uint32_t v[5] = {(uint32_t)layer, (uint32_t)T, (uint32_t)k, (uint32_t)c->wire, (uint32_t)c->wire};
    memcpy(hdr, &seq, 8), memcpy(hdr + 8, v, sizeof v);
    struct iovec iov[4] = {{hdr, sizeof hdr}, {(void *)h, n * es}, {(void *)ids, (size_t)T * k * 8},
                           {(void *)w, (size_t)T * k * 4}};
    struct iovec *p = iov;
    int left = 4;
    int64_t end = shm_now_ns() + (int64_t)timeout_ms * 1000000;
    while (left > 0) {
        struct msghdr m = {0};
        m.msg_iov = p, m.msg_iovlen = (size_t)left;
        ssize_t sent = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (sent < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                c->err = errno;
                return errno == EPIPE || errno == ECONNRESET ? SC_CLOSED : SC_FAILED;
            }
            int r = wait_fd(c, POLLOUT, end);
            if (r == 0) return SC_FULL;
            if (r == -1) return SC_FAILED;
            continue;
        }
        while (left > 0 && (size_t)sent >= p->iov_len) sent -= (ssize_t)p->iov_len, p++, left--;
        if (left > 0) p->iov_base = (char *)p->iov_base + sent, p->iov_len -= (size_t)sent;
    }
    c->sent++;
    return SC_OK;
}

/* n bytes into dst by frame_end_ns: SC_OK, SC_CLOSED, SC_FAILED, TC_STALLED */
static int recv_rest(TcpClient *c, unsigned char *dst, size_t n, int64_t frame_end_ns) {
    while (n) {
        ssize_t r = recv(c->fd, dst, n, MSG_DONTWAIT);
        if (r > 0) {
            dst += r, n -= (size_t)r;
            continue;
        }
        if (r == 0) return SC_CLOSED;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            c->err = errno;
            return errno == ECONNRESET ? SC_CLOSED : SC_FAILED;
        }
        int w = wait_fd(c, POLLIN, frame_end_ns);
        if (w == 0) return TC_STALLED;
        if (w == -1) return SC_FAILED; /* (-SC_INTR: the frame goes on; its handler runs later) */
    }
    return SC_OK;
}

int tc_wait(TcpClient *c, int64_t spin_end_ns, int64_t deadline_ns, int64_t frame_ns, TcpAnswer *a) {
    unsigned char h[TC_RESPONSE_BYTES];
    for (;;) { /* the first byte: spin, then poll to the deadline */
        ssize_t r = recv(c->fd, h, 1, MSG_DONTWAIT);
        if (r == 1) break;
        if (r == 0) return SC_CLOSED;
        if (errno == EINTR) return SC_INTR;
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
            c->err = errno;
            return errno == ECONNRESET ? SC_CLOSED : SC_FAILED;
        }
        if (shm_now_ns() < spin_end_ns) {
            sched_yield();
            continue;
        }
        int w = wait_fd(c, POLLIN, deadline_ns);
        if (w == 0) return SC_NONE;
        if (w == -SC_INTR) return SC_INTR;
        if (w == -1) return SC_FAILED;
    }
    int64_t frame_end = shm_now_ns() + frame_ns;
    int rc = recv_rest(c, h + 1, sizeof h - 1, frame_end);
    if (rc != SC_OK) return rc;
    memcpy(&a->seq, h, 8), memcpy(&a->status, h + 8, 4), memcpy(&a->compute_us, h + 12, 8);
    memcpy(&a->server_us, h + 20, 8), memcpy(&a->mlen, h + 28, 4), memcpy(&a->T, h + 32, 4);
    size_t n;
    if (a->status == 0) {
        if (a->T > (uint32_t)c->max_tokens) return TC_BAD_HEADER;
        n = (size_t)a->T * c->H * (c->wire == 0 ? 4 : 2);
    } else {
        if ((a->status != 3 && a->status != 13) || a->mlen > TC_MAX_MESSAGE) return TC_BAD_HEADER;
        n = a->mlen;
    }
    rc = recv_rest(c, c->body, n, frame_end);
    if (rc == SC_OK) c->answered++;
    return rc;
}

void tc_read(const TcpClient *c, int T, float *out) {
    sc_get_rows(out, c->body, c->wire, (size_t)T * c->H, 0);
}
