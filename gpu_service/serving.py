"""What `moesplit serve` and `moesplit gpu-server` share: build the runner over running shards,
then the engine + HTTP + gRPC APIs (`ServingStack`), and serve until SIGINT/SIGTERM.

    stack = ServingStack(runner, tokenizer, "tiny", port=0, grpc_port=0, health_fn=...).start()
    ... stack.http_url, stack.grpc_address ...
    stack.stop()          # gRPC + HTTP down, engine stopped, then the `closers` run (LIFO)
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from gpu_service.runtime.engine import Engine
from gpu_service.model.placement import add_plan_arguments, placement_from_args
from gpu_service.experts.client import add_expert_client_arguments, expert_client_tls
from gpu_service.api.grpc_api import create_server as create_grpc_server
from gpu_service.api.http_api import create_app, HTTPServer
from gpu_service.metrics import GpuMetrics

log = logging.getLogger("moesplit.serve")


def add_serving_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors + tokenizer)")
    p.add_argument("--served-model-name", default=None,
                   help="model name of the API (default: the checkpoint directory's basename)")
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP and gRPC APIs (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP (OpenAI API) port; 0 picks a free one")
    p.add_argument("--grpc-port", type=int, default=50050, help="gRPC Generate port; 0 picks a free one")
    p.add_argument("--api-key", default=os.environ.get("MOESPLIT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: $MOESPLIT_API_KEY, else none)")
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache size in tokens, shared by all requests")
    p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt (default: share full KV pages of common prefixes)")
    p.add_argument("--host-kv-cache", default="auto", metavar="SIZE|auto|0",
                   help="host-RAM tier of the prefix cache, e.g. 64GiB (pinned on CUDA); auto: half the RAM the "
                        "plan leaves free with --host-ram, else a quarter of MemAvailable (at most 64 GiB); "
                        "0 or a CPU pool: none")
    p.add_argument("--max-batch", type=int, default=16, help="most requests running at once")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="token budget of one step (decodes + prefill chunks)")
    p.add_argument("--device", default=None, help="cuda|cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    add_expert_client_arguments(p)
    p.add_argument("--log-level", default="INFO")
    add_plan_arguments(p)


def plan_or_exit(args: argparse.Namespace, prog: str):
    """The memory plan, made before anything is loaded; None on a CPU-only machine without
    --gpu. A plan that cannot fit exits here with the table and the options that would fit."""
    import torch

    from checkpoint.config import load_config

    return placement_from_args(args, load_config(args.model), args.kv_tokens, args.chunk_tokens, args.max_batch,
                               device=torch.device(args.device) if args.device else None)


def check_serving_args(args: argparse.Namespace) -> str | None:
    """An error message for impossible sizes, else None."""
    for name in ("kv_tokens", "page_size", "max_batch", "chunk_tokens"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if getattr(args, "host_kv_cache", "auto") != "auto":
        from gpu_service.plan.bytes import parse_size

        try:
            parse_size(args.host_kv_cache)
        except ValueError as e:
            return f"--host-kv-cache: {e}; give a size such as 64GiB, 0 (off) or auto"
    if args.expert_timeout <= 0:
        return f"--expert-timeout must be > 0, got {args.expert_timeout}"
    try:
        expert_client_tls(args, "")
    except ValueError as e:
        return str(e).lstrip(": ")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model}: no config.json; --model must be a checkpoint directory"
    return None


def shard_health_fn(addresses: list[str], timeout_s: float = 1.0, tls=None) -> Callable[[], tuple[bool, dict]]:
    """A health check asking every shard's grpc.health.v1 service; keeps one channel per shard.
    (The serving stack uses `ExpertsClient.health`, which knows replicas: one SERVING replica per
    shard group is enough.) `tls`: TLSFiles for shards that require mutual TLS."""
    from wire.channel import make_channel

    stubs = {a: health_pb2_grpc.HealthStub(make_channel(a, [], tls)) for a in addresses}

    def check() -> tuple[bool, dict]:
        out, ok = {}, True
        for a, stub in stubs.items():
            try:
                r = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
                status = health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
            except grpc.RpcError as e:
                status = f"{e.code().name}: {e.details()}"
            out[a] = status
            ok = ok and status == "SERVING"
        return ok, out

    return check


def build_runner(model_dir: str, addresses: list[str], device=None, dtype=None, kv_tokens: int = 8192,
                 page_size: int = 64, expert_timeout: float = 5.0, tls=None, tls_server_name: str | None = None,
                 placement=None, prefix_cache: bool = True, host_kv_cache: str | int = 0):
    """Connect to the shards (fingerprint + coverage checked) and load the GPU side (its tensors
    verified first). `host_kv_cache`: bytes / "64GiB" / "auto" (`host_kv_bytes`) of the prefix
    cache's host tier. Returns (runner, experts_client, tokenizer or None)."""
    import torch

    from checkpoint.reader import CheckpointReader
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.runtime.runner import ModelRunner, RemoteExperts
    from gpu_service.api.tokenizer import Tokenizer, TokenizerError

    reader = CheckpointReader(model_dir)
    client = ExpertsClient(addresses, reader.config, timeout_s=expert_timeout, tls=tls,
                           tls_server_name=tls_server_name).connect()
    try:
        runner = ModelRunner(reader, RemoteExperts(client), device=torch.device(device) if device else None,
                             dtype=getattr(torch, dtype) if dtype else None, kv_tokens=kv_tokens,
                             page_size=page_size, placement=placement, prefix_cache=prefix_cache,
                             host_kv_bytes=host_kv_bytes(host_kv_cache, placement, device))
    except BaseException:
        client.close()
        raise
    try:
        tokenizer = Tokenizer(model_dir)
    except TokenizerError as e:
        log.warning("%s: serving token ids only", e)
        tokenizer = None
    return runner, client, tokenizer


