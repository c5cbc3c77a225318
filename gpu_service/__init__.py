"""GPU service: everything of moesplit that runs beside the GPU. Its rooms:

- `model/`    our PyTorch DeepSeek-V3/V3.2 (MLA, indexer, router, shared experts), quantised
              linears, the placement that executes a memory plan, the paged KV pool;
- `runtime/`  the model runner, sampling and the continuous-batching engine;
- `experts/`  the client of the CPU expert shards: gRPC stream, shared-memory and TCP fast paths,
              replica groups and failover;
- `api/`      the OpenAI-compatible HTTP API, the gRPC Generate API and its client, tokenizers;
- `plan/`     the memory plan (byte model, auto search, report), Helm values, cluster check,
              hot experts — torch-free;
- `local/`    one-machine tools: tiny checkpoints, the local shard stack, the tiny trainer;
- `entrypoints/` the commands (`generate`, `serve`, `server` = gpu-server, `chat`, `plan_cli`,
              `demo`) and the serving stack they share (`serving`).

Top level: the Prometheus metrics (`metrics`).

Imports `checkpoint`, `wire` and `protos`, never `cpu_expert_service` (the local stack starts shard
processes as subprocesses). Importing the package is cheap; torch is imported only by the
modules that compute.
"""
