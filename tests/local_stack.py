"""The replicated local serving stack that the serving, determinism, failover and soak tests share:
2 shards x `replicas` processes on the default expert backend (the kernels where built), a float32
CPU runner over the experts client, the HTTP + gRPC APIs on free ports."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def replicated_stack(model_dir: str, model: str, *, kv_tokens: int, max_batch: int, chunk_tokens: int,
                     expert_timeout: float, replicas: int = 2):
    """Yields a started ServingStack with `.shards` (the LocalShards) and `.client` (the ExpertsClient)."""
    from gpu_service.local.stack import start_shards
    from gpu_service.entrypoints.serving import ServingStack, build_runner

    shards = start_shards(model_dir, 2, split="experts", backend="auto", replicas=replicas)
    try:
        runner, client, tok = build_runner(model_dir, shards.addresses, "cpu", "float32", kv_tokens=kv_tokens,
                                           page_size=16, expert_timeout=expert_timeout)
        st = ServingStack(runner, tok, model, port=0, grpc_port=0, max_batch=max_batch, chunk_tokens=chunk_tokens,
                          health_fn=client.health, closers=[shards.stop, client.close])
    except BaseException:
        shards.stop()
        raise
    st.shards, st.client = shards, client
    st.start()
    try:
        yield st
    finally:
        st.stop()
