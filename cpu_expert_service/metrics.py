"""Prometheus metrics of one CPU expert shard (`moesplit expert-server --metrics-port N`).

Cross-cutting, so nothing in the servicer changes: a gRPC server interceptor stamps each request's
arrival (a reader thread drains the Forward stream as requests come, so a request that waits
behind the previous one on its stream is seen waiting), and the backend is wrapped so every
`forward` reports its compute time, tokens and expert activations. Exported (README "Metrics"):

    moesplit_expert_kernel_seconds{layer}            histogram, backend compute per request
    moesplit_expert_queue_wait_seconds               histogram, arrival on the stream (or the shared-memory
                                                     doorbell) -> compute start
    moesplit_expert_tokens{layer}                    counter, token rows computed
    moesplit_expert_activations{layer,expert}        counter, (token, expert) routings to experts held
                                                     (counted by intermediate slice 0 only, so a sum
                                                     over shards counts each routing once)
    moesplit_expert_weight_bytes{format,checkpoint_format}   gauge
    moesplit_expert_backend_info{shard_id,backend,isa,weight_format}   info-style gauge = 1
    process_*                                        RSS, CPU, fds (ProcessCollector)

    metrics = ShardMetrics(registry, info, shard_id)
    backend = metrics.wrap(backend); grpc.server(..., interceptors=[metrics.interceptor()])
"""
from __future__ import annotations

import logging
import queue
import threading
import time

import grpc
import numpy as np
from prometheus_client import CollectorRegistry, Gauge, Histogram, ProcessCollector, start_http_server
from prometheus_client.core import CounterMetricFamily

PREFIX = "moesplit_"
KERNEL_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                  2.5, 5.0)
WAIT_BUCKETS = (0.00001, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                0.5, 1.0)
FORWARD_METHOD = "/moesplit.v1.ExpertService/Forward"
FORWARD_ONE_METHOD = "/moesplit.v1.ExpertService/ForwardOne"

_arrival = threading.local()  # .t: perf_counter() at which the request being computed arrived


class _Counts:
    """Token and activation counters as numpy arrays (one add per request, not one per expert),
    exported as counters at scrape time."""

    def __init__(self, layers: list[int], n_experts: int, count_activations: bool):
        self.layers = list(layers)
        self.row = {layer: i for i, layer in enumerate(self.layers)}
        self.n_experts = n_experts
        self.count_activations = count_activations
        self.tokens = np.zeros(len(self.layers), dtype=np.int64)
        self.acts = np.zeros((len(self.layers), n_experts), dtype=np.int64)
        self.held = np.zeros(n_experts, dtype=bool)
        self.lock = threading.Lock()
        self.native: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    def native_arrays(self, n_layer_ids: int) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
        """(tokens [layer id], activations [layer id, E] or None, held [E] uint8) that the shards' C
        doorbell loops (kernels/moe_shm.c) add into atomically, whatever the backend; collect() adds
        them in."""
        with self.lock:
            if self.native is None or self.native[0].shape[0] < n_layer_ids:
                n = max(n_layer_ids, max(self.layers, default=0) + 1)
                self.native = (np.zeros(n, dtype=np.int64), np.zeros((n, self.n_experts), dtype=np.int64),
                               self.held.astype(np.uint8))
            tokens, acts, held = self.native
        return tokens, acts if self.count_activations else None, held

    def add(self, layer: int, ids: np.ndarray) -> None:
        i = self.row.get(layer)
        if i is None:
            return
        counts = None
        if self.count_activations and ids.size:
            flat = ids.reshape(-1)
            counts = np.bincount(flat[(flat >= 0) & (flat < self.n_experts)], minlength=self.n_experts)
            counts[~self.held] = 0
        with self.lock:
            self.tokens[i] += ids.shape[0]
            if counts is not None:
                self.acts[i] += counts

    def describe(self):
        return []

    def collect(self):
        with self.lock:
            tokens, acts = self.tokens.copy(), self.acts.copy()
            if self.native is not None:  # what the C loops counted (indexed by layer id)
                ids = np.asarray(self.layers, dtype=np.int64)
                tokens += self.native[0][ids]
                acts += self.native[1][ids]
        c = CounterMetricFamily(PREFIX + "expert_tokens", "Token rows computed by this shard, by layer.",
                                labels=["layer"])
        for layer, n in zip(self.layers, tokens):
            c.add_metric([str(layer)], int(n))
        yield c
        c = CounterMetricFamily(PREFIX + "expert_activations",
                                "Routings of a token to an expert held here, by layer and expert (slice 0 counts).",
                                labels=["layer", "expert"])
        if self.count_activations:
            held = np.nonzero(self.held)[0]
            for layer, row in zip(self.layers, acts):
                for e in held:
                    c.add_metric([str(layer), str(int(e))], int(row[e]))
        yield c


class MeteredBackend:
    """An ExpertBackend that reports each forward to ShardMetrics; everything else passes through."""

    def __init__(self, backend, metrics: "ShardMetrics"):
        self._backend = backend
        self._metrics = metrics

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def forward(self, layer: int, x: np.ndarray, ids: np.ndarray, w: np.ndarray) -> np.ndarray:
        t0 = time.perf_counter()
        arrived = getattr(_arrival, "t", None)
        if arrived is not None:
            self._metrics.queue_wait.observe(max(0.0, t0 - arrived))
            _arrival.t = None
        out = self._backend.forward(layer, x, ids, w)
        m = self._metrics
        child = m._kernel_children.get(layer)
        if child is None:
            child = m._kernel_children[layer] = m.kernel.labels(str(layer))
        child.observe(time.perf_counter() - t0)
        m.counts.add(layer, ids)
        return out


