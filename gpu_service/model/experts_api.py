"""What the model asks of the routed experts: the one interface between gpu_service/model/ and
gpu_service/experts/ (which implements it over the shards' transports), torch only."""
from __future__ import annotations

from typing import Protocol

import torch


class ExpertsHandle(Protocol):
    """One MoE layer's routed-expert call in flight."""

    def wait(self) -> torch.Tensor:
        """sum_k w[t,k] * expert_{ids[t,k]}(h[t]) as [T, H] on h's device and dtype; raises the
        shard's error (ShardError) when no replica could answer within the deadline."""
        ...


class ExpertsFn(Protocol):
    """Routed experts of the model's MoE layers, started asynchronously: the caller computes the
    shared expert between the call and the handle's wait (overlap)."""

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> ExpertsHandle: ...


class Ready:
    """A handle whose result is already there (in-process experts, test doubles)."""

    __slots__ = ("t",)

    def __init__(self, t: torch.Tensor):
        self.t = t

    def wait(self) -> torch.Tensor:
        return self.t
