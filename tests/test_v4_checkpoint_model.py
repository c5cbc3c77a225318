"""A DeepSeek-V4 checkpoint on disk runs in the runtime model (gpu_service.model.v4.load.load_v4)
and gives transformers' tokens.

On make-tiny checkpoints in the real layout — Flash-like with MXFP4 experts, Pro-like with FP8
experts (FP8 attention in both) — the runtime model (float32, weights dequantised by
CheckpointReader, routed experts dequantised into the in-process ReferenceExperts) against
transformers' DeepseekV4ForCausalLM loaded from the same directory (tests/v4_reference.py,
load_reference_v4): every prompt position's logits within 2e-5, 64 greedy tokens equal to its
generate (EOS not stopping) after a prompt longer than the window and than several CSA and HCA
blocks, the same 64 after a prefill in chunks smaller than a compression block, and through
`moesplit generate --in-process`; no indexer score ties at the top-k boundary on those runs (the
tokens do not rest on topk's tie order). Also: every non-expert tensor is loaded, an unknown tensor and a
non-V4 directory are refused by name, bf16 loads keep the float32 set, and the V3-family config
reader sends V4 to the one that reads it (the engine's paths: tests/test_v4_serving.py).
"""
from __future__ import annotations

import functools
import json
import os
import shutil

import numpy as np
import pytest
import torch

from checkpoint import names_v4 as N4
from checkpoint.config import ConfigError
from checkpoint.config_v4 import V4Config
from checkpoint.reader import write_safetensors
from gpu_service.local import tiny
from gpu_service.model.v4.load import load_v4
from gpu_service.model.v4.model import greedy

CASES = {"flash-mxfp4": ("flash", "mxfp4", 3), "pro-fp8": ("pro", "fp8", 7)}  # schedule, format, prefill chunk
PROMPT_LEN = 100
STEPS = 64


@functools.lru_cache(maxsize=None)
def _case(name: str):
    """(checkpoint dir, load_v4 result, transformers model) of one case, made once per session."""
    from tests.v4_reference import load_reference_v4

    schedule, fmt, _ = CASES[name]
    d = os.path.join(_root(), name)
    tiny.make_tiny(d, fmt=fmt, arch="deepseek_v4", v4_schedule=schedule, seed=11)
    return d, load_v4(d), load_reference_v4(d)


@functools.lru_cache(maxsize=None)
def _root() -> str:
    """A temporary directory for the session's checkpoints."""
    import tempfile

    return tempfile.mkdtemp(prefix="v4ckpt-")


def _prompt() -> list[int]:
    """A seeded prompt of PROMPT_LEN ids (no BOS / EOS)."""
    return torch.randint(2, 512, (PROMPT_LEN,), generator=torch.Generator().manual_seed(5)).tolist()


@functools.lru_cache(maxsize=None)
def _hf_tokens(name: str) -> tuple[int, ...]:
    """transformers' generate: greedy, its own cache, EOS not stopping."""
    hf = _case(name)[2]
    ids = torch.tensor(_prompt())[None]
    out = hf.generate(ids, max_new_tokens=STEPS, do_sample=False, eos_token_id=None, pad_token_id=0)
    return tuple(out[0, PROMPT_LEN:].tolist())


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    """Remove the session's checkpoints after the module."""
    yield
    shutil.rmtree(_root(), ignore_errors=True)


