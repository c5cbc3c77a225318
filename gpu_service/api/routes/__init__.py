"""The OpenAI HTTP API's endpoints, one APIRouter per group (`chat`, `completions`, `tokenize`,
`models`, `health`), composed by `gpu_service.api.http_api.create_app`. Shared: `context.ApiContext`
(engine, tokenizer, body check, grammar, submission), `request` (field parsing) and `streaming`
(waiting for choices, server-sent events, usage).
"""
