/* tcp_io.c: see tcp_io.h. */
#define _GNU_SOURCE
#include "tcp_io.h"

#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509v3.h>

void tio_init(TcpIo *io, int fd) {
    memset(io, 0, sizeof *io);
    io->fd = fd;
    pthread_mutex_init(&io->lock, NULL);
}

void tio_free(TcpIo *io) {
    if (io->ssl) SSL_free(io->ssl);
    io->ssl = NULL;
    free(io->stage);
    free(io->rbuf);
    io->stage = io->rbuf = NULL;
    pthread_mutex_destroy(&io->lock);
}

/* OpenSSL's queued errors in words, after `what` */
static void ssl_why(char *why, size_t cap, const char *what) {
    char e[256] = "";
    unsigned long code = ERR_peek_last_error();
    if (code) ERR_error_string_n(code, e, sizeof e);
    snprintf(why, cap, "%s%s%s", what, *e ? ": " : "", e);
    ERR_clear_error();
}

SSL_CTX *tio_ctx(int server, const char *cert, const char *key, const char *ca, char *why, size_t cap) {
    ERR_clear_error();
    SSL_CTX *ctx = SSL_CTX_new(server ? TLS_server_method() : TLS_client_method());
    char what[TIO_WHY];
    if (!ctx) {
        ssl_why(why, cap, "cannot make a TLS context");
        return NULL;
    }
    SSL_CTX_set_min_proto_version(ctx, TLS1_2_VERSION);
    if (SSL_CTX_use_certificate_chain_file(ctx, cert) != 1) {
        snprintf(what, sizeof what, "--tls-cert %s: not a PEM certificate this process can read", cert);
    } else if (SSL_CTX_use_PrivateKey_file(ctx, key, SSL_FILETYPE_PEM) != 1) {
        snprintf(what, sizeof what, "--tls-key %s: not a PEM private key this process can read, or not the key of "
                 "--tls-cert %s", key, cert);
    } else if (SSL_CTX_check_private_key(ctx) != 1) {
        snprintf(what, sizeof what, "--tls-key %s is not the key of --tls-cert %s", key, cert);
    } else if (SSL_CTX_load_verify_locations(ctx, ca, NULL) != 1) {
        snprintf(what, sizeof what, "--tls-ca %s: not PEM CA certificates this process can read", ca);
    } else {
        SSL_CTX_set_verify(ctx, SSL_VERIFY_PEER | (server ? SSL_VERIFY_FAIL_IF_NO_PEER_CERT : 0), NULL);
        if (server) {
            STACK_OF(X509_NAME) *names = SSL_load_client_CA_file(ca);
            if (names) SSL_CTX_set_client_CA_list(ctx, names);
            SSL_CTX_set_num_tickets(ctx, 0); /* one long connection: no resumption tickets to read */
        }
        SSL_CTX_set_options(ctx, SSL_OP_IGNORE_UNEXPECTED_EOF);
        SSL_CTX_set_mode(ctx, SSL_MODE_ENABLE_PARTIAL_WRITE | SSL_MODE_ACCEPT_MOVING_WRITE_BUFFER);
        SSL_CTX_set_read_ahead(ctx, 1);
        return ctx;
    }
    ssl_why(why, cap, what);
    SSL_CTX_free(ctx);
    return NULL;
}

void tio_ctx_free(SSL_CTX *ctx) {
    if (ctx) SSL_CTX_free(ctx);
}

/* poll fd for events by deadline_ns (woken early: polled again) */
static int poll_fd(TcpIo *io, short events, int64_t deadline_ns) {
    for (;;) {
        int64_t left = deadline_ns - shm_now_ns();
        if (left <= 0) return TIO_TIMEOUT;
        int64_t ms = (left + 999999) / 1000000;
        struct pollfd p = {io->fd, events, 0};
        int r = poll(&p, 1, ms > 1000000 ? 1000000 : (int)ms);
        if (r > 0) return TIO_OK;
        if (r < 0) {
            if (errno == EINTR) return TIO_INTR;
            io->err = errno;
            return TIO_ERR;
        }
    }
}

int tio_wait(TcpIo *io, short events, int64_t deadline_ns) {
    if (io->ssl && (events & POLLIN)) { /* records OpenSSL holds already: poll() cannot see them */
        if (io->roff < io->rlen) return TIO_OK;
        pthread_mutex_lock(&io->lock);
        int pending = SSL_has_pending(io->ssl);
        pthread_mutex_unlock(&io->lock);
        if (pending) return TIO_OK;
    }
    return poll_fd(io, events, deadline_ns);
}

