"""What a request is to the engine: its errors, its outputs, the caller's handle and the scheduler's record.

`RequestHandle` is what `Engine.submit` returns (iterate it, `await` it, or `result()`; `cancel()` from
any thread); `_Request` is the scheduler's own state of one request (prompt, KV, sampling, grammar).
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
import weakref
from dataclasses import dataclass, field

import torch

from gpu_service.model.kv import SeqKV
from gpu_service.runtime.logits import TokenLogprob
from gpu_service.runtime.sampling import SamplingParams


FINISH_REASONS = ("stop", "length", "cancelled", "error")

# Per-request caps on what every generated step costs (checked by Engine.submit / submit_n, so by
# every API edge and by direct engine callers alike).
MAX_N = 16  # choices of one submit_n (OpenAI's `n`)
MAX_STOP_TOKEN_IDS = 1024  # ids checked per generated token
MAX_LOGIT_BIAS = 1024  # entries added to the logits per step (OpenAI documents no higher need)


class RequestError(ValueError):
    """A request the engine will never serve as given; `param`/`code` name what to fix."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


class QueueFull(RequestError):
    """The waiting queue holds `max_waiting` requests already: retry after `retry_after_s`
    (HTTP 429 with Retry-After, gRPC RESOURCE_EXHAUSTED)."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message, None, "queue_full")
        self.retry_after_s = retry_after_s


class EngineStopped(RuntimeError):
    """The engine is shutting down and takes no new requests."""


@dataclass
class Output:
    """What a request produced since the previous Output; `finish_reason` ("stop", "length",
    "cancelled", "error") on the last; `prompt_logprobs` on the first only."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    error: str | None = None
    unavailable: bool = False  # an "error" because a backend (expert shard) is unavailable: retry later
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    param: str | None = None  # an "error" the request caused (HTTP 400 / gRPC INVALID_ARGUMENT): the field


class RequestHandle:
    """The caller's side of one request: iterate (sync or async) over `Output`s, or `cancel()`."""

    def __init__(self, rid: str, prompt_tokens: int, max_tokens: int, wake):
        self.id = rid
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.completion_tokens = 0
        self.cached_tokens = 0  # prompt tokens served from the prefix cache (usage.prompt_tokens_details)
        self.finish_reason: str | None = None
        self.error: str | None = None
        self.unavailable = False  # the error was an unavailable expert shard (HTTP 503 / gRPC UNAVAILABLE)
        self.error_param: str | None = None  # the error was the request's own: the field that caused it
        self._wake = wake
        self._cond = threading.Condition()
        self._events: collections.deque[Output] = collections.deque()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._cancel = threading.Event()

    # ---- consumer side ------------------------------------------------------------------------
    def cancel(self) -> None:
        """Ask the engine to drop this request; its KV pages are freed at the next step boundary."""
        if self.finish_reason is None and not self._cancel.is_set():
            self._cancel.set()
            self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def get(self, timeout: float | None = None) -> Output:
        """The next Output (blocking); raises TimeoutError after `timeout` seconds."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._events, timeout):
                raise TimeoutError(f"request {self.id}: no output within {timeout}s")
            return self._events.popleft()

    def __iter__(self):
        while True:
            out = self.get()
            yield out
            if out.finish_reason is not None:
                return

    async def __aiter__(self):
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._events:
                    out, fut = self._events.popleft(), None
                else:
                    out, fut = None, loop.create_future()
                    self._waiter = (loop, fut)
            if fut is not None:
                await fut
                continue
            yield out
            if out.finish_reason is not None:
                return

    def result(self, timeout: float | None = None) -> tuple[list[int], str, str]:
        """Block until done: (token_ids, text, finish_reason)."""
        ids, text = [], []
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out = self.get(None if deadline is None else max(0.0, deadline - time.monotonic()))
            ids += out.token_ids
            text.append(out.text)
            if out.finish_reason is not None:
                return ids, "".join(text), out.finish_reason

    # ---- engine side --------------------------------------------------------------------------
    def _push(self, out: Output) -> None:
        with self._cond:
            self.completion_tokens += len(out.token_ids)
            if out.finish_reason is not None:
                self.finish_reason, self.error, self.unavailable = out.finish_reason, out.error, out.unavailable
                self.error_param = out.param
            self._events.append(out)
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake_loop(*waiter)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _LoopWakes:
    """Futures of one event loop resolved in one call_soon_threadsafe: a step that feeds 32 streams
    wakes the loop once."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.lock, self.futs, self.scheduled = loop, threading.Lock(), [], False

    def add(self, fut: asyncio.Future) -> None:
        with self.lock:
            self.futs.append(fut)
            if self.scheduled:
                return
            self.scheduled = True
        try:
            self.loop.call_soon_threadsafe(self._run)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening
            with self.lock:
                self.futs.clear()
                self.scheduled = False

    def _run(self) -> None:
        with self.lock:
            futs, self.futs, self.scheduled = self.futs, [], False
        for fut in futs:
            _resolve(fut)


