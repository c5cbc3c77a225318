"""Probes and metrics, without the API key (gpu_service.api.guard lets them through):

    GET /live     liveness: 200 while the engine's scheduler thread runs (shards not asked), 503 once it
                  is gone (the server then exits: gpu_service.entrypoints.serving's watchdog)
    GET /health   readiness: 200 when the engine and every expert shard group serve, else 503
    GET /metrics  Prometheus metrics (gpu_service.metrics.GpuMetrics), when given
"""
from __future__ import annotations

from typing import Callable

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from gpu_service.runtime.engine import Engine

HealthFn = Callable[[], "tuple[bool, dict]"]


def router(engine: Engine, health_fn: HealthFn | None = None, metrics=None) -> APIRouter:
    """/live and /health over `engine` (and `health_fn`: the shards' (ok, {address: status})), and
    /metrics when `metrics` is given."""
    r = APIRouter()

    @r.get("/live")
    async def live():
        """Liveness: the engine alone (a shard outage must not restart this pod)."""
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    @r.get("/health")
    def health():
        """Readiness with the detail; sync: runs in the thread pool (the shard checks may block on a first call)."""
        serving = engine.serving
        ok, detail = serving, {"engine": "serving" if serving else "stopped"}
        if health_fn is not None:
            shards_ok, shards = health_fn()
            ok = ok and shards_ok
            detail["shards"] = shards
        detail["status"] = "ok" if ok else "unavailable"
        detail.update({k: v for k, v in engine.stats().items() if k in ("running", "waiting", "pool_usage")})
        return JSONResponse(detail, status_code=200 if ok else 503)

    if metrics is not None:
        @r.get("/metrics")
        def prometheus_metrics():
            """The Prometheus exposition; sync: the scrape runs the shard health checks."""
            body, content_type = metrics.exposition()
            return Response(body, media_type=content_type)

    return r
