"""Hot GPU experts chosen from the shards' activation counts (`--hot-experts`, `moesplit hot-experts`).

Unit part: the file formats, their validation against the model and the plan, top-N picking with
ties and fallbacks. End to end: a tiny checkpoint served by 2 real shard processes with
`--metrics-port`; layer calls that always route to experts 3 and 5; `moesplit hot-experts` scrapes
both shards and picks {3, 5} in every MoE layer; a placement made from that file (the
`--hot-experts` flag) holds exactly those experts on the planned GPU and generates the same tokens
as without hot experts."""
import argparse
import json
import logging
import socket

import numpy as np
import pytest
import torch

from checkpoint.config import ModelConfig
from gpu_service.plan import hot_experts as H
from gpu_service.local.tiny import make_tiny, tiny_config

OVERRIDES = {"num_hidden_layers": 4, "first_k_dense_replace": 1}  # MoE layers 1-3, 16 experts, top-4
HOT = (3, 5)


@pytest.fixture(scope="module")
def cfg():
    return ModelConfig.from_dict(tiny_config("deepseek_v3", "bf16", OVERRIDES))


# ---- files and validation --------------------------------------------------------------------------
def test_explicit_ids_are_checked_and_sorted(cfg):
    spec = H.parse_spec({"1": [5, 3], "2": [0, 15], "3": [7, 1], "top": 2, "metrics": ["x"]}, "f.json")
    assert H.resolve(spec, cfg, 2) == {1: [3, 5], 2: [0, 15], 3: [1, 7]}


@pytest.mark.parametrize("doc, n, msg", [
    ({"1": [3, 16]}, 2, "outside 0-15"),
    ({"1": [-1, 3]}, 2, "outside 0-15"),
    ({"1": [3, 3]}, 2, "more than once"),
    ({"1": [3, 5, 7]}, 2, "pass --gpu-experts 3, or write the file again with `moesplit hot-experts --top 2`"),
    ({"0": [3, 5]}, 2, "layer 0 is not a MoE layer of this model (MoE layers: 1-3)"),
    ({"9": [3, 5]}, 2, "layer 9 is not a MoE layer"),
    ({"counts": {"4": {"1": 2}}}, 2, "layer 4 is not a MoE layer"),
    ({"counts": {"1": {"16": 2}}}, 2, "expert(s) [16] outside 0-15"),
    ({"1": [3, 5]}, 0, "plan keeps none on the GPU (--gpu-experts 0, or auto found no room): pass --gpu-experts 2"),
])
def test_ids_that_do_not_fit_the_model_or_plan_are_refused(cfg, doc, n, msg):
    with pytest.raises(H.HotExpertsError) as e:
        H.resolve(H.parse_spec(doc, "f.json"), cfg, n)
    assert msg in str(e.value) and "f.json" in str(e.value)


@pytest.mark.parametrize("doc, msg", [
    ([1, 2], "expected a JSON object"),
    ({}, "no layers and no counts"),
    ({"layer1": [1]}, "unknown key 'layer1'"),
    ({"1": 3}, "expected a list of expert ids"),
    ({"1": [1.5, 2]}, "expected an integer"),
    ({"1": [True, 2]}, "expected an integer"),
    ({"counts": [1]}, "\"counts\" must map layers"),
    ({"counts": {"1": {"2": -1}}}, "negative"),
    ({"counts": {"x": {}}}, "expected an integer"),
])
def test_malformed_files_are_refused(doc, msg):
    with pytest.raises(H.HotExpertsError, match=None) as e:
        H.parse_spec(doc, "f.json")
    assert msg in str(e.value)


