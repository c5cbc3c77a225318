"""KernelExperts: the ExpertBackend (docs/interfaces.md) on the Cython/C MoE kernels.

Weights are packed at add time into the kernels' layout (bf16, int8 per-output-channel, or int4
symmetric group-32) by the pool threads that will later stream them (first touch). `forward`
runs the whole fused MoE op without the GIL on a pinned pthread pool where the calling thread
is thread 0.

The instruction set is decided once, when a backend is made: the best of amx > avx512 > avx2 >
generic that this CPU and OS support, or the one named by MOESPLIT_KERNEL_ISA (tests, debugging);
naming one the CPU lacks is an error, never a silent fallback.
"""
from __future__ import annotations

import os

import numpy as np

from cpu_expert_service.kernels import _moe

ISA_ENV = "MOESPLIT_KERNEL_ISA"
ISA_ORDER = ("amx", "avx512", "avx2", "generic")  # best first
FORMATS = ("bf16", "int8", "int4", "mxfp4")

# decided once at import: what this machine can run (amx also asks the OS for tile permission)
AVAILABLE_ISAS: tuple[str, ...] = tuple(isa for isa in ISA_ORDER if _moe.cpu_has(isa))


def select_isa(requested: str | None = None) -> str:
    """The ISA a backend uses: `requested`, else $MOESPLIT_KERNEL_ISA, else the best available."""
    name = requested or os.environ.get(ISA_ENV) or AVAILABLE_ISAS[0]
    name = name.strip().lower()
    if name not in ISA_ORDER:
        raise ValueError(f"{ISA_ENV}={name!r} is not a kernel ISA; choose one of {', '.join(ISA_ORDER)}")
    if name not in AVAILABLE_ISAS:
        raise RuntimeError(
            f"kernel ISA {name!r} was requested (argument or {ISA_ENV}) but this CPU/OS does not support it "
            f"(available here: {', '.join(AVAILABLE_ISAS)}); unset {ISA_ENV} or pick an available one"
        )
    return name


