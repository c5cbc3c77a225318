"""Answering generation requests: wait for whole choices (`collect_all`, cancelling them when the
client goes away), or stream them as server-sent events ending in `data: [DONE]`
(`stream_response`); `usage` counts the tokens of all choices."""
from __future__ import annotations

import asyncio
import json
import time
import weakref
from typing import Callable

from fastapi import Request
from fastapi.responses import StreamingResponse

from gpu_service.api.errors import APIError, error_body

# chunk_fn(choice index, Output or None, first=False) -> a chunk dict, or None for no chunk
ChunkFn = Callable[..., "dict | None"]


def usage(hs, n: int = 1) -> dict:
    """Usage of all choices: each prompt counted once (its n choices share it)."""
    prompt = sum(h.prompt_tokens for h in hs[::n])
    done = sum(h.completion_tokens for h in hs)
    return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done,
            "prompt_tokens_details": {"cached_tokens": sum(h.cached_tokens for h in hs[::n])}}


async def collect(request: Request, h) -> tuple[str, list[int], list, list]:
    """Wait for the whole completion; cancel it if the client disconnects meanwhile.
    Returns (text, token ids, logprobs, prompt logprobs)."""
    parts: list[str] = []
    ids: list[int] = []
    lps: list = []
    plps: list = []

    async def consume():
        """Gather the handle's outputs as they come."""
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
        if h.error_param is not None:  # the request's own doing (e.g. a grammar too large to run): 400
            raise APIError(400, h.error or "the request cannot be served", param=h.error_param)
        raise APIError(500, h.error or "generation failed", "server_error")
    return "".join(parts), ids, lps, plps


async def collect_all(request: Request, hs) -> list:
    """`collect` of every choice, concurrently; the others are cancelled when one fails."""
    try:
        return await asyncio.gather(*(collect(request, h) for h in hs))
    finally:
        for h in hs:
            if not h.done:
                h.cancel()


async def _merged(hs):
    """(choice index, Output) as any choice produces them."""
    if len(hs) == 1:  # one choice: its own outputs, no pump task and queue hop per token
        async for out in hs[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i, h):
        """Forward choice i's outputs to the queue, then None."""
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


def _sse(chunk: dict, include_usage: bool) -> str:
    """One server-sent event; with include_usage every chunk but the last carries `"usage": null`."""
    if include_usage:
        chunk["usage"] = None
    return f"data: {json.dumps(chunk)}\n\n"


async def _events(hs, chunk_fn: ChunkFn, include_usage: bool, obj: str, rid: str, n: int, model_name: str):
    """The stream's events: each choice's first chunk, then chunks as outputs come, an error event when
    generation fails, the usage chunk when asked for, `[DONE]`; unfinished choices are cancelled at the end."""
    try:
        for i in range(len(hs)):
            first = chunk_fn(i, None, first=True)
            if first is not None:
                yield _sse(first, include_usage)
        async for i, out in _merged(hs):
            if out.finish_reason == "error":
                err = (error_body(out.error or "an expert shard is unavailable", "service_unavailable_error",
                                  code="expert_shard_unavailable") if out.unavailable
                       else error_body(out.error or "the request cannot be served", param=out.param)
                       if out.param is not None else error_body(out.error or "generation failed", "server_error"))
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
                                         "model": model_name, "choices": [], "usage": usage(hs, n)}) + "\n\n"
        yield "data: [DONE]\n\n"
    finally:
        for h in hs:
            if not h.done:
                h.cancel()  # the client went away (or the stream broke): free the KV pages


def stream_response(hs, chunk_fn: ChunkFn, include_usage: bool, obj: str, rid: str, model_name: str,
                    n: int = 1) -> StreamingResponse:
    """The choices `hs` as a text/event-stream of `obj` chunks made by `chunk_fn`."""
    gen = _events(hs, chunk_fn, include_usage, obj, rid, n, model_name)
    for h in hs:
        weakref.finalize(gen, h.cancel)  # a stream dropped before its first chunk never runs `finally`
    return StreamingResponse(gen, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
