"""The replicated local serving stack that the serving, determinism, failover and soak tests share:
2 shards x `replicas` processes on the default expert backend (the kernels where built), a float32
CPU runner over the experts client, the HTTP + gRPC APIs on free ports."""
from __future__ import annotations

import contextlib
from typing import Callable


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


def shard_health_fn(addresses: list[str], timeout_s: float = 1.0, tls=None) -> Callable[[], tuple[bool, dict]]:
    """A health check asking every shard's grpc.health.v1 (one channel each; the serving
    stack itself uses the replica-aware `ExpertsClient.health`)."""
    from wire.channel import make_channel

    from gpu_service.experts.health import check_parallel

    channels = {a: make_channel(a, [], tls) for a in addresses}

    def check() -> tuple[bool, dict]:  # every shard asked at once: at most timeout_s in all
        out = check_parallel(channels, timeout_s)
        return all(v == "SERVING" for v in out.values()), out

    return check
