"""model/: our PyTorch DeepSeek-V3 / V3.2, minus the routed experts.

- `deepseek`: the one model definition (layers as pieces, MoE with hot experts, micro-batch
  ping-pong), `build_model` from a checkpoint;
- `mla`: MLA attention's projections and core over the attention backend (gpu_service.attention);
- `layers`: RMSNorm, YaRN RoPE, linears, the gated MLP, the router;
- `step`: a micro-batch's step on one device (metadata, padded rows, RoPE table, graph set);
- `rows`: the row padding that makes results independent of the batch;
- `experts_api`: the interface the model calls the routed experts through;
- `kv`: the paged pool of MLA's compressed KV cache (and V3.2's index keys), sequences, chunks;
- `indexer`: DeepSeek-V3.2's lightning indexer (sparse attention);
- `qlinear`: weight-only FP8 / INT8 linears;
- `placement`: executes a memory plan (device of every weight, format of every linear, KV size,
  hot experts) and the preflight check against free GPU memory.

Imports torch, `checkpoint`, `gpu_service.attention` and `gpu_service.plan`; nothing of runtime/,
experts/ or api/.
"""
