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
import os
import string

from gpu_service.api.chat_formats.common import ChatTemplateError, THINK_END, THINK_START
from gpu_service.api.chat_formats.dsml import (ASSISTANT, BOS, EOS, INVOKE_END, PARAM_END, USER, V32_BLOCK,  # noqa: F401
                                               assistant_calls, block_markers, reasoning_of, tool_schemas)

CALLS_BEGIN, CALLS_END = block_markers(V32_BLOCK)
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
        return _fill(self.tools_template, tool_schemas(tools))

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
                    out.append(reasoning_of(m) + THINK_END)
                out.append(content + assistant_calls(m, i, V32_BLOCK) + self.eos)
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
