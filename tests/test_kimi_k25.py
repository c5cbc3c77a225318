"""Kimi-K2.5 / K2.6 (`KimiK25ForConditionalGeneration`): the nested config, the `language_model.`
prefix read by the one reader (GPU side and expert shards), the plan presets, `make-tiny --arch
kimi_k25`, greedy text generation equal to transformers' Kimi_K25ForConditionalGeneration, and
image content parts refused with a 400 that names the part where no image policy is given (a chat
plan without images: tests/test_kimi_k25_images.py serves them)."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from checkpoint import kimi_k25
from checkpoint.config import ConfigError, ModelConfig, load_config
from checkpoint.formats import unpack_int4
from checkpoint.names import expert_weight
from checkpoint.reader import CheckpointReader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(os.path.dirname(ROOT), "shared", "model-configs")
PRESETS = os.path.join(ROOT, "gpu_service", "plan", "presets")


def _real(name):
    for d in (PRESETS, CONFIGS):
        p = os.path.join(d, f"{name}.json")
        if os.path.exists(p):
            with open(p) as f:
                return json.load(f)
    pytest.skip(f"{name}.json not found")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("k25") / "k25"), arch="kimi_k25", seed=4)


def test_real_configs_load_as_the_language_model():
    d = _real("kimi-k2.5")
    cfg = ModelConfig.from_dict(d)
    t = d["text_config"]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.num_experts_per_tok) == \
        (t["hidden_size"], t["num_hidden_layers"], t["n_routed_experts"], t["num_experts_per_tok"])
    assert cfg.quantization.method == "int4" and cfg.quantization.group_size == 32
    assert cfg.weight_prefix == kimi_k25.LANGUAGE_PREFIX
    assert cfg.multimodal["vision_config"]["vt_hidden_size"] == d["vision_config"]["vt_hidden_size"]
    assert cfg.multimodal["media_placeholder_token_id"] == d["media_placeholder_token_id"]
    # the language model is K2-Thinking's: same shapes and routing, so the same fingerprint
    plain = ModelConfig.from_dict(kimi_k25.unwrap(d)[0])
    assert cfg.fingerprint() == plain.fingerprint() and plain.weight_prefix == ""
    k26 = ModelConfig.from_dict(_real("kimi-k2.6"))  # its text_config has no eos: the wrapper's is used
    assert k26.eos_token_ids == (_real("kimi-k2.6")["eos_token_id"],)


def test_a_wrapper_without_text_config_names_the_field():
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict({"architectures": [kimi_k25.ARCHITECTURE], "model_type": "kimi_k25"})


def test_vision_shapes_count_the_real_tower():
    d = _real("kimi-k2.5")
    shapes = kimi_k25.vision_shapes(d["vision_config"], d["text_config"]["hidden_size"])
    tower = [n for n in shapes if n.startswith("vision_tower.")]
    proj = [n for n in shapes if n.startswith("mm_projector.")]
    assert (len(tower), len(proj)) == (329, 6)  # the stored Kimi-K2.5 weight table
    assert shapes["vision_tower.encoder.blocks.0.wqkv.weight"] == (3456, 1152)
    assert shapes["mm_projector.proj.0.weight"] == (4608, 4608)
    assert shapes["mm_projector.proj.2.weight"] == (7168, 4608)
    assert shapes["vision_tower.patch_embed.pos_emb.weight"] == (64, 64, 1152)


def test_tiny_layout_and_reader_prefix_mapping(tiny):
    with open(os.path.join(tiny, "config.json")) as f:
        d = json.load(f)
    assert d["architectures"] == [kimi_k25.ARCHITECTURE] and "text_config" in d and "vision_config" in d
    with open(os.path.join(tiny, "model.safetensors.index.json")) as f:
        stored = list(json.load(f)["weight_map"])
    assert all(n.startswith(("language_model.model.", "language_model.lm_head.", "vision_tower.", "mm_projector."))
               for n in stored)
    assert "vision_tower.encoder.blocks.1.mlp.fc1.weight" in stored and "mm_projector.proj.2.bias" in stored
    r = CheckpointReader(tiny)
    cfg = r.config
    assert r.verify() == len(r.names())
    assert r.has("lm_head.weight") and r.has("model.embed_tokens.weight")
    assert not any(n.startswith(("language_model.", "vision_tower.", "mm_projector.")) for n in r.names())
    vision = [n for n in stored if n.startswith(kimi_k25.VISION_PREFIXES)]
    assert sorted(r.not_served) == sorted(vision) and len(vision) == 2 * 12 + 5 + 6
    # an INT4 expert read by its plain name is the stored `language_model.` triple, dequantised
    layer = cfg.moe_layers[0]
    name = expert_weight(layer, 3, "down")
    assert r.format_of(name) == "int4"
    base = kimi_k25.stored_name(name)[: -len("weight")]
    want = unpack_int4(r.get_raw(base + "weight_packed"), r.get_raw(base + "weight_scale"),
                       tuple(int(x) for x in r.get_raw(base + "weight_shape")), 32)
    np.testing.assert_array_equal(r.get(name), want)
    from checkpoint.reader import MissingTensorError

    with pytest.raises(MissingTensorError, match="stored as 'language_model.model.layers.99"):
        r.get("model.layers.99.mlp.gate.weight")


def test_expert_shards_load_the_nested_checkpoint(tiny):
    from cpu_expert_service.shard_load import load_shard

    cfg, backend, info = load_shard(tiny, None, None, "numpy")
    assert cfg.weight_prefix == kimi_k25.LANGUAGE_PREFIX and info["weight_format"] == "int4"
    r = CheckpointReader(tiny)
    layer = cfg.moe_layers[0]
    x = np.random.default_rng(0).standard_normal((2, cfg.hidden_size)).astype(np.float32)
    ids, w = np.array([[5, 9], [1, 5]], dtype=np.int64), np.array([[0.6, 0.4], [1.0, 0.5]], dtype=np.float32)
    got = backend.forward(layer, x, ids, w)
    want = np.zeros_like(x)
    for t in range(2):
        for e, wt in zip(ids[t], w[t]):
            g, u, dn = (r.get(expert_weight(layer, int(e), k)) for k in ("gate", "up", "down"))
            h = (g @ x[t]) / (1 + np.exp(-(g @ x[t]))) * (u @ x[t])
            want[t] += wt * (dn @ h)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_convert_packs_the_nested_checkpoint(tiny, tmp_path):
    """`moesplit convert` reads the experts through the same reader; the packed shards hold the
    same experts as load_shard's (expert range split: INT4 copied as stored)."""
    from cpu_expert_service.packed import load_packed
    from cpu_expert_service.shard_load import load_shard

    out = str(tmp_path / "packed")
    r = subprocess.run([sys.executable, "-m", "moesplit", "convert", "--model", tiny, "--out", out, "--shards", "2",
                        "--split", "experts", "--quiet"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert r.returncode == 0, r.stderr
    cfg, packed, _ = load_packed(out, 1, "numpy", "auto", model_dir=tiny)
    _, direct, _ = load_shard(tiny, None, None, "numpy")
    layer = cfg.moe_layers[-1]
    x = np.random.default_rng(1).standard_normal((1, cfg.hidden_size)).astype(np.float32)
    e = cfg.n_routed_experts - 1  # held by shard 1 of 2
    ids, w = np.array([[e]], dtype=np.int64), np.array([[1.0]], dtype=np.float32)
    want = direct.forward(layer, x, ids, w)
    assert np.abs(want).max() > 0
    np.testing.assert_allclose(packed.forward(layer, x, ids, w), want, rtol=1e-5, atol=1e-6)


def test_plan_presets_count_the_vision_tower_on_the_first_gpu():
    out = subprocess.run([sys.executable, "-m", "moesplit", "plan", "--model", "kimi-k2.5", "--gpu", "24GiB",
                          "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode in (0, 3), out.stderr
    plan = json.loads(out.stdout)
    d = _real("kimi-k2.5")
    vb = plan["vision"]
    assert vb["params"] == kimi_k25.vision_param_count(d["vision_config"], 7168) and vb["weights"] == 2 * vb["params"]
    assert vb["patches"] >= 16384 and vb["workspace"] > 16384 * 1152 * 2 * 6  # the largest image's activations
    assert plan["gpus"][0]["items"]["vision"] == vb["weights"] + vb["workspace"] + vb["cache"]
    out = subprocess.run([sys.executable, "-m", "moesplit", "plan", "--model", "kimi-k2.6", "--gpu", "24GiB",
                          "--host-ram", "768GiB", "--json"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    k26 = json.loads(out.stdout)
    assert out.returncode == 0 and k26["fits"] and k26["kv_tokens"] >= 32768, out.stdout[-2000:]
    table = subprocess.run([sys.executable, "-m", "moesplit", "plan", "--model", "kimi-k2.6", "--gpu", "24GiB",
                            "--host-ram", "768GiB"], capture_output=True, text=True, cwd=ROOT, timeout=120).stdout
    assert "vision tower + projector on cuda:0" in table and "FITS" in table


PROMPT = [512] + [(i * 37 + 11) % 500 + 2 for i in range(20)]
N_NEW = 32


@pytest.fixture(scope="module")
def reference(tiny):
    """transformers' Kimi_K25ForConditionalGeneration (fp32) greedy on the text-only prompt."""
    from tests.hf_reference import load_reference_kimi_k25

    hf = load_reference_kimi_k25(tiny)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        g = hf.generate(torch.tensor([PROMPT]), max_new_tokens=N_NEW, do_sample=False, output_logits=True,
                        return_dict_in_generate=True)
    return g.sequences[0, len(PROMPT):].tolist(), g.logits[-1][0]


@pytest.mark.parametrize("backend,tol", [("numpy", 1e-4), (None, 2e-2)])
def test_generate_equals_transformers_kimi_k25(tiny, reference, backend, tol):
    """2 shard processes; numpy: fp32 throughout; None: the default backend (the Cython kernels,
    whose 1-token path rounds activations to bf16, as in test_e2e_reference)."""
    cmd = [sys.executable, "-m", "moesplit", "generate", "--model", tiny, "--prompt-ids", ",".join(map(str, PROMPT)),
           "--max-new-tokens", str(N_NEW), "--shards", "2", "--json", "--dtype", "float32", "--device", "cpu",
           "--ignore-eos"] + (["--backend", backend] if backend else [])
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    ref, ref_last = reference
    assert len(ref) == N_NEW and got["token_ids"] == ref
    diff = (torch.tensor(got["last_logits"]) - ref_last).abs().max().item()
    print(f"kimi_k25 backend={backend or 'default'}: last-logits max|diff| {diff:.2e}")
    assert diff < tol, diff


def test_image_part_is_a_400_naming_the_part(tiny):
    from gpu_service.api.chat_request import normalize_messages
    from gpu_service.api.errors import APIError
    from gpu_service.api.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny)
    assert tok.vision_wrapper == kimi_k25.ARCHITECTURE
    assert tok.encode("<|media_pad|>", add_bos=False) == [load_config(tiny).multimodal["media_placeholder_token_id"]]
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                         {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    with pytest.raises(APIError) as e:
        normalize_messages(msgs, vision=tok.vision_wrapper)
    assert e.value.status == 400 and "messages[0].content[1]" in str(e.value)
    assert "image_url" in str(e.value) and "vision tower" in str(e.value) and "not serve" in str(e.value)
    with pytest.raises(APIError) as e:  # a text-only model says so instead
        normalize_messages(msgs)
    assert "text only" in str(e.value) and "vision tower" not in str(e.value)
    assert normalize_messages(msgs[:0] + [{"role": "user", "content": [msgs[0]["content"][0]]}],
                              vision=tok.vision_wrapper)[0]["content"] == "what is this?"
    # the chat request path (what POST /v1/chat/completions runs) refuses it the same way
    from gpu_service.api.chat_request import ChatSettings, chat_plan

    with pytest.raises(APIError) as e:
        chat_plan({"messages": msgs}, tok, ChatSettings())
    assert e.value.status == 400 and e.value.param == "messages[0].content[1]" and "vision tower" in str(e.value)
    plan = chat_plan({"messages": [{"role": "user", "content": "hi"}]}, tok, ChatSettings())
    assert plan.ids and load_config(tiny).multimodal["media_placeholder_token_id"] not in plan.ids

