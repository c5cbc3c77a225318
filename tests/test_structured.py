"""Structured outputs and the OpenAI sampling surface, on a tiny random model.

The model emits garbage unless constrained, so every structural property checked here comes
from the grammar engine: json_schema outputs are validated with `jsonschema`, logprobs are
recomputed from the model's logits through a second runner, penalties / logit_bias are checked
against a numpy formula on recorded logits, n > 1 against the same request with seed + i.
One in-process stack (experts in-process, no shard processes) serves the module.
"""
import concurrent.futures
import json
import os
import re
import time

import httpx
import jsonschema
import numpy as np
import pytest
import torch

MODEL = "tiny-structured"
API_KEY = "sk-structured"

SCHEMA = {  # nested objects, arrays, enums, required fields; bounded so generation always ends
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}, "maxItems": 3},
        "owner": {"type": "object",
                  "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120},
                                 "ok": {"type": "boolean"}},
                  "required": ["age", "ok"], "additionalProperties": False},
    },
    "required": ["name", "kind", "tags", "owner"],
    "additionalProperties": False,
}


def _schemas():
    """8 different bounded schemas."""
    out = [SCHEMA]
    for i in range(1, 8):
        props = {f"f{j}": [{"type": "integer", "minimum": -5, "maximum": 5 + i},
                           {"type": "string", "maxLength": i},
                           {"enum": [f"v{i}", "w", None]},
                           {"type": "array", "items": {"type": "boolean"}, "maxItems": i}][(i + j) % 4]
                 for j in range(1 + i % 3)}
        out.append({"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False})
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=0)


@pytest.fixture(scope="module")
def make_runner(model_dir):
    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    _, backend, _ = load_shard(model_dir, None, None, "numpy")

    def make():
        return ModelRunner(CheckpointReader(model_dir), LocalExperts(backend), device=torch.device("cpu"),
                           dtype=torch.float32, kv_tokens=4096, page_size=16)
    return make


@pytest.fixture(scope="module")
def stack(model_dir, make_runner):
    from gpu_service.api.tokenizer import Tokenizer
    from gpu_service.entrypoints.serving import ServingStack

    st = ServingStack(make_runner(), Tokenizer(model_dir), MODEL, port=0, grpc_port=0, api_key=API_KEY,
                      max_batch=8, chunk_tokens=64).start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def oai(stack):
    import openai

    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def ref(make_runner):
    """Reference logits: a separate runner, one sequence at a time, full prefill then decode."""
    from gpu_service.model.kv import Chunk

    runner = make_runner()

    def logits_of(ids: list[int]) -> torch.Tensor:
        """[len(ids), V] float32: row t = the model's logits after ids[:t + 1]."""
        seq = runner.new_seq()
        try:
            seq.reserve(len(ids) + 1)
            return runner.step(ids, [Chunk(seq, 0, len(ids))], all_logits=True).float()
        finally:
            seq.free()
    return logits_of


def _post(stack, path, body):
    return httpx.post(stack.http_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120)


def _chat_ids(stack, text="Describe a pet"):
    return stack.tokenizer.encode_chat([{"role": "user", "content": text}])


# ---- structured outputs ---------------------------------------------------------------------------
def test_json_schema_20_of_20(stack, oai):
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA, "strict": True}}

    def one(seed):
        return oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Describe a pet"}],
                                           response_format=rf, temperature=1.0, seed=seed, max_tokens=200)
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(one, range(20)))
    for r in rs:
        c = r.choices[0]
        assert c.finish_reason == "stop", c
        jsonschema.validate(json.loads(c.message.content), SCHEMA)
    assert len({r.choices[0].message.content for r in rs}) > 10  # really sampled, not one fixed answer
    # greedy too: the grammar's end stops it
    g = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], response_format=rf,
                                    temperature=0, max_tokens=200)
    assert g.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(g.choices[0].message.content), SCHEMA)


