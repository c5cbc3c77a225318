"""The one place the runner kind is picked from the checkpoint's config: DeepSeek-V4 (a V4Config)
gets `V4Runner` (gpu_service.runtime.runner_v4), the V3 family (DeepSeek-V3/R1, V3.2, Kimi-K2) the
`ModelRunner`. Both take the same arguments and give the engine the same interface."""
from __future__ import annotations

from gpu_service.runtime.runner import ModelRunner
from gpu_service.runtime.runner_v4 import V4Runner


def runner_class(cfg) -> type:
    """V4Runner for a DeepSeek-V4 config, else ModelRunner."""
    return V4Runner if getattr(cfg, "is_v4", False) else ModelRunner


def make_runner(reader, experts, **kw):
    """The runner of `reader.config`'s kind over `experts` (ModelRunner's keyword arguments)."""
    return runner_class(reader.config)(reader, experts, **kw)