/* a failed SSL call's result: TIO_AGAIN (*want), TIO_EOF or TIO_ERR (why) */
static int ssl_failed(TcpIo *io, int e, int saved_errno, short *want, const char *what) {
    if (e == SSL_ERROR_WANT_READ || e == SSL_ERROR_WANT_WRITE) {
        *want = e == SSL_ERROR_WANT_READ ? POLLIN : POLLOUT;
        return TIO_AGAIN;
    }
    if (e == SSL_ERROR_ZERO_RETURN) return TIO_EOF;
    if (e == SSL_ERROR_SYSCALL && ERR_peek_last_error() == 0) {
        io->err = saved_errno;
        return saved_errno == 0 || saved_errno == ECONNRESET || saved_errno == EPIPE ? TIO_EOF : TIO_ERR;
    }
    io->err = 0;
    ssl_why(io->why, sizeof io->why, what);
    io->peer_alert = strstr(io->why, "alert") != NULL; /* the peer ended the session, as a refused certificate does */
    if (io->peer_alert && !io->server && *what)
        snprintf(io->why + strlen(io->why), sizeof io->why - strlen(io->why), " (the shard refused this end's "
                 "certificate: give the GPU service --tls-cert/--tls-key signed by the shard's --tls-ca)");
    return TIO_ERR;
}

long tio_recv_some(TcpIo *io, void *p, size_t n, short *want) {
    if (!io->ssl) {
        for (;;) {
            ssize_t r = recv(io->fd, p, n, MSG_DONTWAIT);
            if (r > 0) {
                io->bytes_in += (uint64_t)r;
                return (long)r;
            }
            if (r == 0) return TIO_EOF;
            if (errno == EINTR) continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK) {
                *want = POLLIN;
                return TIO_AGAIN;
            }
            io->err = errno;
            return errno == ECONNRESET ? TIO_EOF : TIO_ERR;
        }
    }
    if (io->roff < io->rlen) { /* what the last record left */
        size_t k = io->rlen - io->roff < n ? io->rlen - io->roff : n;
        memcpy(p, io->rbuf + io->roff, k);
        io->roff += k;
        return (long)k;
    }
    int whole = n < TIO_RBUF; /* small: the record's plaintext into rbuf; large: straight into p */
    size_t got = 0;
    pthread_mutex_lock(&io->lock);
    ERR_clear_error();
    errno = 0;
    int r = SSL_read_ex(io->ssl, whole ? io->rbuf : p, whole ? TIO_RBUF : n, &got);
    int e = r ? SSL_ERROR_NONE : SSL_get_error(io->ssl, 0), saved = errno;
    int rc = r ? (int)got : ssl_failed(io, e, saved, want, "TLS receive");
    pthread_mutex_unlock(&io->lock);
    if (!r) return rc;
    io->bytes_in += got;
    if (!whole) return (long)got;
    io->roff = 0, io->rlen = got;
    return tio_recv_some(io, p, n, want);
}

int tio_recv_all(TcpIo *io, unsigned char *p, size_t n, int64_t deadline_ns, int intr) {
    while (n) {
        short want = POLLIN;
        long r = tio_recv_some(io, p, n, &want);
        if (r > 0) {
            p += r, n -= (size_t)r;
            continue;
        }
        if (r != TIO_AGAIN) return (int)r;
        int w = want == POLLIN ? tio_wait(io, POLLIN, deadline_ns) : poll_fd(io, want, deadline_ns);
        if (w == TIO_INTR && !intr) continue;
        if (w != TIO_OK) return w;
    }
    return TIO_OK;
}

static int send_plain(TcpIo *io, struct iovec *iov, int n, int64_t deadline_ns) {
    while (n > 0) {
        struct msghdr m = {0};
        m.msg_iov = iov, m.msg_iovlen = (size_t)n;
        ssize_t w = sendmsg(io->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                io->err = errno;
                return errno == EPIPE || errno == ECONNRESET ? TIO_EOF : TIO_ERR;
            }
            int r = poll_fd(io, POLLOUT, deadline_ns);
            if (r != TIO_OK && r != TIO_INTR) return r;
            continue;
        }
        io->bytes_out += (uint64_t)w;
        while (n > 0 && (size_t)w >= iov->iov_len) w -= (ssize_t)iov->iov_len, iov++, n--;
        if (n > 0) iov->iov_base = (char *)iov->iov_base + w, iov->iov_len -= (size_t)w;
    }
    return TIO_OK;
}

/* len bytes of the staging buffer through TLS by deadline_ns */
static int send_stage(TcpIo *io, size_t len, int64_t deadline_ns) {
    size_t off = 0;
    while (off < len) {
        size_t w = 0;
        short want = POLLOUT;
        pthread_mutex_lock(&io->lock);
        ERR_clear_error();
        errno = 0;
        int r = SSL_write_ex(io->ssl, io->stage + off, len - off, &w);
        int e = r ? SSL_ERROR_NONE : SSL_get_error(io->ssl, 0), saved = errno;
        int rc = r ? TIO_OK : ssl_failed(io, e, saved, &want, "TLS send");
        pthread_mutex_unlock(&io->lock);
        if (r) {
            off += w, io->bytes_out += w, io->tls_records_out += (w + 16383) / 16384;
            continue;
        }
        if (rc != TIO_AGAIN) return rc;
        int p = poll_fd(io, want, deadline_ns);
        if (p != TIO_OK && p != TIO_INTR) return p;
    }
    return TIO_OK;
}

