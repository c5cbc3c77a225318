"""What agent frameworks send and expect, checked on the served tiny checkpoints: Kimi's forced
call ids count across the conversation, the common request options (`store`, `metadata`,
`reasoning_effort`, `verbosity`), forced calls on open schemas, truncated calls sent back as
history, stray markers kept out of `content`. The frameworks themselves: test_agents_frameworks.py.
"""
import json

import httpx
import jsonschema
import pytest

from test_chat_api import WEATHER, _client, _script, _serve

# LangChain's default schema for `def get_weather(city: str)`: no additionalProperties
OPEN_WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    st = _serve(tmp_path_factory, "kimi-k2-thinking", "deepseek_v3")
    yield st
    st.stop()


def _forced_loop(st, choice, turns=3):
    """`turns` forced calls, each sent back with its result; the ids the server gave."""
    oai = _client(st)
    msgs = [{"role": "user", "content": "Weather in Paris, then again, then again."}]
    ids = []
    for _ in range(turns):
        r = oai.chat.completions.create(model=st.model_name, messages=msgs, tools=[WEATHER], tool_choice=choice,
                                        max_tokens=100, seed=len(ids))
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        ids.append(call.id)
        msgs.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                             "arguments": call.function.arguments}}]})
        msgs.append({"role": "tool", "tool_call_id": call.id, "content": "sunny"})
    return ids


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_kimi_forced_ids_count_across_the_conversation(kimi, choice):
    """The random model under the grammar (required) or the prompt's prefix (named) writes the id:
    `functions.get_weather:N`, N the calls already in the history."""
    kimi.runner.script = []
    assert _forced_loop(kimi, choice) == [f"functions.get_weather:{n}" for n in range(3)]


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    st = _serve(tmp_path_factory, "deepseek-v32", "deepseek_v32")
    yield st
    st.stop()


def _post(st, **body):
    return httpx.post(st.http_url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})


def _refused(r, param, *words):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], (w, err["message"])


def test_store_metadata_verbosity(kimi):
    kimi.runner.script = []
    meta = {"run": "agents-7", "user_tier": "free"}
    r = _post(kimi, store=False, metadata=meta)
    assert r.status_code == 200, r.text
    assert r.json()["metadata"] == meta
    _refused(_post(kimi, store=True), "store", "false")
    _refused(_post(kimi, metadata={f"k{i}": "v" for i in range(17)}), "metadata", "16")
    _refused(_post(kimi, metadata={"k" * 65: "v"}), "metadata", "64")
    _refused(_post(kimi, metadata={"k": "v" * 513}), "metadata", "512")
    _refused(_post(kimi, metadata={"k": 3}), "metadata", "string")
    _refused(_post(kimi, metadata=["k"]), "metadata")
    _refused(_post(kimi, verbosity="low"), "verbosity", "allowed")
    _refused(_post(kimi, reasoning_effort="extreme"), "reasoning_effort", "minimal", "high")


def test_reasoning_effort_on_an_always_reasoning_format(kimi):
    """Kimi-K2-Thinking reasons whatever it is told: low..max accepted, none / minimal refused."""
    kimi.runner.script = []
    for effort in ("low", "medium", "high"):
        assert _post(kimi, reasoning_effort=effort).status_code == 200
    _refused(_post(kimi, reasoning_effort="none"), "reasoning_effort", "always reasons", "high")


def test_reasoning_effort_switches_v32_thinking(v32):
    v32.runner.script = []
    for effort, end in (("high", "<think>"), ("low", "<think>"), ("minimal", "</think>"), ("none", "</think>")):
        assert _post(v32, reasoning_effort=effort).status_code == 200
        prompt = v32.tokenizer.decode(v32.runner.last_prompt, skip_special_tokens=False)
        assert prompt.endswith("<｜Assistant｜>" + end), (effort, prompt[-40:])
    _refused(_post(v32, reasoning_effort="high", chat_template_kwargs={"thinking": False}), "reasoning_effort",
             "thinking")
    assert _post(v32, reasoning_effort="high", chat_template_kwargs={"thinking": True}).status_code == 200