def test_eight_concurrent_schemas_do_not_leak(stack, oai):
    schemas = _schemas()

    def one(i):
        return oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"item {i}"}], temperature=1.0, seed=100 + i,
            max_tokens=200, response_format={"type": "json_schema", "json_schema": {"name": f"s{i}",
                                                                                     "schema": schemas[i]}})
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        rs = list(ex.map(one, range(8)))
    assert stack.engine.counters["peak_running"] >= 4  # they really ran batched
    for i, r in enumerate(rs):
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schemas[i])


def test_json_object_and_streamed_equals_unstreamed(stack, oai):
    # the random model rarely closes what it opens: a bias towards '"' and '}' lets it finish;
    # validity itself comes from the grammar (the bias alone gives no JSON)
    tok = stack.tokenizer.tok
    bias = {str(tok.token_to_id('"')): 6, str(tok.token_to_id("}")): 6}
    for seed in range(5):
        r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                        response_format={"type": "json_object"}, temperature=1.0, seed=seed,
                                        max_tokens=200, logit_bias=bias)
        assert r.choices[0].finish_reason == "stop"
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    plain = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "json please"}],
                                        temperature=1.0, seed=0, max_tokens=40, logit_bias=bias)
    with pytest.raises(ValueError):
        json.loads(plain.choices[0].message.content)
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "stream"}], response_format=rf, temperature=0.8,
              seed=7, max_tokens=200)
    whole = oai.chat.completions.create(**kw).choices[0]
    chunks = list(oai.chat.completions.create(stream=True, **kw))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == whole.message.content
    assert chunks[-1].choices[0].finish_reason == "stop" == whole.finish_reason


def test_guided_extras(stack):
    ids = _chat_ids(stack)
    for body, check in (
            ({"guided_regex": r"[a-c]{2,4}-[0-9]{2}"}, lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t)),
            ({"guided_choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe")),
            ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
            ({"guided_grammar": 'root ::= "(" [0-9]+ ")"'}, lambda t: re.fullmatch(r"\(\d+\)", t)),
            ({"guided_json": {"type": "array", "items": {"type": "integer"}, "maxItems": 2, "minItems": 1}},
             lambda t: isinstance(json.loads(t), list))):
        for seed in range(3):
            r = _post(stack, "/v1/completions", {"prompt": ids, "temperature": 1.0, "seed": seed,
                                                 "max_tokens": 64, **body})
            assert r.status_code == 200, r.text
            c = r.json()["choices"][0]
            assert c["finish_reason"] == "stop" and check(c["text"]), (body, c)


