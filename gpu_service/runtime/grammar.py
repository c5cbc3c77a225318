"""Grammar-constrained decoding: compiled grammars, per-request matchers, batched token masks.

Built on llguidance (vLLM's "guidance" backend): no vocabulary-wide precompute at compile time,
a token mask in tens of microseconds, JSON Schema, regex, Lark/GBNF and choices, over tokenizer.json
and tiktoken vocabularies.

    spec = GrammarSpec.json_schema({"type": "object", ...})     # or .json_object(), .regex(), .choice(), .grammar(), .lark()
    compiled = GrammarCompiler(vocab).compile(spec).result()   # a Future on the compiler's threads; GrammarError names why
    m = compiled.matcher()                                      # one per request
    apply_bitmask(logits_rows, fill_bitmasks([m, ...]))        # disallowed tokens -> -inf, in place
    m.accept(token); m.stopped                                  # the grammar reached its end: stop

Compiled grammars (and failures) are cached by (vocabulary key, grammar), LRU. Compiling never runs
on the engine's scheduler thread, so a slow schema delays only its own request; `observer(seconds,
kind, ok)` is called once per compilation. No special token is allowed inside grammar text; the EOS
ids are allowed exactly where the grammar may end.
"""
from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import threading
import time
from dataclasses import dataclass

import torch

MAX_SCHEMA_DEPTH = 64  # JSON containers a schema may nest (llguidance's parser stops near 128, jsonschema's
# metaschema check recurses past Python's limit near 200): refused before anything compiles it
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark", "llguidance")
# compact JSON (no free whitespace): a bounded schema then always ends, and outputs stay short
JSON_OPTIONS = {"whitespace_flexible": False, "lenient": False}


class GrammarError(ValueError):
    """A grammar the engine cannot use; the message carries the library's reason."""


class InvalidSchema(GrammarError):
    """A json_schema that is not a valid JSON Schema (its metaschema says why)."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to: `kind` (one of KINDS) and its canonical `source` text."""

    kind: str
    source: str

    def __post_init__(self):
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}: one of {', '.join(KINDS)}")

    @classmethod
    def json_schema(cls, schema: dict | bool) -> "GrammarSpec":
        """A JSON Schema (draft 2020-12 subset llguidance implements; unknown keywords are errors).
        Checked against its metaschema when compiled (~0.1 s for a large one: on the compiler's threads)."""
        if not isinstance(schema, (dict, bool)):
            raise InvalidSchema(f"a JSON schema must be an object, got {type(schema).__name__}")
        check_schema_depth(schema)
        return cls("json_schema", json.dumps(schema, sort_keys=True, separators=(",", ":")))

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls("json_object", '{"type":"object"}')

    @classmethod
    def regex(cls, pattern: str) -> "GrammarSpec":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, options: list[str]) -> "GrammarSpec":
        if not options or not all(isinstance(o, str) for o in options):
            raise GrammarError("a choice needs a non-empty list of strings")
        return cls("choice", json.dumps(list(options)))

    @classmethod
    def grammar(cls, text: str) -> "GrammarSpec":
        """A Lark grammar, or a GBNF / EBNF one (llama.cpp's syntax, as vLLM's guided_grammar)."""
        return cls("grammar", text)

    @classmethod
    def lark(cls, text: str) -> "GrammarSpec":
        """A Lark grammar in llguidance's dialect (may embed JSON schemas: `%json { ... }`)."""
        return cls("lark", text)

    def to_llguidance(self) -> str:
        """The llguidance grammar text (GrammarError on input its converters refuse)."""
        import llguidance

        L = llguidance.LLMatcher
        try:
            if self.kind in ("json_schema", "json_object"):
                return L.grammar_from_json_schema(self.source, defaults=JSON_OPTIONS)
            if self.kind == "regex":
                return L.grammar_from_regex(self.source)
            if self.kind == "choice":
                return L.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in json.loads(self.source)))
            if self.kind == "grammar":
                return llguidance.grammar_from("grammar", self.source)
            if self.kind == "lark":
                return L.grammar_from_lark(self.source)
            return self.source  # "llguidance": already a grammar definition
        except ValueError as e:
            raise GrammarError(str(e)) from None


def check_json_schema(schema) -> None:
    """GrammarError unless `schema` is a valid JSON Schema (checked against its metaschema)."""
    if not isinstance(schema, (dict, bool)):
        raise InvalidSchema(f"a JSON schema must be an object, got {type(schema).__name__}")
    import jsonschema

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path) or "(root)"
        raise InvalidSchema(f"invalid JSON schema at {where}: {e.message}") from None


