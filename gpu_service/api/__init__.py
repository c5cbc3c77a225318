"""api/: how clients talk to the GPU service.

- `http_api`: the OpenAI-compatible HTTP API (FastAPI/uvicorn): `create_app` composes the
  endpoint groups of `routes/` (chat, completions, tokenize, models, health + metrics);
- `grpc_api`: the gRPC GenerateService; `grpc_client`: its client (`moesplit chat`);
- `tokenizer`: the checkpoint's tokenizer and chat template.

Imports `gpu_service.runtime` (the engine and sampling parameters) and `protos`.
"""
