"""Incremental output parsing: each piece of the output is read once, whatever its position.

A `Machine` is fed the output piece by piece. In each state it looks for that state's markers
(`MARKERS[state]`) in the new text only, plus a held-back tail shorter than a marker; it hands the
text between markers to the state's handler (`text`) and moves on at each marker (`marker`). Text
that could still be the start of a marker is held back until the next piece (or `finish`), so
whatever a machine reports is never taken back. The machines report to a sink (duck-typed):

    reasoning(text)   rest(text)   content(text)   call(name, id)   args(text)   done()

`ReasoningMachine` splits `<think>` reasoning from the rest (sent on to `sink.rest`); `DsmlMachine`
reads DSML tool calls (gpu_service.api.chat_formats.dsml) from the rest, the arguments reported
as the text of one JSON object while the parameters arrive (string values escaped, others as the
model wrote them), the shape `parsers.tools.DeepseekV32ToolParser` gives for a whole text.
"""
from __future__ import annotations

import json

from gpu_service.api.chat_formats import dsml
from gpu_service.api.chat_formats.common import THINK_END, THINK_START
from gpu_service.api.parsers.base import ToolCall, find_first, tail_partial


class Machine:
    """The scanner; subclasses set MARKERS (state -> markers) and implement `text(piece, final)`
    (text of the current state between markers; a handler that changes the state returns the
    text to read again in the new state, else None), `marker(m)` and optionally `end()`."""

    MARKERS: dict[str, tuple[str, ...]] = {}

    def __init__(self, sink, state: str):
        self.sink, self.state, self.held = sink, state, ""

    def feed(self, text: str) -> None:
        """Read `text` more of the output."""
        self._run(self.held + text, False)

    def finish(self) -> None:
        """The output is complete: what was held back is text, then `end`."""
        held, self.held = self.held, ""
        self._run(held, True)
        self.end()

    def _run(self, buf: str, final: bool) -> None:
        pos = 0
        while True:
            markers = self.MARKERS[self.state]
            i, m = find_first(buf, markers, pos)
            end = i if m is not None else (len(buf) if final else len(buf) - tail_partial(buf, markers, pos))
            if end > pos:
                back = self.text(buf[pos:end], final)
                if back is not None:  # a new state: read what the handler gave back in it
                    buf, pos = back + buf[end:], 0
                    continue
            if m is None:
                self.held = buf[end:]
                return
            pos = i + len(m)
            self.marker(m)

    def text(self, piece: str, final: bool) -> str | None:
        """Handle `piece` of the current state (see the class docstring)."""
        return None

    def marker(self, m: str) -> None:
        """Move on at marker `m`."""
        raise NotImplementedError

    def end(self) -> None:
        """Called once after the last text."""


class ReasoningMachine(Machine):
    """States: "start" (a leading `<think>` may still come), "in" (reasoning), "out" (the rest, to
    `sink.rest`, with the marker that ended the reasoning when it was not `</think>`)."""

    def __init__(self, sink, enders: tuple[str, ...], start_in: bool):
        self.MARKERS = {"start": (), "in": enders, "out": ()}
        self.start_in, self.ended = start_in, False
        self.buf: list[str] = []
        super().__init__(sink, "start")

    def text(self, piece, final):
        if self.state == "in":
            self.sink.reasoning(piece)
        elif self.state == "out":
            self.sink.rest(piece)
        else:
            self.buf.append(piece)
            held = "".join(self.buf)
            if held.startswith(THINK_START):
                self.state = "in"
                return held[len(THINK_START):]
            if not final and THINK_START.startswith(held):
                return None
            self.state = "in" if self.start_in else "out"
            self.ended = self.state == "out"
            return held
        return None

    def marker(self, m):
        self.state, self.ended = "out", True
        if m != THINK_END:
            self.sink.rest(m)

    def end(self):
        if self.state == "start":  # the whole output is a proper prefix of "<think>" (or empty)
            self.state = "in" if self.start_in else "out"
            self.ended = self.state == "out"
            self._run("".join(self.buf), True)


class DsmlMachine(Machine):
    """DSML calls in a `block` (`function_calls` / `tool_calls`); text after the block is dropped."""

    def __init__(self, sink, block: str):
        begin, end = dsml.block_markers(block)
        self.MARKERS = {"content": (f"\n\n{begin}", begin), "block": (dsml.INVOKE_OPEN, end), "name": ('">',),
                        "invoke": (dsml.PARAM_OPEN, dsml.INVOKE_END), "key": ('"',), "attrs": (">",),
                        "value": (dsml.PARAM_END,), "after": ()}
        super().__init__(sink, "content")
        self.buf: list[str] = []
        self.key, self.first, self.is_str = "", True, False

    def text(self, piece, final):
        if self.state == "content":
            self.sink.content(piece)
        elif self.state in ("name", "key", "attrs"):
            self.buf.append(piece)
        elif self.state == "value":
            self.sink.args(json.dumps(piece, ensure_ascii=False)[1:-1] if self.is_str else piece)
        return None

    def marker(self, m):
        s = self.state
        if s == "content":
            self.state = "block"
        elif s == "block":
            self.state, self.buf = ("name", []) if m == dsml.INVOKE_OPEN else ("after", [])
        elif s == "name":
            self.sink.call("".join(self.buf), None)
            self.sink.args("{")
            self.state, self.first = "invoke", True
        elif s == "invoke":
            if m == dsml.PARAM_OPEN:
                self.state, self.buf = "key", []
            else:
                self.sink.args("}")
                self.sink.done()
                self.state = "block"
        elif s == "key":
            self.state, self.key, self.buf = "attrs", "".join(self.buf), []
        elif s == "attrs":
            self.is_str = 'string="false"' not in "".join(self.buf)
            self.sink.args(("" if self.first else ", ") + json.dumps(self.key, ensure_ascii=False) + ": "
                           + ('"' if self.is_str else ""))
            self.state, self.first = "value", False
        elif s == "value":
            if self.is_str:
                self.sink.args('"')
            self.state = "invoke"


class Collect:
    """A sink that keeps everything (the shapes of a whole text)."""

    def __init__(self):
        self.reasoning_parts: list[str] = []
        self.content_parts: list[str] = []
        self.rest_parts: list[str] = []
        self.calls: list[ToolCall] = []

    def reasoning(self, s: str) -> None:
        self.reasoning_parts.append(s)

    def content(self, s: str) -> None:
        self.content_parts.append(s)

    def rest(self, s: str) -> None:
        self.rest_parts.append(s)

    def call(self, name: str, call_id: str | None) -> None:
        self.calls.append(ToolCall(name, "", call_id))

    def args(self, s: str) -> None:
        self.calls[-1].arguments += s

    def done(self) -> None:
        self.calls[-1].complete = True
