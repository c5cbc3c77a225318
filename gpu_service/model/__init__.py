"""model/: our PyTorch DeepSeek-V3 / V3.2, minus the routed experts.

- `deepseek`: embeddings, RMSNorm, YaRN RoPE, MLA attention, dense MLP, router, shared experts,
  lm_head, micro-batch ping-pong, `build_model` from a checkpoint;
- `experts_api`: what the model asks of the routed experts (`ExpertsFn` -> `ExpertsHandle.wait()`),
  implemented in gpu_service.experts.handoff;
- `kv`: the paged pool of MLA's compressed KV cache (and V3.2's index keys), sequences, chunks;
- `indexer`: DeepSeek-V3.2's lightning indexer (sparse attention);
- `paged_attention`: batched paged MLA attention for all decode sequences of a step;
- `qlinear`: weight-only FP8 / INT8 linears;
- `placement`: executes a memory plan (device of every weight, format of every linear, KV size,
  hot experts) and the preflight check against free GPU memory.

Imports torch, `checkpoint` and `gpu_service.plan`; nothing of runtime/, experts/ or api/.
"""
