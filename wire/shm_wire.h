/* shm_wire.h: wire/shm.py's doorbell and slot-result constants for the protocol's two C ends, the
 * shard's doorbell loop (cpu_expert_service/kernels/moe_shm.c) and the GPU side's client
 * (gpu_service/experts/shm_client.c); tests/test_shm_handoff.py compares both with wire/shm.py. */
#ifndef MOESPLIT_SHM_WIRE_H
#define MOESPLIT_SHM_WIRE_H
#include <stdint.h>
#include <time.h>

#define SHM_DOORBELL_BYTES 16  /* <IIQ: op | status, slot, seq */
#define SHM_OP_FORWARD 1
#define SHM_RESULT_OFFSET 28   /* compute_us Q, server_us Q, msg_len I (the tail of the call header) */
#define SHM_MSG_OFFSET 64      /* a refused call's message */
#define SHM_MSG_MAX (4096 - 64)

/* CLOCK_MONOTONIC in ns (Python's time.monotonic_ns) */
static inline int64_t shm_now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}
#endif