def test_load_file_errors(tmp_path):
    with pytest.raises(H.HotExpertsError, match="No such file"):
        H.load_file(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(H.HotExpertsError, match="not valid JSON"):
        H.load_file(str(tmp_path / "bad.json"))


def test_top_n_from_counts_ties_to_lower_ids_and_empty_layers_fall_back(cfg, caplog):
    counts = {1: {9: 4, 2: 7, 11: 7, 0: 1},  # 2 and 11 tie for first: both; 9 next
              2: {6: 3, 4: 3, 8: 3, 1: 2},  # three-way tie: the two lowest
              3: {0: 0, 5: 0}}  # counted but never routed: fallback
    with caplog.at_level(logging.WARNING, logger="moesplit.hot_experts"):
        hot, fallback = H.top_experts(counts, 3, cfg.moe_layers, cfg.n_routed_experts)
    assert hot == {1: [2, 11, 9], 2: [4, 6, 8], 3: [0, 1, 2]} and fallback == [3]
    hot2, _ = H.top_experts(counts, 2, cfg.moe_layers, cfg.n_routed_experts)
    assert hot2[2] == [4, 6]
    assert "no activation counts for MoE layer(s) 3" in caplog.text and "lowest ids 0-2" in caplog.text
    # a layer with fewer routed experts than N fills up with the lowest unrouted ids
    assert H.top_experts({1: {7: 1}}, 3, [1], 16)[0] == {1: [7, 0, 1]}
    # the counts form of the file: layers missing from it also fall back
    assert H.resolve(H.parse_spec({"counts": {"1": {"9": 5, "2": 5}}}), cfg, 2) == {1: [2, 9], 2: [0, 1], 3: [0, 1]}
    # explicit ids win over counts; a layer they leave out is picked from the counts
    spec = H.parse_spec({"1": [14, 15], "counts": {"1": {"0": 9, "1": 9}, "2": {"12": 1, "13": 2}}})
    assert H.resolve(spec, cfg, 2) == {1: [14, 15], 2: [12, 13], 3: [0, 1]}


def test_parse_prometheus_text():
    text = """# HELP moesplit_expert_activations Routings.
# TYPE moesplit_expert_activations counter
moesplit_expert_activations_total{layer="1",expert="3"} 7.0
moesplit_expert_activations_total{layer="1",expert="5"} 2.0
moesplit_expert_activations_total{layer="2",expert="3"} 0.0
# HELP moesplit_expert_tokens Token rows.
# TYPE moesplit_expert_tokens counter
moesplit_expert_tokens_total{layer="1"} 9.0
"""
    assert H.parse_counts(text) == ({1: {3: 7, 5: 2}, 2: {3: 0}}, True)
    assert H.parse_counts("# TYPE x counter\nx_total 1.0\n") == ({}, False)
    assert H.metrics_url("127.0.0.1:9400") == "http://127.0.0.1:9400/metrics"
    assert H.metrics_url("http://h:1/") == "http://h:1/metrics"
    assert H.metrics_url("https://h:1/custom/path") == "https://h:1/custom/path"


# ---- end to end: real shards, scraped counts, the --hot-experts flag ------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.local.stack import start_shards

    d = make_tiny(str(tmp_path_factory.mktemp("hot") / "bf16"), fmt="bf16", seed=7, overrides=OVERRIDES)
    ports = [_free_port(), _free_port()]
    # numpy: f32 experts like the GPU's copy of the hot ones, which the last check compares with
    with start_shards(d, 2, split="experts", backend="numpy", metrics_ports=ports) as shards:
        client = ExpertsClient(shards.addresses, ModelConfig.from_dict(tiny_config("deepseek_v3", "bf16", OVERRIDES)))
        client.connect()
        try:
            yield d, client, ports
        finally:
            client.close()


def test_scraped_counts_pick_the_routed_experts_and_the_placement_holds_them(stack, tmp_path, cfg):
    from checkpoint.reader import CheckpointReader
    from gpu_service import plan as P
    from moesplit.cli import main
    from gpu_service.model.placement import add_plan_arguments, Placement, placement_from_args
    from gpu_service.experts.handoff import RemoteExperts
    from gpu_service.runtime.runner import ModelRunner

    d, client, ports = stack
    E, k, T, calls = cfg.n_routed_experts, cfg.num_experts_per_tok, 7, 3
    others = [e for e in range(E) if e not in HOT]  # 14: each appears once per call, 3 and 5 on every token
    ids = np.array([[*HOT, others[2 * t], others[2 * t + 1]] for t in range(T)], dtype=np.int64)  # [T, k]
    rng = np.random.default_rng(0)
    for _ in range(calls):
        for layer in cfg.moe_layers:
            out = client.forward(layer, rng.standard_normal((T, cfg.hidden_size), dtype=np.float32), ids,
                                 np.full((T, k), 1.0 / k, np.float32))
            assert out.shape == (T, cfg.hidden_size)

    counts = H.scrape_counts([f"127.0.0.1:{p}" for p in ports])  # both shards: experts 0-7 and 8-15
    for layer in cfg.moe_layers:
        assert counts[layer] == {e: (T * calls if e in HOT else calls) for e in range(E)}

    path = tmp_path / "hot.json"
    assert main(["hot-experts", "--metrics", f"http://127.0.0.1:{ports[0]}/metrics", "--metrics",
                 f"127.0.0.1:{ports[1]}", "--top", "2", "-o", str(path), "--model", d]) == 0
    doc = json.loads(path.read_text())
    assert {int(k): v for k, v in doc.items() if k.isdigit()} == {layer: list(HOT) for layer in cfg.moe_layers}
    assert doc["top"] == 2 and doc["counts"]["1"]["3"] == T * calls and doc["counts"]["2"]["0"] == calls

    # the --hot-experts flag of generate / serve / gpu-server
    p = argparse.ArgumentParser()
    add_plan_arguments(p)

    def placement(*argv):
        return placement_from_args(p.parse_args(["--gpu", "1GiB", "--attention-weights", "bf16", "--embeddings",
                                                 "gpu", *argv]), cfg, 512, 64, 4, device=torch.device("cpu"))

    assert placement("--gpu-experts", "2", "--hot-experts", str(path)).hot_experts == \
        {layer: list(HOT) for layer in cfg.moe_layers}
    assert placement("--gpu-experts", "2").hot_experts == {layer: [0, 1] for layer in cfg.moe_layers}
    with pytest.raises(SystemExit, match="pass --gpu-experts 2, or write the file again with "
                                         "`moesplit hot-experts --top 3`"):
        placement("--gpu-experts", "3", "--hot-experts", str(path))
    with pytest.raises(SystemExit, match="pass --gpu-experts 2"):
        placement("--hot-experts", str(path))  # default --gpu-experts 0
    with pytest.raises(SystemExit, match="needs a memory plan"):
        placement_from_args(p.parse_args(["--hot-experts", str(path)]), cfg, 512, device=torch.device("cpu"))

    # exactly those experts on the planned GPU, and the same tokens as without hot experts
    reader = CheckpointReader(d)
    plan = P.make_plan(reader.config, ["1GiB"], kv_tokens=512, min_kv_tokens=512, chunk_tokens=64, max_batch=4,
                       embeddings="gpu", attention_weights="bf16", gpu_experts=2, expert_format="bf16")
    cpu = [torch.device("cpu")]
    hot_pl = Placement.from_plan(plan, cpu, H.load_file(str(path)))
    cold_pl = Placement.from_plan(P.make_plan(reader.config, ["1GiB"], kv_tokens=512, min_kv_tokens=512,
                                              chunk_tokens=64, max_batch=4, embeddings="gpu",
                                              attention_weights="bf16", gpu_experts=0), cpu)
    experts = RemoteExperts(client)
    hot = ModelRunner(reader, experts, dtype=torch.float32, placement=hot_pl, page_size=64)
    cold = ModelRunner(reader, experts, dtype=torch.float32, placement=cold_pl, page_size=64)
    for layer in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{layer}.mlp.experts."
        held = {int(name[len(prefix):]) for name, _ in hot.model.named_modules()
                if name.startswith(prefix) and name[len(prefix):].isdigit()}  # the `mlp.experts.{e}` MLPs
        assert held == (set(HOT) if layer in cfg.moe_layers else set()), (layer, held)
        assert hot_pl.gpu_index_of(f"model.layers.{layer}.mlp.experts.{HOT[0]}.gate_proj.weight") == 0
    assert not any(".mlp.experts." in name for name, _ in cold.model.named_parameters())
    prompt = [0, 5, 77, 300, 41, 9]
    urls = [f"127.0.0.1:{p}" for p in ports]
    before = H.scrape_counts(urls)
    a = hot.generate(prompt, 24)
    after = H.scrape_counts(urls)  # the shards still see (and count) routings to hot experts
    assert all(sum(after[layer][e] - before[layer][e] for e in HOT) > 0 for layer in cfg.moe_layers)
    b = cold.generate(prompt, 24)
    assert a.token_ids == b.token_ids
    assert (a.last_logits - b.last_logits).abs().max().item() < 1e-4
