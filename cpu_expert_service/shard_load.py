"""What one CPU expert shard serves, read into a backend (`load_shard`), and the parsing of its
--experts / --slice / --weight-format choices. No gRPC here: `load_shard` is also what the GPU
checks (`make gpu-check`) and the tests use for in-process experts on hosts without grpcio; the
server (cpu_expert_service.server) serves what it loads.
"""
from __future__ import annotations

import time

import numpy as np

from checkpoint.config import ModelConfig
from checkpoint.names import slice_range  # noqa: F401  (the server imports it from here)
from cpu_expert_service.arch import (V4_EXACT_IN_BF16, add_mxfp4_expert, bf16_exact, check_mxfp4_slice,
                                    expert_weight_name, swiglu_limit_of)
from cpu_expert_service.backend import ExpertBackend, make_backend
from cpu_expert_service.packed import slice_mxfp4

WEIGHT_FORMATS = ("auto", "bf16", "int8", "int4", "mxfp4")  # --weight-format: how the shard holds its experts


# ---- what this shard serves -------------------------------------------------------------------
def parse_experts(spec: str, n_experts: int | None = None) -> list[int]:
    """'0-7,9' -> [0..7, 9] (sorted, unique); ranges are inclusive."""
    out: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.update(range(lo, hi + 1))
            else:
                out.add(int(part))
        except ValueError:
            raise ValueError(f"--experts: cannot parse {part!r}; expected e.g. '0-7,9'") from None
    if not out:
        raise ValueError(f"--experts {spec!r} names no expert; expected e.g. '0-7,9'")
    if n_experts is not None:
        bad = sorted(e for e in out if not 0 <= e < n_experts)
        if bad:
            raise ValueError(f"--experts: ids {bad} outside [0, {n_experts}) of this model")
    return sorted(out)


def parse_slice(spec: str) -> tuple[int, int]:
    """'1/2' -> (1, 2): slice 1 (0-based) of 2."""
    try:
        a, b = spec.split("/")
        i, n = int(a), int(b)
    except ValueError:
        raise ValueError(f"--slice {spec!r}: expected 'i/n', e.g. 0/2 for the first of two slices") from None
    if not (n >= 1 and 0 <= i < n):
        raise ValueError(f"--slice {spec!r}: need n >= 1 and 0 <= i < n (i is 0-based)")
    return i, n


def _weight_format(reader, name: str, cfg: ModelConfig) -> str:
    try:
        return str(reader.format_of(name))
    except Exception:  # noqa: BLE001 - fall back to what config.json says
        if cfg.quantization is not None:
            return cfg.quantization.method
        return {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}.get(cfg.torch_dtype, cfg.torch_dtype)


