"""The opt-in FP8 GEMM of FP8 linears (gpu_service.model.fp8_gemm), checked on the CPU against an
emulation of torch._scaled_mm's blockwise-scaled contract as cuBLAS states it (1x128 activation
scales [M, K/128] outer-dim-major, 128x128 weight scales [K/128, N/128], the weight column-major,
M a multiple of 4): the call is what the GPU kernel takes, its numbers are DeepSeek's recipe, and
a linear the kernel cannot take keeps the dequantisation, named in the log."""
from __future__ import annotations

import pytest
import torch

from gpu_service.model import fp8_gemm as G
from gpu_service.model import qlinear as Q
from gpu_service.runtime.cuda_graphs import CaptureCheck


def _emulated_scaled_mm(a, b, scale_a, scale_b, out_dtype):
    M, K = a.shape
    K2, N = b.shape
    assert a.dtype == b.dtype == torch.float8_e4m3fn and K == K2 and K % 128 == 0
    assert a.is_contiguous() and b.t().is_contiguous(), "A row-major, B column-major"
    assert M % 4 == 0, "cuBLASLt: rows a multiple of 4"
    assert scale_a.dtype == scale_b.dtype == torch.float32
    assert tuple(scale_a.shape) == (M, K // 128) and scale_a.stride(0) == 1, "1x128 scales outer-dim-major"
    assert tuple(scale_b.shape) == (K // 128, -(-N // 128)), "128x128 scales [K/128, N/128]"
    af = (a.float().view(M, K // 128, 128) * scale_a[..., None]).view(M, K)
    sb = scale_b.repeat_interleave(128, dim=1)[:, :N]  # [K/128, N]
    bf = (b.float().reshape(K // 128, 128, N) * sb[:, None, :]).reshape(K, N)
    return (af @ bf).to(out_dtype)


@pytest.fixture
def hopper(monkeypatch):
    monkeypatch.setattr(G, "_scaled_mm", _emulated_scaled_mm)
    monkeypatch.setattr(G, "_capability", lambda device: (9, 0))


def _fp8(out, inp, seed=0):
    g = torch.Generator().manual_seed(seed)
    return Q.make_quantized(torch.randn(out, inp, generator=g) * 0.05, "fp8", torch.device("cpu"))


def test_act_quant_is_deepseeks_1x128():
    x = torch.randn(6, 256) * torch.linspace(0.1, 10, 256)
    q, s = G.act_quant_1x128(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (6, 2) and s.stride(0) == 1
    back = (q.float().view(6, 2, 128) * s[..., None]).view(6, 256)
    assert ((back - x).abs() <= x.abs() * 2 ** -3 + 1e-6).all()  # e4m3: 3 mantissa bits
    assert torch.allclose(q.float().view(6, 2, 128).abs().amax(-1), torch.full((6, 2), G.E4M3_MAX))


@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_gemm_close_to_the_dequantising_path(hopper, rows):
    m = _fp8(300, 384)  # partial output block
    x = torch.randn(rows, 384)
    ref = Q._Blockwise.forward(m, x)
    with CaptureCheck("fp8 gemm"):  # capturable: no sync, no value-shaped output
        got = G.gemm(m, x)
    assert got.shape == ref.shape
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < 0.05, rel


def test_enable_takes_what_fits_and_names_what_does_not(hopper, caplog):
    net = torch.nn.Sequential(_fp8(256, 384), _fp8(128, 200))  # 200: not a multiple of 128
    with caplog.at_level("WARNING", logger="moesplit.fp8_gemm"):
        n = G.enable(net, torch.float32, "scaled_mm")
    assert n == 1 and net[0].gemm is G.gemm and net[1].gemm is None
    assert any("input width divisible by 128" in r.getMessage() for r in caplog.records)
    x = torch.randn(2, 384)
    assert torch.equal(net[0](x), G.gemm(net[0], x))
    assert G.enable(net, torch.float32, "dequant") == 0 and net[0].gemm is None


def test_a_failing_kernel_keeps_the_dequantisation(monkeypatch, caplog):
    monkeypatch.setattr(G, "_capability", lambda device: (9, 0))

    def broken(*a, **k):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(G, "_scaled_mm", broken)
    m = _fp8(256, 256)
    with caplog.at_level("WARNING", logger="moesplit.fp8_gemm"):
        assert G.enable(torch.nn.Sequential(m), torch.float32, "scaled_mm") == 0
    assert m.gemm is None and any("CUBLAS_STATUS_NOT_SUPPORTED" in r.getMessage() for r in caplog.records)


def test_off_hopper_and_bad_mode():
    m = _fp8(128, 128)
    assert "capability 9.0" in G.unfit(m)  # a CPU tensor: no capability
    with pytest.raises(ValueError, match="MOESPLIT_FP8_GEMM"):
        G.enable(torch.nn.Sequential(m), torch.float32, "fast")
