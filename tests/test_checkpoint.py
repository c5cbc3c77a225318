"""checkpoint/ (names, formats, reader, config errors) and `moesplit make-tiny`."""
from __future__ import annotations

import json
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from checkpoint import names as N
from checkpoint.config import ConfigError, load_config
from checkpoint.formats import (
    FP8_E4M3,
    dequant_fp8_block,
    pack_int4,
    quant_fp8_block,
    unpack_int4,
    unpack_int4_q,
)
from checkpoint.reader import CheckpointError, CheckpointReader, MissingTensorError, write_safetensors

BF16 = np.dtype(ml_dtypes.bfloat16)
MODEL_CONFIGS = "/work/shared/model-configs"


# ---- formats: FP8 ------------------------------------------------------------------------------
def test_fp8_roundtrip_partial_edge_blocks():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((130, 300)) * np.linspace(0.01, 3, 300)).astype(np.float32)
    w[:128, :128] = 0.0  # an all-zero block
    q, s = quant_fp8_block(w, (128, 128))
    assert q.dtype == FP8_E4M3 and q.shape == w.shape
    assert s.dtype == np.float32 and s.shape == (2, 3)
    assert s[0, 0] == 1.0  # zero block guarded
    np.testing.assert_allclose(s[1, 2], np.abs(w[128:, 256:]).max() / 448, rtol=1e-6)
    d = dequant_fp8_block(q, s, (128, 128))
    assert d.dtype == np.float32 and d.shape == w.shape
    full = np.repeat(np.repeat(s, 128, 0), 128, 1)[:130, :300]
    # e4m3: 3 mantissa bits -> half-ulp relative error 2^-4; subnormals: absolute 2^-10 * scale
    bound = np.maximum(np.abs(w) * 2.0**-4, full * 2.0**-10) * 1.0001
    assert np.all(np.abs(d - w) <= bound)
    assert np.all(np.isfinite(d)) and np.all(d[:128, :128] == 0)


def test_fp8_hand_computed_2x2_blocks():
    # 3x3 weight, 2x2 blocks -> 2x2 scales, three of them partial
    w = np.array([[1, -2, 4], [0.5, 0.25, -8], [3, 0, 0]], np.float32)
    q, s = quant_fp8_block(w, (2, 2))
    np.testing.assert_allclose(s, [[2 / 448, 8 / 448], [3 / 448, 1.0]], rtol=1e-7)
    np.testing.assert_array_equal(q.astype(np.float32), [[224, -448, 224], [112, 56, -448], [448, 0, 0]])
    np.testing.assert_allclose(dequant_fp8_block(q, s, (2, 2)), w, rtol=1e-6)
    # dequant alone: every element times its block's scale_inv
    q = np.arange(1, 10, dtype=np.float32).reshape(3, 3).astype(FP8_E4M3)
    s = np.array([[0.5, 2.0], [10.0, -1.0]], np.float32)
    np.testing.assert_array_equal(dequant_fp8_block(q, s, (2, 2)), [[0.5, 1, 6], [2, 2.5, 12], [70, 80, -9]])
    with pytest.raises(ValueError, match="weight_block_size"):
        dequant_fp8_block(q, s[:1], (2, 2))


# ---- formats: INT4 -----------------------------------------------------------------------------
def test_int4_hand_computed_nibble_order():
    # group of 8: amax 3.75 -> scale 3.75/7.5 = 0.5 (exact in bf16); q = round_half_even(w/0.5)
    g0 = [-3.75, -3.5, 0, 0.5, 1, 1.5, -0.5, 3.5]  # q = [-8, -7, 0, 1, 2, 3, -1, 7]
    g1 = [0.75, -0.375]  # in=10: partial group, amax .75 -> scale bf16(0.1); q = [7, -4]
    w = np.array([g0 + g1], np.float32)
    packed, scale, shape = pack_int4(w, group_size=8)
    # nibbles q+8 = [0, 1, 8, 9, 10, 11, 7, 15], least significant first -> 0xF7BA9810
    assert packed.dtype == np.int32 and packed.shape == (1, 2)
    assert packed[0, 0] == np.int32(0xF7BA9810 - (1 << 32))
    assert packed[0, 1] == 0x4F  # nibbles [15, 4], then raw-0 padding
    assert scale.dtype == BF16 and scale.shape == (1, 2)
    assert float(scale[0, 0]) == 0.5 and scale[0, 1] == np.float32(0.75 / 7.5).astype(BF16)
    assert shape.dtype == np.int32 and shape.tolist() == [1, 10]
    np.testing.assert_array_equal(unpack_int4_q(packed, shape), [[-8, -7, 0, 1, 2, 3, -1, 7, 7, -4]])
    d = unpack_int4(packed, scale, shape, group_size=8)
    np.testing.assert_array_equal(d[0, :8], [-4, -3.5, 0, 0.5, 1, 1.5, -0.5, 3.5])
    np.testing.assert_allclose(d[0, 8:], np.array([7, -4]) * float(scale[0, 1]))


