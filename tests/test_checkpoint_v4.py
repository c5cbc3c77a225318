"""checkpoint/ for DeepSeek-V4: typed config (both key spellings), names, MXFP4 / ue8m0 FP8 readers."""
from __future__ import annotations

import copy
import json
import os

import ml_dtypes
import numpy as np
import pytest

from checkpoint import names_v4 as N4
from checkpoint.config import ConfigError, load_config
from checkpoint.config_v4 import V4Config, load_any_config, load_v4_config
from checkpoint.formats_v4 import (
    E8M0,
    FP8_E4M3,
    dequant_fp8_e8m0,
    dequant_mxfp4,
    e8m0_to_f32,
    pack_mxfp4_codes,
    quant_fp8_e8m0,
    quant_mxfp4,
    unpack_mxfp4_codes,
)
from checkpoint.reader import CheckpointError, CheckpointReader, write_safetensors

CONFIGS = "/work/shared/model-configs"
FLASH, PRO = f"{CONFIGS}/deepseek-v4-flash.json", f"{CONFIGS}/deepseek-v4-pro.json"


# ---- config --------------------------------------------------------------------------------------
def test_real_configs_schedules():
    f, p = load_v4_config(FLASH), load_v4_config(PRO)
    # Flash: layers 0-1 window, even 2-42 CSA, odd 3-41 HCA (43 layers; the MTP entry dropped)
    assert f.num_hidden_layers == len(f.compress_ratios) == 43
    assert f.layer_kinds == tuple(["window"] * 2 + ["csa" if i % 2 == 0 else "hca" for i in range(2, 43)])
    # Pro: 0-1 and odd HCA, even 2-60 CSA, no window-only layer
    assert p.layer_kinds == tuple(["hca"] * 2 + ["csa" if i % 2 == 0 else "hca" for i in range(2, 61)])
    assert (f.hidden_size, f.num_attention_heads, f.o_groups, f.q_lora_rank, f.n_routed_experts) == (4096, 64, 8, 1024, 256)
    assert (p.hidden_size, p.num_attention_heads, p.o_groups, p.q_lora_rank, p.n_routed_experts) == (7168, 128, 16, 1536, 384)
    assert f.qk_rope_head_dim == 64 and f.head_dim == 512 and f.sliding_window == 128
    assert f.num_hash_layers == 3 and f.is_hash_layer(2) and not f.is_hash_layer(3)
    assert f.rope_theta == 10000 and f.compress_rope_theta == 160000
    assert f.rope_scaling["type"] == "yarn" and f.rope_scaling["factor"] == 16
    assert f.expert_dtype == "fp4"  # no expert_dtype key: MXFP4, as vLLM assumes
    assert f.quantization.block_size == (128, 128) and f.swiglu_limit == 10.0
    assert f.fingerprint() != p.fingerprint()
    assert load_any_config(FLASH) == f


@pytest.mark.parametrize("path", [FLASH, PRO])
def test_transformers_key_names_give_the_same_config(path):
    """transformers' DeepseekV4Config folds the original keys into its own names (layer_types,
    compress_rates, mlp_layer_types, nested rope_parameters, partial_rotary_factor); reading its
    to_dict() must give the same V4Config as reading the original file."""
    transformers = pytest.importorskip("transformers")
    with open(path) as f:
        d = json.load(f)
    given = copy.deepcopy({k: v for k, v in d.items() if k != "quantization_config"})  # transformers mutates it
    tf = transformers.DeepseekV4Config(**given).to_dict()
    for legacy in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling", "rope_theta",
                   "compress_rope_theta"):
        tf.pop(legacy, None)  # only transformers' spellings left
    assert "layer_types" in tf and "mlp_layer_types" in tf and "main" in tf["rope_parameters"]
    assert tf["partial_rotary_factor"] == 64 / 512
    tf["architectures"] = d["architectures"]
    want = dataclass_fields(V4Config.from_dict({k: v for k, v in d.items() if k != "quantization_config"}))
    assert dataclass_fields(V4Config.from_dict(tf)) == want


def dataclass_fields(cfg: V4Config) -> dict:
    """Fields compared across spellings (rope_scaling compared by its yarn numbers)."""
    import dataclasses

    d = dataclasses.asdict(cfg)
    d["rope_scaling"] = {k: float(v) for k, v in (d["rope_scaling"] or {}).items() if k != "type"}
    d.pop("torch_dtype")
    return d


