"""The memory plan: `make_plan` places every item on the GPUs and CPU shards and searches the auto options.

Nothing is allocated: non-routed weights, KV cache, workspace and hot experts go on the GPUs given,
routed experts on CPU shards; the byte model of each item is in `gpu_service.plan.bytes`.

Auto search, in order of least harm (explicit options are never changed)
------------------------------------------------------------------------
KV target = kv_tokens if given else 65536 (a target: auto shrinks it only when needed, never
below min_kv_tokens; pass min_kv_tokens = kv_tokens to pin it). At the target, with gpu_experts
= 0 when auto:
  1. layer split across all GPUs given: contiguous layer ranges, balanced by bytes (maximin free
     bytes); embeddings on the first GPU, final norm + lm_head on the last — always done;
  2. embeddings on the CPU (only lm_head stays on the GPU);
  3. weight-only quantised attention/indexer/shared-expert/dense linears: fp8 for an FP8
     checkpoint (its stored format: no loss), int8 per-channel otherwise (best accuracy at 1 B);
     then embeddings back on the GPU if that fits;
  4. fewer KV tokens (binary search, multiples of 256, >= min_kv_tokens);
  5. gpu_experts auto = as many hot experts per MoE layer as fit in what is left after 1-4.
expert_format auto: the checkpoint's INT4 for INT4 checkpoints; otherwise the most precise of
bf16, int8, int4 whose shards fit --host-ram (int8 when --host-ram is not given).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

from checkpoint.config import ModelConfig
from checkpoint.config_v4 import V4Config
from checkpoint.names import slice_range
from gpu_service.plan.arch import arch_bytes, kv_bytes_per_token, param_counts
from gpu_service.plan.bytes import (
    ATTENTION_WEIGHTS, DEFAULT_CHUNK_TOKENS, DEFAULT_KV_TARGET, DEFAULT_MAX_BATCH,
    DEFAULT_MIN_KV_TOKENS, EMBEDDINGS, expert_bytes, EXPERT_FORMATS, fmt_gib, GiB,
    gpu_reserve, GPU_SERVICE_HOST_BYTES, HOST_OS_RESERVE_BYTES, KV_ROUND,
    module_bytes, Options, parse_size, SHARD_BASELINE_BYTES, dtype_bytes,
    checkpoint_format, qlinear_scratch_bytes,
)
from gpu_service.plan.host_tier import host_kv_fields
from gpu_service.plan.report import render_table
from gpu_service.plan.vision import vision_bytes


@dataclass
class GpuPlan:
    device: str
    capacity_bytes: int
    layers: list[int]
    items: dict[str, int]
    embeddings: bool
    lm_head: bool

    @property
    def used_bytes(self) -> int:
        return sum(self.items.values())

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def to_json(self) -> dict:
        return {"device": self.device, "capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                "free_bytes": self.free_bytes, "items": dict(self.items), "layers": list(self.layers),
                "embeddings": self.embeddings, "lm_head": self.lm_head}


@dataclass
class ShardPlan:
    index: int
    numa_node: int
    weight_bytes: int
    ram_bytes: int
    slice: tuple[int, int] | None = None  # (i, n): intermediate slice i of n
    experts: tuple[int, int] | None = None  # [a, b) routed expert ids

    def to_json(self) -> dict:
        d: dict[str, Any] = {"index": self.index, "numa_node": self.numa_node}
        if self.slice is not None:
            d["slice"] = list(self.slice)
        else:
            d["experts"] = list(self.experts)
        d.update(weight_bytes=self.weight_bytes, ram_bytes=self.ram_bytes)
        return d


@dataclass
class Plan:
    model: str
    cfg: ModelConfig | V4Config
    options: Options
    gpus: list[GpuPlan]
    shards: list[ShardPlan]
    host: dict[str, Any]
    choices: list[str]
    suggestions: list[dict] = field(default_factory=list)

    @property
    def gpus_fit(self) -> bool:
        return all(g.free_bytes >= 0 for g in self.gpus)

    @property
    def fits(self) -> bool:
        return self.gpus_fit and self.host["fits"]

    @property
    def kv_tokens(self) -> int:
        return self.options.kv_tokens

    @property
    def missing_bytes(self) -> int:
        """GPU overflow summed over GPUs plus host RAM shortfall (0 when it fits)."""
        return sum(max(0, -g.free_bytes) for g in self.gpus) + self.host.get("missing_bytes", 0)

    def to_json(self) -> dict:
        c = param_counts(self.cfg)
        d: dict[str, Any] = {
            "model": self.model,
            "fits": self.fits,
            "kv_tokens": self.options.kv_tokens,
            "gpus": [g.to_json() for g in self.gpus],
            "shards": [s.to_json() for s in self.shards],
            "host": dict(self.host),
            "choices": list(self.choices),
            "options": {k: getattr(self.options, k) for k in self.options.__dataclass_fields__},
            "param_counts": c,
            "kv_bytes_per_token": kv_bytes_per_token(self.cfg, self.options.eb),
            "fingerprint": self.cfg.fingerprint(),
        }
        vb = vision_bytes(self.cfg, self.options.eb) if not self.cfg.is_v4 else None
        if vb:
            d["vision"] = vb
        if not self.fits:
            d["missing_bytes"] = self.missing_bytes
            d["suggestions"] = list(self.suggestions)
        return d

    def table(self) -> str:
        return render_table(self)


# --------------------------------------------------------------------------------- layout
class _Layout:
    """Per-layer and fixed byte costs for one set of options; splits layers across GPUs."""

    def __init__(self, cfg: ModelConfig, o: Options, capacities: list[int]):
        self.cfg, self.o, self.caps = cfg, o, capacities
        self.arch = A = arch_bytes(cfg)
        L = cfg.num_hidden_layers
        self.layer_items: list[dict[str, int]] = [dict() for _ in range(L)]
        self.fixed: dict[str, int] = {}  # category -> bytes of the modules outside the layers
        self.layer_scratch = [0] * L  # the largest quantised linear's dequantisation scratch per layer
        for m in A.gpu_modules(cfg):
            b = module_bytes(cfg, m, o.attention_weights, o.eb)
            if m.layer is None:
                self.fixed[m.category] = self.fixed.get(m.category, 0) + b
            else:
                it = self.layer_items[m.layer]
                it[m.category] = it.get(m.category, 0) + b
                for lname, out, inp in m.linears:
                    fmt = checkpoint_format(cfg, lname) if o.attention_weights == "checkpoint" else o.attention_weights
                    self.layer_scratch[m.layer] = max(self.layer_scratch[m.layer],
                                                      qlinear_scratch_bytes(out, inp, fmt, o.eb))
        hfmt = A.hot_format(cfg, o.expert_format)  # V4 FP8-expert checkpoints: fp8 as stored
        hot = o.gpu_experts * expert_bytes(cfg, hfmt, eb=o.eb)
        for i in range(L):
            self.layer_items[i].update(A.kv_layer_items(cfg, i, o))  # the pool (+ its null slot), per layer
            if cfg.is_moe_layer(i) and hot:
                self.layer_items[i]["gpu_experts"] = hot
                I, H = cfg.moe_intermediate_size, cfg.hidden_size
                self.layer_scratch[i] = max(self.layer_scratch[i], qlinear_scratch_bytes(I, H, hfmt, o.eb),
                                            qlinear_scratch_bytes(H, I, hfmt, o.eb))
        self.layer_total = [sum(it.values()) for it in self.layer_items]
        self.prefix = [0]
        for b in self.layer_total:
            self.prefix.append(self.prefix[-1] + b)
        self.dense_prefix = [0]
        for i in range(L):
            self.dense_prefix.append(self.dense_prefix[-1] + (0 if cfg.is_moe_layer(i) else 1))
        moe_w = cfg.n_shared_experts * cfg.moe_intermediate_size
        if o.gpu_experts:
            moe_w = max(moe_w, cfg.moe_intermediate_size)
        self.moe_width = moe_w
        self.emb = self.fixed["embeddings"] if o.embeddings == "gpu" else 0
        vb = vision_bytes(cfg, o.eb) if not cfg.is_v4 else None
        self.vision = vb["total"] if vb else 0  # Kimi-K2.5's vision tower, on the first GPU
        self.tail = self.fixed["norms"] + self.fixed["lm_head"]
        self.ws_cache: dict[tuple, int] = {}

    def workspace(self, g: int, a: int, b: int) -> int:
        """Workspace of GPU g holding layers [a, b): its widest MLP, lm_head on the last GPU."""
        n_dense = self.dense_prefix[b] - self.dense_prefix[a]
        width = self.cfg.intermediate_size if n_dense else 0
        if n_dense < b - a:
            width = max(width, self.moe_width)
        k = (width, g == len(self.caps) - 1, max(self.layer_scratch[a:b], default=0), b - a)
        if k not in self.ws_cache:
            self.ws_cache[k] = self.arch.workspace(self.cfg, self.o, mlp_width=k[0], lm_head=k[1], scratch=k[2],
                                                   layers=k[3])
        return self.ws_cache[k]

    def used(self, g: int, a: int, b: int) -> int:
        """Bytes on GPU g holding layers [a, b)."""
        G = len(self.caps)
        u = self.prefix[b] - self.prefix[a] + self.workspace(g, a, b) + gpu_reserve(self.caps[g])
        if g == 0:
            u += self.emb + self.vision
        if g == G - 1:
            u += self.tail
        return u

    def split(self) -> list[int]:
        """Boundaries [0, b1, ..., L] maximising the smallest free bytes over GPUs (contiguous)."""
        L, G = self.cfg.num_hidden_layers, len(self.caps)
        if G == 1:
            return [0, L]
        NEG = -(1 << 62)
        # best[g][j]: max over splits of layers [0, j) onto GPUs 0..g-1 of min free; arg for backtrack
        best = [[NEG] * (L + 1) for _ in range(G + 1)]
        arg = [[0] * (L + 1) for _ in range(G + 1)]
        best[0][0] = 1 << 62
        for g in range(1, G + 1):
            cap = self.caps[g - 1]
            for j in range(g, L - (G - g) + 1):
                bv, ba = NEG, 0
                for i in range(g - 1, j):
                    prev = best[g - 1][i]
                    if prev <= bv:
                        continue
                    v = min(prev, cap - self.used(g - 1, i, j))
                    if v > bv:
                        bv, ba = v, i
                best[g][j], arg[g][j] = bv, ba
        bounds = [L]
        j = L
        for g in range(G, 0, -1):
            j = arg[g][j]
            bounds.append(j)
        return bounds[::-1]

    def min_free(self) -> int:
        b = self.split()
        return min(self.caps[g] - self.used(g, b[g], b[g + 1]) for g in range(len(self.caps)))

    def gpu_plans(self) -> list[GpuPlan]:
        b = self.split()
        G = len(self.caps)
        out = []
        for g in range(G):
            items = {c: 0 for c in self.arch.categories(self.cfg)}
            for i in range(b[g], b[g + 1]):
                for k, v in self.layer_items[i].items():
                    items[k] += v
            if g == 0:
                items["embeddings"] = self.emb
                if "vision" in items:
                    items["vision"] = self.vision
            if g == G - 1:
                items["lm_head"] = self.fixed["lm_head"]
                items["norms"] += self.fixed["norms"]
            items["workspace"] = self.workspace(g, b[g], b[g + 1])
            items["reserve"] = gpu_reserve(self.caps[g])
            out.append(GpuPlan(f"cuda:{g}", self.caps[g], list(range(b[g], b[g + 1])), items,
                               embeddings=(g == 0 and self.o.embeddings == "gpu"), lm_head=(g == G - 1)))
        assert sum(self.caps[g] - p.free_bytes for g, p in enumerate(out)) == sum(p.used_bytes for p in out)
        return out


def _fits_gpus(cfg: ModelConfig, o: Options, caps: list[int]) -> bool:
    return _Layout(cfg, o, caps).min_free() >= 0


# ----------------------------------------------------------------------------- CPU shards
def shard_plans(cfg: ModelConfig, fmt: str, numa_nodes: int, chunk_tokens: int,
                split: str = "slice") -> list[ShardPlan]:
    """One shard per NUMA node: an intermediate slice of every expert (split="slice") or a
    contiguous range of experts (split="experts"), for every MoE layer."""
    n, I, E, H = numa_nodes, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.hidden_size
    T, k, nl = chunk_tokens, cfg.num_experts_per_tok, len(cfg.moe_layers)
    out = []
    for s in range(n):
        if split == "slice":
            i0, i1 = slice_range(I, s, n)  # as the shard loads it
            I_s = i1 - i0
            w = nl * E * expert_bytes(cfg, fmt, I_s, host=True)
            ident: dict[str, Any] = {"slice": (s, n)}
        elif split == "experts":
            a, b = s * E // n, (s + 1) * E // n
            I_s = I
            w = nl * (b - a) * expert_bytes(cfg, fmt, host=True)
            ident = {"experts": (a, b)}
        else:
            raise ValueError(f"shard split {split!r}: expected 'slice' or 'experts'")
        buf = 4 * (2 * T * H + T * k * (H + 3 * I_s))
        out.append(ShardPlan(index=s, numa_node=s, weight_bytes=w, ram_bytes=w + buf + SHARD_BASELINE_BYTES, **ident))
    return out


def host_summary(cfg: ModelConfig, shards: list[ShardPlan], embeddings: str, host_ram: int | None) -> dict:
    emb_cpu = 2 * cfg.vocab_size * cfg.hidden_size if embeddings == "cpu" else 0
    req = sum(s.ram_bytes for s in shards) + GPU_SERVICE_HOST_BYTES + emb_cpu + HOST_OS_RESERVE_BYTES
    d: dict[str, Any] = {"capacity_bytes": host_ram, "shards_bytes": sum(s.ram_bytes for s in shards),
                         "gpu_service_bytes": GPU_SERVICE_HOST_BYTES + emb_cpu,
                         "os_reserve_bytes": HOST_OS_RESERVE_BYTES, "required_bytes": req,
                         "fits": host_ram is None or req <= host_ram}
    if host_ram is not None and req > host_ram:
        d["missing_bytes"] = req - host_ram
    return d


# ------------------------------------------------------------------------------ make_plan
def _quant_choice(cfg: ModelConfig) -> str:
    return "fp8" if cfg.quantization is not None and cfg.quantization.method == "fp8" else "int8"


def _check_plan_args(cfg: ModelConfig, caps: list[int], gpus, attention_weights: str, embeddings: str,
                     gpu_experts: int | str, expert_format: str, numa_nodes: int, chunk_tokens: int,
                     max_batch: int, dtype: str, kv_tokens: int | None) -> None:
    """make_plan's arguments checked up front: a ValueError naming the bad value and what is expected."""
    if not caps:
        raise ValueError("no GPU given; pass at least one --gpu SIZE (e.g. --gpu 24GiB)")
    if any(c <= 0 for c in caps):
        raise ValueError(f"GPU capacities must be positive, got {gpus}")
    if len(caps) > cfg.num_hidden_layers:
        raise ValueError(f"{len(caps)} GPUs for {cfg.num_hidden_layers} layers; give at most one GPU per layer")
    if attention_weights not in ATTENTION_WEIGHTS:
        raise ValueError(f"attention_weights {attention_weights!r}: expected one of {ATTENTION_WEIGHTS}")
    if embeddings not in EMBEDDINGS:
        raise ValueError(f"embeddings {embeddings!r}: expected one of {EMBEDDINGS}")
    if expert_format not in EXPERT_FORMATS:
        raise ValueError(f"expert_format {expert_format!r}: expected one of {EXPERT_FORMATS}")
    if expert_format == "mxfp4" and arch_bytes(cfg).native_expert_format(cfg) != "mxfp4":
        raise ValueError("expert_format 'mxfp4' keeps a DeepSeek-V4 checkpoint's MXFP4 experts as stored; this "
                         "model's experts are not MXFP4: use auto, bf16, int8 or int4")
    if gpu_experts != "auto" and (not isinstance(gpu_experts, int) or not 0 <= gpu_experts <= cfg.n_routed_experts):
        raise ValueError(f"gpu_experts {gpu_experts!r}: expected 'auto' or an int in [0, {cfg.n_routed_experts}]")
    if numa_nodes < 1:
        raise ValueError(f"numa_nodes must be >= 1, got {numa_nodes}")
    if chunk_tokens < 1 or max_batch < 1 or chunk_tokens < max_batch:
        raise ValueError(f"need chunk_tokens >= max_batch >= 1, got chunk_tokens={chunk_tokens} max_batch={max_batch}")
    dtype_bytes(dtype)  # ValueError naming the choices
    if kv_tokens is not None and kv_tokens < 1:
        raise ValueError(f"kv_tokens must be positive, got {kv_tokens}")


