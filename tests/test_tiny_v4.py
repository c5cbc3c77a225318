"""`moesplit make-tiny --arch deepseek_v4`: the real on-disk layout, proven by transformers' own
loading path (DeepseekV4ForCausalLM.from_pretrained through conversion_mapping.py)."""
from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest

from checkpoint import names_v4 as N4
from checkpoint.config_v4 import load_v4_config
from checkpoint.formats_v4 import dequant_mxfp4
from checkpoint.reader import CheckpointReader
from gpu_service.local import tiny
from gpu_service.local.tiny_v4 import HCA_RATIO


def make_tiny_v4(out_dir: str, **kw) -> str:
    """make-tiny's V4 path, as the CLI and the other tests reach it."""
    return tiny.make_tiny(out_dir, arch="deepseek_v4", **kw)

STORED = {  # kind -> (weight dtype, scale dtype or None), as the real V4 checkpoints store them
    "fp8": ("F8_E4M3", "F8_E8M0"), "mxfp4": ("I8", "F8_E8M0"), "bf16": ("BF16", None), "f32": ("F32", None),
    "i64": ("I64", None)}


@pytest.fixture(scope="module")
def flash_mxfp4(tmp_path_factory):
    return make_tiny_v4(str(tmp_path_factory.mktemp("v4flash")), fmt="mxfp4", seed=1, v4_schedule="flash")


@pytest.fixture(scope="module")
def pro_fp8(tmp_path_factory):
    return make_tiny_v4(str(tmp_path_factory.mktemp("v4pro")), fmt="fp8", seed=2, v4_schedule="pro")


