/* moe_shm.h: the shard's shared-memory serving loop, the only one (wire/shm.py has the protocol).
 *
 * One client's doorbell loop runs without the GIL: receive (bounded spin, then block), validate the
 * slot's call exactly as the shard's validator does (ExpertServicer.check_and_forward, with its
 * messages), convert hidden rows, ids and weights from their wire dtypes, compute, write the output
 * back in the wire dtype, answer. A call it refuses is answered INVALID_ARGUMENT with the message in
 * the slot; a failed compute INTERNAL; either way the loop serves on. Only the client going or a bad
 * doorbell ends it.
 *
 * The compute is a function pointer: moe_shm_kernels (moe_forward over an Engine's packed experts,
 * all in C) or, for a backend that is not the kernels, a Cython callback that takes the GIL and calls
 * the backend's forward on the converted scratch rows (cpu_expert_service/kernels/_moe.pyx).
 *
 * Metrics (cpu_expert_service.metrics, when the backend is metered), counted as the metered backend
 * counts: token and activation counts of every computed call are added here (atomically) into arrays
 * the collector reads; each computed call's (layer, queue wait, kernel time; -1 when the compute
 * failed) goes into a single-producer ring that a Python thread drains into the histograms. */
#ifndef MOESPLIT_MOE_SHM_H
#define MOESPLIT_MOE_SHM_H
#include "moe.h"
#include "shm_wire.h"  /* wire/: the doorbell and slot constants */
#include "tcp_io.h"    /* wire/: the TCP data path's byte transport (plaintext or TLS) */

enum { MOE_SHM_CLOSED = 0, MOE_SHM_BAD_DOORBELL = 1, MOE_SHM_INTERNAL = 2, MOE_TCP_BAD_FRAME = 3, MOE_TCP_STALLED = 4 };

typedef struct { int32_t layer, T; int64_t wait_ns, kernel_ns; } MoeShmRec;

typedef struct MoeShm MoeShm;
/* one valid call's compute from the scratch rows (x [T, H], ids [T, k], w [T, k]) into out [T, H]
 * (zeroed): 0, or -1 with "Type: text" in err (cap bytes) for an INTERNAL answer */
typedef int (*MoeShmCompute)(MoeShm *s, int layer, int T, int k, char *err, size_t cap);

struct MoeShm {
    /* the mapping and its layout (wire.shm.Layout) */
    unsigned char *base;
    int fd, n_slots, max_tokens, max_k;
    long header_bytes, slot_bytes, hidden_off, ids_off, w_off, out_off;
    /* the model and this shard */
    int H, E, shard_max_tokens;
    int n_layers;                     /* layer ids < n_layers */
    const unsigned char *served;      /* [n_layers] 1: a layer this shard serves */
    const char *shard_id, *served_text; /* for the messages: the shard's name, its layers ("1-3,5") */
    double spin_s;
    MoeShmCompute compute;
    void *ctx;                        /* the compute's (the Cython callback's ShmServe) */
    /* moe_shm_kernels' experts */
    MoePool *pool;
    const MoeKernels *kern;
    int fmt;
    MoeExpert *const *const *experts; /* [n_layers] by global expert id, NULL: no experts of that layer */
    const int *cap, *inter, *hid;     /* [n_layers] table size, intermediate and hidden size */
    /* scratch: max_tokens rows */
    float *x, *w, *out;
    int64_t *ids, *kids;              /* the call's ids; moe_shm_kernels' (-1 where the weight is 0) */
    /* metrics (NULL: none) */
    int64_t *tokens;                  /* [n_layers] */
    int64_t *acts;                    /* [n_layers][E], only experts held counted; NULL: not counted */
    const unsigned char *held;        /* [E] */
    MoeShmRec *ring;                  /* [ring_cap], ring_cap a power of two */
    uint64_t ring_cap, head, tail, dropped;  /* head: written here, tail: by the drainer */
    /* the last call answered INTERNAL (MOE_SHM_INTERNAL) or the bad doorbell (MOE_SHM_BAD_DOORBELL) */
    uint32_t slot;
    uint64_t seq;
    char msg[SHM_MSG_MAX + 1];
};

/* the drainer's side of the ring */
static inline uint64_t moe_shm_head(const MoeShm *s) { return __atomic_load_n(&s->head, __ATOMIC_ACQUIRE); }
static inline void moe_shm_set_tail(MoeShm *s, uint64_t t) { __atomic_store_n(&s->tail, t, __ATOMIC_RELEASE); }
static inline uint64_t moe_shm_dropped(const MoeShm *s) { return __atomic_load_n(&s->dropped, __ATOMIC_RELAXED); }
/* the compute over an Engine's experts (pool, kern, fmt, experts, cap, inter, hid) */
int moe_shm_kernels(MoeShm *s, int layer, int T, int k, char *err, size_t cap);
/* one call's validation (as the shard's validator), compute and output: the request's rows at b
 * (s->hidden_off / ids_off / w_off; c: dtype codes hidden / ids / weights / output), the answer
 * written to out in the output dtype. Returns the status (0 OK, 3 INVALID_ARGUMENT, 13 INTERNAL);
 * when not 0, s->msg holds "shard S: seq N: why" and *mlen its length. Shared by both loops. */
uint32_t moe_shm_answer(MoeShm *s, const unsigned char *b, int32_t layer, uint32_t T, uint32_t k, const uint32_t *c,
                        unsigned char *out, uint64_t seq, int64_t arrived, uint64_t *compute_us, uint32_t *mlen);
/* the TCP data path's loop over one connection io (wire.tcp's frames; plaintext or TLS): each frame's header,
 * then its payload into req (req_cap bytes; committed as it arrives), answered from out (the output
 * rows' buffer); K: the model's num_experts_per_tok (a header with k outside [1, K], T above
 * shard_max_tokens or an unknown dtype code is answered INVALID_ARGUMENT and ends the loop with
 * MOE_TCP_BAD_FRAME: its payload length cannot be trusted). Between frames the connection may idle;
 * once a frame's first byte came, the rest must within frame_timeout_s (else MOE_TCP_STALLED), and
 * each answer must be taken within as long (else MOE_SHM_CLOSED).
 * Returns as moe_shm_serve does otherwise (MOE_SHM_CLOSED, MOE_SHM_INTERNAL after answering). */
int moe_tcp_serve(MoeShm *s, TcpIo *io, unsigned char *req, size_t req_cap, unsigned char *out, int K,
                  double frame_timeout_s);
/* serve doorbells until the client goes (MOE_SHM_CLOSED) or a bad doorbell (MOE_SHM_BAD_DOORBELL:
 * slot / seq say which); returns MOE_SHM_INTERNAL after answering a call whose compute failed (msg
 * says why) so that the caller can log it and serve on */
int moe_shm_serve(MoeShm *s);
#endif
