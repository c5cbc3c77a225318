"""One CPU expert shard: serves routed experts of every MoE layer over gRPC (no torch).

A shard holds either a subset of the routed experts (`--experts 0-7,9`) or a slice of every
expert's intermediate dimension (`--slice i/n`, 0-based: gate/up rows and down columns
[i0:i1) of an even split of moe_intermediate_size), or both. It reads only those weights,
tensor by tensor, through `CheckpointReader.get`, so its memory is its share of the experts.

    moesplit expert-server --model DIR (--experts 0-7,9 | --slice 1/2) [--host H] [--port P]
                           [--port-file F] [--shard-id NAME] [--backend auto|kernels|numpy]
                           [--tls-cert F --tls-key F --tls-ca F] [--metrics-port N] [--shm-dir DIR]
                           [--weight-format auto|bf16|int8|int4|mxfp4] [--act-bits 16|8]
                           [--auth-token-file F]
    moesplit expert-server --packed OUTDIR --shard-index I [--model DIR] ...   (moesplit convert output)
    python -m cpu_expert_service.server ...   (same arguments)

After binding it prints `READY port=<port>` on stdout and writes the port file; it serves until
SIGTERM/SIGINT. Every request is validated; a bad one gets INVALID_ARGUMENT naming the problem
(on the bidi stream that aborts the stream only) and the shard keeps serving.

Before serving, the checkpoint tensors this shard serves are verified (`CheckpointReader.verify`:
present, inside their file, of the shape config.json implies) and every loaded weight must be
finite; a truncated or corrupt file stops the start-up with an error naming file and tensor.
With --tls-cert/--tls-key/--tls-ca the port speaks mutual TLS: clients need a certificate signed
by the CA. Message-size limits and keepalive come from wire.channel.
DeepSeek-V4 (MXFP4 / FP8-e8m0 experts, the config's swiglu_limit): docs/v4.md "Expert shards".
A co-located GPU service may move its layer calls to shared memory inside --shm-dir (AttachShm;
cpu_expert_service.shm_transport): same validation, same backend, same errors.
"""
from __future__ import annotations

import argparse
import logging
import os
import secrets
import signal
import sys
import threading
import time

import grpc
import ml_dtypes
import numpy as np
try:  # optional where only a shard is served without the standard health service
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
except ImportError:
    health = health_pb2 = health_pb2_grpc = None

from checkpoint.config import ModelConfig
from checkpoint.config_v4 import load_any_config
from checkpoint.names import compact_ranges
from wire import channel as transport
from wire.channel import INSTANCE_KEY
from wire.ratelog import RateLimitedLog
from cpu_expert_service import auth
from cpu_expert_service.backend import ExpertBackend
from cpu_expert_service.rpc_limits import add_servicer, SERVICE_NAME
# load_shard and the --experts / --slice parsers live in shard_load (no gRPC); named here for callers
from cpu_expert_service.shard_load import (  # noqa: F401
    load_shard, parse_experts, parse_slice, slice_range, WEIGHT_FORMATS)
from protos.moesplit.v1 import experts_pb2, experts_pb2_grpc

log = logging.getLogger("moesplit.expert_server")

DEFAULT_MAX_TOKENS = transport.DEFAULT_MAX_TOKENS
DEFAULT_MAX_WORKERS = 32  # Forward streams at once (each holds a thread); health etc. keep threads of their own

# wire dtype name -> numpy dtype
WIRE_DTYPES: dict[str, np.dtype] = {
    "float32": np.dtype(np.float32),
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "int32": np.dtype(np.int32),
    "int64": np.dtype(np.int64),
}
FLOAT_WIRE = ("float32", "bfloat16", "float16")
INT_WIRE = ("int32", "int64")
MAX_DIM = 1 << 24  # largest size of one tensor dimension on the wire (T is bounded further by --max-tokens)
# modules whose presence in a shard process is reported by Describe (torch must never be there)
WATCHED_MODULES = ("torch", "transformers", "numpy", "grpc", "safetensors")