@pytest.mark.parametrize("shape,group", [((64, 96), 32), ((5, 100), 32), ((3, 37), 32), ((4, 50), 16)])
def test_int4_roundtrip(shape, group):
    rng = np.random.default_rng(1)
    w = rng.standard_normal(shape).astype(np.float32)
    packed, scale, wshape = pack_int4(w, group)
    out, inp = shape
    assert packed.shape == (out, -(-inp // 8)) and scale.shape == (out, -(-inp // group))
    d = unpack_int4(packed, scale, wshape, group)
    sfull = np.repeat(scale.astype(np.float32), group, 1)[:, :inp]
    # |err| <= scale/2 inside [-8, 7] steps; +amax sits at 7.5 steps (x (1 + 2^-8) for the bf16-rounded
    # scale) and clips to 7: <= 0.5 + 7.5 * 2^-8 steps
    assert np.all(np.abs(d - w) <= sfull * (0.5 + 7.5 * 2.0**-8) + 1e-6)
    q = unpack_int4_q(packed, wshape)
    assert q.min() >= -8 and q.max() <= 7
    # a zero group gets scale eps, not 0 / nan
    p0, s0, sh0 = pack_int4(np.zeros((2, 16), np.float32), 8)
    assert np.all(unpack_int4(p0, s0, sh0, 8) == 0) and np.all(s0.astype(np.float32) > 0)


# ---- names -------------------------------------------------------------------------------------
def test_names_helpers_and_real_configs():
    assert N.expert_weight(3, 17, "gate") == "model.layers.3.mlp.experts.17.gate_proj.weight"
    assert N.parse_expert("model.layers.3.mlp.experts.17.down_proj.weight") == (3, 17, "down")
    assert N.parse_expert("model.layers.3.mlp.shared_experts.down_proj.weight") is None
    assert N.is_routed_expert(N.expert_weight(0, 0, "up"))
    with pytest.raises(ValueError):
        N.expert_weight(0, 0, "gate_up")
    v3 = N.expected_shapes(load_config(f"{MODEL_CONFIGS}/deepseek-v3.json"))
    assert v3["model.layers.0.mlp.gate_proj.weight"] == (18432, 7168)
    assert v3["model.layers.5.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert v3["model.layers.5.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert v3["model.layers.5.mlp.gate.weight"] == (256, 7168)
    assert v3[N.expert_weight(60, 255, "down")] == (7168, 2048)
    assert not any(N.parse_layer(n) == 61 for n in v3)  # MTP layer left out
    assert sum(N.is_routed_expert(n) for n in v3) == 58 * 256 * 3
    v32 = N.expected_shapes(load_config(f"{MODEL_CONFIGS}/deepseek-v3.2.json"))
    p = "model.layers.0.self_attn.indexer."
    assert v32[p + "wq_b.weight"] == (64 * 128, 1536) and v32[p + "wk.weight"] == (128, 7168)
    assert v32[p + "k_norm.weight"] == (128,) and v32[p + "k_norm.bias"] == (128,)
    assert v32[p + "weights_proj.weight"] == (64, 7168)
    kimi = N.expected_shapes(load_config(f"{MODEL_CONFIGS}/kimi-k2-thinking.json"), routed=False)
    assert kimi["model.layers.1.mlp.gate.weight"] == (384, 7168) and not any(map(N.is_routed_expert, kimi))


# ---- config errors -----------------------------------------------------------------------------
def test_config_errors(tmp_path):
    from gpu_service.local.tiny import tiny_config

    d = tiny_config()
    (tmp_path / "config.json").write_text(json.dumps({**d, "architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ConfigError, match="LlamaForCausalLM"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({k: v for k, v in d.items() if k != "hidden_size"}))
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope")


# ---- make-tiny + reader --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """{name: dir} of tiny checkpoints, built once."""
    from gpu_service.local.tiny import make_tiny

    root = tmp_path_factory.mktemp("tiny")
    out = {}
    for fmt in ("bf16", "fp8", "int4"):
        out[fmt] = make_tiny(str(root / fmt), fmt=fmt, seed=0)
    out["v32_fp8"] = make_tiny(str(root / "v32_fp8"), fmt="fp8", seed=0, arch="deepseek_v32")
    out["single"] = make_tiny(str(root / "single"), fmt="fp8", seed=1,
                              overrides={"num_hidden_layers": 1, "first_k_dense_replace": 0})
    return out


def _independent(path: str) -> dict[str, np.ndarray]:
    """Decode a safetensors file with the safetensors library (torch framework) instead of ours."""
    import torch
    from safetensors import safe_open

    out = {}
    with safe_open(path, "pt") as f:
        for k in f.keys():
            t = f.get_tensor(k)
            out[k] = t.numpy() if t.dtype in (torch.int32, torch.int64) else t.float().numpy()
    return out


@pytest.mark.parametrize("which", ["bf16", "fp8", "int4", "v32_fp8", "single"])
def test_make_tiny_reads_back(tiny, which):
    d = tiny[which]
    r = CheckpointReader(d)
    cfg = r.config
    exp = N.expected_shapes(cfg)
    assert r.verify() == len(exp)
    assert set(r.names()) == set(exp)
    sharded = os.path.exists(os.path.join(d, "model.safetensors.index.json"))
    assert sharded == (cfg.num_hidden_layers >= 2)
    if sharded:
        assert len(r.files) >= 2
    fmt = "fp8" if which in ("v32_fp8", "single") else which
    assert (cfg.quantization.method if cfg.quantization else "bf16") == fmt
    if cfg.is_v32:
        assert r.has("model.layers.0.self_attn.indexer.wq_b.weight")
    raw = {}
    for fn in r.files:
        raw.update(_independent(os.path.join(d, fn)))
    for name, shape in exp.items():
        st = r.get_stored(name)
        got = r.get(name)
        assert got.dtype == np.float32 and got.shape == shape == st.shape, name
        assert r.file_of(name).endswith(".safetensors")
        if name.endswith("e_score_correction_bias"):
            assert st.format == "f32"
            np.testing.assert_array_equal(got, raw[name])
        elif st.format == "fp8":
            assert st.arrays["weight"].dtype == FP8_E4M3 and st.arrays["weight_scale_inv"].dtype == np.float32
            s = raw[name + "_scale_inv"]
            ref = raw[name] * np.repeat(np.repeat(s, 128, 0), 128, 1)[: shape[0], : shape[1]]
            np.testing.assert_array_equal(got, ref)
        elif st.format == "int4":
            assert N.is_routed_expert(name)
            base = name[: -len("weight")]
            assert st.arrays["weight_packed"].dtype == np.int32 and st.arrays["weight_scale"].dtype == BF16
            assert raw[base + "weight_shape"].tolist() == list(shape)
            np.testing.assert_array_equal(
                got, unpack_int4(raw[base + "weight_packed"], raw[base + "weight_scale"].astype(BF16), shape, 32)
            )
        else:
            assert st.format == "bf16", name
            np.testing.assert_array_equal(got, raw[name])
    # what is quantized where
    e = N.expert_weight(cfg.moe_layers[0], 0, "gate")
    want_expert = {"bf16": "bf16", "fp8": "fp8", "int4": "int4", "v32_fp8": "fp8", "single": "fp8"}[which]
    assert r.format_of(e) == want_expert
    assert r.format_of("model.layers.0.self_attn.kv_b_proj.weight") == ("fp8" if fmt == "fp8" else "bf16")
    assert r.format_of(N.router_weight(cfg.moe_layers[0])) == "bf16"
    assert r.format_of(N.EMBED) == "bf16" and r.format_of(N.LM_HEAD) == "bf16"


def test_reference_model_covers_checkpoint(tiny):
    import torch
    from hf_reference import load_reference, load_reference_pretrained

    ids = torch.tensor([[0, 43, 328, 332, 501, 409, 7, 100]])
    logits = {}
    for which in ("bf16", "fp8", "int4", "v32_fp8"):
        m = load_reference(tiny[which])  # asserts no missing / unexpected keys
        assert all(p.dtype == torch.float32 for p in m.parameters())
        with torch.no_grad():
            logits[which] = m(ids).logits
        assert torch.isfinite(logits[which]).all()
        r = CheckpointReader(tiny[which])
        layer = r.config.moe_layers[0]
        fused = m.state_dict()[f"model.layers.{layer}.mlp.experts.gate_up_proj"]
        inter = r.config.moe_intermediate_size
        np.testing.assert_array_equal(fused[3, :inter].numpy(), r.get(N.expert_weight(layer, 3, "gate")))
        np.testing.assert_array_equal(fused[3, inter:].numpy(), r.get(N.expert_weight(layer, 3, "up")))
    # independent path: transformers' own loader (per-expert names fused by its conversion mapping)
    ref = load_reference_pretrained(tiny["bf16"])
    with torch.no_grad():
        torch.testing.assert_close(ref(ids).logits, logits["bf16"], rtol=0, atol=0)
    # the quantized variants are the same random model, quantized: close but not equal
    assert (logits["fp8"] - logits["bf16"]).abs().max() < 3.0


def test_make_tiny_cli_and_determinism(tmp_path, tiny):
    from moesplit.cli import main

    (tmp_path / "o.json").write_text(json.dumps({"n_routed_experts": 8, "num_experts_per_tok": 2}))
    assert main(["make-tiny", str(tmp_path / "a"), "--format", "bf16", "--config", str(tmp_path / "o.json")]) == 0
    r = CheckpointReader(tmp_path / "a")
    assert r.config.n_routed_experts == 8 and r.verify() > 0
    assert r.config.rope_scaling["type"] == "yarn" and r.config.rope_scaling["factor"] == 4.0
    raw = json.loads((tmp_path / "a" / "config.json").read_text())
    assert "rope_parameters" not in raw and raw["rope_theta"] == 10000.0
    # same seed, same bytes
    from gpu_service.local.tiny import make_tiny

    make_tiny(str(tmp_path / "b"), fmt="bf16", seed=0)
    for fn in os.listdir(tiny["bf16"]):
        assert (tmp_path / "b" / fn).read_bytes() == open(os.path.join(tiny["bf16"], fn), "rb").read(), fn


def test_tokenizer_loads(tiny):
    import tokenizers
    import transformers

    d = tiny["bf16"]
    t = tokenizers.Tokenizer.from_file(os.path.join(d, "tokenizer.json"))
    assert t.token_to_id("<｜begin▁of▁sentence｜>") == 0 and t.token_to_id("<｜end▁of▁sentence｜>") == 1
    assert t.get_vocab_size() <= 512
    tok = transformers.AutoTokenizer.from_pretrained(d)
    ids = tok("Hello world").input_ids
    assert ids[0] == 0 and ids == t.encode("Hello world").ids
    assert tok.decode(ids, skip_special_tokens=True) == "Hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<｜begin▁of▁sentence｜><｜User｜>Hi<｜Assistant｜>"
    assert tok.eos_token_id == 1


# ---- reader errors ----------------------------------------------------------------------------------
def test_missing_tensor_names_tensor_and_file(tiny, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny["fp8"], d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.self_attn.ghost.weight"] = "model-00002-of-00003.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    r = CheckpointReader(d)
    with pytest.raises(MissingTensorError) as ei:
        r.get("model.layers.0.self_attn.ghost.weight")
    msg = str(ei.value)
    assert "model.layers.0.self_attn.ghost.weight" in msg and "model-00002-of-00003.safetensors" in msg
    assert isinstance(ei.value, KeyError)
    with pytest.raises(MissingTensorError, match=r"model\.layers\.9\.mlp\.gate\.weight.*searched model-0000"):
        r.get("model.layers.9.mlp.gate.weight")
    # a missing shard file is named at open
    os.remove(d / "model-00003-of-00003.safetensors")
    with pytest.raises(CheckpointError, match="model-00003-of-00003.safetensors"):
        CheckpointReader(d)


def test_truncated_and_corrupt_files(tiny, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny["single"], d)
    path = d / "model.safetensors"
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8 : 8 + n])
    header.pop("__metadata__", None)
    last = max(header, key=lambda k: header[k]["data_offsets"][1])
    first = min(header, key=lambda k: header[k]["data_offsets"][0])
    os.truncate(path, os.path.getsize(path) - 100)
    r = CheckpointReader(d)
    np.asarray(r.get_raw(first))  # untouched tensors still read
    with pytest.raises(CheckpointError) as ei:
        r.get_raw(last)
    assert str(path) in str(ei.value) and last in str(ei.value) and "truncated" in str(ei.value)
    with pytest.raises(CheckpointError, match=last.replace(".", r"\.")):
        r.verify()
    # bad header
    path.write_bytes(struct.pack("<Q", 20) + b"{not json at all....")
    with pytest.raises(CheckpointError, match="header is not JSON"):
        CheckpointReader(d)
    path.write_bytes(b"\x01\x02")
    with pytest.raises(CheckpointError, match=str(path)):
        CheckpointReader(d)


def test_verify_reports_wrong_shape(tiny, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(tiny["single"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["moe_intermediate_size"] = 40  # config no longer matches the weights
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"gate_proj\.weight'?: shape \[32, 96\] != expected \[40, 96\]"):
        CheckpointReader(d).verify()


# ---- laziness ---------------------------------------------------------------------------------------
def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_write_safetensors_and_lazy_read(tmp_path):
    from gpu_service.local.tiny import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config()))
    # numpy writer: readable by the safetensors library
    small = {
        "a.weight": np.arange(12, dtype=np.float32).reshape(3, 4).astype(BF16),
        "b.weight": np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3).astype(FP8_E4M3),
        "b.weight_scale_inv": np.array([[2.0]], np.float32),
        "c.bias": np.array([1, 2], np.int32),
    }
    write_safetensors(str(tmp_path / "x.safetensors"), small)
    ind = _independent(str(tmp_path / "x.safetensors"))
    for k, v in small.items():
        np.testing.assert_array_equal(ind[k], v.astype(np.float32) if v.dtype != np.int32 else v)

    # 256 MiB expert-sized tensor first, small one after it; written in chunks (no big buffer)
    big_n = 64 * 1024 * 1024  # f32 elements
    hdr = {
        "model.layers.1.mlp.experts.0.up_proj.weight": {"dtype": "F32", "shape": [big_n // 1024, 1024],
                                                        "data_offsets": [0, big_n * 4]},
        "model.layers.1.mlp.experts.1.up_proj.weight": {"dtype": "BF16", "shape": [4, 8],
                                                        "data_offsets": [big_n * 4, big_n * 4 + 64]},
    }
    blob = json.dumps(hdr).encode()
    blob += b" " * (-len(blob) % 8)
    with open(tmp_path / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + big_n * 4)  # sparse: no data written, reads back as zeros
        f.seek(8 + len(blob) + big_n * 4)
        f.write(np.arange(32, dtype=np.float32).astype(BF16).tobytes())
    os.remove(tmp_path / "x.safetensors")
    r = CheckpointReader(tmp_path)
    before = _rss()
    st = r.get_stored("model.layers.1.mlp.experts.0.up_proj.weight")  # a view: nothing read yet
    assert st.shape == (big_n // 1024, 1024) and st.nbytes == big_n * 4
    got = r.get("model.layers.1.mlp.experts.1.up_proj.weight")
    assert _rss() - before < 16 * 1024 * 1024, "reading one small tensor paged in the big one"
    np.testing.assert_array_equal(got, np.arange(32, dtype=np.float32).reshape(4, 8))
