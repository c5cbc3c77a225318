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

import time

import ml_dtypes
import numpy as np
import torch

from gpu_service.experts.call import Hold, Moved
from gpu_service.model.experts_api import Ready

_WIRE_TORCH = {"bfloat16": torch.bfloat16, "float16": torch.float16}
OUT_WIRE, OUT_F32, OUT_ADD_F32 = 0, 1, 2  # the C client's output modes (SC_OUT_* in shm_client.h)


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


class DirectHandle:
    """One layer call sent straight from the tensors' memory onto the replicas' shared-memory fast
    paths (one part per group, each taking every row): `wait()` receives each part's answer into the
    output in C, summed in group order in float32 as LayerCall sums; a part that fails goes through
    the client's failover with the inputs the shard saw. The same bits as RemoteHandle's."""

    __slots__ = ("client", "layer", "parts", "T", "H", "k", "device", "dtype", "sent", "out_dtype")

    def __init__(self, client, layer: int, parts: list, shape: tuple, device, dtype, out_dtype, sent: int):
        self.client, self.layer, self.parts, self.device, self.dtype, self.out_dtype, self.sent = \
            client, layer, parts, device, dtype, out_dtype, sent
        self.T, self.H, self.k = shape

    def wait(self) -> torch.Tensor:
        """[T, H] on the caller's device (None: the CPU) and dtype; bounded like RemoteHandle.wait."""
        T, H, client = self.T, self.H, self.client
        out = torch.empty((T, H), dtype=self.out_dtype)  # the caller's dtype when it is the wire's, else float32
        addr = out.data_ptr()
        as_is = self.out_dtype is not torch.float32  # one answer, whose bytes are the output
        for n, (g, r, fp, hold, t_send) in enumerate(self.parts):
            mode = OUT_WIRE if as_is else OUT_F32 if n == 0 else OUT_ADD_F32
            if not hold.fin and fp.finish(hold, T, addr, mode):
                if t_send:
                    client.report(self.layer, r.address, t_send, self.sent, T * H * out.element_size(), True)
                continue
            if hold.err is None:  # answered, received by another thread waiting on this fast path
                client.report(self.layer, r.address, t_send, self.sent, hold.res.ByteSize(), True)
                y = torch.from_numpy(hold.res.output)  # [T, H] float32 (the wire's values)
            else:
                if not isinstance(hold.err, Moved):
                    client.report(self.layer, r.address, t_send, self.sent, 0, False)
                inputs = hold.inputs if hold.inputs is not None else \
                    tuple(a.copy() for a in fp.inputs(hold.slot, T, self.k))
                y = client.fail_over(self.layer, g, r, hold, inputs)  # [T, H] float32 (gRPC's: read-only)
                y = torch.from_numpy(y if y.flags.writeable else y.copy())
            out.add_(y) if mode == OUT_ADD_F32 else out.copy_(y)  # (to the wire dtype: torch's cast, as .to)
        if out.dtype is not self.dtype:
            out = out.to(self.dtype)
        return out if self.device is None else out.to(self.device)


def client_wire(client) -> torch.dtype:
    """The torch dtype of the client's wire (float32 unless bfloat16 / float16)."""
    return _WIRE_TORCH.get(getattr(client, "wire_dtype", ""), torch.float32)


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
        self._wire = client_wire(client)
        # clients without it (a test's fake, bench_handoff's older client) take every call through forward_async
        self._route = getattr(client, "direct_route", None)
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
        return hb, ib, wb

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
        device, dtype = (h.device if h.is_cuda else None), h.dtype
        if device is not None:
            h, ids, w = self._to_host_cuda(h, ids, w)
        else:  # float32 or the wire dtype as they are: the transport casts (C for shared memory, like numpy)
            h = (h if dtype is torch.float32 or dtype is self._wire else h.float()).contiguous()
            w = (w if w.dtype is torch.float32 else w.float()).contiguous()
            ids = (ids if ids.dtype is torch.int64 else ids.long()).contiguous()
        direct = self._direct(layer, h, ids, w, device, dtype)
        if direct is not None:
            return direct
        fut = self.client.forward_async(layer, _numpy(h.detach()), ids.numpy(), w.detach().numpy())
        return RemoteHandle(self.client, fut, layer, device or torch.device("cpu"), dtype)

    def _direct(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, device, dtype):
        """The call sent straight from the CPU tensors' memory (h [T, H] float32 or the wire dtype,
        ids [T, k] int64, w [T, k] float32, contiguous) when every part of it can go onto a shared-memory
        fast path whole (ExpertsClient.direct_route: shared memory, or the TCP data path's C client): a
        DirectHandle, else None (forward_async)."""
        hs, shape = h.shape, ids.shape
        if self._route is None or len(hs) != 2 or len(shape) != 2 or w.shape != shape or shape[0] != hs[0] \
                or hs[0] == 0 or hs[1] != self.client.cfg.hidden_size:
            return None  # (forward_async says what is wrong)
        T, k = shape
        route = self._route(ids[0].tolist() if T == 1 and not self.client.whole else None)
        if route is None:
            return None
        args = (h.data_ptr(), h.dtype is not torch.float32, ids.data_ptr(), w.data_ptr())
        client, parts = self.client, []
        for g, r, fp in route:
            hold, t_send = Hold(k), client.observer and time.perf_counter()
            if fp.send_at(layer, T, k, *args, client.timeout_s, hold) is None:  # slots busy: the failover sends it
                hold.inputs = (_numpy(h).copy(), ids.numpy().copy(), w.numpy().copy())
                hold.set_exception(Moved("no free slot"))
            parts.append((g, r, fp, hold, t_send))
        # the output: the caller's dtype when one answer in the wire dtype is all of it, else float32 summed
        out_dtype = dtype if dtype is self._wire and len(parts) == 1 else torch.float32
        return DirectHandle(client, layer, parts, (T, hs[1], k), device, dtype, out_dtype,
                            h.nbytes + ids.nbytes + w.nbytes)


class LocalExperts:
    """ExpertsFn over an in-process `ExpertBackend` (no RPC): for benchmarks and tests."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Ready:
        out = self.backend.forward(layer, h.detach().float().cpu().numpy(), ids.cpu().numpy().astype(np.int64),
                                   w.float().cpu().numpy())
        return Ready(torch.from_numpy(out).to(device=h.device, dtype=h.dtype))