# ---- tensors on the wire ----------------------------------------------------------------------
def to_tensor(a: np.ndarray, dtype: str | None = None) -> experts_pb2.Tensor:
    """numpy array -> Tensor (cast to `dtype` wire name if given)."""
    if dtype is None:
        dtype = next((k for k, v in WIRE_DTYPES.items() if v == a.dtype), None)
        if dtype is None:
            raise ValueError(f"dtype {a.dtype} has no wire encoding; use one of {list(WIRE_DTYPES)}")
    arr = np.ascontiguousarray(a, dtype=WIRE_DTYPES[dtype])
    return experts_pb2.Tensor(dtype=dtype, shape=list(arr.shape), data=arr.tobytes())


class RequestError(ValueError):
    """A request the shard refuses (becomes INVALID_ARGUMENT)."""


def from_tensor(t: experts_pb2.Tensor, field: str, allowed: tuple[str, ...]) -> np.ndarray:
    """Tensor -> numpy array (a read-only view of the message bytes), validated."""
    if t.dtype not in allowed:
        raise RequestError(f"{field}: dtype {t.dtype!r} not accepted; expected one of {', '.join(allowed)}")
    dt = WIRE_DTYPES[t.dtype]
    shape = tuple(int(s) for s in t.shape)
    if len(shape) != 2 or not all(0 <= s <= MAX_DIM for s in shape):  # [0, 2**62] holds no data yet cannot be made
        raise RequestError(f"{field}: shape {list(shape)} must be 2-D with sizes in [0, {MAX_DIM}]")
    n = shape[0] * shape[1]
    if len(t.data) != n * dt.itemsize:
        raise RequestError(
            f"{field}: {len(t.data)} data bytes do not match shape {list(shape)} x {t.dtype} "
            f"({n * dt.itemsize} bytes)"
        )
    return np.frombuffer(t.data, dtype=dt).reshape(shape)


