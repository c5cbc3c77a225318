"""DeepSeek-V4's chat format, built in (the release ships a Python encoder, no Jinja template).

Written from `../shared/formats-v4.md` section 3 (the rules of DeepSeek's `encoding_dsv4.py`;
`\\n` a newline):

    BOS, then [the "Reasoning Effort: Absolute maximum..." paragraph: thinking on, effort "max"], then:
    system          content [+ "\\n\\n" + tools section]
    developer       "<｜User｜>" content [+ "\\n\\n" + tools section]
    user            "<｜User｜>" + its parts joined by "\\n\\n": text, or "<tool_result>" R "</tool_result>"
    assistant       [reasoning "</think>": thinking on, kept] content [DSML "tool_calls" block] EOS
    after a user / developer message that is last or followed by an assistant:
                    "<｜Assistant｜>" + ("<think>" thinking on and (at/after the last user message or
                    thinking kept) else "</think>")

There is no tool role: each run of `tool` messages (and the user text right after them) is one
user message whose parts are the results, ordered as the preceding assistant's `tool_calls` (by
id); consecutive user messages are one message too. Request-level `tools` go to the first message
when it is a system or developer message, else into a new empty system message first. With
thinking on, earlier turns (before the last user / developer message) lose their reasoning and
earlier developer messages vanish ("drop thinking"), unless any message carries tools or
`drop_thinking` is false. `chat_template_kwargs`: `thinking` (or `enable_thinking`; default
false), `reasoning_effort` (`REASONING_EFFORTS`: "max" writes the paragraph, "high" nothing;
thinking on only), `drop_thinking` (default true). The user suffix is the generation prompt, so
`add_generation_prompt` adds nothing (a conversation ending in an assistant message is continued).
A `</tool_result>` inside a result is written as is (as vLLM's copy of the encoder does).
"""
from __future__ import annotations

from gpu_service.api.chat_formats.common import ChatTemplateError, THINK_END, THINK_START
from gpu_service.api.chat_formats.dsml import (ASSISTANT, BOS, EOS, USER, V4_BLOCK, assistant_calls, reasoning_of,
                                               tool_schemas)

RESULT_BEGIN, RESULT_END = "<tool_result>", "</tool_result>"
REASONING_EFFORTS = ("high", "max")
REASONING_EFFORT_MAX = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")
TOOLS_TEMPLATE = """## Tools

You have access to a set of tools to help answer the user's question. You can invoke tools by writing a \
"<｜DSML｜tool_calls>" block like the following:

<｜DSML｜tool_calls>
<｜DSML｜invoke name="$TOOL_NAME">
<｜DSML｜parameter name="$PARAMETER_NAME" string="true|false">$PARAMETER_VALUE</｜DSML｜parameter>
...
</｜DSML｜invoke>
<｜DSML｜invoke name="$TOOL_NAME2">
...
</｜DSML｜invoke>
</｜DSML｜tool_calls>

String parameters should be specified as is and set `string="true"`. For all other types (numbers, booleans, \
arrays, objects), pass the value in JSON format and set `string="false"`.

If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside \
<think>...</think> BEFORE any tool calls or final response.

Otherwise, output directly after </think> with tool calls or final response.

### Available Tool Schemas

{tool_schemas}

You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.
"""
KWARGS = ("thinking", "enable_thinking", "reasoning_effort", "drop_thinking")
USER_ROLES = ("user", "developer")


def tools_section(tools: list[dict]) -> str:
    """The `## Tools` section listing `tools` (OpenAI `{type, function}` items or bare functions)."""
    return TOOLS_TEMPLATE.replace("{tool_schemas}", tool_schemas(tools))


def merge_tool_results(messages: list[dict]) -> list[dict]:
    """`tool` messages and user text after them -> user messages with `parts` [(kind, text, id)],
    kind "text" or "result"; several results in the order of the last assistant's `tool_calls` ids."""
    out: list[dict] = []
    order: dict[str, int] = {}
    for m in messages:
        role = m.get("role")
        if role == "assistant" and m.get("tool_calls"):
            order = {c["id"]: k for k, c in enumerate(m["tool_calls"]) if isinstance(c, dict) and c.get("id")}
        if role in ("tool", "user"):
            part = ("result" if role == "tool" else "text", m.get("content") or "", m.get("tool_call_id") or "")
            if out and out[-1]["role"] == "user":
                out[-1]["parts"].append(part)
            else:
                out.append({"role": "user", "parts": [part], "order": order})
        else:
            out.append(m)
    for m in out:
        if m["role"] == "user" and sum(p[0] == "result" for p in m["parts"]) > 1:
            results = iter(sorted((p for p in m["parts"] if p[0] == "result"), key=lambda p: m["order"].get(p[2], 0)))
            m["parts"] = [next(results) if p[0] == "result" else p for p in m["parts"]]
    return out


def last_user(messages: list[dict]) -> int:
    """Index of the last user / developer message (-1: none)."""
    return max((i for i, m in enumerate(messages) if m["role"] in USER_ROLES), default=-1)


