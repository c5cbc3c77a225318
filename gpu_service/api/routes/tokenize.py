"""`POST /tokenize` and `POST /detokenize` at the server root, as vLLM serves them.

    /tokenize    {"prompt": str, "add_special_tokens": true}  or  {"messages": [...], "tools": [...],
                 "add_generation_prompt": true, "chat_template_kwargs": {...}}  -> {"tokens", "count", "max_model_len"}
    /detokenize  {"tokens": [int]}                                              -> {"prompt": str}

The API key applies; ids outside the vocabulary are 400; a prompt over --max-prompt-chars or more
ids than a request may hold is 413 before any work, and the work runs off the event loop.
"""
from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request

from gpu_service.api.chat_request import DEVELOPER_FAMILIES, normalize_messages, validate_tools
from gpu_service.api.errors import APIError
from gpu_service.api.routes.context import ApiContext


def router(ctx: ApiContext) -> APIRouter:
    """The two routes over `ctx`."""
    r = APIRouter()
    engine, tokenizer = ctx.engine, ctx.tokenizer

    def need_tokenizer(param: str):
        """400 naming `param` when the model has no tokenizer."""
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer (tokenizer.json or tiktoken.model)", param=param)

    def too_large(what: str, n: int, cap: int, flag: str):
        """413 naming the cap and its flag, when `n` passes it."""
        if n > cap:
            raise APIError(413, f"the {what} has {n}; /tokenize and /detokenize take at most {cap} ({flag})",
                           code="request_too_large")

    @r.post("/tokenize")
    async def tokenize(request: Request):
        """A prompt, or messages rendered by the chat format, as token ids."""
        body = await ctx.body(request)
        if ("prompt" in body) == ("messages" in body):
            raise APIError(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
        ids = await asyncio.to_thread(_encode_prompt if "prompt" in body else _encode_chat, body)  # off the loop
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_request_tokens}

    def _encode_prompt(body: dict) -> list[int]:
        need_tokenizer("prompt")
        if not isinstance(body["prompt"], str):
            raise APIError(400, "'prompt' must be a string", param="prompt")
        if ctx.max_chars is not None:
            too_large("prompt (characters)", len(body["prompt"]), ctx.max_chars, "--max-prompt-chars")
        special = body.get("add_special_tokens", True)
        if not isinstance(special, bool):
            raise APIError(400, "'add_special_tokens' must be a boolean", param="add_special_tokens")
        return tokenizer.encode(body["prompt"], add_bos=None if special else False)

    def _encode_chat(body: dict) -> list[int]:
        need_tokenizer("messages")
        fmt = tokenizer.chat_format
        msgs = normalize_messages(body["messages"], keep_developer=getattr(fmt, "family", None) in DEVELOPER_FAMILIES,
                                  vision=getattr(tokenizer, "vision_wrapper", None))
        if ctx.max_chars is not None:
            too_large("conversation (characters)", sum(len(m.get("content") or "") for m in msgs), ctx.max_chars,
                      "--max-prompt-chars")
        tools = validate_tools(body["tools"]) if body.get("tools") is not None else None
        gen = body.get("add_generation_prompt", True)
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(gen, bool):
            raise APIError(400, "'add_generation_prompt' must be a boolean", param="add_generation_prompt")
        if not isinstance(kwargs, dict):
            raise APIError(400, "'chat_template_kwargs' must be an object", param="chat_template_kwargs")
        try:
            return tokenizer.encode_chat(msgs, tools=tools, add_generation_prompt=gen, **kwargs)
        except (ValueError, TypeError) as e:
            raise APIError(400, f"chat template: {e}", param="messages") from None

    @r.post("/detokenize")
    async def detokenize(request: Request):
        """Token ids as text, special tokens included."""
        body = await ctx.body(request)
        need_tokenizer("tokens")
        ids = body.get("tokens")
        if not isinstance(ids, list):
            raise APIError(400, "'tokens' must be an array of token ids", param="tokens")
        too_large("token list (ids)", len(ids), engine.max_request_tokens, "the model's max_model_len, --kv-tokens")
        return {"prompt": await asyncio.to_thread(_decode, ids)}  # off the loop

    def _decode(ids: list) -> str:
        V = engine.cfg.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise APIError(400, "'tokens' must be an array of token ids", param="tokens")
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} out of range: ids must be in [0, {V})", param="tokens")
        return tokenizer.decode(ids, skip_special_tokens=False)

    return r