def json_depth(value, limit: int = MAX_SCHEMA_DEPTH) -> int:
    """Nesting depth of JSON containers in `value` (iterative: no recursion, stops past `limit`)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        v, d = todo.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        deepest = max(deepest, d)
        if deepest > limit:
            return deepest
        todo.extend((c, d + 1) for c in v if isinstance(c, (dict, list)))
    return deepest


def check_schema_depth(schema, where: str = "the JSON schema") -> None:
    """InvalidSchema when `schema` nests more than MAX_SCHEMA_DEPTH containers."""
    if json_depth(schema) > MAX_SCHEMA_DEPTH:
        raise InvalidSchema(f"{where} nests JSON objects / arrays more than {MAX_SCHEMA_DEPTH} deep; flatten it "
                            f"(move shared parts to $defs and refer to them with $ref)")


class GrammarMatcher:
    """One request's position in its grammar (not thread-safe: the scheduler owns it)."""

    def __init__(self, m):
        self._m = m

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False (and `error`) when the grammar does not allow it."""
        return self._m.consume_token(int(token))

    @property
    def stopped(self) -> bool:
        """The grammar cannot continue (its end reached, or an error): the request stops."""
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        return self._m.is_accepting()

    @property
    def error(self) -> str | None:
        return self._m.get_error() if self._m.is_error() else None


class CompiledGrammar:
    """A grammar compiled against one vocabulary; `matcher()` gives each request its own state."""

    def __init__(self, spec: GrammarSpec, vocab_key: str, matcher, compile_s: float):
        self.spec, self.vocab_key, self._pristine, self.compile_s = spec, vocab_key, matcher, compile_s
        self._lock = threading.Lock()

    def matcher(self) -> GrammarMatcher:
        with self._lock:
            return GrammarMatcher(self._pristine.deep_copy())


class GrammarCompiler:
    """Compiles GrammarSpecs for one vocabulary on a small thread pool, with an LRU cache."""

    def __init__(self, vocab, workers: int = 2, cache_size: int = 256, observer=None):
        self.vocab = vocab
        self.cache_size = cache_size
        self.observer = observer  # observer(seconds, kind, ok)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="moesplit-grammar")
        self._cache: collections.OrderedDict[tuple, concurrent.futures.Future] = collections.OrderedDict()
        self._lock = threading.Lock()
        self.stats = {"compiled": 0, "cache_hits": 0, "errors": 0}

    def compile(self, spec: GrammarSpec) -> concurrent.futures.Future:
        """A Future of the CompiledGrammar (raises GrammarError from `.result()` when it fails)."""
        key = (self.vocab.key, spec.kind, spec.source)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.stats["cache_hits"] += 1
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[key] = fut
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return fut

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        import llguidance

        t0 = time.perf_counter()
        ok = False
        try:
            if spec.kind == "json_schema":
                check_json_schema(json.loads(spec.source))
            try:
                text = spec.to_llguidance()
            except RecursionError:  # a nested grammar (a schema's depth is refused before this)
                raise GrammarError("the grammar nests too deeply for the grammar engine; flatten it") from None
            m = llguidance.LLMatcher(self.vocab.lltokenizer(), text, log_level=0)  # drops the GIL while building
            if m.is_error():
                raise GrammarError(m.get_error())
            ok = True
            return CompiledGrammar(spec, self.vocab.key, m, time.perf_counter() - t0)
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                self.stats["compiled" if ok else "errors"] += 1
            if self.observer is not None:
                self.observer(dt, spec.kind, ok)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def compiler_for(tokenizer, cfg) -> GrammarCompiler | None:
    """The grammar compiler over a serving tokenizer's vocabulary (gpu_service.runtime.vocab);
    None without a tokenizer, or one whose vocabulary the engine does not know (logged)."""
    if tokenizer is None:
        return None
    from gpu_service.runtime.vocab import vocabulary_for

    try:
        return GrammarCompiler(vocabulary_for(tokenizer, cfg.vocab_size, cfg.eos_token_ids))
    except ValueError as e:
        import logging

        logging.getLogger("moesplit.grammar").warning("structured outputs off: %s", e)
        return None


_EXECUTOR = None
_BITS = {}
# rows from which masks are computed on llguidance's thread pool: with few cores, handing off to
# threads that compete with torch's own costs far more than it saves (measured: bench/bench_grammar.py)
PARALLEL_MIN_ROWS = 8 if (os.cpu_count() or 1) >= 8 else 1 << 30


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor(num_threads=2)
    return _EXECUTOR


def fill_bitmasks(matchers: list[GrammarMatcher], vocab_size: int) -> torch.Tensor:
    """[len(matchers), ceil(vocab_size / 32)] int32 on the CPU: bit t of row i set = token t allowed."""
    words = (vocab_size + 31) // 32
    mask = torch.full((len(matchers), words), -1, dtype=torch.int32)
    if len(matchers) < PARALLEL_MIN_ROWS:  # on the calling thread: no hand-off to (possibly busy) cores
        for i, m in enumerate(matchers):
            m._m.unsafe_compute_mask_ptr(mask.data_ptr() + i * words * 4, words * 4)
    else:
        _executor().unsafe_compute_mask_ptr([(m._m, i) for i, m in enumerate(matchers)], mask.data_ptr(),
                                            words * 4, len(matchers))
    return mask


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """Set disallowed tokens of `logits` [B, V] (any device) to -inf in place, per `bitmask` [B, W]."""
    B, V = logits.shape
    dev = logits.device
    key = (dev, bitmask.shape[1])
    shifts = _BITS.get(key)
    if shifts is None:
        shifts = _BITS[key] = torch.arange(32, dtype=torch.int32, device=dev)
    bits = (bitmask.to(dev, non_blocking=True).unsqueeze(-1) >> shifts) & 1  # [B, W, 32]
    allowed = bits.reshape(B, -1)[:, :V].bool()
    logits.masked_fill_(~allowed, float("-inf"))
    return logits
