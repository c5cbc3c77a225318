"""Prometheus metrics of the GPU service, served at GET /metrics of the HTTP API.

Named like vLLM's and SGLang's serving metrics, with our prefix `moesplit_` (README "Metrics"
lists every one). Each `ServingStack` owns a `GpuMetrics` over its own `CollectorRegistry`, so
several stacks can live in one process (tests). Three kinds of sources:

- engine events (`EngineObserver`, set as `engine.observer`): time to first token, inter-token
  and end-to-end latency, queue time, finished requests by reason;
- the experts client's per-call observer (`ExpertsObserver`, set as `client.observer`): round-trip
  time per layer, per shard and per host + replica (`moesplit_expert_call_seconds`), bytes sent and
  received per shard;
- read at scrape time (`_ScrapeCollector`): running/waiting requests, KV pool pages, token
  counters (the engine's own counters), shard health, and GPU memory per plan category and
  device, planned vs actual (parameter/buffer bytes by placement + KV pool) and, on CUDA,
  `torch.cuda.memory_allocated` / `memory_reserved`.

    m = GpuMetrics(engine, runner, health_fn=..., plan=None)    # registers everything
    body, content_type = m.exposition()
"""
from __future__ import annotations

import logging
import re
import threading
import time
from typing import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client import generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from wire.channel import host_of

log = logging.getLogger("moesplit.metrics")

PREFIX = "moesplit_"
# latency buckets (seconds): vLLM's TTFT/ITL buckets, extended to the slower CPU-expert regime
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 10.0, 20.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0)
RTT_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
TOKENS_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
FINISH_REASONS = ("stop", "length", "cancelled", "error")

_HOT_EXPERT = re.compile(r"model\.layers\.\d+\.mlp\.experts\.")


def device_label(gpu_index: int) -> str:
    """Label of a planned device: "cuda:N" for planned GPU N (even when a CPU-only test executes
    the plan on the CPU), "cpu" for what the placement keeps on the host (-1)."""
    return "cpu" if gpu_index < 0 else f"cuda:{gpu_index}"


