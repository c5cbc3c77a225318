/* native_remote.h: a whole all-decode step on CPU float32 in C, the expert hand-offs included (issue 20).
 *
 * native_decode.h computes one layer in three calls; between them Python still sent the layer's
 * call to the shards, waited for the answers and summed them: ~100 us of Python per MoE layer, paid
 * 58 times per token. nr_run runs every layer of the step here instead, with the shared-memory fast
 * paths (wire/shm.py) of one replica per shard group claimed for the step:
 *
 *   per micro-batch and layer: nd_attn; per group the rows that route to an expert it holds are
 *   written into the micro-batch's slot (hidden in the wire dtype, ids int64, weights f32) and its
 *   doorbell rung; nd_mlp (the shared expert) while the shards work; the answers received (bounded
 *   spin, then poll() up to the call deadline) and summed in group order; nd_add.
 *
 * With two micro-batches the order is the Python ping-pong's (deepseek._round_robin): while one
 * micro-batch's experts are on the shards, the other computes its attention.
 *
 * Nothing here recovers from a failure: at the first refusal, broken doorbell, deadline or signal
 * nr_run returns, says which path and which calls are still out, and the caller (native_decode.py)
 * settles them and runs the whole step again through the Python path, which owns failover and the
 * gRPC fallback. Re-running is safe: every layer writes the same cache rows at the same slots. */
#ifndef NATIVE_REMOTE_H
#define NATIVE_REMOTE_H
#include "native_decode.h"
#include "shm_wire.h"  /* wire/: the doorbell and slot constants, shared with the shard's C loop */

enum { NR_OK = 0, NR_BROKEN = 1, NR_TIMEOUT = 2, NR_REFUSED = 3, NR_INTR = 4 };

typedef struct {
    unsigned char *base;       /* the shared mapping */
    long slot_base[2];         /* byte offset of micro-batch 0's / 1's slot */
    long hidden_off, ids_off, w_off, out_off;  /* inside a slot (wire.shm.Layout) */
    int fd;                    /* the doorbell (SOCK_SEQPACKET) */
    int slot[2];
    int wire;                  /* 0 float32, 1 bfloat16, 2 float16 */
    const unsigned char *held; /* [E] 1 where the group holds the expert, NULL: every expert */
} NrPath;

typedef struct {               /* one call, for the client's observer (and the caller's bookkeeping) */
    int32_t layer, path, mb, rows;
    int32_t status;            /* -1: still out (no answer yet), else the shard's gRPC status code */
    int32_t slot;
    uint64_t seq;
    int64_t sent_ns, rtt_ns;   /* CLOCK_MONOTONIC of the send; round trip */
    uint64_t compute_us, server_us;
} NrCall;

typedef struct {               /* one micro-batch's place in the step (native_remote.c's own) */
    int next, pending, B, call0, ncall, h_wire;
    float *x1, *h, *sh, *routed, *w;
    const void *hsrc;              /* per-call mode: h rows already in the wire dtype (h_wire) */
    int64_t *ids;
    int *rows;
} NrMb;

typedef struct {
    int n_layers, H, k;
    const NdLayer *const *layers;  /* [n_layers] */
    const int *moe_layer;          /* [n_layers] layer id the shards know, -1: a dense layer */
    float *const *kv, *const *ik;  /* [n_layers] caches (ik entries NULL without an indexer) */
    int n_mb;                      /* 1 or 2 micro-batches */
    const NdStep *steps[2];
    float *x[2];                   /* [B, H] input of the first layer, output of the last */
    void *buf[2];                  /* nr_buf_bytes(B, H, k) each */
    int n_paths;
    NrPath *paths;
    double timeout_s, spin_s;
    uint64_t seq0;                 /* first doorbell seq (the caller keeps them apart from its own) */
    NrCall *calls;                 /* room for calls_cap: n_layers * n_paths * n_mb */
    int calls_cap, n_calls;
    NrMb mb[2];
    int fail_path;                 /* the path that failed (-1: none / a signal) */
    char fail_msg[SHM_MSG_MAX + 1]; /* a refusal's message, or what broke */
} NrRun;

/* Per-call hand-offs for the torch layer paths (fused / CUDA graphs / plain / the C layers driven
 * from Python): the same slot writes, doorbells, waits and sums as nr_run, one layer call at a time.
 * nr_send: h [B, H] float32, or already in the paths' wire dtype (h_wire), and w [B, k] read during
 * the call; ids [B, k] and rows ([B] ints of scratch) kept until nr_wait; nr_wait: routed [B, H]
 * float32 = the answers summed in path order. Both return NR_OK or a failure as nr_run. */
int nr_send(NrRun *r, int mb, int layer, const void *h, int h_wire, int64_t *ids, float *w, int B, int *rows);
int nr_wait(NrRun *r, int mb, float *routed);
size_t nr_buf_bytes(int B, int H, int k);
int nr_has_f16(void);  /* 1 where the compiler has _Float16 (float16 wire dtype) */
/* NR_OK, or the first failure (fail_path, fail_msg; calls with status -1 are still out) */
int nr_run(NrRun *r);
#endif
