"""`moesplit gpu-server`: the GPU service alone (container entrypoint) over already running
expert shards given by --shards-addresses; OpenAI HTTP API + gRPC Generate API until SIGTERM."""
from __future__ import annotations

import argparse
import os
import sys

from gpu_service.entrypoints.serving import (add_serving_arguments, check_serving_args, plan_or_exit, run_stack,
                                             setup_logging)


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_serving_arguments(p)
    p.add_argument("--shards-addresses", "--shards", dest="shards_addresses", default=os.environ.get("MOESPLIT_SHARDS"),
                   help="comma-separated host:port of the expert shards (default: $MOESPLIT_SHARDS)")


def run(args: argparse.Namespace) -> int:
    setup_logging(args.log_level)
    addresses = [a.strip() for a in (args.shards_addresses or "").split(",") if a.strip()]
    err = check_serving_args(args) or (None if addresses else "--shards-addresses is required (host:port,...)")
    if err:
        print(f"moesplit gpu-server: {err}", file=sys.stderr)
        return 2
    return run_stack(args, "moesplit gpu-server", addresses, [], plan_or_exit(args))
