"""OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn).

    POST /v1/chat/completions   chat prompt through the checkpoint's chat template
    POST /v1/completions        text prompt, or token ids
    GET  /v1/models             the one served model
    GET  /health                200 when the engine and every expert shard serve, else 503
    GET  /live                  200 while the engine loop is alive (shards not checked), else 503
    GET  /metrics               Prometheus metrics (gpu_service.metrics), unauthenticated like /health

`stream: true` answers with server-sent events ending in `data: [DONE]`; `stream_options:
{"include_usage": true}` adds a last chunk with usage. Extensions: `top_k`, `ignore_eos`,
`return_token_ids` (each choice / chunk also carries the generated `token_ids`).
Every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, including
malformed JSON (400, not FastAPI's 422 shape) and a wrong API key (401). A client that goes away
cancels its request: the engine frees its KV pages at the next step boundary.
"""
from __future__ import annotations

import asyncio
import json
import logging
import socket
import threading
import time
import uuid
import weakref
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from gpu_service.runtime.engine import Engine, EngineStopped, RequestError
from gpu_service.runtime.sampling import SamplingParams

log = logging.getLogger("moesplit.http")

HealthFn = Callable[[], "tuple[bool, dict]"]


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status)


# ---- request parsing ---------------------------------------------------------------------------
def _get(body: dict, key: str, types, default=None, *, name: str | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(400, f"'{key}' must be {_type_names(types)}, got {v!r}", param=name or key)
    if not isinstance(v, types):
        raise APIError(400, f"'{key}' must be {_type_names(types)}, got {v!r}", param=name or key)
    return v


def _type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "an array", dict: "an object"}.get(t, t.__name__) for t in types)


def _sampling(body: dict) -> tuple[SamplingParams, list[str], bool]:
    n = _get(body, "n", int, 1)
    if n != 1:
        raise APIError(400, f"only n=1 is supported, got n={n}", param="n")
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = _get(body, "top_k", int, 0)
    if top_k < 0:  # OpenAI-style clients send -1 for "off"
        top_k = 0
    seed = _get(body, "seed", int, None)
    try:
        params = SamplingParams(temperature, top_p, top_k, seed)
    except ValueError as e:
        raise APIError(400, str(e), param=next((k for k in ("temperature", "top_p", "top_k", "seed") if k in str(e)),
                                               None)) from None
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        raise APIError(400, "'stop' must be a string or an array of strings", param="stop")
    stop = [s for s in stop if s]
    if len(stop) > 16:
        raise APIError(400, "at most 16 stop strings", param="stop")
    ignore_eos = _get(body, "ignore_eos", bool, False)
    return params, stop, ignore_eos


def _max_tokens(body: dict) -> int | None:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = _get(body, key, int, None)
    if v is not None and v < 1:
        raise APIError(400, f"'{key}' must be >= 1, got {v}", param=key)
    return v


def _message_text(m: dict, i: int) -> str:
    content = m.get("content")
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
        parts = []
        for p in content:
            if not (isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)):
                raise APIError(400, f"messages[{i}].content: only text parts are supported", param="messages")
            parts.append(p["text"])
        return "".join(parts)
    raise APIError(400, f"messages[{i}].content must be a string or an array of text parts", param="messages")


def chat_prompt_ids(tokenizer, messages) -> list[int]:
    """Chat messages -> prompt ids through the chat template; APIError on a malformed list."""
    if tokenizer is None:
        raise APIError(400, "this model has no tokenizer.json; use /v1/completions with token ids", param="messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array of {role, content} objects", param="messages")
    msgs = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role' and 'content'", param="messages")
        if m["role"] not in ("system", "user", "assistant", "developer", "tool"):
            raise APIError(400, f"messages[{i}].role {m['role']!r} is not one of system, user, assistant",
                           param="messages")
        msgs.append({"role": "system" if m["role"] == "developer" else m["role"], "content": _message_text(m, i)})
    try:
        return tokenizer.encode_chat(msgs)
    except ValueError as e:  # TokenizerError: no template, or the template refused the messages
        raise APIError(400, f"chat template: {e}", param="messages") from None


