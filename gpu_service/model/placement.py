"""Executing a memory plan: which device holds each parameter, in which format, and the
pre-load check against the memory actually free.

`Placement.from_plan` turns a `plan.Plan` into a layer -> GPU map (hidden states hop between
GPUs; no NCCL), embeddings on the CPU when the plan says so, weight-only FP8/INT8 linears, the
KV pool size and the GPU-resident hot experts. `preflight` compares the plan with
`torch.cuda.mem_get_info` before anything is allocated and refuses with the plan table, the
missing GiB and the options that would fit.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch

from checkpoint.config import ModelConfig

# linears that the attention-weights option quantises (attention, V3.2 indexer projections,
# shared experts, dense MLP) — the same set the planner counts as quantisable
_QUANTISABLE = re.compile(
    r"model\.layers\.\d+\.(self_attn\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj"
    r"|indexer\.wq_b|indexer\.wk)|mlp\.shared_experts\.(gate|up|down)_proj|mlp\.(gate|up|down)_proj)\.weight$")
_HOT_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")


class PlanDoesNotFit(RuntimeError):
    """The plan needs more GPU memory than is free; the message has the table and the options."""


@dataclass
class Placement:
    cfg: ModelConfig
    devices: list[torch.device]  # one per planned GPU (on a CPU-only machine: cpu, repeated)
    layer_gpu: list[int]  # layer -> index into devices
    embeddings_on_cpu: bool = False
    attention_weights: str = "checkpoint"  # checkpoint|bf16|fp8|int8
    expert_format: str = "bf16"  # format of GPU-resident hot experts
    kv_tokens: int = 4096
    hot_experts: dict[int, list[int]] = field(default_factory=dict)  # layer -> expert ids on the GPU
    plan: object = None  # the plan.Plan this placement executes (for planned-vs-actual metrics)
    chunk_tokens: int = 2048  # tokens per forward step the workspace was planned for

    @property
    def key_block(self) -> int:
        """Keys per block of the expanded prefill attention: the plan's Kb = min(kv_tokens, chunk_tokens)."""
        return max(1, min(self.kv_tokens, self.chunk_tokens))

    @staticmethod
    def single(cfg: ModelConfig, device: torch.device, kv_tokens: int = 4096) -> "Placement":
        return Placement(cfg, [device], [0] * cfg.num_hidden_layers, kv_tokens=kv_tokens)

    @staticmethod
    def from_plan(plan, devices: list[torch.device] | None = None,
                  hot_experts: dict[int, list[int]] | None = None) -> "Placement":
        cfg, o = plan.cfg, plan.options
        if devices is None:
            n = torch.cuda.device_count()
            if n < len(plan.gpus):
                raise PlanDoesNotFit(f"the plan uses {len(plan.gpus)} GPUs but {n} are visible")
            devices = [torch.device("cuda", i) for i in range(len(plan.gpus))]
        layer_gpu = [0] * cfg.num_hidden_layers
        for g, gp in enumerate(plan.gpus):
            for layer in gp.layers:
                layer_gpu[layer] = g
        if hot_experts is None:
            # Without activation statistics the hot set is the first N experts of each layer;
            # pass `hot_experts` (gpu_service.plan.hot_experts: the shards' activation counts) to choose better.
            hot_experts = {layer: list(range(o.gpu_experts)) for layer in cfg.moe_layers} if o.gpu_experts else {}
        elif o.gpu_experts or hot_experts:
            from gpu_service.plan.hot_experts import resolve

            hot_experts = resolve(hot_experts, cfg, o.gpu_experts)  # checked against the plan, every MoE layer
        from gpu_service.plan.arch import hot_expert_format

        return Placement(cfg, list(devices), layer_gpu, o.embeddings == "cpu", o.attention_weights,
                         hot_expert_format(cfg, o.expert_format), o.kv_tokens, hot_experts, plan, o.chunk_tokens)

    # ---- per-parameter decisions ---------------------------------------------------------------
    def gpu_index_of(self, param_name: str) -> int:
        """Index into `devices` of the GPU holding this parameter; -1 for the CPU. DeepSeek-V4's
        checkpoint names too (`layers.N.`, `embed.`; its `norm`, `hc_head_*` and `head` go last)."""
        if param_name.startswith(("model.layers.", "layers.")):
            return self.layer_gpu[int(param_name.split(".")[1 if param_name.startswith("layers.") else 2])]
        if param_name.startswith(("model.embed_tokens", "embed.")):
            return -1 if self.embeddings_on_cpu else 0
        return len(self.devices) - 1  # final norm and lm_head

    def device_of(self, param_name: str) -> torch.device:
        g = self.gpu_index_of(param_name)
        return torch.device("cpu") if g < 0 else self.devices[g]

    @property
    def layer_devices(self) -> list[torch.device]:
        return [self.devices[g] for g in self.layer_gpu]

    def linear_format(self, param_name: str) -> str | None:
        """"fp8"/"int8"/"int4" for a weight held quantised, None for the compute dtype."""
        if _HOT_EXPERT.match(param_name):
            return None if self.expert_format == "bf16" else self.expert_format
        if not _QUANTISABLE.match(param_name):
            return None
        aw = self.attention_weights
        if aw == "checkpoint":
            q = self.cfg.quantization
            return "fp8" if q is not None and q.method == "fp8" else None
        return None if aw == "bf16" else aw


