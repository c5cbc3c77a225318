"""Attention backends: MLA over the paged KV pool, chosen once at start-up.

A backend has four parts, all over a step's metadata (`meta.StepMeta`, built once per step and
device from the chunks' page lists):

    plan_step(meta, pool, device)               what the backend plans once per step
    decode(mla, q, kv, meta, keep, out=None)    one absorbed query per decode sequence of `mla`'s
                                                 layer (q = q_nope W_UK ++ q_pe, [B, nh, r + rope])
                                                 -> o_lat [B, nh, r]
    prefill(mla, q_nope, q_pe, cache, start, keep, wkv)
                                                 one chunk of n > 1 queries over its history,
                                                 K/V expanded per key block -> [n, nh * v]
    select_decode(indexer, q, w, ik, meta)       DeepSeek-V3.2: each decode query's top-k keys

`TorchBackend` (torch_paged.py) runs everywhere (CPU and CUDA); `FlashInferBackend`
(flashinfer_mla.py) takes the decode part on CUDA where `flashinfer` imports and the MLA dims
are the ones its kernels are built for. `select_backend(device, cfg, name)` picks one per device,
the first time a step runs there; MOESPLIT_ATTENTION=torch (or `DeepseekV3.attention_backend =
"torch"`) forces the torch backend, "flashinfer" requires FlashInfer (a ValueError naming the fix
where it cannot run).
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