def mark_arrival(t: float | None = None) -> None:
    """The request about to be computed on this thread arrived at perf_counter() `t` (default now);
    a transport without the gRPC stream (the shared-memory fast path) calls this."""
    _arrival.t = time.perf_counter() if t is None else t


def _stamped(request_iterator):
    """Read the request stream ahead on a thread, stamping arrival times; yield the requests in
    order in the caller's thread with `_arrival.t` set for the compute that follows."""
    q: queue.Queue = queue.Queue()
    end = object()

    def reader():
        try:
            for req in request_iterator:
                q.put((req, time.perf_counter()))
        except Exception as e:  # noqa: BLE001 - the stream broke or was cancelled: end it in order
            q.put((end, e))
            return
        q.put((end, None))

    threading.Thread(target=reader, name="expert-stream-rx", daemon=True).start()
    while True:
        req, t = q.get()
        if req is end:
            if t is not None:
                raise t
            return
        _arrival.t = t
        yield req


class _Interceptor(grpc.ServerInterceptor):
    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        if method == FORWARD_METHOD and handler.stream_stream is not None:
            inner = handler.stream_stream

            def stream(request_iterator, context):
                return inner(_stamped(request_iterator), context)

            return grpc.stream_stream_rpc_method_handler(stream, handler.request_deserializer,
                                                         handler.response_serializer)
        if method == FORWARD_ONE_METHOD and handler.unary_unary is not None:
            inner_one = handler.unary_unary

            def unary(request, context):
                _arrival.t = time.perf_counter()
                return inner_one(request, context)

            return grpc.unary_unary_rpc_method_handler(unary, handler.request_deserializer,
                                                       handler.response_serializer)
        return handler


class ShardMetrics:
    """Every metric of one shard on `registry` (a per-process registry; tests pass their own)."""

    def __init__(self, registry: CollectorRegistry, info: dict, shard_id: str, backend, n_experts: int,
                 process: bool = True):
        p = PREFIX
        self.registry = registry
        self.kernel = Histogram(p + "expert_kernel_seconds", "Backend compute time of one request, by layer.",
                                ["layer"], buckets=KERNEL_BUCKETS, registry=registry)
        self._kernel_children: dict[int, object] = {}
        self._native_lock = threading.Lock()
        self._native_loops: list = []
        self._drainer: threading.Thread | None = None
        self._dropped_logged = 0
        self.queue_wait = Histogram(p + "expert_queue_wait_seconds",
                                    "Time from a request's arrival on its stream to the start of its compute.",
                                    buckets=WAIT_BUCKETS, registry=registry)
        self.counts = _Counts(info["layers"], n_experts, count_activations=info["slice_index"] == 0)
        self.counts.held[np.asarray(info["experts"], dtype=np.int64)] = True
        registry.register(self.counts)
        wb = Gauge(p + "expert_weight_bytes", "Bytes of expert weights resident in the backend.",
                   ["format", "checkpoint_format"], registry=registry)
        wb.labels(str(backend.weight_format), str(info["weight_format"])).set_function(
            lambda: float(backend.weight_bytes()))
        bi = Gauge(p + "expert_backend_info", "The expert kernel in use (value 1).",
                   ["shard_id", "backend", "isa", "weight_format"], registry=registry)
        bi.labels(shard_id, str(backend.name), str(getattr(backend, "isa", "none")),
                  str(backend.weight_format)).set(1)
        if process:
            ProcessCollector(registry=registry)

    # ---- the shards' C doorbell loops (cpu_expert_service.shm_transport.shard_loop)
    DRAIN_S = 0.1

    def attach_native(self, loop) -> None:
        """Feed a C loop's per-call records (queue wait, kernel time) into the histograms, every
        DRAIN_S seconds on one thread, and once more when it ends (detach_native)."""
        with self._native_lock:
            self._native_loops.append(loop)
            if self._drainer is None:
                self._drainer = threading.Thread(target=self._drain_forever, name="shm-metrics", daemon=True)
                self._drainer.start()

    def detach_native(self, loop) -> None:
        with self._native_lock:
            if loop in self._native_loops:
                self._native_loops.remove(loop)
            self._drain(loop)

    def _drain_forever(self) -> None:
        while True:
            time.sleep(self.DRAIN_S)
            with self._native_lock:
                for loop in self._native_loops:
                    self._drain(loop)

    def _drain(self, loop) -> None:
        recs, dropped = loop.drain()  # [n, 4]: layer, T, queue wait ns, kernel ns (-1: the compute failed)
        for layer, _t, wait_ns, kernel_ns in recs.tolist():
            self.queue_wait.observe(wait_ns * 1e-9)
            if kernel_ns < 0:  # as MeteredBackend: a failed forward has its queue wait, no kernel time
                continue
            child = self._kernel_children.get(layer)
            if child is None:
                child = self._kernel_children[layer] = self.kernel.labels(str(layer))
            child.observe(kernel_ns * 1e-9)
        if dropped > self._dropped_logged:
            self._dropped_logged = dropped
            logging.getLogger("moesplit.metrics").warning(
                "%d shared-memory call records were dropped before the metrics drained them", dropped)

    def wrap(self, backend) -> MeteredBackend:
        return MeteredBackend(backend, self)

    def interceptor(self) -> grpc.ServerInterceptor:
        return _Interceptor()


def serve_metrics(registry: CollectorRegistry, host: str, port: int):
    """Start the /metrics HTTP server on host:port (a thread); returns (server, thread)."""
    try:
        return start_http_server(port, addr=host, registry=registry)
    except OSError as e:
        raise OSError(f"cannot bind the metrics port {host}:{port}: {e}; pick another --metrics-port") from None
