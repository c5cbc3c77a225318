"""DeepSeek-V4's built-in chat format against golden strings written by hand from the encoder's
rules (`../shared/formats-v4.md` section 3): every conversation kind the issue lists, the
kwargs' validation, and the format chosen for a V4 checkpoint without a template."""
import json

import pytest

from gpu_service.api.chat_formats import ChatTemplateError, DeepseekV4Format, load_chat_format

B, E, U, A = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}
SCHEMA_LINE = ('{"name": "get_weather", "description": "Weather of a city", "parameters": {"type": "object", '
               '"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}')
TOOLS_SECTION = (
    "## Tools\n\n"
    "You have access to a set of tools to help answer the user's question. You can invoke tools by writing a "
    "\"<｜DSML｜tool_calls>\" block like the following:\n\n"
    "<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME\">\n"
    "<｜DSML｜parameter name=\"$PARAMETER_NAME\" string=\"true|false\">$PARAMETER_VALUE</｜DSML｜parameter>\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"$TOOL_NAME2\">\n"
    "...\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>\n\n"
    "String parameters should be specified as is and set `string=\"true\"`. For all other types (numbers, "
    "booleans, arrays, objects), pass the value in JSON format and set `string=\"false\"`.\n\n"
    "If thinking_mode is enabled (triggered by <think>), you MUST output your complete reasoning inside "
    "<think>...</think> BEFORE any tool calls or final response.\n\n"
    "Otherwise, output directly after </think> with tool calls or final response.\n\n"
    "### Available Tool Schemas\n\n"
    + SCHEMA_LINE + "\n\n"
    "You MUST strictly follow the above defined tool name and parameter schemas to invoke tool calls.\n")
MAX_EFFORT = (
    "Reasoning Effort: Absolute maximum with no shortcuts permitted.\n"
    "You MUST be very thorough in your thinking and comprehensively decompose the problem to resolve the root "
    "cause, rigorously stress-testing your logic against all potential paths, edge cases, and adversarial "
    "scenarios.\n"
    "Explicitly write out your entire deliberation process, documenting every intermediate step, considered "
    "alternative, and rejected hypothesis to ensure absolutely no assumption is left unchecked.\n\n")


def call(cid, name, args):
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


PARIS_CALLS = [call("c1", "get_weather", {"city": "Paris", "days": 2}), call("c2", "get_weather", {"city": "東京"})]
PARIS_DSML = (
    "\n\n<｜DSML｜tool_calls>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
    "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "<｜DSML｜invoke name=\"get_weather\">\n"
    "<｜DSML｜parameter name=\"city\" string=\"true\">東京</｜DSML｜parameter>\n"
    "</｜DSML｜invoke>\n"
    "</｜DSML｜tool_calls>")
TOOL_LOOP = [
    {"role": "user", "content": "Weather in Paris and Tokyo?"},
    {"role": "assistant", "content": "", "reasoning_content": "Two cities: two calls.", "tool_calls": PARIS_CALLS},
    # results sent back in the other order: rendered in the calls' order
    {"role": "tool", "tool_call_id": "c2", "content": "rain, 12C"},
    {"role": "tool", "tool_call_id": "c1", "content": "sun, 20C"},
]

# (messages, tools, chat_template_kwargs, golden)
GOLDEN = {
    "system_user": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], None, {},
        B + "You are terse." + U + "Hi" + A + "</think>"),
    "system_user_thinking": (
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}], None,
        {"thinking": True},
        B + "You are terse." + U + "Hi" + A + "<think>"),
    "multi_turn_dropped_reasoning": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
         {"role": "developer", "content": "Answer in French."},
         {"role": "user", "content": "3+3?"}], None, {"thinking": True},
        # the earlier turn keeps no reasoning (not even </think>); the earlier developer message is gone
        B + U + "2+2?" + A + "</think>" + "4" + E + U + "3+3?" + A + "<think>"),
    "multi_turn_kept_reasoning": (
        [{"role": "user", "content": "2+2?"},
         {"role": "assistant", "content": "4", "reasoning_content": "Add them."},
         {"role": "user", "content": "3+3?"}], None, {"thinking": True, "drop_thinking": False},
        B + U + "2+2?" + A + "<think>" + "Add them.</think>4" + E + U + "3+3?" + A + "<think>"),
    "tool_declarations": (
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}], [WEATHER], {},
        B + "Be brief.\n\n" + TOOLS_SECTION + U + "Weather in Paris?" + A + "</think>"),
    "tool_declarations_no_system": (
        [{"role": "user", "content": "Weather in Paris?"}], [WEATHER], {},
        B + "\n\n" + TOOLS_SECTION + U + "Weather in Paris?" + A + "</think>"),
    "parallel_calls_and_results": (
        TOOL_LOOP, None, {},
        B + U + "Weather in Paris and Tokyo?" + A + "</think>" + PARIS_DSML + E
        + U + "<tool_result>sun, 20C</tool_result>\n\n<tool_result>rain, 12C</tool_result>" + A + "</think>"),
    "results_thinking_with_tools": (
        TOOL_LOOP, [WEATHER], {"thinking": True},
        # tools present: nothing is dropped, the call's reasoning stays
        B + "\n\n" + TOOLS_SECTION + U + "Weather in Paris and Tokyo?" + A + "<think>" + "Two cities: two calls."
        + "</think>" + PARIS_DSML + E
        + U + "<tool_result>sun, 20C</tool_result>\n\n<tool_result>rain, 12C</tool_result>" + A + "<think>"),
    "result_then_user_text": (
        TOOL_LOOP[:2] + [{"role": "tool", "tool_call_id": "c1", "content": "sun"},
                         {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                         {"role": "user", "content": "And Rome?"}], None, {},
        B + U + "Weather in Paris and Tokyo?" + A + "</think>" + PARIS_DSML + E
        + U + "<tool_result>sun</tool_result>\n\n<tool_result>rain</tool_result>\n\nAnd Rome?" + A + "</think>"),
    "thinking_off_history": (
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "reasoning_content": "greet"},
         {"role": "user", "content": "Bye"}], None, {"thinking": False},
        B + U + "Hi" + A + "</think>Hello!" + E + U + "Bye" + A + "</think>"),
    "effort_high": (
        [{"role": "user", "content": "Prove it."}], None, {"thinking": True, "reasoning_effort": "high"},
        B + U + "Prove it." + A + "<think>"),
    "effort_max": (
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Prove it."}], None,
        {"thinking": True, "reasoning_effort": "max"},
        B + MAX_EFFORT + "S" + U + "Prove it." + A + "<think>"),
    "effort_max_tools_enable_thinking": (
        [{"role": "user", "content": "Prove it."}], [WEATHER], {"enable_thinking": True, "reasoning_effort": "max"},
        B + MAX_EFFORT + "\n\n" + TOOLS_SECTION + U + "Prove it." + A + "<think>"),
    "developer_with_tools_continued_assistant": (
        [{"role": "developer", "content": "Dev."}, {"role": "user", "content": "Go"},
         {"role": "assistant", "content": "Par"}], [WEATHER], {},
        # a developer message is a user turn that holds the tools; a final assistant message ends with EOS
        B + U + "Dev.\n\n" + TOOLS_SECTION + U + "Go" + A + "</think>Par" + E),
    "consecutive_users": (
        [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], None, {},
        B + U + "a\n\nb" + A + "</think>"),
}


