"""DeepSeek-V3.2's chat format, built in (the release ships Python encoding code, no Jinja template).

Written from `../shared/formats.md` (`\\n` a newline; BOS/EOS the checkpoint's tokens):

    BOS, then each message:
    system      content [+ "\\n\\n" + tools preamble ending "<functions>\\n{schemas, one per line}\\n</functions>\\n"]
    user        "<｜User｜>" content "<｜Assistant｜>" + ("<think>" if last user message and thinking else "</think>")
    assistant   [reasoning "</think>"  (thinking on, after the last user message)] content [DSML calls] EOS
    tool(s)     "\\n\\n<function_results>" {"\\n<result>" content "</result>"} "\\n</function_results>"
                + ("\\n\\n<think>" thinking on and after the last user message, else "\\n\\n</think>")

DSML calls: "\\n\\n<｜DSML｜function_calls>\\n" + invokes joined by "\\n" + "\\n</｜DSML｜function_calls>";
an invoke: `<｜DSML｜invoke name="N">` "\\n" + parameters joined by "\\n" + "\\n</｜DSML｜invoke>"; a
parameter: `<｜DSML｜parameter name="K" string="true">raw string</｜DSML｜parameter>`, or
`string="false"` with the value as JSON; arguments that are not a JSON object (a call cut short by
`max_tokens`) go in raw as the invoke's body. Request-level `tools` go to the first system message (an
empty one is inserted when there is none). The preamble's wording is `TOOLS_SYSTEM_TEMPLATE` of the
checkpoint's `encoding/encoding_dsv32.py`, read as data (`ast.literal_eval`, never executed), else
our own (`DEFAULT_TOOLS_TEMPLATE`). `chat_template_kwargs`: `thinking` (default false). The
user / tool-result suffix is the generation prompt, so `add_generation_prompt` adds nothing.
"""
from __future__ import annotations

import ast
import json
import os
import string

from gpu_service.api.chat_formats.common import ChatTemplateError, THINK_END, THINK_START

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
CALLS_BEGIN, CALLS_END = "<｜DSML｜function_calls>", "</｜DSML｜function_calls>"
INVOKE_END, PARAM_END = "</｜DSML｜invoke>", "</｜DSML｜parameter>"
RESULTS_BEGIN, RESULTS_END = "<function_results>", "</function_results>"

DEFAULT_TOOLS_TEMPLATE = """## Tools

You can call the functions below. To call them, write a block like this in your reply:
<｜DSML｜function_calls>
<｜DSML｜invoke name="FUNCTION">
<｜DSML｜parameter name="PARAMETER" string="true">a string value, written as is</｜DSML｜parameter>
<｜DSML｜parameter name="PARAMETER" string="false">any other value, as JSON</｜DSML｜parameter>
</｜DSML｜invoke>
</｜DSML｜function_calls>
Several invokes may go in one block. The results come back in <function_results>.

The functions, as JSON schemas:
<functions>
{tool_schemas}
</functions>
"""
KWARGS = ("thinking",)


def invoke_text(name: str, arguments: dict) -> str:
    """One DSML invoke for `arguments` (a dict)."""
    params = []
    for k, v in arguments.items():
        if isinstance(v, str):
            params.append(f'<｜DSML｜parameter name="{k}" string="true">{v}{PARAM_END}')
        else:
            params.append(f'<｜DSML｜parameter name="{k}" string="false">{json.dumps(v, ensure_ascii=False)}{PARAM_END}')
    return f'<｜DSML｜invoke name="{name}">\n' + "\n".join(params) + f"\n{INVOKE_END}"


def calls_text(invokes: list[str]) -> str:
    return f"\n\n{CALLS_BEGIN}\n" + "\n".join(invokes) + f"\n{CALLS_END}"


def read_tools_template(model_dir: str) -> str | None:
    """TOOLS_SYSTEM_TEMPLATE from the checkpoint's encoding/encoding_dsv32.py (as data), or None."""
    path = os.path.join(model_dir, "encoding", "encoding_dsv32.py")
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "TOOLS_SYSTEM_TEMPLATE" for t in node.targets):
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                return None  # not a plain literal: use our wording
            return value if isinstance(value, str) else None
    return None


