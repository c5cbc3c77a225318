"""moesplit/: the `moesplit` console entry point, neutral between the two services.

`moesplit.cli` dispatches each command to its module lazily, so `moesplit expert-server` and
`moesplit convert` run with `cpu_expert_service`, `wire`, `checkpoint` and `protos` installed and
nothing of `gpu_service` (the torch-free experts image relies on it). Imports nothing at load.
"""