@pytest.mark.parametrize("name", CASES)
def test_loads_the_checkpoint_with_the_typed_config(name):
    d, loaded, _ = _case(name)
    cfg, reader = loaded.config, loaded.reader
    assert isinstance(cfg, V4Config) and loaded.model.cfg is cfg
    names = set(reader.names())
    params = {n for n, _ in list(loaded.model.named_parameters()) + list(loaded.model.named_buffers())}
    scales = {n for n in params if n.endswith(".weight_scale_inv")}  # the FP8 linears' scales (Fp8Linear)
    assert params - scales == {n for n in names if N4.parse_expert(n) is None}
    fp8 = {n[:-len("_scale_inv")] for n in scales}
    assert fp8 == {n for n in params - scales if reader.format_of(n) == "fp8_e8m0"} and fp8
    wq_a = loaded.model.layers[2].attn.wq_a
    assert wq_a.weight.dtype == torch.float8_e4m3fn  # kept as stored, dequantised rows are exact:
    assert torch.equal(wq_a.dequant_weight(torch.float32), torch.as_tensor(reader.get("layers.2.attn.wq_a.weight")))
    want_fmt = "mxfp4" if CASES[name][1] == "mxfp4" else "fp8_e8m0"
    assert reader.format_of(N4.expert_weight(3, 0, "down")) == want_fmt
    assert reader.format_of("layers.2.attn.wq_a.weight") == "fp8_e8m0"
    gate_up, down = loaded.experts._weights(3, 1, torch.device("cpu"))
    assert torch.equal(down, torch.as_tensor(reader.get(N4.expert_weight(3, 1, "down"))))
    assert loaded.model.layers[0].ffn.gate.tid2eid.dtype == torch.long
    assert torch.equal(loaded.model.layers[0].ffn.gate.tid2eid,
                       torch.tensor(np.array(reader.get_stored("layers.0.ffn.gate.tid2eid").data)))
    # the prompt crosses the window, several CSA blocks (more than index_topk entries) and HCA blocks
    hca = max(cfg.compress_ratios)
    assert PROMPT_LEN > 4 * cfg.sliding_window and PROMPT_LEN // 4 > 4 * cfg.index_topk and PROMPT_LEN // hca >= 4
    assert {"window", "csa", "hca"} >= set(cfg.layer_kinds) and {"csa", "hca"} <= set(cfg.layer_kinds)


@pytest.mark.parametrize("name", CASES)
def test_prefill_logits_equal_transformers(name):
    _, loaded, hf = _case(name)
    ids = torch.tensor(_prompt())
    with torch.no_grad():
        want = hf(ids[None]).logits[0]
    got = loaded.model(ids, loaded.model.new_cache(), loaded.experts, all_logits=True)
    err = (got - want).abs().max().item()
    assert err < 2e-5, f"logits differ from transformers by {err}"


@pytest.mark.parametrize("name", CASES)
def test_greedy_64_equal_transformers_generate(name):
    _, loaded, _ = _case(name)
    got = greedy(loaded.model, _prompt(), STEPS, loaded.experts)
    want = list(_hf_tokens(name))
    assert got == want
    assert len(set(want)) > 8  # not a degenerate repetition


@pytest.mark.parametrize("name", CASES)
def test_chunked_prefill_equals_one_shot(name):
    """Prefill in chunks smaller than the CSA block (3) or than the HCA block (7), not dividing the prompt."""
    _, loaded, _ = _case(name)
    chunk = CASES[name][2]
    assert chunk < max(loaded.config.compress_ratios) and PROMPT_LEN % chunk
    assert greedy(loaded.model, _prompt(), STEPS, loaded.experts, chunk=chunk) == list(_hf_tokens(name))


@pytest.mark.parametrize("name", CASES)
def test_indexer_picks_have_no_tie_at_the_top_k_boundary(name, monkeypatch):
    """Over the prompt and the 64 tokens, no query's k-th and (k+1)-th best entry score are equal:
    the picks (and so the tokens) do not rest on topk's tie order (make-tiny's 16 indexer heads)."""
    from gpu_service.model.v4.compressor import Indexer

    _, loaded, _ = _case(name)
    seen = []
    score = Indexer.score

    def watch(self, *a):
        """Indexer.score, its rows recorded."""
        scores, ready = score(self, *a)
        seen.extend((row[:r].sort(descending=True).values, self.topk) for row, r in zip(scores, ready.tolist()))
        return scores, ready

    monkeypatch.setattr(Indexer, "score", watch)
    seq = torch.tensor(_prompt() + list(_hf_tokens(name)))
    loaded.model(seq, loaded.model.new_cache(), loaded.experts)
    rows = [(v, k) for v, k in seen if v.numel() > k]
    assert len(rows) > 200
    ties = sum(int(v[k - 1] == v[k]) for v, k in rows)
    assert ties == 0, f"{ties} of {len(rows)} queries tie at the top-k boundary"


def test_generate_in_process_equals_transformers(capsys):
    from moesplit.cli import main as cli_main

    d = _case("flash-mxfp4")[0]
    argv = ["generate", "--model", d, "--prompt-ids", ",".join(map(str, _prompt())),
            "--max-new-tokens", str(STEPS), "--ignore-eos", "--in-process", "--json"]
    assert cli_main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["token_ids"] == list(_hf_tokens("flash-mxfp4")) and res["path"] == "in-process"
    assert res["finish_reason"] == "length"


