"""DeepSeek-V4's reasoning and tool-call parsers (`deepseek_v4`) on outputs written in the
encoder's syntax: unstreamed, streamed split at every character (and one character at a time),
and read incrementally (every parser machine reads each piece once)."""
import json

import pytest

from gpu_service.api.chat_formats import DeepseekV4Format
from gpu_service.api.parsers import OutputParser, TOOL_PARSERS, reasoning_parser_for, tool_parser_for
from gpu_service.api.parsers.incremental import Machine
from gpu_service.api.parsers.stream import IncrementalStream, open_stream


def ChatStream(parser):  # noqa: N802 - every V4 stream is the incremental one
    s = open_stream(parser)
    assert isinstance(s, IncrementalStream)
    return s

CALLS = (
    "\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris \"centre\"\n2nd line</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">東京</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls><｜end▁of▁sentence｜>")
ARGS = ['{"city": "Paris \\"centre\\"\\n2nd line", "days": 3}', '{"city": "東京"}']


def v4(thinking: bool, max_calls=None, prefix=""):
    prompt = DeepseekV4Format().render([{"role": "user", "content": "q"}], thinking=thinking)
    return lambda: OutputParser(reasoning_parser_for("auto", "deepseek_v4", prompt),
                                tool_parser_for("auto", "deepseek_v4"), prefix, max_calls)


CASES = {
    "thinking_then_calls": (v4(True), "Two cities.</think>Checking." + CALLS,
                            ("Two cities.", "Checking.", ARGS)),
    "thinking_runs_into_calls": (v4(True), "Two cities." + CALLS, ("Two cities.", None, ARGS)),
    "chat_calls_only": (v4(False), CALLS[2:], (None, None, ARGS)),
    "chat_answer": (v4(False), "Plain <answer>, a </think> and <｜DSML｜ in text.",
                    (None, "Plain <answer>, a </think> and <｜DSML｜ in text.", [])),
    "thinking_answer": (v4(True), "hmm</think>\n\nIt is 4.", ("hmm", "\n\nIt is 4.", [])),
    "one_call_allowed": (v4(False, max_calls=1), CALLS, (None, None, ARGS[:1])),
}


def deltas_to_message(deltas):
    msg = {"reasoning": "", "content": "", "calls": {}}
    for d in deltas:
        if not d:
            continue
        assert d.get("reasoning") == d.get("reasoning_content")
        msg["reasoning"] += d.get("reasoning_content", "")
        msg["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            c = msg["calls"].setdefault(tc["index"], {"id": tc.get("id"), "name": tc["function"].get("name"),
                                                      "arguments": ""})
            assert c["id"] and c["name"], tc  # the first piece of a call names it
            c["arguments"] += tc["function"].get("arguments", "")
    return msg


@pytest.mark.parametrize("case", list(CASES))
def test_unstreamed(case):
    make, text, (reasoning, content, args) = CASES[case]
    s = ChatStream(make())
    s.feed(text)
    msg = s.message()
    assert msg.get("reasoning_content") == reasoning and msg["content"] == content
    assert [c["function"]["arguments"] for c in msg.get("tool_calls", [])] == args
    assert all(c["function"]["name"] == "get_weather" for c in msg.get("tool_calls", []))
    for a in args:
        json.loads(a)


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_equals_unstreamed_at_every_split(case):
    make, text, _ = CASES[case]
    ref = ChatStream(make())
    ref.feed(text)
    ref = ref.message()
    for pieces in [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]:
        s = ChatStream(make())
        got = deltas_to_message([s.feed(p) for p in pieces] + [s.finish()])
        assert got["reasoning"] == (ref.get("reasoning_content") or ""), pieces
        assert got["content"] == (ref["content"] or ""), pieces
        assert [(c["id"], c["name"], c["arguments"]) for c in got["calls"].values()] == \
               [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in s.message().get("tool_calls", [])]
        assert [c["arguments"] for c in got["calls"].values()] == \
               [c["function"]["arguments"] for c in ref.get("tool_calls", [])], pieces


def test_forced_prefix_is_the_named_call():
    p = TOOL_PARSERS["deepseek_v4"]()
    assert p.forced_prefix("get_weather") == '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n'
    make = v4(True, max_calls=1, prefix="</think>" + p.forced_prefix("get_weather"))
    s = ChatStream(make())
    s.feed('<｜DSML｜parameter name="city" string="true">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n'
           "</｜DSML｜tool_calls>")
    msg = s.message()
    assert msg["content"] is None and "reasoning_content" not in msg
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_v32_block_is_not_a_v4_call():
    content, calls = TOOL_PARSERS["deepseek_v4"]().parse(CALLS.replace("tool_calls", "function_calls"), True)
    assert calls == [] and "function_calls" in content


def test_rendered_history_parses_back():
    """An assistant turn rendered by the format reads back as the same calls."""
    calls = [{"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": "1 < 2", "n": [1, 2]}'}}]
    text = DeepseekV4Format().render([{"role": "user", "content": "q"},
                                      {"role": "assistant", "content": "ok", "tool_calls": calls}])
    answer = text.split("<｜Assistant｜></think>", 1)[1]
    content, got = TOOL_PARSERS["deepseek_v4"]().parse(answer, True)
    assert content == "ok" and [(c.name, json.loads(c.arguments)) for c in got] == [("f", {"x": "1 < 2", "n": [1, 2]})]


def test_each_piece_is_read_once(monkeypatch):
    """The machines scan at most the new piece plus a held tail shorter than the longest marker."""
    scanned = []
    run = Machine._run
    monkeypatch.setattr(Machine, "_run", lambda self, buf, final: (scanned.append(len(buf)), run(self, buf, final))[1])
    make, text, _ = CASES["thinking_then_calls"]
    long_text = "word " * 800 + text  # ~4,300 characters
    s = ChatStream(make())
    for i in range(0, len(long_text), 3):  # 3-character tokens
        s.feed(long_text[i:i + 3])
    s.finish()
    assert max(scanned) < 3 + 40  # no buffer grows with the answer
    assert sum(scanned) < 2.5 * len(long_text)  # each character read about once per machine (two machines)


@pytest.mark.parametrize("case", list(CASES))
def test_machine_split_equals_the_whole_text_split(case):
    """The reasoning machine splits as ReasoningParser.split (the re-reading parser) does, at
    every prefix of the output (non-final) and on the whole (final)."""
    make, text, _ = CASES[case]
    parser = make().reasoning
    for i in list(range(0, len(text), 7)) + [len(text)]:
        for final in (False, True):
            s = IncrementalStream(OutputParser(parser, None))
            s.feed(text[:i])
            if final:
                s.finish()
            reasoning, rest, ended = parser.split(text[:i], final)
            assert s.parsed().reasoning == reasoning and s.parsed().content == rest and s.parsed().reasoning_ended == ended
