"""config.json of the target models, as `moesplit plan --model PRESET` presets.

Copied verbatim from the published checkpoints: deepseek-v3 (also DeepSeek-R1), deepseek-v3.2,
deepseek-v4-flash, deepseek-v4-pro, kimi-k2-instruct, kimi-k2-thinking. Loaded by `gpu_service.plan.load_model_config`."""
