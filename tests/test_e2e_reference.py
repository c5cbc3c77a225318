"""End to end: `moesplit generate` (GPU service + 2 real shard processes over gRPC) against the
transformers reference `DeepseekV3ForCausalLM` on tiny seeded checkpoints, fp32 on CPU."""
import json
import os
import subprocess
import sys

import pytest
import torch

from gpu_service.local.tiny import make_tiny
from tests.hf_reference import load_reference

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
N_NEW = 32

CONFIGS = {
    # n_group > 1 with topk_group < n_group, first_k_dense_replace 1, one shared expert, H=96
    "grouped": {},
    # Kimi-style n_group = 1, first_k_dense_replace 2, two shared experts, H=80 (not a power of two)
    "kimi_style": {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 2, "n_shared_experts": 2,
                   "hidden_size": 80, "num_hidden_layers": 4, "n_routed_experts": 12, "num_experts_per_tok": 3},
}
PROMPTS = {"short": [0, 17, 42], "long": [0] + [(i * 37 + 11) % 500 + 2 for i in range(40)]}


def generate(model_dir, prompt, split="experts", n=N_NEW, backend="numpy"):
    cmd = [sys.executable, "-m", "moesplit", "generate", "--model", model_dir,
           "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", str(n),
           "--shards", "2", "--split", split, "--json", "--dtype", "float32", "--device", "cpu",
           "--backend", backend, "--ignore-eos"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def reference(model_dir, prompt, n=N_NEW):
    hf = load_reference(model_dir)
    hf.generation_config.eos_token_id = None  # both sides generate all n tokens (--ignore-eos)
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_logits=True,
                        return_dict_in_generate=True)
    toks = g.sequences[0, len(prompt):].tolist()
    return toks, g.logits[len(toks) - 1][0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    base = tmp_path_factory.mktemp("e2e")
    out = {}
    for name, over in CONFIGS.items():
        out[(name, "bf16")] = make_tiny(str(base / f"{name}-bf16"), fmt="bf16", seed=1, overrides=over)
    out[("grouped", "fp8")] = make_tiny(str(base / "grouped-fp8"), fmt="fp8", seed=2)
    out[("grouped", "int4")] = make_tiny(str(base / "grouped-int4"), fmt="int4", seed=3)
    return out


def check_equal(got, prompt, model_dir):
    ref_toks, ref_last = reference(model_dir, prompt)
    assert got["token_ids"] == ref_toks
    diff = (torch.tensor(got["last_logits"]) - ref_last).abs().max().item()
    print(f"{os.path.basename(model_dir)} prompt={len(prompt)} tokens={len(ref_toks)} last-logits max|diff|={diff:.2e}")
    assert diff < 1e-4
    assert len(ref_toks) == N_NEW


@pytest.mark.parametrize("cfg_name", list(CONFIGS))
@pytest.mark.parametrize("prompt_name", list(PROMPTS))
def test_bf16_matches_reference(ckpts, cfg_name, prompt_name):
    d = ckpts[(cfg_name, "bf16")]
    check_equal(generate(d, PROMPTS[prompt_name]), PROMPTS[prompt_name], d)


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_quantized_matches_reference_on_dequantized_weights(ckpts, fmt):
    d = ckpts[("grouped", fmt)]
    check_equal(generate(d, PROMPTS["long"]), PROMPTS["long"], d)


def test_split_by_intermediate_slice_gives_same_tokens(ckpts):
    d = ckpts[("grouped", "bf16")]
    a = generate(d, PROMPTS["long"], split="experts")
    b = generate(d, PROMPTS["long"], split="intermediate")
    assert a["token_ids"] == b["token_ids"]
    assert (torch.tensor(a["last_logits"]) - torch.tensor(b["last_logits"])).abs().max().item() < 1e-4


def test_text_prompt_uses_tokenizer(ckpts):
    d = ckpts[("grouped", "fp8")]
    cmd = [sys.executable, "-m", "moesplit", "generate", "--model", d, "--prompt", "Hello there",
           "--max-new-tokens", "5", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert isinstance(out["text"], str) and len(out["token_ids"]) >= 1


@pytest.mark.parametrize("fmt", ["bf16", "int4"])
def test_cython_kernels_end_to_end(ckpts, fmt):
    """The shards on the Cython kernels (what `--backend auto` runs): the same greedy tokens as
    the reference. The BF16 kernel's 1-token path rounds activations to bf16 (as the bf16 wire
    of a real deployment does), so logits agree to ~1e-3 rather than fp32's 1e-6."""
    from cpu_expert_service.backend import available_backends

    assert "kernels" in available_backends(), "the Cython kernels are not built: run `make setup`"
    d = ckpts[("grouped", fmt)]
    got = generate(d, PROMPTS["long"], backend="kernels")
    ref_toks, ref_last = reference(d, PROMPTS["long"])
    diff = (torch.tensor(got["last_logits"]) - ref_last).abs().max().item()
    print(f"kernels {fmt}: last-logits max|diff| {diff:.2e}")
    assert got["token_ids"] == ref_toks
    assert diff < 2e-2
