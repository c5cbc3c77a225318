"""local/: moesplit on one machine.

- `tiny`: tiny random DeepSeek-V3/V3.2 checkpoints (bf16, fp8, int4) and their transformers twin;
- `tiny_train`: a briefly trained tiny model (faithfulness tests);
- `stack`: starts shard processes on loopback (`serve`, `generate`, tests, benchmarks).

Imports `checkpoint` and `wire`; shards are started as subprocesses (`python -m
cpu_expert_service.server`), never imported.
"""
