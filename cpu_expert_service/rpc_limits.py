"""The shard's gRPC server limits: streams cannot take the threads that health and unary calls need.

The sync gRPC server holds one worker thread per open `Forward` stream for its whole life, so 32
idle streams (no credentials needed on a plaintext port) once took every worker: the health
check hit DEADLINE_EXCEEDED and the GPU service's /health went 503 until they closed. Now:

- `StreamLimits` (a server interceptor) lets at most `max_streams` Forward streams hold a thread;
  one more is refused at once with RESOURCE_EXHAUSTED (the GPU client then sends that call with
  the unary `ForwardOne`);
- a stream with no request or answer for `idle_s` is cancelled by a watchdog (the GPU client
  opens a new stream on its next call);
- Forward / ForwardOne are registered raw (`add_servicer`): a message that does not parse is the
  servicer's INVALID_ARGUMENT, not gRPC's INTERNAL;
- the pool has `RESERVED_WORKERS` threads more than streams may take, so health checks,
  Describe, Attach* and ForwardOne always find one; `maximum_concurrent_rpcs` bounds the rest
  (RESOURCE_EXHAUSTED beyond, instead of an unbounded queue).
"""
from __future__ import annotations

import logging
import os
import threading
import time

import grpc

log = logging.getLogger("moesplit.expert_server")
SERVICE_NAME = "moesplit.v1.ExpertService"

RESERVED_WORKERS = 8  # threads no stream can take: health, Describe, Attach*, ForwardOne
IDLE_ENV = "MOESPLIT_STREAM_IDLE_S"
DEFAULT_IDLE_S = 300.0


def idle_seconds() -> float:
    """Idle-stream timeout (MOESPLIT_STREAM_IDLE_S, default 300 s)."""
    raw = os.environ.get(IDLE_ENV, "").strip()
    try:
        v = float(raw) if raw else DEFAULT_IDLE_S
    except ValueError:
        v = -1.0
    if v <= 0:
        raise ValueError(f"{IDLE_ENV}={raw!r}: expected seconds > 0, e.g. 300")
    return v


def server_kwargs(max_streams: int) -> dict:
    """grpc.server() keyword arguments: worker threads and the concurrent-RPC bound."""
    from concurrent import futures

    workers = max_streams + RESERVED_WORKERS
    return dict(thread_pool=futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="shard-grpc"),
                maximum_concurrent_rpcs=max_streams + 4 * RESERVED_WORKERS)


class StreamLimits(grpc.ServerInterceptor):
    """At most `max_streams` bidi streams at once, each cancelled after `idle_s` without traffic."""

    def __init__(self, max_streams: int, idle_s: float | None = None):
        self.max_streams = max_streams
        self.idle_s = idle_seconds() if idle_s is None else idle_s
        self.slots = threading.BoundedSemaphore(max_streams)
        self.active: dict[int, list] = {}  # id -> [last activity (monotonic), context]
        self.lock = threading.Lock()
        self.idle_closed = 0
        threading.Thread(target=self._watch, name="shard-stream-watchdog", daemon=True).start()

    def intercept_service(self, continuation, details):
        handler = continuation(details)
        if handler is None or not (handler.request_streaming and handler.response_streaming):
            return handler
        inner = handler.stream_stream

        def limited(request_iterator, context):
            if not self.slots.acquire(blocking=False):
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"this shard has {self.max_streams} streams open already (--max-workers); "
                              f"send the call with ForwardOne or retry")
            entry = [time.monotonic(), context]
            with self.lock:
                self.active[id(entry)] = entry
            try:
                def counted():
                    for req in request_iterator:
                        entry[0] = time.monotonic()
                        yield req
                for resp in inner(counted(), context):
                    entry[0] = time.monotonic()
                    yield resp
            finally:
                with self.lock:
                    self.active.pop(id(entry), None)
                self.slots.release()

        return grpc.stream_stream_rpc_method_handler(limited, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)

    def _watch(self) -> None:
        tick = min(1.0, self.idle_s / 4)
        while True:
            time.sleep(tick)
            now = time.monotonic()
            with self.lock:
                idle = [e for e in self.active.values() if now - e[0] > self.idle_s]
            for e in idle:
                e[0] = now  # cancel once
                self.idle_closed += 1
                e[1].cancel()
            if idle:
                log.info("closed %d Forward streams idle for over %.0f s", len(idle), self.idle_s)


RAW_METHODS = ("Forward", "ForwardOne")  # requests parsed by the servicer, not by gRPC


def add_servicer(servicer, server: grpc.Server) -> None:
    """Register every ExpertService method (like the generated add_ExpertServiceServicer_to_server),
    except that Forward / ForwardOne receive raw bytes: a message that does not even parse gets
    INVALID_ARGUMENT from the servicer instead of gRPC's INTERNAL deserialization failure (whose
    error path also leaked memory per call under fuzzing)."""
    from google.protobuf import symbol_database

    from protos.moesplit.v1 import experts_pb2

    db = symbol_database.Default()
    handlers = {}
    for m in experts_pb2.DESCRIPTOR.services_by_name["ExpertService"].methods:
        req_cls = db.GetSymbol(m.input_type.full_name)
        resp_cls = db.GetSymbol(m.output_type.full_name)
        kind = {(False, False): grpc.unary_unary_rpc_method_handler, (False, True): grpc.unary_stream_rpc_method_handler,
                (True, False): grpc.stream_unary_rpc_method_handler,
                (True, True): grpc.stream_stream_rpc_method_handler}[(m.client_streaming, m.server_streaming)]
        handlers[m.name] = kind(getattr(servicer, m.name),
                                request_deserializer=None if m.name in RAW_METHODS else req_cls.FromString,
                                response_serializer=resp_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
