"""The tokenizer seam both backends implement (`BaseTokenizer`), and `TokenizerError`.

Backends: `gpu_service.api.tokenizer.HFTokenizer` (tokenizer.json) and
`gpu_service.api.tiktoken_tokenizer.TiktokenTokenizer` (tiktoken.model); see `gpu_service.api.tokenizer`.
"""

from __future__ import annotations

import json
import os

from gpu_service.api import chat_formats


class TokenizerError(ValueError):
    pass


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _tok_str(t):
    return t.get("content") if isinstance(t, dict) else t


class BaseTokenizer:
    """What both backends share: special tokens, BOS handling, skip/keep of special ids, chat."""

    kind = "base"

    def __init__(self, model_dir: str, config: dict):
        self.model_dir = model_dir
        self.config = config
        self.bos_token = _tok_str(config.get("bos_token"))
        self.eos_token = _tok_str(config.get("eos_token"))
        self.add_bos = bool(config.get("add_bos_token", self.bos_token is not None))
        self.special_ids: set[int] = set()  # dropped by decode(skip_special_tokens=True)...
        self.kept_ids: set[int] = set()  # ...except these (parsers' markers)
        self.chat_format = None
        self.vision_wrapper: str | None = None  # a multimodal checkpoint's architecture (api.tokenizer)
        gen = _read_json(os.path.join(model_dir, "generation_config.json"))
        eos = gen.get("eos_token_id")
        self.generation_config = gen
        self.stop_token_ids: tuple[int, ...] = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])

    # ---- backend hooks ----------------------------------------------------------------------
    def token_id(self, s: str | None) -> int | None:
        raise NotImplementedError

    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int]) -> str:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    # ---- shared -------------------------------------------------------------------------------
    def special_tokens_map(self) -> dict[str, str]:
        """Template variables transformers passes: bos_token, eos_token, pad_token, unk_token."""
        out = {}
        for k in ("bos_token", "eos_token", "pad_token", "unk_token"):
            v = _tok_str(self.config.get(k))
            if v is not None:
                out[k] = v
        return out

    def keep_special(self, strings) -> None:
        """Keep these special tokens (by their text) in decode(skip_special_tokens=True) output."""
        for s in strings:
            i = self.token_id(s)
            if i is not None:
                self.kept_ids.add(i)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Special-token strings in `text` become their ids; BOS prepended when configured."""
        ids = self._encode(text)
        bos = self.token_id(self.bos_token)
        if (self.add_bos if add_bos is None else add_bos) and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if skip_special_tokens:
            drop = self.special_ids - self.kept_ids
            ids = [i for i in ids if i not in drop]
        return self._decode(list(ids))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, **kwargs) -> str:
        """Render through the checkpoint's chat format (TokenizerError when there is none)."""
        if self.chat_format is None:
            raise TokenizerError(f"{self.model_dir}: no chat template (tokenizer_config.json chat_template, "
                                 "chat_template.jinja) and no built-in format for this model; use the "
                                 "completions API or pass --chat-template FILE")
        try:
            return self.chat_format.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                           **kwargs)
        except chat_formats.ChatTemplateError as e:
            raise TokenizerError(str(e)) from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    **kwargs) -> list[int]:
        # the rendered text already starts with the BOS token when the format wants one
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs), add_bos=False)
