"""runtime/: running the model for requests.

- `runner`: `ModelRunner` (model + KV pool + experts, one batched step);
- `sampling`: greedy / temperature / top-p / top-k sampling of a batch;
- `engine`: continuous batching (chunked prefill mixed with decode, preemption, stop rules).

Imports `gpu_service.model` and `checkpoint`; the experts client is passed in, not imported.
"""
