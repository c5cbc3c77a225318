"""`moesplit` command line: one entry point, subcommands implemented in their own modules.

Each subcommand module exposes `add_arguments(parser)` and `run(args) -> int`. Modules are
imported only when their subcommand runs, so `moesplit expert-server` never imports torch."""
from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("gpu_service.entrypoints.generate", "generate text with a local GPU service + shard processes"),
    "make-tiny": ("gpu_service.local.tiny", "write a tiny random DeepSeek-V3 / V3.2 / V4 checkpoint"),
    "expert-server": ("cpu_expert_service.server", "run one CPU expert shard (container entrypoint)"),
    "gpu-server": ("gpu_service.entrypoints.server", "run the GPU service alone (container entrypoint)"),
    "serve": ("gpu_service.entrypoints.serve", "start the local stack and serve the OpenAI HTTP + gRPC APIs"),
    "chat": ("gpu_service.entrypoints.chat", "interactive chat over the gRPC Generate API"),
    "plan": ("gpu_service.entrypoints.plan_cli", "compute a memory plan before loading anything"),
    "hot-experts": ("gpu_service.plan.hot_experts", "pick --gpu-experts' hot experts from the shards' activation counts"),
    "convert": ("cpu_expert_service.convert", "pack a checkpoint's experts into per-shard kernel files"),
    "doctor": ("gpu_service.entrypoints.doctor", "measure this box, name what costs speed, predict a model's decode"),
    "bench": ("gpu_service.entrypoints.bench", "decode tokens/s of a checkpoint through the local stack vs doctor's prediction"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="moesplit", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_) in COMMANDS.items():
        sub.add_parser(name, help=help_, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_help(sys.stderr)
            print(f"\nmoesplit: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    p = argparse.ArgumentParser(prog=f"moesplit {name}", description=COMMANDS[name][1])
    module.add_arguments(p)
    args = p.parse_args(argv[1:])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
