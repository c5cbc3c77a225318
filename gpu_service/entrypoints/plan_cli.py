"""`moesplit plan`: print the memory plan of a model on the given GPUs and host, before loading.

Exit status 0 when the plan fits, 3 when it does not (the table then says how many GiB are
missing and which options would fit), 2 on bad input."""
from __future__ import annotations

import argparse
import json
import sys

from checkpoint.config import ConfigError
from gpu_service import plan as P


def _gpu_experts(s: str) -> int | str:
    if s == "auto":
        return s
    try:
        return int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpu-experts {s!r}: expected an integer or 'auto'") from None


def _size(s: str) -> int:
    try:
        return P.parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help=f"checkpoint dir, config.json or preset ({', '.join(P.presets())})")
    p.add_argument("--gpu", action="append", type=_size, required=True, metavar="SIZE",
                   help="total memory of one GPU, e.g. 24GiB (GB = 1e9, GiB = 2^30); repeat per GPU")
    p.add_argument("--host-ram", type=_size, default=None, metavar="SIZE", help="host RAM to check shards against")
    p.add_argument("--host-kv-cache", default="auto", metavar="SIZE|auto",
                   help="host-RAM tier of the prefix cache (default auto: half the RAM --host-ram leaves free)")
    p.add_argument("--numa-nodes", type=int, default=1, help="CPU shards, one per NUMA node (default 1)")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help=f"KV cache target in tokens (default {P.DEFAULT_KV_TARGET}); shrunk only if needed")
    p.add_argument("--min-kv-tokens", type=int, default=P.DEFAULT_MIN_KV_TOKENS,
                   help="never shrink the KV cache below this (default %(default)s)")
    p.add_argument("--chunk-tokens", type=int, default=P.DEFAULT_CHUNK_TOKENS,
                   help="tokens per forward step / prefill chunk (default %(default)s)")
    p.add_argument("--max-batch", type=int, default=P.DEFAULT_MAX_BATCH,
                   help="most sequences decoded together (default %(default)s)")
    p.add_argument("--attention-weights", choices=P.ATTENTION_WEIGHTS, default="auto")
    p.add_argument("--embeddings", choices=P.EMBEDDINGS, default="auto")
    p.add_argument("--gpu-experts", type=_gpu_experts, default="auto", metavar="N|auto",
                   help="hot routed experts per MoE layer held on the GPU")
    p.add_argument("--expert-format", choices=P.EXPERT_FORMATS, default="auto")
    p.add_argument("--dtype", choices=P.DTYPES, default="bfloat16",
                   help="compute dtype of the GPU service (unquantised weights, KV cache, activations; "
                        "default %(default)s, as generate/serve use on CUDA)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--helm-values", metavar="FILE", default=None,
                   help="write Helm values encoding the plan (GPU count and memory, shard pods, layout)")
    p.add_argument("--model-path", default="/models/model",
                   help="where the chart mounts the checkpoint (for --helm-values; default %(default)s)")
    p.add_argument("--kernel-isa", choices=["auto", "amx", "avx512", "avx2"], default="auto",
                   help="CPU feature the expert pods require (for --helm-values / --cluster)")
    p.add_argument("--cluster", action="store_true",
                   help="list the current cluster's nodes (kubeconfig) that can run the plan, and why others cannot")


def run(args: argparse.Namespace) -> int:
    try:
        cfg, name = P.load_model_config(args.model)
        plan = P.make_plan(cfg, args.gpu, host_ram=args.host_ram, numa_nodes=args.numa_nodes,
                           kv_tokens=args.kv_tokens, min_kv_tokens=args.min_kv_tokens,
                           chunk_tokens=args.chunk_tokens, attention_weights=args.attention_weights,
                           embeddings=args.embeddings, gpu_experts=args.gpu_experts,
                           expert_format=args.expert_format, max_batch=args.max_batch, model=name,
                           dtype=args.dtype, host_kv_cache=args.host_kv_cache)
    except (ConfigError, ValueError) as e:
        print(f"moesplit plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan.to_json(), indent=2) if args.json else plan.table())
    if args.helm_values:
        if not plan.fits:
            print(f"moesplit plan: not writing {args.helm_values}: the plan does not fit", file=sys.stderr)
            return 3
        from gpu_service.plan.helm_values import write_helm_values

        write_helm_values(plan.to_json(), args.helm_values, args.model_path, kernel_isa=args.kernel_isa)
        print(f"wrote Helm values to {args.helm_values}", file=sys.stderr)
    if args.cluster:
        from gpu_service.plan.cluster import check_cluster

        try:
            verdicts = check_cluster(plan.to_json(), kernel_isa=args.kernel_isa)
        except Exception as e:  # no kubeconfig, API server unreachable, ...
            print(f"moesplit plan --cluster: cannot list nodes: {e}", file=sys.stderr)
            return 2
        for v in verdicts:
            print(v, file=sys.stderr if args.json else sys.stdout)
    return 0 if plan.fits else 3
