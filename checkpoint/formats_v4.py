"""DeepSeek-V4 on-disk weight formats, numpy only, exact: MXFP4 experts and ue8m0-scaled block FP8.

ue8m0 scale (safetensors `F8_E8M0`): one unsigned byte e, value 2**(e - 127); e = 255 is NaN. No
sign, no mantissa, so every scale is a power of two.

Block FP8 (attention, shared experts, indexer wq_b, MTP projections): `X.weight` F8_E4M3 [out, in]
+ `X.scale` F8_E8M0 [ceil(out/128), ceil(in/128)]; value = w * 2**(e-127) per 128x128 block (edge
blocks may be partial). Unlike V3 the scale is named `.scale` and is e8m0, not f32
`weight_scale_inv`. Quantising (tiny checkpoints) picks the smallest power of two >= amax/448.

MXFP4 (routed experts of the instruct releases): `X.weight` I8 [out, in/2] + `X.scale` F8_E8M0
[out, in/32]. Byte j of a row holds element 2j in its low nibble and 2j+1 in its high nibble; a
nibble is e2m1: bit 3 the sign, bits 0-2 index the magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6. Each scale
covers 32 consecutive inputs of its row. value = e2m1(nibble) * 2**(e-127). Quantising picks the
smallest power of two >= amax/6 per group and rounds to the nearest e2m1 value (ties to the even
code, i.e. the one with mantissa bit 0).
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
FP8_MAX = 448.0
MXFP4_GROUP = 32
E2M1_MAX = 6.0
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
E2M1_VALUES = np.concatenate([E2M1_MAGNITUDES, -E2M1_MAGNITUDES]).astype(np.float32)  # code -> value
E8M0_BIAS = 127


def e8m0_to_f32(s: np.ndarray) -> np.ndarray:
    """F8_E8M0 scales (ml_dtypes float8_e8m0fnu or raw uint8 bytes) -> float32 2**(e-127); 255 -> NaN."""
    e = np.asarray(s).view(np.uint8).astype(np.int32)
    out = np.ldexp(np.float32(1.0), np.minimum(e, 254) - E8M0_BIAS).astype(np.float32)  # 2**-127: f32 subnormal, exact
    return np.where(e == 255, np.float32(np.nan), out).astype(np.float32)


def pow2_scale_e8m0(amax: np.ndarray, qmax: float) -> np.ndarray:
    """Smallest power of two s with amax / s <= qmax, as F8_E8M0 (all-zero groups get 2**0)."""
    amax = np.asarray(amax, np.float64)
    ratio = np.where(amax > 0, amax / qmax, 1.0)
    e = np.clip(np.ceil(np.log2(ratio)), -E8M0_BIAS, 127).astype(np.int32)
    return (e + E8M0_BIAS).astype(np.uint8).view(E8M0)


def _check_2d(w: np.ndarray, what: str) -> None:
    if np.ndim(w) != 2:
        raise ValueError(f"{what}: expected a 2-D [out, in] weight, got shape {np.shape(w)}")


# ---------------------------------------------------------------------------------------------
# block FP8, ue8m0 scales
# ---------------------------------------------------------------------------------------------
def fp8_e8m0_scale_shape(shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    """Shape of `.scale` for an FP8 weight [out, in]."""
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def _block_scale_full(scale: np.ndarray, shape: tuple[int, int], block: tuple[int, int]) -> np.ndarray:
    """[so, si] f32 block scales -> [out, in] (edge blocks cut)."""
    bo, bi = block
    return np.repeat(np.repeat(scale, bo, axis=0), bi, axis=1)[: shape[0], : shape[1]]


def quant_fp8_e8m0(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float -> (e4m3 [out, in], F8_E8M0 scale [ceil(out/bo), ceil(in/bi)])."""
    _check_2d(w, "quant_fp8_e8m0")
    w = np.asarray(w, np.float32)
    so, si = fp8_e8m0_scale_shape(w.shape, block)
    bo, bi = block
    padded = np.zeros((so * bo, si * bi), np.float32)
    padded[: w.shape[0], : w.shape[1]] = w
    scale = pow2_scale_e8m0(np.abs(padded.reshape(so, bo, si, bi)).max(axis=(1, 3)), FP8_MAX)
    full = _block_scale_full(e8m0_to_f32(scale), w.shape, block)
    q = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(FP8_E4M3)  # division by a power of two: exact
    return q, scale