def _expert_format(cfg: ModelConfig, expert_format: str, host: int | None, numa_nodes: int, chunk_tokens: int,
                   shard_split: str, choices: list[str]) -> str:
    """The CPU shards' expert format (also the hot experts' format on the GPU); "auto": the checkpoint's
    int4, else int8 without --host-ram, else the most precise whose shards fit the host. Appends the why."""
    if expert_format != "auto":
        return expert_format
    native = arch_bytes(cfg).native_expert_format(cfg)
    if native is not None:
        choices.append(f"expert format {native}: the checkpoint's own format (lossless)")
        return native
    if host is None:
        choices.append("expert format int8: no --host-ram given; 1 B/param with per-channel scales")
        return "int8"
    efmt = "int4"
    for f in ("bf16", "int8", "int4"):
        if host_summary(cfg, shard_plans(cfg, f, numa_nodes, chunk_tokens, shard_split), "cpu", host)["fits"]:
            efmt = f
            break
    choices.append(f"expert format {efmt}: the most precise of bf16/int8/int4 whose shards fit "
                   f"--host-ram {fmt_gib(host)}")
    return efmt


def _most_kv(fits: Callable[[int], bool], floor: int, target: int) -> int | None:
    """The most KV tokens in [floor, target] (multiples of KV_ROUND above the floor) for which `fits`
    holds, by bisection; None when even `floor` does not fit."""
    if not fits(floor):
        return None
    lo, hi = floor // KV_ROUND, target // KV_ROUND  # search multiples of KV_ROUND
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if mid * KV_ROUND > floor and fits(mid * KV_ROUND):
            lo = mid
        else:
            hi = mid - 1
    return max(floor, lo * KV_ROUND)


