"""The GPU service executes the memory plan: per-device bytes equal the plan, and the options
(layer split, CPU embeddings, FP8/INT8 attention, GPU-resident hot experts) keep the outputs right.

On this CPU-only machine each planned GPU is simulated by the CPU: the placement still decides
which planned device holds every parameter and KV page, and that is what is compared."""
import pytest
import torch

from checkpoint.reader import CheckpointReader
from cpu_expert_service.server import load_shard
from gpu_service import plan as P
from gpu_service.model.kv import Chunk
from gpu_service.model.placement import allocated_bytes_by_gpu, Placement
from gpu_service.experts.handoff import LocalExperts
from gpu_service.runtime.runner import ModelRunner
from gpu_service.local.tiny import make_tiny
from tests.hf_reference import load_reference

KV = 512  # multiple of the page size, so the pool holds exactly the planned tokens
WEIGHT_CATEGORIES = ("embeddings", "attention", "indexer", "dense_mlp", "shared_experts", "routers", "norms",
                     "lm_head", "kv_cache", "index_keys", "gpu_experts")

OPTIONS = {
    "unsplit": dict(gpus=["1GiB"]),
    "split": dict(gpus=["1GiB", "1GiB"]),
    "cpu_embeddings": dict(gpus=["1GiB"], embeddings="cpu"),
    "fp8": dict(gpus=["1GiB"], attention_weights="fp8"),
    "int8": dict(gpus=["1GiB"], attention_weights="int8"),
    "gpu_experts": dict(gpus=["1GiB"], gpu_experts=3),
    "split_fp8_cpu_emb_experts": dict(gpus=["1GiB", "1GiB"], embeddings="cpu", attention_weights="fp8",
                                      gpu_experts=2),
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = make_tiny(str(tmp_path_factory.mktemp("plan") / "bf16"), fmt="bf16", seed=7,
                  overrides={"num_hidden_layers": 4, "first_k_dense_replace": 1})
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    return d, reader, LocalExperts(backend)


def _plan(reader, **kw):
    kw.setdefault("embeddings", "gpu")
    kw.setdefault("attention_weights", "bf16")
    kw.setdefault("gpu_experts", 0)
    gpus = kw.pop("gpus")
    return P.make_plan(reader.config, gpus, kv_tokens=KV, min_kv_tokens=KV, chunk_tokens=64, max_batch=4, **kw)


def _runner(reader, experts, plan, dtype):
    placement = Placement.from_plan(plan, [torch.device("cpu")] * len(plan.gpus))
    return ModelRunner(reader, experts, dtype=dtype, placement=placement, page_size=64), placement


@pytest.mark.parametrize("name", list(OPTIONS))
def test_planned_bytes_equal_allocated_bytes_per_device(ckpt, name):
    _, reader, experts = ckpt
    plan = _plan(reader, **OPTIONS[name])
    assert plan.fits
    runner, placement = _runner(reader, experts, plan, torch.bfloat16)
    got = allocated_bytes_by_gpu(runner.model, placement, runner.pool)
    for g, gp in enumerate(plan.gpus):
        planned = sum(v for k, v in gp.items.items() if k in WEIGHT_CATEGORIES)
        print(f"{name}: GPU {g} planned {planned} B, allocated {got.get(g, 0)} B")
        assert abs(got.get(g, 0) - planned) <= 0.02 * planned, (name, g, planned, got)
    if OPTIONS[name].get("embeddings") == "cpu":
        assert got[-1] == reader.config.vocab_size * reader.config.hidden_size * 2  # bf16 embeddings on the CPU


def _teacher_forced(runner, tokens):
    seq = runner.new_seq()
    try:
        return runner.step(tokens, [Chunk(seq, 0, len(tokens))], all_logits=True)
    finally:
        seq.free()


@pytest.fixture(scope="module")
def reference_run(ckpt):
    return _reference(ckpt[0])


def _agreement(reader, experts, reference, fmt):
    prompt, gen, ref_logits = reference
    runner, _ = _runner(reader, experts, _plan(reader, gpus=["1GiB"], attention_weights=fmt), torch.float32)
    logits = _teacher_forced(runner, prompt + gen[:-1])[len(prompt) - 1:]  # [64, V]
    agree = (logits.argmax(-1) == torch.tensor(gen)).float().mean().item()
    cos = torch.nn.functional.cosine_similarity(logits[-1], ref_logits[-1], dim=0).item()
    print(f"{fmt} attention: {agree:.1%} of 64 steps agree, last-step cosine {cos:.6f}")
    return agree, cos


def _reference(d):
    hf = load_reference(d)
    hf.generation_config.eos_token_id = None
    prompt = [0, 5, 77, 300, 41, 9]
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False, output_logits=True,
                        return_dict_in_generate=True)
    return prompt, g.sequences[0, len(prompt):].tolist(), torch.stack([x[0] for x in g.logits])


