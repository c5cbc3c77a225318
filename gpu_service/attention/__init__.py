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

import logging
import os

import torch

from gpu_service.attention.torch_paged import TorchBackend

log = logging.getLogger("moesplit.attention")

BACKENDS = ("auto", "torch", "flashinfer")


def select_backend(device: torch.device, cfg, name: str | None = None, dtype: torch.dtype = torch.bfloat16):
    """The backend for `device` and a KV cache of `dtype`: "auto" (default; MOESPLIT_ATTENTION) takes
    FlashInfer on CUDA where it imports and fits the model's dims and dtype (else torch, logging
    why); "torch" forces the torch backend."""
    name = name or os.environ.get("MOESPLIT_ATTENTION", "auto")
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r}: expected one of {BACKENDS}")
    if name == "torch" or device.type != "cuda":
        if name == "flashinfer":
            raise ValueError("attention backend 'flashinfer' needs a CUDA device: use 'torch' or 'auto'")
        return TorchBackend()
    from gpu_service.attention import flashinfer_mla

    why = flashinfer_mla.unavailable(cfg, dtype)
    if why is None:
        log.info("attention on %s: FlashInfer MLA decode", device)
        return flashinfer_mla.FlashInferBackend()
    if name == "flashinfer":
        raise ValueError(f"attention backend 'flashinfer' cannot run here: {why}; install the 'flashinfer' extra "
                         "(pip install 'moesplit[flashinfer]'), or use 'auto' or 'torch'")
    log.warning("attention on %s: the torch backend, not FlashInfer: %s", device, why)
    return TorchBackend()
