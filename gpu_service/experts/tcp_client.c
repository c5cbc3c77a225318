/* tcp_client.c: see tcp_client.h. */
#define _GNU_SOURCE
#include "tcp_client.h"

#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <string.h>

/* a transport result (wire/tcp_io.h) as an SC_* code; timed_out: the code for TIO_TIMEOUT */
static int sc_of(TcpClient *c, int r, int timed_out) {
    if (r == TIO_OK) return SC_OK;
    if (r == TIO_TIMEOUT) return timed_out;
    if (r == TIO_EOF) return SC_CLOSED;
    c->err = c->io->err;
    return SC_FAILED;
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
    int rc = sc_of(c, tio_send_all(c->io, iov, 4, shm_now_ns() + (int64_t)timeout_ms * 1000000), SC_FULL);
    if (rc == SC_OK) c->sent++;
    return rc;
}

int tc_wait(TcpClient *c, int64_t spin_end_ns, int64_t deadline_ns, int64_t frame_ns, TcpAnswer *a) {
    unsigned char h[TC_RESPONSE_BYTES];
    long got;
    for (;;) { /* the first bytes (the whole header when it is there: one recv): spin, then wait to the deadline */
        short want = POLLIN;
        long r = got = tio_recv_some(c->io, h, sizeof h, &want);
        if (r > 0) break;
        if (r != TIO_AGAIN) return sc_of(c, (int)r, SC_NONE);
        if (want == POLLIN && shm_now_ns() < spin_end_ns) {
            sched_yield();
            continue;
        }
        int w = tio_wait(c->io, want, deadline_ns);
        if (w == TIO_INTR) return SC_INTR;
        if (w != TIO_OK) return sc_of(c, w, SC_NONE);
    }
    int64_t frame_end = shm_now_ns() + frame_ns;
    int rc = sc_of(c, tio_recv_all(c->io, h + got, sizeof h - (size_t)got, frame_end, 0), TC_STALLED);
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
    rc = sc_of(c, tio_recv_all(c->io, c->body, n, frame_end, 0), TC_STALLED);
    if (rc == SC_OK) c->answered++;
    return rc;
}

void tc_read(const TcpClient *c, int T, float *out) {
    sc_get_rows(out, c->body, c->wire, (size_t)T * c->H, 0);
}
