"""What one micro-batch's pass through the layers needs on one device, built once per step.

`Step` holds the attention metadata (`StepMeta`), the real and padded row counts, the RoPE table
of the step's positions and, for a captured all-decode step, the CUDA-graph set. Layer code runs
its pieces through `Step.run(layer, name, fn, *args)`: eagerly, or as a replay of the piece's
graph (gpu_service.runtime.cuda_graphs).
"""
from __future__ import annotations

import torch

from gpu_service.attention.meta import build_meta, StepMeta


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


class Step:
    """One micro-batch on one device (module docstring)."""

    def __init__(self, meta: StepMeta, backend, cs: torch.Tensor, T: int, Tp: int, block: int, graphs=None):
        self.meta, self.backend, self.T, self.Tp, self.block = meta, backend, T, Tp, block
        self.decode = meta.all_decode  # every row one decode token: the absorbed query in `pre`
        self.graphs = graphs  # a GraphSet for this (device, micro-batch, bucket), or None (eager)
        self.cs = graphs.rope_table(cs) if graphs is not None else cs  # the set's static buffer
        self._o_lat = None

    def run(self, layer: int, name: str, fn, *args) -> tuple:
        """fn(*args) as a tuple: eager, or the replay of its captured graph."""
        if self.graphs is None:
            return _tuple(fn(*args))
        return self.graphs.run(layer, name, fn, *args)

    def o_lat_buffer(self, nh: int, r: int, dtype: torch.dtype, device) -> torch.Tensor:
        """[Tp, nh, r] zeros, once per step: attention writes its T real rows, pad rows stay 0
        (every layer's o_lat is consumed by its own `mid` before the next layer writes)."""
        if self._o_lat is None:
            self._o_lat = torch.zeros(self.Tp, nh, r, dtype=dtype, device=device)
        return self._o_lat


def make_step(chunks, pool, device: torch.device, backend, rope, positions: torch.Tensor, dtype: torch.dtype,
              block: int, graphs=None, slot: int = 0) -> Step:
    """The step of `chunks` on `device`: metadata, padded rows (the graph bucket for an all-decode
    step the runner's `graphs` capture, else a multiple of `block`), the RoPE table."""
    meta = build_meta(chunks, pool, device)
    backend.plan_step(meta, pool, device)
    T = len(meta.write_slots)
    gset = graphs.get(device, slot, T) if graphs is not None and meta.all_decode else None
    Tp = gset.rows if gset is not None else -(-T // block) * block
    cos, sin = rope.cos_sin(positions.to(device), dtype)
    return Step(meta, backend, rope.table(cos, sin, Tp), T, Tp, block, gset)
