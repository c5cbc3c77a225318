"""What the shard side needs to know per model architecture (DeepSeek-V3 family or DeepSeek-V4).

The routed experts' tensor names (checkpoint.names or checkpoint.names_v4), the SwiGLU clamp the
backends apply (V4's `swiglu_limit`; none for V3), the check that a V4 expert format held as
bf16 by the kernels is exact, and the hand-over of stored MXFP4 experts to mxfp4 kernels. Numpy only (no torch), like the rest of the shard.
"""
from __future__ import annotations

import numpy as np

from checkpoint.reader import CheckpointError

V4_EXACT_IN_BF16 = ("mxfp4", "fp8_e8m0")  # DeepSeek-V4 expert formats the kernels can hold as bf16, exactly
MXFP4_GROUP = 32  # inputs per e8m0 scale: an intermediate slice held as mxfp4 starts and ends on one


def expert_weight_name(cfg):
    """The routed-expert weight naming of cfg's architecture: (layer, expert, gate|up|down) -> name."""
    if cfg.is_v4:
        from checkpoint.names_v4 import expert_weight
    else:
        from checkpoint.names import expert_weight
    return expert_weight


def swiglu_limit_of(cfg) -> float | None:
    """The experts' SwiGLU clamp of cfg's model: DeepSeek-V4's swiglu_limit, None for V3-family."""
    return float(cfg.swiglu_limit) if cfg.is_v4 else None


def add_mxfp4_expert(be, layer: int, expert: int, stored: list[dict], names: list[str], file_of) -> None:
    """Hand one expert's stored MXFP4 arrays (gate, up, down: {"weight" I8 [out, in/2], "scale" E8M0
    [out, in/32]}, already cut to the slice) to mxfp4 kernels as they are. A scale byte 255 (e8m0
    NaN) is refused here: it is corrupt data, and the kernels would turn the whole group into NaN."""
    for name, a in zip(names, stored):
        if (np.asarray(a["scale"]).view(np.uint8) == 255).any():
            raise CheckpointError(f"{file_of(name)}: tensor {name!r}: an e8m0 scale is 255 (NaN); the file is "
                                  "corrupt: re-download or re-write it")
    be.add_expert_mxfp4(layer, expert, *(a[k] for a in stored for k in ("weight", "scale")))


def check_mxfp4_slice(i0: int, i1: int, what: str) -> None:
    """Refuse an intermediate slice [i0, i1) that does not start and end on an e8m0 group."""
    if i0 % MXFP4_GROUP or i1 % MXFP4_GROUP:
        raise ValueError(f"{what} = intermediate [{i0}:{i1}) does not align to the MXFP4 group of {MXFP4_GROUP}; "
                         "use a slice count whose slices are multiples of 32, --weight-format bf16, or "
                         "--backend numpy")


def bf16_exact(w: np.ndarray, path: str, name: str) -> None:
    """Refuse a weight that bf16 cannot hold exactly. MXFP4 (e2m1: 2 significant bits, x 2^k with
    k >= -127) always fits bf16's 8-bit significand and f32's exponent range; FP8-e8m0 (e4m3: 4
    bits) does unless its block scale is below 2^-124 (never in a real checkpoint)."""
    # bf16 is f32's top 16 bits (subnormals included): exact iff the low 16 bits are zero
    if (np.ascontiguousarray(w, dtype=np.float32).view(np.uint32) & 0xFFFF).any():
        raise CheckpointError(f"{path}: tensor {name!r} is not exactly representable in bf16 (block scale "
                               "below 2^-124?); serve it with --backend numpy or --weight-format int8")
