"""`moesplit generate`: start N expert shard processes and the GPU service on loopback, generate.

Prints the text; with --json the last line is {"token_ids", "text", "timings", ...}."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from gpu_service.local.stack import add_local_shard_arguments
from gpu_service.model.placement import (add_device_arguments, add_plan_arguments, placement_from_args,
                                         V4_ATTENTION_WEIGHTS, v4_refused_options)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors)")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--prompt", help="prompt text (needs tokenizer.json in the model directory)")
    g.add_argument("--prompt-ids", help="comma-separated prompt token ids, e.g. 1,2,3")
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the checkpoint's chat template")
    p.add_argument("--max-new-tokens", type=int, default=32)
    add_local_shard_arguments(p)
    p.add_argument("--shard-addresses", default=None,
                   help="comma-separated host:port of running shards (skips starting local ones)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    add_device_arguments(p)
    p.add_argument("--kv-tokens", type=int, default=None, help="KV cache tokens (default: prompt + new tokens)")
    add_plan_arguments(p)
    from gpu_service.experts.client import add_expert_client_arguments  # --expert-timeout, --tls-*

    add_expert_client_arguments(p)
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--in-process", action="store_true",
                   help="DeepSeek-V4 only, not the serving engine: the model alone in this process with its "
                        "experts computed in process from the dequantised weights, greedy, no shards / KV pool "
                        "(gpu_service.entrypoints.generate_v4)")


def run(args: argparse.Namespace) -> int:
    from checkpoint.config_v4 import load_any_config
    from checkpoint.reader import CheckpointReader
    from gpu_service.experts.client import ExpertsClient
    from gpu_service.local.stack import start_shards
    from gpu_service.experts.handoff import RemoteExperts
    from gpu_service.model.v4.paged import default_page_size
    from gpu_service.runtime.runners import make_runner
    from gpu_service.runtime.sampling import SamplingParams

    if args.max_new_tokens < 1:
        print("moesplit generate: --max-new-tokens must be >= 1", file=sys.stderr)
        return 2
    cfg = load_any_config(args.model)
    v4 = cfg.is_v4
    if args.in_process and not v4:
        print("moesplit generate: --in-process runs DeepSeek-V4 checkpoints only; drop it", file=sys.stderr)
        return 2
    bad = v4_refused_options(args, cfg) if v4 and not args.in_process else []
    if bad:
        print(f"moesplit generate: {', '.join(bad)}: not available for this DeepSeek-V4 checkpoint (its runner keeps "
              "hot GPU experts only as stored MXFP4 or block FP8, and these experts are neither); drop them", file=sys.stderr)
        return 2
    if v4 and not args.in_process and args.attention_weights not in V4_ATTENTION_WEIGHTS:
        print(f"moesplit generate: --attention-weights {args.attention_weights}: DeepSeek-V4's model runs its "
              "linears as stored (checkpoint) or dequantised (bf16), not re-quantised; pass one of those",
              file=sys.stderr)
        return 2
    tok = None
    if args.prompt is not None:
        from gpu_service.api.tokenizer import Tokenizer

        tok = Tokenizer(args.model)
        ids = tok.encode_chat([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    else:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            print(f"moesplit generate: --prompt-ids must be comma-separated integers, got {args.prompt_ids!r}",
                  file=sys.stderr)
            return 2
    if args.in_process:
        from gpu_service.entrypoints.generate_v4 import run_in_process

        parser = argparse.ArgumentParser()
        add_arguments(parser)
        return run_in_process(args, parser, ids, tok)
    reader = CheckpointReader(args.model, cfg)
    sampling = SamplingParams(args.temperature, args.top_p, args.top_k, args.seed)
    device = torch.device(args.device) if args.device else None
    dtype = getattr(torch, args.dtype) if args.dtype else None

    # the memory plan comes first: a plan that cannot fit stops here, before anything is loaded
    kv = args.kv_tokens or max(len(ids) + args.max_new_tokens, 64)
    placement = placement_from_args(args, cfg, kv, device=device)

    from gpu_service.experts.client import expert_client_tls

    try:
        tls = expert_client_tls(args, "moesplit generate")
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    # local shards use the same files: one certificate as server and client (its SANs must cover 127.0.0.1)
    tls_args = ["--tls-cert", tls.cert, "--tls-key", tls.key, "--tls-ca", tls.ca] if tls else []
    t0 = time.perf_counter()
    shards = None
    try:
        if args.shard_addresses:
            addresses = [a.strip() for a in args.shard_addresses.split(",") if a.strip()]
        else:
            shards = start_shards(args.model, args.shards, split=args.split, backend=args.backend,
                                  replicas=args.replicas, extra_args=tls_args)
            addresses = shards.addresses
        t_shards = time.perf_counter() - t0
        client = ExpertsClient(addresses, cfg, timeout_s=args.expert_timeout, tls=tls,
                               tls_server_name=args.tls_server_name)
        client.connect()
        transports = {a: client.fast.transport_of(a) for a in addresses}
        try:
            page = {"page_size": default_page_size(cfg)} if v4 else {}  # whole V4 compression blocks
            runner = make_runner(reader, RemoteExperts(client), device=device, dtype=dtype, kv_tokens=kv,
                                 placement=placement, cuda_graphs=args.cuda_graphs, **page)
            res = runner.generate(ids, args.max_new_tokens, sampling,
                                  stop_ids=() if args.ignore_eos else cfg.eos_token_ids)
        finally:
            client.close()
    finally:
        if shards is not None:
            shards.stop()
    text = tok.decode(res.token_ids) if tok is not None else None
    res.timings["shards_start_s"] = round(t_shards, 3)
    if text is not None:
        print(text)
    tps = res.timings.get("decode_tokens_per_s")
    print(f"[{len(res.token_ids)} tokens, decode {tps} tok/s, prefill {res.timings['prefill_tokens_per_s']} tok/s, "
          f"finish={res.finish_reason}]", file=sys.stderr)
    if args.json:
        print(json.dumps({
            "token_ids": res.token_ids, "text": text, "prompt_ids": ids, "finish_reason": res.finish_reason,
            "last_logits": res.last_logits.tolist() if res.last_logits is not None else None,
            "timings": res.timings, "shards": len(addresses), "split": args.split, "transports": transports,
        }))
    return 0
