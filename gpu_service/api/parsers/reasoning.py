"""Reasoning parsers: `<think>...</think>` apart from the answer (names as vLLM / SGLang use them).

    deepseek_r1   the output starts inside the reasoning (R1's template opens `<think>`): all up to
                  `</think>` is reasoning; a leading `<think>` is dropped; no `</think>` -> all reasoning
    deepseek_v3   reasoning only when the prompt opened `<think>` (V3.1 / V3.2 with `thinking` on)
                  or the output starts with `<think>`; else all is the answer
    kimi_k2       as deepseek_v3, and the reasoning also ends where the model jumps into its tool
                  section (`<|tool_calls_section_begin|>`) without closing `</think>`
    deepseek_v4   as deepseek_v3, and the reasoning also ends at V4's DSML `tool_calls` block
Each also runs incrementally (`machine`, parsers.incremental), splitting as `split` does.
"""
from __future__ import annotations

from gpu_service.api.chat_formats.common import THINK_END, THINK_START
from gpu_service.api.parsers.base import until
from gpu_service.api.parsers.incremental import ReasoningMachine
from gpu_service.api.parsers.tools import DeepseekV4ToolParser, KimiK2ToolParser

REASONING_PARSERS = ("kimi_k2", "deepseek_r1", "deepseek_v3", "deepseek_v4")
ENDERS = {"kimi_k2": (THINK_END, KimiK2ToolParser.SECTION_BEGIN),
          "deepseek_v4": (THINK_END,) + DeepseekV4ToolParser.markers}


class ReasoningParser:
    """`split(text, final) -> (reasoning, rest, ended)`; `rest` is the answer (and tool calls)."""

    def __init__(self, name: str, start_in_reasoning: bool = False):
        if name not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {name!r}: use one of {', '.join(REASONING_PARSERS)}, none")
        self.name = name
        self.start_in = start_in_reasoning or name == "deepseek_r1"
        self.enders = ENDERS.get(name, (THINK_END,))
        self.incremental = True  # open_stream may read it with `machine` (split: the same on a whole text)

    @staticmethod
    def prompt_opens_reasoning(prompt: str) -> bool:
        """True when the rendered prompt ends inside an opened `<think>` (whitespace aside)."""
        return prompt.rstrip().endswith(THINK_START)

    def machine(self, sink) -> ReasoningMachine:
        """A fresh incremental splitter: `sink.reasoning`, `sink.rest` (the answer and tool calls)."""
        return ReasoningMachine(sink, self.enders, self.start_in)

    def split(self, text: str, final: bool) -> tuple[str, str, bool]:
        if text.startswith(THINK_START):
            text = text[len(THINK_START):]
        elif not final and THINK_START.startswith(text):
            return "", "", False  # may still become "<think>"
        elif not self.start_in:
            return "", text, True
        reasoning, m, after = until(text, self.enders, final)
        if m is None:
            return reasoning, "", False
        return reasoning, (after if m == THINK_END else m + after), True
