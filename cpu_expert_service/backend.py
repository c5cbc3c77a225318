"""The seam between the shard server and the expert math, and its numpy reference.

`ExpertBackend` is what the server talks to: it is handed each expert's (already dequantised,
already sliced) float32 weights once, then computes a layer's routed-expert partial output per
request. `NumpyExperts` is the plain numpy reference every faster kernel is checked against;
the Cython kernels (cpu_expert_service/kernels/) implement the same protocol. `make_backend` is
the one place a backend is chosen.
"""
from __future__ import annotations

import os
from typing import Protocol, runtime_checkable

import numpy as np

BACKEND_ENV = "MOESPLIT_CPU_BACKEND"  # overrides "auto" (tests, debugging)


@runtime_checkable
class ExpertBackend(Protocol):
    """Routed experts of one shard, for every MoE layer it serves."""

    name: str  # kernel name reported by Describe, e.g. "numpy"
    weight_format: str  # storage format the weights came from: bf16|fp8|int4|f32|f16|fp8_e8m0|mxfp4
    swiglu_limit: float | None  # L: gate clamped to <= L, up to [-L, L] before silu (DeepSeek-V4); None off

    def add_expert(self, layer: int, expert: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        """gate, up: [I_s, H] f32; down: [H, I_s] f32 (I_s = this shard's intermediate slice)."""

    def finalize(self) -> None:
        """Called once after the last add_expert (pack, pin, build indexes)."""

    def forward(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x [T, H] f32, ids [T, k] int64 global expert ids, w [T, k] f32 -> [T, H] f32.

        Ids this shard does not hold contribute nothing."""

    def weight_bytes(self) -> int:
        """Bytes of expert weights resident in this backend."""


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), written to stay finite for large |x|."""
    return x / (1.0 + np.exp(-np.clip(x, -80.0, 80.0)))


def check_swiglu_limit(limit: float | None) -> float | None:
    """None (off) or a finite L > 0; anything else is refused naming the fix."""
    if limit is None:
        return None
    limit = float(limit)
    if not 0.0 < limit < float("inf"):
        raise ValueError(f"swiglu_limit {limit}: must be a finite number > 0 (DeepSeek-V4 uses 10.0) or None (off)")
    return limit


def swiglu(gate: np.ndarray, up: np.ndarray, limit: float | None = None) -> np.ndarray:
    """silu(gate) * up; with a limit L first gate = min(gate, L), up = clamp(up, -L, L), as
    transformers' DeepseekV4Experts._apply_gate (clamp is exact, so f32 results match bit for bit
    up to the silu itself)."""
    if limit is not None:
        lim = np.float32(limit)
        gate = np.minimum(gate, lim)
        up = np.clip(up, -lim, lim)
    return silu(gate) * up


class NumpyExperts:
    """Reference backend: per expert, gather its tokens and run the SwiGLU MLP in float32.

    out[t] = sum_j w[t, j] * down @ swiglu(gate @ x[t], up @ x[t], swiglu_limit)  over held experts ids[t, j].
    """

    name = "numpy"

    def __init__(self, weight_format: str = "f32", swiglu_limit: float | None = None) -> None:
        self.weight_format = weight_format
        self.swiglu_limit = check_swiglu_limit(swiglu_limit)
        # layer -> expert -> (gate [I_s,H], up [I_s,H], down [H,I_s]); gate and up are stacked into
        # one [2*I_s, H] matrix so each expert costs one matmul on the way up.
        self._layers: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
        self._hidden: int | None = None
        self._finalized = False

    def add_expert(self, layer: int, expert: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        if self._finalized:
            raise RuntimeError("add_expert after finalize()")
        gate = np.asarray(gate, dtype=np.float32)
        up = np.asarray(up, dtype=np.float32)
        down = np.asarray(down, dtype=np.float32)
        i_s, h = gate.shape
        if up.shape != (i_s, h) or down.shape != (h, i_s):
            raise ValueError(
                f"layer {layer} expert {expert}: inconsistent shapes gate {gate.shape}, up {up.shape}, "
                f"down {down.shape}; expected gate/up [I, H] and down [H, I]"
            )
        if self._hidden is None:
            self._hidden = h
        elif h != self._hidden:
            raise ValueError(f"layer {layer} expert {expert}: hidden size {h} != {self._hidden}")
        gate_up = np.ascontiguousarray(np.concatenate([gate, up], axis=0))  # [2*I_s, H]
        down_t = np.ascontiguousarray(down.T)  # [I_s, H]: x_act @ down_t
        self._layers.setdefault(layer, {})[expert] = (gate_up, down_t)

    def finalize(self) -> None:
        self._finalized = True

    def has(self, layer: int, expert: int) -> bool:
        return expert in self._layers.get(layer, {})

    def weight_bytes(self) -> int:
        return sum(a.nbytes + b.nbytes for experts in self._layers.values() for a, b in experts.values())

    def forward(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        # x: [T, H] f32; ids: [T, k] int; w: [T, k] f32
        x = np.asarray(x, dtype=np.float32)
        out = np.zeros(x.shape, dtype=np.float32)  # [T, H]
        experts = self._layers.get(layer)
        if not experts or x.shape[0] == 0:
            return out
        ids = np.asarray(ids)
        w = np.asarray(w, dtype=np.float32)
        flat_ids = ids.reshape(-1)  # [T*k]
        # pairs with weight 0 are skipped: the GPU service zeroes the experts it computes itself
        order = np.flatnonzero(w.reshape(-1) != 0)
        order = order[np.argsort(flat_ids[order], kind="stable")]
        sorted_ids = flat_ids[order]
        uniq, starts = np.unique(sorted_ids, return_index=True)
        ends = np.append(starts[1:], sorted_ids.size)
        k = ids.shape[1]
        for e, s, t in zip(uniq.tolist(), starts.tolist(), ends.tolist()):
            weights = experts.get(e)
            if weights is None:
                continue  # not held by this shard
            gate_up, down_t = weights
            pos = order[s:t]  # flat positions (token*k + j) routed to e
            tok = pos // k  # [n] token rows (distinct: an expert appears at most once per token)
            xe = x[tok]  # [n, H]
            gu = xe @ gate_up.T  # [n, 2*I_s]
            i_s = down_t.shape[0]
            act = swiglu(gu[:, :i_s], gu[:, i_s:], self.swiglu_limit)  # [n, I_s]
            ye = act @ down_t  # [n, H]
            ye *= w.reshape(-1)[pos][:, None]
            np.add.at(out, tok, ye)  # handles a (malformed) repeated expert in one row
        return out


def _kernels_factory():
    """The Cython kernels' backend constructor, or None when they are not built.

    Looked up in cpu_expert_service.kernel_backend: a `make_backend(weight_format=...)`
    function, else the `KernelExperts` class; None when the extension is not built."""
    import importlib

    for mod_name in ("cpu_expert_service.kernel_backend",):
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        for attr in ("make_backend", "KernelExperts"):
            f = getattr(mod, attr, None)
            if callable(f):
                return f
    return None


def available_backends() -> list[str]:
    """Backends usable on this machine, best first."""
    return (["kernels"] if _kernels_factory() is not None else []) + ["numpy"]


ACT_BITS = (16, 8)  # --act-bits: activation quantisation of the integer kernels (16 = two int8 levels)
INT_ACT_FORMATS = ("int8", "int4", "mxfp4")  # weight formats whose kernels quantise activations


def held_format(weight_format: str) -> str:
    """How the kernels' make_backend holds experts stored as `weight_format`: int4/int8/mxfp4 as is,
    the rest (bf16, fp8, f16, f32, fp8_e8m0) as bf16."""
    return weight_format if weight_format in INT_ACT_FORMATS else "bf16"


def check_act_bits(act_bits: int, backend: str, weight_format: str) -> int:
    """`act_bits` if the backend `backend` ("numpy"/"kernels") holding `weight_format` can honour it,
    else ValueError naming --act-bits: 8 needs the kernels and an integer format (int8/int4/mxfp4)."""
    if act_bits not in ACT_BITS:
        raise ValueError(f"--act-bits {act_bits}: choose 16 (default) or 8")
    if act_bits == 8 and backend == "numpy":
        raise ValueError("--act-bits 8 quantises the activations of the integer kernels; the numpy backend computes "
                         "in float: use --backend kernels (or auto where built), or --act-bits 16")
    if act_bits == 8 and weight_format not in INT_ACT_FORMATS:
        raise ValueError(f"--act-bits 8 applies to int8/int4/mxfp4 experts; these are held as {weight_format} "
                         "(bf16 activations): use --weight-format int8|int4|mxfp4, or --act-bits 16")
    return act_bits


def make_backend(name: str = "auto", weight_format: str = "f32", swiglu_limit: float | None = None,
                 act_bits: int = 16) -> ExpertBackend:
    """Pick the expert backend once, at start-up.

    name: "numpy" (reference), "kernels" (Cython, when built) or "auto" (best available;
    the environment variable MOESPLIT_CPU_BACKEND overrides "auto"). swiglu_limit: the model's
    (DeepSeek-V4 config.json `swiglu_limit`), None for models without one. act_bits: 16, or 8 for
    the kernels' 8-bit activations (int8/int4/mxfp4 only; check_act_bits)."""
    if name == "auto":
        name = os.environ.get(BACKEND_ENV) or available_backends()[0]
    if name == "numpy":
        check_act_bits(act_bits, name, weight_format)
        return NumpyExperts(weight_format=weight_format, swiglu_limit=swiglu_limit)
    if name == "kernels":
        factory = _kernels_factory()
        if factory is None:
            raise ValueError("backend 'kernels' is not built on this machine; run `make build` or use --backend numpy")
        if act_bits == 16:
            return factory(weight_format=weight_format, swiglu_limit=swiglu_limit)
        check_act_bits(act_bits, name, held_format(weight_format))
        return factory(weight_format=weight_format, swiglu_limit=swiglu_limit, act_bits=act_bits)
    raise ValueError(f"unknown expert backend {name!r}; choose 'auto', 'numpy' or 'kernels'")