def allowed_cpus() -> list[int]:
    """CPUs this process may run on, in order (pool thread i is pinned to cpus[i % n])."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


class KernelExperts:
    """Routed experts on the CPU kernels; implements cpu_expert_service.backend.ExpertBackend.

    weight_format: "bf16" | "int8" | "int4" (how the kernels store the weights); num_threads:
    default one per allowed CPU; isa: override the dispatch (default select_isa()); swiglu_limit:
    None (off) or L > 0, the gate/up clamp before silu (DeepSeek-V4), applied in C (moe_core.c);
    act_bits: how int8/int4/mxfp4 quantise activations per group of 32, 16 (default: two int8 levels,
    ~2^-15 relative) or 8 (one level, ~2^-8, the usual int8 activations: half the integer products in
    the AVX-512 prefill micro-kernel); bf16 weights take bf16 activations (16 only)."""

    def __init__(self, weight_format: str = "bf16", num_threads: int | None = None, isa: str | None = None,
                 swiglu_limit: float | None = None, act_bits: int = 16) -> None:
        from cpu_expert_service.backend import check_swiglu_limit

        self.swiglu_limit = check_swiglu_limit(swiglu_limit)
        if weight_format not in FORMATS:
            raise ValueError(f"weight_format {weight_format!r} is not supported; choose one of {', '.join(FORMATS)}")
        self.isa = select_isa(isa)
        cpus = allowed_cpus()
        self.num_threads = int(num_threads) if num_threads else len(cpus)
        if self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        self.weight_format = weight_format
        self.act_bits = int(act_bits)
        self.name = f"kernel-{self.isa}-{weight_format}" + ("-a8" if self.act_bits == 8 else "")
        self._engine = _moe.Engine(weight_format, self.isa, self.num_threads, cpus, self.swiglu_limit or 0.0,
                                   self.act_bits)
        self._finalized = False

    # -- loading ---------------------------------------------------------------------------
    def add_expert(self, layer: int, expert: int, gate: np.ndarray, up: np.ndarray, down: np.ndarray) -> None:
        """gate, up: [I, H] f32; down: [H, I] f32 (dequantised); quantised here to weight_format."""
        self._check_open()
        gate = np.ascontiguousarray(gate, dtype=np.float32)
        up = np.ascontiguousarray(up, dtype=np.float32)
        down = np.ascontiguousarray(down, dtype=np.float32)
        if gate.ndim != 2 or up.shape != gate.shape or down.shape != gate.shape[::-1]:
            raise ValueError(
                f"layer {layer} expert {expert}: inconsistent shapes gate {gate.shape}, up {up.shape}, "
                f"down {down.shape}; expected gate/up [I, H] and down [H, I]"
            )
        self._engine.add_float(int(layer), int(expert), gate, up, down)

    def add_expert_int4(self, layer, expert, gate_packed, gate_scale, up_packed, up_scale,
                        down_packed, down_scale, shapes) -> None:
        """Load compressed-tensors pack-quantized INT4 (symmetric, group 32, q+8 nibbles, eight per
        int32 least significant first) without re-quantising. *_packed: int32 [out, ceil(in/8)];
        *_scale: bf16 (ml_dtypes or raw uint16) [out, ceil(in/32)]; shapes: (I, H), or the three
        weight_shape arrays (gate [I, H], up [I, H], down [H, I])."""
        self._check_open()
        if self.weight_format != "int4":
            raise ValueError(f"add_expert_int4 needs weight_format='int4', this backend is {self.weight_format!r}")
        if np.ndim(shapes[0]) == 0:  # (I, H)
            shapes = [(int(shapes[0]), int(shapes[1]))]
        else:  # three weight_shape arrays
            shapes = [tuple(int(v) for v in np.asarray(s).reshape(-1)[:2]) for s in shapes]
        I, H = shapes[0]
        if len(shapes) == 3 and (shapes[1] != (I, H) or shapes[2] != (H, I)):
            raise ValueError(f"layer {layer} expert {expert}: weight_shapes {shapes} are not gate/up [I, H], down [H, I]")
        args = []
        for nm, packed, scale, (o, i) in (("gate", gate_packed, gate_scale, (I, H)), ("up", up_packed, up_scale, (I, H)),
                                         ("down", down_packed, down_scale, (H, I))):
            packed = np.ascontiguousarray(packed)
            scale = np.ascontiguousarray(scale)
            if packed.dtype != np.int32 or packed.shape != (o, -(-i // 8)):
                raise ValueError(f"layer {layer} expert {expert}: {nm} weight_packed must be int32 {(o, -(-i // 8))}, "
                                 f"got {packed.dtype} {packed.shape}")
            if scale.dtype.itemsize != 2 or scale.shape != (o, -(-i // 32)):
                raise ValueError(f"layer {layer} expert {expert}: {nm} weight_scale must be bf16 {(o, -(-i // 32))} "
                                 f"(group 32), got {scale.dtype} {scale.shape}")
            args += [packed, scale.view(np.uint16)]
        self._engine.add_int4(int(layer), int(expert), H, I, *args)

    def add_expert_mxfp4(self, layer, expert, gate_blocks, gate_scale, up_blocks, up_scale,
                         down_blocks, down_scale) -> None:
        """Load OCP MXFP4 experts as stored (DeepSeek-V4): *_blocks I8/uint8 [out, in/2] (element 2j in
        the low nibble), *_scale F8_E8M0 (ml_dtypes or raw uint8) [out, in/32]; gate/up [I, H], down
        [H, I], H and I multiples of 32. Held as e2m1 nibbles + one power-of-two scale per 32 inputs."""
        self._check_open()
        if self.weight_format != "mxfp4":
            raise ValueError(f"add_expert_mxfp4 needs weight_format='mxfp4', this backend is {self.weight_format!r}")
        gb, gs, ub, us, db, ds = (np.ascontiguousarray(a).view(np.uint8) for a in
                                  (gate_blocks, gate_scale, up_blocks, up_scale, down_blocks, down_scale))
        I, H = gb.shape[0], gb.shape[1] * 2
        self._engine.add_mxfp4(int(layer), int(expert), H, I, gb, gs, ub, us, db, ds)

    def finalize(self) -> None:
        self._finalized = True

    def _check_open(self) -> None:
        if self._finalized:
            raise RuntimeError("add_expert after finalize()")

    # -- compute ---------------------------------------------------------------------------
    def forward(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        """x [T, H] f32, ids [T, k] int64 global ids, w [T, k] f32 -> [T, H] f32 (ids not held add nothing)."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        w = np.ascontiguousarray(w, dtype=np.float32)
        if x.ndim != 2 or ids.ndim != 2 or w.shape != ids.shape or ids.shape[0] != x.shape[0]:
            raise ValueError(f"forward: expected x [T, H], ids [T, k], w [T, k]; got {x.shape}, {ids.shape}, {w.shape}")
        # pairs with weight 0 (experts the GPU service computes itself) are skipped, like NumpyExperts
        ids = np.where(w != 0, ids, -1)
        return self._engine.forward(int(layer), x, ids, w)

    def read_seconds(self, buf: np.ndarray) -> float:
        """Seconds for this backend's pool threads (pinned as for forward) to stream-read `buf`
        once, each thread its contiguous share: the read ceiling of a weight stream (bench)."""
        return float(self._engine.read_probe(buf.reshape(-1).view(np.uint8)))

    # -- introspection ---------------------------------------------------------------------
    def weight_bytes(self) -> int:
        return int(self._engine.weight_bytes())

    def expert_bytes(self, layer: int, expert: int) -> int:
        """Packed bytes of one expert (weights + scales), what one call streams for it."""
        return int(self._engine.expert_bytes(int(layer), int(expert)))

    def dequantised(self, layer: int, expert: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(gate [I, H], up [I, H], down [H, I]) f32 exactly as the kernels see them (for checks)."""
        return tuple(self._engine.unpack(int(layer), int(expert), w) for w in ("gate", "up", "down"))


def make_backend(weight_format: str = "bf16", num_threads: int | None = None,
                 swiglu_limit: float | None = None, act_bits: int = 16) -> KernelExperts:
    """Backend for a checkpoint storage format: int4, int8 and mxfp4 (DeepSeek-V4) keep their width
    (mxfp4: e2m1 nibbles + a power-of-two scale per 32, as stored), everything else (bf16, fp8, f16,
    f32, DeepSeek-V4's fp8_e8m0) runs as bf16. For fp8_e8m0 that is exact: e4m3 (4 significant bits)
    times a power of two fits bf16's 8-bit significand (load_shard checks every weight). act_bits: as
    KernelExperts (8 only for int8/int4/mxfp4)."""
    from cpu_expert_service.backend import held_format

    return KernelExperts(weight_format=held_format(weight_format), num_threads=num_threads,
                         swiglu_limit=swiglu_limit, act_bits=act_bits)
