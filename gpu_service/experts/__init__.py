"""experts/: the GPU side's client of the CPU expert shards (numpy in, numpy out; torch only in `handoff`).

- `handoff`: the model's `ExpertsFn` (gpu_service.model.experts_api): `RemoteExperts` over the
  client (wire-dtype conversion, pinned CUDA buffers), `LocalExperts` over an in-process backend;
- `client`: `ExpertsClient` (connect, coverage, forward / forward_async, health, failover);
- `groups`: Describe answers, the coverage check, replicas and shard groups;
- `stream`: the persistent gRPC Forward stream of one replica;
- `fast`: which fast path each replica gets (shared memory, TCP data path, or none);
- `path`: what the fast paths share (pending calls, deadlines, re-send over gRPC);
- `shm`, `tcp`: the shared-memory and TCP data paths (`shm` sends and receives through the C
  client `_shm_client`, built from shm_client.c by setup.py);
- `errors`: the client's exceptions.

Imports `wire`, `protos`, `checkpoint` and (handoff) `gpu_service.model.experts_api`; never
`cpu_expert_service`.
"""
