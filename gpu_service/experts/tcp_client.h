/* tcp_client.h: the GPU side's client of the TCP data path (wire/tcp.py's frames), in C.
 *
 * One TcpClient per replica's data connection (gpu_service/experts/tcp.py TcpPath keeps the
 * negotiation, pending calls, deadlines and breaks); its bytes move through wire/tcp_io.h, plaintext
 * or mutual TLS. tc_send writes one request frame (the hidden rows cast to the wire dtype on the way;
 * plaintext: one sendmsg), going on after a short write until timeout_ms; tc_wait receives one
 * response: its first bytes (up to its header, one recv) polled without blocking until spin_end_ns,
 * then poll() until deadline_ns; once it began, the rest
 * of the frame must come by frame_end_ns (its length checked first: an OK answer's T rows at most
 * max_tokens, a message at most TC_MAX_MESSAGE bytes), into the client's own bounded buffer. The
 * binding releases the GIL around both. */
#ifndef MOESPLIT_TCP_CLIENT_H
#define MOESPLIT_TCP_CLIENT_H
#include <stddef.h>
#include <stdint.h>

#include "shm_client.h" /* SC_* codes, shm_now_ns */
#include "tcp_io.h"     /* wire/: the byte transport */

enum { TC_REQUEST_BYTES = 28, TC_RESPONSE_BYTES = 36, TC_MAX_MESSAGE = 4096 };
enum { TC_STALLED = 8, TC_BAD_HEADER = 9 }; /* beyond shm_client.h's SC_* codes */

typedef struct {
    TcpIo *io;                       /* the connection (its own descriptor; plaintext or TLS) */
    int H, wire, max_tokens;         /* wire: 0 float32, 1 bfloat16, 2 float16 */
    unsigned char *body;             /* [body_cap]: the last answer's rows (wire dtype) or message */
    size_t body_cap;
    unsigned char *cast;             /* [max_tokens * H * 2]: hidden rows cast to a 16-bit wire dtype */
    int err;                         /* errno of the last SC_FAILED */
    uint64_t sent, answered;
} TcpClient;

typedef struct {
    uint64_t seq, compute_us, server_us;
    uint32_t status, mlen, T;
} TcpAnswer;

/* h [T, H]: float32 (h_wire 0) or already in the wire dtype; ids [T, k] int64, w [T, k] float32.
 * SC_OK, SC_BAD (T out of bounds), SC_FULL (the socket stayed full for timeout_ms: the frame may be
 * cut, the connection unusable), SC_CLOSED / SC_FAILED (err; 0: a TLS failure, io->why says it). */
int tc_send(TcpClient *c, uint64_t seq, int32_t layer, const void *h, int h_wire, const int64_t *ids, const float *w,
            int T, int k, int timeout_ms);
/* SC_OK (*a filled, the body in c->body), SC_NONE (nothing began by deadline_ns), SC_INTR (a signal
 * before a frame began), SC_CLOSED, SC_FAILED (err), TC_STALLED (a frame began, its rest did not come by
 * frame_end_ns), TC_BAD_HEADER (a status or length no request can have: *a filled) */
int tc_wait(TcpClient *c, int64_t spin_end_ns, int64_t deadline_ns, int64_t frame_ns, TcpAnswer *a);
/* out [T, H] float32 = the last answer's rows */
void tc_read(const TcpClient *c, int T, float *out);
#endif
