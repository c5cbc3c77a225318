"""The OpenAI HTTP API's endpoints, one APIRouter per group, composed by
`gpu_service.api.http_api.create_app`:

- `chat`        POST /v1/chat/completions
- `completions` POST /v1/completions
- `tokenize`    POST /tokenize, /detokenize
- `models`      GET  /v1/models
- `health`      GET  /health, /live, /metrics

What they share: `context.ApiContext` (the engine, tokenizer and served model name; the JSON body
check, grammar compilation and submission), `request` (field parsing into sampling parameters)
and `streaming` (waiting for choices, server-sent events, usage).
"""