def _most_gpu_experts(fits: Callable[[int], bool], n_routed: int) -> int:
    """The most hot experts per MoE layer in [0, n_routed] for which `fits` holds (0 when none does)."""
    lo, hi = 0, n_routed
    if not fits(0):
        hi = 0
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _gpu_stage(cfg: ModelConfig, caps: list[int], opts: Callable[[str, str, int, int], Options],
               attention_weights: str, embeddings: str, kv_tokens: int | None, min_kv_tokens: int, n_exp: int,
               choices: list[str]) -> tuple[str, str, int]:
    """(attention weights, embeddings, KV tokens): the first stage of least harm that fits the KV
    target, else the last stage with the most KV tokens that fit; appends the why."""
    target = kv_tokens if kv_tokens is not None else DEFAULT_KV_TARGET
    floor = min(min_kv_tokens, target)
    quant = _quant_choice(cfg)
    emb_opts = [embeddings] if embeddings != "auto" else ["gpu", "cpu"]
    aw_opts = [attention_weights] if attention_weights != "auto" else (
        ["checkpoint"] if quant == "fp8" and cfg.quantization is not None else ["checkpoint", quant])
    stages = [(a, e) for a in aw_opts for e in emb_opts]
    chosen = next(((a, e, target) for a, e in stages if _fits_gpus(cfg, opts(a, e, target, n_exp), caps)), None)
    if chosen is None:
        a, e = stages[-1]
        best = _most_kv(lambda kv: _fits_gpus(cfg, opts(a, e, kv, n_exp), caps), floor, target)
        chosen = (a, e, best if best is not None else floor)
        if best is not None and best < target:
            choices.append(f"kv tokens {best}: the most that fits (target {target}, minimum {floor})")
        elif best is None:
            choices.append(f"kv tokens {floor}: the minimum (--min-kv-tokens); even so the GPUs are too small")
    a, e, kv = chosen
    if kv == target:
        choices.append(f"kv tokens {kv}: the target ({'--kv-tokens' if kv_tokens is not None else 'default'})")
    if attention_weights == "auto":
        if a == "checkpoint":
            choices.append("attention weights checkpoint: " + (
                "the checkpoint's FP8 blocks as stored (1 B/param)" if quant == "fp8" and cfg.quantization
                else "as stored, no re-quantisation needed to fit"))
        else:
            choices.append(f"attention weights {a}: weight-only {a} for attention, shared experts and dense MLP, "
                           "because checkpoint precision does not fit")
    if embeddings == "auto":
        choices.append("embeddings gpu: they fit" if e == "gpu" else
                       "embeddings cpu: the GPU cannot hold them (only lm_head stays on the GPU)")
    return chosen


