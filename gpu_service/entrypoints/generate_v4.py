"""`moesplit generate --in-process` for DeepSeek-V4: the V4 model alone in this process.

Not the serving engine: no expert shards, no paged KV pool, no ModelRunner, no CUDA graphs, no
sampling. It loads the checkpoint with `gpu_service.model.v4.load.load_v4` (weights dequantised, the
routed experts computed in process by `ReferenceExperts` from the dequantised MXFP4 / FP8 weights)
and decodes greedily with the model's own per-sequence cache (`gpu_service.model.v4.model.greedy`).
Its tokens equal transformers' DeepseekV4ForCausalLM (tests/test_v4_checkpoint_model.py). It is
a correctness path for V4 until the engine runs V4 (docs/v4.md says what that needs); every
`moesplit generate` option it cannot honour is refused by name rather than ignored.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

# generate's options this path honours; any other option given a non-default value is refused
HONOURED = {"model", "prompt", "prompt_ids", "max_new_tokens", "device", "dtype", "json", "ignore_eos",
            "in_process", "temperature", "help"}


def refused_options(args: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The option strings of `parser` that `args` sets away from their defaults and this path ignores."""
    bad = []
    for a in parser._actions:
        if a.dest in HONOURED or not a.option_strings:
            continue
        if getattr(args, a.dest, a.default) != a.default:
            bad.append(a.option_strings[-1])
    if args.temperature != 0.0:
        bad.insert(0, "--temperature")
    return bad


def run_in_process(args: argparse.Namespace, parser: argparse.ArgumentParser, ids: list[int], tok) -> int:
    """Greedy tokens from the in-process V4 model; prints the text (and --json's object)."""
    from gpu_service.model.v4.load import load_v4
    from gpu_service.model.v4.model import greedy

    bad = refused_options(args, parser)
    if bad:
        print(f"moesplit generate --in-process: {', '.join(bad)} not supported here (greedy only, experts in "
              "this process, no shards, no KV pool, no plan); drop them", file=sys.stderr)
        return 2
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    t0 = time.perf_counter()
    loaded = load_v4(args.model, dtype=dtype, device=device)
    t1 = time.perf_counter()
    stop = () if args.ignore_eos else loaded.config.eos_token_ids
    out = greedy(loaded.model, ids, args.max_new_tokens, loaded.experts, stop_ids=stop)
    t2 = time.perf_counter()
    finish = "stop" if out and out[-1] in stop else "length"
    text = tok.decode(out) if tok is not None else None
    if text is not None:
        print(text)
    timings = {"load_s": round(t1 - t0, 3), "generate_s": round(t2 - t1, 3),
               "tokens_per_s": round(len(out) / max(t2 - t1, 1e-9), 2)}
    print(f"[{len(out)} tokens in process (DeepSeek-V4 reference path: experts in process, no shards), "
          f"{timings['tokens_per_s']} tok/s, finish={finish}]", file=sys.stderr)
    if args.json:
        print(json.dumps({"token_ids": out, "text": text, "prompt_ids": ids, "finish_reason": finish,
                          "path": "in-process", "timings": timings}))
    return 0