_wakes: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWakes]" = weakref.WeakKeyDictionary()
_wakes_lock = threading.Lock()


def _wake_loop(loop: asyncio.AbstractEventLoop, fut: asyncio.Future) -> None:
    w = _wakes.get(loop)
    if w is None:
        with _wakes_lock:
            w = _wakes.setdefault(loop, _LoopWakes(loop))
    w.add(fut)


@dataclass
class _Request:
    handle: RequestHandle
    prompt_len: int
    tokens: list[int]  # prompt + generated; KV exists for tokens[:seq.length]
    params: SamplingParams
    gen: torch.Generator | None
    max_tokens: int
    stop: tuple[str, ...]
    ignore_eos: bool
    seq: SeqKV
    matcher: object | None = None  # grammar.GrammarMatcher of a structured-output request
    banned_early: tuple[int, ...] = ()  # EOS + stop_token_ids while fewer than min_tokens are out
    prompt_lp: int | None = None  # top-k of the prompt's logprobs to report (echo), None = off
    prompt_lps: list = field(default_factory=list)
    followers: list = field(default_factory=list)  # choices 2..n of the same prompt: fork off this one's KV
    salt: str | None = None  # cache_salt: prefixes are shared only between equal salts
    looked_up: bool = False  # the prefix-cache lookup has been counted
    images: object | None = None  # gpu_service.runtime.images.PromptImages of a prompt with images
    # incremental detokenisation (prefix/read offsets into the generated ids) and stop handling
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""
    sent_chars: int = 0

    @property
    def out(self) -> list[int]:
        return self.tokens[self.prompt_len:]

    def cache_tokens(self) -> list[int]:
        """What the prefix cache keys on: the tokens, image placeholders keyed by their image."""
        return self.tokens if self.images is None else self.images.key_tokens(self.tokens)

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the next sample (1 = a decode)."""
        return len(self.tokens) - self.seq.length


def _lone_surrogate(s: str) -> str | None:
    """The first lone UTF-16 surrogate of `s` as '\\udXXX', or None when `s` is valid Unicode."""
    try:
        s.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return f"\\u{ord(s[e.start]):04x}"


def check_token_lists(stop_ids, bias_pairs) -> None:
    """RequestError unless `stop_token_ids` and the (id, bias) pairs are within the per-request
    caps (MAX_STOP_TOKEN_IDS, MAX_LOGIT_BIAS), with each biased id given once."""
    if len(stop_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"'stop_token_ids' has {len(stop_ids)} ids; at most {MAX_STOP_TOKEN_IDS} "
                           f"(MAX_STOP_TOKEN_IDS) are accepted: list fewer", "stop_token_ids")
    if len(bias_pairs) > MAX_LOGIT_BIAS:
        raise RequestError(f"'logit_bias' has {len(bias_pairs)} entries; at most {MAX_LOGIT_BIAS} "
                           f"(MAX_LOGIT_BIAS) are accepted: bias fewer tokens", "logit_bias")
    seen = set()
    for t, _ in bias_pairs:
        if t in seen:
            raise RequestError(f"logit_bias gives token id {t} more than once; give each id one bias", "logit_bias")
        seen.add(t)


def check_request(engine, prompt_ids: list[int], params: SamplingParams, max_tokens: int | None,
                  stop: tuple, prompt_logprobs: int | None, cache_salt) -> int:
    """Everything `Engine.submit` refuses before a request is queued (RequestError naming the
    field); returns the request's max_tokens (its default filled in)."""
    if not prompt_ids:
        raise RequestError("empty prompt: give at least one token", "prompt")
    V = engine.cfg.vocab_size
    bad = next((t for t in prompt_ids if not 0 <= t < V), None)
    if bad is not None:
        raise RequestError(f"prompt token id {bad} out of range: ids must be in [0, {V})", "prompt")
    limit, n = engine.max_request_tokens, len(prompt_ids)
    where = "context length" if engine.max_context <= engine.pool_tokens else "KV pool (--kv-tokens)"
    if n >= limit:
        raise RequestError(f"the prompt has {n} tokens but the {where} is {limit} tokens; shorten the prompt",
                           "messages", "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limit - n, engine.max_new_tokens)
    least = 0 if prompt_logprobs is not None else 1
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < least:
        raise RequestError(f"max_tokens must be an integer >= {least}, got {max_tokens!r}", "max_tokens")
    if max_tokens > engine.max_new_tokens:
        raise RequestError(f"max_tokens {max_tokens} is over this server's limit of {engine.max_new_tokens} "
                           f"(--max-new-tokens); lower it", "max_tokens")
    if n + max_tokens > limit:
        raise RequestError(
            f"this request needs {n + max_tokens} tokens ({n} in the prompt, {max_tokens} in the completion) "
            f"but the {where} is {limit} tokens; lower max_tokens to at most {limit - n}",
            "max_tokens", "context_length_exceeded")
    if any(not isinstance(s, str) or not s for s in stop):
        raise RequestError("stop strings must be non-empty strings", "stop")
    bad_s = next((u for u in map(_lone_surrogate, stop) if u), None)
    if bad_s is not None:
        raise RequestError(f"a stop string holds a lone UTF-16 surrogate ({bad_s}), which is not valid Unicode; "
                           f"send valid UTF-8 text", "stop")
    if stop and engine.tokenizer is None:
        raise RequestError("stop strings need the checkpoint's tokenizer.json", "stop")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise RequestError(f"cache_salt must be a string, got {cache_salt!r}", "cache_salt")
    bad_s = _lone_surrogate(cache_salt) if cache_salt else None
    if bad_s is not None:
        raise RequestError(f"cache_salt holds a lone UTF-16 surrogate ({bad_s}), which is not valid Unicode; "
                           f"send a valid UTF-8 string", "cache_salt")
    check_token_lists(params.stop_token_ids, params.logit_bias)  # before any per-id work
    bad = next((t for t in tuple(params.stop_token_ids) + tuple(t for t, _ in params.logit_bias) if not 0 <= t < V),
               None)
    if bad is not None:
        raise RequestError(f"token id {bad} out of range: ids must be in [0, {V})",
                           "stop_token_ids" if bad in params.stop_token_ids else "logit_bias")
    if params.min_tokens and len(engine.eos | set(params.stop_token_ids)) >= V:
        raise RequestError(f"min_tokens={params.min_tokens} bans EOS and every stop_token_ids entry until then, "
                           f"and together they cover all {V} tokens of the vocabulary: nothing could be sampled; "
                           f"list fewer stop_token_ids or drop min_tokens", "stop_token_ids")
    return max_tokens
