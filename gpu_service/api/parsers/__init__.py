"""Output parsers: reasoning (`reasoning`), tool calls (`tools`), and both over a stream (`stream`).

`--reasoning-parser auto|kimi_k2|deepseek_r1|deepseek_v3|deepseek_v4|none` and
`--tool-call-parser auto|kimi_k2|deepseek_v3|deepseek_v31|deepseek_v32|deepseek_v4|none`; `auto` picks
from the chat format's model family (`gpu_service.api.chat_formats`), so the target models need no
setting: Kimi-K2 -> kimi_k2 / kimi_k2; DeepSeek-V3 -> deepseek_v3 / deepseek_v3; R1 -> deepseek_v3 /
deepseek_r1; V3.1 -> deepseek_v31 / deepseek_v3; V3.2 -> deepseek_v32 / deepseek_v3; V4 -> deepseek_v4 /
deepseek_v4 (tools / reasoning).
"""
from __future__ import annotations

from gpu_service.api.parsers.base import Parsed, ToolCall, ToolParser
from gpu_service.api.parsers.reasoning import REASONING_PARSERS, ReasoningParser
from gpu_service.api.parsers.stream import ChatStream, OutputParser
from gpu_service.api.parsers.tools import TOOL_PARSERS

__all__ = ["ChatStream", "OutputParser", "Parsed", "ReasoningParser", "ToolCall", "ToolParser", "TOOL_PARSERS",
           "REASONING_PARSERS", "check_parser_name", "tool_parser_for", "reasoning_parser_for"]

FAMILY_TOOL_PARSER = {"kimi_k2": "kimi_k2", "deepseek_v3": "deepseek_v3", "deepseek_r1": "deepseek_v3",
                      "deepseek_v31": "deepseek_v31", "deepseek_v32": "deepseek_v32",
                      "deepseek_v4": "deepseek_v4"}
FAMILY_REASONING_PARSER = {"kimi_k2": "kimi_k2", "deepseek_v3": "deepseek_v3", "deepseek_r1": "deepseek_r1",
                           "deepseek_v31": "deepseek_v3", "deepseek_v32": "deepseek_v3",
                           "deepseek_v4": "deepseek_v4"}


def check_parser_name(kind: str, name: str) -> str:
    """`name` if valid for `kind` ("tool" or "reasoning"), else ValueError listing the valid names."""
    valid = ("auto",) + tuple(TOOL_PARSERS if kind == "tool" else REASONING_PARSERS) + ("none",)
    if name not in valid:
        flag = "--tool-call-parser" if kind == "tool" else "--reasoning-parser"
        raise ValueError(f"{flag} {name!r} is unknown: use one of {', '.join(valid)}")
    return name


def resolve(kind: str, name: str, family: str | None) -> str | None:
    """The parser name `auto` stands for with this family (None: no parser)."""
    check_parser_name(kind, name)
    if name == "auto":
        name = (FAMILY_TOOL_PARSER if kind == "tool" else FAMILY_REASONING_PARSER).get(family or "", "none")
    return None if name == "none" else name


def tool_parser_for(name: str, family: str | None) -> ToolParser | None:
    resolved = resolve("tool", name, family)
    return None if resolved is None else TOOL_PARSERS[resolved]()


def reasoning_parser_for(name: str, family: str | None, prompt: str) -> ReasoningParser | None:
    """The request's reasoning parser; it starts inside the reasoning when the prompt opened it."""
    resolved = resolve("reasoning", name, family)
    if resolved is None:
        return None
    return ReasoningParser(resolved, ReasoningParser.prompt_opens_reasoning(prompt))