def make_plan(cfg: ModelConfig, gpus: list[int | str], host_ram: int | str | None = None, numa_nodes: int = 1,
              kv_tokens: int | None = None, min_kv_tokens: int = DEFAULT_MIN_KV_TOKENS,
              chunk_tokens: int = DEFAULT_CHUNK_TOKENS, attention_weights: str = "auto",
              embeddings: str = "auto", gpu_experts: int | str = "auto", expert_format: str = "auto",
              max_batch: int = DEFAULT_MAX_BATCH, shard_split: str = "slice", model: str | None = None,
              suggest: bool = True, dtype: str = "bfloat16", host_kv_cache: int | str | None = "auto") -> Plan:
    """Plan GPU and CPU memory for `cfg` on GPUs of the given capacities (bytes or "24GiB"); "auto"
    options are searched in order of least harm. A plan that does not fit carries `suggestions` of
    changes that do (each re-planned)."""
    caps = [parse_size(g) for g in gpus]
    host = parse_size(host_ram) if host_ram is not None else None
    _check_plan_args(cfg, caps, gpus, attention_weights, embeddings, gpu_experts, expert_format, numa_nodes,
                     chunk_tokens, max_batch, dtype, kv_tokens)
    name = model or cfg.model_type
    choices: list[str] = []
    efmt = _expert_format(cfg, expert_format, host, numa_nodes, chunk_tokens, shard_split, choices)
    n_exp = 0 if gpu_experts == "auto" else gpu_experts

    def opts(a: str, e: str, kv: int, x: int) -> Options:
        """The options under search with the searched ones filled in."""
        return Options(a, e, efmt, x, kv, chunk_tokens, max_batch, dtype)

    a, e, kv = _gpu_stage(cfg, caps, opts, attention_weights, embeddings, kv_tokens, min_kv_tokens, n_exp, choices)
    if len(caps) > 1:
        choices.append(f"layers split over {len(caps)} GPUs in contiguous ranges balanced by free bytes")
    if gpu_experts == "auto":
        n_exp = _most_gpu_experts(lambda x: _fits_gpus(cfg, opts(a, e, kv, x), caps), cfg.n_routed_experts)
        hfmt = arch_bytes(cfg).hot_format(cfg, efmt)
        choices.append(f"gpu experts {n_exp} per MoE layer: as many hot {hfmt} experts as fit after the KV cache"
                       + (" (the checkpoint's FP8 experts as stored)" if hfmt != efmt else ""))

    o = opts(a, e, kv, n_exp)
    layout = _Layout(cfg, o, caps)
    shards = shard_plans(cfg, efmt, numa_nodes, chunk_tokens, shard_split)
    host_d = host_summary(cfg, shards, e, host)
    host_d.update(host_kv_fields(cfg, host_d, host_kv_cache))
    plan = Plan(name, cfg, o, layout.gpu_plans(), shards, host_d, choices)
    if not plan.fits and suggest:
        plan.suggestions = _suggestions(cfg, dict(gpus=caps, host_ram=host, numa_nodes=numa_nodes, kv_tokens=kv_tokens,
                                                  min_kv_tokens=min_kv_tokens, chunk_tokens=chunk_tokens,
                                                  attention_weights=attention_weights, embeddings=embeddings,
                                                  gpu_experts=gpu_experts, expert_format=expert_format,
                                                  max_batch=max_batch, shard_split=shard_split, dtype=dtype), plan)
    return plan


