"""The FlashInfer backend (CUDA, the optional `flashinfer` extra): decode through FlashInfer's MLA
paged kernel, page size 1 (c_kv / k_pe read in place through each query's slot list; V3.2's top-k
selection passed as each query's slot list). Prefill and the V3.2 selection are the torch
backend's. Not exercised on CPU-only machines (`make gpu-check` runs it where a GPU is).
"""
from __future__ import annotations

import torch

from gpu_service.attention.meta import StepMeta
from gpu_service.attention.torch_paged import TorchBackend

try:  # optional: installed only where CUDA is
    import flashinfer as _flashinfer  # type: ignore
    IMPORT_ERROR = None
except Exception as e:  # noqa: BLE001 - absent or broken: the torch backend, the reason kept for the log
    _flashinfer = None
    IMPORT_ERROR = f"{type(e).__name__}: {e}"

MLA_DIMS = {(512, 64)}  # (kv_lora_rank, rope) FlashInfer's MLA kernels are built for (DeepSeek's)
KV_DTYPES = (torch.bfloat16, torch.float16)  # its MLA kernels' KV / query dtypes (no fp32 kernel)
SLOTS = 2  # micro-batches alive in one step (ping-pong): each plans its own wrapper


def unavailable(cfg, dtype: torch.dtype) -> str | None:
    """Why FlashInfer cannot take this model's decode (None: it can): the import failed, the MLA
    dims are not the ones its kernels are built for, or the KV cache dtype has no kernel."""
    if _flashinfer is None:
        return f"the flashinfer package does not import ({IMPORT_ERROR})"
    dims = (cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    if dims not in MLA_DIMS:
        return (f"its MLA kernels take (kv_lora_rank, qk_rope_head_dim) in {sorted(MLA_DIMS)}, "
                f"this model has {dims}")
    if dtype not in KV_DTYPES:
        return f"its MLA kernels take a bfloat16 / float16 KV cache, this one is {str(dtype).replace('torch.', '')}"
    return None


class FlashInferBackend(TorchBackend):
    """Decode in FlashInfer's BatchMLAPagedAttentionWrapper; everything else as TorchBackend."""

    name = "flashinfer"

    def __init__(self):
        self._wrappers: dict = {}  # (device, slot) -> wrapper; the float workspace is shared per device
        self._workspace: dict = {}
        self._turn: dict = {}

    def plan_step(self, meta: StepMeta, pool, device: torch.device) -> None:
        """The valid slots of every decode query, concatenated, and their offsets (once per step)."""
        if meta.key_slots is None:
            return
        slots = meta.key_slots.cpu()
        flat = torch.cat([slots[i, :n] for i, n in enumerate(meta.lengths)])
        slot = self._turn[device] = (self._turn.get(device, -1) + 1) % SLOTS
        meta.backend_state = {
            "indices": flat.to(device=device, dtype=torch.int32), "slot": slot, "planned": False,
            "indptr": torch.tensor([0] + meta.lengths, dtype=torch.int32).cumsum(0).to(device=device,
                                                                                     dtype=torch.int32)}

    def _run(self, mla, q_abs: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, meta: StepMeta,
             keep: torch.Tensor | None) -> torch.Tensor:
        """o_lat [B, nh, r]; kv_indices are the slots each query reads."""
        nh, r, rdim, scaling = mla.nh, mla.r, mla.rdim, mla.scaling
        st, dev = meta.backend_state, kv.device
        if keep is None:
            indptr, indices = st["indptr"], st["indices"]
        else:
            indices = meta.key_slots[keep].to(torch.int32)  # each query's selected slots, rows in order
            indptr = torch.cat([keep.new_zeros(1, dtype=torch.int32), keep.sum(1).cumsum(0).to(torch.int32)])
        wrapper = self._wrappers.get((dev, st["slot"]))
        if wrapper is None:
            if dev not in self._workspace:
                self._workspace[dev] = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=dev)
            wrapper = self._wrappers[(dev, st["slot"])] = _flashinfer.mla.BatchMLAPagedAttentionWrapper(
                self._workspace[dev], backend="auto")
        if keep is not None or not st["planned"]:  # dense: one plan serves every layer of the step
            B = q_abs.shape[0]
            lens = (indptr[1:] - indptr[:-1]).to(torch.int32)
            wrapper.plan(torch.arange(B + 1, device=dev, dtype=torch.int32), indptr, indices, lens, nh, r,
                         rdim, 1, False, scaling, q_abs.dtype, kv.dtype)
            st["planned"] = keep is None
        return wrapper.run(q_abs.contiguous(), q_pe.contiguous(), kv[:, None, :r], kv[:, None, r:])

    def decode(self, mla, q, kv, meta, keep, out=None):
        """FlashInfer where the step was planned for it (CUDA), else the torch decode."""
        if meta.backend_state is None or kv.device.type != "cuda":
            return super().decode(mla, q, kv, meta, keep, out)
        o = self._run(mla, q[..., :mla.r], q[..., mla.r:], kv, meta, keep)
        if out is not None:
            out.copy_(o)
            return out
        return o
