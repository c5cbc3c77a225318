"""Grammars that force a tool call in the model's native syntax (`tool_choice` required / named).

The prompt already ends with the call's opening (`ToolParser.forced_prefix`); the grammar
(llguidance Lark, compiled by gpu_service.runtime.grammar) constrains the rest: the function
name (for `required`, one of `tools`), the arguments valid for its JSON schema (compact JSON), and
the closing markers. Reaching the grammar's end stops the request, and the text goes through the
same tool-call parser as an unforced call. Markers that are single tokens are matched by id
(`<[id]>`, special or not); other text by literal.

    kimi_k2       [NAME ":N" <|tool_call_argument_begin|>] JSON <|tool_call_end|> <|tool_calls_section_end|>
    deepseek_v3   [NAME "\\n```json\\n"] JSON "\\n```" <｜tool▁call▁end｜> <｜tool▁calls▁end｜>
    deepseek_v31  [NAME <｜tool▁sep｜>] JSON <｜tool▁call▁end｜> <｜tool▁calls▁end｜>
    deepseek_v32  [NAME '">\\n'] {DSML parameter "\\n"} "</｜DSML｜invoke>\\n</｜DSML｜function_calls>"
    deepseek_v4   the same, closing "</｜DSML｜tool_calls>"
                  (string properties raw: an enum's values, else text without '<' up to maxLength
                  or FORCED_STRING_MAX_CHARS;
                  others as JSON for their sub-schema; required ones in order, the others optional)
(the bracketed part only for `required`: the prompt's prefix already names a named function).
Forced calls on open schemas: objects are closed and unbounded strings capped (`closed_schema`:
no undeclared key, no string past FORCED_STRING_MAX_CHARS); `max_tokens` still cuts a call short
(finish_reason `length`; such a call sent back as history renders as the client holds it).
Kimi's call ids count across the conversation: N is `call_index`, the number of tool calls already
in the history, so a forced loop gets `functions.f:0`, `functions.f:1`, ... (one call per forced turn).
"""
from __future__ import annotations

import json

from gpu_service.api.chat_formats import dsml

JSON_OPTIONS = {"whitespace_flexible": False}
OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
# the stated cap on a forced call: a string the schema leaves unbounded is at most this many characters
FORCED_STRING_MAX_CHARS = 8192
STRING_BOUNDS = ("maxLength", "enum", "const", "pattern", "format")


