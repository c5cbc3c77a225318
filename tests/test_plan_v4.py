"""`moesplit plan` for DeepSeek-V4: every number of the report recomputed by hand from the config
(formulas from ../shared/formats-v4.md and docs/v4.md, written out here, not the planner's code)."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from gpu_service import plan as P
from moesplit.cli import main as cli_main

GiB, MiB = 1 << 30, 1 << 20
FLASH_CFG = "/work/shared/model-configs/deepseek-v4-flash.json"


def raw(name: str) -> dict:
    with open(f"{P.PRESETS_DIR}/{name}.json") as f:
        return json.load(f)


def schedule(d: dict) -> list[int]:
    return d["compress_ratios"][: d["num_hidden_layers"]]


def fp8(out: int, inp: int) -> int:
    return out * inp + 4 * math.ceil(out / 128) * math.ceil(inp / 128)


def mxfp4(out: int, inp: int) -> int:
    """MXFP4 as the GPU's hot experts hold it: nibbles + a bf16 scale per 32 inputs (the e8m0 byte widened)."""
    return out * inp // 2 + 2 * (out * inp // 32)


def mxfp4_host(out: int, inp: int) -> int:
    """MXFP4 as the CPU shards hold it (dims multiples of 32): nibbles + the e8m0 byte per 32 inputs."""
    return out * inp // 2 + out * inp // 32


