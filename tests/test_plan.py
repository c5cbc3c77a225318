"""The memory planner (gpu_service/plan/) and `moesplit plan`: seed cases from the user reports,
parameter counts against an independent count, JSON schema, table and exit codes."""
import json
import os

import pytest

from gpu_service import plan as P
from moesplit.cli import main as cli_main

GiB = 1 << 30
# What torch reports as "total capacity" for the cards of the user reports.
RTX3090_TOTAL = int(23.56 * GiB)
RTX4060TI_TOTAL = int(15.57 * GiB)


def preset(name):
    return P.load_model_config(name)[0]


def run_cli(capsys, *argv):
    rc = cli_main(["plan", *argv])
    return rc, capsys.readouterr().out


# ----------------------------------------------------------------------- parameter counts
def test_deepseek_v3_param_count_matches_published_shapes():
    # Independent count from the published DeepSeek-V3 shapes (61 layers, MTP layer excluded).
    H, V, L, I, Im, E, heads = 7168, 129280, 61, 18432, 2048, 256, 128
    q_lora, kv_lora, rope, nope, v = 1536, 512, 64, 128, 128
    attention = (H * q_lora + q_lora  # q_a_proj + q_a_layernorm
                 + q_lora * heads * (nope + rope)  # q_b_proj
                 + H * (kv_lora + rope) + kv_lora  # kv_a_proj_with_mqa + kv_a_layernorm
                 + kv_lora * heads * (nope + v)  # kv_b_proj
                 + heads * v * H)  # o_proj
    per_layer = attention + 2 * H  # input / post-attention norms
    dense_mlp = 3 * H * I
    shared = 3 * H * Im
    router = E * H + E  # gate weight + e_score_correction_bias
    moe_layers = L - 3
    routed = moe_layers * E * 3 * H * Im
    total = 2 * V * H + H + L * per_layer + 3 * dense_mlp + moe_layers * (shared + router) + routed
    assert routed == 653_908_770_816
    assert total == 671_026_419_200
    c = P.param_counts(preset("deepseek-v3"))
    assert c["routed"] == routed
    assert c["routed"] + c["non_routed"] == total == c["total"]


def test_kimi_and_v32_param_counts():
    H, V, L, Im, heads = 7168, 163840, 61, 2048, 64
    attention = H * 1536 + 1536 + 1536 * heads * 192 + H * 576 + 512 + 512 * heads * 256 + heads * 128 * H
    routed = 60 * 384 * 3 * H * Im
    total = (2 * V * H + H + L * (attention + 2 * H) + 3 * H * 18432
             + 60 * (3 * H * Im + 384 * H + 384) + routed)
    for name in ("kimi-k2-instruct", "kimi-k2-thinking", "kimi-k2.5", "kimi-k2.6"):  # K2.5/6: the language model
        c = P.param_counts(preset(name))
        assert (c["routed"], c["total"]) == (routed, total)
    # V3.2 = V3 + the lightning indexer: wq_b [64*128, 1536], wk [128, H], k_norm (w+b), weights_proj [64, H]
    indexer = 64 * 128 * 1536 + 128 * H + 2 * 128 + 64 * H
    assert P.param_counts(preset("deepseek-v3.2"))["total"] == 671_026_419_200 + 61 * indexer


def test_presets_are_the_shared_configs():
    assert P.presets() == ["deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4-pro", "kimi-k2-instruct",
                         "kimi-k2-thinking", "kimi-k2.5", "kimi-k2.6"]
    shared = "/work/shared/model-configs"
    for name in P.presets():
        src = os.path.join(shared, name + ".json")
        if os.path.exists(src):
            with open(src) as a, open(os.path.join(P.PRESETS_DIR, name + ".json")) as b:
                assert json.load(a) == json.load(b)


# ------------------------------------------------------------------------------ byte model
def test_parse_size():
    assert P.parse_size("24GiB") == 24 * GiB
    assert P.parse_size("16GB") == 16_000_000_000
    assert P.parse_size("512MiB") == 512 << 20
    assert P.parse_size("1.5 TiB") == int(1.5 * (1 << 40))
    assert P.parse_size("23.56GiB") == round(23.56 * GiB)
    assert P.parse_size("1000") == 1000
    for bad in ("24 gigs", "", "GiB", "-1GiB"):
        with pytest.raises(ValueError):
            P.parse_size(bad)


