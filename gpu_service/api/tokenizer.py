"""Tokenizers of the checkpoint directory: `tokenizer.json` (DeepSeek, `HFTokenizer`) or
`tiktoken.model` (Kimi-K2, `gpu_service.api.tiktoken_tokenizer.TiktokenTokenizer`).

Both parse special-token strings in text as special tokens; `decode(skip_special_tokens=True)`
keeps the ones the output parsers need (`keep_special`: `<think>`, tool-call markers). Partial
multi-byte characters decode to U+FFFD, which the engine's incremental detokenizer waits out.
`load_tokenizer(model_dir)` (alias `Tokenizer`) also attaches the chat format
(`gpu_service.api.chat_formats`). No transformers import at run time.
"""
from __future__ import annotations

import os

from checkpoint import kimi_k25
from gpu_service.api import chat_formats
from gpu_service.api.tiktoken_tokenizer import TiktokenTokenizer
from gpu_service.api.tokenizer_base import BaseTokenizer, TokenizerError, _read_json

__all__ = ["BaseTokenizer", "HFTokenizer", "TiktokenTokenizer", "Tokenizer", "TokenizerError", "load_tokenizer"]

TOKENIZER_FILES = ("tokenizer.json", "tiktoken.model")


class HFTokenizer(BaseTokenizer):
    """tokenizer.json through the `tokenizers` library."""

    kind = "tokenizer.json"

    def __init__(self, model_dir: str, config: dict):
        from tokenizers import Tokenizer as _Tok

        super().__init__(model_dir, config)
        self.tok = _Tok.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.special_ids = {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}

    def token_id(self, s: str | None) -> int | None:
        return None if s is None else self.tok.token_to_id(s)

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size()


def load_tokenizer(model_dir: str, chat_template: str | None = None) -> BaseTokenizer:
    """The checkpoint's tokenizer (tokenizer.json, else tiktoken.model) with its chat format attached
    (`chat_template`: a file overriding it); TokenizerError naming the files when there is neither."""
    config = _read_json(os.path.join(model_dir, "tokenizer_config.json"))
    if os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        tok: BaseTokenizer = HFTokenizer(model_dir, config)
    elif os.path.exists(os.path.join(model_dir, "tiktoken.model")):
        tok = TiktokenTokenizer(model_dir, config)
    else:
        raise TokenizerError(
            f"{model_dir}: no tokenizer: looked for {' and '.join(TOKENIZER_FILES)} (with tokenizer_config.json); "
            "copy the checkpoint's tokenizer files there, or pass token ids (--prompt-ids / prompt arrays)")
    model_config = _read_json(os.path.join(model_dir, "config.json"))
    if kimi_k25.is_kimi_k25(model_config):  # image parts are refused naming the unserved vision tower
        tok.vision_wrapper = (model_config.get("architectures") or [kimi_k25.ARCHITECTURE])[0]
    try:
        tok.chat_format = chat_formats.load_chat_format(model_dir, config, model_config, tok.special_tokens_map(),
                                                        override=chat_template)
    except chat_formats.ChatTemplateError as e:
        raise TokenizerError(str(e)) from None
    tok.keep_special(chat_formats.MARKERS)
    return tok


Tokenizer = load_tokenizer  # the name callers used before there were two backends
