"""Weight-only quantised linears for the GPU service: FP8 (e4m3, 128x128 block scales, as in
DeepSeek's checkpoints) and INT8 (per-output-channel scales). Weights stay quantised in memory
and are dequantised on the fly inside `forward`, halving attention/shared-expert bytes vs BF16.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn


def _expand_blocks(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    # scale: [ceil(out/bo), ceil(in/bi)] -> [out, in] (edge blocks cropped)
    bo, bi = block
    return scale.repeat_interleave(bo, 0).repeat_interleave(bi, 1)[: shape[0], : shape[1]]


class Fp8Linear(nn.Module):
    """y = x @ (w_e4m3 * scale_inv[block]).T"""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128), bias=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] float8_e4m3fn
        self.weight_scale_inv = nn.Parameter(scale_inv.float(), requires_grad=False)  # [out/bo, in/bi]
        self.block = tuple(block)
        self.bias = bias

    @staticmethod
    def quantize(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
        """float [out, in] -> (e4m3 weight, f32 scale_inv per block), as checkpoint.formats does."""
        from checkpoint.formats import quant_fp8_block

        q, s = quant_fp8_block(w.detach().float().cpu().numpy(), tuple(block))
        return torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn), torch.from_numpy(s)

    def dequant_weight(self, dtype: torch.dtype) -> torch.Tensor:
        s = _expand_blocks(self.weight_scale_inv, tuple(self.weight.shape), self.block)
        return (self.weight.to(torch.float32) * s).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequant_weight(x.dtype), self.bias)


class Int8Linear(nn.Module):
    """y = x @ (w_int8 * scale[out]).T, symmetric per-output-channel scale = amax/127."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] int8
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)  # [out]
        self.bias = bias

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    def dequant_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequant_weight(x.dtype), self.bias)


class Int4Linear(nn.Module):
    """Symmetric group-wise INT4 (compressed-tensors pack-quantized: eight 4-bit values per int32
    along the input dim, least-significant first, stored as q+8; one bf16 scale per group)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], group: int = 32, bias=None):
        super().__init__()
        self.weight_packed = nn.Parameter(packed, requires_grad=False)  # [out, ceil(in/8)] int32
        self.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out, ceil(in/group)] bf16
        self.shape, self.group, self.bias = tuple(shape), group, bias

    @staticmethod
    def quantize(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        """float [out, in] -> (packed int32, bf16 scales), exactly as checkpoint.formats.pack_int4."""
        from checkpoint.formats import pack_int4

        packed, scale, _ = pack_int4(w.detach().float().cpu().numpy(), group)
        return torch.from_numpy(packed), torch.from_numpy(scale.view(np.int16)).view(torch.bfloat16)

    def dequant_weight(self, dtype: torch.dtype) -> torch.Tensor:
        out, inn = self.shape
        shifts = 4 * torch.arange(8, device=self.weight_packed.device, dtype=torch.int32)
        q = ((self.weight_packed[..., None] >> shifts) & 0xF).view(out, -1)[:, :inn] - 8  # [out, in]
        s = self.weight_scale.float().repeat_interleave(self.group, dim=1)[:, :inn]
        return (q.float() * s).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequant_weight(x.dtype), self.bias)


def weight_of(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The (dequantised) weight of a plain or quantised linear, in `dtype`."""
    if isinstance(linear, (Fp8Linear, Int8Linear, Int4Linear)):
        return linear.dequant_weight(dtype)
    return linear.weight.to(dtype)


def make_quantized(w: torch.Tensor, fmt: str, device: torch.device, stored=None,
                   fp8_block: tuple[int, int] = (128, 128)) -> nn.Module:
    """A weight-only quantised linear of format `fmt` ("fp8"|"int8") from a float weight, or from
    the checkpoint's own FP8 arrays `stored=(e4m3 weight, scale_inv)` without re-quantising (then
    `fp8_block` is the checkpoint's scale block, quantization_config.weight_block_size)."""
    if fmt == "fp8":
        if stored is None:
            q, s = Fp8Linear.quantize(w)
            return Fp8Linear(q.to(device), s.to(device))
        q, s = stored
        want = (-(-q.shape[0] // fp8_block[0]), -(-q.shape[1] // fp8_block[1]))
        if tuple(s.shape) != want:
            raise ValueError(f"FP8 weight {tuple(q.shape)} with scale blocks {tuple(fp8_block)} needs weight_scale_inv "
                             f"{want}, got {tuple(s.shape)}: check quantization_config.weight_block_size")
        return Fp8Linear(q.to(device), s.to(device), block=fp8_block)
    if fmt == "int8":
        q, s = Int8Linear.quantize(w)
        return Int8Linear(q.to(device), s.to(device))
    if fmt == "int4":
        if stored is not None:
            q, s, shape = stored
        else:
            (q, s), shape = Int4Linear.quantize(w), tuple(w.shape)
        return Int4Linear(q.to(device), s.to(device), shape)
    if fmt == "bf16":
        lin = nn.Linear(w.shape[1], w.shape[0], bias=False, device="meta")
        lin.weight = nn.Parameter(w.to(device=device, dtype=torch.bfloat16), requires_grad=False)
        return lin
    raise ValueError(f"unknown weight-only format {fmt!r}; use fp8, int8, int4 or bf16")
