"""Tokenizers from the files present: Kimi's tiktoken.model (+ tokenizer_config.json) and
tokenizer.json; pre-tokenization, special tokens, skip/keep, streaming detokenization."""
import json
import os

import pytest

from gpu_service.api.tokenizer import TokenizerError, load_tokenizer
from gpu_service.local import tiny_tokenizers
from gpu_service.local.tiny import SPECIAL_TOKENS, TOKENIZER_TEXT

# the eight alternatives of formats.md, written out here independently of the code under test
PATTERN = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])
TEXT = "我们学习。Don't STOP'S now 12345 😀👍 def f(x):\r\n\treturn x  \n"
# "。" is the optional non-letter that leads the next word; " " before the digits is alternative 8
SPLITS = ["我们学习", "。Don't", " STOP'S", " now", " ", "123", "45", " 😀👍", " def", " f", "(x", "):\r\n",
          "\treturn", " x", "  \n"]


@pytest.fixture(scope="module")
def kimi_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kimi"))
    tiny_tokenizers.write("kimi-k2-thinking", d, TOKENIZER_TEXT, SPECIAL_TOKENS)
    return d


def test_pattern_and_hand_written_splits():
    import regex

    from gpu_service.api.tiktoken_tokenizer import KIMI_PATTERN

    assert KIMI_PATTERN == PATTERN
    assert regex.findall(PATTERN, TEXT, flags=regex.V1) == SPLITS


def test_kimi_ids_equal_a_tiktoken_encoding(kimi_dir):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    tok = load_tokenizer(kimi_dir)
    assert tok.kind == "tiktoken.model" and tok.vocab_size == 768
    ranks = load_tiktoken_bpe(os.path.join(kimi_dir, "tiktoken.model"))
    cfg = json.load(open(os.path.join(kimi_dir, "tokenizer_config.json")))
    n = len(ranks)
    specials = {f"<|reserved_token_{i}|>": i for i in range(n, n + 256)}
    for k, v in cfg["added_tokens_decoder"].items():
        specials.pop(f"<|reserved_token_{k}|>")
        specials[v["content"]] = int(k)
    ref = tiktoken.Encoding("ref", pat_str=PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    for text in (TEXT, TOKENIZER_TEXT, "<|im_user|>user<|im_middle|>héllo wörld<|im_end|>"):
        ids = tok.encode(text, add_bos=False)
        assert ids == ref.encode(text, allowed_special="all")
        assert tok.decode(ids, skip_special_tokens=False) == text
    # every special slot encodes to its id, named or reserved; Kimi's offsets after the ranks
    for name, i in specials.items():
        assert tok.encode(name, add_bos=False) == [i] and tok.token_id(name) == i
    assert tok.token_id("<|im_end|>") == n + 2 and tok.token_id("<|tool_calls_section_begin|>") == n + 11
    assert tok.token_id(f"<|reserved_token_{n + 5}|>") == n + 5
    assert tok.stop_token_ids == (n + 2,)  # generation_config.json: <|im_end|> ends a turn


def test_skip_special_keeps_parser_markers(kimi_dir):
    tok = load_tokenizer(kimi_dir)
    text = "[BOS]<think>hm</think>ok<|tool_calls_section_begin|><|tool_call_begin|>x<|im_end|>"
    ids = tok.encode(text, add_bos=False)
    assert tok.decode(ids) == "<think>hm</think>ok<|tool_calls_section_begin|><|tool_call_begin|>x"
    assert tok.decode(ids, skip_special_tokens=False) == text


@pytest.mark.parametrize("kind", ["kimi-k2", "deepseek-v3"])
def test_streaming_detokenization_keeps_characters_whole(tmp_path, kind):
    """The engine's incremental detokenizer over a text whose characters span several tokens."""
    import types

    from gpu_service.runtime.engine import Engine

    tiny_tokenizers.write(kind, str(tmp_path), TOKENIZER_TEXT, SPECIAL_TOKENS)
    tok = load_tokenizer(str(tmp_path))
    text = "Ünïcode: 😀👍 你好世界 — ok"
    ids = tok.encode(text, add_bos=False)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)  # some token splits a character
    r = types.SimpleNamespace(out=[], prefix_offset=0, read_offset=0)
    eng = types.SimpleNamespace(tokenizer=tok)
    pieces = []
    for i in ids:
        r.out.append(i)
        pieces.append(Engine._detok(eng, r, r.out))
    assert "".join(pieces) == text and all("\ufffd" not in p for p in pieces)


def test_chosen_from_files_present(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json and tiktoken.model"):
        load_tokenizer(str(tmp_path))
    tiny_tokenizers.write("deepseek-r1", str(tmp_path), TOKENIZER_TEXT, SPECIAL_TOKENS)
    tok = load_tokenizer(str(tmp_path))
    assert tok.kind == "tokenizer.json" and tok.chat_format.family == "deepseek_r1"
    ids = tok.encode("<｜User｜>hi<think>", add_bos=True)
    assert ids[0] == 0 and tok.token_id("<｜User｜>") in ids and ids[-1] == tok.token_id("<think>")
    assert tok.decode(ids) == "hi<think>"  # BOS and <｜User｜> are special: skipped; <think> is kept


def test_bad_rank_file_names_the_line(tmp_path):
    tiny_tokenizers.write("kimi-k2", str(tmp_path), TOKENIZER_TEXT, SPECIAL_TOKENS)
    with open(tmp_path / "tiktoken.model", "a") as f:
        f.write("not-base64!! x\n")
    with pytest.raises(TokenizerError, match=r"tiktoken.model:513"):
        load_tokenizer(str(tmp_path))
