"""`moesplit bench --model DIR`: decode tokens/s and time to first token of a checkpoint at 1 and
32 (`--streams`) concurrent streaming completions through the real stack (`moesplit serve` as its
own process, with `--shards` local shard processes), beside `moesplit doctor`'s prediction for the
same checkpoint on this box (measured / predicted).

The doctor's CPU probes run first, before the stack starts, so they do not compete with it."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from gpu_service.entrypoints.doctor import (parse_streams, add_prediction_arguments, cpu_report, make_side,
                                            prediction_args_error)
from gpu_service.local.devices import gpu_facts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors + tokenizer)")
    p.add_argument("--shards", type=int, default=2, help="local expert shard processes (default %(default)s)")
    p.add_argument("--streams", type=parse_streams, default=(1, 32), help="concurrent streams, e.g. 1,8,32 (default 1,32)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens each stream generates (default %(default)s)")
    p.add_argument("--rounds", type=int, default=1, help="runs per stream count; the median is reported")
    p.add_argument("--serve-arg", action="append", default=[], metavar="ARG",
                   help="one more argument for `moesplit serve` (repeat; e.g. --serve-arg=--backend=numpy)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the JSON here")
    add_prediction_arguments(p)


def _check(args: argparse.Namespace) -> str | None:
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        return f"{args.model}: no config.json; --model must be a checkpoint directory (`moesplit make-tiny DIR` makes one)"
    from checkpoint.config import ConfigError
    from checkpoint.config_v4 import load_any_config

    try:
        cfg = load_any_config(args.model)
    except ConfigError as e:
        return str(e)
    if cfg.is_v4:
        return ("DeepSeek-V4 is not benchmarked yet: the prediction bench compares with (the doctor's byte model: MLA KV "
                "reads, V3 expert formats) has no V4 terms (window + compressed entries, MXFP4 experts). Measure V4 "
                "with `moesplit serve --model DIR` and streaming /v1/completions (gpu_service.local.loadgen), or bench "
                "a V3-family checkpoint")
    for name in ("shards", "max_tokens", "rounds"):
        if getattr(args, name) < (2 if name == "max_tokens" else 1):
            return f"--{name.replace('_', '-')} must be >= {2 if name == 'max_tokens' else 1}, got {getattr(args, name)}"
    return prediction_args_error(args)


def predicted(args: argparse.Namespace, cpu: dict, gpus: dict) -> dict:
    """The doctor's prediction for this checkpoint as `moesplit serve` will place it: planned on the
    GPUs found; with none, the GPU side runs on this CPU in float32 with the checkpoint's linears."""
    from checkpoint.config import load_config
    from gpu_service.plan.bytes import checkpoint_format, expert_bytes
    from gpu_service.plan.predict import ModelBytes, gpu_weight_bytes, predict

    if args.context is None:  # what the streams hold: the prompt and half their tokens, on average
        from gpu_service.api.tokenizer import load_tokenizer
        from gpu_service.local.loadgen import prompt

        args.context = len(load_tokenizer(args.model).encode(prompt(0))) + args.max_tokens // 2
    if gpus.get("count"):
        from gpu_service.entrypoints.doctor import model_prediction

        args.gpu = None  # plan on the GPUs found, as serve does
        return model_prediction(args, cpu, gpus)
    cfg = load_config(args.model)
    layer = cfg.moe_layers[0]
    fmt = "int4" if checkpoint_format(cfg, f"model.layers.{layer}.mlp.experts.0.gate_proj") == "int4" else "bf16"
    m = ModelBytes(cfg.n_routed_experts, cfg.num_experts_per_tok, len(cfg.moe_layers), cfg.hidden_size,
                   cfg.moe_intermediate_size, expert_bytes(cfg, fmt), fmt, 0, 0,
                   gpu_weight_bytes(cfg, "checkpoint", "float32"), 4 * cfg.kv_cache_dim * cfg.num_hidden_layers)
    side = make_side(cpu, gpus, fmt, args, None, gpu_on_cpu=True)
    out = predict(m, side, args.streams, args.context)
    out.update(model=os.path.basename(os.path.normpath(args.model)), plan_fits=True,
               plan_options={"device": "cpu", "dtype": "float32", "expert_format": fmt, "gpu_experts": 0})
    return out


