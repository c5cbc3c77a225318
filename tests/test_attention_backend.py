"""Which attention backend a device gets, and why (checked on the CPU: choosing a backend for a
CUDA device touches no CUDA memory). FlashInfer's MLA kernels exist for (kv_lora_rank 512, rope 64)
and 16-bit KV caches only, and a failed import is reported with its reason, never swallowed."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gpu_service import attention
from gpu_service.attention import flashinfer_mla
from gpu_service.attention.torch_paged import TorchBackend

V3 = SimpleNamespace(kv_lora_rank=512, qk_rope_head_dim=64)
TINY = SimpleNamespace(kv_lora_rank=128, qk_rope_head_dim=32)
CUDA = torch.device("cuda", 0)


@pytest.fixture
def importable(monkeypatch):
    """flashinfer 'imports' (a stand-in module: selection only, no kernel runs)."""
    monkeypatch.setattr(flashinfer_mla, "_flashinfer", SimpleNamespace())
    monkeypatch.setattr(flashinfer_mla, "IMPORT_ERROR", None)
    monkeypatch.delenv("MOESPLIT_ATTENTION", raising=False)


def test_flashinfer_taken_only_at_its_dims_and_16_bit_kv(importable, caplog):
    assert isinstance(attention.select_backend(CUDA, V3, dtype=torch.bfloat16), flashinfer_mla.FlashInferBackend)
    assert isinstance(attention.select_backend(CUDA, V3, dtype=torch.float16), flashinfer_mla.FlashInferBackend)
    with caplog.at_level("WARNING", logger="moesplit.attention"):
        fp32 = attention.select_backend(CUDA, V3, dtype=torch.float32)
        tiny = attention.select_backend(CUDA, TINY, dtype=torch.bfloat16)
    assert type(fp32) is TorchBackend and type(tiny) is TorchBackend
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "float32" in text and "(128, 32)" in text and "(512, 64)" in text
    assert type(attention.select_backend(torch.device("cpu"), V3, dtype=torch.bfloat16)) is TorchBackend
    assert type(attention.select_backend(CUDA, V3, name="torch", dtype=torch.bfloat16)) is TorchBackend


def test_failed_import_is_logged_with_its_reason(monkeypatch, caplog):
    monkeypatch.setattr(flashinfer_mla, "_flashinfer", None)
    monkeypatch.setattr(flashinfer_mla, "IMPORT_ERROR", "ImportError: libcudart.so.13: cannot open shared object file")
    monkeypatch.delenv("MOESPLIT_ATTENTION", raising=False)
    with caplog.at_level("WARNING", logger="moesplit.attention"):
        b = attention.select_backend(CUDA, V3, dtype=torch.bfloat16)
    assert type(b) is TorchBackend
    assert any("libcudart.so.13" in r.getMessage() and "torch backend" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match=r"libcudart\.so\.13.*flashinfer"):
        attention.select_backend(CUDA, V3, name="flashinfer", dtype=torch.bfloat16)


def test_forced_flashinfer_names_what_does_not_fit(importable):
    with pytest.raises(ValueError, match=r"bfloat16 / float16 KV cache, this one is float32"):
        attention.select_backend(CUDA, V3, name="flashinfer", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"this model has \(128, 32\)"):
        attention.select_backend(CUDA, TINY, name="flashinfer", dtype=torch.bfloat16)


def test_import_reason_recorded_here():
    """On this machine the module-level import either worked or left its reason (never None and None)."""
    assert (flashinfer_mla._flashinfer is None) == (flashinfer_mla.IMPORT_ERROR is not None)