def placed_bytes(model: torch.nn.Module, placement: Placement, pool=None):
    """(name, planned GPU index (-1 = CPU), bytes) of every parameter and buffer, then ("kv_cache" /
    "index_keys", GPU index, bytes) of each layer's KV pool tensors, by the placement's map."""
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        yield name, placement.gpu_index_of(name), t.numel() * t.element_size()
    if pool is not None:
        for cat, per_layer in (("kv_cache", pool.kv), ("index_keys", getattr(pool, "index_k", None) or [])):
            for layer, t in enumerate(per_layer):
                yield cat, placement.layer_gpu[layer], t.numel() * t.element_size()


def allocated_bytes_by_gpu(model: torch.nn.Module, placement: Placement, pool=None) -> dict[int, int]:
    """Bytes of parameters and buffers (and the KV pool) per planned GPU index (-1 = CPU) — on a
    CPU-only machine this still tells each planned device's share."""
    out: dict[int, int] = {}
    for _, g, b in placed_bytes(model, placement, pool):
        out[g] = out.get(g, 0) + b
    return out


def plan_devices(plan, device: torch.device | None = None) -> list[torch.device]:
    """cuda:N, cuda:N+1, ... for the plan's GPUs (N from `--device cuda:N`); PlanDoesNotFit when fewer
    are visible, never a raw "invalid device ordinal"."""
    first = device.index if device is not None and device.type == "cuda" and device.index is not None else 0
    n = torch.cuda.device_count()
    want = len(plan.gpus)
    if first + want > n:
        start = f" from cuda:{first}" if first else ""
        raise PlanDoesNotFit(f"the plan uses {want} GPU{'s' if want > 1 else ''}{start} but {n} "
                             f"{'is' if n == 1 else 'are'} visible: give one --gpu per GPU you have "
                             f"(or --device cuda:0), or make more GPUs visible (CUDA_VISIBLE_DEVICES)")
    return [torch.device("cuda", first + i) for i in range(want)]