def drop_thinking(messages: list[dict]) -> list[dict]:
    """Before the last user message: assistants lose their reasoning, developer messages go."""
    last = last_user(messages)
    out = []
    for i, m in enumerate(messages):
        if i >= last or m["role"] not in ("assistant", "developer"):
            out.append(m)
        elif m["role"] == "assistant":
            out.append({k: v for k, v in m.items() if k not in ("reasoning", "reasoning_content")})
    return out


def options(kwargs: dict) -> tuple[bool, str | None, bool]:
    """(thinking, reasoning effort, drop thinking) from chat_template_kwargs; ChatTemplateError
    naming the allowed keys and values."""
    unknown = sorted(set(kwargs) - set(KWARGS))
    if unknown:
        raise ChatTemplateError(f"chat_template_kwargs {unknown} unknown to the DeepSeek-V4 format; it takes "
                                f"{list(KWARGS)}")
    for key in ("thinking", "enable_thinking", "drop_thinking"):
        if key in kwargs and not isinstance(kwargs[key], bool):
            raise ChatTemplateError(f"chat_template_kwargs {key} must be true or false, got {kwargs[key]!r}")
    if "thinking" in kwargs and "enable_thinking" in kwargs and kwargs["thinking"] != kwargs["enable_thinking"]:
        raise ChatTemplateError("chat_template_kwargs thinking and enable_thinking disagree: send one")
    thinking = bool(kwargs.get("thinking", kwargs.get("enable_thinking", False)))
    effort = kwargs.get("reasoning_effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise ChatTemplateError(f"chat_template_kwargs reasoning_effort {effort!r} is not one the DeepSeek-V4 "
                                f"format knows: use one of {', '.join(REASONING_EFFORTS)} (or leave it out)")
    if effort is not None and not thinking:
        raise ChatTemplateError(f"chat_template_kwargs reasoning_effort {effort!r} applies to thinking mode only: "
                                "set chat_template_kwargs thinking true, or leave reasoning_effort out")
    return thinking, effort, bool(kwargs.get("drop_thinking", True))


class DeepseekV4Format:
    family = "deepseek_v4"
    name = "deepseek_v4 (built in)"
    template_kwargs = KWARGS  # `thinking`: the on/off switch reasoning_effort "none" turns off
    reasoning_efforts = REASONING_EFFORTS  # chat_template_kwargs reasoning_effort (absent: none)

    def __init__(self, bos: str = BOS, eos: str = EOS):
        self.bos, self.eos = bos, eos

    @classmethod
    def from_checkpoint(cls, model_dir: str, special_tokens: dict[str, str]) -> "DeepseekV4Format":
        """The format with the checkpoint's BOS / EOS strings."""
        return cls(special_tokens.get("bos_token", BOS), special_tokens.get("eos_token", EOS))

    def _message(self, i: int, msgs: list[dict], thinking: bool, drop: bool, last: int) -> str:
        """Message `i` of the prepared conversation, with the generation prompt when it is due."""
        m, role = msgs[i], msgs[i]["role"]
        content = m.get("content") or ""
        tools = "\n\n" + tools_section(m["tools"]) if m.get("tools") else ""
        if role == "system":
            out = content + tools
        elif role == "developer":
            out = USER + content + tools
        elif role == "user":
            out = USER + "\n\n".join(text if kind == "text" else RESULT_BEGIN + text + RESULT_END
                                     for kind, text, _ in m["parts"])
        elif role == "assistant":
            kept = thinking and (not drop or i > last)
            out = (reasoning_of(m) + THINK_END if kept else "") + content + assistant_calls(m, i, V4_BLOCK) + self.eos
        else:
            raise ChatTemplateError(f"messages[{i}].role {role!r} is not one the DeepSeek-V4 format knows")
        if i + 1 < len(msgs) and msgs[i + 1]["role"] != "assistant":
            return out
        if role in USER_ROLES:
            out += ASSISTANT + (THINK_START if thinking and (not drop or i >= last) else THINK_END)
        return out

    def render(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
               **kwargs) -> str:
        """The prompt text of `messages` (OpenAI dicts) with request-level `tools`."""
        thinking, effort, drop = options(kwargs)
        msgs = [dict(m) for m in messages]
        for i, m in enumerate(msgs):
            if m.get("role") == "developer" and not m.get("content"):
                raise ChatTemplateError(f"messages[{i}]: a developer message needs content")
        if tools:
            if msgs and msgs[0].get("role") in ("system", "developer"):
                msgs[0]["tools"] = tools
            else:
                msgs.insert(0, {"role": "system", "content": "", "tools": tools})
        msgs = merge_tool_results(msgs)
        drop = drop and not any(m.get("tools") for m in msgs)
        if thinking and drop:
            msgs = drop_thinking(msgs)
        last = last_user(msgs)
        out = [self.bos, REASONING_EFFORT_MAX if thinking and effort == "max" and msgs else ""]
        out += [self._message(i, msgs, thinking, drop, last) for i in range(len(msgs))]
        return "".join(out)
