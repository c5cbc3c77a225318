/* shm_client.h: the GPU side's client of the shared-memory expert protocol (wire/shm.py), in C.
 *
 * One ShmClient per replica's fast path (gpu_service/experts/shm.py FastPath, which keeps the
 * negotiation, slots, pending calls, deadlines and breaks). sc_send writes one layer call into a
 * slot (hidden rows in the wire dtype, ids int64, weights f32, the call header) and rings the
 * doorbell; sc_wait receives one answer's doorbell, polling without blocking (sched_yield between
 * polls) until spin_end_ns, then poll() until deadline_ns; the binding releases the GIL around it.
 * sc_read copies a slot's output to float32. The doorbell and result constants come from
 * wire/shm_wire.h, shared with the shard's C loop (cpu_expert_service/kernels/moe_shm.c). */
#ifndef MOESPLIT_SHM_CLIENT_H
#define MOESPLIT_SHM_CLIENT_H
#include <stddef.h>
#include <stdint.h>

#include "shm_wire.h"

enum { SC_OK = 0, SC_NONE = 1, SC_CLOSED = 2, SC_FAILED = 3, SC_INTR = 4, SC_FULL = 5, SC_BAD = 6, SC_OTHER = 7 };
/* sc_finish's output modes: the answer's bytes as they are (out in the wire dtype), as float32, added into float32 */
enum { SC_OUT_WIRE = 0, SC_OUT_F32 = 1, SC_OUT_ADD_F32 = 2 };

typedef struct {
    unsigned char *base;            /* the shared mapping */
    long header_bytes, slot_bytes;  /* slot s at header_bytes + s * slot_bytes (wire.shm.Layout) */
    long hidden_off, ids_off, w_off, out_off;
    int n_slots, H, max_tokens, max_k;
    int fd;                         /* the doorbell (SOCK_SEQPACKET), the client's own descriptor */
    int wire;                       /* 0 float32, 1 bfloat16, 2 float16 */
    int err;                        /* errno of the last SC_FAILED */
    uint64_t sent, answered;        /* doorbells rung / answers received */
} ShmClient;

typedef struct {
    uint32_t status, slot;          /* a gRPC status code; the answered slot (< n_slots) */
    uint64_t seq;
} ShmAnswer;

/* h [T, H]: float32 (h_wire 0) or already in the wire dtype (h_wire 1); ids / w [T, k].
 * SC_OK, SC_BAD (T, k or slot out of the layout), SC_FULL (the socket stayed full for timeout_ms),
 * SC_CLOSED / SC_FAILED (err). */
int sc_send(ShmClient *c, int slot, uint64_t seq, int32_t layer, const void *h, int h_wire,
            const int64_t *ids, const float *w, int T, int k, int timeout_ms);
/* SC_OK (*a filled), SC_NONE (nothing by deadline_ns), SC_INTR (a signal), SC_CLOSED (the shard
 * closed the doorbell or sent a short message), SC_FAILED (err), SC_BAD (a slot outside the layout) */
int sc_wait(ShmClient *c, int64_t spin_end_ns, int64_t deadline_ns, ShmAnswer *a);
/* out [T, H] float32 = slot's output rows */
void sc_read(const ShmClient *c, int slot, int T, float *out);
/* One answer (sc_wait); when it is call `seq`'s on `slot` and OK, its T output rows written to out
 * (mode SC_OUT_*) and SC_OK; another call's answer, or this call's refusal, SC_OTHER (*a filled, out
 * untouched); else sc_wait's codes. */
int sc_finish(ShmClient *c, uint64_t seq, int slot, int T, void *out, int mode, int64_t spin_end_ns,
              int64_t deadline_ns, ShmAnswer *a);
/* n float32 values -> the wire dtype (numpy / ml_dtypes casts: round to nearest even) */
void sc_put_rows(void *dst, int wire, const float *x, size_t n);
/* y = the n wire values as float32, or y += them (add) */
void sc_get_rows(float *y, const void *src, int wire, size_t n, int add);
int sc_has_f16(void);  /* 1 where the compiler has _Float16 (float16 conversions in C) */
#endif