int tio_send_all(TcpIo *io, struct iovec *iov, int n, int64_t deadline_ns) {
    if (!io->ssl) return send_plain(io, iov, n, deadline_ns);
    while (n > 0) { /* the parts gathered into the staging buffer, TIO_STAGE bytes at a time */
        size_t len = 0;
        while (n > 0 && len < TIO_STAGE) {
            size_t take = iov->iov_len < TIO_STAGE - len ? iov->iov_len : TIO_STAGE - len;
            memcpy(io->stage + len, iov->iov_base, take);
            len += take, iov->iov_base = (char *)iov->iov_base + take, iov->iov_len -= take;
            if (!iov->iov_len) iov++, n--;
        }
        int r = send_stage(io, len, deadline_ns);
        if (r != TIO_OK) return r;
    }
    return TIO_OK;
}

/* why a handshake failed, with the fix */
static void handshake_why(TcpIo *io, int server, const char *host, const char *cause) {
    char e[200];
    snprintf(e, sizeof e, "%s", cause);
    long v = io->ssl && !server ? SSL_get_verify_result(io->ssl) : X509_V_OK;
    if (!server && v != X509_V_OK)
        snprintf(io->why, sizeof io->why, "TLS handshake: the shard's certificate failed verification for %.100s (%s): "
                 "give the GPU service the --tls-ca that signed the shard's --tls-cert, and the shard a certificate "
                 "naming that host", host ? host : "?", X509_verify_cert_error_string(v));
    else if (server && io->peer_alert)
        snprintf(io->why, sizeof io->why, "TLS handshake: the client refused this shard's certificate (%s): give the "
                 "GPU service the --tls-ca that signed this shard's --tls-cert", e);
    else if (server)
        snprintf(io->why, sizeof io->why, "TLS handshake failed (%s): the client must present its certificate "
                 "(the GPU service's --tls-cert/--tls-key) signed by this shard's --tls-ca", e);
    else if (io->peer_alert)
        snprintf(io->why, sizeof io->why, "TLS handshake: the shard refused this end's certificate (%s): give the "
                 "GPU service --tls-cert/--tls-key signed by the shard's --tls-ca", e);
    else
        snprintf(io->why, sizeof io->why, "TLS handshake with the shard failed (%s): give both ends "
                 "--tls-cert/--tls-key signed by the CA the other end's --tls-ca names", e);
}

int tio_start_tls(TcpIo *io, SSL_CTX *ctx, int server, const char *host, int64_t deadline_ns) {
    int fl = fcntl(io->fd, F_GETFL);
    if (fl < 0 || fcntl(io->fd, F_SETFL, fl | O_NONBLOCK) < 0 || !(io->stage = malloc(TIO_STAGE))
            || !(io->rbuf = malloc(TIO_RBUF))
            || !(io->ssl = SSL_new(ctx)) || SSL_set_fd(io->ssl, io->fd) != 1) {
        io->err = errno;
        ssl_why(io->why, sizeof io->why, "cannot start TLS on the data connection");
        return TIO_ERR;
    }
    io->server = server;
    if (server) {
        SSL_set_accept_state(io->ssl);
    } else {
        SSL_set_connect_state(io->ssl);
        unsigned char addr[16];
        int ip = host && (inet_pton(AF_INET, host, addr) == 1 || inet_pton(AF_INET6, host, addr) == 1);
        if (ip) {
            X509_VERIFY_PARAM_set1_ip_asc(SSL_get0_param(io->ssl), host);
        } else if (host) {
            SSL_set_tlsext_host_name(io->ssl, host);
            SSL_set1_host(io->ssl, host);
        }
    }
    for (;;) {
        ERR_clear_error();
        errno = 0;
        int r = SSL_do_handshake(io->ssl);
        if (r == 1) return TIO_OK;
        short want = POLLIN;
        int e = SSL_get_error(io->ssl, r), saved = errno;
        io->peer_alert = 0;
        int rc = ssl_failed(io, e, saved, &want, "");
        if (rc == TIO_AGAIN) {
            int w = poll_fd(io, want, deadline_ns);
            if (w == TIO_OK || w == TIO_INTR) continue;
            if (w == TIO_TIMEOUT)
                snprintf(io->why, sizeof io->why, "TLS handshake: no answer in time (is the other end speaking TLS? "
                         "give both ends --tls-cert/--tls-key/--tls-ca)");
            return w;
        }
        handshake_why(io, server, host, rc == TIO_EOF ? "the peer closed the connection" :
                      *io->why ? io->why + 2 : strerror(io->err));
        return rc == TIO_EOF ? TIO_EOF : TIO_ERR;
    }
}

const char *tio_version(const TcpIo *io) {
    return io->ssl ? SSL_get_version(io->ssl) : "";
}
