"""config.json of the target models, as `moesplit plan --model PRESET` presets.

Copied verbatim from the published checkpoints: deepseek-v3 (also DeepSeek-R1), deepseek-v3.2,
deepseek-v4-flash, deepseek-v4-pro, kimi-k2-instruct, kimi-k2-thinking; kimi-k2.5 and kimi-k2.6
are the reconstructed configs of ../shared/model-configs (their `_source` / `_unverified` keys say
what is secondary). Loaded by `gpu_service.plan.load_model_config`."""
