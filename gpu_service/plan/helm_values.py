"""Turn a memory plan (the JSON dict of `gpu_service.plan`) into values for the Helm chart in deploy/helm/moesplit.

The plan already knows what the hardware must provide; the chart turns these values into scheduling
constraints: GPU count and GPU Feature Discovery memory affinity for the GPU pod, one Guaranteed-QoS
StatefulSet per expert shard with the shard's CPUs and memory. `moesplit plan ... --helm-values FILE` calls
`write_helm_values`. `gpu_service.plan.cluster.check_cluster` reads the same values to say which nodes fit.
"""
from __future__ import annotations

import json
import math
import posixpath
from typing import Any

MiB = 1 << 20
# GPU Feature Discovery's nvidia.com/gpu.memory is the driver's total in MiB, which can sit a little under the
# nominal size (a "16 GB" card reports 16376-16380 MiB). Nodes must have at least this share of the capacity
# the plan assumed, and never less than what the plan uses.
GPU_MEMORY_TOLERANCE = 0.99
# Whole CPUs per expert shard when neither the plan nor the caller says (the plan sizes memory, not cores).
DEFAULT_CPUS_PER_SHARD = 16
# Expert pod memory above the plan's ram_bytes: Python, gRPC buffers, page tables.
DEFAULT_MEMORY_HEADROOM_MIB = 1024
KERNEL_ISAS = ("amx", "avx512", "avx2", "auto")
HUGEPAGE_BYTES = {"2Mi": 2 * MiB, "1Gi": 1024 * MiB}


def gpu_memory_mib(plan: dict) -> int:
    """MiB of memory every GPU of a node must have (the `nvidia.com/gpu.memory` label) to run the plan."""
    need = 0
    for g in plan["gpus"]:
        used = math.ceil(int(g["used_bytes"]) / MiB)
        assumed = math.floor(int(g["capacity_bytes"]) / MiB * GPU_MEMORY_TOLERANCE)
        need = max(need, used, assumed)
    return need


def shard_cpus(plan: dict, shard: dict, cpus_per_shard: int | None = None) -> int:
    """Whole CPUs of one expert shard: the shard's own `cpus`/`threads`, else the caller's, else the plan's
    `options.cpus_per_shard`, else DEFAULT_CPUS_PER_SHARD."""
    options = plan.get("options") if isinstance(plan.get("options"), dict) else {}
    for v in (shard.get("cpus"), shard.get("threads"), cpus_per_shard,
              options.get("cpus_per_shard"), DEFAULT_CPUS_PER_SHARD):
        if v is not None:
            if int(v) < 1 or int(v) != v:
                raise ValueError(f"shard {shard.get('index')}: CPUs must be a whole number >= 1, got {v!r}")
            return int(v)
    raise AssertionError("unreachable")


def shard_layout(shard: dict) -> dict:
    """{"slice": "i/n"} or {"experts": "a-b"} for one plan shard (the `moesplit expert-server` arguments)."""
    if "slice" in shard and shard["slice"] is not None:
        i, n = (int(x) for x in shard["slice"])
        if not 0 <= i < n:
            raise ValueError(f"shard {shard.get('index')}: slice {i}/{n} is out of range")
        return {"slice": f"{i}/{n}"}
    if "experts" in shard and shard["experts"] is not None:
        # The plan's range is half-open [a, b); `--experts` takes inclusive ranges.
        a, b = (int(x) for x in shard["experts"])
        if not 0 <= a < b:
            raise ValueError(f"shard {shard.get('index')}: expert range [{a}, {b}) is empty or negative")
        return {"experts": f"{a}-{b - 1}"}
    raise ValueError(f"shard {shard.get('index')}: the plan gives neither 'slice' [i, n] nor 'experts' [a, b]")


def plan_args(plan: dict) -> list[str]:
    """`moesplit gpu-server` flags that reproduce the plan's resolved options on the node."""
    o = plan.get("options") or {}
    args = []
    for flag, key in (("--attention-weights", "attention_weights"), ("--embeddings", "embeddings"),
                      ("--gpu-experts", "gpu_experts"), ("--kv-tokens", "kv_tokens"), ("--min-kv-tokens", "kv_tokens"),
                      ("--chunk-tokens", "chunk_tokens"), ("--max-batch", "max_batch")):
        if key in o:
            args += [flag, str(o[key])]
    return args


