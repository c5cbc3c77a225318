"""CPU expert service: a shard process that holds routed experts (a subset, or an intermediate
slice of every expert) and computes them for the GPU service. Never imports torch.

- `server`: the gRPC ExpertService, validation, the `moesplit expert-server` command;
- `backend` (numpy reference), `kernel_backend` + `kernels/` (Cython, one C file per ISA);
- `shm_transport`, `tcp_transport`: the shard side of the fast paths (wire formats in `wire`);
- `packed`, `convert`: `moesplit convert`'s per-shard files and their loader;
- `metrics`: the shard's Prometheus metrics;
- `probes`: this machine's ceilings (read bandwidth, dot peaks) and host facts (`moesplit doctor`,
  bench/bench_kernels.py).

Imports `checkpoint`, `wire` and `protos`, never `gpu_service`.
"""
