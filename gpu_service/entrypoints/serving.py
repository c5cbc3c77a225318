"""What `moesplit serve` and `moesplit gpu-server` share: build the runner over running shards,
then the engine + HTTP + gRPC APIs (`ServingStack`), and serve until SIGINT/SIGTERM.

    stack = ServingStack(runner, tokenizer, "tiny", port=0, grpc_port=0, health_fn=...).start()
    ... stack.http_url, stack.grpc_address ...
    stack.stop()          # gRPC + HTTP down, engine stopped, then the `closers` run (LIFO)
"""
from __future__ import annotations

import argparse
import gc
import logging
import os
import signal
import sys
import threading
import time
from typing import Callable

import grpc

from gpu_service.runtime.engine import Engine
from gpu_service.model.placement import add_device_arguments, add_plan_arguments, placement_from_args
from gpu_service.experts.client import add_expert_client_arguments, expert_client_tls
from gpu_service.api.grpc_api import ApiTLS, create_server as create_grpc_server
from gpu_service.api import guard as G
from gpu_service.api.guard import DEFAULT_MAX_BODY_BYTES, ServerLimits
from gpu_service.api.chat_request import ChatSettings
from gpu_service.api.connections import grpc_server_options
from gpu_service.api.http_api import create_app, HTTPServer
from gpu_service.metrics import GpuMetrics

DEFAULT_PAGE_SIZE = 64  # tokens per KV page when --page-size is not given (V4: see page_size_for)

log = logging.getLogger("moesplit.serve")


