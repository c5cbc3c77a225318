"""The OpenAI request surface: which fields each endpoint takes, sampling and grammar parsing, logprobs shapes.

Nothing is silently ignored: a request field outside the endpoint's allow-list is refused with
400 naming it (`check_fields`). Parsing raises the engine's `RequestError(message, param)`; the HTTP
layer turns it into OpenAI's 400 error shape.

Structured outputs (one of, else 400):
  response_format  {"type": "text"} | {"type": "json_object"} |
                   {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
  structured_outputs (vLLM)  {"json": schema} | {"regex": str} | {"choice": [str]} | {"grammar": lark/GBNF}
                             | {"json_object": true}
  guided_json / guided_regex / guided_choice / guided_grammar (vLLM's older extras)

Bounded cost: every per-step constraint a request carries is capped, so one request cannot slow
the others' steps (tests/test_hostile_cost.py measures it): at most MAX_STOP_TOKEN_IDS
`stop_token_ids`, MAX_LOGIT_BIAS `logit_bias` entries with canonical decimal keys ("5", never
"05" or " 5 ", so no two keys alias one id and no id's bias can sum past +-100), and JSON
schemas at most MAX_SCHEMA_DEPTH containers deep (gpu_service.runtime.grammar).

Options agent frameworks send (`chat_options`): `store` only false (nothing is stored here);
`metadata` as OpenAI bounds it (at most 16 string keys of <= 64 characters, string values of <= 512),
logged and returned on the chat.completion object; `reasoning_effort` one of REASONING_EFFORTS
(what it does depends on the model's format: gpu_service.api.chat_request); `verbosity` refused
(no model served here has a verbosity control).
"""
from __future__ import annotations

import json

from gpu_service.runtime.grammar import GrammarError, GrammarSpec
from gpu_service.runtime.requests import check_token_lists, MAX_LOGIT_BIAS, MAX_N, RequestError

_COMMON = {"model", "stream", "stream_options", "temperature", "top_p", "n", "seed", "stop", "max_tokens",
           "presence_penalty", "frequency_penalty", "logit_bias", "user", "response_format",
           # extensions (vLLM's names)
           "top_k", "ignore_eos", "return_token_ids", "min_tokens", "stop_token_ids", "repetition_penalty",
           "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "cache_salt"}
CHAT_FIELDS = frozenset(_COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                   # gpu_service.api.chat_request
                                   "tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs",
                                   "functions", "function_call",
                                   # chat_options (reasoning_effort: gpu_service.api.chat_request)
                                   "store", "metadata", "reasoning_effort", "verbosity"})
COMPLETION_FIELDS = frozenset(_COMMON | {"prompt", "logprobs", "echo", "best_of"})
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")  # OpenAI's values
MAX_METADATA_KEYS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def _metadata(v) -> dict | None:
    """`metadata` checked as OpenAI does: <= 16 string keys of <= 64 characters to strings of <= 512."""
    if v is None:
        return None
    if not isinstance(v, dict):
        raise RequestError("'metadata' must be an object of string keys to string values", "metadata")
    if len(v) > MAX_METADATA_KEYS:
        raise RequestError(f"'metadata' has {len(v)} keys; at most {MAX_METADATA_KEYS} are allowed", "metadata")
    for k, x in v.items():
        if len(k) > MAX_METADATA_KEY:
            raise RequestError(f"metadata key {k[:20]!r}... has {len(k)} characters; at most {MAX_METADATA_KEY} "
                               "are allowed", "metadata")
        if not isinstance(x, str):
            raise RequestError(f"metadata[{k!r}] must be a string, got {type(x).__name__}", "metadata")
        if len(x) > MAX_METADATA_VALUE:
            raise RequestError(f"metadata[{k!r}] has {len(x)} characters; at most {MAX_METADATA_VALUE} are "
                               "allowed", "metadata")
    return dict(v)


def chat_options(body: dict) -> tuple[dict | None, str | None]:
    """(metadata, reasoning_effort) of a chat request, after checking `store` (false only) and
    refusing `verbosity`; each refusal names the field and the values it may take."""
    store = body.get("store")
    if store is not None and store is not False:
        raise RequestError(f"'store' may only be false (this server stores no completions), got {store!r}",
                           "store")
    if body.get("verbosity") is not None:
        raise RequestError(f"'verbosity' ({body['verbosity']!r}) is not supported: the served models have no "
                           "verbosity control; remove it (allowed: null)", "verbosity")
    effort = body.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise RequestError(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {effort!r}",
                           "reasoning_effort")
    return _metadata(body.get("metadata")), effort


