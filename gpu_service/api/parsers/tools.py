"""Tool-call parsers for the four target formats (names as vLLM / SGLang users know them).

    kimi_k2       <|tool_calls_section_begin|>{<|tool_call_begin|>functions.NAME:I<|tool_call_argument_begin|>
                  JSON<|tool_call_end|>}<|tool_calls_section_end|>        the id is `functions.NAME:I`
    deepseek_v3   <｜tool▁calls▁begin｜>{<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\nJSON\\n```
                  <｜tool▁call▁end｜>}<｜tool▁calls▁end｜>
    deepseek_v31  <｜tool▁calls▁begin｜>{<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>JSON<｜tool▁call▁end｜>}<｜tool▁calls▁end｜>
    deepseek_v32  \\n\\n<｜DSML｜function_calls>\\n{<｜DSML｜invoke name="NAME">\\n{<｜DSML｜parameter name="K"
                  string="true|false">V</｜DSML｜parameter>}\\n</｜DSML｜invoke>}\\n</｜DSML｜function_calls>
                  (arguments assembled as a JSON object: string="true" values raw strings, else JSON)
    deepseek_v4   as deepseek_v32 in a `<｜DSML｜tool_calls>` block
(deepseek_v32 and deepseek_v4 run incrementally: `parsers.incremental`, each piece read once)

Content is the text before the calls. A format's own special markers found there outside a call
section (a random or confused model writing `<|tool_call_end|>` in free text) are dropped from it
(`STRAY`: every tool marker but the one that opens the calls); see `parsers.base` for the
streaming contract (a marker's partial tail is held back like the opening's).
"""
from __future__ import annotations

from gpu_service.api.chat_formats import dsml
from gpu_service.api.parsers.base import ToolCall, ToolParser, until
from gpu_service.api.parsers.incremental import Collect, DsmlMachine


def content_until(text: str, final: bool, begins: tuple, stray: tuple) -> tuple[str, str | None, str]:
    """`until(text, begins, final)` with the `stray` markers before the first of `begins` dropped
    from the content (and their partial tails held back while streaming)."""
    parts = []
    while True:
        before, m, text = until(text, begins + stray, final)
        parts.append(before)
        if m is None or m in begins:
            return "".join(parts), m, text


def _delimited(text: str, final: bool, begin: str, call: str, end: str, sep: str, call_end: str, make,
               stray: tuple = ()):
    """Content and calls of `begin {call HEAD sep ARGS call_end} end`; make(head, args, complete) -> ToolCall."""
    content, m, rest = content_until(text, final, (begin,), stray)
    calls: list[ToolCall] = []
    while m is not None:
        _, m, after = until(rest, (call, end), final)
        if m != call:
            break
        head, m, after = until(after, (sep,), final)
        if m is None:
            break  # the head (id / name) is not complete yet
        args, m, rest = until(after, (call_end,), final)
        calls.append(make(head, args, m is not None))
    return content, calls


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
    CALL_BEGIN, ARG_BEGIN, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
    markers = (SECTION_BEGIN,)
    STRAY = (SECTION_END, CALL_BEGIN, ARG_BEGIN, CALL_END)

    @staticmethod
    def function_name(call_id: str) -> str:
        """`functions.get_weather:0` -> `get_weather`."""
        s = call_id.strip()
        if s.startswith("functions."):
            s = s[len("functions."):]
        return s.rsplit(":", 1)[0] if ":" in s else s

    def parse(self, text, final):
        return _delimited(text, final, self.SECTION_BEGIN, self.CALL_BEGIN, self.SECTION_END, self.ARG_BEGIN,
                          self.CALL_END, lambda head, args, done: ToolCall(self.function_name(head), args,
                                                                            head.strip(), done), self.STRAY)

    def forced_prefix(self, function):
        """The section's opening up to the function name (`required`), or through the call's id
        `functions.NAME:N` (N = `call_index`, the calls already in the conversation) for a named one."""
        head = self.SECTION_BEGIN + self.CALL_BEGIN + "functions."
        return head if function is None else head + f"{function}:{self.call_index}" + self.ARG_BEGIN


class DeepseekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    FENCE = "```json\n"
    markers = (CALLS_BEGIN,)
    STRAY = (CALLS_END, CALL_BEGIN, CALL_END, SEP)

    def _body(self, after: str, final: bool) -> str | None:
        """The arguments' text after the name line: past the ```json fence (None: fence still arriving)."""
        if after.startswith(self.FENCE):
            return after[len(self.FENCE):]
        if after.startswith("```"):  # another fence word
            nl = after.find("\n")
            return after[nl + 1:] if nl >= 0 else (after[3:] if final else None)
        if not final and self.FENCE.startswith(after):
            return None
        return after

    def parse(self, text, final):
        content, m, rest = content_until(text, final, (self.CALLS_BEGIN,), self.STRAY)
        calls: list[ToolCall] = []
        while m is not None:
            _, m, after = until(rest, (self.CALL_BEGIN, self.CALLS_END), final)
            if m != self.CALL_BEGIN:
                break
            _, m, after = until(after, (self.SEP,), final)  # the type word ("function")
            if m is None:
                break
            name, m, after = until(after, ("\n", self.CALL_END), final)
            if m is None and not final:
                break
            body = "" if m == self.CALL_END else self._body(after, final)
            if body is None:
                calls.append(ToolCall(name.strip(), ""))
                break
            args, m, rest = until(body, ("\n```", self.CALL_END), final)
            if m == "\n```":
                _, m, rest = until(rest, (self.CALL_END,), final)
            calls.append(ToolCall(name.strip(), args, None, m is not None))
        return content, calls

    def forced_prefix(self, function):
        head = self.CALLS_BEGIN + self.CALL_BEGIN + "function" + self.SEP
        return head if function is None else head + function + "\n" + self.FENCE


class DeepseekV31ToolParser(DeepseekV3ToolParser):
    name = "deepseek_v31"

    def parse(self, text, final):
        return _delimited(text, final, self.CALLS_BEGIN, self.CALL_BEGIN, self.CALLS_END, self.SEP, self.CALL_END,
                          lambda name, args, done: ToolCall(name.strip(), args, None, done), self.STRAY)

    def forced_prefix(self, function):
        head = self.CALLS_BEGIN + self.CALL_BEGIN
        return head if function is None else head + function + self.SEP


class DeepseekV32ToolParser(ToolParser):
    """V3.2's DSML calls (`function_calls` block), read by an incremental machine (`machine(sink)`);
    `parse` runs one over a whole text."""

    name = "deepseek_v32"
    BLOCK = dsml.V32_BLOCK
    INVOKE, PARAM = dsml.INVOKE_OPEN, dsml.PARAM_OPEN
    BEGIN, END = dsml.block_markers(BLOCK)
    markers = (f"\n\n{BEGIN}", BEGIN)
    incremental = True

    def machine(self, sink) -> DsmlMachine:
        """A fresh incremental parser reporting content and calls to `sink`."""
        return DsmlMachine(sink, self.BLOCK)

    def parse(self, text, final):
        sink = Collect()
        m = self.machine(sink)
        m.feed(text)
        if final:
            m.finish()
        return "".join(sink.content_parts), sink.calls

    def forced_prefix(self, function):
        head = f"\n\n{self.BEGIN}\n{self.INVOKE}"
        return head if function is None else head + function + '">\n'


class DeepseekV4ToolParser(DeepseekV32ToolParser):
    """V4's DSML calls: V3.2's syntax in a `tool_calls` block."""

    name = "deepseek_v4"
    BLOCK = dsml.V4_BLOCK
    BEGIN, END = dsml.block_markers(BLOCK)
    markers = (f"\n\n{BEGIN}", BEGIN)


TOOL_PARSERS = {p.name: p for p in (KimiK2ToolParser, DeepseekV3ToolParser, DeepseekV31ToolParser,
                                    DeepseekV32ToolParser, DeepseekV4ToolParser)}
