"""Chat through the OpenAI HTTP API with the official `openai` client on tiny checkpoints in
Kimi-K2-Thinking's and DeepSeek-V3.2's real formats: tools, tool_choice, reasoning, a tool loop.

The model's output is driven deterministically: `Scripted` wraps the real runner (the tiny model
still runs every step) and overrides each sampled row's logits so the request generates a
scripted text in the model's own syntax, so these tests check the serving path (prompt
rendering, parsers, streaming deltas, finish reasons), not a random model's luck.
"""
import json

import httpx
import jsonschema
import pytest
import torch

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}


class Scripted:
    """The real runner, with each request's sampled tokens forced to `script` (then EOS)."""

    def __init__(self, runner):
        self.runner = runner
        self.script: list[int] = []
        self.prompt_len: dict[int, int] = {}
        self.last_prompt: list[int] = []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def step(self, ids, chunks, all_logits=False):
        assert not all_logits  # (prompt logprobs: not asked for here)
        logits = self.runner.step(ids, chunks).clone()  # an inference tensor: edit a copy
        off = 0
        for j, c in enumerate(chunks):
            if c.start == 0:  # one prefill chunk per prompt (chunk_tokens is large)
                self.prompt_len[id(c.seq)] = c.n
                self.last_prompt = list(ids[off:off + c.n])
            k = c.start + c.n - self.prompt_len[id(c.seq)]
            if k < len(self.script):
                logits[j] = -1e9
                logits[j, self.script[k]] = 0.0
            off += c.n
        return logits


def _serve(tmp_path_factory, kind, arch):
    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.api.tokenizer import load_tokenizer
    from gpu_service.local.tiny import make_tiny
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner
    from gpu_service.entrypoints.serving import ServingStack

    d = make_tiny(str(tmp_path_factory.mktemp(kind) / kind), "bf16", seed=0, arch=arch, tokenizer=kind,
                  overrides={"max_position_embeddings": 4096})  # V3.2's tools preamble is long in tiny BPE
    _, backend, _ = load_shard(d, None, None, "numpy")
    runner = Scripted(ModelRunner(CheckpointReader(d), LocalExperts(backend), device=torch.device("cpu"),
                                  dtype=torch.float32, kv_tokens=4096, page_size=16,
                                  prefix_cache=False))  # the script keys on whole-prompt prefill chunks (start 0)
    tok = load_tokenizer(d)
    st = ServingStack(runner, tok, kind, port=0, grpc_port=0, max_batch=4, chunk_tokens=2048).start()
    st.runner = runner
    return st


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    st = _serve(tmp_path_factory, "kimi-k2-thinking", "deepseek_v3")
    yield st
    st.stop()


@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    st = _serve(tmp_path_factory, "deepseek-v32", "deepseek_v32")
    yield st
    st.stop()


def _client(st):
    import openai

    return openai.OpenAI(base_url=st.http_url + "/v1", api_key="none", max_retries=0, timeout=60)


def _script(st, text, end="<|im_end|>"):
    tok = st.tokenizer
    st.runner.script = tok.encode(text + end, add_bos=False)


def _streamed(oai, **kw):
    """Rebuild (reasoning, content, calls, finish) from a stream as a client would."""
    reasoning, content, calls, finish = "", "", {}, None
    for ch in oai.chat.completions.create(stream=True, **kw):
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        reasoning += getattr(d, "reasoning_content", None) or ""
        content += d.content or ""
        for tc in d.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.type == "function" and tc.function.name
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            calls[tc.index]["arguments"] += tc.function.arguments or ""
        finish = ch.choices[0].finish_reason or finish
    return reasoning, content, list(calls.values()), finish


KIMI_CALL = ("<think>The user wants the weather; I call the tool."
             "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|>")