# ---- the servicer -----------------------------------------------------------------------------
class ExpertServicer(experts_pb2_grpc.ExpertServiceServicer):
    """Thin: validate, decode, backend.forward, encode."""

    def __init__(self, cfg: ModelConfig, backend: ExpertBackend, info: dict, shard_id: str, max_tokens: int):
        self.cfg = cfg
        self.backend = backend
        self.info = info
        self.shard_id = shard_id
        # this process's identity: a restart at the same address answers with another one, and the GPU
        # side re-describes (and re-checks) a replica whose connection shows a new one
        self.instance_id = secrets.token_hex(8)
        self.max_tokens = int(max_tokens)
        self.layers = frozenset(info["layers"])
        self._errors = RateLimitedLog(log)

    # request -> response; raises RequestError for anything invalid
    def _compute(self, req: experts_pb2.LayerRequest) -> experts_pb2.LayerResponse:
        t_start = time.perf_counter()
        self._check_layer(req.layer)
        x = from_tensor(req.hidden, "hidden", FLOAT_WIRE)  # [T, H], a view of the message bytes
        ids = from_tensor(req.topk_ids, "topk_ids", INT_WIRE)  # [T, k]
        w = from_tensor(req.topk_weights, "topk_weights", FLOAT_WIRE)  # [T, k]
        out, compute_us = self.check_and_forward(req.layer, x, ids, w)  # [T, H] f32
        resp = experts_pb2.LayerResponse(
            seq=req.seq,
            layer=req.layer,
            output=to_tensor(out, req.hidden.dtype),
            compute_us=compute_us,
        )
        resp.server_us = int((time.perf_counter() - t_start) * 1e6)
        return resp

    def _check_layer(self, layer: int) -> None:
        if layer not in self.layers:
            raise RequestError(
                f"layer {layer} is not an MoE layer served by shard {self.shard_id} "
                f"(serves layers {compact_ranges(self.layers) or 'none'})"
            )

    def check_and_forward(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> tuple[np.ndarray, int]:
        """Validate one decoded layer call and run the backend: ([T, H] f32, compute µs).
        Shared by gRPC and TCP; raises RequestError for anything invalid (kernels/moe_shm.c makes these checks
        in C with these messages: change them together). x: [T, H] float, ids: [T, k] int, w: [T, k] float."""
        cfg = self.cfg
        self._check_layer(layer)
        T, H = x.shape
        if H != cfg.hidden_size:
            raise RequestError(f"hidden: size {H} != model hidden_size {cfg.hidden_size}")
        if T > self.max_tokens:
            raise RequestError(f"hidden: {T} tokens exceed this shard's maximum of {self.max_tokens} per request")
        if ids.shape[0] != T:
            raise RequestError(f"topk_ids: {ids.shape[0]} rows but hidden has {T} tokens")
        if w.shape != ids.shape:
            raise RequestError(f"topk_weights shape {list(w.shape)} != topk_ids shape {list(ids.shape)}")
        if not 1 <= ids.shape[1] <= cfg.n_routed_experts:  # also for T = 0 (a [0, 2**62] shape is no data)
            raise RequestError(f"topk_ids: k={ids.shape[1]} must be in [1, {cfg.n_routed_experts}]")
        ids64 = np.asarray(ids, dtype=np.int64)  # no copy when already int64 (zero-copy views in)
        if ids64.size and (ids64.min() < 0 or ids64.max() >= cfg.n_routed_experts):
            bad = ids64[(ids64 < 0) | (ids64 >= cfg.n_routed_experts)]
            raise RequestError(
                f"topk_ids: expert id {int(bad[0])} outside [0, {cfg.n_routed_experts})"
            )
        x32 = np.asarray(x, dtype=np.float32)  # backends only read their inputs
        w32 = np.asarray(w, dtype=np.float32)
        if not np.isfinite(x32).all():
            raise RequestError("hidden contains NaN or Inf")
        if not np.isfinite(w32).all():
            raise RequestError("topk_weights contain NaN or Inf")
        t0 = time.perf_counter()
        out = self.backend.forward(layer, x32, ids64, w32)  # [T, H] f32
        return out, int((time.perf_counter() - t0) * 1e6)

    def _compute_or_abort(self, req: "experts_pb2.LayerRequest | bytes", context) -> experts_pb2.LayerResponse:
        if isinstance(req, bytes):  # registered raw (see add_servicer): parse here, refuse garbage cleanly
            try:
                req = experts_pb2.LayerRequest.FromString(req)
            except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"shard {self.shard_id}: not a LayerRequest message ({type(e).__name__}: {e})")
        try:
            return self._compute(req)
        except RequestError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"shard {self.shard_id}: seq {req.seq}: {e}")
        except Exception as e:  # noqa: BLE001 - a bug in the backend: say so (once per interval), keep serving
            if self._errors.warning(type(e).__name__, "shard %s: layer %d seq %d failed: %s: %s", self.shard_id,
                                    req.layer, req.seq, type(e).__name__, e):
                log.debug("traceback", exc_info=True)
            context.abort(grpc.StatusCode.INTERNAL, f"shard {self.shard_id}: seq {req.seq}: {type(e).__name__}: {e}")

    def Forward(self, request_iterator, context):
        context.send_initial_metadata(((INSTANCE_KEY, self.instance_id),))
        for req in request_iterator:
            yield self._compute_or_abort(req, context)

    def ForwardOne(self, request, context):
        context.send_initial_metadata(((INSTANCE_KEY, self.instance_id),))
        return self._compute_or_abort(request, context)

    shm_dir: str | None = None  # shared directory of the co-located fast path (None: refused)

    def AttachShm(self, request, context):
        from cpu_expert_service import shm_transport

        try:
            thread = shm_transport.attach(self, request.path, request.token, request.socket_path, self.shm_dir)
        except shm_transport.Refused as e:
            log.info("shard %s: shared-memory fast path refused: %s", self.shard_id, e)
            return experts_pb2.AttachShmResponse(accepted=False, reason=str(e), instance_id=self.instance_id)
        log.info("shard %s: shared-memory fast path %s attached", self.shard_id, thread)
        return experts_pb2.AttachShmResponse(accepted=True, instance_id=self.instance_id)

    data: "object | None" = None  # cpu_expert_service.tcp_transport.DataServer (None: refused)
    data_refusal = "the TCP data path is off on this shard (--data-port -1 or MOESPLIT_TCP=0)"

    def AttachTcp(self, request, context):
        if self.data is None:
            return experts_pb2.AttachTcpResponse(accepted=False, reason=self.data_refusal, instance_id=self.instance_id)
        port, token = self.data.offer()
        return experts_pb2.AttachTcpResponse(accepted=True, port=port, token=token, instance_id=self.instance_id)

    def Describe(self, request, context):
        i = self.info
        return experts_pb2.ShardInfo(
            shard_id=self.shard_id,
            layers=i["layers"],
            experts=i["experts"],
            slice_index=i["slice_index"],
            slice_count=i["slice_count"],
            intermediate_start=i["intermediate_start"],
            intermediate_stop=i["intermediate_stop"],
            weight_format=i["weight_format"],
            kernel=self.backend.name,
            model_fingerprint=self.cfg.fingerprint(),
            hidden_size=self.cfg.hidden_size,
            n_routed_experts=self.cfg.n_routed_experts,
            num_experts_per_tok=self.cfg.num_experts_per_tok,
            weight_bytes=int(self.backend.weight_bytes()),
            max_tokens=self.max_tokens,
            pid=os.getpid(),
            loaded_modules=[m for m in WATCHED_MODULES if m in sys.modules],
            swiglu_limit=getattr(self.backend, "swiglu_limit", None) or 0.0,
            act_bits=int(i.get("act_bits", 16)),
            instance_id=self.instance_id,
        )


