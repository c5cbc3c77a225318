"""Attention backends: MLA over the paged KV pool, chosen once at start-up.

A backend works over a step's metadata (`meta.StepMeta`): `plan_step(meta, pool, device)` once
per step; `decode(mla, q, kv, meta, keep, out=None)` the absorbed decode queries [B, nh, r + rope]
-> o_lat [B, nh, r]; `prefill(mla, q_nope, q_pe, cache, start, keep, wkv)` one chunk -> [n, nh * v];
`select_decode(indexer, q, w, ik, meta)` V3.2's top-k keys per decode query.

`TorchBackend` runs on CPU and CUDA; `FlashInferBackend` takes the decode part on CUDA where
`flashinfer` imports and fits the MLA dims. MOESPLIT_ATTENTION=torch (or
`DeepseekV3.attention_backend = "torch"`) forces the torch backend; "flashinfer" requires it.
"""
from __future__ import annotations

import os

import torch

from gpu_service.attention.torch_paged import TorchBackend

BACKENDS = ("auto", "torch", "flashinfer")


def select_backend(device: torch.device, cfg, name: str | None = None):
    """The backend for `device`: "auto" (default; MOESPLIT_ATTENTION) takes FlashInfer on CUDA where
    it is installed and fits the model's dims, else torch; "torch" forces the torch backend."""
    name = name or os.environ.get("MOESPLIT_ATTENTION", "auto")
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected one of {BACKENDS}")
    if name == "torch" or device.type != "cuda":
        if name == "flashinfer":
            raise ValueError("attention backend 'flashinfer' needs a CUDA device: use 'torch' or 'auto'")
        return TorchBackend()
    from gpu_service.attention import flashinfer_mla

    if flashinfer_mla.available(cfg):
        return flashinfer_mla.FlashInferBackend()
    if name == "flashinfer":
        raise ValueError("attention backend 'flashinfer': the flashinfer package does not import here or its MLA "
                         f"kernels do not take kv_lora_rank {cfg.kv_lora_rank} / rope {cfg.qk_rope_head_dim}; "
                         "install the 'flashinfer' extra or use 'auto'")
    return TorchBackend()
