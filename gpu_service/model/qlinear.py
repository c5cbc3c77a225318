"""Weight-only quantised linears: FP8 (e4m3, 128x128 block scales, as in DeepSeek's checkpoints),
INT8 (per-output-channel scales) and INT4 (compressed-tensors groups).

Weights stay quantised in memory. `forward` dequantises QLINEAR_ROWS weight rows at a time into
one reused scratch buffer per device and dtype (sized at load: `reserve_scratch`) and multiplies it
into its slice of the output, never a full-size weight (the plan counts the buffer:
`gpu_service.plan.bytes.qlinear_scratch_bytes`). No fused weight-only GEMM: torchao / Marlin-class
kernels are not installable where this runs.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn


from gpu_service.plan.bytes import QLINEAR_ROWS  # weight rows dequantised at once (the plan counts them)


class _Scratch:
    """One reused buffer per (device, compute dtype) that quantised linears dequantise into.

    The model sizes it at load (`reserve_scratch`: the widest quantised linear it holds), so no call
    grows it afterwards: CUDA graphs captured later bake its address into their kernels. A buffer
    replaced by a larger one is kept, never freed, because a graph captured before may still write
    into it (a freed block handed to another tensor would be overwritten by every replay)."""

    def __init__(self):
        self._bufs: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
        self._retired: list[torch.Tensor] = []
        self.grown = 0  # buffers replaced after the first: 0 in a model sized at load

    def reserve(self, device: torch.device, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The buffer of (device, dtype), at least `numel` elements."""
        key = (torch.device(device), dtype)
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < numel:
            if buf is not None:
                self._retired.append(buf)
                self.grown += 1
            buf = self._bufs[key] = torch.empty(numel, dtype=dtype, device=device)
        return buf

    def get(self, device: torch.device, dtype: torch.dtype, rows: int, cols: int) -> torch.Tensor:
        return self.reserve(device, dtype, rows * cols)[: rows * cols].view(rows, cols)

    def nbytes(self, device: torch.device) -> int:
        """Bytes of the live buffers on `device` (the retired ones not counted)."""
        dev = torch.device(device)
        return sum(b.numel() * b.element_size() for (d, _), b in self._bufs.items() if d == dev)

    def clear(self) -> None:
        self._bufs.clear()
        self._retired.clear()
        self.grown = 0


SCRATCH = _Scratch()