def _fill(template: str, schemas: str) -> str:
    """Put the schemas into the template's one `{field}`, else after it."""
    fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    if len(set(fields)) == 1:  # a str.format template: unescape {{ }} around the field, not in the schemas
        parts = template.split("{" + fields[0] + "}")
        return schemas.join(p.replace("{{", "{").replace("}}", "}") for p in parts)
    return template.rstrip("\n") + f"\n<functions>\n{schemas}\n</functions>\n"


def _invoke(call: dict, where: str) -> str:
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
            return f'<｜DSML｜invoke name="{fn["name"]}">\n{args}\n{INVOKE_END}'
        args = parsed
    if not isinstance(args, dict):
        raise ChatTemplateError(f"{where}.function.arguments must be a JSON object or a string")
    return invoke_text(fn["name"], args)


class DeepseekV32Format:
    family = "deepseek_v32"
    name = "deepseek_v32 (built in)"
    template_kwargs = KWARGS  # the chat_template_kwargs it takes (`thinking`: reasoning_effort's switch)

    def __init__(self, tools_template: str | None = None, bos: str = BOS, eos: str = EOS):
        self.tools_template = tools_template or DEFAULT_TOOLS_TEMPLATE
        self.bos, self.eos = bos, eos

    @classmethod
    def from_checkpoint(cls, model_dir: str, special_tokens: dict[str, str]) -> "DeepseekV32Format":
        return cls(read_tools_template(model_dir), special_tokens.get("bos_token", BOS),
                   special_tokens.get("eos_token", EOS))

    def tools_part(self, tools: list[dict]) -> str:
        lines = [json.dumps(t.get("function", t) if isinstance(t, dict) else t, ensure_ascii=False) for t in tools]
        return _fill(self.tools_template, "\n".join(lines))

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        unknown = sorted(set(kwargs) - set(KWARGS))
        if unknown:
            raise ChatTemplateError(f"chat_template_kwargs {unknown} unknown to the DeepSeek-V3.2 format; "
                                    f"it takes {list(KWARGS)}")
        thinking = bool(kwargs.get("thinking", False))
        msgs = list(messages)
        holder = None
        if tools:
            holder = next((i for i, m in enumerate(msgs) if m.get("role") == "system"), None)
            if holder is None:
                msgs.insert(0, {"role": "system", "content": ""})
                holder = 0
        last_user = max((i for i, m in enumerate(msgs) if m.get("role") in ("user", "developer")), default=-1)
        out = [self.bos]
        i = 0
        while i < len(msgs):
            m, role = msgs[i], msgs[i].get("role")
            content = m.get("content") or ""
            if role == "system":
                out.append(content + ("\n\n" + self.tools_part(tools) if i == holder else ""))
            elif role in ("user", "developer"):
                out.append(USER + content + ASSISTANT + (THINK_START if thinking and i == last_user else THINK_END))
            elif role == "assistant":
                if thinking and i > last_user:
                    reasoning = m.get("reasoning_content") or m.get("reasoning") or ""
                    out.append(reasoning + THINK_END)
                out.append(content)
                calls = m.get("tool_calls") or []
                if calls:
                    out.append(calls_text([_invoke(c, f"messages[{i}].tool_calls[{j}]")
                                           for j, c in enumerate(calls)]))
                out.append(self.eos)
            elif role == "tool":
                j = i
                parts = [f"\n\n{RESULTS_BEGIN}"]
                while j < len(msgs) and msgs[j].get("role") == "tool":
                    parts.append(f"\n<result>{msgs[j].get('content') or ''}</result>")
                    j += 1
                parts.append(f"\n{RESULTS_END}" + ("\n\n" + THINK_START if thinking and i > last_user
                                                   else "\n\n" + THINK_END))
                out.append("".join(parts))
                i = j
                continue
            else:
                raise ChatTemplateError(f"messages[{i}].role {role!r} is not one the DeepSeek-V3.2 format knows")
            i += 1
        return "".join(out)
