"""plan/: the memory plan, before a byte is allocated.

- `bytes`: the byte model of every item (weights by format, KV cache, workspace, reserve, shards);
  `bytes_v4`: DeepSeek-V4's parts of it; `arch`: which one a config gets (`arch_bytes(cfg)`);
- `search`: `make_plan` places the items and searches the auto options; `Plan` and its JSON;
- `report`: the table of `moesplit plan`, presets, `load_model_config`;
- `helm_values`: chart values that encode a plan; `cluster`: which nodes can run it;
- `hot_experts`: which routed experts a plan puts on the GPU;
- `predict`: decode tokens/s from a plan's bytes per step and the box's ceilings (`moesplit doctor`).

Imports `checkpoint` only (and the Kubernetes client lazily in `cluster`); torch-free. The names
of bytes, search and report are re-exported here: `from gpu_service import plan as P; P.make_plan(...)`.
"""
from __future__ import annotations

from gpu_service.plan.bytes import (  # noqa: F401 (re-exported)
    ATTENTION_WEIGHTS, CATEGORIES, checkpoint_format, CUDA_CONTEXT_BYTES, DEFAULT_CHUNK_TOKENS,
    DEFAULT_KV_TARGET, DTYPE_BYTES, DTYPES, dtype_bytes, DEFAULT_MAX_BATCH, DEFAULT_MIN_KV_TOKENS, EMBEDDINGS, expert_bytes, EXPERT_FORMATS,
    fmt_gib, FP8_BLOCK, fp8_block, FRAGMENTATION_FRACTION, FRAGMENTATION_MIN_BYTES, GiB,
    gpu_reserve, GPU_SERVICE_HOST_BYTES, HOST_OS_RESERVE_BYTES, INT4_GROUP, KiB, kv_bytes_per_token_layer,
    KV_ROUND, linear_bytes, MiB, Module, module_bytes, Options, param_bytes_by_module,
    parse_size, PRESETS_DIR, QLINEAR_ROWS, qlinear_scratch_bytes, SHARD_BASELINE_BYTES, TiB, workspace_bytes,
    decode_workspace_bytes, graph_buckets, graph_pool_bytes, MIN_KEYS,
)
from gpu_service.plan.arch import arch_bytes, gpu_modules, kv_bytes_per_token, param_counts  # noqa: F401
from gpu_service.plan.search import GpuPlan, host_summary, make_plan, Plan, shard_plans, ShardPlan  # noqa: F401
from gpu_service.plan.report import load_model_config, presets, render_table  # noqa: F401