def dequant_fp8_e8m0(w: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """e4m3 [out, in] * per-block 2**(e-127) -> float32 [out, in]."""
    _check_2d(w, "dequant_fp8_e8m0")
    want = fp8_e8m0_scale_shape(w.shape, block)
    if tuple(np.shape(scale)) != want:
        raise ValueError(f"dequant_fp8_e8m0: scale shape {tuple(np.shape(scale))} does not match weight {w.shape} "
                         f"with block {tuple(block)} (expected {want}); check quantization_config.weight_block_size")
    return np.asarray(w).astype(np.float32) * _block_scale_full(e8m0_to_f32(scale), w.shape, block)


# ---------------------------------------------------------------------------------------------
# MXFP4: e2m1 nibbles, low nibble first, ue8m0 scale per 32 inputs
# ---------------------------------------------------------------------------------------------
def mxfp4_shapes(shape: tuple[int, int]) -> dict[str, tuple[int, int]]:
    """Stored shapes of an MXFP4 weight of logical shape (out, in): `weight` I8 and `scale` E8M0."""
    out, inp = shape
    if inp % MXFP4_GROUP:
        raise ValueError(f"MXFP4: input dim {inp} is not a multiple of {MXFP4_GROUP}")
    return {"weight": (out, inp // 2), "scale": (out, inp // MXFP4_GROUP)}


def unpack_mxfp4_codes(packed: np.ndarray) -> np.ndarray:
    """I8 [out, in/2] -> e2m1 codes uint8 [out, in] (element 2j = low nibble of byte j)."""
    b = np.asarray(packed).view(np.uint8)
    codes = np.empty((b.shape[0], b.shape[1] * 2), np.uint8)
    codes[:, 0::2] = b & 0x0F
    codes[:, 1::2] = b >> 4
    return codes


def pack_mxfp4_codes(codes: np.ndarray) -> np.ndarray:
    """e2m1 codes uint8 [out, in] (in even) -> I8 [out, in/2], low nibble first."""
    c = np.asarray(codes, np.uint8)
    if c.shape[1] % 2:
        raise ValueError(f"pack_mxfp4_codes: input dim {c.shape[1]} must be even")
    return ((c[:, 0::2] & 0x0F) | ((c[:, 1::2] & 0x0F) << 4)).astype(np.uint8).view(np.int8)


def dequant_mxfp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """(I8 [out, in/2], F8_E8M0 [out, in/32]) -> float32 [out, in]."""
    _check_2d(packed, "dequant_mxfp4")
    out, half = np.shape(packed)
    want = (out, half * 2 // MXFP4_GROUP)
    if tuple(np.shape(scale)) != want or (half * 2) % MXFP4_GROUP:
        raise ValueError(f"dequant_mxfp4: scale shape {tuple(np.shape(scale))} does not match packed weight "
                         f"{(out, half)} (expected {want}: one scale per {MXFP4_GROUP} inputs)")
    vals = E2M1_VALUES[unpack_mxfp4_codes(packed)]  # [out, in]
    return vals * np.repeat(e8m0_to_f32(scale), MXFP4_GROUP, axis=1)


def _e2m1_codes(x: np.ndarray) -> np.ndarray:
    """Nearest e2m1 code of each float in [-6, 6] (ties to the even code)."""
    mag = np.abs(x)
    dist = np.abs(mag[..., None] - E2M1_MAGNITUDES)  # [..., 8]
    # ties: equal distance to codes k and k+1 -> argmin picks k first; prefer the even one
    best = np.argmin(dist, axis=-1)
    tie_up = (best % 2 == 1) & (best + 1 < 8)
    nxt = np.minimum(best + 1, 7)
    tie = tie_up & np.isclose(np.take_along_axis(dist, nxt[..., None], -1)[..., 0],
                              np.take_along_axis(dist, best[..., None], -1)[..., 0], rtol=0, atol=0)
    best = np.where(tie, nxt, best)
    sign = (np.signbit(x) & (best > 0)).astype(np.uint8) << 3
    return best.astype(np.uint8) | sign


def quant_mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float (in a multiple of 32) -> (I8 [out, in/2], F8_E8M0 [out, in/32])."""
    _check_2d(w, "quant_mxfp4")
    w = np.asarray(w, np.float32)
    out, inp = w.shape
    mxfp4_shapes(w.shape)  # validates the group multiple
    groups = w.reshape(out, inp // MXFP4_GROUP, MXFP4_GROUP)
    scale = pow2_scale_e8m0(np.abs(groups).max(axis=2), E2M1_MAX)  # [out, in/32]
    scaled = groups / e8m0_to_f32(scale)[:, :, None]
    return pack_mxfp4_codes(_e2m1_codes(scaled).reshape(out, inp)), scale