def test_config_errors_name_the_fix():
    with open(FLASH) as f:
        d = json.load(f)
    with pytest.raises(ConfigError, match="not a V3-family one: .*load_any_config"):
        load_config(FLASH)  # the V3 family's reader sends V4 to the one that reads it
    bad = dict(d, layer_types=["sliding_attention"] * 43)
    with pytest.raises(ConfigError, match="disagree"):
        V4Config.from_dict(bad)
    with pytest.raises(ConfigError, match="compress_ratios"):
        V4Config.from_dict({k: v for k, v in d.items() if k != "compress_ratios"})
    with pytest.raises(ConfigError, match="num_hash_layers"):
        V4Config.from_dict(dict(d, mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 41))
    with pytest.raises(ConfigError, match="expert_dtype"):
        V4Config.from_dict(dict(d, quantization_config={**d["quantization_config"], "expert_dtype": "int3"}))
    fp8 = V4Config.from_dict(dict(d, expert_dtype="fp8"))  # top-level, as V4.1 ships it
    assert fp8.expert_dtype == "fp8"


def test_names_and_shapes_of_flash():
    cfg = load_v4_config(FLASH)
    t = N4.tensor_table(cfg, mtp=True)
    assert t["layers.0.attn.wq_b.weight"].shape == (64 * 512, 1024)
    assert t["layers.0.attn.wo_a.weight"].shape == (8 * 1024, 64 * 512 // 8)
    assert "layers.0.attn.compressor.ape" not in t  # window-only layer
    assert t["layers.2.attn.compressor.wkv.weight"].shape == (1024, 4096)  # CSA: 2 x 512
    assert t["layers.2.attn.compressor.ape"] == N4.TensorSpec((4, 1024), "f32")
    assert t["layers.3.attn.compressor.ape"].shape == (128, 512)  # HCA
    assert "layers.3.attn.indexer.wq_b.weight" not in t
    assert t["layers.2.attn.indexer.wq_b.weight"] == N4.TensorSpec((64 * 128, 1024), "fp8")
    assert t["layers.2.attn.indexer.compressor.ape"].shape == (4, 256)
    assert t["layers.2.ffn.gate.tid2eid"] == N4.TensorSpec((129280, 6), "i64")
    assert "layers.3.ffn.gate.tid2eid" not in t and t["layers.3.ffn.gate.bias"].kind == "f32"
    assert t[N4.expert_weight(5, 7, "down")] == N4.TensorSpec((4096, 2048), "expert")
    assert t["layers.0.hc_attn_fn"].shape == (24, 4 * 4096) and t["hc_head_fn"].shape == (4, 4 * 4096)
    assert t["mtp.0.e_proj.weight"].kind == "fp8" and "mtp.0.attn.compressor.ape" not in t
    assert N4.parse_expert("model.layers.5.ffn.experts.7.w3.weight") == (5, 7, "up")
    assert N4.is_mtp("mtp.0.enorm.weight") and not N4.is_mtp("layers.1.attn_norm.weight")
    # every routed expert: 3 tensors x 256 experts x 43 layers, plus the MTP block's
    n_exp = sum(1 for n in t if ".experts." in n)
    assert n_exp == 3 * 256 * 44


# ---- formats: ue8m0, MXFP4 ------------------------------------------------------------------------
def test_e8m0_hand_values_and_ml_dtypes():
    raw = np.array([127, 128, 126, 0, 254, 255, 130], np.uint8)
    got = e8m0_to_f32(raw)
    np.testing.assert_array_equal(got[:5], [1.0, 2.0, 0.5, 2.0**-127, 2.0**127])
    assert np.isnan(got[5]) and got[6] == 8.0
    indep = raw.view(E8M0).astype(np.float32)  # ml_dtypes' own decode
    np.testing.assert_array_equal(got[:5], indep[:5])


def _e2m1_by_bits(code: int) -> float:
    """e2m1 from its bit fields: sign bit 3, exponent bits 2-1 (bias 1), mantissa bit 0."""
    s, e, m = (code >> 3) & 1, (code >> 1) & 3, code & 1
    mag = m * 0.5 if e == 0 else 2.0 ** (e - 1) * (1 + m / 2)
    return -mag if s else mag


def test_mxfp4_hand_computed_nibble_order():
    # one row, 64 inputs = 2 groups; byte 0 = 0x2F: element 0 = low nibble 0xF (-6), element 1 = 0x2 (1.0)
    packed = np.zeros((1, 32), np.uint8)
    packed[0, 0] = 0x2F
    packed[0, 16] = 0x7A  # element 32 = 0xA (-1.0), element 33 = 0x7 (6.0)
    scale = np.array([[128, 125]], np.uint8).view(E8M0)  # x2 for group 0, x1/4 for group 1
    d = dequant_mxfp4(packed.view(np.int8), scale)
    assert d.shape == (1, 64) and d.dtype == np.float32
    assert d[0, 0] == -12.0 and d[0, 1] == 2.0 and d[0, 32] == -0.25 and d[0, 33] == 1.5
    assert np.count_nonzero(d) == 4
    with pytest.raises(ValueError, match="one scale per 32"):
        dequant_mxfp4(packed.view(np.int8), scale[:, :1])


def test_mxfp4_against_independent_decode():
    rng = np.random.default_rng(1)
    packed = rng.integers(-128, 128, (5, 48), dtype=np.int64).astype(np.int8)  # [5, 96 inputs]
    scale = rng.integers(120, 135, (5, 3), dtype=np.int64).astype(np.uint8).view(E8M0)
    got = dequant_mxfp4(packed, scale)
    b = packed.view(np.uint8)
    want = np.zeros((5, 96))
    for r in range(5):
        for j in range(48):
            for k, code in enumerate((b[r, j] & 0xF, b[r, j] >> 4)):
                i = 2 * j + k
                want[r, i] = _e2m1_by_bits(int(code)) * 2.0 ** (int(scale.view(np.uint8)[r, i // 32]) - 127)
    np.testing.assert_array_equal(got, want)
    # and ml_dtypes' float4_e2m1fn decode of the unpacked codes
    codes = unpack_mxfp4_codes(packed)
    f4 = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(got, f4 * np.repeat(scale.astype(np.float32), 32, axis=1))
    np.testing.assert_array_equal(pack_mxfp4_codes(codes), packed)


def test_mxfp4_quantise_roundtrip():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((6, 64)).astype(np.float32)
    w[0, :32] = 0.0
    packed, scale = quant_mxfp4(w)
    assert packed.dtype == np.int8 and packed.shape == (6, 32) and scale.dtype == E8M0 and scale.shape == (6, 2)
    d = dequant_mxfp4(packed, scale)
    assert np.all(d[0, :32] == 0)
    s = np.repeat(scale.astype(np.float32), 32, axis=1)
    amax = np.repeat(np.abs(w).reshape(6, 2, 32).max(axis=2), 32, axis=1)
    assert np.all((amax <= 6 * s) & ((amax > 3 * s) | (amax == 0)))  # smallest power of two that fits
    assert np.all(np.abs(d - w) <= s * 1.0 + 1e-7)  # e2m1 steps are <= 2 (half-step 1) between 4 and 6
    again = dequant_mxfp4(*quant_mxfp4(d))  # representable values survive exactly
    np.testing.assert_array_equal(again, d)


def test_fp8_e8m0_hand_computed_and_independent():
    w = np.array([[1, -2, 4], [0.5, 0.25, -900], [3, 0, 0]], np.float32)
    q, s = quant_fp8_e8m0(w, (2, 2))
    assert q.dtype == FP8_E4M3 and s.dtype == E8M0 and s.shape == (2, 2)
    # block amax 2 -> 2/448 -> 2**-7; 900 -> 2**2 (900/448 = 2.01); 3 -> 2**-7; zero block -> 2**0
    np.testing.assert_array_equal(s.view(np.uint8), [[120, 129], [120, 127]])
    d = dequant_fp8_e8m0(q, s, (2, 2))
    np.testing.assert_array_equal(d[:, :2], w[:, :2])  # exactly representable
    assert d[1, 2] == -896.0  # -900/4 = -225 -> e4m3 224 (ties to even mantissa) -> x4
    indep = q.astype(np.float32) * np.repeat(np.repeat(s.astype(np.float32), 2, 0), 2, 1)[:3, :3]
    np.testing.assert_array_equal(d, indep)
    with pytest.raises(ValueError, match="weight_block_size"):
        dequant_fp8_e8m0(q, s[:1], (2, 2))


# ---- reader --------------------------------------------------------------------------------------
def _tiny_dict() -> dict:
    with open(FLASH) as f:
        d = json.load(f)
    d.update(hidden_size=64, num_hidden_layers=1, compress_ratios=[0, 0], vocab_size=8, n_routed_experts=2,
             num_experts_per_tok=1, moe_intermediate_size=32, num_attention_heads=2, head_dim=32, o_groups=1,
             qk_rope_head_dim=8)
    return d


@pytest.mark.parametrize("prefix", ["", "model."])
def test_reader_reads_v4_pairs_in_both_spellings(tmp_path, prefix):
    with open(tmp_path / "config.json", "w") as f:
        json.dump(_tiny_dict(), f)
    rng = np.random.default_rng(3)
    wf = rng.standard_normal((32, 64)).astype(np.float32)  # an MXFP4 expert w1 [I, D]
    packed, pscale = quant_mxfp4(wf)
    q8, s8 = quant_fp8_e8m0(rng.standard_normal((200, 64)).astype(np.float32))
    write_safetensors(str(tmp_path / "model.safetensors"), {
        f"{prefix}layers.0.ffn.experts.0.w1.weight": packed, f"{prefix}layers.0.ffn.experts.0.w1.scale": pscale,
        f"{prefix}layers.0.attn.wkv.weight": q8, f"{prefix}layers.0.attn.wkv.scale": s8,
        f"{prefix}layers.0.hc_attn_scale": np.ones(3, np.float32),
        f"{prefix}layers.0.ffn.gate.tid2eid": np.zeros((8, 1), np.int64),
    })
    with pytest.raises(ConfigError, match="any_architecture=True"):
        CheckpointReader(tmp_path)  # the V3-family reader: V4 sent to the one that reads it
    r = CheckpointReader(tmp_path, any_architecture=True)
    assert isinstance(r.config, V4Config)
    assert sorted(r.names()) == sorted(["layers.0.ffn.experts.0.w1.weight", "layers.0.attn.wkv.weight",
                                        "layers.0.hc_attn_scale", "layers.0.ffn.gate.tid2eid"])
    assert r.format_of("layers.0.ffn.experts.0.w1.weight") == "mxfp4"
    assert r.format_of("layers.0.attn.wkv.weight") == "fp8_e8m0"
    st = r.get_stored("layers.0.ffn.experts.0.w1.weight")
    assert st.shape == (32, 64) and st.arrays["weight"].dtype == np.int8
    np.testing.assert_array_equal(r.get("layers.0.ffn.experts.0.w1.weight"), dequant_mxfp4(packed, pscale))
    np.testing.assert_array_equal(r.get("layers.0.attn.wkv.weight"), dequant_fp8_e8m0(q8, s8))
    assert r.get("layers.0.ffn.gate.tid2eid").shape == (8, 1)
    # wkv is [head_dim=32, D] in this config, so the stored [200, 64] must fail verification
    with pytest.raises(CheckpointError, match="layers.0.attn.wkv.weight"):
        r.verify(["layers.0.attn.wkv.weight"])
    r.verify(["layers.0.ffn.experts.0.w1.weight"])
    assert os.path.basename(r.file_of("layers.0.attn.wkv.weight")) == "model.safetensors"


def test_mxfp4_rounding_matches_ml_dtypes_round_to_nearest_even():
    """quant_mxfp4's e2m1 rounding (ties to the even code) agrees with ml_dtypes' float4_e2m1fn cast
    on every midpoint and a random spread, at scale 2**0 (group amax exactly 6)."""
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.3, 0.7, 2.9, 4.6, 5.9], np.float32)
    rng = np.random.default_rng(5)
    vals = np.concatenate([mids, -mids, rng.uniform(-6, 6, 40).astype(np.float32)])
    vals[0] = 6.0  # the group's amax -> scale 2**ceil(log2(6/6)) = 1
    w = vals.reshape(2, 32)
    w[1, 0] = -6.0
    packed, scale = quant_mxfp4(w)
    assert (scale.view(np.uint8) == 127).all()
    want = w.astype(ml_dtypes.float4_e2m1fn).astype(np.float32)
    np.testing.assert_array_equal(dequant_mxfp4(packed, scale), want)
