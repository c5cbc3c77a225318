"""Checkpoint access shared by both services (numpy only): typed config, lazy safetensors
reading, and the on-disk formats (BF16/F16/F32, DeepSeek FP8 block, compressed-tensors INT4)."""
from checkpoint.config import ConfigError, ModelConfig, QuantConfig, load_config

__all__ = ["ConfigError", "ModelConfig", "QuantConfig", "load_config"]