def test_linear_and_kv_bytes():
    out, inp = 2048, 7168
    assert P.linear_bytes(out, inp, "bf16") == 2 * out * inp
    assert P.linear_bytes(out, inp, "fp8") == out * inp + 4 * 16 * 56
    assert P.linear_bytes(out, inp, "int8") == out * inp + 4 * out
    assert P.linear_bytes(out, inp, "int4") == out * inp // 2 + 2 * out * (inp // 32)
    kimi, v32 = preset("kimi-k2-thinking"), preset("deepseek-v3.2")
    assert P.kv_bytes_per_token_layer(kimi) == (2 * 576, 0)
    assert P.kv_bytes_per_token_layer(v32) == (2 * 576, 2 * 128)
    # checkpoint precision: Kimi-K2-Thinking keeps non-expert linears in bf16, V3.2 in fp8 blocks
    assert P.checkpoint_format(kimi, "model.layers.5.self_attn.o_proj") == "bf16"
    assert P.checkpoint_format(kimi, "model.layers.5.mlp.shared_experts.down_proj") == "bf16"
    assert P.checkpoint_format(kimi, "model.layers.0.mlp.gate_proj") == "bf16"
    assert P.checkpoint_format(v32, "model.layers.5.self_attn.o_proj") == "fp8"
    assert P.gpu_reserve(24 * GiB) == 512 * (1 << 20) + int(0.03 * 24 * GiB)


def test_param_bytes_by_module_matches_plan_items():
    cfg = preset("kimi-k2-thinking")
    p = P.make_plan(cfg, ["80GiB"], attention_weights="checkpoint", embeddings="gpu", gpu_experts=0)
    assert p.fits
    by_mod = P.param_bytes_by_module(cfg, p.options)
    g = p.gpus[0].items
    cats = ("embeddings", "attention", "dense_mlp", "shared_experts", "routers", "norms", "lm_head")
    weights = sum(g[k] for k in cats)
    assert sum(by_mod.values()) == weights
    assert by_mod["model.layers.5.mlp.gate"] == 4 * (384 * 7168 + 384)
    assert by_mod["lm_head"] == 2 * 163840 * 7168
    # weights at checkpoint precision = non-routed params x 2 B (all bf16) + f32 routers
    c = P.param_counts(cfg)
    assert weights == 2 * c["non_routed"] + 2 * 60 * (384 * 7168 + 384)


# ------------------------------------------------------------------------------ seed cases
@pytest.mark.parametrize("cap", ["24GiB", RTX3090_TOTAL])
def test_kimi_k2_thinking_fits_one_24g_card(cap):
    p = P.make_plan(preset("kimi-k2-thinking"), [cap], model="kimi-k2-thinking")
    assert p.fits and p.kv_tokens >= 32768
    g = p.gpus[0]
    assert 0 <= g.free_bytes and g.used_bytes <= g.capacity_bytes
    assert g.layers == list(range(61))


@pytest.mark.parametrize("cap", ["16GiB", RTX4060TI_TOTAL])
def test_deepseek_v32_fits_two_16g_cards(cap):
    p = P.make_plan(preset("deepseek-v3.2"), [cap, cap], host_ram="768GiB")
    assert p.fits and p.kv_tokens >= 20000
    a, b = p.gpus
    assert a.layers + b.layers == list(range(61)) and a.layers and b.layers  # contiguous split
    assert b.items["lm_head"] > 0 and a.items["lm_head"] == 0
    assert b.items["embeddings"] == 0  # embeddings only ever on the first GPU
    assert a.items["index_keys"] > 0


