"""FP8 linears as FP8 GEMMs (opt-in): DeepSeek's own recipe, activations quantised per token and
128 columns (1x128, e4m3, scale amax/448), times the checkpoint's e4m3 weights and 128x128 block
scales, in one `torch._scaled_mm` (cuBLAS blockwise scaling: sm90, CUDA >= 12.9), instead of
dequantising the weight rows into the scratch on every call (qlinear's default).

MOESPLIT_FP8_GEMM=dequant (default) keeps the dequantisation; =scaled_mm takes the GEMM for every
FP8 linear that passes a check at load: eligible (CUDA capability 9.0, input width a multiple of
128, 128x128 blocks) and, on one random batch, within FP8_GEMM_TOLERANCE of the dequantising
path; any other linear keeps the dequantisation, with a warning naming why. The activations'
quantisation changes the numbers (to DeepSeek's reference inference's), so it stays opt-in until
`make gpu-check` has measured it (tests/test_gpu.py::test_fp8_gemm_against_dequant).
"""
from __future__ import annotations

import logging
import os

import torch

from gpu_service.model.qlinear import Fp8Linear

log = logging.getLogger("moesplit.fp8_gemm")

MODES = ("dequant", "scaled_mm")
E4M3_MAX = 448.0
FP8_GEMM_TOLERANCE = 0.05  # relative error of the check batch against the dequantising path
_scaled_mm = getattr(torch, "_scaled_mm", None)  # (a module name, so that CPU tests can emulate it)


def _capability(device: torch.device):
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def act_quant_1x128(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (K % 128 == 0) -> (e4m3 [M, K], float32 scales [M, K / 128] outer-dim-major, as
    cuBLAS's 1x128 blockwise scaling reads them): x ~= q * scale per 128-column group."""
    M, K = x.shape
    xb = x.view(M, K // 128, 128)
    s = xb.abs().amax(-1).float().clamp_(min=1e-12).div_(E4M3_MAX)  # [M, K/128]
    q = (xb.float() / s[..., None]).to(torch.float8_e4m3fn).view(M, K)
    return q, s.t().contiguous().t()


def gemm(m: Fp8Linear, x: torch.Tensor) -> torch.Tensor:
    """x [..., in] -> [..., out] in x's dtype through one blockwise-scaled FP8 GEMM (rows padded
    to a multiple of 4, cuBLASLt's minimum, with zeros)."""
    lead, K = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    pad = -M % 4
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, K)])
    q, s = act_quant_1x128(x2)
    y = _scaled_mm(q, m.weight.t(), scale_a=s, scale_b=m.weight_scale_inv.t(), out_dtype=x.dtype)
    y = y[:M] if pad else y
    if m.bias is not None:
        y = y + m.bias
    return y.view(*lead, m.out_features)


def unfit(m: Fp8Linear) -> str | None:
    """Why the FP8 GEMM cannot take this linear (None: it may)."""
    if _scaled_mm is None:
        return "this torch has no _scaled_mm"
    cap = _capability(m.weight.device)
    if cap != (9, 0):
        return f"cuBLAS blockwise FP8 scaling runs on capability 9.0, this device is {cap}"
    if m.block != (128, 128) or m.in_features % 128:
        return f"needs 128x128 blocks and an input width divisible by 128, got {m.block} and {m.in_features}"
    return None


def _check(m: Fp8Linear, dtype: torch.dtype) -> str | None:
    """Run the GEMM on one random batch against the dequantising path: why it failed, or None."""
    g = torch.Generator(device="cpu").manual_seed(m.in_features)
    x = torch.randn(5, m.in_features, generator=g).to(device=m.weight.device, dtype=dtype)
    try:
        got = gemm(m, x).float()
    except Exception as e:  # noqa: BLE001 - any failure keeps the dequantising path, named in the log
        return f"{type(e).__name__}: {e}"
    ref = super(Fp8Linear, m).forward(x).float()
    rel = ((got - ref).norm() / ref.norm().clamp(min=1e-12)).item()
    return None if rel <= FP8_GEMM_TOLERANCE else f"relative error {rel:.3g} > {FP8_GEMM_TOLERANCE}"


def enable(model: torch.nn.Module, dtype: torch.dtype, mode: str | None = None) -> int:
    """At load: the FP8 GEMM for every FP8 linear it passes (mode "scaled_mm"; MOESPLIT_FP8_GEMM),
    none with "dequant". Returns how many linears took it."""
    mode = mode or os.environ.get("MOESPLIT_FP8_GEMM", "dequant")
    if mode not in MODES:
        raise ValueError(f"MOESPLIT_FP8_GEMM={mode!r}: expected one of {MODES}")
    n, why = 0, {}
    for name, m in model.named_modules():
        if not isinstance(m, Fp8Linear):
            continue
        m.gemm = None
        if mode == "dequant":
            continue
        reason = unfit(m) or _check(m, dtype)
        if reason is None:
            m.gemm, n = gemm, n + 1
        else:
            why.setdefault(reason, []).append(name)
    for reason, names in why.items():
        log.warning("FP8 GEMM off for %d linear(s) (%s, ...): %s; they dequantise per call",
                    len(names), names[0], reason)
    if mode != "dequant":
        log.info("FP8 GEMM on for %d linear(s)", n)
    return n