def add_serving_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors + tokenizer)")
    p.add_argument("--served-model-name", default=None,
                   help="model name of the API (default: the checkpoint directory's basename)")
    p.add_argument("--host", default="127.0.0.1", help="address of the HTTP and gRPC APIs (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP (OpenAI API) port; 0 picks a free one")
    p.add_argument("--grpc-port", type=int, default=50050, help="gRPC Generate port; 0 picks a free one")
    p.add_argument("--api-key", default=os.environ.get("MOESPLIT_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 and on gRPC Generate (default: "
                        "$MOESPLIT_API_KEY, else none; prefer the variable: a flag shows in `ps`)")
    p.add_argument("--grpc-tls-cert", help="PEM certificate: serve gRPC Generate over TLS (needs --grpc-tls-key)")
    p.add_argument("--grpc-tls-key", help="PEM private key of --grpc-tls-cert")
    p.add_argument("--grpc-tls-ca", help="PEM CA: require gRPC Generate clients to present a certificate it signed")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"largest HTTP request body; larger: 413 before reading it (default {DEFAULT_MAX_BODY_BYTES})")
    p.add_argument("--max-prompt-chars", type=int, default=None,
                   help="longest text prompt, checked before tokenizing (default: 16 x the tokens a request may hold)")
    p.add_argument("--allow-image-urls", action="store_true",
                   help="fetch http(s) image_url parts (default: only data: URLs; a URL is a 400 naming this flag)")
    p.add_argument("--max-images", type=int, default=8, help="most images in one request (default 8)")
    p.add_argument("--max-image-bytes", type=int, default=10 << 20,
                   help="largest encoded image (default 10 MiB; the body cap --max-body-bytes applies first)")
    p.add_argument("--max-image-pixels", type=int, default=64 << 20,
                   help="most decoded pixels (width x height, read from the header) of one image (default 64Mi)")
    p.add_argument("--image-fetch-timeout", type=float, default=10.0,
                   help="seconds to fetch one image URL with --allow-image-urls (default 10)")
    p.add_argument("--max-waiting", type=int, default=256,
                   help="most requests queued for admission; beyond: HTTP 429 / gRPC RESOURCE_EXHAUSTED (default 256)")
    p.add_argument("--max-new-tokens", type=int, default=8192,
                   help="longest completion (and the default when a request omits max_tokens; default 8192)")
    add_connection_arguments(p)
    p.add_argument("--kv-tokens", type=int, default=8192, help="KV cache size in tokens, shared by all requests")
    p.add_argument("--page-size", type=int, default=None,
                   help=f"tokens per KV page (default {DEFAULT_PAGE_SIZE}; DeepSeek-V4: the smallest multiple of its "
                        "compression blocks >= that, e.g. 128 for HCA ratio 128)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="recompute every prompt (default: share full KV pages of common prefixes)")
    p.add_argument("--prefix-snapshot-every", type=int, default=None, metavar="TOKENS",
                   help="DeepSeek-V4 only: keep the prefix cache's snapshots at prompt boundaries that are multiples "
                        "of TOKENS (a multiple of the page size), so prompts sharing a prefix (a system prompt) "
                        "resume there; 0: none (default: 2048 rounded up to whole pages)")
    p.add_argument("--host-kv-cache", default="auto", metavar="SIZE|auto|0",
                   help="host-RAM tier of the prefix cache, e.g. 64GiB (pinned on CUDA); auto: half the RAM the "
                        "plan leaves free with --host-ram, else a quarter of MemAvailable (at most 64 GiB); "
                        "0 or a CPU pool: none")
    p.add_argument("--max-batch", type=int, default=32, help="most requests running at once (default 32)")
    p.add_argument("--chunk-tokens", type=int, default=512,
                   help="token budget of one step (decodes + prefill chunks)")
    add_device_arguments(p)
    add_expert_client_arguments(p)
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the checkpoint's (or the built-in V3.2 format)")
    p.add_argument("--tool-call-parser", default="auto",
                   help="auto|kimi_k2|deepseek_v3|deepseek_v31|deepseek_v32|none (default auto: by model)")
    p.add_argument("--reasoning-parser", default="auto",
                   help="auto|kimi_k2|deepseek_r1|deepseek_v3|none (default auto: by model)")
    p.add_argument("--log-level", default="INFO")
    add_plan_arguments(p)


def add_connection_arguments(p: argparse.ArgumentParser) -> None:
    """The connection-level limits of the HTTP and gRPC servers (guard.ServerLimits; docs/reliability.md)."""
    p.add_argument("--header-timeout", type=float, default=G.DEFAULT_HEADER_TIMEOUT_S,
                   help=f"seconds a connection may take to send a request's headers (default {G.DEFAULT_HEADER_TIMEOUT_S:g})")
    p.add_argument("--body-timeout", type=float, default=G.DEFAULT_BODY_TIMEOUT_S,
                   help=f"seconds a request body may take, plus 1 s per --body-min-rate bytes received; "
                        f"beyond: 408, closed (default {G.DEFAULT_BODY_TIMEOUT_S:g})")
    p.add_argument("--body-min-rate", type=int, default=G.DEFAULT_BODY_MIN_RATE,
                   help=f"bytes per second a request body must keep up (default {G.DEFAULT_BODY_MIN_RATE})")
    p.add_argument("--max-connections", "--limit-concurrency", dest="max_connections", type=int,
                   default=G.DEFAULT_MAX_CONNECTIONS,
                   help=f"most open HTTP connections: past it the oldest idle one is closed, else the new one "
                        f"(default {G.DEFAULT_MAX_CONNECTIONS})")
    p.add_argument("--max-connections-per-client", type=int, default=G.DEFAULT_MAX_CONNECTIONS_PER_CLIENT,
                   help=f"most open HTTP connections from one client address, 0: no cap; raise it behind an "
                        f"ingress or proxy (default {G.DEFAULT_MAX_CONNECTIONS_PER_CLIENT})")
    p.add_argument("--probe-connections", type=int, default=G.DEFAULT_PROBE_CONNECTIONS,
                   help=f"of --max-connections, how many only /live and /health may use (default "
                        f"{G.DEFAULT_PROBE_CONNECTIONS})")
    p.add_argument("--grpc-max-streams-per-connection", type=int, default=G.DEFAULT_GRPC_STREAMS_PER_CONNECTION,
                   help=f"concurrent gRPC streams on one connection (default {G.DEFAULT_GRPC_STREAMS_PER_CONNECTION})")
    p.add_argument("--grpc-min-ping-interval", type=float, default=G.DEFAULT_GRPC_MIN_PING_INTERVAL_S,
                   help=f"seconds between a gRPC client's pings without data; more often: GOAWAY (default "
                        f"{G.DEFAULT_GRPC_MIN_PING_INTERVAL_S:g})")
    p.add_argument("--grpc-max-connection-idle", type=float, default=G.DEFAULT_GRPC_MAX_CONNECTION_IDLE_S,
                   help=f"seconds an idle gRPC connection stays open (default {G.DEFAULT_GRPC_MAX_CONNECTION_IDLE_S:g})")


def server_limits(args: argparse.Namespace) -> ServerLimits:
    """The ServerLimits of the flags (ValueError naming the flag when one is impossible)."""
    return ServerLimits(
        max_body_bytes=args.max_body_bytes, max_prompt_chars=args.max_prompt_chars,
        header_timeout_s=args.header_timeout, body_timeout_s=args.body_timeout, body_min_rate=args.body_min_rate,
        max_connections=args.max_connections, max_connections_per_client=args.max_connections_per_client,
        probe_connections=args.probe_connections, grpc_max_streams_per_connection=args.grpc_max_streams_per_connection,
        grpc_min_ping_interval_s=args.grpc_min_ping_interval, grpc_max_connection_idle_s=args.grpc_max_connection_idle,
        max_images=getattr(args, "max_images", 8), max_image_bytes=getattr(args, "max_image_bytes", 10 << 20),
        max_image_pixels=getattr(args, "max_image_pixels", 64 << 20),
        allow_image_urls=getattr(args, "allow_image_urls", False),
        image_fetch_timeout_s=getattr(args, "image_fetch_timeout", 10.0))


def plan_or_exit(args: argparse.Namespace):
    """The memory plan, made before anything is loaded (DeepSeek-V4 too: v4_option_error has refused
    the plan options its runner cannot execute); None on a CPU-only machine without --gpu. A plan
    that cannot fit exits here with the table and the options that would fit."""
    import torch

    from checkpoint.config_v4 import load_any_config

    cfg = load_any_config(args.model)
    return placement_from_args(args, cfg, args.kv_tokens, args.chunk_tokens, args.max_batch,
                               device=torch.device(args.device) if args.device else None)




def v4_option_error(args: argparse.Namespace, cfg) -> str | None:
    """The serving options set that a DeepSeek-V4 model (`cfg`) cannot honour, as an error; None if none."""
    from gpu_service.model.placement import V4_ATTENTION_WEIGHTS, v4_refused_options
    from gpu_service.model.v4.paged import page_block
    from gpu_service.plan.bytes import parse_size

    block = page_block(cfg)
    if args.page_size % block:
        return (f"--page-size {args.page_size}: a DeepSeek-V4 page must hold whole compression blocks of every "
                f"layer; use a multiple of {block} (lcm of 4 and the HCA ratios)")
    every = getattr(args, "prefix_snapshot_every", None)
    if every is not None and every % args.page_size:
        return (f"--prefix-snapshot-every {every}: snapshots sit on page boundaries; use a multiple of the page "
                f"size {args.page_size} (or 0 for none)")
    if every is not None and not getattr(args, "prefix_cache", True):
        return "--prefix-snapshot-every: there is no prefix cache with --no-prefix-cache; drop one of the two"

    aw = getattr(args, "attention_weights", "auto")
    if aw not in V4_ATTENTION_WEIGHTS:
        return (f"--attention-weights {aw}: DeepSeek-V4's model runs its linears as stored (checkpoint: block "
                "FP8) or dequantised (bf16), not re-quantised; pass --attention-weights checkpoint or bf16")
    bad = v4_refused_options(args, cfg)
    host = getattr(args, "host_kv_cache", "auto")
    if host != "auto" and parse_size(host):
        bad.append("--host-kv-cache")
    if not bad:
        return None
    why = (["its runner keeps hot GPU experts only as stored MXFP4 or block FP8, and these experts are neither"]
           if bad != ["--host-kv-cache"] else []) + (["its prefix cache has no host tier"] if "--host-kv-cache" in bad else [])
    return f"{', '.join(bad)}: not available for this DeepSeek-V4 checkpoint ({'; '.join(why)}); drop them"


def check_serving_args(args: argparse.Namespace) -> str | None:
    """An error message for impossible sizes, else None."""
    for name in ("kv_tokens", "page_size", "max_batch", "chunk_tokens", "max_waiting", "max_new_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if getattr(args, "prefix_snapshot_every", None) is not None and args.prefix_snapshot_every < 0:
        return f"--prefix-snapshot-every must be >= 0 (0: no snapshots kept), got {args.prefix_snapshot_every}"
    if getattr(args, "host_kv_cache", "auto") != "auto":
        from gpu_service.plan.bytes import parse_size

        try:
            parse_size(args.host_kv_cache)
        except ValueError as e:
            return f"--host-kv-cache: {e}; give a size such as 64GiB, 0 (off) or auto"
    if args.expert_timeout <= 0:
        return f"--expert-timeout must be > 0, got {args.expert_timeout}"
    try:
        server_limits(args)
        expert_client_tls(args, "")
        ApiTLS.from_args(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca)
    except ValueError as e:
        return str(e).lstrip(": ")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model}: no config.json; --model must be a checkpoint directory"
    from gpu_service.api.parsers import check_parser_name

    try:
        check_parser_name("tool", getattr(args, "tool_call_parser", "auto"))
        check_parser_name("reasoning", getattr(args, "reasoning_parser", "auto"))
    except ValueError as e:
        return str(e)
    template = getattr(args, "chat_template", None)
    if template and not os.path.isfile(template):
        return f"--chat-template {template}: no such file"
    from checkpoint.config import ConfigError
    from checkpoint.config_v4 import load_any_config

    try:
        cfg = load_any_config(args.model)
    except ConfigError as e:
        return str(e)
    if args.page_size is None:
        args.page_size = page_size_for(cfg)
    if not cfg.is_v4 and getattr(args, "prefix_snapshot_every", None) is not None:
        return ("--prefix-snapshot-every: DeepSeek-V4 only (its prefix cache keeps snapshots of prompt "
                "boundaries); this model's prefix cache shares whole KV pages without them; drop the option")
    return v4_option_error(args, cfg) if cfg.is_v4 else None


def page_size_for(cfg) -> int:
    """The page size used when --page-size is not given: DEFAULT_PAGE_SIZE, or for DeepSeek-V4 the
    smallest multiple of its compression blocks at least that (gpu_service.model.v4.paged)."""
    if not getattr(cfg, "is_v4", False):
        return DEFAULT_PAGE_SIZE
    from gpu_service.model.v4.paged import default_page_size

    return default_page_size(cfg, DEFAULT_PAGE_SIZE)


def build_runner(model_dir: str, addresses: list[str], device=None, dtype=None, kv_tokens: int = 8192,
                 page_size: int = DEFAULT_PAGE_SIZE, expert_timeout: float = 5.0, tls=None, tls_server_name: str | None = None,
                 placement=None, chat_template: str | None = None, prefix_cache: bool = True,
                 host_kv_cache: str | int = 0, cuda_graphs: bool = True, prefix_snapshot_every: int | None = None):
    """Connect to the shards (fingerprint + coverage checked) and load the GPU side; returns (runner,
    experts_client, tokenizer or None). `prefix_snapshot_every`: DeepSeek-V4's V4Runner snapshot_every
    (None: its default; refused for other models)."""
    import torch

    from checkpoint.reader import CheckpointReader
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.experts.handoff import RemoteExperts
    from gpu_service.runtime.runners import make_runner
    from gpu_service.api.tokenizer import TokenizerError, load_tokenizer

    reader = CheckpointReader(model_dir, any_architecture=True)  # DeepSeek-V4 too (a V4Config)
    snap = {}
    if prefix_snapshot_every is not None:
        if not reader.config.is_v4:
            raise ValueError("--prefix-snapshot-every: DeepSeek-V4 only; drop the option for this model")
        snap = {"snapshot_every": prefix_snapshot_every}
    client = ExpertsClient(addresses, reader.config, timeout_s=expert_timeout, tls=tls,
                           tls_server_name=tls_server_name).connect()
    try:
        host_bytes = 0 if reader.config.is_v4 and host_kv_cache == "auto" else \
            host_kv_bytes(host_kv_cache, placement, device)
        runner = make_runner(reader, RemoteExperts(client), device=torch.device(device) if device else None,
                             dtype=getattr(torch, dtype) if dtype else None, kv_tokens=kv_tokens,
                             page_size=page_size, placement=placement, prefix_cache=prefix_cache,
                             host_kv_bytes=host_bytes, cuda_graphs=cuda_graphs, **snap)
    except BaseException:
        client.close()
        raise
    try:
        tokenizer = load_tokenizer(model_dir, chat_template)
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
                 chunk_tokens: int = 512, health_fn=None, closers: list[Callable[[], None]] | None = None,
                 limits: ServerLimits | None = None, max_waiting: int = 256, max_new_tokens: int = 8192,
                 grpc_tls: ApiTLS | None = None, chat_settings=None):
        # generation ends at config.json's EOS and at generation_config.json's end-of-turn ids (Kimi: <|im_end|>)
        eos = tuple(runner.cfg.eos_token_ids) + tuple(getattr(tokenizer, "stop_token_ids", ()) or ())
        self.engine = Engine(runner, tokenizer, max_batch=max_batch, chunk_tokens=chunk_tokens,
                             max_waiting=max_waiting, max_new_tokens=max_new_tokens,
                             eos_token_ids=tuple(dict.fromkeys(eos)))
        self.limits = limits or ServerLimits()
        self.api_key, self.grpc_tls = api_key, grpc_tls
        self.chat_settings = chat_settings
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.host, self.port, self.grpc_port = host, port, grpc_port
        self.metrics = GpuMetrics(self.engine, runner, health_fn=health_fn)  # GET /metrics; own registry
        self.app = create_app(self.engine, tokenizer, model_name, api_key=api_key, health_fn=health_fn,
                              metrics=self.metrics, limits=self.limits, chat_settings=chat_settings)
        self.closers = list(closers or [])
        self.http: HTTPServer | None = None
        self.grpc_server: grpc.Server | None = None
        self._stopped = False

    def start(self) -> "ServingStack":
        try:
            self.engine.start()
            self.http = HTTPServer(self.app, self.host, self.port, limits=self.limits).start()
            self.grpc_server, self.grpc_port = create_grpc_server(
                self.engine, self.tokenizer, self.host, self.grpc_port, api_key=self.api_key, tls=self.grpc_tls,
                max_prompt_chars=self.limits.prompt_chars_for(self.engine.max_request_tokens),
                chat_settings=self.chat_settings, options=grpc_server_options(self.limits),
                image_policy=self.limits.image_policy() if getattr(self.engine.runner, "images", None) else None)
        except BaseException:
            self.stop()
            raise
        self.port = self.http.port
        # what exists now (the loaded model, tokenizer, compiled grammars' tables) lives as long as the
        # server: out of the collector's sight, so a full collection while serving scans only what
        # requests made (unfrozen, a heap of a few million objects pauses every thread ~0.5 s)
        gc.collect()
        gc.freeze()
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
        close_all(self.closers)
        gc.unfreeze()  # what start froze is collectable again (a process that serves on, e.g. tests)

    def __enter__(self) -> "ServingStack":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def close_all(closers: list[Callable[[], None]]) -> None:
    """Run `closers` last first; one that raises is logged and the rest still run."""
    for close in reversed(closers):
        try:
            close()
        except Exception:  # noqa: BLE001 - keep closing the rest
            log.exception("error while shutting down")