@pytest.mark.parametrize("cap", ["16GiB", RTX4060TI_TOTAL])
def test_deepseek_v32_one_16g_card_says_what_would_fit(cap):
    cfg = preset("deepseek-v3.2")
    p = P.make_plan(cfg, [cap])
    if p.fits:
        return
    assert p.missing_bytes > 0 and p.suggestions
    for s in p.suggestions:  # every suggestion re-plans to a fitting plan
        kw = {"gpus": [cap]} | s["change"]
        assert P.make_plan(cfg, **kw, suggest=False).fits
    assert any(len(s["change"].get("gpus", ())) == 2 for s in p.suggestions)  # a second card


@pytest.mark.parametrize("cap", ["24GiB", RTX3090_TOTAL])
def test_hybrid_engine_configuration_does_not_fit(cap):
    # user report 000: non-expert weights at checkpoint precision (bf16) and embeddings on the GPU
    p = P.make_plan(preset("kimi-k2-thinking"), [cap], attention_weights="checkpoint", embeddings="gpu")
    assert not p.fits
    o = p.options
    assert (o.attention_weights, o.embeddings) == ("checkpoint", "gpu")  # explicit options kept
    g = p.gpus[0]
    assert g.items["attention"] > 11 * GiB  # 61 x 101M params in bf16
    assert p.missing_bytes == g.used_bytes - g.capacity_bytes > 0
    args = {s["args"] for s in p.suggestions}
    assert "--attention-weights int8" in args
    assert "--embeddings cpu" in args


# ---------------------------------------------------------------------------- auto search
def test_auto_order_and_explicit_options():
    cfg = preset("kimi-k2-thinking")
    big = P.make_plan(cfg, ["80GiB"])
    assert (big.options.attention_weights, big.options.embeddings, big.kv_tokens) == ("checkpoint", "gpu", 65536)
    assert big.options.gpu_experts > 0
    pinned = P.make_plan(cfg, ["24GiB"], gpu_experts=1, embeddings="cpu", kv_tokens=8192)
    assert (pinned.options.gpu_experts, pinned.options.embeddings) == (1, "cpu")
    assert pinned.kv_tokens == 8192 and pinned.gpus[0].items["embeddings"] == 0
    # KV shrinks only when needed and never below min_kv_tokens
    tight = P.make_plan(cfg, ["20GiB"], attention_weights="checkpoint")
    assert tight.options.embeddings == "cpu"
    assert (tight.fits and 4096 <= tight.kv_tokens < 65536) or (not tight.fits and tight.kv_tokens == 4096)
    never = P.make_plan(cfg, ["24GiB"], attention_weights="checkpoint", embeddings="gpu", min_kv_tokens=8192)
    assert not never.fits and never.kv_tokens == 8192


def test_shards_and_host_ram():
    cfg = preset("deepseek-v3")
    p = P.make_plan(cfg, ["24GiB"], host_ram="768GiB", numa_nodes=2)
    assert p.options.expert_format == "int8"  # bf16 (1.3 TB) does not fit 768 GiB
    assert [s.slice for s in p.shards] == [(0, 2), (1, 2)]
    routed = 653_908_770_816
    scales = 58 * 256 * 4 * (2 * 2048 + 2 * 7168)  # per-channel f32 scales of both slices
    assert sum(s.weight_bytes for s in p.shards) == routed + scales
    assert all(s.ram_bytes > s.weight_bytes for s in p.shards)
    assert P.make_plan(cfg, ["24GiB"], host_ram="512GiB").options.expert_format == "int4"
    short = P.make_plan(cfg, ["24GiB"], host_ram="512GiB", expert_format="int8")
    assert short.gpus_fit and not short.fits and short.host["missing_bytes"] > 0
    assert any(s["args"] == "--expert-format int4" for s in short.suggestions)
    by_expert = P.shard_plans(cfg, "int4", 2, 2048, split="experts")
    assert [s.experts for s in by_expert] == [(0, 128), (128, 256)]


