"""Text <-> token ids with the checkpoint's tokenizer.json, and its chat template (jinja2).

Uses the `tokenizers` library directly: no transformers import at run time."""
from __future__ import annotations

import json
import os

import jinja2


class TokenizerError(ValueError):
    pass


class Tokenizer:
    def __init__(self, model_dir: str):
        from tokenizers import Tokenizer as _Tok

        path = os.path.join(model_dir, "tokenizer.json")
        if not os.path.exists(path):
            raise TokenizerError(
                f"{model_dir}: no tokenizer.json; pass token ids with --prompt-ids instead of text")
        self.tok = _Tok.from_file(path)
        cfg_path = os.path.join(model_dir, "tokenizer_config.json")
        self.config = json.load(open(cfg_path)) if os.path.exists(cfg_path) else {}
        self.bos_token = self._tok_str(self.config.get("bos_token"))
        self.eos_token = self._tok_str(self.config.get("eos_token"))
        self.add_bos = bool(self.config.get("add_bos_token", self.bos_token is not None))
        tpl = self.config.get("chat_template")
        if isinstance(tpl, list):  # [{"name": "default", "template": ...}]
            tpl = next((t["template"] for t in tpl if t.get("name") == "default"), tpl[0]["template"])
        self.chat_template = tpl

    @staticmethod
    def _tok_str(t):
        return t.get("content") if isinstance(t, dict) else t

    def token_id(self, s: str | None) -> int | None:
        return None if s is None else self.tok.token_to_id(s)

    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        ids = self.tok.encode(text, add_special_tokens=False).ids
        bos = self.token_id(self.bos_token)
        if (self.add_bos if add_bos is None else add_bos) and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise TokenizerError("tokenizer_config.json has no chat_template; use the completions API")
        env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(msg):
            raise TokenizerError(msg)

        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        # the template already starts with the BOS token
        return self.encode(self.apply_chat_template(messages), add_bos=False)
