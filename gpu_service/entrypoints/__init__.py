"""The GPU side's commands, one module each: `generate`, `serve`, `server` (= `moesplit
gpu-server`), `chat`, `plan_cli` (= `moesplit plan`), `doctor` and `bench`, which moesplit/cli.py imports only when
its command runs (each exposes `add_arguments(parser)` and `run(args) -> int`); `demo` (`make
demo`, `python -m gpu_service.entrypoints.demo`); and `serving`, the stack `serve` and
`gpu-server` share (runner over running shards, engine, HTTP + gRPC APIs, signal handling)."""
