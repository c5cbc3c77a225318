"""The model's experts (gpu_service.model.experts_api.ExpertsFn) over the transports: torch in, torch out.

- `RemoteExperts`: the CPU shards through an `ExpertsClient` (shared memory with the C client,
  the TCP data path or gRPC, chosen per replica; failover per call inside the client). On CUDA
  hidden states leave the device already in the wire dtype, through pinned host buffers; on the
  CPU float32 ones are handed over as they are and cast by the transport (round to nearest even,
  the same bits as torch's cast).
- `LocalExperts`: an in-process `ExpertBackend` (no RPC): benchmarks and tests.

The only module of experts/ that imports torch.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

from gpu_service.model.experts_api import Ready

_WIRE_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def _numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of a CPU tensor; bfloat16 as ml_dtypes.bfloat16 (numpy has no bf16 of its own)."""
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


class RemoteHandle:
    """One layer call on the shards: `wait()` -> [T, H] on the caller's device and dtype."""

    __slots__ = ("client", "fut", "layer", "device", "dtype")

    def __init__(self, client, fut, layer: int, device: torch.device, dtype: torch.dtype):
        self.client, self.fut, self.layer, self.device, self.dtype = client, fut, layer, device, dtype

    def wait(self) -> torch.Tensor:
        """Bounded: the client's deadline per replica (ShardError when the last one passes)."""
        out = torch.from_numpy(self.client.result(self.fut, self.layer))  # [T, H] float32
        return out if self.dtype == torch.float32 and self.device.type == "cpu" else \
            out.to(device=self.device, dtype=self.dtype)


class RemoteExperts:
    """ExpertsFn over the experts client: tensors go to the shards as numpy arrays.

    On CUDA, hidden / ids / weights are copied device->host with non_blocking=True into pinned
    host buffers (a few sets used in turn, grown as needed) and synchronised once per call; the
    client copies them into its transport (shared-memory slot, TCP frame, gRPC message) before
    forward_async returns, so a set is free again by its turn."""

    PINNED_SETS = 4  # > calls in flight at once (micro-batch ping-pong: 2)

    def __init__(self, client):
        self.client = client
        # hidden states leave the device already in the wire dtype (half the bytes for bf16; the
        # client then copies them without a numpy cast)
        self._wire = _WIRE_TORCH.get(getattr(client, "wire_dtype", ""), torch.float32)
        self._pinned: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = [None] * self.PINNED_SETS
        self._turn = 0

    def _to_host_cuda(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
        T, H = h.shape
        k = ids.shape[1]
        i = self._turn % self.PINNED_SETS
        self._turn += 1
        bufs = self._pinned[i]
        if bufs is None or bufs[0].shape[0] < T or bufs[0].shape[1] != H or bufs[1].shape[1] != k:
            cap = max(T, 2 * bufs[0].shape[0] if bufs is not None else 16)
            bufs = (torch.empty((cap, H), dtype=self._wire, pin_memory=True),  # [cap, H]
                    torch.empty((cap, k), dtype=torch.int64, pin_memory=True),  # [cap, k]
                    torch.empty((cap, k), dtype=torch.float32, pin_memory=True))  # [cap, k]
            self._pinned[i] = bufs
        hb, ib, wb = bufs[0][:T], bufs[1][:T], bufs[2][:T]
        hb.copy_(h.detach().to(self._wire), non_blocking=True)
        ib.copy_(ids, non_blocking=True)
        wb.copy_(w.detach().float(), non_blocking=True)
        torch.cuda.current_stream(h.device).synchronize()
        return _numpy(hb), ib.numpy(), wb.numpy()

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> RemoteHandle:
        if h.device.type == "cuda":
            fut = self.client.forward_async(layer, *self._to_host_cuda(h, ids, w))
        else:  # float32 or the wire dtype as they are: the transport casts (C for shared memory, like numpy)
            x = h if h.dtype == torch.float32 or h.dtype == self._wire else h.float()
            if w.dtype != torch.float32:
                w = w.float()
            fut = self.client.forward_async(layer, _numpy(x.detach().cpu().contiguous()), ids.cpu().numpy(),
                                            w.detach().cpu().numpy())
        return RemoteHandle(self.client, fut, layer, h.device, h.dtype)


class LocalExperts:
    """ExpertsFn over an in-process `ExpertBackend` (no RPC): for benchmarks and tests."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Ready:
        out = self.backend.forward(layer, h.detach().float().cpu().numpy(), ids.cpu().numpy().astype(np.int64),
                                   w.float().cpu().numpy())
        return Ready(torch.from_numpy(out).to(device=h.device, dtype=h.dtype))
