"""model/: the one model definition and what it runs on.

`deepseek` (the model, `build_model`), `mla`, `layers` (RMSNorm, RoPE, MLP, router), `step` and
`rows` (a micro-batch's step, batch-invariant row padding), `experts_api` (how the model calls the
routed experts), `kv` (the paged pool), `indexer` (V3.2), `qlinear` (weight-only FP8 / INT8 / INT4),
`placement` (executes a memory plan), `prefix_cache` / `host_kv` (prefix sharing).

Imports torch, `checkpoint`, `gpu_service.attention` and `gpu_service.plan`; nothing of runtime/,
experts/ or api/.
"""
