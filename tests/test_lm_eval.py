"""A peer's test suite as the oracle: lm-evaluation-harness against `moesplit serve`.

`lm_eval --model local-completions` (its OpenAI-completions client, token-id prompts, batched
prompt arrays) is pointed at `moesplit serve` on a tiny seeded bf16 checkpoint (2 shard processes,
numpy expert backend, fp32), offline, with two tasks written here over a small local JSON dataset:

- `moesplit_ll` (output_type loglikelihood): lm-eval scores each continuation from our
  `echo: true, logprobs: 1, max_tokens: 1` answers; every per-example loglikelihood (from
  `--log_samples`) must equal what transformers' `DeepseekV3ForCausalLM` computes on the same
  checkpoint for the same token ids (context/continuation split as lm-eval splits them) within 1e-4;
  its is-greedy flag must equal the reference's argmax test.
- `moesplit_gen` (output_type generate_until, greedy, `until` stop strings): lm-eval's texts must
  equal transformers' greedy `generate` from the same prompt ids, decoded and cut at the first stop
  string as lm-eval's request asks.
"""
import glob
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "tiny-lm-eval"
MAX_GEN = 12
UNTIL = ["\n\n", "."]

LL_DOCS = [  # context, continuation (some contexts end in a space: lm-eval moves it to the continuation)
    {"ctx": "The quick brown fox", "cont": " jumps over the lazy dog"},
    {"ctx": "Question: what is two plus two? Answer:", "cont": " four"},
    {"ctx": "Paris is the capital of ", "cont": "France"},
    {"ctx": "1, 2, 3,", "cont": " 4, 5"},
    {"ctx": "def add(a, b):\n    return", "cont": " a + b"},
    {"ctx": "Mixture of experts", "cont": " models route tokens"},
]
GEN_DOCS = [{"ctx": "Once upon a time"}, {"ctx": "The answer is"}, {"ctx": "Hello, my name is"},
            {"ctx": "In 1969, the first"}]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _write_tasks(d: str) -> None:
    for name, docs in (("ll", LL_DOCS), ("gen", GEN_DOCS)):
        with open(os.path.join(d, f"{name}.jsonl"), "w") as f:
            for doc in docs:
                f.write(json.dumps(doc) + "\n")
    common = (f"dataset_path: json\n"
              f"test_split: test\n")
    with open(os.path.join(d, "moesplit_ll.yaml"), "w") as f:
        f.write(f"task: moesplit_ll\n{common}"
                f"dataset_kwargs:\n  data_files:\n    test: {os.path.join(d, 'll.jsonl')}\n"
                "output_type: loglikelihood\n"
                "doc_to_text: \"{{ctx}}\"\n"
                "doc_to_target: \"{{cont}}\"\n"
                "target_delimiter: \"\"\n"
                "metric_list:\n  - metric: perplexity\n  - metric: acc\n")
    until = json.dumps(UNTIL)
    with open(os.path.join(d, "moesplit_gen.yaml"), "w") as f:
        f.write(f"task: moesplit_gen\n{common}"
                f"dataset_kwargs:\n  data_files:\n    test: {os.path.join(d, 'gen.jsonl')}\n"
                "output_type: generate_until\n"
                "doc_to_text: \"{{ctx}}\"\n"
                "doc_to_target: \"\"\n"
                f"generation_kwargs:\n  until: {until}\n  max_gen_toks: {MAX_GEN}\n  do_sample: false\n"
                "  temperature: 0\n"
                "metric_list:\n  - metric: exact_match\n")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=5)