def test_reasoning_effort_per_format_control():
    """The mapping per kind of control: efforts passed through, switch, always, none."""
    from gpu_service.api.chat_formats import JinjaFormat
    from gpu_service.api.chat_request import reasoning_kwargs, thinking_control
    from gpu_service.api.errors import APIError
    from gpu_service.local import tiny_templates as T

    class Efforts:  # a format that names its levels (as DeepSeek-V4's does)
        reasoning_efforts = ("low", "high", "max")

    assert reasoning_kwargs("max", Efforts(), {"x": 1}) == {"x": 1, "reasoning_effort": "max"}
    with pytest.raises(APIError) as e:
        reasoning_kwargs("medium", Efforts(), {})
    assert e.value.param == "reasoning_effort" and "low, high, max" in e.value.message
    v31 = JinjaFormat("{% if thinking %}<think>{% else %}</think>{% endif %}", None, {}, "deepseek_v31")
    assert thinking_control(v31) == "switch"
    assert reasoning_kwargs("minimal", v31, {}) == {"thinking": False}
    assert reasoning_kwargs("medium", v31, {}) == {"thinking": True}
    assert thinking_control(JinjaFormat(T.KIMI_K2_THINKING, None, {}, "kimi_k2")) == "always"
    assert thinking_control(JinjaFormat(T.DEEPSEEK_R1, None, {}, "deepseek_r1")) == "always"
    for plain in (T.KIMI_K2, T.DEEPSEEK_V3):
        fmt = JinjaFormat(plain, None, {}, None)
        assert thinking_control(fmt) is None
        with pytest.raises(APIError) as e:
            reasoning_kwargs("low", fmt, {})
        assert e.value.param == "reasoning_effort" and "allowed" in e.value.message
    assert reasoning_kwargs(None, None, {"a": 1}) == {"a": 1}


NOTE = {"type": "function", "function": {"name": "note", "parameters": {  # open, nested, LangChain-style
    "type": "object", "properties": {"text": {"type": "string"}, "tags": {"type": "array", "items": {
        "type": "object", "properties": {"name": {"type": "string"}}}}}, "required": ["text"]}}}


def test_open_schemas_are_closed_for_forced_calls():
    from gpu_service.api.tool_grammar import closed_schema, FORCED_STRING_MAX_CHARS

    s = closed_schema(NOTE["function"]["parameters"])
    assert s["additionalProperties"] is False and s["properties"]["tags"]["items"]["additionalProperties"] is False
    assert s["properties"]["text"]["maxLength"] == FORCED_STRING_MAX_CHARS
    for bounded in ({"type": "string", "maxLength": 3}, {"type": "string", "enum": ["a"]},
                    {"type": "string", "pattern": "^a+$"}):
        assert closed_schema(bounded) == bounded
    assert "additionalProperties" not in NOTE["function"]["parameters"]  # the request's schema is left alone
    asked = {"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": {"type": "string"}}
    assert closed_schema(asked) == asked
    both = {"allOf": [{"type": "object", "properties": {"a": {}}}, {"type": "object", "properties": {"b": {}}}]}
    assert closed_schema(both) == both


def _forced_random(st, tools, choice, max_tokens=600):
    """A forced call from the random model, unstreamed then streamed: both finish with valid calls."""
    st.runner.script = []
    oai = _client(st)
    kw = dict(model=st.model_name, messages=[{"role": "user", "content": "Go."}], tools=tools, tool_choice=choice,
              max_tokens=max_tokens, temperature=1.0, seed=3)
    c = oai.chat.completions.create(**kw).choices[0]
    assert c.finish_reason == "tool_calls", c
    (call,) = c.message.tool_calls
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in tools}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), {**schema, "additionalProperties": False})
    from test_chat_api import _streamed

    _, _, calls, finish = _streamed(oai, **kw)
    assert finish == "tool_calls" and [(x["name"], x["arguments"]) for x in calls] == \
        [(call.function.name, call.function.arguments)]