def _default_shard_id(experts: list[int] | None, slice_spec: tuple[int, int] | None) -> str:
    parts = []
    if experts is not None:
        parts.append("experts-" + compact_ranges(experts))
    if slice_spec is not None:
        parts.append(f"slice-{slice_spec[0]}of{slice_spec[1]}")
    return "_".join(parts) or "all"


def create_server(
    model_dir: str,
    experts: list[int] | None = None,
    slice_spec: tuple[int, int] | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    backend: str = "numpy",
    max_workers: int = DEFAULT_MAX_WORKERS,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    shard_id: str | None = None,
    tls: "transport.TLSFiles | None" = None,
    metrics_registry=None,
    shm_dir: str | None = None,
    weight_format: str = "auto",
    packed: str | None = None,
    shard_index: int | None = None,
    data_port: int | None = None,
    auth_token: bytes | None = None,
    act_bits: int = 16,
) -> tuple[grpc.Server, int]:
    """Load this shard's experts and return a started server and its bound port.
    With `tls`, the port requires a client certificate signed by `tls.ca` (mutual TLS).
    With `packed` (a `moesplit convert` output), shard `shard_index` is read from its layer files
    (cpu_expert_service.packed.load_packed; `model_dir`, if given, must be the model converted).
    With `auth_token`, every ExpertService call must carry it (cpu_expert_service.auth).
    `act_bits` 8: the integer kernels' 8-bit activations (shard_load.load_shard; Describe reports it)."""
    creds = transport.server_credentials(tls) if tls is not None else None  # bad files: fail before loading
    if packed is not None:
        from cpu_expert_service.packed import load_packed

        if experts is not None or slice_spec is not None:
            raise ValueError("--packed: the shard's experts and slice come from the packed manifest; "
                             "drop --experts / --slice")
        if shard_index is None:
            raise ValueError("--packed needs --shard-index I (which packed shard this process serves)")
        cfg, be, info = load_packed(packed, shard_index, backend, weight_format, model_dir, act_bits)
        shard_id = shard_id or _default_shard_id(
            info["experts"], (info["slice_index"], info["slice_count"]) if info["slice_count"] > 1 else None)
    else:
        cfg, be, info = load_shard(model_dir, experts, slice_spec, backend, weight_format, act_bits)
    shard_id = shard_id or _default_shard_id(experts, slice_spec)
    from cpu_expert_service.rpc_limits import server_kwargs, StreamLimits

    interceptors = [StreamLimits(max_workers)]  # streams can never take the threads health needs
    if auth_token:  # first: a refused call takes no stream slot
        from cpu_expert_service.auth import TokenAuth

        interceptors.insert(0, TokenAuth(auth_token))
    if metrics_registry is not None:  # Prometheus: metered backend + arrival-stamping interceptor
        from cpu_expert_service.metrics import ShardMetrics

        sm = ShardMetrics(metrics_registry, info, shard_id, be, cfg.n_routed_experts)
        be, interceptors = sm.wrap(be), interceptors + [sm.interceptor()]
    servicer = ExpertServicer(cfg, be, info, shard_id, max_tokens)
    servicer.shm_dir = shm_dir or None  # co-located clients may attach shared memory inside it
    if data_port is not None and data_port >= 0:
        from cpu_expert_service.tcp_transport import DataServer
        from wire.tcp import enabled

        if enabled():  # cross-host clients may attach to it (TLS with the gRPC files when given)
            servicer.data = DataServer(servicer, host, data_port, tls)
    server = grpc.server(**server_kwargs(max_workers), interceptors=interceptors,
                         options=transport.server_options(cfg, max_tokens))
    add_servicer(servicer, server)
    if health is None:
        raise RuntimeError("serving a shard needs grpc.health.v1: pip install grpcio-health-checking")
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    addr = f"{host}:{port}"
    bound = server.add_secure_port(addr, creds) if creds is not None else server.add_insecure_port(addr)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    server.start()
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    server.health_servicer = health_servicer  # so run() can flip to NOT_SERVING on shutdown
    server.servicer = servicer
    log.info(
        "shard %s: %d experts x %d layers, intermediate [%d:%d), %s via %s, %.1f MB in %.2fs, port %d",
        shard_id, len(info["experts"]), len(info["layers"]), info["intermediate_start"],
        info["intermediate_stop"], info["weight_format"], be.name, be.weight_bytes() / 2**20,
        info["load_s"], bound,
    )
    return server, bound