def measure(args: argparse.Namespace) -> dict:
    """Start the stack, warm it up, then each stream count `--rounds` times: {B: {tokens_per_s, ttft_s}}."""
    from gpu_service.local.loadgen import ServeProcess, decode_tokens_per_s, run_streams, ttft_s

    out = {}
    t0 = time.perf_counter()
    with ServeProcess(args.model, ["--shards", str(args.shards), "--max-batch", str(max(32, *args.streams)),
                                   *args.serve_arg]) as srv:
        print(f"bench: stack up in {time.perf_counter() - t0:.1f} s (port {srv.port}); warming up", file=sys.stderr)
        run_streams(srv.port, 2, 4)
        for b in args.streams:
            rates, ttfts = [], []
            for r in range(args.rounds):
                print(f"bench: {b} streams x {args.max_tokens} tokens, round {r + 1}/{args.rounds} ...",
                      file=sys.stderr, flush=True)
                recs = run_streams(srv.port, b, args.max_tokens)
                rates.append(decode_tokens_per_s(recs))
                ttfts.append(ttft_s(recs))
            out[b] = {"tokens_per_s": round(sorted(rates)[len(rates) // 2], 2),
                      "ttft_s": round(sorted(ttfts)[len(ttfts) // 2], 4), "rounds": [round(x, 2) for x in rates]}
    return out


def compare_row(b: int, meas: dict, pred: dict) -> dict:
    """Measured beside predicted for `b` streams: the ratio, and the step time the formula does not
    explain (measured step - predicted step: fixed per-step costs it has no term for)."""
    step_ms = b / meas["tokens_per_s"] * 1e3
    return {**meas, "predicted_tokens_per_s": pred["tokens_per_s"],
            "measured_over_predicted": float(f"{meas['tokens_per_s'] / pred['tokens_per_s']:.4g}"),
            "measured_step_ms": float(f"{step_ms:.4g}"), "predicted_step_ms": pred["t_step_ms"],
            "unexplained_step_ms": float(f"{step_ms - pred['t_step_ms']:.4g}")}


def run(args: argparse.Namespace) -> int:
    err = _check(args)
    if err:
        print(f"moesplit bench: {err}", file=sys.stderr)
        return 2
    print("bench: measuring this box (doctor's probes) ...", file=sys.stderr, flush=True)
    try:
        cpu = cpu_report(args.threads, args.quick)
        gpus = gpu_facts()
        pred = predicted(args, cpu, gpus)
        meas = measure(args)
    except (RuntimeError, ValueError) as e:
        print(f"moesplit bench: {e}", file=sys.stderr)
        return 1
    rows = {b: compare_row(b, meas[b], pred["by_streams"][b]) for b in args.streams}
    res = {"model": args.model, "shards": args.shards, "max_tokens": args.max_tokens, "cpu_model": cpu["cpu_model"],
           "kernel_isa": cpu["kernel_isa"], "gpus": gpus["count"], "results": rows, "prediction": pred}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    if args.json:
        print(json.dumps(res))
        return 0
    from gpu_service.plan.predict import formula_lines

    print("\n".join(formula_lines(pred)))
    print(f"\n{'streams':>8} {'measured tok/s':>15} {'predicted tok/s':>16} {'measured/predicted':>19} {'TTFT s':>8} "
          f"{'step ms (meas / pred)':>22}")
    for b, r in rows.items():
        print(f"{b:>8} {r['tokens_per_s']:>15.2f} {r['predicted_tokens_per_s']:>16.2f} "
              f"{r['measured_over_predicted']:>19.4g} {r['ttft_s']:>8.3f} "
              f"{r['measured_step_ms']:>11.3f} / {r['predicted_step_ms']:<9.4g}")
    if any(r["measured_over_predicted"] < 0.5 for r in rows.values()):
        print("\nmeasured is under half the prediction: the formula counts the bytes a step reads and the hand-offs; "
              "the difference per step (step ms above) is fixed cost it has no term for (the engine's Python, "
              "kernel launches or, on a CPU, torch's op dispatch per layer, sampling, streaming), which dominates "
              "a model whose step reads little")
    return 0
