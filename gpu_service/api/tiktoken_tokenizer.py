"""Kimi-K2's tokenizer: `tiktoken.model` + `tokenizer_config.json` through the `tiktoken` library.

`tiktoken.model` has one `base64(token bytes) SPACE rank` line per token; `KIMI_PATTERN` is Kimi's
pre-tokenization regex; `NUM_SPECIAL_SLOTS` (256) special tokens follow the ranks, named from
`added_tokens_decoder` (an unnamed slot is `<|reserved_token_{id}|>`). Special-token strings in
text are parsed as special; a slot marked `"special": false` (Kimi's tool-call tokens) survives
`decode(skip_special_tokens=True)`.
"""
from __future__ import annotations

import base64
import os

from gpu_service.api.tokenizer_base import BaseTokenizer, TokenizerError

NUM_SPECIAL_SLOTS = 256
_LETTER_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_LETTER_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]"
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
KIMI_PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?" + _LETTER_UPPER + "*" + _LETTER_LOWER + "+" + _CONTRACTION,
    r"[^\r\n\p{L}\p{N}]?" + _LETTER_UPPER + "+" + _LETTER_LOWER + "*" + _CONTRACTION,
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])


def read_ranks(path: str) -> dict[bytes, int]:
    """`base64 rank` lines -> {token bytes: rank}; ValueError naming the line when malformed."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                tok, rank = line.split()
                ranks[base64.b64decode(tok, validate=True)] = int(rank)
            except ValueError as e:
                raise TokenizerError(f"{path}:{n}: expected 'base64 rank', got {line[:60]!r} ({e})") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks must be 0..{len(ranks) - 1} without gaps or repeats")
    return ranks


def special_slots(n_ranks: int, config: dict) -> dict[int, tuple[str, bool]]:
    """id -> (name, special) for the 256 slots after the ranks, from added_tokens_decoder."""
    dec = config.get("added_tokens_decoder") or {}
    out = {}
    for i in range(n_ranks, n_ranks + NUM_SPECIAL_SLOTS):
        entry = dec.get(str(i))
        if entry is None:
            out[i] = (f"<|reserved_token_{i}|>", True)
        else:
            out[i] = (entry["content"], bool(entry.get("special", True)))
    extra = [k for k in dec if not n_ranks <= int(k) < n_ranks + NUM_SPECIAL_SLOTS]
    if extra:
        raise TokenizerError(f"tokenizer_config.json added_tokens_decoder has ids {extra[:5]} outside the "
                             f"{NUM_SPECIAL_SLOTS} special slots {n_ranks}..{n_ranks + NUM_SPECIAL_SLOTS - 1} "
                             "that follow tiktoken.model's ranks")
    return out


class TiktokenTokenizer(BaseTokenizer):
    """tiktoken.model (+ tokenizer_config.json) with Kimi's pattern and special slots."""

    kind = "tiktoken.model"

    def __init__(self, model_dir: str, config: dict, pattern: str = KIMI_PATTERN):
        import tiktoken

        super().__init__(model_dir, config)
        ranks = read_ranks(os.path.join(model_dir, "tiktoken.model"))
        self.n_ranks = len(ranks)
        slots = special_slots(self.n_ranks, config)
        self.enc = tiktoken.Encoding(name=os.path.basename(os.path.normpath(model_dir)) or "tiktoken",
                                     pat_str=pattern, mergeable_ranks=ranks,
                                     special_tokens={name: i for i, (name, _) in slots.items()})
        self._special = {name: i for i, (name, _) in slots.items()}
        self._names = {i: name for i, (name, _) in slots.items()}
        self.special_ids = {i for i, (_, special) in slots.items() if special}

    def token_id(self, s: str | None) -> int | None:
        if s is None:
            return None
        if s in self._special:
            return self._special[s]
        ids = self.enc.encode_ordinary(s)
        return ids[0] if len(ids) == 1 else None

    def id_to_token(self, i: int) -> str | None:
        if i in self._names:
            return self._names[i]
        try:
            return self.enc.decode_single_token_bytes(i).decode("utf-8", errors="replace")
        except KeyError:
            return None

    def _encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special="all", disallowed_special=())

    def _decode(self, ids: list[int]) -> str:
        V = self.vocab_size
        return self.enc.decode([i for i in ids if 0 <= i < V], errors="replace")

    @property
    def vocab_size(self) -> int:
        return self.n_ranks + NUM_SPECIAL_SLOTS

    def grammar_vocabulary(self, vocab_size: int, eos_token_ids):
        """The grammar engine's view of this vocabulary (gpu_service.runtime.vocab)."""
        from gpu_service.runtime.vocab import TiktokenVocabulary

        return TiktokenVocabulary(self.enc, vocab_size, tuple(eos_token_ids))