@pytest.fixture(scope="module")
def dense_routing(tmp_path_factory):
    """Every token uses every expert: no top-k knife edges, so weight noise is all that differs.
    (On tiny random checkpoints with top-4 of 16 routing, near-ties in the router flip experts
    under any perturbation; see the closing note of the plan issue for those numbers.)"""
    d = make_tiny(str(tmp_path_factory.mktemp("dense") / "bf16"), fmt="bf16", seed=7,
                  overrides={"num_hidden_layers": 4, "n_routed_experts": 4, "num_experts_per_tok": 4,
                             "n_group": 1, "topk_group": 1})
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    return d, reader, LocalExperts(backend), _reference(d)


def test_int8_attention_is_faithful(dense_routing):
    """Teacher-forced over the reference's 64 greedy steps: INT8 weight-only attention/shared/dense
    linears (what the planner picks for BF16 checkpoints) agree on >= 90% of the argmaxes and the
    last step's logits have cosine similarity >= 0.999."""
    _, reader, experts, ref = dense_routing
    agree, cos = _agreement(reader, experts, ref, "int8")
    assert agree >= 0.9 and cos >= 0.999


def test_fp8_attention_from_bf16_stays_close(dense_routing):
    """FP8 re-quantised from BF16 (e4m3 keeps 3 mantissa bits, ~3% per weight) is lossier than
    INT8 per channel; on tiny random weights it reaches ~80% agreement, cosine >= 0.99."""
    _, reader, experts, ref = dense_routing
    agree, cos = _agreement(reader, experts, ref, "fp8")
    assert agree >= 0.75 and cos >= 0.99


def test_fp8_attention_on_fp8_checkpoint_is_lossless(tmp_path):
    """DeepSeek's own FP8 checkpoints: fp8 attention keeps the stored e4m3 blocks unchanged."""
    d = make_tiny(str(tmp_path / "fp8"), fmt="fp8", seed=7, overrides={"num_hidden_layers": 4})
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    prompt, gen, ref_logits = ref = _reference(d)
    agree, cos = _agreement(reader, LocalExperts(backend), ref, "fp8")
    assert agree == 1.0 and cos > 0.99999


def test_fp8_checkpoint_with_its_own_scale_blocks(tmp_path):
    """An FP8 checkpoint whose quantization_config.weight_block_size is not 128 x 128: the GPU
    side keeps its blocks as stored (not cropped to 128-blocks), so it computes what the checkpoint
    reader dequantises, and the plan counts its scales exactly."""
    d = make_tiny(str(tmp_path / "fp8b32"), fmt="fp8", seed=7, overrides={
        "num_hidden_layers": 3, "quantization_config": {"weight_block_size": [32, 16]}})
    reader = CheckpointReader(d)
    assert tuple(reader.config.quantization.block_size) == (32, 16)
    _, backend, _ = load_shard(d, None, None, "numpy")
    experts = LocalExperts(backend)
    tokens = [3, 14, 15, 92, 65, 35, 89, 79]
    logits = {}
    for aw in ("checkpoint", "bf16"):  # as stored vs dequantised by the reader
        plan = _plan(reader, gpus=["1GiB"], attention_weights=aw)
        runner, placement = _runner(reader, experts, plan, torch.bfloat16)
        got = allocated_bytes_by_gpu(runner.model, placement, runner.pool)[0]
        planned = sum(v for k, v in plan.gpus[0].items.items() if k in WEIGHT_CATEGORIES)
        assert got == planned, (aw, got, planned)
        logits[aw] = _teacher_forced(runner, tokens).float()
    # the same weights: dequantised to bf16 on the fly, or by the reader at load (a 128-block crop
    # of these 32 x 16 scales had been ~90% off)
    assert torch.nn.functional.cosine_similarity(logits["checkpoint"][-1], logits["bf16"][-1], dim=0) > 0.9999


@pytest.mark.parametrize("name", ["split", "cpu_embeddings", "gpu_experts"])
def test_lossless_options_give_the_reference_tokens(ckpt, reference_run, name):
    _, reader, experts = ckpt
    prompt, gen, ref_logits = reference_run
    opts = dict(OPTIONS[name])
    if name == "gpu_experts":
        opts["expert_format"] = "bf16"  # hot experts at checkpoint precision: exact
    runner, placement = _runner(reader, experts, _plan(reader, **opts), torch.float32)
    if name == "gpu_experts":
        assert placement.hot_experts and all(len(v) == 3 for v in placement.hot_experts.values())
    res = runner.generate(prompt, 64)
    assert res.token_ids == gen
    assert (res.last_logits - ref_logits[-1]).abs().max().item() < 1e-4