def load_shard(
    model_dir: str,
    experts: list[int] | None,
    slice_spec: tuple[int, int] | None,
    backend: str = "numpy",
    weight_format: str = "auto",
    act_bits: int = 16,
) -> tuple[ModelConfig, ExpertBackend, dict]:
    """Read this shard's expert weights (only those) into a backend. Returns (cfg, backend, info).

    weight_format: auto (the checkpoint's: int4 stays int4, mxfp4 stays mxfp4, bf16/fp8 run as bf16) |
    bf16 | int8 | int4: the kernels quantise float weights at load; the numpy backend holds the same
    values (checkpoint.formats.as_format) | mxfp4 (MXFP4 checkpoints only).

    DeepSeek-V4 (V4Config): experts `layers.L.ffn.experts.E.w1|w3|w2` in MXFP4 are, under auto, held
    by the kernels as stored (e2m1 nibbles + e8m0 group scales: add_expert_mxfp4; slices on groups
    of 32); with --weight-format bf16, and for FP8-e8m0, they are dequantised exactly
    (checkpoint.formats_v4) and held as bf16, which is exact (checked per weight: bf16_exact). The
    numpy backend holds the exact f32 values. The backend applies the config's swiglu_limit.

    act_bits: 16, or 8 (`--act-bits 8`: the kernels' 8-bit activations, int8/int4/mxfp4 only; any
    other combination is refused before reading weights); reported in info["act_bits"]."""
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"--weight-format {weight_format!r}: choose one of {', '.join(WEIGHT_FORMATS)}")
    from checkpoint.formats import as_format
    from checkpoint.reader import CheckpointError, CheckpointReader

    reader = CheckpointReader(model_dir, any_architecture=True)
    cfg: ModelConfig = reader.config
    expert_weight = expert_weight_name(cfg)
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    experts = list(range(E)) if experts is None else sorted(set(int(e) for e in experts))
    bad = [e for e in experts if not 0 <= e < E]
    if bad:
        raise ValueError(f"experts {bad} outside [0, {E}) of model {model_dir}")
    s_idx, s_cnt = slice_spec if slice_spec is not None else (0, 1)
    if not (s_cnt >= 1 and 0 <= s_idx < s_cnt):
        raise ValueError(f"slice {s_idx}/{s_cnt}: need count >= 1 and 0 <= index < count")
    i0, i1 = slice_range(I, s_idx, s_cnt)
    if i1 <= i0:
        raise ValueError(f"slice {s_idx}/{s_cnt} of moe_intermediate_size={I} is empty; use fewer slices")
    layers = list(cfg.moe_layers)
    # headers only: every tensor served is present, inside its file and of the right shape
    reader.verify([expert_weight(layer, e, p) for layer in layers for e in experts for p in ("gate", "up", "down")])
    fmt = _weight_format(reader, expert_weight(layers[0], experts[0], "gate"), cfg) if layers else "f32"
    if weight_format == "mxfp4" and fmt != "mxfp4":
        raise ValueError(f"--weight-format mxfp4 holds MXFP4 experts as stored; {model_dir} stores {fmt}: "
                         "choose auto, bf16, int8 or int4")
    be = make_backend(backend, weight_format=fmt if weight_format == "auto" else weight_format,
                      swiglu_limit=swiglu_limit_of(cfg), act_bits=act_bits)
    # V4 formats held as bf16 by the kernels: exact, checked per weight below
    check_bf16 = fmt in V4_EXACT_IN_BF16 and be.name != "numpy" and be.weight_format == "bf16"
    # numpy with an explicit format holds the values the kernels would hold in it
    round_to = weight_format if weight_format not in ("auto", fmt) and not hasattr(be, "add_expert_int4") else None
    t0 = time.perf_counter()
    whole = (i0, i1) == (0, I)
    # INT4 checkpoints load into INT4 kernels as stored (re-quantising dequantised INT4 is lossy)
    native_int4 = fmt == "int4" and hasattr(be, "add_expert_int4") and be.weight_format == "int4"
    native_mxfp4 = fmt == "mxfp4" and hasattr(be, "add_expert_mxfp4") and be.weight_format == "mxfp4"
    if native_mxfp4:
        check_mxfp4_slice(i0, i1, f"slice {s_idx}/{s_cnt}")
    if native_int4 and (i0 % 32 or (i1 % 32 and i1 != I)):
        raise ValueError(f"slice {s_idx}/{s_cnt} = intermediate [{i0}:{i1}) does not align to the INT4 group of 32; "
                         f"use a slice count that divides {I // 32}, --weight-format bf16|int8, or --backend numpy")
    for layer in layers:
        for e in experts:
            if native_mxfp4:
                names = [expert_weight(layer, e, p) for p in ("gate", "up", "down")]
                st = [dict(zip(("weight", "scale"), slice_mxfp4(reader.get_stored(n).arrays, p, i0, i1)))
                      for n, p in zip(names, ("gate", "up", "down"))]
                add_mxfp4_expert(be, layer, e, st, names, reader.file_of)
                continue
            if native_int4:
                st = [reader.get_stored(expert_weight(layer, e, p)).arrays for p in ("gate", "up", "down")]
                for proj, a in zip(("gate", "up", "down"), st):
                    if not np.isfinite(np.asarray(a["weight_scale"], dtype=np.float32)).all():
                        name = expert_weight(layer, e, proj)
                        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r}: weight_scale holds NaN/Inf; "
                                              "the file is corrupt: re-download or re-write it")
                g0, g1 = i0 // 32, -(-i1 // 32)
                be.add_expert_int4(layer, e,
                                   st[0]["weight_packed"][i0:i1], st[0]["weight_scale"][i0:i1],
                                   st[1]["weight_packed"][i0:i1], st[1]["weight_scale"][i0:i1],
                                   st[2]["weight_packed"][:, i0 // 8:-(-i1 // 8)], st[2]["weight_scale"][:, g0:g1],
                                   (i1 - i0, cfg.hidden_size))
                continue
            gate = reader.get(expert_weight(layer, e, "gate"))  # [I, H]
            up = reader.get(expert_weight(layer, e, "up"))  # [I, H]
            down = reader.get(expert_weight(layer, e, "down"))  # [H, I]
            for proj, t in (("gate", gate), ("up", up), ("down", down)):
                if not np.isfinite(t).all():  # corrupt data bytes decode to NaN / Inf
                    name = expert_weight(layer, e, proj)
                    raise CheckpointError(
                        f"{reader.file_of(name)}: tensor {name!r} holds {int((~np.isfinite(t)).sum())} NaN/Inf "
                        "values; the file is corrupt: re-download or re-write it")
                if check_bf16:
                    bf16_exact(t, reader.file_of(expert_weight(layer, e, proj)), expert_weight(layer, e, proj))
            if not whole:  # copy so the full tensors are freed right away
                gate, up, down = gate[i0:i1].copy(), up[i0:i1].copy(), down[:, i0:i1].copy()
            if round_to is not None:
                gate, up, down = (as_format(t, round_to) for t in (gate, up, down))
            be.add_expert(layer, e, gate, up, down)
            del gate, up, down
        reader.close()  # unmap: file pages read so far stop counting towards this process's RSS
    be.finalize()
    info = dict(
        experts=experts,
        layers=layers,
        slice_index=s_idx,
        slice_count=s_cnt,
        intermediate_start=i0,
        intermediate_stop=i1,
        weight_format=fmt,
        serve_format=be.weight_format if weight_format == "auto" else weight_format,
        act_bits=act_bits,
        load_s=time.perf_counter() - t0,
    )
    return cfg, be, info
