"""Packed per-shard expert files: what `moesplit convert` writes and `expert-server --packed` reads.

    OUTDIR/moesplit-packed.json                           manifest (below)
    OUTDIR/config.json                                    copy of the model's config.json
    OUTDIR/shard-{i}-of-{n}/layer-{L:03d}.safetensors     one per shard and MoE layer

A layer file is a plain safetensors file holding exactly its shard's routed experts of layer L
(or its intermediate slice [i0:i1) of every expert: gate/up rows, down columns), with real
tensor names, in one format:

    bf16  model.layers.L.mlp.experts.e.{gate,up,down}_proj.weight   bf16 [I_s, H] / [H, I_s]
    int8  ...weight int8 + ...weight_scale f32 [out]  (per output channel, checkpoint.formats.
          quant_int8_channel: the kernels' own int8 quantisation)
    int4  ...weight_packed int32 / ...weight_scale bf16 / ...weight_shape int32: compressed-tensors
          pack-quantized, symmetric, group 32 (an INT4 checkpoint's experts are copied bit-exactly)
    mxfp4 DeepSeek-V4 only, copied as stored: layers.L.ffn.experts.e.w1|w3|w2.weight I8 [out, in/2]
          + .scale F8_E8M0 [out, in/32] (checkpoint.formats_v4)

(A DeepSeek-V4 model's files use its own names, layers.L.ffn.experts.e.w1|w3|w2, in every format.)

so `CheckpointReader(shard_dir)` reads a shard directory (no index needed) and `get()` dequantises.
Manifest: {"moesplit_packed": 1, "fingerprint": cfg.fingerprint(), "config": "config.json",
"model": source dir, "source_format", "format", "split": "experts"|"intermediate", "shards":
[{"index", "dir", "experts": [...], "intermediate": [i0, i1], "layers": [...]}]}.

A layer file's header (every name, dtype, shape) is known before any data is read, so it is
written first and the tensors are streamed after it, expert by expert, into a temporary name
that is renamed once complete; a file is complete when its header parses, lists exactly the
expected tensors and the file size is header + data (`layer_complete`).
"""
from __future__ import annotations

import json
import math
import os
import struct
import time

import numpy as np

from checkpoint.config import ModelConfig
from checkpoint.config_v4 import load_any_config
from checkpoint.manifest import MANIFEST, VERSION, PackedError, read_manifest  # noqa: F401 (convert uses P.MANIFEST)
from checkpoint.formats import as_format, pack_int4, quant_int8_channel
from checkpoint.names import PROJS, expert_weight
from cpu_expert_service.arch import V4_EXACT_IN_BF16, add_mxfp4_expert, bf16_exact, expert_weight_name, swiglu_limit_of
from checkpoint.reader import DTYPES, CheckpointError, SafetensorsFile, _ST_NAME

FORMATS = ("bf16", "int8", "int4", "mxfp4")
SERVE_FORMATS = ("bf16", "int8", "int4", "mxfp4")  # how a shard may hold them (mxfp4: MXFP4 files only)
SPLITS = ("intermediate", "experts")
INT4_GROUP = 32  # the kernels' (and Kimi-K2-Thinking's) group size
PARTIAL = ".partial"  # temporary layer files: layer-003.safetensors.partial-<pid>


# ---- layout ------------------------------------------------------------------------------------
def shard_dirname(index: int, count: int) -> str:
    return f"shard-{index}-of-{count}"


def layer_filename(layer: int) -> str:
    return f"layer-{layer:03d}.safetensors"


def resolve_format(fmt: str, source_format: str) -> str:
    """auto -> int4 for an INT4 checkpoint, mxfp4 for an MXFP4 one, else bf16; explicit formats
    are checked (mxfp4 is a copy of MXFP4 experts, never a quantisation)."""
    if fmt == "auto":
        return source_format if source_format in ("int4", "mxfp4") else "bf16"
    if fmt not in FORMATS:
        raise ValueError(f"--format {fmt!r}: choose auto, {', '.join(FORMATS)}")
    if fmt == "mxfp4" and source_format != "mxfp4":
        raise ValueError(f"--format mxfp4 copies MXFP4 experts as stored; these are {source_format}: choose "
                         f"auto, {', '.join(SERVE_FORMATS)}")
    return fmt


