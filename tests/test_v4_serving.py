"""DeepSeek-V4 served by the engine: the V4 runner (gpu_service.runtime.runner_v4, picked by
gpu_service.runtime.runners) over 2 expert-shard processes on the default backend (the C kernels
where built), its cache in the paged pool (gpu_service.model.v4.paged), float32 on the CPU.

On make-tiny checkpoints in the real layout — Flash-like with MXFP4 experts, Pro-like with FP8
experts — a 100-token prompt (past the window of 8, 25 CSA blocks of 4, 6 HCA blocks of 16):
- 64 greedy tokens through the Engine (check_pool on) equal transformers' DeepseekV4ForCausalLM
  generate, with the prompt in one chunk and in chunks of 3 (under a compression block);
- a second turn (the first turn's prompt + output + new tokens) hits the prefix cache (cached
  tokens > 0, fewer prompt tokens computed) and gives the tokens of a runner without the cache,
  also after a reply too short to cross a page boundary (resumed at the prompt's last boundary);
- 8 concurrent requests in a pool too small for all of them (preemptions happen) each give the
  tokens of its run alone; a request larger than the pool is refused at submit; n = 2 choices
  give the alone run twice;
- the HTTP completions endpoint (and gRPC Generate) returns the runner's greedy run, a JSON schema
  constrains its output (structured outputs), chat is served on both through the built-in V4 encoder;
  `moesplit generate` (shards, no --in-process) gives transformers' tokens; `moesplit gpu-server` over
  the shards serves V4 completions (n = 3 choices too) and chat, executing a memory plan split over 2
  (simulated) GPUs with hot experts, MXFP4 or FP8 as stored;
  options that cannot apply to V4 are refused by name.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile

import httpx
import pytest
import torch

CASES = {"flash-mxfp4": ("flash", "mxfp4"), "pro-fp8": ("pro", "fp8")}
PROMPT_LEN, STEPS, SEED = 100, 64, 11
PAGE = 16  # lcm(4, the tiny HCA ratio 16)

_ROOT = tempfile.mkdtemp(prefix="v4serve-")
_STARTED: dict = {}
_HF: dict = {}


def _prompt(n: int = PROMPT_LEN, seed: int = 5) -> list[int]:
    """A seeded prompt of n ids (no BOS / EOS)."""
    return torch.randint(2, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _served(name: str):
    """(checkpoint dir, runner, experts client, tokenizer) of one case over 2 shard processes, once."""
    if name not in _STARTED:
        from gpu_service.entrypoints.serving import build_runner
        from gpu_service.local import tiny
        from gpu_service.local.stack import start_shards

        schedule, fmt = CASES[name]
        d = os.path.join(_ROOT, name)
        tiny.make_tiny(d, fmt=fmt, arch="deepseek_v4", v4_schedule=schedule, seed=SEED)
        shards = start_shards(d, 2, split="experts", backend="auto")
        try:
            runner, client, tok = build_runner(d, shards.addresses, "cpu", "float32", kv_tokens=2048, page_size=PAGE)
        except BaseException:
            shards.stop()
            raise
        _STARTED[name] = (d, runner, client, tok, shards)
    return _STARTED[name][:4]


def _hf_tokens(name: str) -> list[int]:
    """transformers' greedy generate of the prompt (EOS not stopping)."""
    if name not in _HF:
        from tests.v4_reference import load_reference_v4

        hf = load_reference_v4(_served(name)[0])
        out = hf.generate(torch.tensor(_prompt())[None], max_new_tokens=STEPS, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
        _HF[name] = out[0, PROMPT_LEN:].tolist()
    return _HF[name]


@pytest.fixture(scope="module", autouse=True)
def _cleanup():
    """Stop the shards and remove the checkpoints after the module."""
    yield
    for _, runner, client, _, shards in _STARTED.values():
        client.close()
        shards.stop()
    shutil.rmtree(_ROOT, ignore_errors=True)


def _run(engine, prompt: list[int], steps: int, **kw) -> list[int]:
    """One request's tokens through a started engine."""
    from gpu_service.runtime.sampling import SamplingParams

    h = engine.submit(prompt, SamplingParams(), max_tokens=steps, ignore_eos=True, **kw)
    return [t for o in h for t in o.token_ids]


def _engine(runner, **kw):
    from gpu_service.runtime.engine import Engine

    return Engine(runner, None, check_pool=True, **kw).start()


@pytest.mark.parametrize("name", CASES)
def test_engine_tokens_equal_transformers_one_shot_and_chunked(name):
    from gpu_service.runtime.runner_v4 import V4Runner

    _, runner, client, _ = _served(name)
    assert isinstance(runner, V4Runner) and runner.experts.client is client
    want = _hf_tokens(name)
    for chunk in (512, 3):  # 3: a prefill chunk under the CSA block (4) and the HCA block (16)
        e = _engine(runner, max_batch=4, chunk_tokens=chunk)
        try:
            assert _run(e, _prompt(), STEPS) == want, f"chunk_tokens {chunk}"
            assert e.stats()["errors"] == 0 and e.last_error is None
        finally:
            e.stop()
    assert runner.pool.pages_in_use == runner.pool.cached_pages  # nothing but the cache holds pages


def test_second_turn_hits_the_prefix_cache_with_the_tokens_of_no_cache():
    from gpu_service.runtime.runners import make_runner

    d, runner, client, _ = _served("flash-mxfp4")
    runner.prefix_cache.clear()
    turn1 = _prompt(61, seed=8)
    e = _engine(runner, max_batch=4, chunk_tokens=64)
    try:
        out1 = _run(e, turn1, 40)
        computed = e.stats()["prefill_tokens_computed"]
        cache = runner.prefix_cache
        assert len(cache.snaps) == 1 and cache.snap_pages > 0  # turn 1 left its last boundary, charged pages
        assert runner.pool.pages_in_use == runner.pool.cached_pages == len(cache.gpu_lru) + cache.snap_pages
        turn2 = turn1 + out1 + _prompt(9, seed=9)
        out2 = _run(e, turn2, 24)
        s = e.stats()
    finally:
        e.stop()
    assert s["cached_tokens"] > 0 and s["cached_tokens"] % PAGE == 0 and s["prefix_hits_gpu"] == s["cached_tokens"]
    assert s["prefill_tokens_computed"] - computed == len(turn2) - s["cached_tokens"]
    assert s["prefix_snapshots"] >= 1
    # a short reply that crosses no page boundary: the next turn resumes at the prompt's last boundary
    # (its final prefill chunk ran in two passes split there)
    short1 = _prompt(50, seed=10)
    e = _engine(runner, max_batch=4, chunk_tokens=64)
    try:
        short_out1 = _run(e, short1, 10)  # 50 + 9 fed: the boundary 48 inside the prompt, 64 not reached
        short2 = short1 + short_out1 + _prompt(9, seed=11)
        short_out2 = _run(e, short2, 12)
        assert e.stats()["cached_tokens"] == 48
    finally:
        e.stop()
    from checkpoint.reader import CheckpointReader

    plain = make_runner(CheckpointReader(d, any_architecture=True), runner.experts, device=torch.device("cpu"),
                        dtype=torch.float32, kv_tokens=512, page_size=PAGE, prefix_cache=False)
    assert plain.prefix_cache is None
    e = _engine(plain, max_batch=4, chunk_tokens=64)
    try:
        assert _run(e, turn1, 40) == out1
        assert _run(e, turn2, 24) == out2
        assert _run(e, short1, 10) == short_out1 and _run(e, short2, 12) == short_out2
        assert e.stats()["cached_tokens"] == 0
    finally:
        e.stop()


def test_batch_of_8_each_equals_its_alone_run_with_preemption():
    from checkpoint.reader import CheckpointReader
    from gpu_service.runtime.requests import RequestError
    from gpu_service.runtime.runners import make_runner

    d, big, _, _ = _served("flash-mxfp4")
    runner = make_runner(CheckpointReader(d, any_architecture=True), big.experts, device=torch.device("cpu"),
                         dtype=torch.float32, kv_tokens=320, page_size=PAGE)
    prompts = [_prompt(20 + 9 * i, seed=20 + i) for i in range(8)]
    alone = [runner.generate(p, 24).token_ids for p in prompts]
    e = _engine(runner, max_batch=8, chunk_tokens=40)
    try:
        from gpu_service.runtime.sampling import SamplingParams

        handles = [e.submit(p, SamplingParams(), max_tokens=24, ignore_eos=True) for p in prompts]
        got = [[t for o in h for t in o.token_ids] for h in handles]
        with pytest.raises(RequestError):
            e.submit(_prompt(330), SamplingParams(), max_tokens=4)  # more than the pool holds
        # n = 2 choices of one prompt: forked at the last prompt token (tests/test_v4_fork.py)
        n2 = [[t for o in h for t in o.token_ids] for h in
              e.submit_n(prompts[3], [SamplingParams(), SamplingParams()], max_tokens=24, ignore_eos=True)]
        s = e.stats()
    finally:
        e.stop()
    assert got == alone and n2 == [alone[3], alone[3]]
    assert s["peak_running"] > 1 and s["preempted"] > 0 and s["errors"] == 0
    assert s["prefix_snapshots"] > 0 and s["prefix_snapshots_dropped"] > 0  # charged pages, given back under pressure
    assert len({tuple(g) for g in got}) == 8


def test_http_and_grpc_completions_and_chat():
    from gpu_service.entrypoints.serving import ServingStack

    _, runner, _, tok = _served("flash-mxfp4")
    assert tok is not None
    ids = tok.encode("hello there")
    want = runner.generate(ids, 16, stop_ids=runner.cfg.eos_token_ids).token_ids
    st = ServingStack(runner, tok, "tiny-v4", port=0, grpc_port=0, max_batch=4, chunk_tokens=64).start()
    try:
        r = httpx.post(st.http_url + "/v1/completions", timeout=120,
                       json={"model": "tiny-v4", "prompt": "hello there", "max_tokens": 16, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == tok.decode([t for t in want if t not in runner.cfg.eos_token_ids])
        schema = {"type": "object", "properties": {"a": {"type": "string", "enum": ["yes", "no"]}}, "required": ["a"],
                  "additionalProperties": False}
        r = httpx.post(st.http_url + "/v1/completions", timeout=120, json={
            "model": "tiny-v4", "prompt": "hello there", "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}})
        assert r.status_code == 200, r.text
        assert json.loads(r.json()["choices"][0]["text"])["a"] in ("yes", "no")  # structured outputs on V4
        r = httpx.post(st.http_url + "/v1/chat/completions", timeout=120, json={  # the built-in V4 encoder
            "model": "tiny-v4", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant" and tok.chat_format.family == "deepseek_v4"
        from gpu_service.api.grpc_client import GenerateClient

        with GenerateClient(st.grpc_address) as gc:
            g = next(gc.generate(prompt_ids=ids, max_tokens=16, temperature=0, stream=False))
            assert list(g.token_ids) == want
            g = next(gc.generate(messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0,
                                 stream=False))
            assert len(g.token_ids) >= 1
        m = httpx.get(st.http_url + "/metrics", timeout=30)
        assert m.status_code == 200 and f'category="kv_cache",device="cuda:0"}} {runner.pool.bytes()}' in m.text
    finally:
        st.engine.stop()
        st.http.stop()
        st.grpc_server.stop(grace=0).wait()


def test_generate_through_shards_equals_transformers(capsys):
    from moesplit.cli import main as cli_main

    d = _served("flash-mxfp4")[0]
    argv = ["generate", "--model", d, "--prompt-ids", ",".join(map(str, _prompt())), "--max-new-tokens", str(STEPS),
            "--ignore-eos", "--json"]
    assert cli_main(argv) == 0
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["token_ids"] == _hf_tokens("flash-mxfp4") and res["shards"] == 2


def test_options_that_cannot_apply_are_refused_by_name():
    from gpu_service.entrypoints import serve
    from gpu_service.entrypoints.serving import check_serving_args
    from gpu_service.model.v4.paged import V4Pool

    d, runner, _, _ = _served("flash-mxfp4")
    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    base = ["--model", d, "--page-size", "32"]
    assert check_serving_args(p.parse_args(base)) is None
    plan = ["--gpu", "24GiB", "--embeddings", "cpu", "--gpu-experts", "4"]
    assert check_serving_args(p.parse_args(base + plan)) is None  # a plan with hot MXFP4 experts: executed
    for extra, word in ((["--attention-weights", "int8"], "--attention-weights"),
                        (["--host-kv-cache", "1GiB"], "--host-kv-cache"),
                        (["--page-size", "8"], "multiple of 16")):
        err = check_serving_args(p.parse_args(base + extra))
        assert err is not None and word in err and "DeepSeek-V4" in err
    pro = ["--model", _served("pro-fp8")[0], "--page-size", "32"]  # FP8 experts: hot as stored (Fp8Linear)
    assert check_serving_args(p.parse_args(pro + plan)) is None
    from gpu_service.local import tiny

    plain = os.path.join(_ROOT, "bf16")  # unquantised experts: no hot GPU experts
    tiny.make_tiny(plain, fmt="bf16", arch="deepseek_v4", v4_schedule="pro", seed=SEED)
    err = check_serving_args(p.parse_args(["--model", plain, "--page-size", "32", "--gpu-experts", "4"]))
    assert err is not None and "--gpu-experts" in err and "MXFP4 or block FP8" in err
    with pytest.raises(ValueError, match="multiple of 16"):
        V4Pool(runner.cfg, 4, 24, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("name", CASES)
def test_gpu_server_cli_serves_v4_completions(name):
    import re
    import signal
    import subprocess
    import sys
    import time

    d, runner, _, _ = _served(name)
    addresses = ",".join(_STARTED[name][4].addresses)
    base = [sys.executable, "-m", "moesplit", "gpu-server", "--model", d, "--shards-addresses", addresses,
            "--port", "0", "--grpc-port", "0", "--kv-tokens", "512", "--page-size", str(PAGE), "--dtype", "float32",
            "--device", "cpu", "--log-level", "WARNING"]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    bad = subprocess.run(base + ["--attention-weights", "int8"], cwd=root, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--attention-weights int8" in bad.stderr and "DeepSeek-V4" in bad.stderr
    # a memory plan split over 2 GPUs (simulated by the CPU) with 2 hot experts per layer (MXFP4 or FP8 as
    # stored) is executed (the shards skip the hot experts): the tokens of the one-device runner without them
    p = subprocess.Popen(base + ["--gpu", "1GiB", "--gpu", "1GiB", "--gpu-experts", "2"], cwd=root,
                         stderr=subprocess.PIPE, text=True)
    try:
        url, deadline, lines = None, time.monotonic() + 90, []
        while url is None and time.monotonic() < deadline:
            line = p.stderr.readline()
            if not line and p.poll() is not None:
                break
            lines.append(line)
            m = re.search(r"OpenAI API (http://\S+)/v1", line)
            url = m.group(1) if m else None
        assert url is not None, "".join(lines)
        ids = _prompt(30, seed=3)
        want = runner.generate(ids, 8).token_ids
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": os.path.basename(d), "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["token_ids"] == want
        r = httpx.post(url + "/v1/completions", timeout=120, json={  # n = 3 choices, forked from one prefill
            "model": os.path.basename(d), "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "n": 3})
        assert r.status_code == 200, r.text
        assert [c["token_ids"] for c in r.json()["choices"]] == [want] * 3
        r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": os.path.basename(d), "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_default_page_size_follows_the_architecture(tmp_path):
    """Without --page-size a real V4 release (HCA ratio 128) gets 128-token pages and V3 the usual 64;
    an explicit page size that is not a multiple of the compression blocks is still refused by name."""
    from checkpoint.config_v4 import load_any_config
    from gpu_service.entrypoints import serve
    from gpu_service.entrypoints.serving import check_serving_args, DEFAULT_PAGE_SIZE
    from gpu_service.model.v4.paged import default_page_size, page_block

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    for name, want in (("deepseek-v4-flash", 128), ("deepseek-v4-pro", 128), ("deepseek-v3", DEFAULT_PAGE_SIZE)):
        d = tmp_path / name
        d.mkdir()
        shutil.copy(f"/work/shared/model-configs/{name}.json", d / "config.json")
        args = p.parse_args(["--model", str(d)])
        assert args.page_size is None and check_serving_args(args) is None
        assert args.page_size == want
        cfg = load_any_config(str(d))
        if cfg.is_v4:
            assert page_block(cfg) == 128 and default_page_size(cfg) == 128
            err = check_serving_args(p.parse_args(["--model", str(d), "--page-size", "64"]))
            assert err is not None and "multiple of 128" in err
            assert check_serving_args(p.parse_args(["--model", str(d), "--page-size", "256"])) is None
    d, runner, _, _ = _served("flash-mxfp4")  # the tiny Flash: blocks of 16 -> the usual 64
    assert page_block(runner.cfg) == PAGE and default_page_size(runner.cfg) == DEFAULT_PAGE_SIZE


@pytest.mark.parametrize("name", CASES)
def test_runner_keeps_fp8_linears_as_stored_and_its_weights_are_the_plans(name):
    """The runner's FP8 attention / indexer / shared-expert linears stay FP8 (Fp8Linear, ue8m0 scales
    as float32 powers of two) and every weight byte it holds is the plan's weight items, to the byte."""
    from gpu_service import plan as P
    from gpu_service.model.qlinear import Fp8Linear

    _, runner, _, _ = _served(name)
    model, cfg = runner.model, runner.cfg
    fp8 = [n for n, m in model.named_modules() if isinstance(m, Fp8Linear)]
    attn = model.layers[2].attn
    assert {"layers.2.attn.wq_a", "layers.2.attn.wo_a", "layers.0.ffn.shared_experts.w2"} <= set(fp8)
    assert any(".indexer.wq_b" in n for n in fp8) and attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert all(torch.equal(m.weight_scale_inv, 2.0 ** m.weight_scale_inv.log2().round())
               for m in model.modules() if isinstance(m, Fp8Linear))  # e8m0: powers of two, exact
    plan = P.make_plan(cfg, ["1GiB"], kv_tokens=512, min_kv_tokens=512, embeddings="gpu",
                       attention_weights="checkpoint", gpu_experts=0, dtype="float32")
    items = plan.gpus[0].items
    weights = sum(t.untyped_storage().nbytes() for t in list(model.parameters()) + list(model.buffers()))
    assert weights == sum(v for k, v in items.items()
                          if k not in ("workspace", "reserve", "kv_cache", "index_keys", "kv_window"))
    assert items["attention"] < sum(t.numel() * 4 for n, t in model.named_parameters() if ".attn." in n
                                    and ".compressor." not in n and ".indexer." not in n and "weight_scale" not in n)
