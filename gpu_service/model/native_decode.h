/* native_decode.h: one DeepSeek-V3 layer of an all-decode step on CPU in float32, in C (issue 20).
 *
 * The torch fused path (fast_decode.py) costs ~110 torch ops per layer, each >= 3 us of dispatch
 * on CPU: the fixed cost of a 61-layer decode step is the op count. This file computes the same
 * layer (everything but the routed experts) in plain C loops over the step's rows:
 *
 *   nd_attn  input norm, q_a / q_b (or q), kv_a, the q_a and kv_a norms, RoPE, the absorbed query,
 *            (V3.2) the lightning indexer's new key, query and head weights and its top-k selection,
 *            the step's new cache rows written at their slots, attention over each sequence's
 *            paged slots (its own length: no padding enters a row's arithmetic), W_UV, o_proj,
 *            residual, post-attention norm, and (MoE) the router's group-limited top-k.
 *   nd_mlp   the shared expert or the dense MLP.
 *   nd_add   residual + routed (+ shared).
 *
 * Every row is computed alone, in one fixed summation order (8-lane partial sums reduced in a
 * fixed tree, no FMA contraction: -ffp-contract=off), so a sequence's bits do not depend on what
 * it is batched with, on the micro-batch split, or on the ISA the dispatcher picked.
 * Weights are the model's own float32 tensors (pointers, no copies): [out, in] row-major. */
#ifndef NATIVE_DECODE_H
#define NATIVE_DECODE_H
#include <stddef.h>
#include <stdint.h>

typedef struct {
    int H, nh, nope, rd, r, vd;   /* hidden, heads, qk_nope / qk_rope / kv_lora / v head dims */
    int qlr;                      /* q_lora_rank, 0: q_proj directly */
    int interleave;               /* RoPE input pairs interleaved (DeepSeek) or half-split */
    float eps_in, eps_q, eps_kv, eps_post, scaling;
    const float *in_norm, *q_norm, *kv_norm, *post_norm;
    const float *w_q;             /* q_a_proj [qlr, H], or q_proj [nh (nope + rd), H] */
    const float *w_kva;           /* kv_a_proj_with_mqa [r + rd, H] */
    const float *w_qb;            /* q_b_proj [nh (nope + rd), qlr] or NULL */
    const float *w_kvb;           /* kv_b_proj [nh (nope + vd), r] */
    const float *w_o;             /* o_proj [H, nh vd] */
    /* router (NULL w_router: a dense layer) */
    int E, k, n_group, topk_group, norm_topk;
    float route_scale;
    const float *w_router, *router_bias;  /* [E, H], [E] */
    /* shared expert / dense MLP (NULL w_gate: none) */
    int inter;
    const float *w_gate, *w_up, *w_down;  /* [inter, H], [inter, H], [H, inter] */
    /* DeepSeek-V3.2 lightning indexer (ih 0: none): heads, head dim, top-k; k_norm eps,
     * softmax_scale (ihd^-0.5), head-weight scale (ih^-0.5) */
    int ih, ihd, itopk;
    float ieps, iscale, iwscale;
    const float *w_iq;            /* wq_b [ih ihd, qlr] */
    const float *w_ik;            /* wk [ihd, H] */
    const float *ik_norm_w, *ik_norm_b;  /* k_norm (LayerNorm) [ihd] */
    const float *w_iw;            /* weights_proj [ih, H] */
} NdLayer;

typedef struct {
    int B;                        /* rows (one decode token per sequence) */
    long smax;                    /* key_slots' row stride */
    const int64_t *write_slots;   /* [B] the pool slot of each new token */
    const int64_t *key_slots;     /* [B, smax] each sequence's slots, position order */
    const int64_t *lengths;       /* [B] keys each query sees (its position + 1) */
    const float *cos, *sin;       /* [B, rd / 2] */
    float *scratch;               /* nd_scratch_floats(L, B, smax) floats (the most any layer needs) */
} NdStep;

size_t nd_scratch_floats(const NdLayer *L, int B, long smax);
/* x [B, H] -> x1 = x + attention [B, H], h = post norm [B, H]; MoE: ids [B, k], w [B, k]
 * (best selection score first: sigmoid + correction bias; ties to the lower expert id). kv [slots, r + rd] is written at write_slots.
 * V3.2: ik [slots, ihd] (the index keys) is written too, and a query with more than itopk keys
 * attends to its itopk best by index score (ties to the earlier position). */
void nd_attn(const NdLayer *L, const NdStep *S, float *kv, float *ik, const float *x, float *x1, float *h,
             int64_t *ids, float *w);
/* out [B, H] = down(silu(gate h) * up h); scratch: the step's (nd_mlp uses B rows of it) */
void nd_mlp(const NdLayer *L, int B, const float *h, float *out, float *scratch);
/* out[i] = (a[i] + b[i]) + x[i], or x[i] + a[i] when b is NULL */
void nd_add(long n, const float *x, const float *a, const float *b, float *out);
#endif