def test_refusals_name_the_field_and_server_keeps_serving(stack, oai):
    import openai

    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        ({"messages": msgs, "frobnicate": 1}, "frobnicate"),
        # tools are served since the chat-formats issue (15): a bad schema is what is refused now
        ({"messages": msgs, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
         "tools[0].function.parameters"),
        ({"messages": msgs, "response_format": {"type": "json_schema",
                                                "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "response_format"),
        ({"messages": msgs, "response_format": {"type": "yaml"}}, "response_format"),
        ({"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
        ({"messages": msgs, "logit_bias": {"999999": 5}}, "logit_bias"),
        ({"messages": msgs, "presence_penalty": 3}, "presence_penalty"),
        ({"messages": msgs, "guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
    ]
    for body, param in cases:
        r = _post(stack, "/v1/chat/completions", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param and param in r.json()["error"]["message"], r.text
    r = _post(stack, "/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = _post(stack, "/v1/completions", {"prompt": "hi", "suffix": "x"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    # an invalid regex is an invalid schema (its metaschema says format: regex)
    r = _post(stack, "/v1/chat/completions", {"messages": msgs, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(unclosed"}}}})
    assert r.status_code == 400 and "invalid JSON schema" in r.json()["error"]["message"]
    # valid schemas the engine cannot compile (look-ahead; a keyword it does not implement): 400 with its reason
    for bad, reason in (({"type": "object", "properties": {"a": {"type": "string", "pattern": "(?=x)a"}}},
                         "look-around"),
                        ({"type": "object", "dependentSchemas": {"a": {}}}, "dependentSchemas")):
        with pytest.raises(openai.BadRequestError) as e:
            oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, response_format={
                "type": "json_schema", "json_schema": {"name": "bad", "schema": bad}})
        assert reason in str(e.value) and "cannot compile" in str(e.value)
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_compile_runs_off_the_scheduler_and_is_cached(stack):
    from gpu_service.runtime.grammar import GrammarSpec

    comp = stack.engine.grammars
    spec = GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(30)},
                                    "required": [f"p{i}" for i in range(30)], "additionalProperties": False})
    f1 = comp.compile(spec)
    assert comp.compile(spec) is f1  # cached by (vocabulary, grammar)
    g = f1.result(30)
    assert g.compile_s < 5.0
    names = {t.name for t in __import__("threading").enumerate()}
    assert any(n.startswith("moesplit-grammar") for n in names)
    m = httpx.get(stack.http_url + "/metrics").text
    assert "moesplit_grammar_compile_seconds_count" in m
    assert re.search(r"moesplit_structured_output_requests_total \d+", m)


# ---- logprobs -------------------------------------------------------------------------------------
def test_chat_logprobs_equal_log_softmax_of_the_logits(stack, oai, ref):
    ids = _chat_ids(stack, "logprobs")
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "logprobs"}],
                                    max_tokens=6, temperature=0.9, seed=3, logprobs=True, top_logprobs=4,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    c = r.choices[0]
    out = c.model_extra["token_ids"]
    lp = torch.log_softmax(ref(ids + out), -1)[len(ids) - 1:]  # row t predicts out[t]
    assert len(c.logprobs.content) == len(out) == 6
    for t, (tok, e) in enumerate(zip(out, c.logprobs.content)):
        assert abs(e.logprob - lp[t, tok].item()) < 1e-4
        tops = [x.logprob for x in e.top_logprobs]
        assert len(tops) == 4 and tops == sorted(tops, reverse=True)
        assert np.allclose(tops, torch.topk(lp[t], 4).values.numpy(), atol=1e-4)
        assert bytes(e.bytes) == stack.engine.grammars.vocab.lltokenizer().decode_bytes([tok])
    # streamed: the same logprobs, chunk by chunk
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "logprobs"}], max_tokens=6, temperature=0.9, seed=3,
        logprobs=True, top_logprobs=4, stream=True, extra_body={"ignore_eos": True}))
    streamed = [e.logprob for ch in chunks if ch.choices and ch.choices[0].logprobs
                for e in ch.choices[0].logprobs.content]
    assert np.allclose(streamed, [e.logprob for e in c.logprobs.content], atol=1e-6)


def test_completions_echo_prompt_logprobs(stack, ref):
    """What lm-eval's loglikelihood sends: echo, logprobs 1, max_tokens 0 or 1, a batch of prompts."""
    tok = stack.tokenizer
    prompts = ["The capital of France is Paris", "gRPC streams tokens"]
    for max_tokens in (0, 1):
        r = _post(stack, "/v1/completions", {"prompt": prompts, "echo": True, "logprobs": 1,
                                             "max_tokens": max_tokens, "temperature": 0})
        assert r.status_code == 200, r.text
        for text, c in zip(prompts, r.json()["choices"]):
            ids = tok.encode(text)
            lp = c["logprobs"]
            want = torch.log_softmax(ref(ids), -1)
            assert lp["token_logprobs"][0] is None and len(lp["tokens"]) == len(ids) + max_tokens
            for t in range(1, len(ids)):
                assert abs(lp["token_logprobs"][t] - want[t - 1, ids[t]].item()) < 1e-4
                assert len(lp["top_logprobs"][t]) >= 1
            assert c["text"].startswith(tok.decode(ids))
            assert lp["text_offset"] == sorted(lp["text_offset"])
    # streamed echo gives the same numbers
    with httpx.stream("POST", stack.http_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": prompts[0], "echo": True, "logprobs": 1, "max_tokens": 1, "temperature": 0,
                            "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    lps = [x for e in events if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    whole = r.json()["choices"][0]["logprobs"]["token_logprobs"]  # the last request: max_tokens 1
    assert lps[0] is None and len(lps) == len(whole) and np.allclose(lps[1:], whole[1:], atol=1e-6)
    assert "".join(e["choices"][0]["text"] for e in events) == r.json()["choices"][0]["text"]


# ---- n, seeds, penalties, bias ----------------------------------------------------------------------
def _counter(stack, name):
    m = re.search(rf"^{name} (\S+)$", httpx.get(stack.http_url + "/metrics").text, re.M)
    return float(m.group(1))


def test_n_choices_equal_seed_plus_i(stack):
    ids = _chat_ids(stack, "four samples")
    body = {"messages": [{"role": "user", "content": "four samples"}], "temperature": 1.0, "max_tokens": 10,
            "ignore_eos": True, "return_token_ids": True}
    before = _counter(stack, "moesplit_prefill_tokens_computed_total")
    r = _post(stack, "/v1/chat/completions", {**body, "n": 4, "seed": 40})
    after = _counter(stack, "moesplit_prefill_tokens_computed_total")
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert r.json()["usage"]["prompt_tokens"] == len(ids) and r.json()["usage"]["completion_tokens"] == 40
    for i, c in enumerate(choices):
        one = _post(stack, "/v1/chat/completions", {**body, "seed": 40 + i}).json()["choices"][0]
        assert c["token_ids"] == one["token_ids"]
    assert len({tuple(c["token_ids"]) for c in choices}) > 1
    # the prompt is prefilled once; each other choice computes only its last prompt token
    assert after - before == len(ids) + 3


def test_logit_bias_ban_and_force(stack):
    ids = _chat_ids(stack, "bias")
    base = {"prompt": ids, "temperature": 1.0, "max_tokens": 16, "ignore_eos": True, "return_token_ids": True}
    free = _post(stack, "/v1/completions", {**base, "seed": 1}).json()["choices"][0]["token_ids"]
    banned = free[0]
    for seed in range(3):
        out = _post(stack, "/v1/completions", {**base, "seed": seed, "logit_bias": {str(t): -100 for t in free[:4]}})
        assert not set(out.json()["choices"][0]["token_ids"]) & set(free[:4])
    out = _post(stack, "/v1/completions", {**base, "seed": 5, "logit_bias": {"77": 100}}).json()
    assert out["choices"][0]["token_ids"] == [77] * 16
    assert banned in free


def test_processing_equals_numpy_formula(make_runner, ref, model_dir):
    """Penalties + bias + min_tokens applied in the engine equal the OpenAI / vLLM formulas in numpy."""
    from gpu_service.runtime.logits import process_row
    from gpu_service.runtime.sampling import SamplingParams

    rng = np.random.default_rng(0)
    ids = list(rng.integers(4, 500, 12))
    logits = ref(ids)[-1].numpy().astype(np.float64)
    prompt_len, out = 8, ids[8:] + ids[9:11]
    tokens = ids[:8] + out
    p = SamplingParams(1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                       logit_bias=((7, 2.0), (9, -1.5)), min_tokens=10, stop_token_ids=(11,))
    got = process_row(torch.tensor(logits, dtype=torch.float32), p, tokens, prompt_len, (1, 11)).numpy()
    want = logits.copy()
    want[7] += 2.0
    want[9] -= 1.5
    want[[1, 11]] = -np.inf  # fewer than min_tokens generated: EOS and stop_token_ids banned
    seen = np.zeros_like(want, dtype=bool)
    seen[tokens] = True
    want = np.where(seen, np.where(want > 0, want / 1.3, want * 1.3), want)
    counts = np.bincount(out, minlength=len(want))
    want = want - counts * 0.3 - (counts > 0) * 0.5
    assert np.allclose(got, want, atol=1e-4, equal_nan=False)


def test_min_tokens_and_stop_token_ids(stack):
    ids = _chat_ids(stack, "stop ids")
    base = {"prompt": ids, "temperature": 0, "max_tokens": 12, "return_token_ids": True, "ignore_eos": True}
    free = _post(stack, "/v1/completions", base).json()["choices"][0]["token_ids"]
    stop_at = free[3]
    r = _post(stack, "/v1/completions", {**base, "stop_token_ids": [stop_at]}).json()["choices"][0]
    assert r["finish_reason"] == "stop" and r["token_ids"] == free[:free.index(stop_at) + 1]
    assert r["text"] == stack.tokenizer.decode(free[:free.index(stop_at)])  # the stop token's text is not output
    r = _post(stack, "/v1/completions", {**base, "stop_token_ids": [stop_at], "min_tokens": 12}).json()["choices"][0]
    assert stop_at not in r["token_ids"][:12] and len(r["token_ids"]) == 12


def test_greedy_independent_of_batch(stack):
    ids = _chat_ids(stack, "alone or batched")
    rf = {"type": "json_schema", "json_schema": {"name": "pet", "schema": SCHEMA}}
    body = {"messages": [{"role": "user", "content": "alone or batched"}], "temperature": 0, "max_tokens": 100,
            "response_format": rf, "return_token_ids": True, "frequency_penalty": 0.4}
    alone = _post(stack, "/v1/chat/completions", body).json()["choices"][0]["token_ids"]
    with concurrent.futures.ThreadPoolExecutor(6) as ex:
        noise = [ex.submit(_post, stack, "/v1/completions", {"prompt": ids[:5 + i], "temperature": 1.0, "seed": i,
                                                             "max_tokens": 30, "ignore_eos": True}) for i in range(5)]
        batched = ex.submit(_post, stack, "/v1/chat/completions", body).result().json()["choices"][0]["token_ids"]
        [f.result() for f in noise]
    assert batched == alone


# ---- gRPC ---------------------------------------------------------------------------------------
def test_grpc_constraint_logprobs_and_bias(stack, ref):
    import grpc

    from protos.moesplit.v1 import generate_pb2, generate_pb2_grpc

    ids = _chat_ids(stack, "grpc")
    with grpc.insecure_channel(stack.grpc_address) as ch:
        stub = generate_pb2_grpc.GenerateServiceStub(ch)

        def run(**kw):
            rs = list(stub.Generate(generate_pb2.GenerateRequest(prompt_ids=ids, **{"max_tokens": 200, **kw}), timeout=60,
                                    metadata=(("authorization", f"Bearer {API_KEY}"),)))  # the API key on gRPC too
            return rs, "".join(r.text for r in rs), [t for r in rs for t in r.token_ids]
        rs, text, _ = run(json_schema=json.dumps(SCHEMA), temperature=1.0, seed=11)
        assert rs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)
        rs, text, _ = run(choice=generate_pb2.Choices(options=["left", "right"]), temperature=1.0, seed=2)
        assert text in ("left", "right") and rs[-1].finish_reason == "stop"
        rs, _, out = run(max_tokens=5, logprobs=3, ignore_eos=True, temperature=0.7, seed=1, logit_bias={9: -100})
        lp = torch.log_softmax(ref(ids + out), -1)[len(ids) - 1:]
        got = [x for r in rs for x in r.logprobs]
        assert [x.token_id for x in got] == out and 9 not in out
        for t, x in enumerate(got):
            assert abs(x.logprob - lp[t, x.token_id].item()) < 1e-4 and len(x.top) == 3
        with pytest.raises(grpc.RpcError) as e:
            run(json_schema=json.dumps({"type": "object", "dependentSchemas": {"a": {}}}))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "dependentSchemas" in e.value.details()
