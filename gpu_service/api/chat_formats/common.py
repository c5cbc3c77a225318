"""What the chat formats and the output parsers share: marker strings and the error type."""
from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"
KIMI_TOOL_TOKENS = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                    "<|tool_call_argument_begin|>", "<|tool_call_end|>")
DEEPSEEK_TOOL_TOKENS = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>",
                        "<｜tool▁call▁end｜>", "<｜tool▁sep｜>")
# special tokens the output parsers read: kept in decode(skip_special_tokens=True)
MARKERS = (THINK_START, THINK_END) + KIMI_TOOL_TOKENS + DEEPSEEK_TOOL_TOKENS
FAMILIES = ("kimi_k2", "deepseek_v3", "deepseek_r1", "deepseek_v31", "deepseek_v32", "deepseek_v4")


class ChatTemplateError(ValueError):
    """The template or the built-in format refused the conversation (or could not be loaded)."""