def helm_values_from_plan(plan: dict, model_path: str, image: str | None = None, *,
                          kernel_isa: str = "auto", redundancy: int = 1,
                          cpus_per_shard: int | None = None,
                          memory_headroom_mib: int = DEFAULT_MEMORY_HEADROOM_MIB,
                          hugepages_size: str | None = None,
                          gpu_products: list[str] | None = None) -> dict:
    """Chart values (a dict to dump as YAML) that make Kubernetes schedule `plan` where it fits.
    `model_path`: the checkpoint inside the containers (its parent is the volume mount); `image`:
    "registry/namespace[:tag]" the two images were pushed under; `hugepages_size` ("2Mi"|"1Gi"): each
    shard's weights in hugepages of that size."""
    if not plan.get("fits", False):
        raise ValueError("the memory plan does not fit its hardware; Helm values for it would schedule pods that "
                         "cannot load. Re-plan with one of the options it lists (fewer KV tokens, FP8/INT8 "
                         "attention, embeddings on CPU, more GPUs) first.")
    if not plan.get("gpus"):
        raise ValueError("the memory plan has no GPUs; the GPU service needs at least one")
    if not plan.get("shards"):
        raise ValueError("the memory plan has no expert shards; the chart needs at least one expert StatefulSet")
    if kernel_isa not in KERNEL_ISAS:
        raise ValueError(f"kernel_isa must be one of {', '.join(KERNEL_ISAS)}, not {kernel_isa!r}")
    if int(redundancy) < 1:
        raise ValueError(f"redundancy must be >= 1 (replicas of every shard group), not {redundancy!r}")
    if hugepages_size is not None and hugepages_size not in HUGEPAGE_BYTES:
        raise ValueError(f"hugepages_size must be 2Mi or 1Gi, not {hugepages_size!r}")
    model_path = posixpath.normpath(model_path)
    mount = posixpath.dirname(model_path)
    if not model_path.startswith("/") or mount == "/":
        raise ValueError(f"model_path {model_path!r} must be an absolute directory below a mount point, "
                         "e.g. /models/Kimi-K2-Thinking")

    groups = []
    for s in sorted(plan["shards"], key=lambda s: int(s["index"])):
        ram = int(s["ram_bytes"])
        group: dict[str, Any] = {"name": f"shard{int(s['index'])}", **shard_layout(s),
                                 "numaNode": int(s.get("numa_node") or 0),
                                 "cpu": shard_cpus(plan, s, cpus_per_shard)}
        if hugepages_size:
            page = HUGEPAGE_BYTES[hugepages_size]
            pages = math.ceil(int(s["weight_bytes"]) / page)
            group["hugepages"] = f"{pages * page // MiB}Mi"
            ram = max(0, ram - int(s["weight_bytes"]))
        group["memory"] = f"{math.ceil(ram / MiB) + int(memory_headroom_mib)}Mi"
        groups.append(group)

    values: dict[str, Any] = {
        "model": {"path": model_path, "mountPath": mount},
        "gpu": {"count": len(plan["gpus"]), "memoryMiB": gpu_memory_mib(plan),
                # the GPU service re-plans on the node with these resolved choices (never "auto")
                "extraArgs": plan_args(plan)},
        "experts": {"kernelIsa": kernel_isa, "redundancy": int(redundancy), "groups": groups},
    }
    if gpu_products:
        values["gpu"]["products"] = list(gpu_products)
    if hugepages_size:
        values["experts"]["hugepagesSize"] = hugepages_size
    if image:
        if "@" in image:
            raise ValueError(f"image {image!r}: give repository:tag; the chart does not take digests")
        # "registry/ns[:tag]": the two images scripts/build_images.sh builds, pushed under that namespace.
        repo, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
        values["image"] = {c: {"repository": f"{repo.rstrip('/')}/moesplit-{c}", **({"tag": tag} if tag else {})}
                           for c in ("experts", "gpu")}
    return values


def dump_helm_values(values: dict, header: str = "") -> str:
    """YAML text of `values` (JSON, which YAML reads too, when PyYAML is absent)."""
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    try:
        import yaml
    except ImportError:
        return comment + json.dumps(values, indent=2) + "\n"
    return comment + yaml.safe_dump(values, sort_keys=False, default_flow_style=False)


def write_helm_values(plan: dict, path: str, model_path: str, image: str | None = None, **kwargs) -> dict:
    """Write helm_values_from_plan(...) to `path` (a values file for `helm install -f`); returns the values."""
    values = helm_values_from_plan(plan, model_path, image, **kwargs)
    model = plan.get("model")
    name = model.get("name") if isinstance(model, dict) else model
    header = (f"Helm values from a moesplit memory plan{f' for {name}' if name else ''}: "
              f"{len(plan['gpus'])} GPU(s), {len(plan['shards'])} expert shard(s).\n"
              "Generated by `moesplit plan --helm-values`; re-run the plan instead of editing the hardware keys.")
    with open(path, "w") as f:
        f.write(dump_helm_values(values, header))
    return values
