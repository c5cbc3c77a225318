"""Per-call expert hand-offs in C for the torch layer paths (issue 20).

Where a decode step cannot run whole in C (CUDA, 16-bit or quantised attention weights: the fused
segments and CUDA graphs; or the native layers driven from Python), its layer calls still go over
the shared-memory fast paths through C (native_remote.c's nr_send / nr_wait) instead of the
client's futures: the step claims one idle path per shard group (gpu_service.experts.native_handoff),
each call writes the slots and rings the doorbells, and waiting receives and sums the answers, the
GIL released. `NativeCalls` is that claim for one step; RemoteExperts uses it while it is active.

Any failure raises `HandoffFailed` out of the layers; DeepseekV3.forward then settles the claim
(Handoff.finish: as the Python path would) and runs the step again through the Python hand-off.
"""
from __future__ import annotations

import torch

from gpu_service.model.native_decode import _c, HandoffFailed


_WIRE_TORCH = {0: torch.float32, 1: torch.bfloat16, 2: torch.float16}


class NativeCalls:
    """One step's claimed fast paths, used call by call (two calls in flight at most: ping-pong)."""

    def __init__(self, handoff, n_moe_layers: int, max_rows: int, H: int, k: int):
        self.ho = handoff
        cap = max(1, n_moe_layers) * len(handoff.paths) * handoff.n_mb
        self.c = _c.RemoteCalls(H, k, handoff.paths, cap, max_rows, handoff.timeout_s, handoff.spin_s, handoff.seq0)
        self.wire = _WIRE_TORCH[handoff.claims[0][2].hc]
        self.free = list(range(handoff.n_mb))[::-1]  # per-call states (= slots) not in flight
        self.rc = 0
        self.H = H

    def send(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, to_host=None):
        """Start one layer call; returns the wait() closure. h [B, H], ids [B, k], w [B, k] on any
        device; to_host(h, ids, w): host arrays of a CUDA call (RemoteExperts' pinned buffers: one
        synchronisation, hidden already in the wire dtype)."""
        if self.rc or not self.free:
            self._fail(self.rc or 1)
        B = h.shape[0]
        if to_host is not None:
            hb, ib, wb = to_host(h, ids, w)  # numpy views of pinned memory, stable until this call's wait
            keep = (hb, ib, wb)
            hp, h_wire, ip, wp = hb.ctypes.data, int(hb.dtype.itemsize == 2), ib.ctypes.data, wb.ctypes.data
        else:
            hh, h_wire = h.detach(), 0
            if hh.dtype != torch.float32:  # (into the wire dtype, float32 included)
                hh, h_wire = hh.to(self.wire), int(self.wire != torch.float32)
            hh = hh.contiguous()
            ii = ids.detach().to(dtype=torch.int64).contiguous()  # kept until wait (its rows are re-derived)
            ww = w.detach().to(dtype=torch.float32).contiguous()
            keep = (hh, ii, ww)
            hp, ip, wp = hh.data_ptr(), ii.data_ptr(), ww.data_ptr()
        i = self.free.pop()
        rc = self.c.send(i, layer, hp, h_wire, ip, wp, B)
        if rc:
            self._fail(rc)
        dev, dt = h.device, h.dtype

        def wait(keep=keep) -> torch.Tensor:  # (keep: the ids stay alive until the answers are summed)
            out = torch.empty(B, self.H, dtype=torch.float32)
            rc2 = self.c.wait(i, out.data_ptr())
            if rc2:
                self._fail(rc2)
            self.free.append(i)
            return out if dev.type == "cpu" and dt == torch.float32 else out.to(device=dev, dtype=dt)

        return wait

    def _fail(self, rc: int):
        self.rc = rc
        raise HandoffFailed(rc)

    def finish(self) -> None:
        """Report the calls, give the paths back, settle a failure (Handoff.finish)."""
        self.ho.finish(self.rc, self.c.fail_path, self.c.fail_msg, self.c.calls(), self.c.path_calls())


def begin(client, rows: list[int], cfg) -> NativeCalls | None:
    """A NativeCalls for a decode step of micro-batches of `rows` rows, or None (the Python hand-off)."""
    if _c is None:
        return None
    from gpu_service.experts.native_handoff import claim

    ho = claim(client, rows, cfg.num_experts_per_tok, _c.has_f16(), whole=False)
    if ho is None:
        return None
    try:
        return NativeCalls(ho, len(cfg.moe_layers), max(rows), cfg.hidden_size, cfg.num_experts_per_tok)
    except BaseException:
        ho.release()
        raise

