"""DSML, the tool-call markup of DeepSeek-V3.2 and V4: what both formats, their parsers and the
forcing grammar share.

    "\\n\\n<｜DSML｜BLOCK>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜BLOCK>"
    invoke     `<｜DSML｜invoke name="N">` "\\n" + parameters joined by "\\n" + "\\n</｜DSML｜invoke>"
    parameter  `<｜DSML｜parameter name="K" string="true">raw string</｜DSML｜parameter>`, or
               `string="false"` with the value as JSON

BLOCK is `function_calls` in V3.2 and `tool_calls` in V4 (`block_markers`). History calls whose
arguments are not a JSON object (a call cut short by `max_tokens`) go in raw as the invoke's body.
"""
from __future__ import annotations

import json

from gpu_service.api.chat_formats.common import ChatTemplateError

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
INVOKE_OPEN, PARAM_OPEN = '<｜DSML｜invoke name="', '<｜DSML｜parameter name="'
INVOKE_END, PARAM_END = "</｜DSML｜invoke>", "</｜DSML｜parameter>"
V32_BLOCK, V4_BLOCK = "function_calls", "tool_calls"


def block_markers(block: str) -> tuple[str, str]:
    """(opening, closing) marker of a calls block named `block`."""
    return f"<｜DSML｜{block}>", f"</｜DSML｜{block}>"


def invoke_text(name: str, arguments: dict) -> str:
    """One DSML invoke for `arguments` (a dict)."""
    params = []
    for k, v in arguments.items():
        if isinstance(v, str):
            params.append(f'{PARAM_OPEN}{k}" string="true">{v}{PARAM_END}')
        else:
            params.append(f'{PARAM_OPEN}{k}" string="false">{json.dumps(v, ensure_ascii=False)}{PARAM_END}')
    return f'{INVOKE_OPEN}{name}">\n' + "\n".join(params) + f"\n{INVOKE_END}"


def calls_text(invokes: list[str], block: str) -> str:
    """The calls block (with its leading blank line) holding `invokes`."""
    begin, end = block_markers(block)
    return f"\n\n{begin}\n" + "\n".join(invokes) + f"\n{end}"


def history_invoke(call: dict, where: str) -> str:
    """One history call as a DSML invoke: its arguments as parameters when they are a JSON object,
    else (a call cut short by max_tokens, or any other string a client holds) the raw text as the
    invoke's body, as OpenAI accepts any string there and the other formats render it raw."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ChatTemplateError(f"{where}.function.name is required")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            parsed = json.loads(args) if args.strip() else {}
        except (json.JSONDecodeError, RecursionError):
            parsed = None
        if not isinstance(parsed, dict):
            return f'{INVOKE_OPEN}{fn["name"]}">\n{args}\n{INVOKE_END}'
        args = parsed
    if not isinstance(args, dict):
        raise ChatTemplateError(f"{where}.function.arguments must be a JSON object or a string")
    return invoke_text(fn["name"], args)


def assistant_calls(message: dict, index: int, block: str) -> str:
    """The calls block of an assistant message's `tool_calls` ("" when it has none)."""
    calls = message.get("tool_calls") or []
    if not calls:
        return ""
    return calls_text([history_invoke(c, f"messages[{index}].tool_calls[{j}]") for j, c in enumerate(calls)], block)


def tool_schemas(tools: list[dict]) -> str:
    """The request's functions as JSON, one per line (as both encoders list them)."""
    return "\n".join(json.dumps(t.get("function", t) if isinstance(t, dict) else t, ensure_ascii=False)
                     for t in tools)


def reasoning_of(message: dict) -> str:
    """An assistant message's reasoning under any of its names ("" when none)."""
    return message.get("reasoning_content") or message.get("reasoning") or ""