def closed_schema(schema):
    """`schema` as a forced call writes it: every object that does not say otherwise closed
    (`additionalProperties: false`): a tool uses no key it did not declare, so a forced call never
    writes one (LangChain's default schemas leave the keyword out); an object that sets any of
    OPEN_KEYWORDS keeps its own rule, as do the branches of an `allOf` (closing each would refuse
    the others' keys). A string with none of STRING_BOUNDS gets maxLength FORCED_STRING_MAX_CHARS,
    so a model that never closes a string still ends the call."""
    if isinstance(schema, list):
        return [closed_schema(x) for x in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in ("properties", "$defs", "definitions", "dependentSchemas") and isinstance(v, dict):
            out[k] = {name: closed_schema(sub) for name, sub in v.items()}
        elif k in ("items", "prefixItems", "anyOf", "oneOf", "not", "if", "then", "else", "contains",
                   "additionalItems"):
            out[k] = closed_schema(v)
        else:
            out[k] = v
    is_object = out.get("type") == "object" or (isinstance(out.get("type"), list) and "object" in out["type"]) \
        or "properties" in out
    if is_object and not any(k in out for k in OPEN_KEYWORDS):
        out["additionalProperties"] = False
    if out.get("type") == "string" and not any(k in out for k in STRING_BOUNDS):
        out["maxLength"] = FORCED_STRING_MAX_CHARS
    return out


def _schema(fn: dict) -> dict:
    s = closed_schema(dict(fn.get("parameters") or {"type": "object"}))
    s["x-guidance"] = JSON_OPTIONS
    return s


class _Lark:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.rules: list[str] = []
        self.n = 0

    def marker(self, text: str) -> str:
        """A marker: by token id when it is one token of the vocabulary, else as a literal."""
        i = self.tokenizer.token_id(text)
        return f"<[{i}]>" if i is not None else json.dumps(text)

    def json_rule(self, schema: dict) -> str:
        self.n += 1
        name = f"j{self.n}"
        self.rules.append(f"{name}: %json {json.dumps(schema, ensure_ascii=False)}")
        return name

    def text(self, start: str) -> str:
        return "\n".join([f"start: {start}"] + self.rules) + "\n"


def _dsml_params(g: _Lark, fn: dict, block: str) -> str:
    """The parameters of `fn` as DSML then the closing markers of the invoke and of `block`."""
    schema = fn.get("parameters") or {}
    props = schema.get("properties") or {}
    required = set(schema.get("required") or [])
    parts = []
    for key, sub in props.items():
        sub = sub if isinstance(sub, dict) else {}
        head = f'<｜DSML｜parameter name="{key}" string='
        if sub.get("type") == "string":
            if isinstance(sub.get("enum"), list) and sub["enum"]:
                value = "(" + " | ".join(json.dumps(str(v)) for v in sub["enum"]) + ")"
            else:
                n = sub.get("maxLength")
                value = f"/[^<]{{0,{int(n) if isinstance(n, int) else FORCED_STRING_MAX_CHARS}}}/"
            item = f'{json.dumps(head + chr(34) + "true" + chr(34) + ">")} {value} {json.dumps(dsml.PARAM_END)}'
        else:
            value = g.json_rule({**closed_schema(sub), "x-guidance": JSON_OPTIONS})
            item = f'{json.dumps(head + chr(34) + "false" + chr(34) + ">")} {value} {json.dumps(dsml.PARAM_END)}'
        item = f'({item} "\\n")'
        parts.append(item if key in required else item + "?")
    return " ".join(parts + [json.dumps(dsml.INVOKE_END + "\n" + dsml.block_markers(block)[1])])


def tool_call_grammar(parser: str, tools: list[dict], choice, tokenizer, call_index: int = 0):
    """The GrammarSpec (Lark) of the forced continuation, for parser `parser` (a TOOL_PARSERS name);
    `call_index`: the tool calls already in the conversation (Kimi's ids count on from it)."""
    from gpu_service.runtime.grammar import GrammarSpec

    g = _Lark(tokenizer)
    fns = [t["function"] for t in tools]
    named = choice["function"]["name"] if isinstance(choice, dict) else None
    alts = []
    for fn in fns if named is None else [f for f in fns if f["name"] == named]:
        name = json.dumps(fn["name"])
        if parser == "kimi_k2":
            body = f"{g.json_rule(_schema(fn))} {g.marker('<|tool_call_end|>')} {g.marker('<|tool_calls_section_end|>')}"
            call_id = f"{fn['name']}:{int(call_index)}"
            head = f"{json.dumps(call_id)} {g.marker('<|tool_call_argument_begin|>')} "
        elif parser == "deepseek_v3":
            body = (f"{g.json_rule(_schema(fn))} {json.dumps(chr(10) + '```')} {g.marker('<｜tool▁call▁end｜>')} "
                    f"{g.marker('<｜tool▁calls▁end｜>')}")
            head = f"{name} {json.dumps(chr(10) + '```json' + chr(10))} "
        elif parser == "deepseek_v31":
            body = f"{g.json_rule(_schema(fn))} {g.marker('<｜tool▁call▁end｜>')} {g.marker('<｜tool▁calls▁end｜>')}"
            head = f"{name} {g.marker('<｜tool▁sep｜>')} "
        elif parser in ("deepseek_v32", "deepseek_v4"):
            body = _dsml_params(g, fn, dsml.V32_BLOCK if parser == "deepseek_v32" else dsml.V4_BLOCK)
            head = f"{name} {json.dumps(chr(34) + '>' + chr(10))} "
        else:
            raise ValueError(f"no tool-call grammar for parser {parser!r}")
        alts.append(body if named is not None else head + body)
    return GrammarSpec.lark(g.text(" | ".join(f"({a})" for a in alts)))
