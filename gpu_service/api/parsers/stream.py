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

`open_stream(parser)` picks the streamer: `IncrementalStream` when the request's parsers run
incrementally (`incremental`: DeepSeek-V4's), each piece then read once, so a token costs the same
at the end of a long answer as at its start; else `ChatStream`, which parses the text so far
again at each piece and sends the differences.
"""
from __future__ import annotations

import logging
import uuid

from gpu_service.api.parsers.base import Parsed, ToolCall, ToolParser
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

    @property
    def incremental(self) -> bool:
        """Every parser of the request runs incrementally (and there is at least one)."""
        parts = [p for p in (self.reasoning, self.tools) if p is not None]
        return bool(parts) and all(getattr(p, "incremental", False) for p in parts)

    def parse(self, text: str, final: bool) -> Parsed:
        """The parse of `text`, the output so far (`final`: all of it)."""
        if self.incremental:
            stream = IncrementalStream(self)
            stream.feed(text)
            if final:
                stream.finish()
            return stream.parsed()
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


class IncrementalStream:
    """ChatStream's interface over incremental parsers: it is the machines' sink (`reasoning`,
    `rest` from the reasoning parser; `content`, `call`, `args`, `done` from the tool parser), each
    adding to the pending delta and to the whole message."""

    def __init__(self, parser: OutputParser):
        self.parser = parser
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.calls: list[dict] = []
        self.dropped = False  # a call past max_calls is being read: its pieces are not reported
        self.delta: dict = {}
        self.finished = False
        self.tools = parser.tools.machine(self) if parser.tools is not None else None
        self.split = parser.reasoning.machine(self) if parser.reasoning is not None else None
        if parser.prefix:
            self._read(parser.prefix)

    def reasoning(self, s: str) -> None:
        """Sink: reasoning text."""
        self.reasoning_parts.append(s)
        self.delta["reasoning_content"] = self.delta.get("reasoning_content", "") + s

    def rest(self, s: str) -> None:
        """Sink: text after the reasoning (the answer and its calls)."""
        if self.tools is not None:
            self.tools.feed(s)
        else:
            self.content(s)

    def content(self, s: str) -> None:
        """Sink: answer text."""
        self.content_parts.append(s)
        self.delta["content"] = self.delta.get("content", "") + s

    def call(self, name: str, call_id: str | None) -> None:
        """Sink: a call's name is complete."""
        if self.parser.max_calls is not None and len(self.calls) >= self.parser.max_calls:
            self.dropped = True
            return
        self.dropped = False
        i = len(self.calls)
        cid = call_id or f"call_{uuid.uuid4().hex[:24]}"
        self.calls.append({"name": name, "id": cid, "given_id": call_id, "args": [], "complete": False})
        self.delta.setdefault("tool_calls", {})[i] = {"index": i, "id": cid, "type": "function",
                                                     "function": {"name": name, "arguments": ""}}

    def args(self, s: str) -> None:
        """Sink: more of the current call's arguments."""
        if self.dropped or not s:
            return
        i = len(self.calls) - 1
        self.calls[i]["args"].append(s)
        item = self.delta.setdefault("tool_calls", {}).setdefault(i, {"index": i, "function": {"arguments": ""}})
        item["function"]["arguments"] += s

    def done(self) -> None:
        """Sink: the current call's end marker."""
        if not self.dropped:
            self.calls[-1]["complete"] = True

    def _read(self, text: str) -> None:
        if self.split is not None:
            self.split.feed(text)
        else:
            self.rest(text)

    def _take(self) -> dict | None:
        delta, self.delta = self.delta, {}
        if "reasoning_content" in delta:
            delta["reasoning"] = delta["reasoning_content"]
        if "tool_calls" in delta:
            delta["tool_calls"] = [delta["tool_calls"][i] for i in sorted(delta["tool_calls"])]
        return delta or None

    def feed(self, text: str) -> dict | None:
        """The delta for `text` more of the output (None when nothing is sure yet)."""
        if text and not self.finished:
            self._read(text)
        return self._take()

    def finish(self) -> dict | None:
        """The delta of whatever was held back, the output being complete."""
        if not self.finished:
            self.finished = True
            if self.split is not None:
                self.split.finish()
            if self.tools is not None:
                self.tools.finish()
        return self._take()

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def parsed(self) -> Parsed:
        """What was read so far, as a Parsed."""
        calls = [ToolCall(c["name"], "".join(c["args"]), c["given_id"], c["complete"]) for c in self.calls]
        return Parsed("".join(self.reasoning_parts), "".join(self.content_parts), calls,
                      self.split is None or self.split.ended)

    def message(self) -> dict:
        """The non-streamed assistant message (as ChatStream.message)."""
        self.finish()
        content = "".join(self.content_parts)
        msg: dict = {"role": "assistant", "content": content if (content or not self.calls) else None}
        reasoning = "".join(self.reasoning_parts)
        if reasoning:
            msg["reasoning_content"] = msg["reasoning"] = reasoning
        if self.calls:
            msg["tool_calls"] = [{"id": c["id"], "type": "function",
                                  "function": {"name": c["name"], "arguments": "".join(c["args"])}}
                                 for c in self.calls]
        return msg


def open_stream(parser: OutputParser) -> ChatStream | IncrementalStream:
    """The streamer for a request's parsers (see the module docstring)."""
    return IncrementalStream(parser) if parser.incremental else ChatStream(parser)