def preflight(plan, plan_kwargs: dict | None = None, devices: list[torch.device] | None = None) -> None:
    """Before allocating: each planned GPU's bytes (less the CUDA context) must be free now on its
    device; else PlanDoesNotFit with the table, the missing GiB and re-planned options."""
    if not torch.cuda.is_available():
        return
    from gpu_service import plan as P

    devices = devices if devices is not None else plan_devices(plan)
    short = []
    free = []
    for dev, g in zip(devices, plan.gpus):
        f, total = torch.cuda.mem_get_info(dev)
        need = g.used_bytes - P.CUDA_CONTEXT_BYTES  # the context exists once mem_get_info has run
        free.append(f)
        if need > f:
            short.append((dev.index, need - f, f, total))
    if not short and plan.fits:
        return
    lines = [plan.table(), ""]
    for i, miss, f, total in short:
        lines.append(f"GPU {i}: {P.fmt_gib(miss)} missing ({P.fmt_gib(f)} free of {P.fmt_gib(total)})")
    if plan_kwargs is not None:
        alt = P.make_plan(plan.cfg, [f + P.gpu_reserve(f) for f in free], **plan_kwargs)
        if alt.fits:
            lines.append("would fit with the memory free now: " + "; ".join(alt.choices))
        for s in alt.suggestions or plan.suggestions:
            lines.append(f"would fit: {s.get('args') or s.get('change')}")
    raise PlanDoesNotFit("\n".join(lines))


