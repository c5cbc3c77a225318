"""On-disk weight formats, numpy only: DeepSeek block FP8 and compressed-tensors INT4.

DeepSeek FP8 (DeepSeek-V3/R1/V3.2): `weight` float8_e4m3fn [out, in] plus `weight_scale_inv`
float32 [ceil(out/bo), ceil(in/bi)], one scale per (bo x bi) block (128x128); the real value is
`weight * weight_scale_inv` (the name says inv, but it multiplies). Edge blocks may be partial.

compressed-tensors "pack-quantized" INT4 (Kimi-K2-Thinking), as in compressed-tensors'
`pack_to_int32` / `unpack_from_int32` and `calculate_qparams`:
  - symmetric, group-wise along the input dim: scale = amax(|w| in group) / 7.5
    (bit_range/2 with bit_range = q_max - q_min = 7 - (-8) = 15), clamped to >= float32 eps, stored
    bf16; q = clamp(round_half_even(w / scale), -8, 7) computed with the bf16-rounded scale.
  - stored as q + 8 in 4-bit nibbles, eight per int32, least-significant nibble first, along the
    input dim: weight_packed int32 [out, ceil(in/8)], weight_scale bf16 [out, ceil(in/group)],
    weight_shape int32 [2] = (out, in).
  - `in` not a multiple of 8: the last int32 of each row is padded with raw nibble 0 (what
    compressed-tensors does: it pads after adding the offset); unpack drops the padding using
    weight_shape. `in` not a multiple of group_size: the last group is partial (its scale covers
    the remaining columns only), so weight_scale has ceil(in/group) columns.
  - dequantised value = q * scale.
"""
from __future__ import annotations

import math

import ml_dtypes
import numpy as np

FP8_E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
BF16 = np.dtype(ml_dtypes.bfloat16)
FP8_MAX = 448.0
INT4_MIN, INT4_MAX = -8, 7
INT4_SCALE_DIV = (INT4_MAX - INT4_MIN) / 2.0  # 7.5, as compressed-tensors calculate_qparams


def _check_2d(w: np.ndarray, what: str) -> None:
    if w.ndim != 2:
        raise ValueError(f"{what}: expected a 2-D [out, in] weight, got shape {w.shape}")


# ---------------------------------------------------------------------------------------------
# DeepSeek block FP8
# ---------------------------------------------------------------------------------------------
def fp8_scale_shape(shape: tuple[int, int], block: tuple[int, int] = (128, 128)) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def quant_fp8_block(w: np.ndarray, block: tuple[int, int] = (128, 128)) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float -> (e4m3 [out, in], scale_inv f32 [ceil(out/bo), ceil(in/bi)]).

    scale_inv = amax(|block|) / 448; all-zero blocks get scale_inv 1.0."""
    _check_2d(w, "quant_fp8_block")
    w = np.asarray(w, dtype=np.float32)
    out, inp = w.shape
    bo, bi = block
    so, si = fp8_scale_shape(w.shape, block)
    padded = np.zeros((so * bo, si * bi), np.float32)
    padded[:out, :inp] = w
    amax = np.abs(padded.reshape(so, bo, si, bi)).max(axis=(1, 3))  # [so, si]
    scale_inv = np.where(amax > 0, amax / FP8_MAX, 1.0).astype(np.float32)
    full = np.repeat(np.repeat(scale_inv, bo, axis=0), bi, axis=1)[:out, :inp]
    # clip: e4m3fn has no inf, a value a hair above 448 after the division would become NaN
    q = np.clip(w / full, -FP8_MAX, FP8_MAX).astype(FP8_E4M3)
    return q, scale_inv


def dequant_fp8_block(w: np.ndarray, scale_inv: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """e4m3 [out, in] * per-block scale_inv -> float32 [out, in] (partial edge blocks allowed)."""
    _check_2d(w, "dequant_fp8_block")
    out, inp = w.shape
    want = fp8_scale_shape(w.shape, block)
    if tuple(scale_inv.shape) != want:
        raise ValueError(
            f"dequant_fp8_block: weight_scale_inv shape {tuple(scale_inv.shape)} does not match weight "
            f"{w.shape} with block {tuple(block)} (expected {want}); check quantization_config.weight_block_size"
        )
    bo, bi = block
    full = np.repeat(np.repeat(np.asarray(scale_inv, np.float32), bo, axis=0), bi, axis=1)[:out, :inp]
    return np.asarray(w).astype(np.float32) * full


# ---------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized INT4
# ---------------------------------------------------------------------------------------------
def int4_shapes(shape: tuple[int, int], group_size: int = 32) -> dict[str, tuple[int, ...]]:
    """Stored shapes of an INT4 weight of logical shape (out, in)."""
    out, inp = shape
    return {
        "weight_packed": (out, math.ceil(inp / 8)),
        "weight_scale": (out, math.ceil(inp / group_size)),
        "weight_shape": (2,),
    }


def pack_int4(w: np.ndarray, group_size: int = 32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] float -> (weight_packed int32 [out, ceil(in/8)], weight_scale bf16
    [out, ceil(in/group)], weight_shape int32 [2]); symmetric, see the module docstring."""
    _check_2d(w, "pack_int4")
    w = np.asarray(w, dtype=np.float32)
    out, inp = w.shape
    ng = math.ceil(inp / group_size)
    padded = np.zeros((out, ng * group_size), np.float32)
    padded[:, :inp] = w
    amax = np.abs(padded.reshape(out, ng, group_size)).max(axis=2)  # [out, ng]
    scale = np.maximum(amax / INT4_SCALE_DIV, np.finfo(np.float32).eps).astype(BF16)
    full = np.repeat(scale.astype(np.float32), group_size, axis=1)[:, :inp]
    q = np.clip(np.round(w / full), INT4_MIN, INT4_MAX).astype(np.int32)  # [out, in] in [-8, 7]
    packed = _pack_nibbles((q - INT4_MIN).astype(np.uint32))
    return packed, scale, np.array([out, inp], dtype=np.int32)


