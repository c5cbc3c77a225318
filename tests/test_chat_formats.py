"""Chat formats: rendered prompts equal hand-written strings for fixed conversations in each format
(system, user, assistant with reasoning, tool calls, tool results, multi-turn, thinking on/off),
and our Jinja rendering equals transformers' on the same template and messages."""
import json

import pytest

from gpu_service.api.chat_formats import ChatTemplateError, DeepseekV32Format, load_chat_format
from gpu_service.api.chat_formats.jinja_format import JinjaFormat
from gpu_service.local import tiny_templates as T

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer"}}}}}
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 3}"}}
LOOP = [  # two turns, then a tool loop in the second
    {"role": "system", "content": "S"},
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "A1", "reasoning_content": "R1"},
    {"role": "user", "content": "Q2"},
    {"role": "assistant", "content": "", "reasoning_content": "R2", "tool_calls": [{**CALL, "id": "c0"}]},
    {"role": "tool", "tool_call_id": "c0", "content": "sunny"},
]
KIMI_SPECIALS = {"bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
DS_SPECIALS = {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>"}
TOOLS_JSON = json.dumps([WEATHER], separators=(",", ":"))


def kimi(thinking):
    return JinjaFormat(T.KIMI_K2_THINKING if thinking else T.KIMI_K2, "test", KIMI_SPECIALS, "kimi_k2")


def test_kimi_k2():
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q", "name": "ann"},
            {"role": "assistant", "content": "A", "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny"}]
    assert kimi(False).render(msgs, tools=[WEATHER]) == (
        "<|im_system|>tool_declare<|im_middle|>" + TOOLS_JSON + "<|im_end|>"
        "<|im_system|>system<|im_middle|>S<|im_end|>"
        "<|im_user|>ann<|im_middle|>Q<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>A<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
        "<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 3}<|tool_call_end|><|tool_calls_section_end|>"
        "<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")


def test_kimi_k2_thinking_interleaved():
    """History up to the last assistant message without tool calls: empty think; the current
    tool loop keeps its reasoning."""
    assert kimi(True).render(LOOP[1:]) == (
        "<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot AI.<|im_end|>"
        "<|im_user|>user<|im_middle|>Q1<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think></think>A1<|im_end|>"
        "<|im_user|>user<|im_middle|>Q2<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>R2</think><|tool_calls_section_begin|><|tool_call_begin|>c0"
        "<|tool_call_argument_begin|>{\"city\": \"Paris\", \"days\": 3}<|tool_call_end|><|tool_calls_section_end|>"
        "<|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of c0\nsunny<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")


def test_deepseek_v3_and_r1():
    v3 = JinjaFormat(T.DEEPSEEK_V3, "test", DS_SPECIALS, "deepseek_v3")
    tools_part = ("\n\n## Tools\nYou can call these functions:\n" + json.dumps(WEATHER["function"]) +
                  "\nTo call one, write <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n"
                  "ARGUMENTS\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>")
    assert v3.render(LOOP, tools=[WEATHER]) == (
        "<｜begin▁of▁sentence｜>S" + tools_part +
        "<｜User｜>Q1<｜Assistant｜>A1<｜end▁of▁sentence｜><｜User｜>Q2<｜Assistant｜><｜tool▁calls▁begin｜>"
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\", \"days\": 3}\n```"
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>sunny<｜tool▁output▁end｜><｜tool▁outputs▁end｜><｜Assistant｜>")
    r1 = JinjaFormat(T.DEEPSEEK_R1, "test", DS_SPECIALS, "deepseek_r1")
    msgs = [{"role": "user", "content": "Q1"}, {"role": "assistant", "content": "<think>old</think>A1"},
            {"role": "user", "content": "Q2"}]
    assert r1.render(msgs) == ("<｜begin▁of▁sentence｜><｜User｜>Q1<｜Assistant｜>A1<｜end▁of▁sentence｜>"
                               "<｜User｜>Q2<｜Assistant｜><think>\n")


TOOLS_FILE = '''import json
raise SystemExit("this file must never run")
TOOLS_SYSTEM_TEMPLATE = """## Tools
Call with DSML.
<functions>
{tool_schemas}
</functions>
"""
'''


def test_deepseek_v32_thinking_on_and_off(tmp_path):
    (tmp_path / "encoding").mkdir()
    (tmp_path / "encoding" / "encoding_dsv32.py").write_text(TOOLS_FILE)
    fmt = DeepseekV32Format.from_checkpoint(str(tmp_path), DS_SPECIALS)
    tools = "S\n\n## Tools\nCall with DSML.\n<functions>\n" + json.dumps(WEATHER["function"]) + "\n</functions>\n"
    calls = ("\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
             "<｜DSML｜parameter name=\"city\" string=\"true\">Paris</｜DSML｜parameter>\n"
             "<｜DSML｜parameter name=\"days\" string=\"false\">3</｜DSML｜parameter>\n"
             "</｜DSML｜invoke>\n</｜DSML｜function_calls>")
    on = fmt.render(LOOP, tools=[WEATHER], thinking=True)
    assert on == ("<｜begin▁of▁sentence｜>" + tools +
                  "<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"  # older reasoning dropped
                  "<｜User｜>Q2<｜Assistant｜><think>R2</think>" + calls + "<｜end▁of▁sentence｜>"
                  "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n<think>")
    off = fmt.render(LOOP, tools=[WEATHER])
    assert off == ("<｜begin▁of▁sentence｜>" + tools +
                   "<｜User｜>Q1<｜Assistant｜></think>A1<｜end▁of▁sentence｜>"
                   "<｜User｜>Q2<｜Assistant｜></think>" + calls + "<｜end▁of▁sentence｜>"
                   "\n\n<function_results>\n<result>sunny</result>\n</function_results>\n\n</think>")
    # formats.md's example
    short = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi"}]
    assert fmt.render(short, thinking=True) == "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜><think>"
    assert fmt.render(short) == "<｜begin▁of▁sentence｜>You are terse.<｜User｜>Hi<｜Assistant｜></think>"
    # tools and no system message: an empty one carries them; developer is a user turn
    dev = fmt.render([{"role": "developer", "content": "D"}], tools=[WEATHER])
    assert dev.startswith("<｜begin▁of▁sentence｜>\n\n## Tools\n") and dev.endswith("<｜User｜>D<｜Assistant｜></think>")
    with pytest.raises(ChatTemplateError, match="thinking"):
        fmt.render(short, enable_thinking=True)
    # arguments that are not a JSON object (a call cut short by max_tokens) render raw
    assert fmt.render([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": '{"a": "x'}}]}]) \
        == ('<｜begin▁of▁sentence｜>\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name="f">\n{"a": "x\n'
            '</｜DSML｜invoke>\n</｜DSML｜function_calls><｜end▁of▁sentence｜>')


def test_v32_selected_without_template_and_override(tmp_path):
    cfg = {"architectures": ["DeepseekV32ForCausalLM"]}
    fmt = load_chat_format(str(tmp_path), {}, cfg, DS_SPECIALS)
    assert isinstance(fmt, DeepseekV32Format) and fmt.family == "deepseek_v32"
    assert load_chat_format(str(tmp_path), {}, {"architectures": ["DeepseekV3ForCausalLM"]}, DS_SPECIALS) is None
    (tmp_path / "t.jinja").write_text("{{ bos_token }}{% for m in messages %}[{{ m.content }}]{% endfor %}")
    over = load_chat_format(str(tmp_path), {}, cfg, DS_SPECIALS, override=str(tmp_path / "t.jinja"))
    assert over.render([{"role": "user", "content": "x"}]) == "<｜begin▁of▁sentence｜>[x]"
    named = {"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}
    assert load_chat_format(str(tmp_path), named, {}, {}).render([]) == "D"
    with pytest.raises(ChatTemplateError, match="no such file|No such file"):
        load_chat_format(str(tmp_path), {}, cfg, {}, override=str(tmp_path / "missing.jinja"))


CONVERSATIONS = [
    ([{"role": "user", "content": "Hi 你好"}], None, {}),
    (LOOP, [WEATHER], {}),
    (LOOP[:4], [WEATHER], {"custom_flag": True}),
]


@pytest.mark.parametrize("template", ["KIMI_K2", "KIMI_K2_THINKING", "DEEPSEEK_V3", "DEEPSEEK_R1"])
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
def test_jinja_equals_transformers(template, conv):
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs, tools, kwargs = CONVERSATIONS[conv]
    specials = KIMI_SPECIALS if template.startswith("KIMI") else DS_SPECIALS
    tpl = getattr(T, template)
    ours = JinjaFormat(tpl, "test", specials, None).render(msgs, tools=tools, add_generation_prompt=True, **kwargs)
    ref, _ = render_jinja_template(conversations=[msgs], tools=tools, chat_template=tpl, add_generation_prompt=True,
                                   **specials, **kwargs)
    assert ours == ref[0]


def test_jinja_environment_like_transformers():
    """loop controls, tojson without HTML escaping, raise_exception, strftime_now, kwargs."""
    from transformers.utils.chat_template_utils import render_jinja_template

    tpl = ("{% for m in messages %}{% if loop.index > 2 %}{% break %}{% endif %}{{ m | tojson }}{% endfor %}"
           "{{ strftime_now('%Y')[:2] }}{{ flag }}"
           "{% if messages[0].role == 'tool' %}{{ raise_exception('no tool first') }}{% endif %}")
    msgs = [{"role": "user", "content": "<a & b>"}, {"role": "user", "content": "é"}, {"role": "user", "content": "x"}]
    ours = JinjaFormat(tpl, "t", {}, None).render(msgs, flag="!")
    assert ours == render_jinja_template(conversations=[msgs], chat_template=tpl, add_generation_prompt=True,
                                         flag="!")[0][0]
    assert '"<a & b>"' in ours and "é" in ours and '"x"' not in ours
    with pytest.raises(ChatTemplateError, match="no tool first"):
        JinjaFormat(tpl, "t", {}, None).render([{"role": "tool", "content": ""}])
