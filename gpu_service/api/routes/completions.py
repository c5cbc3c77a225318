"""POST /v1/completions: a text prompt, token ids, or a batch of either (one set of n choices per
prompt); `echo` (the prompt's text first, with its logprobs when `logprobs` is given)."""
from __future__ import annotations

import asyncio
import time
import uuid

from fastapi import APIRouter, Request

from gpu_service.api import openai_params as OP
from gpu_service.api.errors import APIError, check_prompt_chars
from gpu_service.api.routes.context import ApiContext
from gpu_service.api.routes.request import field, include_usage
from gpu_service.api.routes.streaming import collect_all, stream_response, usage


def completion_prompts(tokenizer, prompt, max_chars: int | None = None) -> list[list[int]]:
    """A completions `prompt`: a string, token ids, or an array of either (a batch: one choice each)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > 64:
            raise APIError(400, f"at most 64 prompts in one request, got {len(prompt)}", param="prompt")
        if max_chars is not None:
            check_prompt_chars(sum(len(p) for p in prompt if isinstance(p, str)), max_chars, "prompt")
        return [completion_prompt_ids(tokenizer, p, max_chars) for p in prompt]
    return [completion_prompt_ids(tokenizer, prompt, max_chars)]


def completion_prompt_ids(tokenizer, prompt, max_chars: int | None = None) -> list[int]:
    """One completions prompt: a string or token ids."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise APIError(400, "this model has no tokenizer.json; send the prompt as token ids", param="prompt")
        check_prompt_chars(len(prompt), max_chars, "prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise APIError(400, "'prompt' must be a non-empty string or an array of token ids", param="prompt")


class _Answer:
    """What a completion's chunks and whole answer are made from: the id, creation time, prompts and
    the choices per prompt, the logprobs count `k` (None: none), `echo`, `want_ids`."""

    def __init__(self, ctx: ApiContext, prompts: list[list[int]], n: int, k: int | None, echo: bool,
                 want_ids: bool):
        """A fresh completion id and creation time for these choices."""
        self.ctx, self.prompts, self.n, self.k, self.echo, self.want_ids = ctx, prompts, n, k, echo, want_ids
        self.rid = f"cmpl-{uuid.uuid4().hex}"
        self.now = int(time.time())

    def prompt_text(self, i: int) -> str:
        """Choice i's prompt as text ('' without a tokenizer)."""
        tokenizer = self.ctx.tokenizer
        return tokenizer.decode(self.prompts[i // self.n]) if tokenizer is not None else ""

    def wrap(self, c: dict) -> dict:
        """One choice's streamed chunk."""
        return {"id": self.rid, "object": "text_completion", "created": self.now, "model": self.ctx.model_name,
                "choices": [c]}

    def chunk_fn(self, n_choices: int):
        """The streamed chunks: with echo the prompt's text first (its logprobs come with the first
        tokens), then each choice's text, logprobs with running text offsets."""
        offsets = [0] * n_choices  # text_offset of each choice's next token

        def chunk(i, out, first=False):
            """Choice i's chunk for `out` (None: no chunk for it)."""
            if first:
                if not self.echo:
                    return None
                return self.wrap({"index": i, "text": self.prompt_text(i), "logprobs": None, "finish_reason": None})
            c = {"index": i, "text": out.text or "", "logprobs": None, "finish_reason": out.finish_reason}
            if self.k is not None:
                head = out.prompt_logprobs is not None  # echo: the prompt's tokens, the first without a logprob
                c["logprobs"] = OP.completion_logprobs((out.prompt_logprobs or []) + (out.logprobs or []),
                                                       self.ctx.text_of, offsets[i],
                                                       self.prompts[i // self.n][0] if head else None)
                offsets[i] += sum(len(t) for t in c["logprobs"]["tokens"])
            if self.want_ids:
                c["token_ids"] = out.token_ids
            return self.wrap(c)
        return chunk

    def whole(self, hs, results: list) -> dict:
        """The whole `text_completion` object from each choice's collected (text, ids, logprobs, prompt logprobs)."""
        text_of = self.ctx.text_of
        choices = []
        for i, (h, (text, out_ids, lps, plps)) in enumerate(zip(hs, results)):
            head = self.prompt_text(i) if self.echo else ""
            logprobs = None
            if self.k is not None:
                logprobs = (OP.completion_logprobs(plps + lps, text_of, 0, self.prompts[i // self.n][0]) if self.echo
                            else OP.completion_logprobs(lps, text_of))
            choice = {"index": i, "text": head + text, "logprobs": logprobs, "finish_reason": h.finish_reason}
            if self.want_ids:
                choice["token_ids"] = out_ids
            choices.append(choice)
        return {"id": self.rid, "object": "text_completion", "created": self.now, "model": self.ctx.model_name,
                "choices": choices, "usage": usage(hs, self.n)}


def router(ctx: ApiContext) -> APIRouter:
    """The completions route over `ctx`."""
    r = APIRouter()

    @r.post("/v1/completions")
    async def completions(request: Request):
        """A text completion, whole or streamed (`stream: true`)."""
        body = await ctx.body(request)
        if "prompt" not in body:
            raise APIError(400, "'prompt' is required", param="prompt")
        prompts = await asyncio.to_thread(completion_prompts, ctx.tokenizer, body["prompt"],
                                          ctx.max_chars)  # off the loop
        stream = field(body, "stream", bool, False)
        with_usage = include_usage(body) if stream else False
        want_ids = field(body, "return_token_ids", bool, False)
        echo = field(body, "echo", bool, False)
        if body.get("suffix") is not None:
            raise APIError(400, "'suffix' (insertion) is not supported", param="suffix")
        k = OP.logprobs_k(body, False)
        grammar = await ctx.grammar(body)
        hs = ctx.submit(prompts, body, False, grammar, prompt_lp=k if echo and k is not None else None)
        answer = _Answer(ctx, prompts, len(hs) // len(prompts), k, echo, want_ids)
        if stream:
            return stream_response(hs, answer.chunk_fn(len(hs)), with_usage, "text_completion", answer.rid,
                                   ctx.model_name, answer.n)
        return answer.whole(hs, await collect_all(request, hs))

    return r