class EngineObserver:
    """Engine hooks (submit from API threads, the rest from the scheduler) -> request latency
    histograms and finished-by-reason counters."""

    def __init__(self, registry: CollectorRegistry):
        p = PREFIX
        self.ttft = Histogram(p + "time_to_first_token_seconds", "Time from arrival to the first generated token.",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram(p + "inter_token_latency_seconds", "Time between two generated tokens of a request.",
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram(p + "e2e_request_latency_seconds", "Time from arrival to the request's end.",
                             buckets=E2E_BUCKETS, registry=registry)
        self.queue = Histogram(p + "request_queue_time_seconds", "Time a request waited before its first admission.",
                               buckets=TTFT_BUCKETS, registry=registry)
        self.prompt_len = Histogram(p + "request_prompt_tokens", "Prompt tokens per finished request.",
                                    buckets=TOKENS_BUCKETS, registry=registry)
        self.gen_len = Histogram(p + "request_generation_tokens", "Generated tokens per finished request.",
                                 buckets=TOKENS_BUCKETS, registry=registry)
        self.finished = Counter(p + "request_finished", "Finished requests by finish reason.",
                                ["finished_reason"], registry=registry)
        for r in FINISH_REASONS:
            self.finished.labels(r)
        self._lock = threading.Lock()
        self._reqs: dict[str, list] = {}  # id -> [arrival, admitted, last token time]

    def submit(self, h) -> None:
        with self._lock:
            self._reqs[h.id] = [time.monotonic(), None, None]

    def admit(self, h) -> None:
        st = self._reqs.get(h.id)
        if st is not None and st[1] is None:  # re-admission after a preemption is not queue time
            st[1] = time.monotonic()
            self.queue.observe(st[1] - st[0])

    def token(self, h) -> None:
        st = self._reqs.get(h.id)
        if st is None:
            return
        now = time.monotonic()
        if st[2] is None:
            self.ttft.observe(now - st[0])
        else:
            self.itl.observe(now - st[2])
        st[2] = now

    def finish(self, h, reason: str) -> None:
        with self._lock:
            st = self._reqs.pop(h.id, None)
        self.finished.labels(reason).inc()
        if st is not None:
            self.e2e.observe(time.monotonic() - st[0])
        self.prompt_len.observe(h.prompt_tokens)
        self.gen_len.observe(h.completion_tokens)

    def preempt(self, h) -> None:  # counted from the engine's counters at scrape time
        pass


def _address_labels(address: str) -> tuple[str, str]:
    """(host, replica) of an address when no experts client names the replica: the address itself."""
    return host_of(address), address


class ExpertsObserver:
    """`ExpertsClient.observer`: called once per shard call with (layer, shard address, rtt
    seconds, bytes sent, bytes received, ok). `labels_of(address)` -> (host, replica) names the
    replica in `moesplit_expert_call_seconds` (the client's `replica_labels`: the shard's own id)."""

    def __init__(self, registry: CollectorRegistry):
        p = PREFIX
        self.labels_of: Callable[[str], tuple[str, str]] = _address_labels
        self.call = Histogram(p + "expert_call_seconds",
                              "Round trip of one layer call to one replica (send to answer, failed calls included), "
                              "by the host dialled and the replica's shard id.",
                              ["host", "replica"], buckets=RTT_BUCKETS, registry=registry)
        self.layer_rtt = Histogram(p + "expert_layer_rtt_seconds",
                                   "Round trip of one shard call of a MoE layer (send to answer), by layer.",
                                   ["layer"], buckets=RTT_BUCKETS, registry=registry)
        self.shard_rtt = Histogram(p + "expert_shard_rtt_seconds", "Round trip of one shard call, by shard.",
                                   ["shard"], buckets=RTT_BUCKETS, registry=registry)
        self.sent = Counter(p + "expert_sent_bytes", "Request bytes sent to each expert shard.", ["shard"],
                            registry=registry)
        self.received = Counter(p + "expert_received_bytes", "Response bytes received from each expert shard.",
                                ["shard"], registry=registry)
        self.calls = Counter(p + "expert_requests", "Shard calls by shard and status (ok|error).",
                             ["shard", "status"], registry=registry)

        # label children looked up once (labels() costs ~5 µs a call; a 61-layer step makes ~120 calls)
        self._layer: dict[int, object] = {}
        self._shard: dict[str, tuple] = {}

    def _children(self, shard: str) -> tuple:
        c = self._shard.get(shard)
        if c is None:
            c = self._shard[shard] = (self.shard_rtt.labels(shard), self.sent.labels(shard),
                                      self.received.labels(shard), self.calls.labels(shard, "ok"),
                                      self.calls.labels(shard, "error"), self.call.labels(*self.labels_of(shard)))
        return c

    def __call__(self, layer: int, shard: str, rtt_s: float, sent: int, received: int, ok: bool) -> None:
        c = self._layer.get(layer)
        if c is None:
            c = self._layer[layer] = self.layer_rtt.labels(str(layer))
        c.observe(rtt_s)
        rtt, snt, rcv, n_ok, n_err, call = self._children(shard)
        rtt.observe(rtt_s)
        call.observe(rtt_s)
        snt.inc(sent)
        if ok:
            rcv.inc(received)
        (n_ok if ok else n_err).inc()


# ---- memory: planned vs actual by plan category -------------------------------------------------
def _module_categories(cfg) -> list[tuple[str, str]]:
    """(module path, plan category), longest paths first, so a parameter takes its closest module."""
    from gpu_service.plan import gpu_modules

    mods = [(m.name, m.category) for m in gpu_modules(cfg)]
    return sorted(mods, key=lambda nc: -len(nc[0]))


def category_of(name: str, modules: list[tuple[str, str]]) -> str:
    """Plan category of a parameter/buffer name (gpu_service.plan.CATEGORIES, else "other")."""
    if _HOT_EXPERT.match(name):
        return "gpu_experts"
    for mod, cat in modules:
        if name == mod or name.startswith(mod + "."):
            return cat
    return "other"


def actual_bytes(runner, placement=None) -> dict[tuple[str, str], int]:
    """{(category, device label): bytes} of the runner's parameters, buffers and KV pool, placed by
    the placement's map (`placement.placed_bytes`)."""
    from gpu_service.model.placement import Placement, placed_bytes

    if getattr(runner.cfg, "is_v4", False):  # no plan categories yet: weights and the pool per planned device
        placement = placement or getattr(runner, "placement", None)
        where = placement.gpu_index_of if placement is not None else (lambda name: 0)
        out = {}
        for name, t in list(runner.model.named_parameters()) + list(runner.model.named_buffers()):
            k = ("weights", device_label(where(name)))
            out[k] = out.get(k, 0) + t.numel() * t.element_size()
        pool = runner.pool
        for i, ts in enumerate(zip(pool.entries, pool.index_k)):
            k = ("kv_cache", device_label(placement.layer_gpu[i] if placement is not None else 0))
            out[k] = out.get(k, 0) + sum(t.numel() * t.element_size() for t in ts if t is not None)
        return out
    placement = placement or getattr(runner, "placement", None) or Placement.single(runner.cfg, runner.device)
    mods = _module_categories(runner.cfg)
    out: dict[tuple[str, str], int] = {}
    for name, g, b in placed_bytes(runner.model, placement, runner.pool):
        k = (name if name in ("kv_cache", "index_keys") else category_of(name, mods), device_label(g))
        out[k] = out.get(k, 0) + b
    images = getattr(runner, "images", None)
    if images is not None:  # the vision tower (first GPU) and its cached embeddings
        k = ("vision", device_label(0))
        out[k] = sum(t.numel() * t.element_size() for t in images.tower.parameters()) + images.stats["cached_bytes"]
    return out


def planned_bytes(runner, plan=None, placement=None) -> dict[tuple[str, str], int]:
    """{(category, device label): bytes} the memory plan gives each category: the plan's items, or
    without a plan the byte model applied to the runner's placement and KV pool."""
    from gpu_service import plan as P
    from gpu_service.model.placement import Placement

    out: dict[tuple[str, str], int] = {}
    if plan is not None:
        for g, gp in enumerate(plan.gpus):
            for cat, b in gp.items.items():
                out[(cat, device_label(g))] = int(b)
        if getattr(plan.options, "embeddings", "gpu") == "cpu":
            out[("embeddings", "cpu")] = getattr(plan.options, "eb", 2) * plan.cfg.vocab_size * plan.cfg.hidden_size
        return out
    cfg = runner.cfg
    if getattr(cfg, "is_v4", False):
        return out  # V4 without a plan: no byte model applied to the runner (a plan gives its items above)
    placement = placement or getattr(runner, "placement", None) or Placement.single(cfg, runner.device)
    dt = getattr(runner, "dtype", None)
    eb = dt.itemsize if dt is not None else 2  # the compute dtype's bytes per element
    for m in P.gpu_modules(cfg):
        if cfg.tie_word_embeddings and m.category == "lm_head":
            continue
        k = (m.category, device_label(placement.gpu_index_of(m.name + ".weight")))
        out[k] = out.get(k, 0) + P.module_bytes(cfg, m, placement.attention_weights, eb)
    kv, idx = P.kv_bytes_per_token_layer(cfg, eb)
    tokens = runner.pool.num_pages * runner.pool.page_size + 1  # + the null slot
    for layer, g in enumerate(placement.layer_gpu):
        for cat, b in (("kv_cache", kv), ("index_keys", idx)):
            if b:
                k = (cat, device_label(g))
                out[k] = out.get(k, 0) + b * tokens
        hot = placement.hot_experts.get(layer, [])
        if hot:
            k = ("gpu_experts", device_label(g))
            out[k] = out.get(k, 0) + len(hot) * P.expert_bytes(cfg, placement.expert_format, eb=eb)
    return out


class _ScrapeCollector:
    """Values read at scrape time: engine state and counters, shard health, memory."""

    def __init__(self, engine, runner=None, health_fn=None, plan=None):
        self.engine, self.runner, self.health_fn, self.plan = engine, runner, health_fn, plan
        self.labels_of: Callable[[str], tuple[str, str]] = _address_labels  # shard address -> (host, replica)
        self._planned: dict | None = None
        self._actual: dict | None = None

    def describe(self):
        return []  # collected lazily: no scrape at registration time

    def collect(self):
        p = PREFIX
        s = self.engine.stats()
        for name, key, doc in (
                ("num_requests_running", "running", "Requests in the running batch."),
                ("num_requests_waiting", "waiting", "Requests waiting for admission."),
                ("kv_cache_usage_ratio", "pool_usage",
                 "Fraction of KV cache pages held by requests (0-1; reclaimable prefix-cache pages excluded)."),
                ("kv_cache_page_size_tokens", "pool_page_size", "Tokens per KV cache page.")):
            g = GaugeMetricFamily(p + name, doc)
            g.add_metric([], s[key])
            yield g
        g = GaugeMetricFamily(p + "kv_cache_pages", "KV cache pages by state (used: held by requests, cached: "
                              "only by the prefix cache, reclaimable; free; total).", labels=["state"])
        g.add_metric(["used"], s["pool_pages_in_use"] - s["pool_pages_cached"])
        g.add_metric(["cached"], s["pool_pages_cached"])
        g.add_metric(["free"], s["pool_pages_total"] - s["pool_pages_in_use"])
        g.add_metric(["total"], s["pool_pages_total"])
        yield g
        for name, key, doc in (
                ("prompt_tokens", "prompt_tokens", "Prompt tokens of submitted requests."),
                ("generation_tokens", "generated_tokens", "Generated tokens."),
                ("request_submitted", "requests", "Requests accepted by the engine."),
                ("num_preemptions", "preempted", "Requests preempted to free KV pages (recomputed later)."),
                ("engine_steps", "steps", "Engine steps (batched forward passes)."),
                ("engine_step_tokens", "step_tokens", "Tokens fed through the model (prefill + decode)."),
                ("prefill_tokens_computed", "prefill_tokens_computed",
                 "Prompt tokens run through the model (a prompt shared by n choices counts once)."),
                ("structured_output_requests", "structured_requests",
                 "Requests constrained by a grammar (response_format, guided_*).")):
            c = CounterMetricFamily(p + name, doc)
            c.add_metric([], s[key])
            yield c
        yield from _prefix_cache_families(s, getattr(self.engine, "prefix", None))
        if "image_hits" in s:  # a vision tower (gpu_service.runtime.images.ImageEmbeddings)
            c = CounterMetricFamily(p + "image_embedding_cache", "Images looked up in the image-embedding cache, "
                                    "by result (hit: the vision tower did not run).", labels=["result"])
            c.add_metric(["hit"], s["image_hits"])
            c.add_metric(["miss"], s["image_misses"])
            yield c
            g = GaugeMetricFamily(p + "image_embedding_cache_bytes", "Bytes of image embeddings cached.")
            g.add_metric([], s["image_cached_bytes"])
            yield g
        if self.health_fn is not None:
            g = GaugeMetricFamily(p + "expert_shard_up", "1 when the shard's gRPC health check says SERVING and "
                                  "the experts client uses it (0: down, failed over, reconnecting).",
                                  labels=["shard", "host", "replica"])
            try:
                _, shards = self.health_fn()
            except Exception:  # noqa: BLE001 - a failing check must not break the scrape
                log.exception("shard health check failed")
                shards = {}
            for addr, status in shards.items():
                g.add_metric([addr, *self.labels_of(addr)], 1.0 if status == "SERVING" else 0.0)
            yield g
        if self.runner is not None:
            yield from self._memory()

    def _memory(self):
        p = PREFIX
        try:
            if self._planned is None:  # parameters and the pool do not change after loading
                self._planned = planned_bytes(self.runner, self.plan)
                self._actual = actual_bytes(self.runner)
        except Exception:  # noqa: BLE001
            log.exception("memory metrics unavailable")
            self._planned, self._actual = {}, {}
        for name, values, doc in (
                ("gpu_memory_planned_bytes", self._planned, "Bytes the memory plan gives each category and device."),
                ("gpu_memory_actual_bytes", self._actual,
                 "Bytes held per plan category and device: parameters and buffers by placement, KV pool.")):
            g = GaugeMetricFamily(p + name, doc, labels=["category", "device"])
            for (cat, dev), b in sorted(values.items()):
                g.add_metric([cat, dev], b)
            yield g
        g = GaugeMetricFamily(p + "gpu_memory_device_bytes",
                              "Bytes per device by source: tensors (sum of actual), torch_allocated and "
                              "torch_reserved (torch.cuda, CUDA devices only).", labels=["device", "source"])
        per_dev: dict[str, int] = {}
        for (_, dev), b in self._actual.items():
            per_dev[dev] = per_dev.get(dev, 0) + b
        for dev, b in sorted(per_dev.items()):
            g.add_metric([dev, "tensors"], b)
        import torch

        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                g.add_metric([f"cuda:{i}", "torch_allocated"], torch.cuda.memory_allocated(i))
                g.add_metric([f"cuda:{i}", "torch_reserved"], torch.cuda.memory_reserved(i))
        yield g


def _prefix_cache_families(s: dict, cache):
    """The prefix cache (gpu_service.model.prefix_cache), from engine.stats()."""
    p = PREFIX
    if cache is None:
        return
    c = CounterMetricFamily(p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
    c.add_metric([], s["prefix_queries"])
    yield c
    for name, doc, label, values in (
            ("hits", "Prompt tokens served by the prefix cache, by tier (gpu|host).", "tier",
             (("gpu", "hits_gpu"), ("host", "hits_host"))),
            ("evictions", "Cached pages evicted: from the GPU pool (to the host tier or dropped) and dropped "
             "from the host tier.", "tier", (("gpu", "evicted_gpu"), ("host", "evicted_host"))),
            ("copied_bytes", "Bytes copied between the GPU pool and the host tier.", "direction",
             (("to_host", "copy_out_bytes"), ("to_gpu", "copy_in_bytes")))):
        c = CounterMetricFamily(p + "prefix_cache_" + name, doc, labels=[label])
        for v, key in values:
            c.add_metric([v], s["prefix_" + key])
        yield c
    g = GaugeMetricFamily(p + "prefix_cache_pages", "Prefix-cache pages by tier and state (gpu: referenced by "
                          "requests | cached, unreferenced; host: cached | free).", labels=["tier", "state"])
    for (tier, state), n in sorted(cache.page_counts().items()):
        g.add_metric([tier, state], n)
    yield g


class GpuMetrics:
    """Everything the GPU service exports, on one registry; hooks itself into the engine and the
    experts client (`runner.experts.client`) when they are given."""

    def __init__(self, engine, runner=None, health_fn: Callable | None = None, plan=None,
                 registry: CollectorRegistry | None = None, client=None):
        self.registry = registry or CollectorRegistry(auto_describe=False)
        self.engine_observer = EngineObserver(self.registry)
        self.experts_observer = ExpertsObserver(self.registry)
        if plan is None:  # a runner built from a memory plan may carry it (runner.plan)
            plan = getattr(runner, "plan", None)
        scrape = _ScrapeCollector(engine, runner, health_fn, plan)
        self.registry.register(scrape)
        ProcessCollector(registry=self.registry)
        engine.observer = self.engine_observer
        self.grammar_compile = Histogram(PREFIX + "grammar_compile_seconds",
                                         "Time to compile a structured-output grammar (cache misses).",
                                         ["kind", "ok"], buckets=RTT_BUCKETS, registry=self.registry)
        if getattr(engine, "grammars", None) is not None:
            engine.grammars.observer = lambda s, kind, ok: self.grammar_compile.labels(kind, str(ok).lower()).observe(s)
        if client is None and runner is not None:
            client = getattr(getattr(runner, "experts", None), "client", None)
        if client is not None:
            client.observer = self.experts_observer
            self.experts_observer.labels_of = scrape.labels_of = client.replica_labels

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
