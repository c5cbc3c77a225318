"""`ApiContext`: what every endpoint of the HTTP API shares — the engine, the tokenizer, the served
model's name and limits — and the steps common to them: reading the JSON body (`body`), compiling
a request's grammar off the event loop (`grammar`, `compile`) and submitting its choices (`submit`)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import time

from fastapi import Request
from starlette.requests import ClientDisconnect

from gpu_service.api import openai_params as OP
from gpu_service.api.chat_request import ChatSettings
from gpu_service.api.errors import APIError
from gpu_service.api.routes.request import check_unicode, field, max_tokens, sampling
from gpu_service.runtime.engine import Engine, EngineStopped, QueueFull, RequestError
from gpu_service.runtime.logits import grammar_reason
from gpu_service.runtime.grammar import GrammarError, InvalidSchema

BIG_BODY = 256 << 10  # bytes: JSON bodies from this size are parsed in a worker thread


class ApiContext:
    """The served model behind the routes (`tokenizer` None: token-id prompts only; `max_chars`: the
    prompt cap; `text_of`: token id -> text for logprobs)."""

    def __init__(self, engine: Engine, tokenizer, model_name: str, chat_settings: ChatSettings,
                 max_chars: int | None):
        """The context of one app; `created` is now."""
        self.engine, self.tokenizer, self.model_name = engine, tokenizer, model_name
        self.chat_settings, self.max_chars = chat_settings, max_chars
        self.created = int(time.time())
        self.image_policy = None  # gpu_service.api.image_parts.ImagePolicy when images are served
        self.text_of = OP.TokenText(tokenizer, engine.grammars.vocab if engine.grammars is not None else None)

    async def body(self, request: Request) -> dict:
        """The request's JSON object; 400 (`invalid_json`) when it is not one, 404 when it names another model."""
        try:
            raw = await request.body()
        except ClientDisconnect:  # the client left (or the body deadline closed it): nobody to answer
            raise APIError(400, "the client disconnected before sending the whole body") from None
        try:  # a large body parses off the event loop (1M ids as JSON: ~170 ms of CPU)
            body = json.loads(raw) if len(raw) < BIG_BODY else await asyncio.to_thread(json.loads, raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
        except RecursionError:
            raise APIError(400, "the request body is nested too deeply", code="invalid_json") from None
        except ValueError:  # e.g. an integer literal past Python's 4300-digit limit
            raise APIError(400, "the request body has a number too long to parse", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object")
        check_unicode(body, raw)  # before any field is used: a lone surrogate cannot be encoded or echoed
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")
        return body

    async def grammar(self, body: dict):
        """The request's compiled grammar (compiled off the event loop and the scheduler), or None."""
        spec, key = OP.grammar_spec(body)
        return None if spec is None else await self.compile(spec, key)

    async def compile(self, spec, key: str):
        """`spec` compiled by the engine's grammar compiler; 400 naming `key` when it cannot be."""
        engine = self.engine
        if engine.grammars is None:
            raise APIError(400, f"{key} needs grammar-constrained decoding, and the grammar engine does not know "
                                "this tokenizer's vocabulary", param=key)
        try:
            return await asyncio.wrap_future(engine.grammars.compile(spec))
        except InvalidSchema as e:
            raise APIError(400, f"{key}: {e}", param=key, code="invalid_schema") from None
        except GrammarError as e:
            raise APIError(400, f"{key}: the grammar engine cannot compile this: {grammar_reason(str(e))}",
                           param=key, code="invalid_grammar") from None

    def submit(self, prompts: list[list[int]], body: dict, chat: bool, grammar=None, prompt_lp=None, images=None):
        """One handle per choice: prompt p's choice i is handle p * n + i, seeded with seed + i;
        `images`: the ImageInputs of a chat prompt's placeholders (one prompt).
        A full queue is 429 with Retry-After, a stopped engine 503; nothing stays submitted on an error."""
        engine = self.engine
        OP.check_fields(body, OP.CHAT_FIELDS if chat else OP.COMPLETION_FIELDS,
                        "/v1/chat/completions" if chat else "/v1/completions")
        n = OP.choices_n(body)
        params, stop, ignore_eos = sampling(body, engine.cfg.vocab_size, chat)
        limit = max_tokens(body, 0 if prompt_lp is not None else 1)
        if len(prompts) * n > engine.max_waiting:  # never admissible: 400, not a 429 to retry
            raise APIError(400, f"this request makes {len(prompts) * n} sequences ({len(prompts)} prompt(s) x n={n}) "
                                f"but the server queues at most {engine.max_waiting} (--max-waiting); lower n or "
                                f"send fewer prompts", param="n" if n > 1 else "prompt")
        hs = []
        try:
            for ids in prompts:
                ps = [params if params.seed is None else dataclasses.replace(params, seed=params.seed + i)
                      for i in range(n)]
                hs += engine.submit_n(ids, ps, max_tokens=limit, stop=stop, ignore_eos=ignore_eos,
                                      grammar=grammar, prompt_logprobs=prompt_lp,
                                      cache_salt=field(body, "cache_salt", str), images=images)
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
