"""Metrics end to end, checked by a real Prometheus (the Debian package `prometheus`).

One local stack: a tiny bf16 checkpoint, 2 expert shard processes with `--metrics-port`, the
serving stack (/metrics on its HTTP port). Prometheus scrapes all three every second and loads
deploy/helm/moesplit/rules/moesplit-rules.yaml. After some traffic (completions and chat, streamed
and not), every target expression of every panel of every dashboard in
deploy/helm/moesplit/dashboards/ is evaluated through Prometheus' HTTP API and must return data;
the counters must equal what the API reported (tokens) and what the model computed (activations).
"""
import glob
import json
import math
import os
import shutil
import socket
import subprocess
import time

import httpx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHART = os.path.join(ROOT, "deploy", "helm", "moesplit")
DASHBOARDS = sorted(glob.glob(os.path.join(CHART, "dashboards", "*.json")))
RULES = os.path.join(CHART, "rules", "moesplit-rules.yaml")
API_KEY = "sk-metrics"
MODEL = "tiny-metrics"
# Grafana's interval variables, as a dashboard would resolve them on a short range
GRAFANA_VARS = {"$__rate_interval": "30s", "$__interval": "15s", "$__range": "10m"}


def _binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"`{name}` is not installed: run `make setup-test` (installs the Debian package prometheus)")
    return path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(pred, timeout: float, what: str, step: float = 0.2):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            last = pred()
            if last:
                return last
        except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
            last = e
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}: last {last!r}")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    from gpu_service.local.stack import start_shards
    from gpu_service.entrypoints.serving import ServingStack, build_runner
    from local_stack import shard_health_fn
    from gpu_service.local.tiny import make_tiny

    model_dir = make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=0)
    metrics_ports = [_free_port(), _free_port()]
    shards = start_shards(model_dir, 2, split="experts", backend="numpy", metrics_ports=metrics_ports)
    try:
        runner, client, tok = build_runner(model_dir, shards.addresses, "cpu", "float32", kv_tokens=1024,
                                           page_size=16)
        st = ServingStack(runner, tok, MODEL, port=0, grpc_port=0, api_key=API_KEY, max_batch=4, chunk_tokens=32,
                          health_fn=shard_health_fn(shards.addresses), closers=[shards.stop, client.close])
    except BaseException:
        shards.stop()
        raise
    st.metrics_ports, st.shard_addrs = metrics_ports, list(shards.addresses)
    st.start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def prometheus(stack, tmp_path_factory):
    binary = _binary("prometheus")
    d = tmp_path_factory.mktemp("prometheus")
    port = _free_port()
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "1s"},
        "rule_files": [RULES],
        "scrape_configs": [
            {"job_name": "moesplit-gpu", "static_configs": [{"targets": [f"127.0.0.1:{stack.port}"]}]},
            {"job_name": "moesplit-experts",
             "static_configs": [{"targets": [f"127.0.0.1:{p}" for p in stack.metrics_ports]}]},
        ],
    }
    (d / "prometheus.yml").write_text(json.dumps(config))  # JSON is YAML
    log = open(d / "prometheus.log", "wb")
    proc = subprocess.Popen([binary, f"--config.file={d / 'prometheus.yml'}", f"--storage.tsdb.path={d / 'data'}",
                             f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        def ready():
            if proc.poll() is not None:
                raise AssertionError(f"prometheus exited with {proc.returncode}: "
                                     f"{(d / 'prometheus.log').read_text()[-3000:]}")
            return httpx.get(url + "/-/ready", timeout=2).status_code == 200

        _wait(ready, 60, "prometheus to be ready")
        _wait(lambda: all(t["health"] == "up" for t in _targets(url)) and len(_targets(url)) == 3, 30,
              "prometheus to scrape the GPU service and both shards")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def _targets(url: str) -> list[dict]:
    return httpx.get(url + "/api/v1/targets", timeout=5).json()["data"]["activeTargets"]


def query(url: str, expr: str, at: float | None = None) -> list[dict]:
    params = {"query": expr}
    if at is not None:
        params["time"] = f"{at:.3f}"
    r = httpx.get(url + "/api/v1/query", params=params, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", f"{expr}: {r.status_code} {body}"
    return body["data"]["result"]


def scalar(url: str, expr: str, at: float | None = None) -> float:
    res = query(url, expr, at)
    assert len(res) == 1, f"{expr}: expected one series, got {res}"
    return float(res[0]["value"][1])


def _post(stack, path: str, body: dict) -> dict:
    r = httpx.post(stack.http_url + path, json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream(stack, path: str, body: dict) -> dict:
    """A streamed request with include_usage; returns the usage chunk."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    usage = None
    with httpx.stream("POST", stack.http_url + path, json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage = chunk["usage"]
    assert usage is not None
    return usage


@pytest.fixture(scope="module")
def traffic(stack, prometheus):
    """Requests of every kind; returns (usages, finish reasons, evaluation time)."""
    usages, reasons = [], []
    # a first request creates the labelled series (per layer, per shard); Prometheus must see them
    # before the rest of the traffic so that rates over the window have an increase
    r = _post(stack, "/v1/completions", {"prompt": "warm up", "max_tokens": 2})
    usages.append(r["usage"])
    reasons.append(r["choices"][0]["finish_reason"])
    _wait(lambda: query(prometheus, "moesplit_expert_layer_rtt_seconds_count")
          and query(prometheus, "moesplit_expert_activations_total > 0"), 20, "the first scrapes after traffic")
    time.sleep(2.5)
    for body in ({"prompt": "The quick brown fox", "max_tokens": 12, "ignore_eos": True},
                 {"prompt": [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28,
                             29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40], "max_tokens": 6}):
        r = _post(stack, "/v1/completions", body)
        usages.append(r["usage"])
        reasons.append(r["choices"][0]["finish_reason"])
    r = _post(stack, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hello there"}],
                                               "max_tokens": 8, "temperature": 0.8, "seed": 3})
    usages.append(r["usage"])
    reasons.append(r["choices"][0]["finish_reason"])
    usages.append(_stream(stack, "/v1/chat/completions",
                          {"messages": [{"role": "user", "content": "stream please"}], "max_tokens": 10,
                           "ignore_eos": True}))
    reasons.append("length")
    usages.append(_stream(stack, "/v1/completions", {"prompt": "once upon a time", "max_tokens": 7,
                                                      "ignore_eos": True}))
    reasons.append("length")
    gen = sum(u["completion_tokens"] for u in usages)
    _wait(lambda: scalar(prometheus, "moesplit_generation_tokens_total") == gen, 20,
          f"Prometheus to scrape {gen} generated tokens")
    cfg = stack.engine.cfg
    routed = f"moesplit_engine_step_tokens_total * {cfg.num_experts_per_tok * len(cfg.moe_layers)}"
    _wait(lambda: scalar(prometheus, "sum(moesplit_expert_activations_total)") == scalar(prometheus, routed), 20,
          "Prometheus to scrape the shards' counters after the traffic")
    time.sleep(1.5)
    return usages, reasons, time.time()


def _panel_targets():
    for path in DASHBOARDS:
        with open(path) as f:
            dash = json.load(f)
        variables = {v["name"]: v for v in dash.get("templating", {}).get("list", [])}
        panels = list(dash["panels"])
        while panels:
            p = panels.pop(0)
            panels.extend(p.get("panels", []))  # rows
            for t in p.get("targets", []):
                yield os.path.basename(path), p["title"], t["expr"], variables


def _resolve(expr: str, variables: dict) -> str:
    for k, v in GRAFANA_VARS.items():
        expr = expr.replace(k, v)
    for name, var in variables.items():
        if var["type"] == "datasource":
            continue
        value = var.get("allValue") or ".+"
        expr = expr.replace("${" + name + "}", value).replace("$" + name, value).replace(f"[[{name}]]", value)
    assert "$" not in expr, f"unresolved variable in {expr}"
    return expr


# ---- the checks -------------------------------------------------------------------------------------------------
def test_dashboards_are_grafana_json():
    assert [os.path.basename(p) for p in DASHBOARDS] == ["moesplit-experts.json", "moesplit-memory.json",
                                                         "moesplit-serving.json"]
    for path in DASHBOARDS:
        with open(path) as f:
            dash = json.load(f)
        names = [v["name"] for v in dash["templating"]["list"]]
        assert names[0] == "datasource" and dash["templating"]["list"][0]["query"] == "prometheus", path
        uids = set()
        for p in dash["panels"]:
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, (path, p["title"])
            assert p["targets"], (path, p["title"])
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
            uids.add(p["id"])
        assert len(uids) == len(dash["panels"]), f"{path}: duplicate panel ids"


def test_rules_pass_promtool():
    r = subprocess.run([_binary("promtool"), "check", "rules", RULES], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_metrics_endpoint_needs_no_api_key(stack):
    r = httpx.get(stack.http_url + "/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "moesplit_time_to_first_token_seconds_bucket" in r.text
    assert httpx.get(stack.http_url + "/v1/models").status_code == 401  # the API itself still needs the key
    for p in stack.metrics_ports:
        t = httpx.get(f"http://127.0.0.1:{p}/metrics").text
        assert "moesplit_expert_backend_info{" in t and "process_resident_memory_bytes" in t


def test_every_dashboard_panel_returns_data(prometheus, traffic):
    *_, at = traffic
    empty, nan = [], []
    n = 0
    for dash, title, expr, variables in _panel_targets():
        n += 1
        q = _resolve(expr, variables)
        res = query(prometheus, q, at)
        if not res:
            empty.append(f"{dash} / {title}: {q}")
        elif not any(math.isfinite(float(s["value"][1])) for s in res):
            nan.append(f"{dash} / {title}: {q} -> {res}")
    assert n >= 25
    assert not empty, "panels with no data:\n" + "\n".join(empty)
    assert not nan, "panels with only NaN:\n" + "\n".join(nan)


def test_counters_match_the_traffic(stack, prometheus, traffic):
    usages, reasons, at = traffic
    gen = sum(u["completion_tokens"] for u in usages)
    prompt = sum(u["prompt_tokens"] for u in usages)
    assert scalar(prometheus, "moesplit_generation_tokens_total", at) == gen
    assert scalar(prometheus, "moesplit_prompt_tokens_total", at) == prompt
    assert scalar(prometheus, "moesplit_request_submitted_total", at) == len(usages)
    for reason in ("stop", "length"):
        assert scalar(prometheus, f'moesplit_request_finished_total{{finished_reason="{reason}"}}', at) == \
            reasons.count(reason)
    assert scalar(prometheus, "moesplit_time_to_first_token_seconds_count", at) == len(usages)
    assert scalar(prometheus, "moesplit_inter_token_latency_seconds_count", at) == gen - len(usages)
    assert scalar(prometheus, "moesplit_request_generation_tokens_sum", at) == gen
    assert scalar(prometheus, "moesplit_num_requests_running", at) == 0
    assert scalar(prometheus, "moesplit_kv_cache_usage_ratio", at) == 0
    # every token fed through the model is routed to k experts, each held by exactly one shard
    fed = scalar(prometheus, "moesplit_engine_step_tokens_total", at)
    k = stack.engine.cfg.num_experts_per_tok
    per_layer = query(prometheus, "sum by (layer) (moesplit_expert_activations_total)", at)
    assert sorted(int(s["metric"]["layer"]) for s in per_layer) == list(stack.engine.cfg.moe_layers)
    for s in per_layer:
        assert float(s["value"][1]) == fed * k, s
    assert scalar(prometheus, "sum(moesplit_expert_tokens_total)", at) > 0
    ups = query(prometheus, "moesplit_expert_shard_up", at)
    assert {s["metric"]["shard"]: float(s["value"][1]) for s in ups} == {a: 1.0 for a in stack.shard_addrs}
    names = {s["metric"]["shard"]: (s["metric"]["host"], s["metric"]["replica"]) for s in ups}
    assert {h for h, _ in names.values()} == {"127.0.0.1"}
    assert len({r for _, r in names.values()}) == len(stack.shard_addrs) and not set(names.values()) & \
        {("127.0.0.1", a) for a in stack.shard_addrs}  # replicas named by their shard id, not the address
    calls = query(prometheus, "sum by (host, replica) (moesplit_expert_call_seconds_count)", at)
    assert {(s["metric"]["host"], s["metric"]["replica"]) for s in calls} == set(names.values())
    assert scalar(prometheus, "sum(moesplit_expert_call_seconds_count)", at) == \
        scalar(prometheus, "sum(moesplit_expert_requests_total)", at) > 0
    sent = query(prometheus, "moesplit_expert_sent_bytes_total", at)
    assert {s["metric"]["shard"] for s in sent} == set(stack.shard_addrs)


def test_memory_matches_the_placement(stack, prometheus, traffic):
    from gpu_service.model.placement import allocated_bytes_by_gpu, Placement

    *_, at = traffic
    runner = stack.engine.runner
    placement = getattr(runner, "placement", None) or Placement.single(runner.cfg, runner.device)
    want = sum(allocated_bytes_by_gpu(runner.model, placement, runner.pool).values())
    assert scalar(prometheus, "sum(moesplit_gpu_memory_actual_bytes)", at) == want
    assert scalar(prometheus, 'sum(moesplit_gpu_memory_actual_bytes{category="kv_cache"})', at) == runner.pool.bytes()
    assert not query(prometheus, 'moesplit_gpu_memory_actual_bytes{category="other"}', at)  # all categorised
    planned = {s["metric"]["category"] for s in query(prometheus, "moesplit_gpu_memory_planned_bytes", at)}
    actual = {s["metric"]["category"] for s in query(prometheus, "moesplit_gpu_memory_actual_bytes", at)}
    assert actual == planned  # every planned category is held, nothing outside the plan's categories


def test_slice_shards_count_each_routing_once_and_see_queue_wait(tmp_path):
    """In-process shards with metrics: two intermediate slices (only slice 0 counts activations, so a
    sum over shards counts each routing once); requests pipelined on one stream wait in the queue."""
    import numpy as np
    from prometheus_client import CollectorRegistry

    from checkpoint.config import load_config
    from cpu_expert_service.server import create_server
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.local.tiny import make_tiny

    model_dir = make_tiny(str(tmp_path / "tiny"), "bf16", seed=2)
    cfg = load_config(model_dir)
    regs, servers, addrs = [], [], []
    try:
        for i in range(2):
            reg = CollectorRegistry(auto_describe=False)
            srv, port = create_server(model_dir, slice_spec=(i, 2), port=0, backend="numpy", shard_id=f"s{i}",
                                      metrics_registry=reg)
            regs.append(reg)
            servers.append(srv)
            addrs.append(f"127.0.0.1:{port}")
        client = ExpertsClient(addrs, cfg).connect()
        seen = []
        client.observer = lambda *a: seen.append(a)
        rng = np.random.default_rng(0)
        T, H, k, E = 5, cfg.hidden_size, cfg.num_experts_per_tok, cfg.n_routed_experts
        layer = cfg.moe_layers[0]
        ids = np.stack([rng.permutation(E)[:k] for _ in range(T)])  # [T, k]
        futs = [client.forward_async(layer, rng.standard_normal((T, H), dtype=np.float32), ids,
                                     np.full((T, k), 1.0 / k, np.float32)) for _ in range(6)]  # pipelined
        for f in futs:
            client.result(f, layer)
        client.close()
        want = np.bincount(ids.reshape(-1), minlength=E) * len(futs)
        for i, reg in enumerate(regs):
            got = [reg.get_sample_value("moesplit_expert_activations_total", {"layer": str(layer), "expert": str(e)})
                   for e in range(E)]
            if i == 0:
                assert got == [float(x) for x in want]
            else:
                assert got == [None] * E  # slice 1 does not count: the routing was counted by slice 0
            assert reg.get_sample_value("moesplit_expert_tokens_total", {"layer": str(layer)}) == T * len(futs)
            assert reg.get_sample_value("moesplit_expert_queue_wait_seconds_count") == len(futs)
            assert reg.get_sample_value("moesplit_expert_kernel_seconds_count", {"layer": str(layer)}) == len(futs)
            assert reg.get_sample_value("moesplit_expert_backend_info", {
                "shard_id": f"s{i}", "backend": "numpy", "isa": "none", "weight_format": "bf16"}) == 1
            assert reg.get_sample_value("moesplit_expert_weight_bytes",
                                        {"format": "bf16", "checkpoint_format": "bf16"}) > 0
            assert reg.get_sample_value("process_resident_memory_bytes") > 0
        assert len(seen) == 2 * len(futs) and all(ok and sent > 0 and recv > 0 for _, _, _, sent, recv, ok in seen)
    finally:
        for srv in servers:
            srv.stop(None)


def test_planned_and_actual_memory_agree_per_category_and_device(tmp_path):
    """A 2-GPU plan (CPU embeddings, INT8 attention, 2 hot experts) executed on the CPU: every
    category's actual bytes on every planned device equal the plan's (workspace/reserve: plan only)."""
    import torch

    from checkpoint.reader import CheckpointReader
    from gpu_service import plan as P
    from gpu_service.metrics import actual_bytes, planned_bytes
    from gpu_service.model.placement import Placement
    from gpu_service.runtime.runner import ModelRunner
    from gpu_service.local.tiny import make_tiny

    reader = CheckpointReader(make_tiny(str(tmp_path / "tiny"), "fp8", seed=0))
    plan = P.make_plan(reader.config, ["1GiB", "1GiB"], kv_tokens=256, gpu_experts=2, embeddings="cpu",
                       attention_weights="int8")
    placement = Placement.from_plan(plan, [torch.device("cpu")] * 2)
    runner = ModelRunner(reader, lambda *a: None, device=torch.device("cpu"), dtype=torch.bfloat16,
                         placement=placement, page_size=16)
    planned, actual = planned_bytes(runner, plan), actual_bytes(runner)
    held = {k: v for k, v in planned.items() if v and k[0] not in ("workspace", "reserve")}
    assert held == actual
    assert {d for _, d in actual} == {"cpu", "cuda:0", "cuda:1"}
    # without the Plan object (runner.plan unset), the byte model over the placement gives the same
    assert {k: v for k, v in planned_bytes(runner).items() if v} == held