@pytest.mark.parametrize("fixture", ["kimi", "v32"])
def test_forced_call_on_an_open_schema_finishes(fixture, request):
    st = request.getfixturevalue(fixture)
    for choice in ("required", {"type": "function", "function": {"name": "note"}}):
        _forced_random(st, [OPEN_WEATHER, NOTE], choice)


@pytest.mark.parametrize("fixture", ["kimi", "v32"])
def test_forced_string_cap(fixture, request, monkeypatch):
    """An unbounded string of a forced call stops at FORCED_STRING_MAX_CHARS (here lowered to 3)."""
    from gpu_service.api import tool_grammar

    monkeypatch.setattr(tool_grammar, "FORCED_STRING_MAX_CHARS", 3)
    st = request.getfixturevalue(fixture)
    st.runner.script = []
    r = _client(st).chat.completions.create(model=st.model_name, messages=[{"role": "user", "content": "Go."}],
                                            tools=[NOTE], tool_choice="required", max_tokens=600, seed=5)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    args = json.loads(c.message.tool_calls[0].function.arguments)
    assert len(args["text"]) <= 3 and all(len(t.get("name", "")) <= 3 for t in args.get("tags", []))


@pytest.mark.parametrize("fixture", ["kimi", "v32"])
def test_truncated_call_sent_back_is_accepted(fixture, request):
    """A forced call cut off by max_tokens goes back as history (as the Agents SDK sends it) and the
    next request is served; its raw arguments are in the prompt."""
    st = request.getfixturevalue(fixture)
    st.runner.script = []
    oai = _client(st)
    msgs = [{"role": "user", "content": "Go."}]
    r = oai.chat.completions.create(model=st.model_name, messages=msgs, tools=[NOTE], tool_choice="required",
                                    max_tokens=12, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "length"
    (call,) = c.message.tool_calls
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    msgs += [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
             {"role": "tool", "tool_call_id": call.id, "content": "error: truncated"}]
    r = oai.chat.completions.create(model=st.model_name, messages=msgs, tools=[NOTE], max_tokens=4)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    prompt = st.tokenizer.decode(st.runner.last_prompt, skip_special_tokens=False)
    assert call.function.arguments in prompt


@pytest.mark.parametrize("name, stray", [("kimi_k2", "<|tool_call_end|>"), ("kimi_k2", "<|tool_calls_section_end|>"),
                                         ("deepseek_v3", "<｜tool▁call▁end｜>"), ("deepseek_v31", "<｜tool▁sep｜>")])
def test_stray_markers_stay_out_of_content(name, stray):
    """A tool marker in free text outside a call section is dropped, streamed (one character at a
    time: a partial marker is held back, never sent) and whole alike; the calls still parse."""
    from gpu_service.api.parsers import ChatStream, OutputParser, TOOL_PARSERS

    text = f"Sunny{stray} today.{stray[:5]}"
    for final_text, want in ((text, "Sunny today." + stray[:5]), (f"A{stray}B", "AB")):
        whole = ChatStream(OutputParser(None, TOOL_PARSERS[name]()))
        whole.feed(final_text)
        assert whole.message()["content"] == want
        streamed = ChatStream(OutputParser(None, TOOL_PARSERS[name]()))
        got = "".join((streamed.feed(ch) or {}).get("content", "") for ch in final_text)
        got += (streamed.finish() or {}).get("content", "")
        assert got == want


def test_stray_marker_before_a_kimi_call(kimi):
    _script(kimi, "Let me see<|tool_call_end|>.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
                  "<|tool_call_argument_begin|>{\"city\": \"Rome\"}<|tool_call_end|><|tool_calls_section_end|>")
    r = _client(kimi).chat.completions.create(model=kimi.model_name, messages=[{"role": "user", "content": "?"}],
                                              tools=[WEATHER], max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content.endswith("Let me see.")
    assert "<|" not in c.message.content and c.message.tool_calls[0].function.arguments == '{"city": "Rome"}'