WATCHDOG_S = 0.5  # how often serve_until_signal checks that the engine's scheduler thread still runs


def serve_until_signal(stack: ServingStack, prog: str) -> int:
    """Block until SIGINT/SIGTERM (then 0) or until the engine's scheduler thread is gone (then stop
    and return 1, so Kubernetes restarts the process)."""
    stop = threading.Event()
    rc = 0

    def on_signal(signum, frame):
        log.info("signal %d: shutting down", signum)
        stop.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(f"{prog}: serving '{stack.model_name}' — OpenAI API {stack.http_url}/v1, gRPC {stack.grpc_address}",
              file=sys.stderr, flush=True)
        while not stop.wait(WATCHDOG_S):
            if not stack.engine.alive:
                log.critical("%s: the engine's scheduler thread is gone (%s); exiting so the server is restarted",
                             prog, stack.engine.last_error or "no error recorded")
                rc = 1
                break
    finally:
        t0 = time.monotonic()
        stack.stop()
        for s, h in old.items():
            signal.signal(s, h)
        log.info("stopped in %.1fs", time.monotonic() - t0)
    return rc


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
                                                 getattr(args, "chat_template", None), args.prefix_cache,
                                                 args.host_kv_cache, getattr(args, "cuda_graphs", True),
                                                 getattr(args, "prefix_snapshot_every", None))
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
                             health_fn=client.health, closers=closers,
                             limits=server_limits(args),
                             max_waiting=args.max_waiting, max_new_tokens=args.max_new_tokens,
                             grpc_tls=ApiTLS.from_args(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_ca),
                             chat_settings=ChatSettings(getattr(args, "tool_call_parser", "auto"),
                                                        getattr(args, "reasoning_parser", "auto")))
        stack.start()  # on failure it stops itself, running the closers
    except BaseException as e:
        if stack is None:
            close_all(closers)
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
