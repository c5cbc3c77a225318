"""Lazy, per-tensor reading of Hugging Face safetensors checkpoints, numpy only.

safetensors' own numpy framework cannot return bf16 or float8 tensors (numpy has no such
dtypes), so this module parses the format itself: an 8-byte little-endian header length, a JSON
header {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then the data.
Each file is `np.memmap`ed read-only once; a tensor is a view of its byte range, viewed with
ml_dtypes' bfloat16 / float8_e4m3fn. Nothing is read until a tensor's pages are touched, so
reading one expert pages in that expert only.

Logical names: an FP8 `X.weight` + `X.weight_scale_inv`, or an INT4 `X.weight_packed` +
`X.weight_scale` + `X.weight_shape`, or an INT8 `X.weight` (int8) + `X.weight_scale` (f32 per
output channel, moesplit's packed format), are one logical `X.weight`. `get()` dequantises to float32;
`get_stored()` returns the stored arrays (zero-copy, read-only memmap views).

DeepSeek-V4 checkpoints (config `DeepseekV4ForCausalLM`): `X.weight` + `X.scale` (F8_E8M0) is one
logical `X.weight`, format "fp8_e8m0" when the weight is F8_E4M3 (128x128 blocks) or "mxfp4" when
it is I8 (packed e2m1, see checkpoint.formats_v4); a leading `model.` (transformers' save_pretrained
spelling) is dropped from logical names, so both spellings read the same.

Kimi-K2.5 / K2.6 checkpoints (config `KimiK25ForConditionalGeneration`, `cfg.weight_prefix`
"language_model."): `language_model.model.X` reads as logical `model.X` and
`language_model.lm_head.weight` as `lm_head.weight`, so every caller (GPU model, expert shards,
converters) uses the plain DeepSeek-V3 names; the `vision_tower.*` / `mm_projector.*` tensors are
left out of the logical names and listed in `.not_served` (stored name -> reason): the vision
tower (gpu_service.model.vision) reads them with `get_raw`.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field

import ml_dtypes
import numpy as np

from checkpoint import kimi_k25, names_v4
from checkpoint.config import ModelConfig, load_config
from checkpoint.config_v4 import V4Config, load_any_config
from checkpoint.formats import dequant_fp8_block, dequant_int8_channel, fp8_scale_shape, int4_shapes, unpack_int4
from checkpoint.formats_v4 import dequant_fp8_e8m0, dequant_mxfp4, fp8_e8m0_scale_shape, mxfp4_shapes
from checkpoint.names import expected_shapes, is_mtp

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit

DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
if hasattr(ml_dtypes, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = np.dtype(ml_dtypes.float8_e8m0fnu)
_ST_NAME = {v: k for k, v in DTYPES.items()}
_PLAIN_FORMAT = {"F32": "f32", "BF16": "bf16", "F16": "f16"}

FP8_SUFFIXES = ("weight_scale_inv",)
INT4_SUFFIXES = ("weight_packed", "weight_scale", "weight_shape")


class CheckpointError(RuntimeError):
    """A checkpoint file that cannot be read as it claims (bad header, truncated data, wrong shape)."""


class MissingTensorError(KeyError):
    """A tensor the model needs is not in the checkpoint. The message names tensor and file."""

    def __init__(self, message: str, name: str = ""):
        super().__init__(message)
        self.message = message
        self.name = name

    def __str__(self) -> str:
        return self.message


@dataclass(frozen=True)
class TensorInfo:
    name: str  # stored name
    file: str  # absolute path
    dtype: str  # safetensors dtype string, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int
    problem: str | None = None  # integrity problem found when the header was read

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass
class StoredTensor:
    """A logical tensor as stored. format: "f32"|"bf16"|"f16"|"fp8"|"int4"|"int8" (or a lower-case
    safetensors dtype such as "i64" for other plain tensors). arrays: stored suffix -> array, e.g.
    {"weight"} for plain weights, {"e_score_correction_bias"} for that buffer, {"weight",
    "weight_scale_inv"} for FP8, {"weight_packed", "weight_scale", "weight_shape"} for INT4.
    shape: logical (dequantised) shape."""

    format: str
    arrays: dict[str, np.ndarray]
    shape: tuple[int, ...]
    names: dict[str, str] = field(default_factory=dict)  # suffix -> stored tensor name

    @property
    def data(self) -> np.ndarray:
        """The primary array (weight, weight_packed, or the plain tensor)."""
        for k in ("weight_packed", "weight"):
            if k in self.arrays:
                return self.arrays[k]
        return next(iter(self.arrays.values()))

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays.values())


class SafetensorsFile:
    """One .safetensors file: header parsed at open, data memmapped lazily."""

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        try:
            self.size = os.path.getsize(self.path)
        except OSError as e:
            raise CheckpointError(f"{self.path}: cannot open ({e}); check the file exists and is readable") from e
        self.metadata, self.tensors = self._read_header()
        self._mm: np.memmap | None = None

    def _bad(self, why: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path}: not a valid safetensors file ({why}); the file is probably truncated or "
            "corrupt: re-download or re-write it"
        )

    def _read_header(self) -> tuple[dict, dict[str, TensorInfo]]:
        if self.size < 8:
            raise self._bad(f"only {self.size} bytes")
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER or 8 + n > self.size:
                raise self._bad(f"header length {n} does not fit in a {self.size}-byte file")
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self._bad(f"header is not JSON: {e}") from e
        if not isinstance(header, dict):
            raise self._bad("header is not a JSON object")
        start = 8 + n
        meta = header.pop("__metadata__", None) or {}
        tensors: dict[str, TensorInfo] = {}
        for name, h in header.items():
            try:
                dtype, shape, (b, e) = h["dtype"], tuple(int(s) for s in h["shape"]), h["data_offsets"]
            except (KeyError, TypeError, ValueError) as ex:
                raise CheckpointError(f"{self.path}: tensor {name!r}: malformed header entry {h!r}") from ex
            problem = None
            if dtype not in DTYPES:
                problem = f"dtype {dtype!r} is not supported (supported: {', '.join(DTYPES)})"
            elif not 0 <= b <= e:
                problem = f"bad data_offsets [{b}, {e}]"
            elif e - b != math.prod(shape) * DTYPES[dtype].itemsize:
                problem = (
                    f"data_offsets [{b}, {e}] hold {e - b} bytes but {dtype}{list(shape)} needs "
                    f"{math.prod(shape) * DTYPES[dtype].itemsize}"
                )
            elif start + e > self.size:
                problem = (
                    f"data ends at byte {start + e} but the file has only {self.size} bytes "
                    "(truncated download?)"
                )
            tensors[name] = TensorInfo(name, self.path, dtype, shape, start + b, start + e, problem)
        return meta, tensors

    def array(self, name: str) -> np.ndarray:
        """Read-only zero-copy view of a stored tensor."""
        info = self.tensors[name]
        if info.problem:
            raise CheckpointError(f"{self.path}: tensor {name!r}: {info.problem}; re-download or re-write the file")
        if info.nbytes == 0:
            return np.zeros(info.shape, DTYPES[info.dtype])
        if self._mm is None:
            self._mm = np.memmap(self.path, dtype=np.uint8, mode="r")
        return self._mm[info.begin : info.end].view(DTYPES[info.dtype]).reshape(info.shape)

    def close(self) -> None:
        self._mm = None


def _split(stored: str) -> tuple[str, str]:
    """`a.b.weight_scale_inv` -> ("a.b.", "weight_scale_inv")."""
    i = stored.rfind(".")
    return stored[: i + 1], stored[i + 1 :]


def _logical(stored: str, v4: bool = False) -> str:
    """Logical name of a stored tensor (scale / packing companions fold into `…weight`)."""
    if v4:
        stored = names_v4.strip_prefix(stored)
    prefix, suffix = _split(stored)
    if suffix in FP8_SUFFIXES or suffix in INT4_SUFFIXES or (v4 and suffix == "scale"):
        return prefix + "weight"
    return stored


class CheckpointReader:
    """A Hugging Face checkpoint directory: config.json + model.safetensors or sharded
    model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json."""

    def __init__(self, model_dir: str | os.PathLike, config: ModelConfig | V4Config | None = None, *,
                 any_architecture: bool = False):
        """config None: read config.json with checkpoint.config.load_config (the V3 family; it
        refuses DeepSeek-V4 naming the reader that takes it); any_architecture=True reads every
        supported architecture (checkpoint.config_v4.load_any_config): the serving paths, the expert
        shard and convert."""
        self.model_dir = os.path.abspath(os.fspath(model_dir))
        if not os.path.isdir(self.model_dir):
            raise CheckpointError(f"{self.model_dir}: not a directory; pass a checkpoint directory")
        if config is None:
            config = load_any_config(self.model_dir) if any_architecture else load_config(self.model_dir)
        self.config = config
        self.v4 = self.config.is_v4
        self._files: dict[str, SafetensorsFile] = {}
        self._weight_map: dict[str, str] = self._load_weight_map()  # stored name -> file name
        self._groups: dict[str, dict[str, str]] = {}  # logical -> {suffix: stored name}
        self.not_served: dict[str, str] = {}  # stored name -> why the text model does not read it
        prefixed = bool(getattr(self.config, "weight_prefix", ""))
        for stored in self._weight_map:
            name = kimi_k25.logical_name(stored) if prefixed else stored
            if name is None:
                self.not_served[stored] = kimi_k25.NOT_SERVED
                continue
            self._groups.setdefault(_logical(name, self.v4), {})[_split(stored)[1]] = stored

    # ---- files ------------------------------------------------------------------------------
    def _load_weight_map(self) -> dict[str, str]:
        index = os.path.join(self.model_dir, INDEX_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    wm = json.load(f)["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: unreadable index ({e}); re-download it") from e
            missing = sorted({fn for fn in wm.values() if not os.path.exists(os.path.join(self.model_dir, fn))})
            if missing:
                raise CheckpointError(
                    f"{index} maps tensors to file(s) that are not in {self.model_dir}: "
                    f"{', '.join(missing[:5])}{' …' if len(missing) > 5 else ''}; download the missing shards"
                )
            return dict(wm)
        single = os.path.join(self.model_dir, SINGLE_FILE)
        if os.path.exists(single):
            return {n: SINGLE_FILE for n in self._file(SINGLE_FILE).tensors}
        files = sorted(f for f in os.listdir(self.model_dir) if f.endswith(".safetensors"))
        if not files:
            raise CheckpointError(
                f"{self.model_dir}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files; "
                "point at a Hugging Face checkpoint directory"
            )
        wm = {}
        for fn in files:  # no index: build the map from every file's header
            for n in self._file(fn).tensors:
                wm[n] = fn
        return wm

    def _file(self, fn: str) -> SafetensorsFile:
        f = self._files.get(fn)
        if f is None:
            f = self._files[fn] = SafetensorsFile(os.path.join(self.model_dir, fn))
        return f

    @property
    def files(self) -> list[str]:
        """File names (relative to model_dir) that hold tensors."""
        return sorted(set(self._weight_map.values()))

    def _info(self, stored: str, logical: str | None = None) -> TensorInfo:
        fn = self._weight_map.get(stored)
        if fn is None:
            raise self._missing(logical or stored)
        f = self._file(fn)
        info = f.tensors.get(stored)
        if info is None:
            raise MissingTensorError(
                f"tensor {stored!r} is mapped to {f.path} by {INDEX_FILE}, but that file does not contain "
                "it; the shard is stale or the index is wrong: re-download both",
                stored,
            )
        return info

    def _missing(self, name: str) -> MissingTensorError:
        where = ", ".join(self.files[:4]) + (" …" if len(self.files) > 4 else "")
        prefix = getattr(self.config, "weight_prefix", "")
        label = repr(name)
        if prefix and not name.startswith(prefix):
            label += f" (stored as {prefix + name!r})"
        return MissingTensorError(
            f"tensor {label} is not in the checkpoint {self.model_dir} (searched {where}); the checkpoint "
            "is incomplete or of another model: check config.json matches the weights",
            name,
        )

    def get_raw(self, stored: str) -> np.ndarray:
        """A stored tensor by its on-disk name, zero-copy, in its stored dtype."""
        info = self._info(stored)
        return self._file(self._weight_map[stored]).array(info.name)

    def raw_info(self, stored: str) -> TensorInfo:
        return self._info(stored)

    # ---- logical tensors ---------------------------------------------------------------------
    def names(self, include_mtp: bool = False) -> list[str]:
        """Logical tensor names in the checkpoint (MTP layers left out unless include_mtp)."""
        if self.v4:
            return [n for n in self._groups if include_mtp or not names_v4.is_mtp(n)]
        return [n for n in self._groups if include_mtp or not is_mtp(n, self.config)]

    def has(self, name: str) -> bool:
        return name in self._groups

    def __contains__(self, name: str) -> bool:
        return self.has(name)

    def file_of(self, name: str) -> str:
        """Absolute path of the file holding `name` (a logical or stored name)."""
        g = self._groups.get(name)
        stored = next(iter(g.values())) if g else name
        fn = self._weight_map.get(stored)
        if fn is None:
            raise self._missing(name)
        return os.path.join(self.model_dir, fn)

    def format_of(self, name: str) -> str:
        g = self._group(name)
        if "weight_packed" in g:
            return "int4"
        if "weight_scale_inv" in g:
            return "fp8"
        if set(g) == {"weight", "weight_scale"} and self._info(g["weight"], name).dtype == "I8":
            return "int8"  # symmetric per output channel: moesplit's packed int8 (cpu_expert_service.packed)
        if self.v4 and set(g) == {"weight", "scale"}:
            dt = self._info(g["weight"], name).dtype
            if dt in ("F8_E4M3", "I8"):
                return "fp8_e8m0" if dt == "F8_E4M3" else "mxfp4"
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r}: weight dtype {dt} with a `.scale` is not "
                                  "a DeepSeek-V4 layout (F8_E4M3 block FP8 or I8 packed MXFP4)")
        if len(g) > 1:
            raise CheckpointError(
                f"{self.file_of(name)}: tensor {name!r} is stored as {sorted(g)}, a layout moesplit does not "
                "read (supported: plain, DeepSeek FP8 weight+weight_scale_inv, compressed-tensors INT4 "
                "weight_packed+weight_scale+weight_shape)"
            )
        dt = self._info(next(iter(g.values())), name).dtype
        return _PLAIN_FORMAT.get(dt, dt.lower())

    def _group(self, name: str) -> dict[str, str]:
        g = self._groups.get(name)
        if g is None:
            if name in self._weight_map:  # a stored name such as X.weight_scale_inv
                return {_split(name)[1]: name}
            raise self._missing(name)
        return g

    def get_stored(self, name: str) -> StoredTensor:
        g = self._group(name)
        fmt = self.format_of(name)
        if fmt == "int4":
            for s in INT4_SUFFIXES:
                if s not in g:
                    raise self._missing(_split(g["weight_packed"])[0] + s)
        elif fmt == "fp8" and "weight" not in g:
            raise self._missing(name)
        elif fmt in ("fp8_e8m0", "mxfp4") and "weight" not in g:
            raise self._missing(name)
        arrays = {}
        for suffix, stored in g.items():
            info = self._info(stored, name)
            arrays[suffix] = self._file(self._weight_map[stored]).array(info.name)
        if fmt == "int4":
            shape = tuple(int(s) for s in np.asarray(arrays["weight_shape"]).reshape(-1))
        elif fmt == "mxfp4":
            shape = (arrays["weight"].shape[0], arrays["weight"].shape[1] * 2)
        else:
            shape = tuple(arrays["weight"].shape) if "weight" in arrays else tuple(next(iter(arrays.values())).shape)
        return StoredTensor(fmt, arrays, shape, dict(g))

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.get_stored(name).shape

    def _fp8_block(self) -> tuple[int, int]:
        q = self.config.quantization
        if self.v4:
            return tuple(q.block_size) if q is not None else (128, 128)
        return tuple(q.block_size) if q is not None and q.method == "fp8" else (128, 128)

    def _group_size(self) -> int:
        q = self.config.quantization
        return q.group_size if q is not None and q.method == "int4" else 32

    def get(self, name: str) -> np.ndarray:
        """Logical tensor as a new float32 array (FP8 / INT4 dequantised)."""
        st = self.get_stored(name)
        try:
            if st.format == "fp8":
                return dequant_fp8_block(st.arrays["weight"], st.arrays["weight_scale_inv"], self._fp8_block())
            if st.format == "int4":
                return unpack_int4(
                    st.arrays["weight_packed"], st.arrays["weight_scale"], st.shape, self._group_size()
                )
            if st.format == "int8":
                return dequant_int8_channel(st.arrays["weight"], st.arrays["weight_scale"])
            if st.format == "fp8_e8m0":
                return dequant_fp8_e8m0(st.arrays["weight"], st.arrays["scale"], self._fp8_block())
            if st.format == "mxfp4":
                return dequant_mxfp4(st.arrays["weight"], st.arrays["scale"])
        except ValueError as e:
            raise CheckpointError(f"{self.file_of(name)}: tensor {name!r}: {e}") from e
        return np.array(st.data, dtype=np.float32)

    # ---- integrity -----------------------------------------------------------------------------
    def verify(self, names: list[str] | None = None) -> int:
        """Check that every expected tensor (or just `names`) is present, readable (header and data
        offsets inside the file) and of the shape config.json implies. Raises CheckpointError listing
        the problems; returns the number of logical tensors checked. Reads headers (and INT4
        weight_shape values) only."""
        exp = names_v4.expected_shapes(self.config, mtp=True) if self.v4 else expected_shapes(self.config)
        todo = list(exp) if names is None else list(names)
        problems: list[str] = []
        for name in todo:
            try:
                g = self._group(name)
                infos = {s: self._info(st, name) for s, st in g.items()}
            except MissingTensorError as e:
                problems.append(str(e))
                continue
            except CheckpointError as e:
                problems.append(str(e))
                continue
            bad = [f"{i.file}: tensor {i.name!r}: {i.problem}" for i in infos.values() if i.problem]
            if bad:
                problems.extend(bad)
                continue
            want = exp.get(name)
            if want is None:
                continue
            got = self._stored_shape_problem(name, infos, want)
            if got:
                problems.append(f"{self.file_of(name)}: tensor {name!r}: {got}")
        if problems:
            more = f"\n  … and {len(problems) - 20} more" if len(problems) > 20 else ""
            raise CheckpointError(
                f"checkpoint {self.model_dir} failed verification ({len(problems)} problem(s)):\n  "
                + "\n  ".join(problems[:20])
                + more
            )
        return len(todo)

    def _stored_shape_problem(self, name: str, infos: dict[str, TensorInfo], want: tuple) -> str | None:
        want = tuple(want)
        if "weight_packed" in infos:
            missing = [s for s in INT4_SUFFIXES if s not in infos]
            if missing:
                return f"INT4 weight lacks {', '.join(missing)}"
            exp = int4_shapes(want, self._group_size())
            for s in ("weight_packed", "weight_scale"):
                if infos[s].shape != exp[s]:
                    return f"{s} shape {list(infos[s].shape)} != expected {list(exp[s])} for weight {list(want)}"
            ws = self._file(self._weight_map[infos["weight_shape"].name]).array(infos["weight_shape"].name)
            if tuple(int(x) for x in np.asarray(ws).reshape(-1)) != want:
                return f"weight_shape {np.asarray(ws).tolist()} != expected {list(want)}"
            return None
        w = infos.get("weight") or next(iter(infos.values()))
        if self.v4 and "scale" in infos:
            return _v4_stored_shape_problem(infos, want, self._fp8_block())
        if w.shape != want:
            return f"shape {list(w.shape)} != expected {list(want)} from config.json"
        if "weight_scale_inv" in infos:
            es = fp8_scale_shape(want, self._fp8_block())
            if infos["weight_scale_inv"].shape != es:
                return f"weight_scale_inv shape {list(infos['weight_scale_inv'].shape)} != expected {list(es)}"
        return None

    def close(self) -> None:
        for f in self._files.values():
            f.close()

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _v4_stored_shape_problem(infos: dict[str, TensorInfo], want: tuple, block: tuple[int, int]) -> str | None:
    """Shape check of a V4 `weight` + `scale` pair against the logical shape `want`."""
    w, s = infos["weight"], infos["scale"]
    if s.dtype != "F8_E8M0":
        return f"scale dtype {s.dtype} != F8_E8M0 (ue8m0)"
    if w.dtype == "I8":
        exp = mxfp4_shapes(want)
    elif w.dtype == "F8_E4M3":
        exp = {"weight": want, "scale": fp8_e8m0_scale_shape(want, block)}
    else:
        return f"weight dtype {w.dtype} with a scale: expected F8_E4M3 or I8 (MXFP4)"
    for k, i in (("weight", w), ("scale", s)):
        if i.shape != tuple(exp[k]):
            return f"{k} shape {list(i.shape)} != expected {list(exp[k])} for logical {list(want)} ({w.dtype})"
    return None


def write_safetensors(path: str, tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> None:
    """Write numpy arrays (incl. ml_dtypes bf16 / float8) as a standard .safetensors file."""
    header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
    off = 0
    arrays = []
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        dt = _ST_NAME.get(a.dtype)
        if dt is None:
            raise ValueError(f"write_safetensors: tensor {name!r} has unsupported dtype {a.dtype}")
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
        arrays.append(a)
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # keep data 8-byte aligned, as safetensors does
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