def hand_params(d: dict) -> dict:
    """Parameters from the published shapes (formats-v4.md section 1), MTP block excluded."""
    D, V, H, hd, ql = d["hidden_size"], d["vocab_size"], d["num_attention_heads"], d["head_dim"], d["q_lora_rank"]
    G, ol, E, I, k = d["o_groups"], d["o_lora_rank"], d["n_routed_experts"], d["moe_intermediate_size"], d["num_experts_per_tok"]
    nI, dI = d["index_n_heads"], d["index_head_dim"]
    total = 0
    for i, r in enumerate(schedule(d)):
        total += 2 * D + 2 * (24 * 4 * D + 24 + 3)  # attn_norm, ffn_norm, hc_attn_*, hc_ffn_*
        total += D * ql + ql + H * hd * ql + hd * D + hd + G * ol * (H * hd // G) + D * G * ol + H  # attention
        if r:
            c = 2 if r == 4 else 1
            total += 2 * c * hd * D + r * c * hd + hd  # compressor wkv, wgate, ape, norm
        if r == 4:
            total += nI * dI * ql + nI * D + 2 * 2 * dI * D + 4 * 2 * dI + dI  # indexer
        total += 3 * I * D + E * D + (V * k if i < d["num_hash_layers"] else E)  # shared, gate, tid2eid / bias
    total += 2 * V * D + D + 4 * 4 * D + 4 + 1  # embed, head, norm, hc_head
    routed = d["num_hidden_layers"] * E * 3 * D * I
    return {"routed": routed, "non_routed": total, "total": routed + total}


@pytest.mark.parametrize("name,published", [("deepseek-v4-flash", 284e9), ("deepseek-v4-pro", 1.6e12)])
def test_param_counts(name, published):
    d = raw(name)
    want = hand_params(d)
    assert P.param_counts(P.load_model_config(name)[0]) == want
    # the release's totals count the MTP block too (one more MoE block, ~1-2 % of the weights)
    assert 0.97 < want["total"] / published < 1.01


def hand_items(d: dict, o: dict, layers: list[int], *, first: bool, last: bool, cap: int) -> dict:
    """The GPU table's items for one GPU holding `layers` (docs/v4.md "Memory plan")."""
    D, V, H, hd, ql = d["hidden_size"], d["vocab_size"], d["num_attention_heads"], d["head_dim"], d["q_lora_rank"]
    G, ol, E, I, k = d["o_groups"], d["o_lora_rank"], d["n_routed_experts"], d["moe_intermediate_size"], d["num_experts_per_tok"]
    nI, dI, W, topk = d["index_n_heads"], d["index_head_dim"], d["sliding_window"], d["index_topk"]
    e, K, B, T = 2, o["kv_tokens"], o["max_batch"], o["chunk_tokens"]
    it = dict.fromkeys(["attention", "indexer", "compressor", "mhc", "shared_experts", "routers", "norms",
                        "kv_cache", "index_keys", "kv_window", "gpu_experts"], 0)
    sched = schedule(d)
    for i in layers:
        r = sched[i]
        it["attention"] += (fp8(ql, D) + fp8(H * hd, ql) + fp8(hd, D) + fp8(G * ol, H * hd // G) + fp8(D, G * ol)
                            + e * (ql + hd) + 4 * H)
        it["mhc"] += 4 * 2 * (24 * 4 * D + 24 + 3)
        it["norms"] += e * 2 * D
        it["shared_experts"] += fp8(I, D) * 2 + fp8(D, I)
        it["routers"] += 4 * E * D + (8 * V * k if i < d["num_hash_layers"] else 4 * E)
        it["gpu_experts"] += o["gpu_experts"] * 3 * mxfp4(I, D)
        pend = 0
        if r:
            w = (2 if r == 4 else 1) * hd
            it["compressor"] += e * (2 * w * D + hd) + 4 * r * w
            it["kv_cache"] += e * hd * (math.ceil(K / r) + 1)
            rows = 2 * r if r == 4 else r
            pend = 2 * 4 * rows * w + (2 * 4 * rows * 2 * dI if r == 4 else 0)
        if r == 4:
            it["indexer"] += fp8(nI * dI, ql) + e * (nI * D + 2 * 2 * dI * D + dI) + 4 * 4 * 2 * dI
            it["index_keys"] += e * dI * (math.ceil(K / 4) + 1)
        it["kv_window"] += B * (e * W * hd + pend)
    it["embeddings"] = e * V * D if first and o["embeddings"] == "gpu" else 0
    it["lm_head"] = e * V * D if last else 0
    if last:
        it["norms"] += e * D + 4 * (4 * 4 * D + 4 + 1)
    it["reserve"] = 512 * MiB + max(256 * MiB, int(0.03 * cap))
    # workspace, docs/v4.md: widest MLP = the shared expert (or a hot expert: the same width)
    # the torch attention works ATTN_BLOCK (256) queries at a time over the window's W-1 keys, the chunk, then
    # on an HCA layer every entry of it (the smallest HCA ratio's ceil(K/r)+1) or on a CSA layer each query's
    # index_topk gathered picks, and the sink logit; the indexer scores INDEX_BLOCK (64) queries at a time
    Eh = max((math.ceil(K / r) + 1 for r in sched if r and r != 4), default=0)
    E4 = math.ceil(K / 4) + 1
    rows = e * (ql + 2 * H * hd + hd + G * ol + D + 3 * I)
    wc = max(2 * hd if r == 4 else hd for r in sched if r)  # the widest compressor (CSA: 2 hd)

    def step(R: int, span: int, seqs: int) -> int:
        """One layer over R rows of `seqs` sequences, each query seeing `span` chunk keys."""
        r = R // seqs  # attention and indexer run one sequence at a time
        b, bi = min(r, 256), min(r, 64)
        S = span + W + max(Eh, topk)
        streams = 2 * 4 * R * 4 * D + 4 * R * 24
        proj = e * R * (2 * wc + 4 * dI + nI * dI + nI)  # compressors' and indexer's projections of every row
        held = proj + e * (span + W) * hd + e * r * (span + W) + 16 * r * topk
        attn = 2 * e * b * H * S + e * r * H * hd + 2 * e * Eh * hd + e * r * Eh + e * b * topk * (hd + 1)
        index = (e + 4) * E4 * dI + e * r * nI * dI + 4 * r * nI + bi * (4 * nI * dI + 4 * nI * E4 + 4 * E4 + 28 * topk)
        comp = (4 * e + 12) * R * wc
        return streams + R * rows + held + max(attn, index, comp)

    # the batched decode of Bd rows: every row's window (W-1 stacked + the new key), its HCA entries (E
    # padded, at most the pool's) or CSA picks at once; the indexer 8 rows at a time over E4 padded entries
    kinds = {r: (2 * e * r * (2 * hd if r == 4 else hd) if r else 0)
             + ((e + 4) * 4 * hd + 2 * e * 4 * 2 * dI + (e + 4) * 4 * dI if r == 4 else 0) for r in set(sched)}
    state = e * (W - 1) * hd + max(kinds.values())
    slots = max(r * (2 * hd if r == 4 else hd) for r in sched if r)

    def decode(Bd: int) -> int:
        S = W + max(Eh, topk)
        proj = e * Bd * (2 * wc + 4 * dI + nI * dI + nI)
        held = proj + 2 * Bd * state + e * Bd * S * (hd + 1) + 16 * Bd * topk
        attn = 2 * e * min(Bd, 256) * H * S + e * Bd * H * hd + e * Bd * max(Eh, topk) * hd
        index = e * Bd * nI * dI + 4 * Bd * nI + 28 * Bd * topk + min(Bd, 8) * E4 * ((e + 4) * dI + 4 * nI + 4)
        comp = (3 * e + 12) * Bd * slots
        return 2 * 4 * Bd * 4 * D + 4 * Bd * 24 + Bd * rows + held + max(attn, index, comp)

    buckets = sorted({1, 2, 4, 8, 16, 32} | {1 << j for j in range(max(B, 32).bit_length()) if (1 << j) <= max(B, 32)})
    static = 3 * 4 * 4 * D + 3 * e * D + 2 * 4 * 24 + 2 * state + 8 * (Eh + 2 * E4) + 12 * k
    graphs = sum(decode(b) + b * static for b in buckets)  # one pool per bucket: a decode step and the buffers
    # the one reused dequantisation buffer: min(1024, out) rows of the widest quantised linear [out, in]
    quantised = [(ql, D), (H * hd, ql), (hd, D), (G * ol, H * hd // G), (D, G * ol), (I, D), (D, I), (nI * dI, ql)]
    scratch = max(e * min(1024, out) * inp for out, inp in quantised)
    if o["gpu_experts"] and o["expert_format"] == "mxfp4":  # hot MXFP4 experts [I, D], [D, I]: + codes as int32
        scratch = max([scratch] + [e * min(1024, out) * inp + 4 * min(1024, out) * math.ceil(inp / 2)
                                   for out, inp in ((I, D), (D, I))])
    # hot experts: their summed output [T, D] and one expert's rows at its worst (D + 6I, or 3D, per row)
    hot = e * T * (D + max(D + 6 * I, 3 * D)) if o["gpu_experts"] else 0
    it["workspace"] = (max(step(T, T, 1), decode(B)) + 4 * T * D + 12 * T * k + hot
                       + (2 * 4 * B * V if last else 0)
                       + scratch + graphs + e * H * hd * ol)  # + wo_a (FP8) dequantised whole per step
    return it


def check_plan(name: str, gpus: list[str], host: str, **kw) -> tuple[object, dict]:
    cfg, _ = P.load_model_config(name)
    plan = P.make_plan(cfg, gpus, host_ram=host, model=name, **kw)
    j = plan.to_json()
    d, o = raw(name), j["options"]
    n = len(j["gpus"])
    covered = [i for g in j["gpus"] for i in g["layers"]]
    assert covered == list(range(d["num_hidden_layers"]))  # contiguous, every layer once
    for gi, g in enumerate(j["gpus"]):
        want = hand_items(d, o, g["layers"], first=gi == 0, last=gi == n - 1, cap=g["capacity_bytes"])
        got = dict(g["items"])
        assert set(got) == set(want), (set(got) ^ set(want))
        for key in want:
            assert got[key] == want[key], (key, got[key], want[key])
        assert g["used_bytes"] == sum(got.values()) and g["free_bytes"] == g["capacity_bytes"] - g["used_bytes"]
    # pool bytes per token: sum over CSA (hd + dI)/4 and HCA hd/ratio, in bf16
    per_tok = sum(2 * (d["head_dim"] + (d["index_head_dim"] if r == 4 else 0)) / r for r in schedule(d) if r)
    assert j["kv_bytes_per_token"] == per_tok
    # shards: MXFP4 experts as stored
    E, I, D, L = d["n_routed_experts"], d["moe_intermediate_size"], d["hidden_size"], d["num_hidden_layers"]
    assert o["expert_format"] == "mxfp4"
    w = L * E * 3 * mxfp4_host(I, D)
    (s,) = j["shards"]
    assert s["weight_bytes"] == w
    T, k = o["chunk_tokens"], d["num_experts_per_tok"]
    assert s["ram_bytes"] == w + 4 * (2 * T * D + T * k * (D + 3 * I)) + GiB
    emb_cpu = 2 * d["vocab_size"] * D if o["embeddings"] == "cpu" else 0  # bf16 embeddings in host RAM
    assert j["host"]["required_bytes"] == s["ram_bytes"] + 4 * GiB + emb_cpu + 8 * GiB
    return plan, j


def test_flash_one_24g_card_at_the_default_chunk():
    # chunk 2048: with the attention in query blocks (CSA picks gathered) and the indexer scoring 64 queries
    # at a time, the workspace is about a GiB and 64k KV tokens fit beside hot experts
    plan, j = check_plan("deepseek-v4-flash", ["24GiB"], "256GiB")
    (g,) = j["gpus"]
    assert j["fits"] and j["kv_tokens"] >= 65536 and j["options"]["chunk_tokens"] == 2048
    assert j["options"]["gpu_experts"] > 0
    assert g["items"]["workspace"] < 2 * GiB


def test_flash_one_24g_card_fits_64k_kv_at_chunk_512():
    plan, j = check_plan("deepseek-v4-flash", ["24GiB"], "256GiB", chunk_tokens=512)
    assert j["fits"] and j["kv_tokens"] >= 65536
    assert j["options"]["attention_weights"] == "checkpoint" and j["options"]["embeddings"] == "gpu"
    assert j["options"]["gpu_experts"] > 0
    t = plan.table()
    assert "FITS" in t and "KV compressed" in t and "6,880 B/token" in t and "mHC mixing" in t


def test_flash_16g_card_says_what_fits():
    plan, j = check_plan("deepseek-v4-flash", ["16GiB"], "256GiB", chunk_tokens=512)
    assert j["fits"] and j["kv_tokens"] >= 65536  # and fewer hot experts than on 24 GiB
    big = P.make_plan(P.load_model_config("deepseek-v4-flash")[0], ["24GiB"], host_ram="256GiB", chunk_tokens=512)
    assert j["options"]["gpu_experts"] < big.options.gpu_experts
    assert f"gpu-experts {j['options']['gpu_experts']}/layer" in plan.table()


def test_pro_two_24g_cards_and_1tib():
    plan, j = check_plan("deepseek-v4-pro", ["24GiB", "24GiB"], "1TiB")
    if j["fits"]:
        assert j["kv_tokens"] >= 4096 and "FITS" in plan.table()
    else:  # names the shortfall
        assert "DOES NOT FIT" in plan.table() and j["missing_bytes"] > 0


def test_pro_on_too_little_names_the_shortfall(capsys):
    rc = cli_main(["plan", "--model", "deepseek-v4-pro", "--gpu", "24GiB", "--host-ram", "512GiB"])
    out = capsys.readouterr().out
    assert rc == 3 and "DOES NOT FIT" in out and "host RAM short by" in out


def test_expert_format_rules(tmp_path):
    v3 = P.load_model_config("deepseek-v3")[0]
    with pytest.raises(ValueError, match="not MXFP4"):
        P.make_plan(v3, ["80GiB"], expert_format="mxfp4")
    d = raw("deepseek-v4-flash")
    d["quantization_config"] = {**d["quantization_config"], "expert_dtype": "fp8"}
    (tmp_path / "config.json").write_text(json.dumps(d))
    cfg, name = P.load_model_config(str(tmp_path))
    p = P.make_plan(cfg, ["24GiB"], host_ram="512GiB", model=name)
    assert p.options.expert_format in ("bf16", "int8", "int4")
    with pytest.raises(ValueError, match="not MXFP4"):
        P.make_plan(cfg, ["24GiB"], expert_format="mxfp4")


def test_plan_of_a_tiny_v4_checkpoint_and_shared_config(tmp_path, capsys):
    from gpu_service.local.tiny import make_tiny

    d = make_tiny(str(tmp_path / "t"), arch="deepseek_v4", v4_schedule="pro")
    rc = cli_main(["plan", "--model", d, "--gpu", "2GiB", "--json"])  # chunk 2048: 0.3 GiB of workspace
    j = json.loads(capsys.readouterr().out)
    assert rc == 0 and j["fits"] and j["options"]["expert_format"] == "mxfp4"
    assert "kv_window" in j["gpus"][0]["items"] and "dense_mlp" not in j["gpus"][0]["items"]
    rc = cli_main(["plan", "--model", FLASH_CFG, "--gpu", "24GiB", "--host-ram", "256GiB"])
    assert rc == 0 and "FITS" in capsys.readouterr().out


def test_shard_and_hot_mxfp4_bytes_are_what_each_side_holds(tmp_path):
    """On a tiny V4 MXFP4 checkpoint: the plan's shard weight bytes equal what the mxfp4 kernels allocate
    (whole, in two intermediate slices, in two expert ranges), and its hot-expert bytes what
    Mxfp4Linear holds on the GPU (the scales as bf16: more than the shards' e8m0 bytes)."""
    from cpu_expert_service.backend import available_backends
    from cpu_expert_service.server import load_shard
    from gpu_service.local import tiny
    from gpu_service.model.qlinear import Mxfp4Linear

    if "kernels" not in available_backends():
        pytest.skip("C kernels not built")
    d = tiny.make_tiny(str(tmp_path / "flash"), fmt="mxfp4", seed=5, arch="deepseek_v4")
    cfg, _ = P.load_model_config(d)
    E, I, H = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for n, split in ((1, "slice"), (2, "slice"), (2, "experts")):
        for s in P.shard_plans(cfg, "mxfp4", n, 64, split=split):
            experts = list(range(*s.experts)) if split == "experts" else None
            _, be, info = load_shard(d, experts, s.slice if split == "slice" else None, backend="kernels")
            assert info["serve_format"] == "mxfp4"
            assert be.weight_bytes() == s.weight_bytes, (n, split, s.index)
    whole = P.shard_plans(cfg, "mxfp4", 1, 64)[0].weight_bytes
    assert whole == len(cfg.moe_layers) * E * 3 * mxfp4_host(I, H)  # 4.25 bits a weight
    rng = np.random.default_rng(0)
    hot = 0
    for out, inp in ((I, H), (I, H), (H, I)):
        lin = Mxfp4Linear.from_stored(rng.integers(0, 256, (out, inp // 2), dtype=np.uint8).view(np.int8),
                                      rng.integers(100, 140, (out, inp // 32), dtype=np.uint8), "cpu")
        hot += sum(p.numel() * p.element_size() for p in lin.parameters())
    assert hot == P.expert_bytes(cfg, "mxfp4") == 3 * mxfp4(I, H) > whole // (len(cfg.moe_layers) * E)
