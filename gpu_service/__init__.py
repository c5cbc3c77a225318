"""GPU service: the non-expert half of the model, the engine and the APIs.

`model/` (the PyTorch DeepSeek-V3/V3.2, quantised linears, placement, paged KV), `attention/`,
`runtime/` (runner, sampling, continuous-batching engine), `experts/` (client of the CPU expert
shards), `api/` (HTTP and gRPC APIs, tokenizers), `plan/` (the torch-free memory plan), `local/`
(tiny checkpoints, local shard stack), `entrypoints/` (the commands), and `metrics`
(docs/interfaces.md has the tree).

Imports `checkpoint`, `wire` and `protos`, never `cpu_expert_service`. Importing the package is
cheap; torch is imported only by the modules that compute.
"""