def host_kv_bytes(spec: str | int, placement=None, device=None) -> int:
    """--host-kv-cache as bytes: "auto" is gpu_service.model.host_kv.auto_host_kv_bytes of the plan,
    and nothing when the pool lives in host memory anyway (a CPU device)."""
    import torch

    from gpu_service.model.host_kv import auto_host_kv_bytes
    from gpu_service.plan.bytes import parse_size

    if spec != "auto":
        return parse_size(spec)
    cuda = torch.cuda.is_available() if device is None else str(device).startswith("cuda")
    if placement is not None:
        cuda = any(d.type == "cuda" for d in placement.layer_devices)
    return auto_host_kv_bytes(getattr(placement, "plan", None)) if cuda else 0


class ServingStack:
    """Engine + OpenAI HTTP API + gRPC Generate API over one runner."""

    def __init__(self, runner, tokenizer, model_name: str, host: str = "127.0.0.1", port: int = 8000,
                 grpc_port: int = 50050, api_key: str | None = None, max_batch: int = 16,
                 chunk_tokens: int = 512, health_fn=None, closers: list[Callable[[], None]] | None = None):
        self.engine = Engine(runner, tokenizer, max_batch=max_batch, chunk_tokens=chunk_tokens)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.host, self.port, self.grpc_port = host, port, grpc_port
        self.metrics = GpuMetrics(self.engine, runner, health_fn=health_fn)  # GET /metrics; own registry
        self.app = create_app(self.engine, tokenizer, model_name, api_key=api_key, health_fn=health_fn,
                              metrics=self.metrics)
        self.closers = list(closers or [])
        self.http: HTTPServer | None = None
        self.grpc_server: grpc.Server | None = None
        self._stopped = False

    def start(self) -> "ServingStack":
        try:
            self.engine.start()
            self.http = HTTPServer(self.app, self.host, self.port).start()
            self.grpc_server, self.grpc_port = create_grpc_server(self.engine, self.tokenizer, self.host,
                                                                  self.grpc_port)
        except BaseException:
            self.stop()
            raise
        self.port = self.http.port
        return self

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.grpc_server is not None:
            self.grpc_server.health_servicer.enter_graceful_shutdown()
        self.engine.stop()  # running requests end "cancelled": streams close promptly
        if self.http is not None:
            self.http.stop()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=2.0).wait()
        for close in reversed(self.closers):
            try:
                close()
            except Exception:  # noqa: BLE001 - keep closing the rest
                log.exception("error while shutting down")

    def __enter__(self) -> "ServingStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def serve_until_signal(stack: ServingStack, prog: str) -> int:
    """Print where we serve, block until SIGINT/SIGTERM, then stop the stack."""
    stop = threading.Event()

    def on_signal(signum, frame):
        log.info("signal %d: shutting down", signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"{prog}: serving '{stack.model_name}' — OpenAI API {stack.http_url}/v1, gRPC {stack.grpc_address}",
              file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        t0 = time.monotonic()
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
        log.info("stopped in %.1fs", time.monotonic() - t0)
    return 0


def run_stack(args: argparse.Namespace, prog: str, addresses: list[str], closers: list[Callable[[], None]],
              placement=None) -> int:
    """Common tail of serve / gpu-server: runner over `addresses`, stack, serve until a signal.
    `closers` (e.g. stopping local shards) run on the way out, whatever happens."""
    closers = list(closers)
    stack = None
    try:
        runner, client, tokenizer = build_runner(args.model, addresses, args.device, args.dtype,
                                                 args.kv_tokens, args.page_size, args.expert_timeout,
                                                 expert_client_tls(args, prog), args.tls_server_name, placement,
                                                 args.prefix_cache, args.host_kv_cache)
        closers.append(client.close)
        shard_max = min((int(s.info.max_tokens) for s in client.shards if s.info.max_tokens), default=None)
        chunk = args.chunk_tokens
        if shard_max is not None and max(chunk, args.max_batch) > shard_max:
            chunk = shard_max
            log.warning("--chunk-tokens lowered to %d: the shards take at most %d tokens per request",
                        chunk, shard_max)
        name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
        stack = ServingStack(runner, tokenizer, name, host=args.host, port=args.port, grpc_port=args.grpc_port,
                             api_key=args.api_key, max_batch=args.max_batch, chunk_tokens=chunk,
                             health_fn=client.health, closers=closers)
        stack.start()  # on failure it stops itself, running the closers
    except BaseException as e:
        if stack is None:
            for close in reversed(closers):
                try:
                    close()
                except Exception:  # noqa: BLE001
                    log.exception("error while shutting down")
        from checkpoint.reader import CheckpointError
        from gpu_service.experts.errors import ExpertsClientError

        if isinstance(e, (ExpertsClientError, CheckpointError, OSError, ValueError)):  # shards, ports, checkpoint
            print(f"{prog}: {e}", file=sys.stderr)
            return 1
        raise
    return serve_until_signal(stack, prog)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
