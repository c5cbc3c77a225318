"""Kimi-K2.5 / K2.6 chat: the tiny checkpoints' K2.5 / K2.6 templates rendered by the Jinja path
(chat_plan) equal transformers' own Jinja rendering (render_jinja_template, the core of
apply_chat_template) of the same files for a conversation with an image, earlier reasoning, a tool
call and its result, with thinking on (default) and off, and K2.6's preserve_thinking; the
TypeScript tool declarations (tools_ts); the K2 parsers on the output, streamed == whole."""
import base64
import io
import json
import os

import numpy as np
import pytest

from gpu_service.api.chat_formats.tools_ts import deep_sort, tools_typescript

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city.",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "unit": {"type": "string", "enum": ["c", "f"], "default": "c"},
        "city": {"type": "string", "description": "City name", "maxLength": 40},
        "days": {"type": "array", "items": {"type": "integer", "minimum": 1}}}}}}


def _png() -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (40, 70, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


CONVERSATION = [
    {"role": "user", "content": [{"type": "text", "text": "Where is this? "},
                                 {"type": "image_url", "image_url": {"url": _png()}}]},
    {"role": "assistant", "reasoning_content": "A harbour; ask for the weather.", "content": "Checking.",
     "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                     "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
    {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "{\"temp\": 4}"},
    {"role": "assistant", "reasoning_content": "It is cold.", "content": "Oslo, 4 degrees."},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.fixture(scope="module", params=["kimi-k2.5", "kimi-k2.6"])
def tiny(request, tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    d = make_tiny(str(tmp_path_factory.mktemp("k25c") / request.param), arch="kimi_k25", seed=4,
                  tokenizer=request.param)
    return request.param, d


def reference(model_dir: str, messages, tools, **kw) -> str:
    """transformers' rendering of the checkpoint's chat_template.jinja, with what Kimi's tokenizer
    passes it: the tools deep-sorted and their TypeScript text."""
    from transformers.utils.chat_template_utils import render_jinja_template

    with open(os.path.join(model_dir, "chat_template.jinja")) as f:
        template = f.read()
    if tools:
        tools = deep_sort(tools)
        kw["tools_ts_str"] = tools_typescript(tools)
    out, _ = render_jinja_template(conversations=[messages], tools=tools, chat_template=template,
                                   add_generation_prompt=True, **kw)
    return out[0]


@pytest.mark.parametrize("kwargs", [{}, {"thinking": False}, {"preserve_thinking": True}])
def test_rendering_equals_transformers(tiny, kwargs):
    from gpu_service.api.chat_request import ChatSettings, chat_plan
    from gpu_service.api.guard import ServerLimits
    from gpu_service.api.tokenizer import load_tokenizer

    kind, d = tiny
    tok = load_tokenizer(d)
    body = {"messages": CONVERSATION, "tools": [WEATHER], "chat_template_kwargs": kwargs}
    plan = chat_plan(body, tok, ChatSettings(), images=ServerLimits().image_policy())
    ref = reference(d, CONVERSATION, [WEATHER], **kwargs)
    assert plan.prompt == ref
    assert "namespace functions {" in ref and "<|media_begin|>image<|media_content|><|media_pad|><|media_end|>" in ref
    assert ref.endswith("<think></think>" if kwargs.get("thinking") is False else "<think>")
    kept = "<think>A harbour; ask for the weather.</think>" in ref
    assert kept == (kind == "kimi-k2.6" and bool(kwargs.get("preserve_thinking")))  # earlier reasoning
    assert "<think>It is cold.</think>" in ref or not kept


def test_typescript_declarations():
    assert tools_typescript([WEATHER]) == (
        "# Tools\n\n## functions\nnamespace functions {\n// Weather of a city.\ntype get_weather = (_: {\n"
        "  // City name\n  // maxLength: 40\n  city: string,\n"
        "  days?: Array<\n    // minimum: 1\n    number\n  >,\n"
        "  // Default: \"c\"\n  unit?: \"c\" | \"f\"\n}) => any;\n}\n")
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "$defs": {"Node": {"type": "object", "description": "A node.",
                                             "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}},
        "properties": {"root": {"$ref": "#/$defs/Node"}, "meta": {}, "flag": {"type": ["boolean", "null"]},
                       "extra": {"type": "object", "additionalProperties": {"type": "string"}}}}}}
    assert tools_typescript([tree]) == (
        "# Tools\n\n## functions\nnamespace functions {\n// A node.\ninterface Node {\n  kids?: Array<Node>\n}\n"
        "type tree = (_: {\n  extra?: {\n    [k: string]: string\n  },\n  flag?: boolean | null,\n  meta?: any,\n"
        "  root?: Node\n}) => any;\n}\n")
    assert tools_typescript([]) == "" and tools_typescript([{"type": "web_search"}]) == ""


def test_k2_parsers_on_the_output_streamed_equal_whole(tiny):
    from gpu_service.api.chat_request import ChatSettings, chat_plan
    from gpu_service.api.tokenizer import load_tokenizer

    _, d = tiny
    tok = load_tokenizer(d)
    plan = chat_plan({"messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER]}, tok, ChatSettings())
    text = ("Need the tool.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
            "<|tool_call_argument_begin|>{\"city\": \"Oslo\"}<|tool_call_end|><|tool_calls_section_end|>")
    whole = plan.stream()
    whole.feed(text)
    msg = whole.message()
    assert msg["reasoning_content"] == "Need the tool." and msg["content"] == "Let me check."
    (call,) = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {"city": "Oslo"}
    streamed = plan.stream()
    for i in range(0, len(text), 3):
        streamed.feed(text[i:i + 3])
    assert streamed.message() == msg
