"""OpenAI-compatible HTTP API over the engine (FastAPI + uvicorn).

    POST /v1/chat/completions   chat prompt through the checkpoint's chat format (gpu_service.api.chat_request:
                                tools, tool_choice, chat_template_kwargs); reasoning -> reasoning_content,
                                tool calls -> tool_calls (gpu_service.api.parsers)
    POST /v1/completions        text prompt, or token ids
    POST /tokenize, /detokenize prompt or messages -> token ids, and back (gpu_service.api.tokenize_api)
    GET  /v1/models             the one served model
    GET  /health                readiness: 200 when the engine and every expert shard group serve, else 503
    GET  /live                  liveness: 200 while the engine's scheduler runs (shards not asked)
    GET  /metrics               Prometheus metrics (gpu_service.metrics), unauthenticated like /health

`stream: true` answers with server-sent events ending in `data: [DONE]`; `stream_options:
{"include_usage": true}` adds a last chunk with usage. Extensions: `top_k`, `ignore_eos`,
`return_token_ids` (each choice / chunk also carries the generated `token_ids`), vLLM's
`min_tokens`, `stop_token_ids`, `repetition_penalty`, `structured_outputs` / `guided_*`.
Structured outputs (`response_format`, gpu_service.api.openai_params), logprobs (chat
`logprobs`/`top_logprobs`, completions `logprobs` + `echo`), `n` choices (choice i seeded with
seed + i), penalties and `logit_bias` are implemented; any other field is refused with 400 naming it.
`cache_salt` (vLLM's: prefixes are shared only between requests of the same salt); usage reports
`prompt_tokens_details.cached_tokens` (prompt tokens served by the prefix cache), as OpenAI does.
Every error has OpenAI's shape `{"error": {"message", "type", "param", "code"}}`, including
malformed JSON (400, not FastAPI's 422 shape) and a wrong API key (401). A client that goes away
cancels its request: the engine frees its KV pages at the next step boundary.

Limits before work (gpu_service.api.guard): a body over --max-body-bytes is 413 before it is read,
a prompt over --max-prompt-chars is 400 before it is tokenized (tokenizing runs off the event
loop), a full waiting queue is 429 with Retry-After, malformed JSON (too deep, integers too long)
is 400; a 500 names no internal detail (the server log has it).
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

from gpu_service.api.chat_request import ChatSettings, chat_plan
from gpu_service.api.errors import APIError, error_body
from gpu_service.api.parsers.stream import merge_deltas
from gpu_service.api import openai_params as OP
from gpu_service.api import tokenize_api
from gpu_service.api.errors import check_prompt_chars as _check_chars
from gpu_service.api.guard import BodyTooLarge, Guard, ServerLimits
from gpu_service.runtime.engine import Engine, EngineStopped, QueueFull, RequestError
from gpu_service.runtime.grammar import GrammarError, InvalidSchema
from gpu_service.runtime.sampling import SamplingParams

log = logging.getLogger("moesplit.http")

HealthFn = Callable[[], "tuple[bool, dict]"]


def _error_response(e: APIError) -> JSONResponse:
    return JSONResponse(error_body(e.message, e.type, e.param, e.code), status_code=e.status, headers=e.headers)


# ---- request parsing ---------------------------------------------------------------------------
def _get(body: dict, key: str, types, default=None, *, name: str | None = None):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise APIError(400, f"'{key}' must be {_type_names(types)}, got {v!r}", param=name or key)
    if not isinstance(v, types):
        raise APIError(400, f"'{key}' must be {_type_names(types)}, got {_short(v)}", param=name or key)
    if isinstance(v, int) and not isinstance(v, bool) and not -2**63 <= v < 2**63:
        raise APIError(400, f"'{key}' must fit in 64 bits, got a {len(str(abs(v)))}-digit integer", param=name or key)
    return v


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _type_names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "an array", dict: "an object"}.get(t, t.__name__) for t in types)


def _sampling(body: dict, vocab_size: int = 1 << 31, chat: bool = True) -> tuple[SamplingParams, list[str], bool]:
    temperature = float(_get(body, "temperature", (int, float), 1.0))
    top_p = float(_get(body, "top_p", (int, float), 1.0))
    top_k = _get(body, "top_k", int, 0)
    if top_k < 0:  # OpenAI-style clients send -1 for "off"
        top_k = 0
    seed = _get(body, "seed", int, None)
    try:
        extra = OP.sampling_fields(body, vocab_size)
        params = SamplingParams(temperature, top_p, top_k, seed, logprobs=OP.logprobs_k(body, chat), **extra)
    except OP.ParamError as e:
        raise APIError(400, str(e), param=e.param) from None
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
    if len(stop) > Engine.MAX_STOP:
        raise APIError(400, f"at most {Engine.MAX_STOP} stop strings", param="stop")
    ignore_eos = _get(body, "ignore_eos", bool, False)
    return params, stop, ignore_eos


def _max_tokens(body: dict, least: int = 1) -> int | None:
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = _get(body, key, int, None)
    if v is not None and v < least:
        raise APIError(400, f"'{key}' must be >= 1, got {v}", param=key)
    return v


def completion_prompts(tokenizer, prompt, max_chars: int | None = None) -> list[list[int]]:
    """A completions `prompt`: a string, token ids, or an array of either (a batch: one choice each)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 64:
            raise APIError(400, f"at most 64 prompts in one request, got {len(prompt)}", param="prompt")
        if max_chars is not None:
            _check_chars(sum(len(p) for p in prompt if isinstance(p, str)), max_chars, "prompt")
        return [completion_prompt_ids(tokenizer, p, max_chars) for p in prompt]
    return [completion_prompt_ids(tokenizer, prompt, max_chars)]