def _pack_nibbles(nib: np.ndarray) -> np.ndarray:
    """uint32 values in [0, 15], [out, in] -> int32 [out, ceil(in/8)], least-significant first."""
    out, inp = nib.shape
    n = math.ceil(inp / 8)
    padded = np.zeros((out, n * 8), np.uint32)  # padding nibbles are raw 0
    padded[:, :inp] = nib
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    packed = np.bitwise_or.reduce(padded.reshape(out, n, 8) << shifts, axis=2)
    return packed.astype(np.uint32).view(np.int32)


def unpack_int4_q(packed: np.ndarray, shape) -> np.ndarray:
    """weight_packed int32 [out, ceil(in/8)] -> signed q int8 [out, in] in [-8, 7]."""
    out, inp = (int(s) for s in np.asarray(shape).reshape(-1)[:2])
    packed = np.asarray(packed)
    if packed.dtype != np.int32 or packed.shape != (out, math.ceil(inp / 8)):
        raise ValueError(
            f"unpack_int4: weight_packed must be int32 {(out, math.ceil(inp / 8))} for weight_shape "
            f"{(out, inp)}, got {packed.dtype} {packed.shape}"
        )
    shifts = (np.arange(8, dtype=np.uint32) * 4)[None, None, :]
    nib = (packed.view(np.uint32)[:, :, None] >> shifts) & np.uint32(0xF)  # [out, n, 8]
    return (nib.reshape(out, -1)[:, :inp].astype(np.int8) + np.int8(INT4_MIN)).astype(np.int8)


def unpack_int4(packed: np.ndarray, scale: np.ndarray, shape, group_size: int = 32) -> np.ndarray:
    """(weight_packed, weight_scale, weight_shape) -> float32 [out, in] = q * scale."""
    q = unpack_int4_q(packed, shape)
    out, inp = q.shape
    want = (out, math.ceil(inp / group_size))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"unpack_int4: weight_scale shape {tuple(scale.shape)} does not match weight_shape {(out, inp)} "
            f"with group_size {group_size} (expected {want}); check the config group's group_size"
        )
    full = np.repeat(np.asarray(scale).astype(np.float32), group_size, axis=1)[:, :inp]
    return q.astype(np.float32) * full


# ---------------------------------------------------------------------------------------------
# INT8, symmetric per output channel (the CPU kernels' int8 layout)
# ---------------------------------------------------------------------------------------------
INT8_MAX = 127


def quant_int8_channel(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """w [out, in] float -> (q int8 [out, in] in [-127, 127], scale f32 [out]); value = q * scale.

    Exactly what the CPU kernels do when handed float weights for int8 (moe_pack.c prep_row):
    scale = amax(|row|) / 127 in float32, q = round_half_even(w / scale); an all-zero row gets
    scale 0 and q 0. So quantising here and dequantising into the kernels reproduces this q."""
    _check_2d(w, "quant_int8_channel")
    w = np.asarray(w, dtype=np.float32)
    scale = (np.abs(w).max(axis=1) / np.float32(INT8_MAX)).astype(np.float32)  # [out]
    safe = np.where(scale > 0, scale, np.float32(1))[:, None]
    q = np.where(scale[:, None] > 0, np.clip(np.round(w / safe), -INT8_MAX, INT8_MAX), 0).astype(np.int8)
    return q, scale


def dequant_int8_channel(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """int8 [out, in] * scale f32 [out] (or [out, 1]) -> float32 [out, in]."""
    _check_2d(q, "dequant_int8_channel")
    s = np.asarray(scale, dtype=np.float32).reshape(-1)
    if s.shape != (q.shape[0],):
        raise ValueError(f"dequant_int8_channel: weight_scale shape {tuple(np.shape(scale))} does not match "
                         f"weight {q.shape} (expected one scale per output channel: [{q.shape[0]}])")
    return np.asarray(q).astype(np.float32) * s[:, None]


def as_format(w: np.ndarray, fmt: str) -> np.ndarray:
    """The float32 values `w` [out, in] takes once stored in `fmt` (bf16, int8 per channel, int4
    group 32; f32/fp8/f16 unchanged): what the CPU kernels hold, for the numpy reference."""
    w = np.asarray(w, dtype=np.float32)
    if fmt == "bf16":
        return w.astype(BF16).astype(np.float32)
    if fmt == "int8":
        return dequant_int8_channel(*quant_int8_channel(w))
    if fmt == "int4":
        packed, scale, shape = pack_int4(w)
        return unpack_int4(packed, scale, shape)
    return w
