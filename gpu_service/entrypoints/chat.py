"""`moesplit chat`: interactive chat over the gRPC Generate API; streams tokens as they come and
keeps the conversation; a reasoning model's thinking is shown apart (dim, before the answer). Commands: /reset (forget the conversation), /exit (or Ctrl-D)."""
from __future__ import annotations

import argparse
import sys


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default="127.0.0.1:50050", help="gRPC address of the GPU service (host:port)")
    p.add_argument("--connect-timeout", type=float, default=10.0, help="seconds to wait for the server")
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)


def chat_loop(client, args: argparse.Namespace, stdin=sys.stdin, stdout=sys.stdout) -> int:
    import grpc

    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    interactive = stdin.isatty()
    while True:
        if interactive:
            stdout.write(">>> ")
            stdout.flush()
        line = stdin.readline()
        if not line:  # EOF
            return 0
        line = line.rstrip("\n")
        if not line.strip():
            continue
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        parts, thinking = [], []
        dim, reset = ("\033[2m", "\033[0m") if interactive else ("", "")
        try:
            for r in client.generate(messages=history, max_tokens=args.max_tokens, temperature=args.temperature,
                                     top_p=args.top_p, top_k=args.top_k, seed=args.seed):
                if r.reasoning:
                    if not thinking:
                        stdout.write(f"{dim}[thinking] ")
                    thinking.append(r.reasoning)
                    stdout.write(r.reasoning)
                if r.text:
                    if thinking and not parts:
                        stdout.write(f"{reset}\n")
                    parts.append(r.text)
                    stdout.write(r.text)
                stdout.flush()
        except grpc.RpcError as e:
            history.pop()
            print(f"\nmoesplit chat: {e.code().name}: {e.details()}", file=sys.stderr)
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                return 1
            continue
        except KeyboardInterrupt:  # stop this answer, keep the conversation
            stdout.write("\n")
        if thinking and not parts:
            stdout.write(reset)
        history.append({"role": "assistant", "content": "".join(parts), "reasoning_content": "".join(thinking)})
        stdout.write("\n")
        stdout.flush()


def run(args: argparse.Namespace) -> int:
    import grpc

    from gpu_service.api.grpc_client import GenerateClient

    import os

    with GenerateClient(args.address, api_key=os.environ.get("MOESPLIT_API_KEY")) as client:  # the server's key
        try:
            grpc.channel_ready_future(client.channel).result(timeout=args.connect_timeout)
        except grpc.FutureTimeoutError:
            print(f"moesplit chat: no GPU service at {args.address} after {args.connect_timeout:.0f}s; "
                  f"start one with `moesplit serve` or pass --address", file=sys.stderr)
            return 1
        try:
            return chat_loop(client, args)
        except KeyboardInterrupt:
            return 0
