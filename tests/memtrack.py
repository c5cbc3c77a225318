"""A byte tracker over torch's dispatch: the tensor bytes alive per (planned) device and their
high-water mark, measured on CPU.

`ByteTracker` is a `TorchDispatchMode`: every tensor an op returns on a storage none of its inputs
has (a fresh allocation, not a view or an in-place result) is charged, once per storage, to
the label current at that moment (`tracker.label`, else the tensor's device), and released when its
storage is freed (a weakref finalizer on the storage). `attribute_layers(model, placement, tracker)`
sets the label to the planned GPU ("gpu0", "gpu1", ...) whose layer (or embeddings / final norm +
lm_head) is running, so a CPU-only run still tells each planned device's transient bytes.

What it cannot see: scratch that a kernel allocates inside one aten op (below the dispatcher) and
tensors made outside torch ops (`torch.from_numpy`). So it measures what the model *keeps*, which is
what the plan's workspace item promises to bound.
"""
from __future__ import annotations

import weakref
from collections import defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class ByteTracker(TorchDispatchMode):
    def __init__(self, explain: bool = False):
        super().__init__()
        self.explain = explain  # keep, per label, the live tensors (op, shape, bytes) at the peak
        self.at_peak: dict[str, list] = {}
        self.label: str | None = None
        self.live: dict[str, int] = defaultdict(int)
        self.peak: dict[str, int] = defaultdict(int)
        self._owner: dict[int, tuple[str, int]] = {}
        self._what: dict[int, tuple] = {}
        self.per_call: list[int] = []  # filled by `call_peak`

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # an output sharing an input's storage is a view or an in-place result: nothing new
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "meta"}
        out = func(*args, **kwargs)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.untyped_storage()._cdata not in inputs:
                self._charge(t, func)
        return out

    def _charge(self, t: torch.Tensor, func=None) -> None:
        st = t.untyped_storage()
        key = st._cdata
        if key in self._owner:
            return
        label, n = self.label or str(t.device), st.nbytes()
        self._owner[key] = (label, n)
        if self.explain:
            self._what[key] = (str(func), tuple(t.shape), n)
        self.live[label] += n
        if self.live[label] > self.peak[label]:
            self.peak[label] = self.live[label]
            if self.explain:
                self.at_peak[label] = [self._what[k] for k, (lb, _) in self._owner.items() if lb == label]
        weakref.finalize(st, self._release, key)

    def _release(self, key: int) -> None:
        label, n = self._owner.pop(key)
        self._what.pop(key, None)
        self.live[label] -= n

    def reset_peak(self) -> dict[str, int]:
        """Start a new high-water mark from what is alive now; returns the live bytes per label."""
        for k in list(self.peak):
            self.peak[k] = self.live[k]
        return dict(self.live)

    def transient(self, base: dict[str, int]) -> dict[str, int]:
        """High-water mark above `base` (a `reset_peak` result), per label."""
        return {k: self.peak[k] - base.get(k, 0) for k in self.peak}


def attribute_layers(model, placement, tracker: ByteTracker) -> list:
    """Forward pre-hooks that set `tracker.label` to the planned device running each part of the
    model: layer i -> f"gpu{placement.layer_gpu[i]}", embeddings -> gpu0 (or "host" when the plan keeps
    them on the CPU), final norm + lm_head -> the last GPU. Returns the hook handles."""
    last = f"gpu{len(placement.devices) - 1}"
    handles = []

    def setter(label):
        def hook(module, args):
            tracker.label = label
        return hook

    emb = "host" if placement.embeddings_on_cpu else "gpu0"
    handles.append(model.model.embed_tokens.register_forward_pre_hook(setter(emb)))
    for i, blk in enumerate(model.model.layers):
        # Block.steps is a generator (not forward): its first module call is the input norm
        handles.append(blk.input_layernorm.register_forward_pre_hook(setter(f"gpu{placement.layer_gpu[i]}")))
    handles.append(model.model.norm.register_forward_pre_hook(setter(last)))
    handles.append(model.lm_head.register_forward_pre_hook(setter(last)))
    handles.append(_FusedLayerLabels(placement, tracker))
    return handles


class _FusedLayerLabels:
    """A layer's pieces call no module of it (gpu_service.model.deepseek.Block.steps): wrap
    `Block.steps` to set the label of the layer it runs. `remove()` restores it, like a hook handle."""

    def __init__(self, placement, tracker: ByteTracker):
        from gpu_service.model.deepseek import Block

        self.mod, self.orig = Block, Block.steps
        orig = self.orig

        def block_steps(blk, *rest):
            gen, label = orig(blk, *rest), f"gpu{placement.layer_gpu[blk.layer]}"
            while True:  # the label again after each yield (the other micro-batch ran meanwhile)
                tracker.label = label
                try:
                    next(gen)
                except StopIteration as e:
                    return e.value
                yield

        Block.steps = block_steps

    def remove(self) -> None:
        self.mod.steps = self.orig
