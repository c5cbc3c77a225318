/* tcp_io.h: the TCP data path's byte transport for its two C ends, the shard's loop
 * (cpu_expert_service/kernels/moe_tcp.c) and the GPU side's client (gpu_service/experts/tcp_client.c).
 *
 * The frames (wire/tcp.py) stay in those two files; this moves their bytes, over a plaintext socket
 * or over mutual TLS (OpenSSL) on the same socket, without blocking: a receive or send that cannot
 * go on waits in poll() under the caller's deadline (TLS: WANT_READ / WANT_WRITE wait for what
 * OpenSSL asks for, bytes OpenSSL already holds count as readable). A TLS send gathers the frame's
 * parts into a bounded staging buffer (one record per TIO_STAGE bytes, not one per part); a TLS
 * receive smaller than TIO_RBUF takes a whole record's plaintext into a buffer of its own and the
 * frame's pieces from there (one SSL_read a record: each is costly, above all with cold caches). One
 * thread may send while another receives (the GPU side does): TLS calls are serialized by a mutex,
 * held only around a non-blocking SSL call, never while waiting.
 *
 * The TLS contexts load the gRPC path's files (--tls-cert, --tls-key, --tls-ca): the shard requires
 * and checks the client's certificate, the client checks the shard's against the CA and its name. */
#ifndef MOESPLIT_TCP_IO_H
#define MOESPLIT_TCP_IO_H
#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "shm_wire.h" /* shm_now_ns */

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

enum { TIO_OK = 1, TIO_EOF = 0, TIO_ERR = -1, TIO_TIMEOUT = -2, TIO_INTR = -3, TIO_AGAIN = -4 };
enum { TIO_STAGE = 64 * 1024, TIO_RBUF = 16 * 1024, TIO_WHY = 512 };
#define TIO_FOREVER INT64_MAX

typedef struct {
    int fd;
    SSL *ssl;                  /* NULL: plaintext */
    pthread_mutex_t lock;      /* around SSL calls (a sender and a receiver thread) */
    unsigned char *stage;      /* [TIO_STAGE] TLS sends */
    unsigned char *rbuf;       /* [TIO_RBUF] TLS receives: a record's plaintext, taken out in pieces */
    size_t roff, rlen;         /* (the receiving thread's alone) */
    int err;                   /* errno of the last TIO_ERR (0: a TLS error, in why) */
    int server, peer_alert;    /* the TLS side; the last TLS error was an alert from the peer (it refused) */
    uint64_t bytes_in, bytes_out, tls_records_out;
    char why[TIO_WHY];         /* the last TLS failure, in words */
} TcpIo;

/* fd (owned by the caller until tio_free): plaintext */
void tio_init(TcpIo *io, int fd);
/* SSL calls' state freed (no close_notify: the caller shuts the socket down); fd left open */
void tio_free(TcpIo *io);
/* a TLS context: server (client certificate required) or client; NULL with why filled */
SSL_CTX *tio_ctx(int server, const char *cert, const char *key, const char *ca, char *why, size_t cap);
void tio_ctx_free(SSL_CTX *ctx);
/* the handshake on io's socket (made non-blocking) by deadline_ns; host: the name (or IP address) the
 * client checks the shard's certificate for. TIO_OK, or TIO_ERR / TIO_TIMEOUT / TIO_EOF with io->why */
int tio_start_tls(TcpIo *io, SSL_CTX *ctx, int server, const char *host, int64_t deadline_ns);
/* ready for `events` (POLLIN / POLLOUT) by deadline_ns: TIO_OK, TIO_TIMEOUT, TIO_INTR, TIO_ERR */
int tio_wait(TcpIo *io, short events, int64_t deadline_ns);
/* what is there now, at most n bytes: > 0 bytes, TIO_EOF, TIO_AGAIN (*want: the event to wait for),
 * TIO_ERR */
long tio_recv_some(TcpIo *io, void *p, size_t n, short *want);
/* n bytes by deadline_ns: TIO_OK, TIO_EOF, TIO_ERR, TIO_TIMEOUT; TIO_INTR only when intr is set */
int tio_recv_all(TcpIo *io, unsigned char *p, size_t n, int64_t deadline_ns, int intr);
/* every byte of the iovecs by deadline_ns (iov changed): TIO_OK, TIO_ERR, TIO_TIMEOUT (a frame may be cut) */
int tio_send_all(TcpIo *io, struct iovec *iov, int n, int64_t deadline_ns);
/* "" or the TLS protocol version of a started session */
const char *tio_version(const TcpIo *io);
#endif
