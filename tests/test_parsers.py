"""Reasoning and tool-call parsers on hand-written model outputs in each real format
(`../shared/formats.md`), unstreamed and streamed with the text split at every character and
at every token boundary; the streamed deltas must add up to exactly the unstreamed message."""
import json
import time

import pytest

from gpu_service.api.parsers import ChatStream, OutputParser, ReasoningParser, TOOL_PARSERS, reasoning_parser_for
from gpu_service.api.parsers import check_parser_name, tool_parser_for
from gpu_service.api.parsers.base import partial_len, until

KIMI_TWO_CALLS = (
    "<think>The user wants weather in two cities. I will call the tool twice."
    "<|tool_calls_section_begin|>"
    "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Paris\"}<|tool_call_end|>"
    "<|tool_call_begin|>functions.get_weather:1<|tool_call_argument_begin|>{\"city\": \"東京\"}<|tool_call_end|>"
    "<|tool_calls_section_end|>")
KIMI_CLOSED = "<think>Short.</think>Hello! 😀 How can I help?"
R1_INSIDE = "The user says hi. Greet back.</think>\n\nHello there."
V3_CALLS = (
    "Let me look.<｜tool▁calls▁begin｜>"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"days\": 3}\n```"
    "<｜tool▁call▁end｜>"
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{\"a\": 1, \"b\": 2}\n```<｜tool▁call▁end｜>"
    "<｜tool▁calls▁end｜>")
V31_CALLS = ("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{\"city\": \"Paris\"}<｜tool▁call▁end｜>"
             "<｜tool▁call▁begin｜>add<｜tool▁sep｜>{\"a\": 1}<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
DSML_CALLS = (
    "I need the weather.</think>Checking now."
    "\n\n<｜DSML｜function_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris \"centre\"</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"units\" string=\"false\">{\"temp\": \"C\", \"list\": [1, 2]}</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n"
    "</｜DSML｜function_calls>")

CASES = {
    "kimi_two_calls_no_close": (
        lambda: OutputParser(ReasoningParser("kimi_k2"), TOOL_PARSERS["kimi_k2"]()), KIMI_TWO_CALLS,
        {"reasoning": "The user wants weather in two cities. I will call the tool twice.", "content": None,
         "calls": [("functions.get_weather:0", "get_weather", '{"city": "Paris"}'),
                   ("functions.get_weather:1", "get_weather", '{"city": "東京"}')]}),
    "kimi_closed_think": (
        lambda: OutputParser(ReasoningParser("kimi_k2"), TOOL_PARSERS["kimi_k2"]()), KIMI_CLOSED,
        {"reasoning": "Short.", "content": "Hello! 😀 How can I help?", "calls": []}),
    "r1_starts_inside": (
        lambda: OutputParser(ReasoningParser("deepseek_r1"), TOOL_PARSERS["deepseek_v3"]()), R1_INSIDE,
        {"reasoning": "The user says hi. Greet back.", "content": "\n\nHello there.", "calls": []}),
    "v3_two_calls": (
        lambda: OutputParser(ReasoningParser("deepseek_v3"), TOOL_PARSERS["deepseek_v3"]()), V3_CALLS,
        {"reasoning": None, "content": "Let me look.",
         "calls": [(None, "get_weather", '{"city": "Paris", "days": 3}'), (None, "add", '{"a": 1, "b": 2}')]}),
    "v31_two_calls": (
        lambda: OutputParser(None, TOOL_PARSERS["deepseek_v31"]()), V31_CALLS,
        {"reasoning": None, "content": None,
         "calls": [(None, "get_weather", '{"city": "Paris"}'), (None, "add", '{"a": 1}')]}),
    "v32_dsml_thinking": (
        lambda: OutputParser(ReasoningParser("deepseek_v3", start_in_reasoning=True), TOOL_PARSERS["deepseek_v32"]()),
        DSML_CALLS,
        {"reasoning": "I need the weather.", "content": "Checking now.",
         "calls": [(None, "get_weather",
                    '{"city": "Paris \\"centre\\"", "days": 3, "units": {"temp": "C", "list": [1, 2]}}'),
                   (None, "now", "{}")]}),
    "v32_plain_answer": (
        lambda: OutputParser(ReasoningParser("deepseek_v3"), TOOL_PARSERS["deepseek_v32"]()), "Just text.\n\n",
        {"reasoning": None, "content": "Just text.\n\n", "calls": []}),
}


def whole(make, text):
    s = ChatStream(make())
    s.feed(text)
    return s.message()


def streamed(make, pieces):
    """Feed pieces; rebuild the message from the deltas the way an OpenAI client does."""
    s = ChatStream(make())
    deltas = [s.feed(p) for p in pieces] + [s.finish()]
    msg = {"reasoning": "", "content": "", "calls": {}}
    for d in deltas:
        if not d:
            continue
        assert d.get("reasoning") == d.get("reasoning_content")
        msg["reasoning"] += d.get("reasoning_content", "")
        msg["content"] += d.get("content", "")
        for tc in d.get("tool_calls", []):
            i = tc["index"]
            if i not in msg["calls"]:  # the first piece of a call names it
                assert tc["type"] == "function" and tc["id"] and tc["function"]["name"], tc
                msg["calls"][i] = {"id": tc["id"], "name": tc["function"]["name"], "arguments": ""}
            else:
                assert "id" not in tc and "name" not in tc.get("function", {}), tc
            msg["calls"][i]["arguments"] += tc.get("function", {}).get("arguments", "")
    return msg, s.message()


def check(message, expected):
    assert message.get("reasoning_content") == expected["reasoning"]
    assert message["content"] == expected["content"]
    calls = message.get("tool_calls") or []
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == \
           [(n, a) for _, n, a in expected["calls"]]
    for c, (cid, _, args) in zip(calls, expected["calls"]):
        json.loads(args)
        assert c["type"] == "function" and c["id"]
        if cid is not None:
            assert c["id"] == cid


@pytest.mark.parametrize("case", list(CASES))
def test_unstreamed(case):
    make, text, expected = CASES[case]
    check(whole(make, text), expected)


@pytest.mark.parametrize("case", list(CASES))
def test_streamed_every_split(case):
    """Every single split point, and one character at a time."""
    make, text, expected = CASES[case]
    ref = whole(make, text)
    splits = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in splits:
        got, final = streamed(make, pieces)
        assert got["reasoning"] == (ref.get("reasoning_content") or ""), pieces
        assert got["content"] == (ref["content"] or ""), pieces
        assert [(c["name"], c["arguments"]) for c in got["calls"].values()] == \
               [(c["function"]["name"], c["function"]["arguments"]) for c in ref.get("tool_calls", [])], pieces
        assert [c["id"] for c in got["calls"].values()] == [c["id"] for c in final.get("tool_calls", [])]


def test_streamed_at_token_boundaries(tmp_path):
    """Kimi and DeepSeek outputs tokenized by tiny tokenizers of the real formats, fed one
    decoded token at a time (special tokens arrive whole, multi-byte characters may split)."""
    from gpu_service.api.tokenizer import load_tokenizer
    from gpu_service.local import tiny_tokenizers
    from gpu_service.local.tiny import SPECIAL_TOKENS, TOKENIZER_TEXT

    for kind, names in (("kimi-k2-thinking", ("kimi_two_calls_no_close", "kimi_closed_think")),
                        ("deepseek-v3", ("r1_starts_inside", "v3_two_calls", "v31_two_calls", "v32_dsml_thinking"))):
        d = tmp_path / kind
        d.mkdir()
        tiny_tokenizers.write(kind, str(d), TOKENIZER_TEXT, SPECIAL_TOKENS)
        tok = load_tokenizer(str(d))
        for name in names:
            make, text, expected = CASES[name]
            ids = tok.encode(text, add_bos=False)
            assert tok.decode(ids) == text, name  # markers survive skip_special_tokens
            pieces, prev = [], ""
            for k in range(1, len(ids) + 1):  # the engine's rule: emit only complete characters
                cur = tok.decode(ids[:k])
                if not cur.endswith("\ufffd"):
                    pieces.append(cur[len(prev):])
                    prev = cur
            got, final = streamed(make, pieces)
            check(final, expected)
            assert got["content"] == (final["content"] or "")


def test_truncated_call_is_reported_incomplete():
    make = CASES["kimi_two_calls_no_close"][0]
    text = KIMI_TWO_CALLS[:KIMI_TWO_CALLS.index("東京")]
    msg = whole(make, text)
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_weather"]
    assert msg["tool_calls"][1]["function"]["arguments"] == '{"city": "'


def test_scanner_holds_back_partial_markers():
    assert partial_len("abc<|tool", ["<|tool_call_end|>"]) == 6
    assert until("text <｜tool▁ca", ["<｜tool▁calls▁begin｜>"], False) == ("text ", None, "")
    assert until("text <｜tool▁ca", ["<｜tool▁calls▁begin｜>"], True) == ("text <｜tool▁ca", None, "")


def test_auto_choice_and_names():
    assert tool_parser_for("auto", "kimi_k2").name == "kimi_k2"
    assert tool_parser_for("auto", "deepseek_r1").name == "deepseek_v3"
    assert tool_parser_for("auto", "deepseek_v32").name == "deepseek_v32"
    assert tool_parser_for("auto", None) is None and tool_parser_for("none", "kimi_k2") is None
    r = reasoning_parser_for("auto", "deepseek_v32", "<｜User｜>Hi<｜Assistant｜><think>")
    assert r.name == "deepseek_v3" and r.start_in
    assert not reasoning_parser_for("auto", "deepseek_v32", "<｜User｜>Hi<｜Assistant｜></think>").start_in
    with pytest.raises(ValueError, match="kimi_k2, deepseek_v3, deepseek_v31, deepseek_v32"):
        check_parser_name("tool", "hermes")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        check_parser_name("reasoning", "qwen3")


@pytest.mark.parametrize("name", list(TOOL_PARSERS))
def test_forced_prefix_parses_as_the_named_call(name):
    p = TOOL_PARSERS[name]()
    prefix = p.forced_prefix("get_weather")
    _, calls = p.parse(prefix, False)
    assert [c.name for c in calls] == ["get_weather"] and calls[0].arguments in ("", "{")


def test_streaming_parse_cost():
    """The per-token cost on the streaming path (every token re-parses the text so far):
    printed for the closing note; bounded loosely so a pathological regression fails."""
    make, text, _ = CASES["v32_dsml_thinking"]
    long_text = "word " * 400 + text  # ~2,300 characters of output
    s = ChatStream(make())
    t0 = time.perf_counter()
    for ch in long_text:
        s.feed(ch)
    s.finish()
    per = (time.perf_counter() - t0) / len(long_text) * 1e6
    print(f"streaming parse: {per:.1f} us per character over {len(long_text)} characters")
    assert per < 2000


@pytest.mark.parametrize("case", list(CASES))
def test_incremental_stream_equals_the_reparsing_one(case):
    """Where the request's parsers all run incrementally (V3.2's and V4's, every reasoning parser),
    open_stream's IncrementalStream gives what ChatStream (re-parsing) gives, whole and split at
    every point; each reasoning machine splits as ReasoningParser.split at every prefix."""
    from gpu_service.api.parsers.stream import IncrementalStream

    make, text, expected = CASES[case]
    parser = make()
    if parser.reasoning is not None:
        for name in ("kimi_k2", "deepseek_r1", "deepseek_v3", "deepseek_v4"):
            for start_in in (False, True):
                r = ReasoningParser(name, start_in)
                for i in range(len(text) + 1):
                    for final in (False, True):
                        s = IncrementalStream(OutputParser(r, None))
                        s.feed(text[:i])
                        if final:
                            s.finish()
                        p = s.parsed()
                        assert (p.reasoning, p.content, p.reasoning_ended) == r.split(text[:i], final), (name, i)
    if not parser.incremental:
        return
    ref = whole(make, text)
    for pieces in [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)]:
        s = IncrementalStream(make())
        for p in pieces:
            s.feed(p)
        msg = s.message()
        assert (msg.get("reasoning_content"), msg["content"]) == (ref.get("reasoning_content"), ref["content"])
        assert [c["function"] for c in msg.get("tool_calls", [])] == [c["function"] for c in ref.get("tool_calls", [])]
    check(msg, expected)