def plan_shards(cfg: ModelConfig, count: int, split: str) -> list[dict]:
    """The shards of a conversion: contiguous even expert ranges (as gpu_service.local.stack.
    expert_ranges) or even intermediate slices (as cpu_expert_service.shard_load.slice_range)."""
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    if split not in SPLITS:
        raise ValueError(f"--split {split!r}: choose {' or '.join(SPLITS)}")
    if split == "experts" and not 1 <= count <= E:
        raise ValueError(f"--shards {count}: cannot split {E} experts into {count} shards; need 1 <= n <= {E}")
    if split == "intermediate" and not 1 <= count <= I:
        raise ValueError(f"--shards {count}: cannot split moe_intermediate_size={I} into {count} slices")
    out = []
    for i in range(count):
        if split == "experts":
            experts, (i0, i1) = list(range(i * E // count, (i + 1) * E // count)), (0, I)
        else:
            experts, (i0, i1) = list(range(E)), (i * I // count, (i + 1) * I // count)
        out.append(dict(index=i, dir=shard_dirname(i, count), experts=experts, intermediate=[i0, i1],
                        layers=list(cfg.moe_layers)))
    return out


def check_int4_slices(shards: list[dict], I: int, fmt: str = "INT4") -> None:
    """INT4 (or MXFP4) stored weights slice along the intermediate dim only at group boundaries
    (down's input dim is packed in groups of 32); anything else would need re-quantising."""
    for s in shards:
        i0, i1 = s["intermediate"]
        if i0 % INT4_GROUP or (i1 % INT4_GROUP and i1 != I):
            raise ValueError(
                f"shard {s['index']}: intermediate slice [{i0}:{i1}) of moe_intermediate_size={I} does not align "
                f"to the {fmt} group of {INT4_GROUP}, so the {fmt} experts cannot be copied as stored; use a shard "
                f"count that divides {I // INT4_GROUP}, --split experts, or another --format")


def tensor_specs(fmt: str, layer: int, experts: list[int], I_s: int, H: int,
                 name_of=expert_weight) -> list[tuple[str, str, tuple]]:
    """(name, safetensors dtype, shape) of every tensor of one layer file, in file order; name_of:
    the model's expert naming (cpu_expert_service.arch.expert_weight_name)."""
    out = []
    for e in experts:
        for proj in PROJS:
            o, i = (H, I_s) if proj == "down" else (I_s, H)
            name = name_of(layer, e, proj)  # ....weight
            base = name[: -len("weight")]
            if fmt == "mxfp4":
                out += [(name, "I8", (o, i // 2)), (base + "scale", "F8_E8M0", (o, math.ceil(i / INT4_GROUP)))]
            elif fmt == "bf16":
                out.append((name, "BF16", (o, i)))
            elif fmt == "int8":
                out += [(name, "I8", (o, i)), (base + "weight_scale", "F32", (o,))]
            elif fmt == "int4":
                out += [(base + "weight_packed", "I32", (o, math.ceil(i / 8))),
                        (base + "weight_scale", "BF16", (o, math.ceil(i / INT4_GROUP))),
                        (base + "weight_shape", "I32", (2,))]
            else:
                raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")
    return out


def _header(specs, metadata: dict[str, str]) -> tuple[bytes, int]:
    header: dict = {"__metadata__": dict(metadata)}
    off = 0
    for name, dt, shape in specs:
        n = math.prod(shape) * DTYPES[dt].itemsize
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # data 8-byte aligned, as safetensors does
    return struct.pack("<Q", len(blob)) + blob, off


def file_size(specs, metadata: dict[str, str]) -> int:
    head, data = _header(specs, metadata)
    return len(head) + data


# ---- encoding one expert -----------------------------------------------------------------------
def encode(fmt: str, name: str, w: np.ndarray) -> list[np.ndarray]:
    """Float weight [out, in] -> its stored arrays in `fmt`, in tensor_specs order."""
    if fmt == "bf16":
        return [w if w.dtype == DTYPES["BF16"] else np.asarray(w, dtype=np.float32).astype(DTYPES["BF16"])]
    if fmt == "int8":
        return list(quant_int8_channel(w))
    if fmt == "int4":
        return list(pack_int4(w, INT4_GROUP))
    raise ValueError(f"format {fmt!r}: choose one of {', '.join(FORMATS)}")


def slice_int4(arrays: dict, proj: str, i0: int, i1: int) -> list[np.ndarray]:
    """Stored INT4 arrays of one projection cut to the intermediate slice [i0:i1) (group-aligned,
    see check_int4_slices): gate/up rows, down packed columns and groups. Bits unchanged."""
    p, s, shape = arrays["weight_packed"], arrays["weight_scale"], np.asarray(arrays["weight_shape"]).reshape(-1)
    o, i = int(shape[0]), int(shape[1])
    if proj == "down":
        return [p[:, i0 // 8: math.ceil(i1 / 8)], s[:, i0 // INT4_GROUP: math.ceil(i1 / INT4_GROUP)],
                np.array([o, i1 - i0], dtype=np.int32)]
    return [p[i0:i1], s[i0:i1], np.array([i1 - i0, i], dtype=np.int32)]


def slice_mxfp4(arrays: dict, proj: str, i0: int, i1: int) -> list[np.ndarray]:
    """Stored MXFP4 arrays (weight I8 [out, in/2], scale [out, in/32]) of one projection cut to the
    intermediate slice [i0:i1) (group-aligned): gate/up rows, down packed columns. Bits unchanged."""
    q, s = arrays["weight"], arrays["scale"]
    if proj == "down":
        return [q[:, i0 // 2: i1 // 2], s[:, i0 // INT4_GROUP: math.ceil(i1 / INT4_GROUP)]]
    return [q[i0:i1], s[i0:i1]]


# ---- writing / checking one layer file ---------------------------------------------------------
class LayerWriter:
    """Streams one layer file: header first, then `write(array)` in tensor_specs order; `commit()`
    fsyncs and renames the temporary file to `path`. Leaving without commit removes it."""

    def __init__(self, path: str, specs, metadata: dict[str, str]):
        self.path, self.specs = path, list(specs)
        self.tmp = f"{path}{PARTIAL}-{os.getpid()}"
        head, self.data_bytes = _header(self.specs, metadata)
        self._f = open(self.tmp, "wb")
        self._f.write(head)
        self._next = 0
        self.bytes = len(head)

    def write(self, a: np.ndarray) -> int:
        name, dt, shape = self.specs[self._next]
        a = np.ascontiguousarray(a)
        if _ST_NAME.get(a.dtype) != dt or tuple(a.shape) != tuple(shape):
            raise AssertionError(f"{self.path}: {name}: got {a.dtype} {a.shape}, expected {dt} {shape}")
        self._f.write(memoryview(a.reshape(-1).view(np.uint8)))
        self._next += 1
        self.bytes += a.nbytes
        return a.nbytes

    def commit(self) -> None:
        if self._next != len(self.specs):
            raise AssertionError(f"{self.path}: {self._next} of {len(self.specs)} tensors written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def layer_complete(path: str, specs) -> bool:
    """True when `path` exists, its header parses and lists exactly `specs`, and the file is
    exactly header + data bytes long (a truncated or over-long file is not complete)."""
    if not os.path.exists(path):
        return False
    try:
        f = SafetensorsFile(path)
    except CheckpointError:
        return False
    if len(f.tensors) != len(specs):
        return False
    end = 0
    for name, dt, shape in specs:
        t = f.tensors.get(name)
        if t is None or t.problem or t.dtype != dt or tuple(t.shape) != tuple(shape):
            return False
        end = max(end, t.end)
    return end == f.size


# ---- manifest ----------------------------------------------------------------------------------
def write_json(path: str, obj) -> None:
    tmp = f"{path}{PARTIAL}-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def packed_config(packed_dir: str, model_dir: str | None = None) -> tuple[ModelConfig, dict]:
    """(config, manifest) of a packed directory; with `model_dir`, its config.json must be the
    model the files were converted from (same fingerprint)."""
    m = read_manifest(packed_dir)
    cfg = load_any_config(os.path.join(packed_dir, m.get("config", "config.json")))
    if cfg.fingerprint() != m.get("fingerprint"):
        raise PackedError(f"{packed_dir}: config.json fingerprint {cfg.fingerprint()} != the manifest's "
                          f"{m.get('fingerprint')}; the directory was modified: re-run `moesplit convert`")
    if model_dir is not None:
        want = load_any_config(model_dir).fingerprint()
        if want != m["fingerprint"]:
            raise PackedError(
                f"{packed_dir} was converted from another model (fingerprint {m['fingerprint']}, source "
                f"{m.get('model')}) than --model {model_dir} (fingerprint {want}); convert this model with "
                f"`moesplit convert --model {model_dir} --out DIR` or point --packed at its conversion")
    return cfg, m


# ---- loading a shard ---------------------------------------------------------------------------
def load_packed(packed_dir: str, shard_index: int, backend: str = "numpy", weight_format: str = "auto",
                model_dir: str | None = None, act_bits: int = 16):
    """Load shard `shard_index` of a packed directory into a backend: (cfg, backend, info), as
    cpu_expert_service.shard_load.load_shard. weight_format auto = the packed format. INT4 files go
    into INT4 kernels as stored (add_expert_int4); everything else is dequantised (int8: q * scale)
    and handed to add_expert, where INT8 kernels re-quantise it to the same q and scale (the scales
    convert writes are fl(amax/127), and fl(fl(127 * s) / 127) == s for those); the numpy backend
    with an explicit other format rounds through it (checkpoint.formats.as_format). MXFP4 files
    (DeepSeek-V4) go into mxfp4 kernels as stored (add_mxfp4_expert); with --weight-format bf16 they
    are dequantised exactly and held as bf16, exactly (bf16_exact). act_bits: as load_shard."""
    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.backend import make_backend

    cfg, m = packed_config(packed_dir, model_dir)
    shards = m["shards"]
    if not 0 <= shard_index < len(shards):
        raise PackedError(f"--shard-index {shard_index} is out of range: {packed_dir} holds {len(shards)} shards "
                          f"(0..{len(shards) - 1})")
    s = shards[shard_index]
    fmt = m["format"]
    serve = fmt if weight_format == "auto" else weight_format
    if weight_format != "auto" and serve not in SERVE_FORMATS:
        raise ValueError(f"--weight-format {weight_format!r}: choose auto, {', '.join(SERVE_FORMATS)}")
    if serve == "mxfp4" and fmt != "mxfp4":
        raise ValueError(f"--weight-format mxfp4 holds MXFP4 experts as stored; {packed_dir} holds {fmt}: "
                         f"choose auto, {', '.join(f for f in SERVE_FORMATS if f != 'mxfp4')}")
    name_of = expert_weight_name(cfg)
    sdir = os.path.join(packed_dir, s["dir"])
    H = cfg.hidden_size
    i0, i1 = s["intermediate"]
    experts, layers = [int(e) for e in s["experts"]], [int(x) for x in s["layers"]]
    bad = [layer_filename(L) for L in layers
           if not layer_complete(os.path.join(sdir, layer_filename(L)),
                                 tensor_specs(fmt, L, experts, i1 - i0, H, name_of))]
    if bad:
        raise PackedError(f"{sdir}: {len(bad)} layer file(s) missing or incomplete ({', '.join(bad[:4])}"
                          f"{' …' if len(bad) > 4 else ''}); the conversion did not finish: re-run "
                          f"`moesplit convert` with the same arguments (it resumes)")
    be = make_backend(backend, weight_format=serve, swiglu_limit=swiglu_limit_of(cfg), act_bits=act_bits)
    kernels = hasattr(be, "add_expert_int4")
    native_int4 = kernels and fmt == "int4" and be.weight_format == "int4"
    native_mxfp4 = kernels and fmt == "mxfp4" and be.weight_format == "mxfp4"
    check_bf16 = kernels and fmt in V4_EXACT_IN_BF16 and be.weight_format == "bf16"
    t0 = time.perf_counter()
    reader = CheckpointReader(sdir, config=cfg)
    for layer in layers:
        for e in experts:
            names = [name_of(layer, e, p) for p in PROJS]
            if native_mxfp4:  # the layer files hold the slice already
                add_mxfp4_expert(be, layer, e, [reader.get_stored(n).arrays for n in names], names, reader.file_of)
                continue
            if native_int4:
                st = [reader.get_stored(n).arrays for n in names]
                _check_finite(reader, names, [a["weight_scale"] for a in st])
                be.add_expert_int4(layer, e, st[0]["weight_packed"], st[0]["weight_scale"],
                                   st[1]["weight_packed"], st[1]["weight_scale"],
                                   st[2]["weight_packed"], st[2]["weight_scale"],
                                   [a["weight_shape"] for a in st])
                continue
            ws = [reader.get(n) for n in names]  # gate [I_s, H], up [I_s, H], down [H, I_s] f32
            _check_finite(reader, names, ws)
            for n, w in zip(names, ws if check_bf16 else ()):
                bf16_exact(w, reader.file_of(n), n)
            if not kernels and serve != fmt:  # numpy holds what the kernels would
                ws = [as_format(w, serve) for w in ws]
            be.add_expert(layer, e, *ws)
        reader.close()  # unmap: pages read so far stop counting towards RSS
    be.finalize()
    n = len(shards)
    info = dict(experts=experts, layers=layers,
                slice_index=shard_index if m["split"] == "intermediate" else 0,
                slice_count=n if m["split"] == "intermediate" else 1,
                intermediate_start=i0, intermediate_stop=i1, weight_format=fmt,
                serve_format=be.weight_format if weight_format == "auto" else serve, act_bits=act_bits,
                packed=os.path.abspath(packed_dir), load_s=time.perf_counter() - t0)
    return cfg, be, info


def _check_finite(reader, names, arrays) -> None:
    for name, a in zip(names, arrays):
        if not np.isfinite(np.asarray(a, dtype=np.float32)).all():
            raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} holds NaN/Inf; the file is corrupt: "
                                  "delete it and re-run `moesplit convert` (it rewrites missing layer files)")


def layer_metadata(fmt: str, index: int, count: int) -> dict[str, str]:
    return {"format": "pt", "moesplit_format": fmt, "moesplit_shard": f"{index}/{count}"}
