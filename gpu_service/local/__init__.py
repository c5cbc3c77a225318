"""local/: moesplit on one machine.

- `tiny`: tiny random DeepSeek-V3/V3.2 checkpoints (bf16, fp8, int4) and their transformers twin;
- `tiny_train`: a briefly trained tiny model (faithfulness tests);
- `stack`: starts shard processes on loopback (`serve`, `generate`, tests, benchmarks);
- `loadgen`: `moesplit serve` as a process and concurrent streaming completions against it (`bench`);
- `devices`: this box's GPUs (without torch unless the driver lists one) and known cards' bandwidth.

Imports `checkpoint` and `wire`; shards and the CPU probes are started as subprocesses (`python -m
cpu_expert_service.server`, `python -m cpu_expert_service.probes`), never imported.
"""