def test_layout_names_dtypes_packing(flash_mxfp4):
    with open(f"{flash_mxfp4}/config.json") as f:
        raw = json.load(f)
    n = raw["num_hidden_layers"]
    assert raw["compress_ratios"] == [0, 0] + [4 if i % 2 == 0 else HCA_RATIO for i in range(2, n)] + [0]
    assert raw["quantization_config"]["scale_fmt"] == "ue8m0" and "expert_dtype" not in raw["quantization_config"]
    assert "layer_types" not in raw and "num_hash_layers" in raw  # the original key names
    cfg = load_v4_config(flash_mxfp4)
    r = CheckpointReader(flash_mxfp4, any_architecture=True)
    table = N4.tensor_table(cfg, mtp=True)
    assert set(r.names(include_mtp=True)) == set(table)
    assert r.verify() == len(table)
    assert all(not s.startswith("model.") for s in r._weight_map)  # original spelling
    for name, spec in table.items():
        kind = "mxfp4" if spec.kind == "expert" else spec.kind
        w_dt, s_dt = STORED[kind]
        st = r.get_stored(name)
        assert r.raw_info(st.names.get("weight", name)).dtype == w_dt, name
        if s_dt:
            assert set(st.names) == {"weight", "scale"} and r.raw_info(st.names["scale"]).dtype == s_dt, name
            assert st.names["scale"] == name[: -len("weight")] + "scale"
        else:
            assert len(st.names) == 1, name
    # MXFP4: [out, in/2] bytes, one scale per 32 inputs; decoding the stored bytes ourselves agrees
    e = N4.expert_weight(3, 5, "down")
    st = r.get_stored(e)
    D, inter = cfg.hidden_size, cfg.moe_intermediate_size
    assert st.arrays["weight"].shape == (D, inter // 2) and st.arrays["scale"].shape == (D, inter // 32)
    np.testing.assert_array_equal(r.get(e), dequant_mxfp4(st.arrays["weight"], st.arrays["scale"]))
    # FP8: 128x128 blocks with ue8m0 scales (wq_b [H*hd, q_lora] spans two row blocks)
    st = r.get_stored("layers.2.attn.wq_b.weight")
    H, hd = cfg.num_attention_heads, cfg.head_dim
    assert st.arrays["scale"].shape == (math.ceil(H * hd / 128), math.ceil(cfg.q_lora_rank / 128)) == (2, 1)
    t2e = r.get_stored("layers.0.ffn.gate.tid2eid").data
    assert t2e.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
    assert all(len(set(row)) == len(row) for row in t2e.tolist()) and t2e.max() < cfg.n_routed_experts
    assert "layers.1.ffn.gate.tid2eid" in table and "layers.2.ffn.gate.bias" in table  # num_hash_layers 2


def _check_consumed(model, reader: CheckpointReader):
    """Every dequantised tensor landed in a transformers parameter, values equal."""
    import torch

    info = model.moesplit_loading
    sd = model.state_dict()
    assert sum(v.numel() for v in sd.values()) == sum(
        math.prod(reader.shape_of(n)) for n in info["written"])  # nothing dropped, nothing duplicated
    assert info["mtp"] and all(n.startswith("mtp.0.") for n in info["mtp"])
    cfg = reader.config

    def eq(hf_name, value):
        np.testing.assert_array_equal(sd[hf_name].detach().numpy(), value, err_msg=hf_name)

    eq("model.embed_tokens.weight", reader.get("embed.weight"))
    eq("lm_head.weight", reader.get("head.weight"))
    eq("model.hc_head.hc_fn", reader.get("hc_head_fn"))
    for i, kind in enumerate(cfg.layer_kinds):
        p, q = f"layers.{i}.", f"model.layers.{i}."
        eq(q + "self_attn.o_a_proj.weight", reader.get(p + "attn.wo_a.weight"))
        eq(q + "self_attn.sinks", reader.get(p + "attn.attn_sink"))
        eq(q + "attn_hc.fn", reader.get(p + "hc_attn_fn"))
        eq(q + "input_layernorm.weight", reader.get(p + "attn_norm.weight"))
        w1 = np.stack([reader.get(N4.expert_weight(i, e, "gate")) for e in range(cfg.n_routed_experts)])
        w3 = np.stack([reader.get(N4.expert_weight(i, e, "up")) for e in range(cfg.n_routed_experts)])
        eq(q + "mlp.experts.gate_up_proj", np.concatenate([w1, w3], axis=1))
        eq(q + "mlp.experts.down_proj",
           np.stack([reader.get(N4.expert_weight(i, e, "down")) for e in range(cfg.n_routed_experts)]))
        eq(q + "mlp.shared_experts.down_proj.weight", reader.get(p + "ffn.shared_experts.w2.weight"))
        if cfg.is_hash_layer(i):
            eq(q + "mlp.gate.tid2eid", reader.get_stored(p + "ffn.gate.tid2eid").data)
        else:
            eq(q + "mlp.gate.e_score_correction_bias", reader.get(p + "ffn.gate.bias"))
        if kind != "window":
            eq(q + "self_attn.compressor.position_bias", reader.get(p + "attn.compressor.ape"))
            eq(q + "self_attn.compressor.kv_norm.weight", reader.get(p + "attn.compressor.norm.weight"))
        if kind == "csa":
            eq(q + "self_attn.compressor.indexer.q_b_proj.weight", reader.get(p + "attn.indexer.wq_b.weight"))
            eq(q + "self_attn.compressor.indexer.kv_proj.weight", reader.get(p + "attn.indexer.compressor.wkv.weight"))
            eq(q + "self_attn.compressor.indexer.scorer.weights_proj.weight",
               reader.get(p + "attn.indexer.weights_proj.weight"))
    assert torch.is_floating_point(sd["lm_head.weight"]) and sd["lm_head.weight"].dtype == torch.float32


@pytest.mark.parametrize("which", ["flash_mxfp4", "pro_fp8"])
def test_transformers_loads_every_tensor(which, request):
    pytest.importorskip("transformers")
    import torch

    from tests.v4_reference import load_reference_v4

    d = request.getfixturevalue(which)
    model = load_reference_v4(d)  # asserts no missing / unexpected / mismatched key
    reader = CheckpointReader(d, any_architecture=True)
    cfg = reader.config
    assert cfg.expert_dtype == ("fp8" if which == "pro_fp8" else "fp4")
    assert reader.format_of(N4.expert_weight(2, 0, "gate")) == ("fp8_e8m0" if which == "pro_fp8" else "mxfp4")
    assert list(model.config.layer_types) == [
        {"window": "sliding_attention", "csa": "compressed_sparse_attention",
         "hca": "heavily_compressed_attention"}[k] for k in cfg.layer_kinds]
    _check_consumed(model, reader)
    # a prompt past the window and several compression blocks runs and is not degenerate
    ids = torch.arange(5, 5 + 3 * HCA_RATIO).unsqueeze(0)
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all() and logits.std() > 0.1
    assert len(set(logits.argmax(-1).tolist())) > 3  # greedy choices vary along the prompt


def test_cli_v4_and_errors(tmp_path, capsys):
    p = argparse.ArgumentParser()
    tiny.add_arguments(p)
    assert tiny.run(p.parse_args([str(tmp_path / "a"), "--arch", "deepseek_v4", "--v4-schedule", "pro",
                                  "--format", "fp8", "--seed", "3"])) == 0
    assert "deepseek_v4 (pro) fp8" in capsys.readouterr().out
    cfg = load_v4_config(tmp_path / "a")
    assert cfg.layer_kinds[:3] == ("hca", "hca", "csa") and cfg.expert_dtype == "fp8"
    with pytest.raises(SystemExit, match="deepseek_v4 only"):
        tiny.run(p.parse_args([str(tmp_path / "b"), "--v4-schedule", "pro"]))
    with pytest.raises(SystemExit, match="not a DeepSeek-V4 format"):
        tiny.run(p.parse_args([str(tmp_path / "c"), "--arch", "deepseek_v4", "--format", "int4"]))
    # same seed, same bytes
    make_tiny_v4(str(tmp_path / "d1"), seed=4)
    make_tiny_v4(str(tmp_path / "d2"), seed=4)
    for f in ("model-00001-of-00004.safetensors", "config.json"):
        assert (tmp_path / "d1" / f).read_bytes() == (tmp_path / "d2" / f).read_bytes()


def test_v3_family_reader_names_the_v4_reader(flash_mxfp4):
    """The V3 family's readers (CheckpointReader's default, load_config) send V4 to the ones that read
    it (load_any_config, any_architecture=True: what the engine's paths use, tests/test_v4_serving.py);
    the expert shard and convert take V4 too (tests/test_v4_experts.py)."""
    from checkpoint.config import ConfigError

    with pytest.raises(ConfigError, match="load_any_config .*any_architecture=True"):
        CheckpointReader(flash_mxfp4)
