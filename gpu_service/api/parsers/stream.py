"""One request's output through its reasoning and tool-call parsers, streamed or whole.

    out = OutputParser(reasoning=ReasoningParser("kimi_k2"), tools=KimiK2ToolParser())
    stream = ChatStream(out)
    for piece in engine_text:                  # each engine Output's text
        delta = stream.feed(piece)             # an OpenAI `delta` dict, or None
    delta = stream.finish()                    # whatever was held back
    message = stream.message()                 # the non-streamed `message` (same parse)

Deltas: `reasoning_content` and `reasoning` (both names), `content`, `tool_calls` (the first piece
of call i carries `index`, `id`, `type`, `function.name`; later ones `index` and pieces of
`function.arguments`). The streamed pieces concatenate to exactly the non-streamed message.
`prefix`: text already in the prompt that belongs to the answer (a forced tool-call opening).
"""
from __future__ import annotations

import logging
import uuid

from gpu_service.api.parsers.base import Parsed, ToolParser
from gpu_service.api.parsers.reasoning import ReasoningParser

log = logging.getLogger("moesplit.parsers")


def merge_deltas(a: dict | None, b: dict | None) -> dict | None:
    """One delta saying what `a` then `b` say (text fields joined, tool-call pieces by index)."""
    if not a or not b:
        return a or b
    out = dict(a)
    for k, v in b.items():
        if k != "tool_calls":
            out[k] = out.get(k, "") + v
            continue
        calls = {c["index"]: {**c, "function": dict(c.get("function", {}))} for c in out.get("tool_calls", [])}
        for c in v:
            if c["index"] in calls:
                fn = calls[c["index"]]["function"]
                fn["arguments"] = fn.get("arguments", "") + c.get("function", {}).get("arguments", "")
            else:
                calls[c["index"]] = c
        out["tool_calls"] = [calls[i] for i in sorted(calls)]
    return out


class OutputParser:
    def __init__(self, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 prefix: str = "", max_calls: int | None = None):
        self.reasoning, self.tools, self.prefix, self.max_calls = reasoning, tools, prefix, max_calls

    def parse(self, text: str, final: bool) -> Parsed:
        text = self.prefix + text
        if self.reasoning is not None:
            reasoning, rest, ended = self.reasoning.split(text, final)
        else:
            reasoning, rest, ended = "", text, True
        if self.tools is not None:
            content, calls = self.tools.parse(rest, final)
        else:
            content, calls = rest, []
        if self.max_calls is not None:
            calls = calls[:self.max_calls]
        return Parsed(reasoning, content, calls, ended)


def _grown(old: str, new: str, what: str) -> str:
    if not new.startswith(old):  # a parser broke the prefix contract: never resend, log it
        log.warning("%s changed while streaming (%r -> %r); keeping what was sent", what, old[-20:], new[-20:])
        return ""
    return new[len(old):]


class ChatStream:
    """Diffs successive parses of the growing text into OpenAI deltas (see the module docstring)."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self.text = ""
        self.sent = Parsed()
        self.sent_args: list[str] = []
        self.ids: list[str] = []
        self.final: Parsed | None = None

    def _id(self, i: int, given: str | None) -> str:
        while len(self.ids) <= i:
            self.ids.append("")
        if not self.ids[i]:
            self.ids[i] = given or f"call_{uuid.uuid4().hex[:24]}"
        return self.ids[i]

    def _diff(self, p: Parsed) -> dict | None:
        delta: dict = {}
        r = _grown(self.sent.reasoning, p.reasoning, "reasoning")
        if r:
            delta["reasoning_content"] = delta["reasoning"] = r
            self.sent.reasoning += r
        c = _grown(self.sent.content, p.content, "content")
        if c:
            delta["content"] = c
            self.sent.content += c
        calls = []
        for i, call in enumerate(p.calls):
            item: dict = {"index": i}
            fn: dict = {}
            if i >= len(self.sent_args):
                item.update(id=self._id(i, call.id), type="function")
                fn["name"] = call.name
                self.sent_args.append("")
            a = _grown(self.sent_args[i], call.arguments, f"tool call {i} arguments")
            if a or "name" in fn:
                fn["arguments"] = a
                self.sent_args[i] += a
                item["function"] = fn
                calls.append(item)
        if calls:
            delta["tool_calls"] = calls
        return delta or None

    def feed(self, text: str) -> dict | None:
        """The delta for `text` more of the output (None when nothing is sure yet)."""
        self.text += text
        if not text:
            return None
        return self._diff(self.parser.parse(self.text, False))

    def finish(self) -> dict | None:
        """The delta of whatever was held back, parsing the whole output as final."""
        self.final = self.parser.parse(self.text, True)
        return self._diff(self.final)

    @property
    def has_calls(self) -> bool:
        p = self.final if self.final is not None else self.sent
        return bool(p.calls) or bool(self.sent_args)

    def message(self) -> dict:
        """The non-streamed assistant message: content (None when there are calls and no text),
        reasoning_content / reasoning when any, tool_calls when any."""
        if self.final is None:
            self.finish()
        p = self.final
        msg: dict = {"role": "assistant", "content": p.content if (p.content or not p.calls) else None}
        if p.reasoning:
            msg["reasoning_content"] = msg["reasoning"] = p.reasoning
        if p.calls:
            msg["tool_calls"] = [{"id": self._id(i, c.id), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments}}
                                 for i, c in enumerate(p.calls)]
        return msg
