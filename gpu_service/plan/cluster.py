"""Which Kubernetes nodes can run a memory plan's pods, and why the others cannot.

`check_cluster(plan)` reads the nodes of the current kubeconfig (or takes recorded node objects) and, for each
node, checks the same requirements the Helm chart encodes (gpu_service.plan.helm_values): GPU Feature Discovery
labels and allocatable `nvidia.com/gpu` for the GPU pod; Node Feature Discovery CPU labels and allocatable whole
CPUs, memory and hugepages for each expert shard pod. It checks each pod on its own against a node's
allocatable resources, not what other pods already use.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from decimal import Decimal

from gpu_service.plan.helm_values import helm_values_from_plan

GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"
GPU_COUNT_LABEL = "nvidia.com/gpu.count"
GPU_PRODUCT_LABEL = "nvidia.com/gpu.product"
CPUID_LABEL = "feature.node.kubernetes.io/cpu-cpuid."
# experts.kernelIsa -> NFD cpuid features that must be "true" (same table as the chart's _helpers.tpl).
ISA_FEATURES = {"amx": ("AMXBF16", "AVX512BF16", "AVX512F"), "avx512": ("AVX512F",), "avx2": ("AVX2",), "auto": ()}

_SUFFIX = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60,
           "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": 1,
           "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18}


def parse_quantity(q: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("70", "500m", "1056439012Ki", "16Gi", "1e3") as a Decimal."""
    if isinstance(q, (int, float)):
        return Decimal(str(q))
    m = re.fullmatch(r"([+-]?[0-9.]+(?:[eE][+-]?[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|)", q.strip())
    if not m:
        raise ValueError(f"not a Kubernetes quantity: {q!r}")
    return Decimal(m.group(1)) * Decimal(_SUFFIX[m.group(2)])


def _gib(n: Decimal) -> str:
    return f"{float(n) / 2**30:.1f} GiB"


@dataclass
class NodeVerdict:
    """What one node can run. gpu_reasons / expert_reasons[shard index] say why not (empty when it can)."""

    node: str
    gpu_ok: bool
    gpu_reasons: list[str] = field(default_factory=list)
    expert_shards: list[int] = field(default_factory=list)  # shard indices whose pod fits this node
    expert_reasons: dict[int, list[str]] = field(default_factory=dict)

    @property
    def experts_ok(self) -> bool:
        return bool(self.expert_shards)

    def __str__(self) -> str:
        gpu = "GPU pod: yes" if self.gpu_ok else "GPU pod: no (" + "; ".join(self.gpu_reasons) + ")"
        parts = [f"shards {self.expert_shards}: yes"] if self.expert_shards else []
        for i, why in sorted(self.expert_reasons.items()):
            parts.append(f"shard {i}: no (" + "; ".join(why) + ")")
        return f"{self.node}: {gpu}; expert pods: " + ", ".join(parts)


def _check_gpu(labels: dict, alloc: dict, gpu: dict) -> list[str]:
    why = []
    count, need_mib = int(gpu["count"]), int(gpu["memoryMiB"])
    if GPU_MEMORY_LABEL not in labels:
        why.append(f"no {GPU_MEMORY_LABEL} label (GPU Feature Discovery not running, or no NVIDIA GPU)")
    elif int(labels[GPU_MEMORY_LABEL]) < need_mib:
        why.append(f"GPU memory too small: {labels[GPU_MEMORY_LABEL]} MiB < {need_mib} MiB the plan needs")
    have = int(parse_quantity(alloc.get("nvidia.com/gpu", "0")))
    label_count = int(labels.get(GPU_COUNT_LABEL, have))
    if min(have, label_count) < count:
        why.append(f"too few GPUs: {min(have, label_count)} allocatable nvidia.com/gpu < {count}")
    products = gpu.get("products") or []
    if products and labels.get(GPU_PRODUCT_LABEL) not in products:
        why.append(f"GPU model {labels.get(GPU_PRODUCT_LABEL)!r} not in {products}")
    for res, qty in ((gpu.get("resources") or {}).get("requests") or {}).items():
        if res in ("cpu", "memory") and parse_quantity(alloc.get(res, "0")) < parse_quantity(qty):
            why.append(f"too little allocatable {res}: {alloc.get(res, '0')} < {qty}")
    return why


def _check_shard(labels: dict, alloc: dict, group: dict, features: tuple[str, ...], hp_size: str) -> list[str]:
    why = []
    missing = [f for f in features if labels.get(CPUID_LABEL + f) != "true"]
    if missing:
        why.append("missing CPU feature label " + ", ".join(CPUID_LABEL + f for f in missing))
    cpu = parse_quantity(alloc.get("cpu", "0"))
    if cpu < group["cpu"]:
        why.append(f"too few allocatable CPUs: {cpu} < {group['cpu']}")
    mem, need = parse_quantity(alloc.get("memory", "0")), parse_quantity(group["memory"])
    if mem < need:
        why.append(f"too little allocatable memory: {_gib(mem)} < {_gib(need)}")
    if group.get("hugepages"):
        res = f"hugepages-{hp_size}"
        have, want = parse_quantity(alloc.get(res, "0")), parse_quantity(group["hugepages"])
        if have < want:
            why.append(f"too few {res}: {_gib(have)} < {_gib(want)}")
    return why


def list_nodes() -> list[dict]:
    """Node objects (as plain dicts, API field names) from the current kubeconfig or in-cluster config."""
    from kubernetes import client, config

    try:
        config.load_kube_config()
    except Exception:
        config.load_incluster_config()
    api = client.ApiClient()
    return [api.sanitize_for_serialization(n) for n in client.CoreV1Api(api).list_node().items]


def check_cluster(plan: dict, nodes: list[dict] | None = None, *, values: dict | None = None,
                  **values_kwargs) -> list[NodeVerdict]:
    """One NodeVerdict per node: can it run the plan's GPU pod, and which expert shard pods.

    nodes: Node objects as dicts (kubectl get node -o json items); None lists the current cluster's nodes with
    the `kubernetes` package. values: chart values to check against; default helm_values_from_plan(plan, ...)
    with values_kwargs (kernel_isa, cpus_per_shard, hugepages_size, ...).
    """
    if values is None:
        values = helm_values_from_plan(plan, "/models/model", **values_kwargs)
    if nodes is None:
        nodes = list_nodes()
    experts = values["experts"]
    features = ISA_FEATURES[experts.get("kernelIsa", "auto")]
    hp_size = experts.get("hugepagesSize", "2Mi")
    verdicts = []
    for node in nodes:
        meta, status = node.get("metadata", {}), node.get("status", {})
        labels, alloc = meta.get("labels") or {}, status.get("allocatable") or {}
        gpu_why = _check_gpu(labels, alloc, values["gpu"])
        v = NodeVerdict(node=meta.get("name", "?"), gpu_ok=not gpu_why, gpu_reasons=gpu_why)
        for g, shard in zip(experts["groups"], sorted(plan["shards"], key=lambda s: int(s["index"]))):
            why = _check_shard(labels, alloc, g, features, hp_size)
            if why:
                v.expert_reasons[int(shard["index"])] = why
            else:
                v.expert_shards.append(int(shard["index"]))
        verdicts.append(v)
    return verdicts
