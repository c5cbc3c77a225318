"""A checkpoint's Jinja chat template, rendered the way transformers' `apply_chat_template` does.

The same environment: sandboxed, `trim_blocks` + `lstrip_blocks`, the `loopcontrols` extension,
`tojson` without HTML escaping (ensure_ascii off, `indent`/`separators`/`sort_keys`),
`raise_exception`, `strftime_now`; the same variables: `messages`, `tools`, `documents`,
`add_generation_prompt`, the special tokens (`bos_token`, `eos_token`, ...) and the request's
`chat_template_kwargs`; reasoning copied under `reasoning_content` and `thinking` as transformers
does. `{% generation %}` blocks (assistant-mask markers) render their body. A template reading
`tools_ts_str` (Kimi-K2.5 / K2.6) gets the tools deep-sorted and as TypeScript (chat_formats.tools_ts),
as their tokenizer's apply_chat_template passes them.
"""
from __future__ import annotations

import datetime
import json

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gpu_service.api.chat_formats.common import ChatTemplateError
from gpu_service.api.chat_formats.tools_ts import deep_sort, tools_typescript

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: renders its body (we need no assistant mask)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.datetime.now().strftime(fmt)


def make_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def alias_reasoning(messages: list[dict]) -> list[dict]:
    """Reasoning under any of its names -> also `reasoning_content` and `thinking` (as transformers)."""
    out = []
    for m in messages:
        r = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append({"thinking": r, **m, "reasoning_content": r} if r is not None else m)
    return out


class JinjaFormat:
    """One compiled template; `render` raises ChatTemplateError with the template's message."""

    def __init__(self, template: str, source: str | None, special_tokens: dict[str, str], family: str | None):
        self.template_text = template
        self.source = source or "chat template"
        self.special_tokens = dict(special_tokens)
        self.family = family
        self.name = f"jinja ({self.source})"
        try:
            self.template = make_environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{self.source}: line {e.lineno}: {e.message}") from None

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        if tools and "tools_ts_str" in self.template_text and "tools_ts_str" not in kwargs:
            tools = deep_sort(tools)  # Kimi-K2.5 / K2.6: as their tokenizer, sorted, with the TypeScript text
            kwargs = {**kwargs, "tools_ts_str": tools_typescript(tools)}
        variables = {**self.special_tokens, **kwargs}
        try:
            return self.template.render(messages=alias_reasoning(messages), tools=tools, documents=None,
                                        add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"{self.source}: {e}") from None
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            raise ChatTemplateError(f"{self.source}: the template failed on this conversation: "
                                    f"{type(e).__name__}: {e}") from None