def test_generate_refuses_what_it_would_ignore(capsys):
    """Options the in-process path cannot honour (--chat among them: the engine path renders chat
    with the V4 encoder), and without --in-process the memory-plan choices the V4 runner cannot
    execute (re-quantised attention weights) are refused by name."""
    from moesplit.cli import main as cli_main

    d = _case("flash-mxfp4")[0]
    base = ["generate", "--model", d, "--prompt-ids", "5,6,7"]
    assert cli_main(base + ["--gpu", "24GiB", "--attention-weights", "int8"]) == 2
    assert "--attention-weights int8" in capsys.readouterr().err
    for extra, word in ((["--temperature", "0.7"], "--temperature"), (["--shards", "3"], "--shards"),
                        (["--kv-tokens", "64"], "--kv-tokens"), (["--chat"], "--chat")):
        assert cli_main(base + ["--in-process"] + extra) == 2
        assert word in capsys.readouterr().err
    with pytest.raises(ConfigError, match="load_any_config"):
        from checkpoint.reader import CheckpointReader

        CheckpointReader(d)  # the V3-family reader: V4 sent to the reader that takes it


def test_generate_in_process_stops_at_eos_and_decodes_text(capsys):
    """With a prompt text (the tiny tokenizer) and EOS stopping: the tokens are a prefix of the
    model's greedy run ending at the first EOS, or the whole run when no EOS comes."""
    from gpu_service.api.tokenizer import Tokenizer
    from moesplit.cli import main as cli_main

    d, loaded, _ = _case("flash-mxfp4")
    assert cli_main(["generate", "--model", d, "--prompt", "hello tiny v4", "--max-new-tokens", "12",
                     "--in-process", "--json"]) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    ids = Tokenizer(d).encode("hello tiny v4")
    assert res["prompt_ids"] == ids
    eos = loaded.config.eos_token_ids
    full = greedy(loaded.model, ids, 12, loaded.experts)
    cut = next((i + 1 for i, t in enumerate(full) if t in eos), len(full))
    assert res["token_ids"] == full[:cut]
    assert res["finish_reason"] == ("stop" if full[cut - 1] in eos else "length")
    assert isinstance(res["text"], str)


def test_bfloat16_load_keeps_the_float32_set():
    d, loaded, _ = _case("pro-fp8")
    m16 = load_v4(d, dtype=torch.bfloat16).model
    assert m16.layers[2].attn.wq_a.weight.dtype == torch.float8_e4m3fn  # FP8 as stored, computed in bf16
    assert m16.layers[2].attn.wkv.weight.dtype == torch.float8_e4m3fn
    assert m16.layers[2].attn.compressor.wkv.weight.dtype == torch.bfloat16
    assert m16.layers[2].ffn.gate.weight.dtype == torch.float32 and m16.layers[0].hc_attn_fn.dtype == torch.float32
    ids = torch.tensor(_prompt())
    a = loaded.model(ids, loaded.model.new_cache(), loaded.experts, all_logits=True)
    b = m16(ids, m16.new_cache(), loaded.experts, all_logits=True)
    assert torch.isfinite(b).all() and (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.85


def test_unknown_tensor_and_non_v4_dir_are_refused(tmp_path):
    d = _case("flash-mxfp4")[0]
    bad = tmp_path / "extra"
    shutil.copytree(d, bad)
    write_safetensors(str(bad / "extra.safetensors"), {"layers.0.attn.bogus.weight": np.zeros((2, 2), np.float32)})
    idx = json.loads((bad / "model.safetensors.index.json").read_text())
    idx["weight_map"]["layers.0.attn.bogus.weight"] = "extra.safetensors"
    (bad / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ValueError, match="layers.0.attn.bogus.weight"):
        load_v4(str(bad))
    v3 = tmp_path / "v3"
    v3.mkdir()
    v3_config = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    (v3 / "config.json").write_text(json.dumps(v3_config))
    with pytest.raises(ConfigError, match="not a DeepSeek-V4 config"):
        load_v4(str(v3))


def test_config_the_model_does_not_implement_is_refused():
    """One config type (V4Config); values the model would not honour are named."""
    import dataclasses
    from types import SimpleNamespace

    from gpu_service.model.v4.model import DeepseekV4

    cfg = _case("pro-fp8")[1].config
    with pytest.raises(TypeError, match="V4Config"):
        DeepseekV4(SimpleNamespace(**dataclasses.asdict(cfg)))
    changes = [({"norm_topk_prob": False}, "norm_topk_prob"),
               ({"compress_ratios": (16, 2, 4, 16, 4, 16)}, "compress_ratios")]
    for change, word in changes:
        with torch.device("meta"), pytest.raises(ValueError, match=word):
            DeepseekV4(dataclasses.replace(cfg, **change))