@pytest.fixture(scope="module")
def server(model_dir):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=ROOT)
    p = subprocess.Popen([sys.executable, "-m", "moesplit", "serve", "--model", model_dir,
                          "--served-model-name", MODEL, "--port", str(port), "--grpc-port", "0",
                          "--shards", "2", "--backend", "numpy", "--dtype", "float32", "--device", "cpu",
                          "--log-level", "WARNING"], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 180
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if p.poll() is not None or time.time() > deadline:
                out = p.communicate(timeout=5)[0] if p.poll() is not None else ""
                pytest.fail(f"moesplit serve did not become ready: {out[-3000:]}")
            time.sleep(0.5)
        yield url
    finally:
        p.terminate()
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


@pytest.fixture(scope="module")
def lm_eval_samples(server, model_dir, tmp_path_factory):
    pytest.importorskip("lm_eval")  # a test dependency: installed by `make setup` ('.[test]')
    d = str(tmp_path_factory.mktemp("lm-eval"))
    _write_tasks(d)
    out = os.path.join(d, "out")
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=os.path.join(d, "hf-datasets"), OPENAI_API_KEY="unused", TOKENIZERS_PARALLELISM="false")
    model_args = ",".join([f"model={MODEL}", f"base_url={server}/v1/completions", "tokenizer_backend=huggingface",
                           f"tokenizer={model_dir}", "tokenized_requests=True", "num_concurrent=2",
                           "max_retries=1", "timeout=120"])
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args,
           "--tasks", "moesplit_ll,moesplit_gen", "--include_path", d, "--batch_size", "4",
           "--log_samples", "--output_path", out]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=d)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-6000:])
    samples = {}
    for task in ("moesplit_ll", "moesplit_gen"):
        files = glob.glob(os.path.join(out, "**", f"samples_{task}_*.jsonl"), recursive=True)
        assert len(files) == 1, (task, files, r.stderr[-3000:])
        with open(files[0]) as f:
            samples[task] = sorted((json.loads(line) for line in f), key=lambda s: s["doc_id"])
    return samples


@pytest.fixture(scope="module")
def hf(model_dir):
    from tests.hf_reference import load_reference

    return load_reference(model_dir)


@pytest.fixture(scope="module")
def tok(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _split(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's context/continuation split for causal models: trailing spaces of the context go to
    the continuation; the whole is encoded and the continuation is what follows the context's ids."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def test_loglikelihoods_equal_transformers(lm_eval_samples, hf, tok):
    samples = lm_eval_samples["moesplit_ll"]
    assert [s["doc_id"] for s in samples] == list(range(len(LL_DOCS)))
    worst = 0.0
    for s, doc in zip(samples, LL_DOCS):
        ctx, cont = _split(tok, doc["ctx"], doc["cont"])
        assert ctx and cont
        ids = torch.tensor([ctx + cont])
        with torch.no_grad():
            logp = torch.log_softmax(hf(ids).logits[0].double(), dim=-1)  # [S, V]
        rows = logp[len(ctx) - 1: len(ctx) + len(cont) - 1]  # predicting each continuation token
        want = float(rows[torch.arange(len(cont)), torch.tensor(cont)].sum())
        want_greedy = bool((rows.argmax(-1) == torch.tensor(cont)).all())
        got_ll, got_greedy = s["resps"][0][0]
        got_ll = float(got_ll)
        worst = max(worst, abs(got_ll - want))
        assert abs(got_ll - want) <= 1e-4, (doc, got_ll, want)
        assert str(got_greedy) == str(want_greedy), (doc, got_greedy, want_greedy)
    print(f"lm-eval loglikelihoods: {len(samples)} examples, max |ours - transformers| = {worst:.2e}")


def test_greedy_generations_equal_transformers(lm_eval_samples, hf, tok, model_dir):
    samples = lm_eval_samples["moesplit_gen"]
    assert [s["doc_id"] for s in samples] == list(range(len(GEN_DOCS)))
    eos = tok.eos_token_id
    nonempty = 0
    for s, doc in zip(samples, GEN_DOCS):
        ids = tok(doc["ctx"], add_special_tokens=False).input_ids
        with torch.no_grad():
            g = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_GEN, do_sample=False, eos_token_id=eos,
                            pad_token_id=eos)
        new = [t for t in g[0, len(ids):].tolist()]
        if eos in new:
            new = new[: new.index(eos)]
        text = tok.decode(new, skip_special_tokens=True)
        for stop in UNTIL + [tok.decode([eos])]:  # lm-eval adds the EOS text to `until`
            if stop in text:
                text = text[: text.index(stop)]
        got = s["resps"][0][0]
        assert got == text, (doc, got, text, new)
        nonempty += bool(text)
    assert nonempty >= 2  # the comparison is about real text, not only immediate stops
