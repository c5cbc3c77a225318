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
