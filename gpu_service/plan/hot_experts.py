"""Which routed experts to keep hot on the GPU (`--gpu-experts N`): the N most activated ones.

The shards count every routing per MoE layer and expert (`moesplit_expert_activations_total`,
slice 0 only, so a sum over all shards and replicas counts each routing once); this module turns
the counts into the hot set `Placement.from_plan(hot_experts=...)` puts on the GPU:

    counts = scrape_counts(["http://shard-0:9400/metrics", "shard-1:9400"])  # {layer: {expert: n}}
    hot, fallback = top_experts(counts, 2, layers=cfg.moe_layers, n_experts=cfg.n_routed_experts)

Ties go to the lower id; a layer without counts falls back to the lowest ids (logged). A
`--hot-experts FILE` is `{"<layer>": [ids]}` (checked against the plan) and/or
`{"counts": {"<layer>": {"<expert>": n}}}`; "top" and "metrics" are written for the record only
(docs/plan.md). No torch here, so the subcommand stays light.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass

from checkpoint.names import compact_ranges

log = logging.getLogger("moesplit.hot_experts")

METRIC = "moesplit_expert_activations"  # counter family; samples are named METRIC + "_total"
_INFO_KEYS = ("top", "metrics")  # written by `moesplit hot-experts` for the record, ignored on reading

Counts = dict[int, dict[int, int]]  # layer -> expert -> activations


class HotExpertsError(ValueError):
    """A hot-experts file, its counts or its ids do not fit the model or the plan."""


@dataclass
class HotExpertsSpec:
    """What a hot-experts file says: explicit ids per layer, activation counts, or both."""

    ids: dict[int, list[int]]
    counts: Counts
    source: str = "hot experts"


# ---- counts from the shards' /metrics ---------------------------------------------------------------
def parse_counts(text: str) -> tuple[Counts, bool]:
    """Activation counts in one Prometheus text exposition -> ({layer: {expert: n}}, whether the
    activations family was present at all; a slice > 0 shard exports it without samples)."""
    from prometheus_client.parser import text_string_to_metric_families

    counts: Counts = {}
    present = False
    for fam in text_string_to_metric_families(text):
        if fam.name not in (METRIC, METRIC + "_total"):
            continue
        present = True
        for s in fam.samples:
            if s.name not in (METRIC + "_total", METRIC):  # not e.g. _created
                continue
            layer, expert = int(s.labels["layer"]), int(s.labels["expert"])
            row = counts.setdefault(layer, {})
            row[expert] = row.get(expert, 0) + int(round(s.value))
    return counts, present


def metrics_url(spec: str) -> str:
    """'host:port' -> 'http://host:port/metrics'; a URL with a path is kept as given."""
    url = spec if "://" in spec else "http://" + spec
    _, sep, path = url.partition("://")[2].partition("/")
    return url if sep and path else url.rstrip("/") + "/metrics"


def scrape_counts(urls: list[str], timeout_s: float = 10.0) -> Counts:
    """Sum the activation counts of every shard metrics endpoint (all shards, all replicas)."""
    total: Counts = {}
    found = False
    for spec in urls:
        url = metrics_url(spec)
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as r:
                text = r.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError) as e:
            raise HotExpertsError(f"cannot read {url}: {getattr(e, 'reason', e)}") from None
        counts, present = parse_counts(text)
        if not present:
            log.warning("%s has no %s_total: not an expert shard's --metrics-port?", url, METRIC)
        found |= present
        for layer, row in counts.items():
            dst = total.setdefault(layer, {})
            for e, n in row.items():
                dst[e] = dst.get(e, 0) + n
    if not found:
        raise HotExpertsError(f"no {METRIC}_total at {', '.join(metrics_url(u) for u in urls)}: "
                              "point --metrics at the expert shards' --metrics-port")
    return total


# ---- picking -----------------------------------------------------------------------------------------
def top_experts(counts: Counts, n: int, layers=None, n_experts: int | None = None,
                source: str = "counts") -> tuple[dict[int, list[int]], list[int]]:
    """The n most activated experts of each layer (ties -> lower id; a layer without activations gets
    the lowest ids, logged); returns ({layer: ids}, the layers that fell back)."""
    layers = sorted(counts) if layers is None else list(layers)
    if n_experts is None:
        n_experts = 1 + max((e for row in counts.values() for e in row), default=-1)
        n_experts = max(n_experts, n)
    if not 0 <= n <= n_experts:
        raise HotExpertsError(f"cannot pick {n} hot experts per layer out of {n_experts}")
    hot, fallback = {}, []
    for layer in layers:
        row = counts.get(layer, {})
        if not any(row.values()):
            fallback.append(layer)
            hot[layer] = list(range(n))
            continue
        hot[layer] = sorted(range(n_experts), key=lambda e: (-row.get(e, 0), e))[:n]
    if fallback and n:
        log.warning("%s: no activation counts for MoE layer(s) %s: their hot experts are the lowest ids 0-%d",
                    source, compact_ranges(fallback), n - 1)
    return hot, fallback


# ---- files and validation ----------------------------------------------------------------------------
def _int(v, what: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        if isinstance(v, str) and v.strip().lstrip("-").isdigit():
            return int(v)
        raise HotExpertsError(f"{what}: expected an integer, got {v!r}")
    return v


def parse_spec(d, source: str = "hot experts") -> HotExpertsSpec:
    """Check the shape of a decoded hot-experts JSON document (see the module docstring)."""
    if not isinstance(d, dict):
        raise HotExpertsError(f"{source}: expected a JSON object {{\"<layer>\": [expert ids]}} or "
                              f"{{\"counts\": {{\"<layer>\": {{\"<expert>\": count}}}}}}, got {type(d).__name__}")
    ids: dict[int, list[int]] = {}
    counts: Counts = {}
    for k, v in d.items():
        if k == "counts":
            if not isinstance(v, dict):
                raise HotExpertsError(f"{source}: \"counts\" must map layers to {{expert: count}}")
            for lk, row in v.items():
                layer = _int(lk, f"{source}: counts layer {lk!r}")
                if not isinstance(row, dict):
                    raise HotExpertsError(f"{source}: counts of layer {layer} must map expert ids to counts")
                out = counts.setdefault(layer, {})
                for ek, c in row.items():
                    e = _int(ek, f"{source}: counts of layer {layer}, expert {ek!r}")
                    if isinstance(c, float) and c.is_integer():
                        c = int(c)
                    c = _int(c, f"{source}: count of layer {layer} expert {e}")
                    if c < 0:
                        raise HotExpertsError(f"{source}: count of layer {layer} expert {e} is negative ({c})")
                    out[e] = out.get(e, 0) + c
        elif k in _INFO_KEYS:
            continue
        else:
            try:
                layer = int(k)
            except ValueError:
                raise HotExpertsError(f"{source}: unknown key {k!r}; expected layer numbers, \"counts\", "
                                      f"\"top\" or \"metrics\"") from None
            if not isinstance(v, list):
                raise HotExpertsError(f"{source}: layer {layer}: expected a list of expert ids, got {v!r}")
            ids[layer] = [_int(e, f"{source}: layer {layer}") for e in v]
    if not ids and not counts:
        raise HotExpertsError(f"{source}: no layers and no counts")
    return HotExpertsSpec(ids, counts, source)


def load_file(path: str) -> HotExpertsSpec:
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise HotExpertsError(f"--hot-experts {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise HotExpertsError(f"--hot-experts {path}: not valid JSON ({e})") from None
    return parse_spec(d, source=path)


def resolve(spec: HotExpertsSpec | dict, cfg, n: int) -> dict[int, list[int]]:
    """{layer: sorted ids} for every MoE layer: given ids, else the most activated, else the lowest
    (logged); HotExpertsError naming the fix."""
    if isinstance(spec, dict):
        spec = HotExpertsSpec({_int(k, f"hot_experts layer {k!r}"): [_int(e, f"hot_experts layer {k}") for e in v]
                               for k, v in spec.items()}, {}, "hot_experts")
    src, E, moe = spec.source, cfg.n_routed_experts, list(cfg.moe_layers)
    for layer in sorted(set(spec.ids) | set(spec.counts)):
        if layer not in moe:
            raise HotExpertsError(f"{src}: layer {layer} is not a MoE layer of this model "
                                  f"(MoE layers: {compact_ranges(moe) or 'none'}); is the file for another model?")
    for layer, row in spec.counts.items():
        bad = [e for e in row if not 0 <= e < E]
        if bad:
            raise HotExpertsError(f"{src}: counts of layer {layer} name expert(s) {bad} outside 0-{E - 1}")
    if n == 0 and (any(spec.ids.values()) or spec.counts):
        k = max((len(v) for v in spec.ids.values()), default=0)
        raise HotExpertsError(f"{src} chooses hot experts but the plan keeps none on the GPU (--gpu-experts 0, "
                              f"or auto found no room): pass --gpu-experts {k or 'N'}")
    for layer, ids in spec.ids.items():
        bad = [e for e in ids if not 0 <= e < E]
        if bad:
            raise HotExpertsError(f"{src}: layer {layer}: expert id(s) {bad} outside 0-{E - 1}")
        dup = sorted({e for e in ids if ids.count(e) > 1})
        if dup:
            raise HotExpertsError(f"{src}: layer {layer} lists expert(s) {dup} more than once")
        if len(ids) != n:
            raise HotExpertsError(
                f"{src}: layer {layer} lists {len(ids)} hot experts but the plan keeps {n} per MoE layer "
                f"(--gpu-experts): pass --gpu-experts {len(ids)}, or write the file again with "
                f"`moesplit hot-experts --top {n}`")
    rest = [layer for layer in moe if layer not in spec.ids]
    picked, _ = top_experts(spec.counts, n, rest, E, source=src) if rest else ({}, [])
    return {layer: sorted(spec.ids[layer] if layer in spec.ids else picked[layer]) for layer in moe}


# ---- `moesplit hot-experts` ----------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--metrics", action="append", required=True, metavar="URL",
                   help="an expert shard's metrics endpoint (http://host:port/metrics or host:port); "
                        "repeat for every shard and replica: their counts are summed")
    p.add_argument("--top", type=int, required=True, metavar="N",
                   help="hot experts per MoE layer (the --gpu-experts the plan will use)")
    p.add_argument("-o", "--out", required=True, metavar="FILE", help="JSON file for --hot-experts")
    p.add_argument("--model", default=None, metavar="DIR|CONFIG|PRESET",
                   help="check the counts against this model and cover all its MoE layers (recommended)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per scrape (default %(default)s)")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="moesplit hot-experts: %(message)s")
    try:
        if args.top < 0:
            raise HotExpertsError(f"--top must be >= 0, got {args.top}")
        counts = scrape_counts(args.metrics, args.timeout)
        layers = n_experts = None
        if args.model:
            from gpu_service.plan import load_model_config

            cfg, _ = load_model_config(args.model)
            layers, n_experts = cfg.moe_layers, cfg.n_routed_experts
            resolve(HotExpertsSpec({}, counts, "the scraped counts"), cfg, args.top)  # checks layers / ids
        hot, fallback = top_experts(counts, args.top, layers, n_experts, source="the scraped counts")
    except (HotExpertsError, ValueError) as e:
        print(f"moesplit hot-experts: {e}", file=sys.stderr)
        return 2
    doc = {str(layer): ids for layer, ids in hot.items()}
    doc["top"] = args.top
    doc["metrics"] = [metrics_url(u) for u in args.metrics]
    doc["counts"] = {str(layer): {str(e): n for e, n in sorted(row.items())} for layer, row in sorted(counts.items())}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    routings = sum(sum(row.values()) for row in counts.values())
    print(f"wrote {args.out}: top {args.top} experts of {len(hot)} MoE layers from {routings} routings "
          f"({len(args.metrics)} metrics endpoint(s)); layers without counts: {compact_ranges(fallback) or 'none'}")
    return 0