@pytest.mark.parametrize("name", list(GOLDEN))
def test_golden(name):
    messages, tools, kwargs, golden = GOLDEN[name]
    assert DeepseekV4Format().render(messages, tools=tools, **kwargs) == golden


def test_efforts_are_the_encoders():
    assert DeepseekV4Format.reasoning_efforts == ("high", "max")


@pytest.mark.parametrize("kwargs, match", [
    ({"thinking": True, "reasoning_effort": "low"}, "reasoning_effort 'low'.*use one of high, max"),
    ({"thinking": "yes"}, "thinking must be true or false"),
    ({"effort": "max"}, r"\['effort'\] unknown.*\['thinking', 'enable_thinking', 'reasoning_effort', 'drop_thinking'\]"),
    ({"thinking": False, "reasoning_effort": "max"}, "thinking mode only"),
    ({"thinking": True, "enable_thinking": False}, "disagree"),
])
def test_bad_kwargs_name_the_allowed(kwargs, match):
    with pytest.raises(ChatTemplateError, match=match):
        DeepseekV4Format().render([{"role": "user", "content": "x"}], **kwargs)


def test_chosen_for_a_v4_checkpoint_without_template(tmp_path):
    fmt = load_chat_format(str(tmp_path), {}, {"architectures": ["DeepseekV4ForCausalLM"]}, {})
    assert isinstance(fmt, DeepseekV4Format) and fmt.family == "deepseek_v4"
    jinja = load_chat_format(str(tmp_path), {"chat_template": "{{ messages[0].content }}"},
                             {"architectures": ["DeepseekV4ForCausalLM"]}, {})
    assert jinja.family == "deepseek_v4" and jinja.render([{"role": "user", "content": "t"}]) == "t"


def test_openai_reasoning_effort_maps_onto_the_encoder():
    """`reasoning_effort` "none" -> thinking off; "high" / "max" -> thinking on at that level; the
    other OpenAI values are a 400 naming the allowed ones; contradictions with the kwargs a 400."""
    from gpu_service.api.chat_request import reasoning_kwargs
    from gpu_service.api.errors import APIError

    fmt = DeepseekV4Format()
    assert reasoning_kwargs("none", fmt, {}) == {"thinking": False}
    assert reasoning_kwargs("high", fmt, {}) == {"thinking": True, "reasoning_effort": "high"}
    assert reasoning_kwargs("max", fmt, {"drop_thinking": False}) == {"drop_thinking": False, "thinking": True,
                                                                      "reasoning_effort": "max"}
    assert reasoning_kwargs("max", fmt, {"enable_thinking": True}) == {"thinking": True, "reasoning_effort": "max"}
    rendered = fmt.render([{"role": "user", "content": "x"}], **reasoning_kwargs("max", fmt, {}))
    assert rendered == B + MAX_EFFORT + U + "x" + A + "<think>"
    for bad in ("low", "medium", "minimal", "xhigh"):
        with pytest.raises(APIError) as e:
            reasoning_kwargs(bad, fmt, {})
        assert e.value.status == 400 and e.value.param == "reasoning_effort"
        assert "none, high, max" in e.value.message
    for effort, kwargs in (("none", {"thinking": True}), ("high", {"thinking": False}),
                           ("high", {"thinking": True, "reasoning_effort": "max"})):
        with pytest.raises(APIError) as e:
            reasoning_kwargs(effort, fmt, kwargs)
        assert e.value.param == "reasoning_effort" and "drop one" in e.value.message