def _scale_blocks_(w: torch.Tensor, s: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """In place: w[rows, cols] *= s[ceil(rows/bo), ceil(cols/bi)] per (bo, bi) block, through
    broadcast views (no expanded scale tensor); partial edge blocks as in checkpoint.formats."""
    bo, bi = block
    rows, cols = w.shape
    rf, cf = rows // bo * bo, cols // bi * bi
    nrf, ncf = rf // bo, cf // bi
    if rf and cf:
        w[:rf, :cf].view(nrf, bo, ncf, bi).mul_(s[:nrf, None, :ncf, None])
    if rf and cf < cols:
        w[:rf, cf:].view(nrf, bo, cols - cf).mul_(s[:nrf, None, ncf:ncf + 1])
    if rf < rows and cf:
        w[rf:, :cf].view(rows - rf, ncf, bi).mul_(s[nrf:nrf + 1, :ncf, None])
    if rf < rows and cf < cols:
        w[rf:, cf:].mul_(s[nrf:nrf + 1, ncf:ncf + 1])
    return w


class _Blockwise(nn.Module):
    """Shared forward: y[:, r0:r1] = x @ W[r0:r1].T, W[r0:r1] dequantised into the scratch buffer."""

    out_features: int
    in_features: int

    def _dequant_rows(self, w: torch.Tensor, r0: int, r1: int) -> None:  # into w [r1 - r0, in]
        raise NotImplementedError

    def _scratch_cols(self) -> int:
        return self.in_features

    def scratch_elems(self) -> int:
        """Elements of the scratch one forward call uses (its widest row block)."""
        return min(QLINEAR_ROWS, self.out_features) * self._scratch_cols()

    def dequant_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole weight [out, in] in `dtype` (one tensor of that size, nothing else kept):
        for kv_b_proj's absorbed / expanded attention, dequantised once per step."""
        dev = self._device()
        if self._scratch_cols() == self.in_features:
            w = torch.empty(self.out_features, self.in_features, dtype=dtype, device=dev)
            self._dequant_rows(w, 0, self.out_features)
            return w
        w = torch.empty(self.out_features, self._scratch_cols(), dtype=dtype, device=dev)
        self._dequant_rows(w, 0, self.out_features)
        return w[:, : self.in_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead, n_out = x.shape[:-1], self.out_features
        x2 = x.reshape(-1, x.shape[-1])
        y = torch.empty(x2.shape[0], n_out, dtype=x.dtype, device=x.device)
        rows = min(QLINEAR_ROWS, n_out)
        for r0 in range(0, n_out, rows):
            r1 = min(n_out, r0 + rows)
            w = SCRATCH.get(x.device, x.dtype, r1 - r0, self._scratch_cols())
            self._dequant_rows(w, r0, r1)
            torch.mm(x2, w[:, : self.in_features].t(), out=y[:, r0:r1])
        if self.bias is not None:
            y += self.bias
        return y.view(*lead, n_out)

    def _device(self) -> torch.device:
        return next(iter(self.parameters())).device


class Fp8Linear(_Blockwise):
    """y = x @ (w_e4m3 * scale_inv[block]).T"""

    def __init__(self, weight: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128), bias=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] float8_e4m3fn
        self.weight_scale_inv = nn.Parameter(scale_inv.float(), requires_grad=False)  # [out/bo, in/bi]
        self.block = tuple(block)
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        self.gemm = None  # an FP8 GEMM taking the place of the dequantisation (gpu_service.model.fp8_gemm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.gemm is None else self.gemm(self, x)

    @staticmethod
    def quantize(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
        """float [out, in] -> (e4m3 weight, f32 scale_inv per block), as checkpoint.formats does."""
        from checkpoint.formats import quant_fp8_block

        q, s = quant_fp8_block(w.detach().float().cpu().numpy(), tuple(block))
        return torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn), torch.from_numpy(s)

    def _dequant_rows(self, w: torch.Tensor, r0: int, r1: int) -> None:
        bo = self.block[0]
        assert r0 % bo == 0, "row blocks start on a scale block"
        w.copy_(self.weight[r0:r1])  # e4m3 -> compute dtype: exact for bf16, fp16 and fp32
        _scale_blocks_(w, self.weight_scale_inv[r0 // bo: -(-r1 // bo)], self.block)


class Int8Linear(_Blockwise):
    """y = x @ (w_int8 * scale[out]).T, symmetric per-output-channel scale = amax/127."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, bias=None):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)  # [out, in] int8
        self.weight_scale = nn.Parameter(scale.float(), requires_grad=False)  # [out]
        self.bias = bias
        self.out_features, self.in_features = weight.shape

    @staticmethod
    def quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        w = w.float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale

    def _dequant_rows(self, w: torch.Tensor, r0: int, r1: int) -> None:
        w.copy_(self.weight[r0:r1])  # int8 -> compute dtype: exact
        w.mul_(self.weight_scale[r0:r1, None])


class Int4Linear(_Blockwise):
    """Symmetric group-wise INT4 (compressed-tensors pack-quantized: eight 4-bit values per int32
    along the input dim, least-significant first, stored as q+8; one bf16 scale per group)."""

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, shape: tuple[int, int], group: int = 32, bias=None):
        super().__init__()
        self.weight_packed = nn.Parameter(packed, requires_grad=False)  # [out, ceil(in/8)] int32
        self.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out, ceil(in/group)] bf16
        self.shape, self.group, self.bias = tuple(shape), group, bias
        self.out_features, self.in_features = self.shape

    @staticmethod
    def quantize(w: torch.Tensor, group: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
        """float [out, in] -> (packed int32, bf16 scales), exactly as checkpoint.formats.pack_int4."""
        from checkpoint.formats import pack_int4

        packed, scale, _ = pack_int4(w.detach().float().cpu().numpy(), group)
        return torch.from_numpy(packed), torch.from_numpy(scale.view(np.int16)).view(torch.bfloat16)

    def _scratch_cols(self) -> int:
        return self.weight_packed.shape[1] * 8  # whole packed words; the tail past in_features is unused

    def _dequant_rows(self, w: torch.Tensor, r0: int, r1: int) -> None:
        rows, words = r1 - r0, self.weight_packed.shape[1]
        packed = self.weight_packed[r0:r1]
        w8 = w.view(rows, words, 8)
        for j in range(8):  # one nibble position at a time: int32 temporaries of rows x words
            w8[..., j].copy_((packed >> (4 * j)) & 0xF)
        w.sub_(8)
        g, inn = self.group, self.in_features
        gf = inn // g
        if gf:
            w[:, : gf * g].view(rows, gf, g).mul_(self.weight_scale[r0:r1, :gf, None])
        if gf * g < inn:
            w[:, gf * g: inn].mul_(self.weight_scale[r0:r1, gf:gf + 1])


class Mxfp4Linear(_Blockwise):
    """DeepSeek-V4's MXFP4 weight as stored (checkpoint.formats_v4): e2m1 codes two a byte, low nibble
    first [out, in/2], and each 32 inputs' ue8m0 scale held as bf16 2**(e-127) [out, in/32] (exact; the
    2 bytes the plan's "mxfp4" format counts per scale)."""

    GROUP = 32

    def __init__(self, packed: torch.Tensor, scale: torch.Tensor, bias=None):
        super().__init__()
        if packed.shape[1] * 2 != scale.shape[1] * self.GROUP:
            raise ValueError(f"Mxfp4Linear: packed {tuple(packed.shape)} and scales {tuple(scale.shape)} disagree "
                             f"(one scale per {self.GROUP} inputs)")
        self.weight_packed = nn.Parameter(packed, requires_grad=False)  # [out, in/2] uint8
        self.weight_scale = nn.Parameter(scale, requires_grad=False)  # [out, in/32] bf16 powers of two
        self.out_features, self.in_features, self.bias = packed.shape[0], packed.shape[1] * 2, bias

    @staticmethod
    def from_stored(packed: np.ndarray, e8m0: np.ndarray, device) -> "Mxfp4Linear":
        """From the checkpoint's arrays (I8 [out, in/2], ue8m0 [out, in/32]) on `device`."""
        from checkpoint.formats_v4 import e8m0_to_f32

        q = torch.from_numpy(np.array(packed).view(np.uint8))  # a writable copy
        s = torch.from_numpy(e8m0_to_f32(e8m0)).to(torch.bfloat16)
        return Mxfp4Linear(q.to(device), s.to(device))

    def _dequant_rows(self, w: torch.Tensor, r0: int, r1: int) -> None:
        """Each code byte -> its two e2m1 values through a 256-entry pair table straight into `w`; the
        one temporary is the codes as int32 (4 bytes per byte: the plan's qlinear_scratch_bytes)."""
        rows = r1 - r0
        codes = self.weight_packed[r0:r1].int().view(-1)
        torch.index_select(_mxfp4_pairs(w.device, w.dtype), 0, codes, out=w.view(-1, 2))
        w.view(rows, -1, self.GROUP).mul_(self.weight_scale[r0:r1, :, None])  # exact: powers of two


_PAIRS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}  # (device, dtype) -> [256, 2] values


def _mxfp4_pairs(device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """The two e2m1 values (low nibble first) of every byte, [256, 2] in `dtype` on `device`, made once."""
    key = (torch.device(device), dtype)
    if key not in _PAIRS:
        from checkpoint.formats_v4 import E2M1_VALUES

        v, b = torch.from_numpy(np.asarray(E2M1_VALUES, dtype=np.float32)), torch.arange(256)
        _PAIRS[key] = torch.stack([v[b & 0xF], v[b >> 4]], 1).to(device=device, dtype=dtype)
    return _PAIRS[key]


def reserve_scratch(model: nn.Module, dtype: torch.dtype) -> None:
    """At load: the dequantisation scratch of every device sized for the model's widest quantised
    linear there (the plan's qlinear_scratch_bytes), before any step runs or any graph is captured."""
    widest: dict[torch.device, int] = {}
    for m in model.modules():
        if isinstance(m, _Blockwise):
            dev = m._device()
            widest[dev] = max(widest.get(dev, 0), m.scratch_elems())
    for dev, n in widest.items():  # one allocation per device (none outgrown and kept)
        SCRATCH.reserve(dev, dtype, n)


def weight_of(linear: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The (dequantised) weight of a plain or quantised linear, in `dtype`."""
    if isinstance(linear, _Blockwise):
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
