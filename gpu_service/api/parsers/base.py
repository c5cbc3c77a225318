"""What every output parser shares: the parsed shape and a marker scanner safe for streaming.

Parsers are pure functions of the text generated so far: `parse(text, final)`. With
`final=False` they hold back any tail that could still turn into a marker, and report only
what later text cannot change, so each field of a non-final parse is a prefix of the same field
in every later parse; the streamer sends the differences, and the final parse is the answer.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolCall:
    name: str
    arguments: str  # the JSON text of the arguments (a prefix of it while streaming)
    id: str | None = None  # the id the model wrote (Kimi), else one is made up
    complete: bool = False  # the call's end marker was seen


@dataclass
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)
    reasoning_ended: bool = True


def tail_partial(text: str, markers, start: int = 0) -> int:
    """Length of the longest tail of `text[start:]` that is a proper prefix of one of `markers`
    (only the last len(marker) - 1 characters are looked at)."""
    best, n = 0, len(text)
    for m in markers:
        j = text.find(m[0], max(start, n - len(m) + 1))
        while 0 <= j and n - j > best:  # later starts are shorter tails
            if m.startswith(text[j:]):
                best = n - j
                break
            j = text.find(m[0], j + 1)
    return best


def partial_len(text: str, markers) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `markers`."""
    return tail_partial(text, markers)


def find_first(text: str, markers, start: int = 0) -> tuple[int, str | None]:
    """(position, marker) of the earliest marker in `text[start:]` (the longest on a tie), or (-1, None)."""
    pos, found = -1, None
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (pos < 0 or i < pos or (i == pos and len(m) > len(found))):
            pos, found = i, m
    return pos, found


def until(text: str, markers, final: bool) -> tuple[str, str | None, str]:
    """Split at the earliest marker: (before, marker, after). Without a marker: (text, None, "")
    when final, else the text less any tail that may be the start of a marker."""
    pos, m = find_first(text, markers)
    if m is not None:
        return text[:pos], m, text[pos + len(m):]
    if final:
        return text, None, ""
    return text[:len(text) - partial_len(text, markers)], None, ""


class ToolParser:
    """One model family's tool-call syntax. Subclasses set `name`, `markers` (the strings that
    start the calls) and implement `parse` and `forced_prefix`."""

    name = "none"
    markers: tuple[str, ...] = ()
    # tool calls already in the conversation: Kimi numbers its call ids across it (`functions.NAME:N`)
    call_index = 0

    def parse(self, text: str, final: bool) -> tuple[str, list[ToolCall]]:
        """(content before the calls, the calls seen so far)."""
        return text, []

    def forced_prefix(self, function: str | None) -> str:
        """Text that opens a call in this syntax (of `function`, or of any when None): appended to
        the prompt for `tool_choice` required / named when no grammar engine constrains decoding."""
        raise NotImplementedError
