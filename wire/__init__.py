"""wire/: what the GPU service and the expert shards must agree on, importable by either alone.

- `shm`: the shared-memory fast path's file layout, slot views, doorbell ops, dtype codes;
- `tcp`: the TCP data path's frames, token hello, TLS contexts and socket helpers;
- `channel`: gRPC message limits from the model, keepalive, reconnect backoff, mutual-TLS files
  and credentials, the `--tls-*` arguments.

numpy, grpcio and `checkpoint` only: imports neither service (and never torch).
"""
