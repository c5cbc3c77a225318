"""`moesplit serve`: start N local CPU expert shard processes, then the GPU service with the
OpenAI HTTP API and the gRPC Generate API; serve until Ctrl-C/SIGTERM, then stop everything
(shard processes included)."""
from __future__ import annotations

import argparse
import os
import secrets
import sys

from gpu_service.local.stack import add_local_shard_arguments
from gpu_service.entrypoints.serving import (add_serving_arguments, check_serving_args, plan_or_exit, run_stack,
                                             setup_logging)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_serving_arguments(p)
    add_local_shard_arguments(p)


def run(args: argparse.Namespace) -> int:
    from gpu_service.local.stack import ShardStartError, start_shards

    setup_logging(args.log_level)
    err = (check_serving_args(args) or (f"--shards must be >= 1, got {args.shards}" if args.shards < 1 else None)
           or (f"--replicas must be >= 1, got {args.replicas}" if args.replicas < 1 else None))
    if err:
        print(f"moesplit serve: {err}", file=sys.stderr)
        return 2
    # with --tls-*, the local shards serve mutual TLS with the same files (SANs must cover 127.0.0.1)
    tls_args = [a for f in ("cert", "key", "ca") for a in (f"--tls-{f}", getattr(args, f"tls_{f}"))] \
        if args.tls_cert else []
    placement = plan_or_exit(args)  # before any shard or weight is loaded
    if not (os.environ.get("MOESPLIT_SHARD_TOKEN") or os.environ.get("MOESPLIT_SHARD_TOKEN_FILE")):
        os.environ["MOESPLIT_SHARD_TOKEN"] = secrets.token_hex(16)  # the local shards take calls from us only
    try:
        shards = start_shards(args.model, args.shards, split=args.split, backend=args.backend,
                              replicas=args.replicas, extra_args=tls_args)
    except (ShardStartError, ValueError) as e:
        print(f"moesplit serve: {e}", file=sys.stderr)
        return 1
    return run_stack(args, "moesplit serve", shards.addresses, [shards.stop], placement)