def check_fields(body: dict, allowed: frozenset, endpoint: str) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise RequestError(f"{endpoint} does not support the field(s) {', '.join(map(repr, unknown))}; "
                         f"remove them (supported: {', '.join(sorted(allowed))})", unknown[0])


def _num(body, key, default, lo=None, hi=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"'{key}' must be a number, got {v!r}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return float(v)


def _int(body, key, default, lo=None, hi=None):
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise RequestError(f"'{key}' must be an integer, got {v!r}", key)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        raise RequestError(f"'{key}' must be in [{lo}, {hi}], got {v}", key)
    return v


def choices_n(body: dict) -> int:
    """`n` (1..MAX_N); `best_of` is accepted only when it equals n (no ranking of extra samples)."""
    n = _int(body, "n", 1, 1, MAX_N)
    best_of = _int(body, "best_of", None)
    if best_of is not None and best_of != n:
        raise RequestError(f"best_of={best_of} is not supported (only best_of == n); use n and rank client-side",
                         "best_of")
    return n


def logprobs_k(body: dict, chat: bool) -> int | None:
    """Top alternatives per token to report, or None: chat `logprobs: true` + `top_logprobs`,
    completions `logprobs: k` (0..5 in OpenAI's API; up to 20 here)."""
    if chat:
        on = body.get("logprobs")
        if on is not None and not isinstance(on, bool):
            raise RequestError(f"'logprobs' must be a boolean, got {on!r}", "logprobs")
        top = _int(body, "top_logprobs", None, 0, 20)
        if top is not None and not on:
            raise RequestError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    return _int(body, "logprobs", None, 0, 20)


def _bias_id(k, vocab_size: int) -> int:
    """A logit_bias key: a canonical decimal token id ("5"; not "05", " 5", "+5", "5.0")."""
    if isinstance(k, int) and not isinstance(k, bool):
        t = k
    elif isinstance(k, str) and k.isascii() and k.isdigit() and (k == "0" or k[0] != "0"):
        t = int(k)
    else:
        raise RequestError(f"logit_bias key {k!r} is not a token id: write ids as plain decimal strings, "
                         f"e.g. \"5\" (no sign, spaces or leading zeros)", "logit_bias")
    if not 0 <= t < vocab_size:
        raise RequestError(f"logit_bias token id {t} out of range [0, {vocab_size})", "logit_bias")
    return t


def sampling_fields(body: dict, vocab_size: int) -> dict:
    """The SamplingParams fields beyond temperature / top_p / top_k / seed, validated."""
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise RequestError("'logit_bias' must be an object {token id: bias}", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:  # before any per-key work
        raise RequestError(f"'logit_bias' has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are accepted",
                         "logit_bias")
    pairs = []
    for k, v in bias.items():
        t = _bias_id(k, vocab_size)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
            raise RequestError(f"logit_bias[{k}] must be a number in [-100, 100], got {v!r}", "logit_bias")
        pairs.append((t, float(v)))
    stop_ids = body.get("stop_token_ids") or []
    if not (isinstance(stop_ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids)):
        raise RequestError("'stop_token_ids' must be an array of token ids", "stop_token_ids")
    check_token_lists(stop_ids, pairs)
    bad = next((t for t in stop_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise RequestError(f"stop_token_ids: token id {bad} out of range [0, {vocab_size})", "stop_token_ids")
    return dict(presence_penalty=_num(body, "presence_penalty", 0.0, -2, 2),
                frequency_penalty=_num(body, "frequency_penalty", 0.0, -2, 2),
                repetition_penalty=_num(body, "repetition_penalty", 1.0, 0.01, 2),
                logit_bias=tuple(sorted(pairs)), min_tokens=_int(body, "min_tokens", 0, 0),
                stop_token_ids=tuple(stop_ids))


def _schema_arg(v, param: str):
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except (json.JSONDecodeError, RecursionError) as e:
            raise RequestError(f"'{param}' is not valid JSON: {e}", param) from None
    if not isinstance(v, (dict, bool)):
        raise RequestError(f"'{param}' must be a JSON schema object", param)
    return v


def grammar_spec(body: dict) -> tuple[GrammarSpec | None, str | None]:
    """(GrammarSpec or None, the field it came from). RequestError on a malformed or invalid one."""
    given = [k for k in ("response_format", "structured_outputs") + GUIDED if body.get(k) is not None]
    rf = body.get("response_format")
    if rf is not None and isinstance(rf, dict) and rf.get("type") == "text" and len(rf) == 1:
        given.remove("response_format")
    if not given:
        return None, None
    if len(given) > 1:
        raise RequestError(f"give one of {', '.join(given)}, not several", given[1])
    key = given[0]
    v = body[key]
    try:
        if key == "response_format":
            return _response_format(v), key
        if key == "structured_outputs":
            if not isinstance(v, dict):
                raise RequestError("'structured_outputs' must be an object", key)
            kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if v.get(k) not in (None, False)]
            extra = sorted(set(v) - {"json", "regex", "choice", "grammar", "json_object"})
            if extra:
                raise RequestError(f"structured_outputs does not support {', '.join(extra)}", key)
            if len(kinds) != 1:
                raise RequestError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
                                 key)
            k = kinds[0]
            v = {"json_object": True}.get(k, v[k]) if k == "json_object" else v[k]
            key, k = f"structured_outputs.{k}", {"json": "guided_json", "regex": "guided_regex",
                                                  "choice": "guided_choice", "grammar": "guided_grammar",
                                                  "json_object": "json_object"}[k]
            if k == "json_object":
                return GrammarSpec.json_object(), key
        else:
            k = key
        if k == "guided_json":
            return GrammarSpec.json_schema(_schema_arg(v, key)), key
        if not (isinstance(v, str) or k == "guided_choice"):
            raise RequestError(f"'{key}' must be a string", key)
        if k == "guided_regex":
            return GrammarSpec.regex(v), key
        if k == "guided_grammar":
            return GrammarSpec.grammar(v), key
        return GrammarSpec.choice(v), key
    except GrammarError as e:
        raise RequestError(f"{key}: {e}", key) from None


def _response_format(rf) -> GrammarSpec:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise RequestError("'response_format' must be an object with a 'type'", "response_format")
    t = rf["type"]
    if t == "json_object":
        return GrammarSpec.json_object()
    if t != "json_schema":
        raise RequestError(f"response_format type {t!r} is not supported: text, json_object or json_schema",
                         "response_format")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise RequestError("response_format.json_schema must be an object {name, schema, strict}", "response_format")
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise RequestError(f"response_format.json_schema does not support {', '.join(extra)}", "response_format")
    if "name" in js and not isinstance(js["name"], str):
        raise RequestError("response_format.json_schema.name must be a string", "response_format")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise RequestError("response_format.json_schema.strict must be a boolean", "response_format")
    return GrammarSpec.json_schema(_schema_arg(js.get("schema", {}), "response_format"))


# ---- logprobs in OpenAI's shapes -------------------------------------------------------------------
class TokenText:
    """Token id -> (text, bytes) through the grammar vocabulary (exact bytes, also for a token that
    is part of a multi-byte character), else the tokenizer."""

    def __init__(self, tokenizer, vocab=None):
        self.tokenizer, self.vocab, self._cache = tokenizer, vocab, {}

    def __call__(self, t: int) -> tuple[str, list[int]]:
        got = self._cache.get(t)
        if got is None:
            if self.vocab is not None:
                b = self.vocab.lltokenizer().decode_bytes([t])
            elif self.tokenizer is not None:
                b = self.tokenizer.decode([t], skip_special_tokens=False).encode()
            else:
                b = f"token_id:{t}".encode()
            got = self._cache[t] = (b.decode("utf-8", errors="replace"), list(b))
        return got


def chat_logprobs(lps, text_of: TokenText) -> dict:
    """`choice.logprobs` of a chat completion (or of one chunk): {"content": [...], "refusal": None}."""
    def entry(t, lp):
        s, b = text_of(t)
        return {"token": s, "logprob": lp, "bytes": b}

    return {"content": [{**entry(x.token, x.logprob), "top_logprobs": [entry(t, v) for t, v in x.top]}
                        for x in lps], "refusal": None}


def completion_logprobs(lps, text_of: TokenText, offset0: int = 0, prompt_first: int | None = None) -> dict:
    """The legacy completions shape {tokens, token_logprobs, top_logprobs, text_offset}; with echo,
    `prompt_first` is the first prompt token (no logprob: nothing predicts it)."""
    tokens, token_lps, tops, offsets = [], [], [], []
    off = offset0
    if prompt_first is not None:
        s, _ = text_of(prompt_first)
        tokens.append(s), token_lps.append(None), tops.append(None), offsets.append(off)
        off += len(s)
    for x in lps:
        s, _ = text_of(x.token)
        tokens.append(s)
        token_lps.append(x.logprob)
        top = {}
        for t, v in x.top:
            top.setdefault(text_of(t)[0], v)
        tops.append(top)
        offsets.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}