# ---- CLI --------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="checkpoint directory (config.json + *.safetensors); with --packed optional "
                                    "(then only its config.json is read, to check the packed fingerprint)")
    p.add_argument("--packed", help="serve from `moesplit convert` output OUTDIR instead of the checkpoint's files")
    p.add_argument("--shard-index", type=int, help="with --packed: which packed shard (0-based) to serve")
    p.add_argument("--weight-format", choices=WEIGHT_FORMATS, default="auto",
                   help="how the experts are held: auto (the checkpoint's / packed files': int4 stays int4, V4 "
                        "MXFP4 stays mxfp4 as stored, the rest runs as bf16) | bf16 | int8 | int4 (kernels "
                        "quantise at load) | mxfp4 (MXFP4 checkpoints only)")
    p.add_argument("--act-bits", type=int, choices=(16, 8), default=16,
                   help="activation quantisation of the int8/int4/mxfp4 kernels per group of 32: 16 (default, two "
                        "int8 levels, ~2^-15 relative) | 8 (one level, ~2^-8; faster AVX-512 prefill). Every replica "
                        "of a shard group must use the same value; refused with bf16 or --backend numpy")
    p.add_argument("--experts", help="routed expert ids to serve, e.g. '0-7,9' (default: all)")
    p.add_argument("--slice", dest="slice_spec", help="intermediate slice i/n to serve (0-based), e.g. 1/2")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    p.add_argument("--port-file", help="write the bound port to this file once serving")
    p.add_argument("--shard-id", help="name reported by Describe and in errors")
    p.add_argument("--backend", default="auto",
                   help="expert kernel: auto (best built; env MOESPLIT_CPU_BACKEND overrides) | kernels | numpy")
    p.add_argument("--max-workers", type=int, default=DEFAULT_MAX_WORKERS,
                   help="Forward streams served at once (each holds a thread; RESOURCE_EXHAUSTED beyond)")
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="largest T accepted per request")
    p.add_argument("--metrics-port", type=int, default=0,
                   help="serve Prometheus /metrics on this port of --host (default 0: off)")
    transport.add_tls_arguments(p, "server")
    auth.add_arguments(p)
    p.add_argument("--shm-dir", default=None,
                   help="shared directory for the co-located shared-memory fast path (default $MOESPLIT_SHM_DIR "
                        "or /dev/shm; '' disables it, as does MOESPLIT_SHM=0)")
    p.add_argument("--data-port", type=int, default=0,
                   help="TCP port of the cross-host data path (cpu_expert_service.tcp_transport) on --host, "
                        "TLS with --tls-*; default 0 picks a free one, -1 turns it off (as does MOESPLIT_TCP=0)")
    p.add_argument("--log-level", default="INFO")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if not args.model and not args.packed:
            raise ValueError("pass --model DIR (a checkpoint) or --packed OUTDIR --shard-index I (moesplit convert)")
        cfg = load_any_config(args.model or args.packed)
        experts = parse_experts(args.experts, cfg.n_routed_experts) if args.experts else None
        slice_spec = parse_slice(args.slice_spec) if args.slice_spec else None
        tls = transport.TLSFiles.from_args(args.tls_cert, args.tls_key, args.tls_ca, "moesplit expert-server")
        token = auth.resolve_token(args.auth_token_file)
    except ValueError as e:
        print(f"moesplit expert-server: {e}", file=sys.stderr)
        return 2
    from checkpoint.reader import CheckpointError

    registry = None
    if args.metrics_port:
        from prometheus_client import CollectorRegistry

        registry = CollectorRegistry(auto_describe=False)
    try:
        server, port = create_server(
            args.model, experts=experts, slice_spec=slice_spec, host=args.host, port=args.port,
            backend=args.backend, max_workers=args.max_workers, max_tokens=args.max_tokens,
            shard_id=args.shard_id, tls=tls, metrics_registry=registry,
            shm_dir=_shm_dir(args.shm_dir), weight_format=args.weight_format, packed=args.packed,
            shard_index=args.shard_index, data_port=args.data_port, auth_token=token,
            act_bits=args.act_bits,
        )
    except (CheckpointError, KeyError, ValueError, OSError) as e:  # never reported ready
        print(f"moesplit expert-server: {e}", file=sys.stderr)
        return 1
    if registry is not None:
        from cpu_expert_service.metrics import serve_metrics

        try:
            serve_metrics(registry, args.host, args.metrics_port)
        except OSError as e:
            print(f"moesplit expert-server: {e}", file=sys.stderr)
            server.stop(None)
            return 1
    stop = threading.Event()

    def _on_signal(signum, frame):
        log.info("signal %d: shutting down", signum)
        stop.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if args.port_file:
        tmp = f"{args.port_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)  # readers never see a partial file
    print(f"READY port={port}", flush=True)
    while not stop.wait(3600):
        pass
    server.health_servicer.enter_graceful_shutdown()
    server.stop(grace=2.0).wait()
    log.info("stopped")
    return 0


def _shm_dir(arg: str | None) -> str | None:
    from wire import shm

    d = shm.default_dir() if arg is None else arg
    return d if d and shm.enabled() else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cpu_expert_service.server", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
