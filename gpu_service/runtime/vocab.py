"""Token vocabularies for grammar matching: every token's bytes, the special and the EOS ids.

A `Vocabulary` gives llguidance an `LLTokenizer` plus a `key` naming the vocabulary in the
compiled-grammar cache:

    vocab = vocabulary_for(tokenizer, vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_ids)

Adapters: `HFVocabulary` (tokenizer.json) and `TiktokenVocabulary`; another tokenizer plugs in by
defining `grammar_vocabulary(vocab_size, eos_token_ids)`, which `vocabulary_for` asks first.
`vocab_size` is the model's logits width: ids the tokenizer does not know are never allowed.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Protocol, runtime_checkable


@runtime_checkable
class Vocabulary(Protocol):
    """What the grammar engine needs of a tokenizer."""

    key: str  # identifies the vocabulary (compiled grammars are cached by (key, grammar))
    vocab_size: int  # logits width
    eos_token_ids: tuple[int, ...]

    def lltokenizer(self):
        """The llguidance.LLTokenizer (built once, ~ms to ~1 s for a large vocabulary; cached)."""
        ...


class _LazyTokenizer:
    """Builds the LLTokenizer once, on first use, thread-safely."""

    def __init__(self):
        self._lock = threading.Lock()
        self._llt = None

    def lltokenizer(self):
        with self._lock:
            if self._llt is None:
                self._llt = self._build()
            return self._llt

    def _build(self):  # pragma: no cover - overridden
        raise NotImplementedError


class HFVocabulary(_LazyTokenizer):
    """A `tokenizers` tokenizer (tokenizer.json text); special tokens only where a grammar names them."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
        super().__init__()
        self.tokenizer_json = tokenizer_json
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        h = hashlib.sha256(tokenizer_json.encode()).hexdigest()[:16]
        self.key = f"hf:{h}:{self.vocab_size}:{','.join(map(str, self.eos_token_ids))}"

    @classmethod
    def from_tokenizers(cls, tok, vocab_size: int, eos_token_ids) -> "HFVocabulary":
        """From a `tokenizers.Tokenizer` object."""
        return cls(tok.to_str(), vocab_size, tuple(eos_token_ids))

    def _build(self):
        import llguidance

        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                      eos_token=list(self.eos_token_ids) or None)


class TiktokenVocabulary(_LazyTokenizer):
    """A `tiktoken.Encoding` (mergeable ranks + special tokens + split pattern)."""

    def __init__(self, encoding, vocab_size: int, eos_token_ids: tuple[int, ...]):
        super().__init__()
        self.encoding = encoding
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = tuple(int(t) for t in eos_token_ids)
        self.key = f"tiktoken:{encoding.name}:{self.vocab_size}:{','.join(map(str, self.eos_token_ids))}"

    def _build(self):
        from llguidance.tiktoken import lltokenizer_from_encoding

        return lltokenizer_from_encoding(self.encoding, n_vocab=self.vocab_size,
                                         eos_token=list(self.eos_token_ids) or None)


def vocabulary_for(tokenizer, vocab_size: int, eos_token_ids) -> Vocabulary:
    """The Vocabulary of a serving tokenizer: its own `grammar_vocabulary(...)` when it has one,
    else a tokenizer.json one (`.tok` is a `tokenizers.Tokenizer`). ValueError names what is missing."""
    own = getattr(tokenizer, "grammar_vocabulary", None)
    if callable(own):
        return own(vocab_size, tuple(eos_token_ids))
    tok = getattr(tokenizer, "tok", None)
    if tok is not None and hasattr(tok, "to_str"):
        return HFVocabulary.from_tokenizers(tok, vocab_size, eos_token_ids)
    raise ValueError(f"structured outputs need a tokenizer whose vocabulary the grammar engine knows; "
                     f"{type(tokenizer).__name__} has neither grammar_vocabulary() nor a tokenizer.json")
