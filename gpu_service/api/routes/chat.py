"""POST /v1/chat/completions: the messages through the checkpoint's chat format
(gpu_service.api.chat_request: tools, tool_choice, chat_template_kwargs), n choices, each parsed
as it streams (reasoning -> reasoning_content, tool calls -> tool_calls: gpu_service.api.parsers)."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request

from gpu_service.api import openai_params as OP
from gpu_service.api.chat_request import chat_plan
from gpu_service.api.errors import APIError
from gpu_service.api.parsers.stream import merge_deltas
from gpu_service.api.routes.context import ApiContext
from gpu_service.api.routes.request import field, include_usage
from gpu_service.api.routes.streaming import collect_all, stream_response, usage


def router(ctx: ApiContext) -> APIRouter:
    """The chat completions route over `ctx`."""
    r = APIRouter()

    @r.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """A chat completion, whole or streamed (`stream: true`)."""
        body = await ctx.body(request)
        if "messages" not in body:
            raise APIError(400, "'messages' is required", param="messages")
        plan = await asyncio.to_thread(chat_plan, body, ctx.tokenizer, ctx.chat_settings, ctx.max_chars,  # off the loop
                                       ctx.image_policy)
        stream = field(body, "stream", bool, False)
        with_usage = include_usage(body) if stream else False
        want_ids = field(body, "return_token_ids", bool, False)
        grammar = await ctx.grammar(body)
        if plan.grammar is not None and ctx.engine.grammars is not None:  # tool_choice required / named
            if grammar is not None:
                raise APIError(400, "tool_choice 'required' or a named function cannot be combined with "
                                    "response_format / structured outputs: drop one", param="tool_choice")
            grammar = await ctx.compile(plan.grammar, "tool_choice")
        hs = ctx.submit([plan.ids], body, True, grammar, images=plan.images)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        now = int(time.time())
        parsed = [plan.stream() for _ in hs]  # one parse per choice
        if stream:
            chunk = _chunk_fn(ctx, rid, now, parsed, want_ids)
            return stream_response(hs, chunk, with_usage, "chat.completion.chunk", rid, ctx.model_name, len(hs))
        results = await collect_all(request, hs)
        out = _completion(ctx, body, rid, now, hs, parsed, results, want_ids)
        if plan.metadata is not None:  # OpenAI's chat.completion object carries the request's metadata
            out["metadata"] = plan.metadata
        return out

    return r


def _finish_reason(parsed, i: int, finish):
    """OpenAI's `tool_calls` for a choice that stopped after calling tools, else the engine's reason."""
    return "tool_calls" if finish == "stop" and parsed[i].has_calls else finish


def _chunk_fn(ctx: ApiContext, rid: str, now: int, parsed: list, want_ids: bool):
    """The streamed chunks: the assistant role first, then each choice's parsed deltas."""
    def chunk(i, out, first=False):
        """Choice i's chunk for `out` (None: no chunk for it)."""
        if first:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": ctx.model_name,
                    "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}]}
        delta = parsed[i].feed(out.text) if out.text else None
        if out.finish_reason is not None:
            delta = merge_deltas(delta, parsed[i].finish())
        if delta is None and out.finish_reason is None and not out.logprobs and not want_ids:
            return None
        c = {"index": i, "delta": delta or {}, "logprobs": None,
             "finish_reason": _finish_reason(parsed, i, out.finish_reason)}
        if out.logprobs:
            c["logprobs"] = OP.chat_logprobs(out.logprobs, ctx.text_of)
        if want_ids:
            c["token_ids"] = out.token_ids
        return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": ctx.model_name,
                "choices": [c]}
    return chunk


def _completion(ctx: ApiContext, body: dict, rid: str, now: int, hs, parsed: list, results: list,
                want_ids: bool) -> dict:
    """The whole `chat.completion` object from each choice's collected (text, ids, logprobs, _)."""
    choices = []
    for i, (h, (text, out_ids, lps, _)) in enumerate(zip(hs, results)):
        parsed[i].feed(text)
        choice = {"index": i, "message": parsed[i].message(),
                  "logprobs": OP.chat_logprobs(lps, ctx.text_of) if body.get("logprobs") is True else None,
                  "finish_reason": _finish_reason(parsed, i, h.finish_reason)}
        if want_ids:
            choice["token_ids"] = out_ids
        choices.append(choice)
    return {"id": rid, "object": "chat.completion", "created": now, "model": ctx.model_name,
            "choices": choices, "usage": usage(hs, len(hs))}