# ---- command-line wiring (generate / serve / gpu-server) ------------------------------------------
def add_device_arguments(p) -> None:
    """--device, --dtype and --no-cuda-graphs (the serving commands and generate)."""
    p.add_argument("--device", default=None, help="cuda|cpu (default: cuda when available)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="compute dtype (default: bfloat16 on CUDA, float32 on CPU)")
    p.add_argument("--no-cuda-graphs", dest="cuda_graphs", action="store_false",
                   help="run decode steps eagerly (default on CUDA: each layer's decode segments replayed as "
                        "CUDA graphs per batch-size bucket)")


def add_plan_arguments(p) -> None:
    """The memory-plan options of the serving commands (see `moesplit plan`)."""
    p.add_argument("--gpu", action="append", default=None, metavar="SIZE",
                   help="plan for GPUs of these total sizes (repeat per GPU; default: the visible CUDA devices; "
                        "on a CPU-only machine no plan is made unless given)")
    p.add_argument("--attention-weights", choices=["auto", "checkpoint", "bf16", "fp8", "int8"], default="auto",
                   help="precision of attention / shared-expert / dense linears on the GPU")
    p.add_argument("--embeddings", choices=["auto", "gpu", "cpu"], default="auto")
    p.add_argument("--gpu-experts", default="0", metavar="N|auto",
                   help="hot routed experts per MoE layer kept and computed on the GPU (default 0)")
    p.add_argument("--min-kv-tokens", type=int, default=None,
                   help="never shrink the KV cache below this when auto-fitting (default: --kv-tokens)")
    p.add_argument("--hot-experts", default=None, metavar="FILE",
                   help="which experts --gpu-experts keeps on the GPU: JSON {\"<layer>\": [ids]} or "
                        "{\"counts\": {\"<layer>\": {\"<expert>\": n}}} (`moesplit hot-experts` writes it from the "
                        "shards' activation counts; default: the lowest ids)")


# memory-plan options a DeepSeek-V4 model uses only when its experts are quantised (its runner keeps hot experts
# as stored: MXFP4 or block FP8): (dest, default, flag); --attention-weights fp8 / int8 are refused by
# V4_ATTENTION_WEIGHTS
V4_PLAN_OPTIONS = (("gpu_experts", "0", "--gpu-experts"), ("hot_experts", None, "--hot-experts"))


def v4_refused_options(args, cfg) -> list[str]:
    """The flags of V4_PLAN_OPTIONS set for a DeepSeek-V4 `cfg` whose routed experts are neither MXFP4 nor
    block FP8 (an unquantised checkpoint: its runner holds hot experts only as stored)."""
    from gpu_service.plan.bytes_v4 import hot_expert_format_v4, native_expert_format_v4, V4_HOT_FORMATS

    hot = hot_expert_format_v4(cfg, native_expert_format_v4(cfg) or "bf16")
    return [] if hot in V4_HOT_FORMATS else options_set(args, V4_PLAN_OPTIONS)
# the attention-weights formats the V4 model executes: its block-FP8 linears as stored, or dequantised
V4_ATTENTION_WEIGHTS = ("auto", "checkpoint", "bf16")


def options_set(args, options) -> list[str]:
    """The flags of `options` ((dest, default, flag) each) that `args` sets away from their defaults."""
    return [flag for dest, default, flag in options if getattr(args, dest, default) != default]


def placement_from_args(args, cfg: ModelConfig, kv_tokens: int, chunk_tokens: int = 2048,
                        max_batch: int = 16, device: torch.device | None = None) -> "Placement | None":
    """Make the plan, refuse before loading if it cannot fit (SystemExit with the table and the
    options that would fit), and return its placement; None when no plan applies (CPU, no --gpu)."""
    from gpu_service import plan as P

    cuda_wanted = device is not None and device.type == "cuda"
    cuda = cuda_wanted or (device is None and torch.cuda.is_available())
    # the compute dtype the runner will use (ModelRunner's default: bf16 on CUDA, fp32 on the CPU)
    dtype = getattr(args, "dtype", None) or ("bfloat16" if cuda else "float32")
    hot_file = getattr(args, "hot_experts", None)
    if not args.gpu and not cuda:  # nothing to plan for
        if hot_file:
            raise SystemExit(f"moesplit: --hot-experts {hot_file} needs a memory plan with hot GPU experts: "
                             "pass --gpu SIZE and --gpu-experts N (without a GPU nothing is kept hot)")
        return None
    spec = None
    if hot_file:  # read and shape-check before planning, so a bad file stops before anything else
        from gpu_service.plan.hot_experts import HotExpertsError, load_file

        try:
            spec = load_file(hot_file)
        except HotExpertsError as e:
            raise SystemExit(f"moesplit: {e}") from None
    if cuda and not args.gpu and not torch.cuda.is_available():
        raise SystemExit(f"moesplit: --device {device} but this machine has no CUDA device (torch "
                         f"{torch.__version__}); use --device cpu, or pass --gpu SIZE to only check a plan")
    if args.gpu:
        caps = [P.parse_size(g) for g in args.gpu]
    else:  # the visible devices from the chosen one on
        first = device.index if cuda_wanted and device.index is not None else 0
        caps = [torch.cuda.get_device_properties(i).total_memory for i in range(first, torch.cuda.device_count())]
    gx = args.gpu_experts if args.gpu_experts == "auto" else int(args.gpu_experts)
    kw = dict(kv_tokens=kv_tokens, min_kv_tokens=args.min_kv_tokens or kv_tokens,
              chunk_tokens=max(chunk_tokens, max_batch), attention_weights=args.attention_weights,
              embeddings=args.embeddings, gpu_experts=gx, max_batch=max_batch, dtype=dtype)
    # the plan (in the compute dtype's bytes) comes before CUDA is touched: a plan that does not
    # fit is refused here whatever the machine
    plan = P.make_plan(cfg, caps, **kw)
    if not plan.fits:
        raise SystemExit(plan.table() + f"\n\nmoesplit: the plan does not fit in {dtype}: "
                         f"{P.fmt_gib(plan.missing_bytes)} missing; nothing was loaded. Options that would fit are "
                         "listed above" + (" (or --dtype bfloat16)" if dtype == "float32" else "") + ".")
    if cuda and not torch.cuda.is_available():
        raise SystemExit(f"moesplit: --device {device} but this machine has no CUDA device (torch "
                         f"{torch.__version__}); use --device cpu")
    if cuda:
        try:
            devices = plan_devices(plan, device)
            preflight(plan, kw, devices)
        except PlanDoesNotFit as e:
            raise SystemExit(f"{e}\n\nmoesplit: not enough GPUs or free GPU memory right now; nothing was loaded.") from None
    else:  # a CPU-only machine given --gpu: execute the plan's layout on the CPU (for testing plans)
        devices = [torch.device("cpu")] * len(plan.gpus)
    hot = None
    if spec is not None:
        from gpu_service.plan.hot_experts import HotExpertsError, resolve

        try:
            hot = resolve(spec, cfg, plan.options.gpu_experts)
        except HotExpertsError as e:
            raise SystemExit(f"moesplit: {e}; nothing was loaded.") from None
    return Placement.from_plan(plan, devices, hot)
