"""experts/: the GPU side's client of the CPU expert shards (numpy in, numpy out; no torch).

- `client`: `ExpertsClient` (connect, coverage, forward / forward_async, health, failover);
- `groups`: Describe answers, the coverage check, replicas and shard groups;
- `stream`: the persistent gRPC Forward stream of one replica;
- `fast`: which fast path each replica gets (shared memory, TCP data path, or none);
- `path`: what the fast paths share (pending calls, deadlines, re-send over gRPC);
- `shm`, `tcp`: the shared-memory and TCP data paths;
- `errors`: the client's exceptions.

Imports `wire`, `protos` and `checkpoint`; never `cpu_expert_service`.
"""
