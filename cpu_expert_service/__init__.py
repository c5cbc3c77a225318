"""CPU expert service: a shard process that holds routed experts (a subset, or an intermediate
slice of every expert) and computes them for the GPU service over gRPC. Never imports torch."""
