"""A DeepSeek-V4 checkpoint directory -> the runtime V4 model, in process.

`load_v4(model_dir, dtype, device)` reads config.json as `checkpoint.config_v4.V4Config` (the one
config type the V4 model reads), builds `DeepseekV4` with `build_v4` from `CheckpointReader` (block
FP8 attention / shared-expert / indexer projections kept as stored in `Fp8Linear`, the V3 model's
quantised linear, with the ue8m0 scales as float32 powers of two, so their dequantised rows are
exact; bf16 and float32 tensors as stored; `tid2eid` as int64), and wraps the routed experts
(MXFP4 or FP8, dequantised on first use per expert) in the in-process `ReferenceExperts`. The MTP
block is not loaded (the model does not use it). A non-expert, non-MTP tensor of the checkpoint the
model did not ask for is an error: a weight is never silently dropped.

This is the whole model on one device without the serving engine: no paged KV pool, no expert
shards (what is missing for those is written in docs/v4.md).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from checkpoint import names_v4 as N4
from checkpoint.config_v4 import V4Config, load_v4_config
from checkpoint.formats_v4 import e8m0_to_f32
from checkpoint.reader import CheckpointReader
from gpu_service.model.v4.model import DeepseekV4, build_v4
from gpu_service.model.v4.moe import ReferenceExperts


@dataclass
class LoadedV4:
    """What `load_v4` returns: the model, its in-process experts, the typed config and the reader
    (kept open: the experts read their weights from it on first use)."""

    model: DeepseekV4
    experts: ReferenceExperts
    config: V4Config
    reader: CheckpointReader


def _getter(reader: CheckpointReader):
    """get(name) -> float32 array (dequantised), int64 kept for the hash routing tables."""
    def get(name: str) -> np.ndarray:
        """One logical tensor of the checkpoint."""
        if reader.format_of(name) == "i64":
            return np.array(reader.get_stored(name).data, dtype=np.int64)
        return reader.get(name)
    return get


def _fp8_stored(reader: CheckpointReader):
    """stored(name) -> (e4m3 weight, float32 block scales) of a block-FP8 (ue8m0-scaled) weight, as
    gpu_service.model.qlinear.Fp8Linear holds it (the scales 2**(e-127), exact); None for others."""
    def stored(name: str):
        """The FP8 arrays of one logical weight, or None."""
        if reader.format_of(name) == "mxfp4" and N4.parse_expert(name) is not None:  # a hot expert: as stored
            st = reader.get_stored(name)
            return "mxfp4", st.arrays["weight"], st.arrays["scale"]
        if reader.format_of(name) != "fp8_e8m0":
            return None
        st = reader.get_stored(name)
        q = torch.from_numpy(np.array(st.arrays["weight"]).view(np.uint8)).view(torch.float8_e4m3fn)
        return q, torch.from_numpy(e8m0_to_f32(st.arrays["scale"]))
    return stored


def model_from_reader(reader: CheckpointReader, dtype: torch.dtype = torch.float32,
                      device: "torch.device | str | Callable[[str], torch.device]" = "cpu",
                      fp8: bool = True, hot_experts: dict[int, list[int]] | None = None) -> DeepseekV4:
    """The model minus the routed experts from a reader over a V4 checkpoint (reader.config a
    V4Config), on `device` or each tensor on `device(name)` (a placement's); a tensor it does not use (other than routed experts and MTP) is an error. With `fp8`,
    block-FP8 linears stay FP8 (`Fp8Linear`), else they are dequantised to `dtype`."""
    block = tuple(reader.config.quantization.block_size) if reader.config.quantization is not None else (128, 128)
    stored = _fp8_stored(reader)
    keep = stored if fp8 else (lambda name: stored(name) if N4.parse_expert(name) is not None else None)
    model, loaded = build_v4(reader.config, _getter(reader), dtype=dtype, device=device, stored=keep,
                             fp8_block=block, hot_experts=hot_experts)
    unused = sorted(n for n in reader.names() if n not in loaded and N4.parse_expert(n) is None)
    if unused:
        raise ValueError(f"{reader.model_dir}: tensor(s) the V4 model does not use: {', '.join(unused[:5])}"
                         f"{' ...' if len(unused) > 5 else ''}; config.json does not describe these weights")
    return model


def load_v4(model_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
            device: torch.device | str = "cpu") -> LoadedV4:
    """The runtime DeepSeek-V4 model of a checkpoint directory (module docstring)."""
    cfg = load_v4_config(model_dir)  # a ConfigError naming the fix for anything not V4
    reader = CheckpointReader(model_dir, cfg)
    model = model_from_reader(reader, dtype, device)
    experts = ReferenceExperts(reader.get, cfg.n_routed_experts, cfg.swiglu_limit)
    return LoadedV4(model, experts, cfg, reader)