def test_kimi_reasoning_and_tool_call(kimi):
    oai = _client(kimi)
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    _script(kimi, KIMI_CALL)
    r = oai.chat.completions.create(model="kimi-k2-thinking", messages=msgs, tools=[WEATHER], max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.reasoning_content == "The user wants the weather; I call the tool."
    assert c.message.content is None
    (call,) = c.message.tool_calls
    assert call.id == "functions.get_weather:0" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # the rendered prompt is Kimi's format, tools first, default system prompt inserted
    prompt = kimi.tokenizer.decode(kimi.runner.last_prompt, skip_special_tokens=False)
    assert prompt == ("<|im_system|>tool_declare<|im_middle|>" + json.dumps([WEATHER], separators=(",", ":"))
                      + "<|im_end|><|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by Moonshot "
                      "AI.<|im_end|><|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
                      "<|im_assistant|>assistant<|im_middle|>")
    _script(kimi, KIMI_CALL)
    reasoning, content, calls, finish = _streamed(oai, model="kimi-k2-thinking", messages=msgs, tools=[WEATHER],
                                                  max_tokens=200)
    assert (reasoning, content, finish) == (c.message.reasoning_content, "", "tool_calls")
    assert [(x["id"], x["name"], x["arguments"]) for x in calls] == \
           [(call.id, call.function.name, call.function.arguments)]


def test_kimi_tool_loop_renders_history(kimi):
    """call -> role: tool result -> next turn: the history goes back in Kimi's format, the
    current tool loop keeping its reasoning (interleaved thinking)."""
    oai = _client(kimi)
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "", "reasoning_content": "I call the tool.",
             "tool_calls": [{"id": "functions.get_weather:0", "type": "function",
                             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "functions.get_weather:0", "content": "sunny, 21 C"}]
    _script(kimi, "<think>It is sunny.</think>Sunny, 21 °C in Paris.")
    r = oai.chat.completions.create(model="kimi-k2-thinking", messages=msgs, tools=[WEATHER], max_tokens=200)
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.content == "Sunny, 21 °C in Paris."
    assert c.message.reasoning_content == "It is sunny." and not c.message.tool_calls
    prompt = kimi.tokenizer.decode(kimi.runner.last_prompt, skip_special_tokens=False)
    assert prompt.endswith(
        "<|im_user|>user<|im_middle|>Weather in Paris?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|><think>I call the tool.</think>"
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
        "{\"city\": \"Paris\"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>"
        "<|im_system|>tool<|im_middle|>## Return of functions.get_weather:0\nsunny, 21 C<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>")


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_kimi_forced_tool_choice(kimi, choice):
    """required / named: the call's opening is put in the prompt; the grammar holds the rest."""
    oai = _client(kimi)
    msgs = [{"role": "user", "content": "Anything."}]
    rest = ('get_weather:0<|tool_call_argument_begin|>' if choice == "required" else "") + \
        '{"city":"Rome"}<|tool_call_end|><|tool_calls_section_end|>'  # compact JSON: the grammar's
    results = []
    for stream in (False, True):
        _script(kimi, rest)
        if stream:
            _, content, calls, finish = _streamed(oai, model="kimi-k2-thinking", messages=msgs,
                                                  tools=[WEATHER, CLOCK], tool_choice=choice, max_tokens=100)
            results.append((finish, [(x["name"], x["arguments"]) for x in calls]))
        else:
            r = oai.chat.completions.create(model="kimi-k2-thinking", messages=msgs, tools=[WEATHER, CLOCK],
                                            tool_choice=choice, max_tokens=100)
            c = r.choices[0]
            results.append((c.finish_reason, [(t.function.name, t.function.arguments) for t in c.message.tool_calls]))
    assert results[0] == results[1] == ("tool_calls", [("get_weather", '{"city":"Rome"}')])
    jsonschema.validate(json.loads(results[0][1][0][1]), WEATHER["function"]["parameters"])
    prompt = kimi.tokenizer.decode(kimi.runner.last_prompt, skip_special_tokens=False)
    assert prompt.endswith("<|im_assistant|>assistant<|im_middle|><|tool_calls_section_begin|><|tool_call_begin|>"
                           "functions." + ("" if choice == "required" else "get_weather:0<|tool_call_argument_begin|>"))


def test_tool_choice_none_leaves_tools_out(kimi):
    oai = _client(kimi)
    _script(kimi, "No tools today.")
    r = oai.chat.completions.create(model="kimi-k2-thinking", messages=[{"role": "user", "content": "Hi"}],
                                    tools=[WEATHER], tool_choice="none", max_tokens=50)
    assert r.choices[0].message.content == "No tools today." and r.choices[0].finish_reason == "stop"
    assert "tool_declare" not in kimi.tokenizer.decode(kimi.runner.last_prompt, skip_special_tokens=False)


def test_bad_chat_requests_name_the_field(kimi):
    url = kimi.http_url + "/v1/chat/completions"
    user = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[0].function.parameters"),
        ({"messages": user, "tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
         "tools[0].function.parameters"),
        ({"messages": user, "tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"messages": user, "tool_choice": "required"}, "tool_choice"),
        ({"messages": user, "tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
        ({"messages": user + [{"role": "tool", "content": "42"}]}, "messages[1].tool_call_id"),
        ({"messages": user, "functions": [WEATHER["function"]]}, "functions"),
        ({"messages": user, "chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
        ({"messages": user, "chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ({"messages": user, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ]
    for body, param in cases:
        r = httpx.post(url, json={"model": "kimi-k2-thinking", "max_tokens": 4, **body})
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (body, err)


V32_OUT = ("The user asks for weather; call it.</think>Let me check."
           "\n\n<｜DSML｜function_calls>\n<｜DSML｜invoke name=\"get_weather\">\n"
           "<｜DSML｜parameter name=\"city\" string=\"true\">Rome</｜DSML｜parameter>\n</｜DSML｜invoke>\n"
           "<｜DSML｜invoke name=\"now\">\n\n</｜DSML｜invoke>\n</｜DSML｜function_calls>")


def test_v32_thinking_and_dsml_calls(v32):
    """V3.2 ships no template: the built-in format renders thinking on (chat_template_kwargs) and
    the DSML calls parse, two in one turn."""
    oai = _client(v32)
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Weather in Rome?"}]
    kw = dict(model="deepseek-v32", messages=msgs, tools=[WEATHER, CLOCK], max_tokens=300,
              extra_body={"chat_template_kwargs": {"thinking": True}})
    _script(v32, V32_OUT, end="<｜end▁of▁sentence｜>")
    r = oai.chat.completions.create(**kw)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls"
    assert c.message.reasoning_content == "The user asks for weather; call it."
    assert c.message.content == "Let me check."
    assert [(t.function.name, t.function.arguments) for t in c.message.tool_calls] == \
           [("get_weather", '{"city": "Rome"}'), ("now", "{}")]
    prompt = v32.tokenizer.decode(v32.runner.last_prompt, skip_special_tokens=False)
    assert prompt.startswith("<｜begin▁of▁sentence｜>You are terse.\n\n## Tools\n")
    assert prompt.endswith("</functions>\n<｜User｜>Weather in Rome?<｜Assistant｜><think>")
    _script(v32, V32_OUT, end="<｜end▁of▁sentence｜>")
    reasoning, content, calls, finish = _streamed(oai, **kw)
    assert (reasoning, content, finish) == (c.message.reasoning_content, c.message.content, "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls] == [(t.function.name, t.function.arguments)
                                                           for t in c.message.tool_calls]
    # thinking off: the prompt closes the reasoning, and the answer is all content
    _script(v32, "Sunny.", end="<｜end▁of▁sentence｜>")
    r = oai.chat.completions.create(model="deepseek-v32", messages=msgs, max_tokens=50)
    assert r.choices[0].message.content == "Sunny." and getattr(r.choices[0].message, "reasoning_content", None) is None
    assert v32.tokenizer.decode(v32.runner.last_prompt, skip_special_tokens=False).endswith(
        "<｜User｜>Weather in Rome?<｜Assistant｜></think>")
    bad = httpx.post(v32.http_url + "/v1/chat/completions",
                     json={"messages": msgs, "chat_template_kwargs": {"thinkin": True}, "max_tokens": 4})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"


@pytest.mark.parametrize("fixture", ["kimi", "v32"])
def test_forced_call_from_a_random_model_validates(fixture, request):
    """No script: the tiny random model, held by the tool-call grammar in the model's native
    syntax, always finishes with a call whose arguments validate; streamed == unstreamed."""
    st = request.getfixturevalue(fixture)
    st.runner.script = []
    oai = _client(st)
    tools = [WEATHER, {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 8},
                                         "stars": {"type": "integer", "enum": [1, 2, 3]}},
        "required": ["text", "stars"], "additionalProperties": False}}}]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for choice in ("required", {"type": "function", "function": {"name": "note"}}):
        kw = dict(model=st.model_name, messages=[{"role": "user", "content": "Go."}], tools=tools, tool_choice=choice,
                  max_tokens=600, temperature=1.0, seed=7)  # DSML markers are many tiny-BPE tokens
        r = oai.chat.completions.create(**kw)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls", c
        (call,) = c.message.tool_calls
        if isinstance(choice, dict):
            assert call.function.name == "note"
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        _, _, calls, finish = _streamed(oai, **kw)
        assert finish == "tool_calls"
        assert [(x["name"], x["arguments"]) for x in calls] == [(call.function.name, call.function.arguments)]


def test_tokenize_and_detokenize(kimi):
    url = kimi.http_url
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    r = httpx.post(url + "/tokenize", json={"messages": msgs, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert r.json()["count"] == len(ids) == len(kimi.tokenizer.encode_chat(msgs, tools=[WEATHER]))
    text = httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"]
    assert text.startswith("<|im_system|>tool_declare<|im_middle|>") and text.endswith("<|im_assistant|>assistant<|im_middle|>")
    r = httpx.post(url + "/tokenize", json={"prompt": "<|im_user|>hi", "add_special_tokens": False})
    assert r.json()["tokens"][0] == kimi.tokenizer.token_id("<|im_user|>")
    assert httpx.post(url + "/detokenize", json={"tokens": [10 ** 6]}).json()["error"]["param"] == "tokens"
    assert httpx.post(url + "/tokenize", json={}).status_code == 400


def _grpc_chat(st, **kw):
    """One gRPC Generate over `messages`: (reasoning, text, [(id, name, arguments)], finish_reason)."""
    import grpc

    from protos.moesplit.v1 import generate_pb2, generate_pb2_grpc

    with grpc.insecure_channel(st.grpc_address) as ch:
        rs = list(generate_pb2_grpc.GenerateServiceStub(ch).Generate(generate_pb2.GenerateRequest(**kw), timeout=60))
    calls: dict[int, list[str]] = {}
    for r in rs:
        for c in r.tool_calls:
            cur = calls.setdefault(c.index, ["", "", ""])
            cur[0], cur[1] = cur[0] or c.id, cur[1] or c.name
            cur[2] += c.arguments
    return ("".join(r.reasoning for r in rs), "".join(r.text for r in rs),
            [tuple(calls[i]) for i in sorted(calls)], rs[-1].finish_reason)


def test_grpc_gets_the_same_tool_call_and_reasoning_as_http(kimi):
    from protos.moesplit.v1 import generate_pb2

    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    _script(kimi, KIMI_CALL)
    r = _client(kimi).chat.completions.create(model="kimi-k2-thinking", messages=msgs, tools=[WEATHER],
                                              max_tokens=200, seed=3)
    http_prompt = list(kimi.runner.last_prompt)
    m = r.choices[0].message
    _script(kimi, KIMI_CALL)
    reasoning, text, calls, finish = _grpc_chat(
        kimi, messages=[generate_pb2.ChatMessage(role="user", content="Weather in Paris?")],
        tools_json=json.dumps([WEATHER]), max_tokens=200, seed=3)
    assert kimi.runner.last_prompt == http_prompt  # the same rendering (tools in Kimi's format)
    assert (reasoning, text, finish) == (m.reasoning_content, "", "tool_calls")
    assert calls == [(c.id, c.function.name, c.function.arguments) for c in m.tool_calls]


def test_grpc_chat_fields_are_checked(kimi):
    import grpc

    from protos.moesplit.v1 import generate_pb2

    user = [generate_pb2.ChatMessage(role="user", content="hi")]
    for kw, what in ((dict(prompt="hi", tools_json=json.dumps([WEATHER])), "only with messages"),
                     (dict(messages=user, tools_json="[not json"), "tools_json"),
                     (dict(messages=user, tools_json=json.dumps([WEATHER]), tool_choice_json=json.dumps(
                         {"type": "function", "function": {"name": "nope"}})), "tool_choice")):
        with pytest.raises(grpc.RpcError) as e:
            _grpc_chat(kimi, max_tokens=4, **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and what in e.value.details()
