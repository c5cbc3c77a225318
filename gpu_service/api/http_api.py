"""OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn).

    POST /v1/chat/completions   chat prompt through the checkpoint's chat format (gpu_service.api.chat_request:
                                tools, tool_choice, chat_template_kwargs); reasoning -> reasoning_content,
                                tool calls -> tool_calls (gpu_service.api.parsers)
    POST /v1/completions        text prompt, or token ids
    POST /tokenize, /detokenize prompt or messages -> token ids, and back (gpu_service.api.routes.tokenize)
    GET  /v1/models             the one served model
    GET  /health                readiness: 200 when the engine and every expert shard group serve, else 503
    GET  /live                  liveness: 200 while the engine's scheduler runs (shards not asked)
    GET  /metrics               Prometheus metrics (gpu_service.metrics), unauthenticated like /health

Every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`; the request
fields, extensions and limits before work are described in docs/serving.md.

The endpoints live in gpu_service.api.routes, one APIRouter per group; `create_app` adds the
error handlers, the guard middleware and the routers.
"""
from __future__ import annotations

import logging
import socket
import threading
import time

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpu_service.api.chat_request import ChatSettings
from gpu_service.api.errors import APIError, error_body
from gpu_service.api.guard import BodyTooLarge, Guard, ServerLimits
from gpu_service.api.routes import chat, completions, health, models, tokenize
from gpu_service.api.routes.context import ApiContext
from gpu_service.api.routes.health import HealthFn
from gpu_service.runtime.engine import Engine
from gpu_service.runtime.requests import RequestError

log = logging.getLogger("moesplit.http")


async def _error(request, e: Exception) -> JSONResponse:
    """Every error in OpenAI's shape: an endpoint's refusal (APIError, or the engine's RequestError:
    400), FastAPI's validation (400, not its 422 shape), Starlette's 404/405, a body over
    --max-body-bytes (413, connection closed), anything else 500 naming no internal detail."""
    if isinstance(e, RequestError):
        e = APIError(400, str(e), param=e.param, code=e.code)
    elif isinstance(e, RequestValidationError):
        e = APIError(400, f"invalid request: {e.errors()}")
    elif isinstance(e, StarletteHTTPException):
        e = APIError(e.status_code, str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error")
    elif isinstance(e, BodyTooLarge):
        e = APIError(413, str(e), code="request_too_large", headers={"Connection": "close"})
    elif not isinstance(e, APIError):
        log.exception("unhandled error")  # the detail stays in the log: clients learn nothing internal
        e = APIError(500, "internal error (the server log has the details)", "server_error")
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


def create_app(engine: Engine, tokenizer, model_name: str, api_key: str | None = None,
               health_fn: HealthFn | None = None, metrics=None, limits: ServerLimits | None = None,
               chat_settings: ChatSettings | None = None) -> FastAPI:
    """The HTTP API over `engine`; `metrics` (a GpuMetrics) is served at GET /metrics without the key."""
    chat_settings = chat_settings or ChatSettings()
    app = FastAPI(title="moesplit", docs_url=None, redoc_url=None)
    limits = limits or ServerLimits()
    ctx = ApiContext(engine, tokenizer, model_name, chat_settings, limits.prompt_chars_for(engine.max_request_tokens))
    if getattr(engine.runner, "images", None) is not None:  # a vision tower: image_url parts are served
        ctx.image_policy = limits.image_policy()
    for exc in (APIError, RequestError, RequestValidationError, StarletteHTTPException, BodyTooLarge, Exception):
        app.add_exception_handler(exc, _error)
    # auth + body cap: pure ASGI (a BaseHTTPMiddleware would hide client disconnects from `collect`)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)
    for r in (chat.router(ctx), completions.router(ctx), tokenize.router(ctx), models.router(ctx),
              health.router(engine, health_fn, metrics)):
        app.include_router(r)
    return app


# ---- uvicorn in a thread -------------------------------------------------------------------------
class HTTPServer:
    """uvicorn serving `app` from a background thread on a socket bound up front (port 0 works)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                 limits: ServerLimits | None = None):
        """Bind host:port now (OSError naming --port when taken); `limits`: the connection-level
        limits (deadlines, caps, room for the probes: gpu_service.api.connections)."""
        import uvicorn

        from gpu_service.api.connections import ConnectionTable, ProbeReserve, limited_protocol

        limits = limits or ServerLimits()
        self.connections = ConnectionTable(limits)

        fam = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(fam, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # accepted connections inherit it: asyncio's own TCP_NODELAY skips this pre-bound socket (proto 0), and
        # Nagle + delayed ACK would hold every response's body 40 ms behind its headers
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            self.sock.bind((host, port))
        except OSError as e:
            self.sock.close()
            raise OSError(f"cannot bind the HTTP API to {host}:{port}: {e}; pick another --port") from None
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(
            ProbeReserve(app, self.connections), log_level=log_level, timeout_graceful_shutdown=5, lifespan="off",
            http=limited_protocol(limits, self.connections), limit_concurrency=None,  # ours: per client, probes kept
            timeout_keep_alive=5))
        self.thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> "HTTPServer":
        """Serve from a daemon thread; return once uvicorn has started (RuntimeError after `timeout`)."""
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="moesplit-http", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.host}:{self.port}")
            time.sleep(0.02)
        return self

    @property
    def url(self) -> str:
        """http://host:port, the bound port."""
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit, wait up to `timeout` for its thread, close the socket."""
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()