def test_uneven_slices_counted_as_the_shards_load_them():
    """I = 2048 over 3 slices: each slice's bytes are those of the shard's own range
    (cpu_expert_service.shard_load.slice_range: 682, 683, 683 rows), not a split of the plan's own."""
    from cpu_expert_service.shard_load import slice_range
    from gpu_service.plan.bytes import expert_bytes

    cfg = preset("deepseek-v3")
    I, nl, E = cfg.moe_intermediate_size, len(cfg.moe_layers), cfg.n_routed_experts
    rows = [b - a for a, b in (slice_range(I, s, 3) for s in range(3))]
    assert rows == [682, 683, 683]
    plans = P.shard_plans(cfg, "int8", 3, 2048)
    assert [s.weight_bytes for s in plans] == [nl * E * expert_bytes(cfg, "int8", r, host=True) for r in rows]
    assert plans[0].weight_bytes < plans[2].weight_bytes


# ------------------------------------------------------------------------------------ CLI
def test_cli_json_schema_and_exit_codes(capsys):
    rc, out = run_cli(capsys, "--model", "kimi-k2-thinking", "--gpu", "24GiB", "--json")
    assert rc == 0
    d = json.loads(out)
    for k in ("fits", "kv_tokens", "gpus", "shards", "choices", "options", "param_counts", "model"):
        assert k in d
    assert d["fits"] is True and d["model"] == "kimi-k2-thinking" and d["kv_tokens"] >= 32768
    g = d["gpus"][0]
    for k in ("device", "capacity_bytes", "used_bytes", "free_bytes", "items", "layers"):
        assert k in g
    assert g["used_bytes"] == sum(g["items"].values()) and g["free_bytes"] == g["capacity_bytes"] - g["used_bytes"]
    assert {"embeddings", "attention", "kv_cache", "workspace", "reserve", "lm_head"} <= set(g["items"])
    s = d["shards"][0]
    assert {"index", "numa_node", "weight_bytes", "ram_bytes"} <= set(s) and ("slice" in s or "experts" in s)
    assert set(d["param_counts"]) >= {"routed", "non_routed"}
    assert isinstance(d["choices"], list) and all(isinstance(c, str) for c in d["choices"])

    rc, out = run_cli(capsys, "--model", "kimi-k2-thinking", "--gpu", "24GiB", "--attention-weights", "checkpoint",
                      "--embeddings", "gpu", "--json")
    assert rc == 3
    d = json.loads(out)
    assert d["fits"] is False and d["missing_bytes"] > 0 and d["suggestions"]

    rc, out = run_cli(capsys, "--model", "kimi-k2-thinking", "--gpu", "24GiB", "--attention-weights", "checkpoint",
                      "--embeddings", "gpu")
    assert rc == 3
    assert "DOES NOT FIT" in out and "GiB missing" in out and "--attention-weights int8" in out

    rc, out = run_cli(capsys, "--model", "deepseek-v3.2", "--gpu", "16GiB", "--gpu", "16GiB")
    assert rc == 0
    assert "cuda:0" in out and "cuda:1" in out and "KV cache" in out and "FITS" in out


def test_cli_bad_input(capsys):
    assert cli_main(["plan", "--model", "no-such-model", "--gpu", "24GiB"]) == 2
    assert "presets" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["plan", "--model", "deepseek-v3", "--gpu", "lots"])


def test_cli_model_dir(tmp_path, capsys):
    tiny = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 1024, "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 64,
        "num_hidden_layers": 4, "num_attention_heads": 4, "n_routed_experts": 16, "num_experts_per_tok": 4,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
        "q_lora_rank": 96, "kv_lora_rank": 64, "qk_rope_head_dim": 16, "qk_nope_head_dim": 32, "v_head_dim": 32,
        "max_position_embeddings": 4096,
    }
    (tmp_path / "config.json").write_text(json.dumps(tiny))
    rc, out = run_cli(capsys, "--model", str(tmp_path), "--gpu", "2GiB", "--gpu", "2GiB", "--numa-nodes", "2", "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["fits"] and d["model"] == tmp_path.name
    assert [g["layers"] for g in d["gpus"]] in ([[0, 1], [2, 3]], [[0], [1, 2, 3]], [[0, 1, 2], [3]])
    assert d["param_counts"]["routed"] == 3 * 16 * 3 * 256 * 64
    assert [s["slice"] for s in d["shards"]] == [[0, 2], [1, 2]]
    rc, _ = run_cli(capsys, "--model", str(tmp_path / "config.json"), "--gpu", "2GiB")
    assert rc == 0
