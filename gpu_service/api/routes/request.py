"""Request fields of the OpenAI generation endpoints parsed into typed values, or `APIError(400)`
naming the field: `field` (one typed field), `sampling` (SamplingParams, stop strings, ignore_eos),
`max_tokens`, `include_usage` (stream_options), `check_unicode` (no lone surrogates anywhere)."""
from __future__ import annotations

import re

from gpu_service.api import openai_params as OP
from gpu_service.api.errors import APIError
from gpu_service.runtime.engine import Engine
from gpu_service.runtime.sampling import SamplingParams


def check_unicode(body, raw: bytes) -> None:
    """400 naming the field when a string of `body` holds a lone UTF-16 surrogate (valid JSON, not valid
    Unicode); only bodies whose `raw` bytes hold a surrogate escape are walked."""
    if not _SURROGATE_ESCAPE.search(raw):
        return
    stack = [(body, "")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, dict):
            stack += [(x, f"{path}.{k}" if path else str(k)) for k, x in v.items()]
            stack += [(k, f"{path}.{k!r} (a key)" if path else f"{k!r} (a key)") for k in v if isinstance(k, str)]
        elif isinstance(v, list):
            stack += [(x, f"{path}[{i}]") for i, x in enumerate(v)]
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                top = path.split(".", 1)[0].split("[", 1)[0]
                top = _ascii(top) if top in body else None
                raise APIError(400, f"'{_ascii(path)}' holds a lone UTF-16 surrogate (\\u{ord(v[e.start]):04x}), "
                                    f"which is not valid Unicode: send valid UTF-8 text (an escaped surrogate "
                                    f"must be half of a pair)", param=top) from None


def _ascii(path: str) -> str:
    """`path` with anything that is not printable ASCII escaped (it may hold the surrogate itself)."""
    return path.encode("ascii", "backslashreplace").decode()[:120]


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def field(body: dict, key: str, types, default=None, *, name: str | None = None):
    """`body[key]` when it is one of `types` (a bool is not an int unless `types` says so, integers fit
    in 64 bits); `default` when absent or null; else 400 naming `name or key`."""
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
    """repr(v), cut to 80 characters for an error message."""
    r = repr(v)
    return r if len(r) <= 80 else r[:77] + "..."


def _type_names(types) -> str:
    """JSON names of Python types for an error message: (int, float) -> 'an integer or a number'."""
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join({int: "an integer", float: "a number", str: "a string", bool: "a boolean",
                        list: "an array", dict: "an object"}.get(t, t.__name__) for t in types)


def sampling(body: dict, vocab_size: int = 1 << 31, chat: bool = True) -> tuple[SamplingParams, list[str], bool]:
    """The request's sampling parameters, its non-empty stop strings (at most Engine.MAX_STOP) and ignore_eos."""
    temperature = float(field(body, "temperature", (int, float), 1.0))
    top_p = float(field(body, "top_p", (int, float), 1.0))
    top_k = field(body, "top_k", int, 0)
    if top_k < 0:  # OpenAI-style clients send -1 for "off"
        top_k = 0
    seed = field(body, "seed", int, None)
    extra, k = OP.sampling_fields(body, vocab_size), OP.logprobs_k(body, chat)
    try:
        params = SamplingParams(temperature, top_p, top_k, seed, logprobs=k, **extra)
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
    ignore_eos = field(body, "ignore_eos", bool, False)
    return params, stop, ignore_eos


def max_tokens(body: dict, least: int = 1) -> int | None:
    """`max_completion_tokens` (chat's newer name) or `max_tokens`; None when neither is given."""
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = field(body, key, int, None)
    if v is not None and v < least:
        raise APIError(400, f"'{key}' must be >= 1, got {v}", param=key)
    return v


def include_usage(body: dict) -> bool:
    """`stream_options.include_usage`: a last chunk with the usage."""
    so = body.get("stream_options")
    if so is None:
        return False
    if not isinstance(so, dict):
        raise APIError(400, "'stream_options' must be an object", param="stream_options")
    return bool(so.get("include_usage", False))
