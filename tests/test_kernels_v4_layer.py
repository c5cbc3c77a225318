"""A DeepSeek-V4-shaped MoE layer on the C kernels against float64 numpy: H 4096, I 2048, all 256
routed experts held in MXFP4 as a checkpoint stores them (e2m1 nibbles + e8m0 bytes), top-6 routing,
and V4's clamp (swiglu_limit 10: silu(min(g, L)) * clamp(u, -L, L)), on every ISA this CPU runs
natively. The small-shape tests (test_kernels.py, test_v4_experts.py) cover the same code at every
token-count path and under the SIMDe / AMX emulation builds; this one checks the real layer sizes
(group counts, panel counts, the pool's offsets past 2^32 bytes) end to end.

To keep the pool's 3.4 GiB and the set-up time small, the 256 experts share 8 random code tensors
and each has its own random e8m0 scales, so no two experts hold the same weights."""
from __future__ import annotations

import numpy as np
import pytest

from checkpoint.formats_v4 import dequant_mxfp4, pack_mxfp4_codes
from cpu_expert_service import kernel_backend as kb

H, I, E, TOPK, LIMIT = 4096, 2048, 256, 6, 10.0
ISAS_HERE = [isa for isa in ("avx512", "avx2", "generic") if isa in kb.AVAILABLE_ISAS]


def reference(deq, x, ids, w, limit):
    """sum_j w[t, j] * down @ (silu(min(gate x, L)) * clamp(up x, -L, L)) in float64 (no clamp: limit None)."""
    out = np.zeros(x.shape, dtype=np.float64)
    for t in range(x.shape[0]):
        xt = x[t].astype(np.float64)
        for e, wt in zip(ids[t], w[t]):
            g, u, d = deq(int(e))
            gx, ux = g @ xt, u @ xt
            if limit is not None:
                gx, ux = np.minimum(gx, limit), np.clip(ux, -limit, limit)
            out[t] += wt * (d @ (gx / (1 + np.exp(-gx)) * ux))
    return out


def v4_layer(isa, act_bits):
    """A kernels backend holding all 256 experts of one V4-Flash-sized layer, and expert -> its
    stored tensors (codes packed as the checkpoint's blocks, e8m0 scales)."""
    rng = np.random.default_rng(29)
    codes = [[pack_mxfp4_codes(rng.integers(0, 16, size=s, dtype=np.uint8)) for s in ((I, H), (I, H), (H, I))]
             for _ in range(8)]
    be = kb.KernelExperts("mxfp4", num_threads=2, isa=isa, swiglu_limit=LIMIT, act_bits=act_bits)
    stored = {}
    for e in range(E):
        # weights ~ 2^-6 x e2m1: gate/up pre-activations of a few tens, so the clamp acts on many of them
        scales = [rng.integers(119, 124, size=(o, i // 32), dtype=np.uint8) for o, i in ((I, H), (I, H), (H, I))]
        stored[e] = [a for pair in zip(codes[e % 8], scales) for a in pair]
        be.add_expert_mxfp4(0, e, *stored[e])
    be.finalize()
    return be, stored


@pytest.mark.parametrize("act_bits,tol", [(16, 1e-3), (8, 3e-2)])
@pytest.mark.parametrize("isa", ISAS_HERE)
def test_v4_flash_layer_mxfp4_clamped_matches_numpy(isa, act_bits, tol):
    """1 and 5 tokens, top-6 of 256 experts: the kernels' output within `tol` (relative, whole
    output) of float64 math on the stored weights with the clamp, far from the unclamped math, and
    each row of the 5-token call bit-equal to that token alone (batch invariance at this size)."""
    be, stored = v4_layer(isa, act_bits)
    assert be.expert_bytes(0, 0) == 3 * H * I * 17 // 32  # 4.25 bits a weight, as stored
    cache = {}

    def deq(e):
        if e not in cache:
            s = stored[e]
            cache[e] = tuple(dequant_mxfp4(s[2 * j], s[2 * j + 1]) for j in range(3))
        return cache[e]

    rng = np.random.default_rng(7)
    x = (4.0 * rng.standard_normal((5, H))).astype(np.float32)
    ids = np.stack([rng.choice(E, TOPK, replace=False) for _ in range(5)]).astype(np.int64)
    w = rng.random((5, TOPK), dtype=np.float32)
    out = be.forward(0, x, ids, w)
    want = reference(deq, x, ids, w, LIMIT)
    unclamped = reference(deq, x, ids, w, None)
    err = np.linalg.norm(out - want) / np.linalg.norm(want)
    print(f"\nV4 layer mxfp4 {isa} a{act_bits}: relative error {err:.2e}, "
          f"clamp changes the output by {np.linalg.norm(unclamped - want) / np.linalg.norm(want):.2f}")
    assert err < tol
    assert np.linalg.norm(unclamped - want) > 0.2 * np.linalg.norm(want)
    for t in range(5):
        np.testing.assert_array_equal(be.forward(0, x[t:t + 1], ids[t:t + 1], w[t:t + 1])[0], out[t])
