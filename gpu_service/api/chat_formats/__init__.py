"""Chat formats: how a conversation (+ tools) becomes the prompt text, per model family.

`JinjaFormat` renders the checkpoint's template as transformers does (`chat_template` of
tokenizer_config.json, or `chat_template.jinja`; `--chat-template FILE` overrides both);
`DeepseekV32Format` and `DeepseekV4Format` are the built-in formats of V3.2 and V4 (their releases
ship Python encoders, no template). Each has `render(messages, tools=None,
add_generation_prompt=True, **chat_template_kwargs) -> str` and `family`, which picks the
reasoning and tool-call parsers (`gpu_service.api.parsers`).
"""
from __future__ import annotations

import os

from gpu_service.api.chat_formats.common import (DEEPSEEK_TOOL_TOKENS, FAMILIES, KIMI_TOOL_TOKENS, MARKERS, THINK_END,
                                                 THINK_START, ChatTemplateError)
from gpu_service.api.chat_formats.dsv32 import DeepseekV32Format
from gpu_service.api.chat_formats.dsv4 import DeepseekV4Format
from gpu_service.api.chat_formats.jinja_format import JinjaFormat

__all__ = ["ChatTemplateError", "DeepseekV32Format", "DeepseekV4Format", "JinjaFormat", "MARKERS", "THINK_END", "THINK_START",
           "DEEPSEEK_TOOL_TOKENS", "FAMILIES", "KIMI_TOOL_TOKENS", "load_chat_format", "template_family"]


def template_family(template: str, model_config: dict) -> str | None:
    """The model family a Jinja template (and config.json) belongs to, from the markers it writes."""
    archs = model_config.get("architectures") or []
    if "DeepseekV32ForCausalLM" in archs:
        return "deepseek_v32"
    if "DeepseekV4ForCausalLM" in archs:
        return "deepseek_v4"
    if "<|im_middle|>" in template or model_config.get("model_type") in ("kimi_k2", "kimi_k25"):
        return "kimi_k2"
    if "<｜Assistant｜>" in template:
        if "<｜tool▁sep｜>" in template and "```json" not in template and "function<｜tool▁sep｜>" not in template:
            return "deepseek_v31"
        # R1: the generation prompt opens the reasoning
        gen = template.rsplit("add_generation_prompt", 1)[-1]
        return "deepseek_r1" if THINK_START in gen else "deepseek_v3"
    return None


def _template_from_config(config: dict) -> str | None:
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    return tpl if isinstance(tpl, str) else None


def load_chat_format(model_dir: str, tokenizer_config: dict, model_config: dict, special_tokens: dict[str, str],
                     override: str | None = None):
    """The chat format for a checkpoint, or None (completions only): `override` (a Jinja file), then
    tokenizer_config.json `chat_template`, `chat_template.jinja`, the built-in V3.2 / V4 format."""
    source, template = None, None
    if override:
        try:
            with open(override, encoding="utf-8") as f:
                template, source = f.read(), override
        except OSError as e:
            raise ChatTemplateError(f"--chat-template {override}: {e.strerror}") from None
    if template is None:
        template = _template_from_config(tokenizer_config)
        source = "tokenizer_config.json chat_template" if template is not None else None
    path = os.path.join(model_dir, "chat_template.jinja")
    if template is None and os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            template, source = f.read(), path
    if template is not None:
        return JinjaFormat(template, source, special_tokens, template_family(template, model_config))
    archs = model_config.get("architectures") or []
    if "DeepseekV32ForCausalLM" in archs:
        return DeepseekV32Format.from_checkpoint(model_dir, special_tokens)
    if "DeepseekV4ForCausalLM" in archs or model_config.get("model_type") == "deepseek_v4":
        return DeepseekV4Format.from_checkpoint(model_dir, special_tokens)
    return None