def completion_prompt_ids(tokenizer, prompt, max_chars: int | None = None) -> list[int]:
    """One completions prompt: a string or token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json; send the prompt as token ids", param="prompt")
        _check_chars(len(prompt), max_chars, "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise APIError(400, "'prompt' must be a non-empty string or an array of token ids", param="prompt")


# ---- the app -----------------------------------------------------------------------------------
def create_app(engine: Engine, tokenizer, model_name: str, api_key: str | None = None,
               health_fn: HealthFn | None = None, metrics=None, limits: ServerLimits | None = None,
               chat_settings: ChatSettings | None = None) -> FastAPI:
    """`metrics`: a gpu_service.metrics.GpuMetrics served at GET /metrics (no API key, like /health);
    `limits`: body / prompt sizes (gpu_service.api.guard.ServerLimits; default: its defaults);
    `chat_settings`: the tool-call / reasoning parser choice (default: auto, by model)."""
    chat_settings = chat_settings or ChatSettings()
    app = FastAPI(title="moesplit", docs_url=None, redoc_url=None)
    created = int(time.time())
    limits = limits or ServerLimits()
    max_chars = limits.prompt_chars_for(engine.max_request_tokens)

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

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request, e: BodyTooLarge):
        return _error_response(APIError(413, str(e), code="request_too_large", headers={"Connection": "close"}))

    @app.exception_handler(Exception)
    async def _internal(request, e: Exception):
        log.exception("unhandled error")  # the detail stays in the log: clients learn nothing internal
        return _error_response(APIError(500, "internal error (the server log has the details)", "server_error"))

    # auth + body cap: pure ASGI (a BaseHTTPMiddleware would hide client disconnects from _collect)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=limits.max_body_bytes)

    async def _body(request: Request) -> dict:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
        except ValueError:  # e.g. an integer literal past Python's 4300-digit limit
            raise APIError(400, "the request body has a number too long to parse", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{model_name}'",
                           param="model", code="model_not_found")
        return body

    text_of = OP.TokenText(tokenizer, engine.grammars.vocab if engine.grammars is not None else None)

    async def _grammar(body: dict):
        """The request's compiled grammar (compiled off the event loop and the scheduler), or None."""
        try:
            spec, key = OP.grammar_spec(body)
        except OP.ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        return None if spec is None else await _compile(spec, key)

    async def _compile(spec, key: str):
        if engine.grammars is None:
            raise APIError(400, f"{key} needs grammar-constrained decoding, and the grammar engine does not know "
                                "this tokenizer's vocabulary", param=key)
        try:
            return await asyncio.wrap_future(engine.grammars.compile(spec))
        except InvalidSchema as e:
            raise APIError(400, f"{key}: {e}", param=key, code="invalid_schema") from None
        except GrammarError as e:
            raise APIError(400, f"{key}: the grammar engine cannot compile this: {e}", param=key,
                           code="invalid_grammar") from None

    def _submit(prompts: list[list[int]], body: dict, chat: bool, grammar=None, prompt_lp=None):
        """One handle per choice: prompt p's choice i is handle p * n + i, seeded with seed + i."""
        try:
            OP.check_fields(body, OP.CHAT_FIELDS if chat else OP.COMPLETION_FIELDS,
                            "/v1/chat/completions" if chat else "/v1/completions")
            n = OP.choices_n(body)
        except OP.ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        params, stop, ignore_eos = _sampling(body, engine.cfg.vocab_size, chat)
        max_tokens = _max_tokens(body, 0 if prompt_lp is not None else 1)
        hs = []
        try:
            for ids in prompts:
                ps = [params if params.seed is None else OP.with_seed(params, params.seed + i) for i in range(n)]
                hs += engine.submit_n(ids, ps, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos,
                                      grammar=grammar, prompt_logprobs=prompt_lp,
                                      cache_salt=_get(body, "cache_salt", str))
        except QueueFull as e:
            for h in hs:
                h.cancel()
            raise APIError(429, str(e), "rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(e.retry_after_s)}) from None
        except RequestError as e:
            for h in hs:
                h.cancel()
            param = e.param if e.param != "messages" or "messages" in body else "prompt"
            raise APIError(400, str(e), param=param, code=e.code) from None
        except EngineStopped as e:
            for h in hs:
                h.cancel()
            raise APIError(503, str(e), "server_error") from None
        return hs

    def _usage(hs, n: int = 1) -> dict:
        """Usage of all choices: each prompt counted once (its n choices share it)."""
        prompt = sum(h.prompt_tokens for h in hs[::n])
        done = sum(h.completion_tokens for h in hs)
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
                "prompt_tokens_details": {"cached_tokens": sum(h.cached_tokens for h in hs[::n])}}

    async def _collect(request: Request, h) -> tuple[str, list[int], list, list]:
        """Wait for the whole completion; cancel it if the client disconnects meanwhile.
        Returns (text, token ids, logprobs, prompt logprobs)."""
        parts: list[str] = []
        ids: list[int] = []
        lps: list = []
        plps: list = []

        async def consume():
            async for out in h:
                parts.append(out.text)
                ids.extend(out.token_ids)
                lps.extend(out.logprobs or [])
                plps.extend(out.prompt_logprobs or [])

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
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
        return "".join(parts), ids, lps, plps

    async def _collect_all(request: Request, hs) -> list:
        try:
            return await asyncio.gather(*(_collect(request, h) for h in hs))
        finally:
            for h in hs:
                if not h.done:
                    h.cancel()

    def _stream(hs, chunk_fn, include_usage: bool, obj: str, rid: str, n: int = 1):
        async def merged():  # (choice index, Output) as any choice produces them
            if len(hs) == 1:  # one choice: its own outputs, no pump task and queue hop per token
                async for out in hs[0]:
                    yield 0, out
                return
            q: asyncio.Queue = asyncio.Queue()

            async def pump(i, h):
                try:
                    async for out in h:
                        await q.put((i, out))
                finally:
                    await q.put((i, None))

            tasks = [asyncio.ensure_future(pump(i, h)) for i, h in enumerate(hs)]
            try:
                left = len(hs)
                while left:
                    i, out = await q.get()
                    if out is None:
                        left -= 1
                    else:
                        yield i, out
            finally:
                for t in tasks:
                    t.cancel()

        async def events():
            try:
                for i in range(len(hs)):
                    first = chunk_fn(i, None, first=True)
                    if first is not None:
                        yield _sse(first, include_usage)
                async for i, out in merged():
                    if out.finish_reason == "error":
                        err = (error_body(out.error or "an expert shard is unavailable", "service_unavailable_error",
                                          code="expert_shard_unavailable") if out.unavailable
                               else error_body(out.error or "generation failed", "server_error"))
                        yield f"data: {json.dumps(err)}\n\n"
                        break
                    if out.finish_reason == "cancelled":
                        break
                    if out.text or out.finish_reason or out.token_ids or out.prompt_logprobs:
                        c = chunk_fn(i, out)
                        if c is not None:
                            yield _sse(c, include_usage)
                if include_usage and all(h.finish_reason in ("stop", "length") for h in hs):
                    yield "data: " + json.dumps({"id": rid, "object": obj, "created": int(time.time()),
                                                 "model": model_name, "choices": [], "usage": _usage(hs, n)}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                for h in hs:
                    if not h.done:
                        h.cancel()  # the client went away (or the stream broke): free the KV pages

        gen = events()
        for h in hs:
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
        plan = await asyncio.to_thread(chat_plan, body, tokenizer, chat_settings, max_chars)  # off the loop
        stream = _get(body, "stream", bool, False)
        include_usage = _include_usage(body) if stream else False
        want_ids = _get(body, "return_token_ids", bool, False)
        grammar = await _grammar(body)
        if plan.grammar is not None and engine.grammars is not None:  # tool_choice required / named
            if grammar is not None:
                raise APIError(400, "tool_choice 'required' or a named function cannot be combined with "
                                    "response_format / structured outputs: drop one", param="tool_choice")
            grammar = await _compile(plan.grammar, "tool_choice")
        hs = _submit([plan.ids], body, True, grammar)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        parsed = [plan.stream() for _ in hs]  # one parse per choice

        def finish_reason(i, finish):
            return "tool_calls" if finish == "stop" and parsed[i].has_calls else finish

        if stream:
            def chunk(i, out, first=False):
                if first:
                    return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                         "logprobs": None, "finish_reason": None}]}
                delta = parsed[i].feed(out.text) if out.text else None
                if out.finish_reason is not None:
                    delta = merge_deltas(delta, parsed[i].finish())
                if delta is None and out.finish_reason is None and not out.logprobs and not want_ids:
                    return None
                c = {"index": i, "delta": delta or {}, "logprobs": None,
                     "finish_reason": finish_reason(i, out.finish_reason)}
                if out.logprobs:
                    c["logprobs"] = OP.chat_logprobs(out.logprobs, text_of)
                if want_ids:
                    c["token_ids"] = out.token_ids
                return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                        "choices": [c]}
            return _stream(hs, chunk, include_usage, "chat.completion.chunk", rid, len(hs))
        choices = []
        for i, (h, (text, out_ids, lps, _)) in enumerate(zip(hs, await _collect_all(request, hs))):
            parsed[i].feed(text)
            choice = {"index": i, "message": parsed[i].message(),
                      "logprobs": OP.chat_logprobs(lps, text_of) if body.get("logprobs") is True else None,
                      "finish_reason": finish_reason(i, h.finish_reason)}
            if want_ids:
                choice["token_ids"] = out_ids
            choices.append(choice)
        return {"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                "choices": choices, "usage": _usage(hs, len(hs))}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", param="prompt")
        prompts = await asyncio.to_thread(completion_prompts, tokenizer, body["prompt"], max_chars)  # off the loop
        stream = _get(body, "stream", bool, False)
        include_usage = _include_usage(body) if stream else False
        want_ids = _get(body, "return_token_ids", bool, False)
        echo = _get(body, "echo", bool, False)
        if body.get("suffix") is not None:
            raise APIError(400, "'suffix' (insertion) is not supported", param="suffix")
        try:
            k = OP.logprobs_k(body, False)
        except OP.ParamError as e:
            raise APIError(400, str(e), param=e.param) from None
        grammar = await _grammar(body)
        hs = _submit(prompts, body, False, grammar, prompt_lp=k if echo and k is not None else None)
        n = len(hs) // len(prompts)
        rid = f"cmpl-{uuid.uuid4().hex}"
        now = int(time.time())

        def prompt_text(i):
            return tokenizer.decode(prompts[i // n]) if tokenizer is not None else ""

        if stream:
            offsets = [0] * len(hs)  # text_offset of each choice's next token

            def chunk(i, out, first=False):
                if first:  # echo: the prompt's text first (its logprobs come with the first tokens)
                    if not echo:
                        return None
                    c = {"index": i, "text": prompt_text(i), "logprobs": None, "finish_reason": None}
                    return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                            "choices": [c]}
                c = {"index": i, "text": out.text or "", "logprobs": None, "finish_reason": out.finish_reason}
                if k is not None:
                    head = out.prompt_logprobs is not None  # echo: the prompt's tokens, the first without a logprob
                    c["logprobs"] = OP.completion_logprobs((out.prompt_logprobs or []) + (out.logprobs or []),
                                                           text_of, offsets[i], prompts[i // n][0] if head else None)
                    offsets[i] += sum(len(t) for t in c["logprobs"]["tokens"])
                if want_ids:
                    c["token_ids"] = out.token_ids
                return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                        "choices": [c]}
            return _stream(hs, chunk, include_usage, "text_completion", rid, n)
        choices = []
        for i, (h, (text, out_ids, lps, plps)) in enumerate(zip(hs, await _collect_all(request, hs))):
            head = prompt_text(i) if echo else ""
            logprobs = None
            if k is not None:
                logprobs = (OP.completion_logprobs(plps + lps, text_of, 0, prompts[i // n][0]) if echo
                            else OP.completion_logprobs(lps, text_of))
            choice = {"index": i, "text": head + text, "logprobs": logprobs, "finish_reason": h.finish_reason}
            if want_ids:
                choice["token_ids"] = out_ids
            choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                "choices": choices, "usage": _usage(hs, n)}

    tokenize_api.add_routes(app, engine, tokenizer, _body)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": model_name, "object": "model", "created": created, "owned_by": "moesplit",
            "max_model_len": engine.max_request_tokens}]}

    @app.get("/live")
    async def live():  # liveness: the engine alone (a shard outage must not restart this pod)
        ok = engine.alive
        return JSONResponse({"status": "ok" if ok else "stopped"}, status_code=200 if ok else 503)

    @app.get("/health")
    def health():  # sync: runs in the thread pool (the shard checks may block on a first call)
        ok, detail = engine.alive, {"engine": "serving" if engine.alive else "stopped"}
        if health_fn is not None:
            shards_ok, shards = health_fn()
            ok = ok and shards_ok
            detail["shards"] = shards
        detail["status"] = "ok" if ok else "unavailable"
        detail.update({k: v for k, v in engine.stats().items() if k in ("running", "waiting", "pool_usage")})
        return JSONResponse(detail, status_code=200 if ok else 503)

    if metrics is not None:
        @app.get("/metrics")
        def prometheus_metrics():  # sync: the scrape runs the shard health checks
            body, content_type = metrics.exposition()
            return Response(body, media_type=content_type)

    return app


# ---- uvicorn in a thread -------------------------------------------------------------------------
class HTTPServer:
    """uvicorn serving `app` from a background thread on a socket bound up front (port 0 works)."""

    def __init__(self, app, host: str = "127.0.0.1", port: int = 8000, log_level: str = "warning",
                 limits: ServerLimits | None = None):
        import uvicorn

        from gpu_service.api.guard import header_timeout_protocol

        limits = limits or ServerLimits()

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
            app, log_level=log_level, timeout_graceful_shutdown=5, lifespan="off",
            http=header_timeout_protocol(limits.header_timeout_s), limit_concurrency=limits.limit_concurrency,
            timeout_keep_alive=5))
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
