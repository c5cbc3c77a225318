/* moe_shm.h: the shard's shared-memory serving loop in C (issue 20).
 *
 * cpu_expert_service.shm_transport served each doorbell in Python: ~100 us per call, of which the
 * kernels computed ~30 and the rest was the slot views, validation and the backend's numpy. Here one
 * client's doorbell loop runs without the GIL: receive (bounded spin, then block), validate, convert
 * the slot's hidden rows from the wire dtype, moe_forward, write the output back in the wire dtype,
 * answer. Anything it does not take as a plain valid call (an unknown layer, out-of-range ids,
 * NaN / Inf, int32 ids, T = 0, more rows than the shard takes) it hands back to Python with the
 * call's slot and seq: Python computes or refuses it exactly as before, with its own messages.
 *
 * Metrics (cpu_expert_service.metrics, when the backend is metered): token and activation counts
 * are added here (atomically) into arrays the collector reads; each call's (layer, queue wait,
 * kernel time) goes into a single-producer ring that a Python thread drains into the histograms. */
#ifndef MOESPLIT_MOE_SHM_H
#define MOESPLIT_MOE_SHM_H
#include "moe.h"
#include "shm_wire.h"  /* wire/: the doorbell and slot constants, shared with the GPU side's native step */

enum { MOE_SHM_CLOSED = 0, MOE_SHM_BAD_DOORBELL = 1, MOE_SHM_PYTHON = 2, MOE_SHM_NOMEM = 3 };

typedef struct { int32_t layer, T; int64_t wait_ns, kernel_ns; } MoeShmRec;

typedef struct {
    /* the mapping and its layout (wire.shm.Layout) */
    unsigned char *base;
    int fd, n_slots, max_tokens, max_k;
    long header_bytes, slot_bytes, hidden_off, ids_off, w_off, out_off;
    /* the model and this shard */
    int H, E, shard_max_tokens, fmt;
    int n_layers;                    /* layer ids < n_layers */
    MoeExpert *const *const *experts; /* [n_layers] by global expert id, NULL: not held / not served */
    const int *cap, *inter;          /* [n_layers] table size and intermediate size */
    double spin_s;
    /* scratch: max_tokens rows */
    float *x, *w, *out;
    int64_t *ids;
    /* metrics (NULL: none) */
    int64_t *tokens;                 /* [n_layers] */
    int64_t *acts;                   /* [n_layers][E], only experts held counted; NULL: not counted */
    const unsigned char *held;       /* [E] */
    MoeShmRec *ring;                 /* [ring_cap], ring_cap a power of two */
    uint64_t ring_cap, head, tail, dropped;  /* head: written here, tail: by the drainer */
    /* a call handed back (MOE_SHM_PYTHON) */
    uint32_t slot;
    uint64_t seq;
    int64_t arrived_ns;
} MoeShm;

/* the drainer's side of the ring */
static inline uint64_t moe_shm_head(const MoeShm *s) { return __atomic_load_n(&s->head, __ATOMIC_ACQUIRE); }
static inline void moe_shm_set_tail(MoeShm *s, uint64_t t) { __atomic_store_n(&s->tail, t, __ATOMIC_RELEASE); }
static inline uint64_t moe_shm_dropped(const MoeShm *s) { return __atomic_load_n(&s->dropped, __ATOMIC_RELAXED); }
/* serve doorbells until the client goes (MOE_SHM_CLOSED), a bad doorbell (MOE_SHM_BAD_DOORBELL:
 * slot / seq say which) or a call for Python (MOE_SHM_PYTHON) */
int moe_shm_serve(MoeShm *s, MoePool *pool, const MoeKernels *kern);
#endif