def completion_prompt_ids(tokenizer, prompt) -> list[int]:
    """A completions `prompt`: a string, token ids, or a one-element list of either."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json; send the prompt as token ids", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if isinstance(prompt, list) and len(prompt) > 1:
        raise APIError(400, "batched prompts are not supported: send one prompt per request", param="prompt")
    raise APIError(400, "'prompt' must be a non-empty string or an array of token ids", param="prompt")


# ---- the app -----------------------------------------------------------------------------------
def create_app(engine: Engine, tokenizer, model_name: str, api_key: str | None = None,
               health_fn: HealthFn | None = None, metrics=None) -> FastAPI:
    """`metrics`: a gpu_service.metrics.GpuMetrics served at GET /metrics (no API key, like /health)."""
    app = FastAPI(title="moesplit", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(APIError)
    async def _api_error(request, e: APIError):
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, e: RequestValidationError):
        return _error_response(APIError(400, f"invalid request: {e.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, e: StarletteHTTPException):
        type_ = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return _error_response(APIError(e.status_code, str(e.detail), type_))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(e).__name__}: {e}", "server_error"))

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if api_key is not None and request.url.path.startswith("/v1"):
            auth = request.headers.get("authorization", "")
            if auth != f"Bearer {api_key}":
                return _error_response(APIError(
                    401, "Incorrect API key provided: send 'Authorization: Bearer <key>' with the server's --api-key",
                    code="invalid_api_key"))
        return await call_next(request)

    async def _body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return body

    def _submit(ids: list[int], body: dict):
        params, stop, ignore_eos = _sampling(body)
        max_tokens = _max_tokens(body)
        try:
            return engine.submit(ids, params, max_tokens, stop=stop, ignore_eos=ignore_eos)
        except RequestError as e:
            param = e.param if e.param != "messages" or "messages" in body else "prompt"
            raise APIError(400, str(e), param=param, code=e.code) from None
        except EngineStopped as e:
            raise APIError(503, str(e), "server_error") from None

    def _usage(h) -> dict:
        return {"prompt_tokens": h.prompt_tokens, "completion_tokens": h.completion_tokens,
                "total_tokens": h.prompt_tokens + h.completion_tokens}

    async def _collect(request: Request, h) -> tuple[str, list[int]]:
        """Wait for the whole completion; cancel it if the client disconnects meanwhile."""
        parts: list[str] = []
        ids: list[int] = []

        async def consume():
            async for out in h:
                parts.append(out.text)
                ids.extend(out.token_ids)

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.5)
                if not task.done() and await request.is_disconnected():
                    h.cancel()
            await task
        finally:
            if not h.done:
                h.cancel()
        if h.finish_reason == "error":
            if h.unavailable:  # an expert shard has no replica left: retry later
                raise APIError(503, h.error or "an expert shard is unavailable", "service_unavailable_error",
                               code="expert_shard_unavailable")
            raise APIError(500, h.error or "generation failed", "server_error")
        return "".join(parts), ids

    def _stream(h, chunk_fn, include_usage: bool, obj: str, rid: str):
        async def events():
            try:
                first = chunk_fn(None, None, None, first=True)
                if first is not None:
                    yield _sse(first, include_usage)
                async for out in h:
                    if out.finish_reason == "error":
                        err = (error_body(out.error or "an expert shard is unavailable", "service_unavailable_error",
                                          code="expert_shard_unavailable") if out.unavailable
                               else error_body(out.error or "generation failed", "server_error"))
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    if out.finish_reason == "cancelled":
                        break
                    if out.text or out.finish_reason or out.token_ids:
                        yield _sse(chunk_fn(out.text, out.finish_reason, out.token_ids), include_usage)
                if include_usage and h.finish_reason in ("stop", "length"):
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                                 "model": model_name, "choices": [], "usage": _usage(h)}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                if not h.done:
                    h.cancel()  # the client went away (or the stream broke): free the KV pages

        gen = events()
        weakref.finalize(gen, h.cancel)  # a stream dropped before its first chunk never runs `finally`
        return StreamingResponse(gen, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    def _sse(chunk: dict, include_usage: bool) -> str:
        if include_usage:
            chunk["usage"] = None
        return f"data: {json.dumps(chunk)}\n\n"

    def _include_usage(body: dict) -> bool:
        so = body.get("stream_options")
        if so is None:
            return False
        if not isinstance(so, dict):
            raise APIError(400, "'stream_options' must be an object", param="stream_options")
        return bool(so.get("include_usage", False))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _body(request)
        if "messages" not in body:
            raise APIError(400, "'messages' is required", param="messages")
        ids = chat_prompt_ids(tokenizer, body["messages"])
        stream = _get(body, "stream", bool, False)
        include_usage = _include_usage(body) if stream else False
        want_ids = _get(body, "return_token_ids", bool, False)
        h = _submit(ids, body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if stream:
            def chunk(text, finish, ids, first=False):
                delta = {"role": "assistant", "content": ""} if first else ({"content": text} if text else {})
                c = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
                if want_ids and not first:
                    c["token_ids"] = ids
                return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                        "choices": [c]}
            return _stream(h, chunk, include_usage, "chat.completion.chunk", rid)
        text, out_ids = await _collect(request, h)
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": h.finish_reason}
        if want_ids:
            choice["token_ids"] = out_ids
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": [choice], "usage": _usage(h)}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", param="prompt")
        ids = completion_prompt_ids(tokenizer, body["prompt"])
        stream = _get(body, "stream", bool, False)
        include_usage = _include_usage(body) if stream else False
        want_ids = _get(body, "return_token_ids", bool, False)
        h = _submit(ids, body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        if stream:
            def chunk(text, finish, ids, first=False):
                if first:
                    return None
                c = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
                if want_ids:
                    c["token_ids"] = ids
                return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                        "choices": [c]}
            return _stream(h, chunk, include_usage, "text_completion", rid)
        text, out_ids = await _collect(request, h)
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": h.finish_reason}
        if want_ids:
            choice["token_ids"] = out_ids
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                "choices": [choice], "usage": _usage(h)}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "moesplit",
            "max_model_len": engine.max_request_tokens}]}

    @app.get("/health")
    def health():  # sync: runs in the thread pool (the shard checks block)
        ok, detail = engine.alive, {"engine": "serving" if engine.alive else "stopped"}
        if health_fn is not None:
            shards_ok, shards = health_fn()
            ok = ok and shards_ok
            detail["shards"] = shards
        detail["status"] = "ok" if ok else "unavailable"
        detail.update({k: v for k, v in engine.stats().items() if k in ("running", "waiting", "pool_usage")})
        return JSONResponse(detail, status_code=200 if ok else 503)

    @app.get("/live")
    async def live():  # liveness: the engine loop only; a shard outage is /health's (readiness) business
        return JSONResponse({"engine": "serving" if engine.alive else "stopped"},
                            status_code=200 if engine.alive else 503)

    if metrics is not None:
        @app.get("/metrics")
        def prometheus_metrics():  # sync: the scrape runs the shard health checks
            body, content_type = metrics.exposition()
            return Response(body, media_type=content_type)

    return app


# ---- uvicorn in a thread -------------------------------------------------------------------------
class HTTPServer:
    """uvicorn serving `app` from a background thread on a socket bound up front (port 0 works)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning"):
        import uvicorn

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
        self.server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5,
                                                    lifespan="off"))
        self.thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> "HTTPServer":
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
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        if self.thread is not None:
            self.thread.join(timeout)
        self.sock.close()