_STD_GPU_GIB = (8, 12, 16, 20, 24, 32, 40, 48, 80, 96, 141)


def _size_arg(n: int) -> str:
    return f"{n // GiB}GiB" if n % GiB == 0 else f"{n / GiB:.2f}GiB"


def _suggestions(cfg: ModelConfig, kw: dict, failed: Plan) -> list[dict]:
    """Changed options that fit, each verified by planning again; least harmful first."""
    cands: list[tuple[str, dict]] = []
    quant = _quant_choice(cfg)
    gpus_fail = not failed.gpus_fit
    if gpus_fail:
        if kw["embeddings"] == "gpu":
            cands.append(("--embeddings cpu", {"embeddings": "cpu"}))
        fp8_ckpt = cfg.quantization is not None and cfg.quantization.method == "fp8"
        if kw["attention_weights"] not in ("auto", quant) and not (kw["attention_weights"] == "checkpoint" and fp8_ckpt):
            cands.append((f"--attention-weights {quant}", {"attention_weights": quant}))
        if kw["gpu_experts"] not in ("auto", 0):
            cands.append(("--gpu-experts 0", {"gpu_experts": 0}))
        explicit = {k: v for k, v in (("embeddings", "auto"), ("attention_weights", "auto"), ("gpu_experts", "auto"))
                    if kw[k] != "auto"}
        if len(explicit) > 1:
            cands.append((" ".join(f"--{k.replace('_', '-')} auto" for k in explicit), explicit))
        for m in (2048, 1024):
            if m < min(kw["min_kv_tokens"], kw["kv_tokens"] or DEFAULT_KV_TARGET):
                cands.append((f"--min-kv-tokens {m}", {"min_kv_tokens": m}))
        for c in (1024, 512):
            if c < kw["chunk_tokens"] and c >= kw["max_batch"]:
                cands.append((f"--chunk-tokens {c}", {"chunk_tokens": c}))
        g = kw["gpus"]
        if len(g) < cfg.num_hidden_layers:
            cands.append((" ".join(f"--gpu {_size_arg(x)}" for x in g + [g[-1]]), {"gpus": g + [g[-1]]}))
        for s in _STD_GPU_GIB:
            if s * GiB > max(g):
                if make_plan(cfg, **{**kw, "gpus": [s * GiB] * len(g), "suggest": False}).gpus_fit:
                    cands.append((" ".join(f"--gpu {s}GiB" for _ in g), {"gpus": [s * GiB] * len(g)}))
                    break
    if not failed.host["fits"]:
        for f in ("int8", "int4"):
            if kw["expert_format"] != f and (kw["expert_format"] != "auto" or f == "int4"):
                cands.append((f"--expert-format {f}", {"expert_format": f}))
        need = failed.host["required_bytes"]
        cands.append((f"--host-ram {math.ceil(need / (64 * GiB)) * 64}GiB",
                       {"host_ram": math.ceil(need / (64 * GiB)) * 64 * GiB}))
    out = []
    for args, change in cands:
        p = make_plan(cfg, **{**kw, **change, "suggest": False})
        if p.fits:
            out.append({"args": args, "change": {k: v for k, v in change.items()}, "kv_tokens": p.kv_tokens,
                        "gpu_experts": p.options.gpu_experts,
                        "gpu_used_bytes": [x.used_bytes for x in p.gpus],
                        "gpu_capacity_bytes": [x.capacity_bytes for x in p.gpus]})
    return out
