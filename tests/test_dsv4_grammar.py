"""`tool_choice` required / named for DeepSeek-V4: the grammar (gpu_service.api.tool_grammar)
held against the real V4 vocabulary by the grammar engine accepts the call in V4's DSML syntax
token by token, refuses arguments outside the schema and V3.2's closing, and what it accepts
parses (deepseek_v4 parser) into arguments that validate."""
import json
import os

import jsonschema
import pytest

from gpu_service.api.parsers import TOOL_PARSERS

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]},
                                     "days": {"type": "integer"}},
    "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "maxLength": 8}}, "required": ["text"]}}}]
P, PE = '<｜DSML｜parameter name="', "</｜DSML｜parameter>"
CLOSE = "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """(our tokenizer on the real V4 files, a grammar compiler on their vocabulary)."""
    from gpu_service.api.tokenizer import load_tokenizer
    from gpu_service.local import tiny_tokenizers
    from gpu_service.runtime.grammar import GrammarCompiler
    from gpu_service.runtime.vocab import HFVocabulary

    d = str(tmp_path_factory.mktemp("v4g"))
    try:
        tiny_tokenizers.write("deepseek-v4", d, "", [])
    except RuntimeError as e:
        pytest.skip(str(e))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["DeepseekV4ForCausalLM"]}, f)
    tok = load_tokenizer(d)
    with open(os.path.join(d, "tokenizer.json"), encoding="utf-8") as f:
        compiler = GrammarCompiler(HFVocabulary(f.read(), tok.vocab_size, tok.stop_token_ids))
    yield tok, compiler
    compiler.close()


def _accepts(engine, choice, text) -> bool:
    from gpu_service.api.tool_grammar import tool_call_grammar

    tok, compiler = engine
    m = compiler.compile(tool_call_grammar("deepseek_v4", TOOLS, choice, tok)).result().matcher()
    return all(m.accept(t) for t in tok.encode(text, add_bos=False)) and m.accepting


NAMED = {"type": "function", "function": {"name": "get_weather"}}
GOOD = f'{P}city" string="true">Rome{PE}\n{P}days" string="false">3{PE}\n' + CLOSE


@pytest.mark.parametrize("choice, text, ok", [
    ("required", 'get_weather">\n' + GOOD, True),
    ("required", f'note">\n{P}text" string="true">hi there{PE}\n' + CLOSE, True),
    ("required", f'note">\n{P}text" string="true">far too long{PE}\n' + CLOSE, False),  # maxLength 8
    ("required", 'unknown">\n' + GOOD, False),
    (NAMED, GOOD, True),
    (NAMED, f'{P}city" string="true">Paris{PE}\n' + CLOSE, True),  # optional days left out
    (NAMED, f'{P}city" string="true">Berlin{PE}\n' + CLOSE, False),  # not in the enum
    (NAMED, f'{P}days" string="false">3{PE}\n' + CLOSE, False),  # required city missing
    (NAMED, f'{P}city" string="true">Paris{PE}\n</｜DSML｜invoke>\n</｜DSML｜function_calls>', False),  # V3.2's
])
def test_grammar(engine, choice, text, ok):
    assert _accepts(engine, choice, text) == ok


def test_accepted_call_parses_and_validates(engine):
    p = TOOL_PARSERS["deepseek_v4"]()
    content, calls = p.parse(p.forced_prefix("get_weather") + GOOD, True)
    assert content == "" and [c.name for c in calls] == ["get_weather"] and calls[0].complete
    args = json.loads(calls[0].arguments)
    jsonschema.validate(args, TOOLS[0]["function"]["parameters"])
    assert args == {"city": "Rome", "days": 3}