def test_plan_that_does_not_fit_stops_generate_before_loading(ckpt, tmp_path):
    import subprocess
    import sys

    d, _, _ = ckpt
    r = subprocess.run([sys.executable, "-m", "moesplit", "generate", "--model", d, "--prompt-ids", "1,2",
                        "--max-new-tokens", "2", "--gpu", "1MiB", "--attention-weights", "bf16",
                        "--embeddings", "gpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "does not fit" in r.stderr and "missing" in r.stderr
    assert "nothing was loaded" in r.stderr


def test_serve_refuses_a_plan_that_does_not_fit_before_starting_anything(ckpt):
    import subprocess
    import sys

    d, _, _ = ckpt
    r = subprocess.run([sys.executable, "-m", "moesplit", "serve", "--model", d, "--port", "0",
                        "--grpc-port", "0", "--gpu", "1MiB", "--gpu", "1MiB", "--attention-weights", "bf16",
                        "--embeddings", "gpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0
    assert "DOES NOT FIT" in r.stdout + r.stderr and "nothing was loaded" in r.stderr
    assert "expert-server" not in r.stderr  # no shard was started


def test_serve_executes_a_two_gpu_plan(ckpt):
    """`serve --gpu X --gpu X` on a CPU-only machine lays the plan's two devices out on the CPU."""
    from openai import OpenAI

    from gpu_service.local.stack import start_shards
    from gpu_service.entrypoints.serving import ServingStack, build_runner

    d, reader, _ = ckpt
    plan = _plan(reader, gpus=["1GiB", "1GiB"])
    placement = Placement.from_plan(plan, [torch.device("cpu")] * 2)
    with start_shards(d, 2, backend="numpy") as shards:
        runner, client, tok = build_runner(d, shards.addresses, dtype="float32", placement=placement)
        assert runner.plan is plan and runner.pool.num_pages * runner.pool.page_size == KV
        with ServingStack(runner, tok, "tiny", port=0, grpc_port=0, closers=[client.close]).start() as stack:
            c = OpenAI(base_url=stack.http_url + "/v1", api_key="x")
            out = c.completions.create(model="tiny", prompt="hello", max_tokens=4, temperature=0)
            assert out.usage.completion_tokens == 4


@pytest.fixture(scope="module")
def trained_dense_routing(tmp_path_factory):
    """The `dense_routing` checkpoint (same config and seeded init), trained for 500 AdamW steps on
    real text (gpu_service.local.tiny_train, ~25 s on one core), so its logits have a trained model's margins."""
    from gpu_service.local.tiny_train import DENSE_ROUTING, train_tiny

    r = train_tiny(str(tmp_path_factory.mktemp("trained") / "bf16"), fmt="bf16", seed=7, overrides=DENSE_ROUTING,
                   steps=500)
    losses = r["losses"]
    print(f"trained {len(losses)} steps in {r['seconds']:.1f} s: loss {losses[0]:.2f} -> "
          f"{sum(losses[-20:]) / 20:.2f} (mean of the last 20)")
    d = r["dir"]
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    return d, reader, LocalExperts(backend), _reference(d)


def test_quantised_attention_on_a_trained_model(trained_dense_routing):
    """The quantised-attention bar (>= 90% greedy agreement), on a briefly trained tiny model instead of random weights (whose near-flat
    logits make FP8's ~2.6% weight noise flip ~20% of greedy near-ties): FP8 re-quantised from BF16
    and INT8 both agree on >= 90% of the 64 teacher-forced greedy steps, last-step cosine >= 0.999.
    Here FP8 gets 59/64 (58 needed), cosine 0.9997; INT8 64/64, 0.99995. Over seeds 1/2/7 x 300/400/
    500 steps FP8 got 92-100% and a last-step cosine 0.9983-0.99996 (one run of nine below 0.999),
    INT8 98-100% and >= 0.9999: FP8 meets the bar on trained weights, but not by a wide margin."""
    _, reader, experts, ref = trained_dense_routing
    logits = ref[2]
    top2 = logits.topk(2, dim=-1).values
    print(f"reference top1-top2 logit gap: median {(top2[:, 0] - top2[:, 1]).median().item():.2f}")
    for fmt in ("fp8", "int8"):
        agree, cos = _agreement(reader, experts, ref, fmt)
        assert agree >= 0.9 and cos >= 0.999, (fmt, agree, cos)
