"""The vision tower's GPU bytes in the memory plan (Kimi-K2.5 / K2.6): weights, the activation
workspace of the largest image the preprocessing allows, and the image-embedding cache.

The tower runs on the first GPU (beside the embeddings), one image at a time:
- weights: the tower + projector parameters in the compute dtype (checkpoint.kimi_k25.vision_shapes);
- workspace: per patch, the residual, the LayerNorm output, fused q/k/v, the attention output and
  the MLP's two [inter] activations in the compute dtype, plus float32 LayerNorm and RoPE
  temporaries (5 x hidden); the attention itself is a fused kernel on CUDA (no patches^2 scores).
  The largest image: the most padded patches any size can give (at most 16384 before padding);
- the embedding cache (gpu_service.runtime.images.ImageEmbeddings): EMBED_CACHE_BYTES (its size, set here).
"""
from __future__ import annotations

from checkpoint import kimi_k25
from checkpoint.kimi_k25 import MAX_PATCHES, MAX_SIDE_PATCHES, MERGE, PATCH

EMBED_CACHE_BYTES = 256 << 20  # the image-embedding cache on the GPU (runtime.images.ImageEmbeddings)


def max_image_patches() -> int:
    """The most patches (after padding to the 2x2 merge) of any image the preprocessing allows."""
    best = 0
    for gh in range(1, MAX_SIDE_PATCHES + 1):
        gw = min(MAX_SIDE_PATCHES, MAX_PATCHES // gh)
        best = max(best, (-(-(gh + 1) // MERGE) * MERGE) * (-(-(gw + 1) // MERGE) * MERGE))
    return best


def vision_bytes(cfg, eb: int) -> dict | None:
    """{"params", "weights", "workspace", "cache", "total", "patches"} of cfg's vision tower on the GPU
    in a compute dtype of `eb` bytes, or None for a text-only model."""
    mm = getattr(cfg, "multimodal", None)
    if not mm:
        return None
    vc = mm.get("vision_config") or {}
    params = kimi_k25.vision_param_count(vc, cfg.hidden_size)
    d, inter = int(vc.get("vt_hidden_size", 1152)), int(vc.get("vt_intermediate_size", 4304))
    n = max_image_patches()
    per_patch = eb * (6 * d + 2 * inter + 3 * PATCH * PATCH) + 4 * 5 * d
    tokens = n // (MERGE * MERGE)
    out_ws = tokens * (4 * MERGE * MERGE * d * 2 + eb * cfg.hidden_size)  # projector LN (fp32) + the embeddings
    ws = n * per_patch + out_ws
    weights = params * eb
    return {"params": params, "weights": weights, "workspace": ws, "cache": EMBED_CACHE_BYTES,
            "total": weights + ws + EMBED_CACHE_BYTES, "patches": n}
