"""`moesplit make-tiny --arch kimi_k25`: a tiny Kimi-K2.5-layout checkpoint (dev/test tool).

What is real: config.json is a `KimiK25ForConditionalGeneration` wrapper (the DeepSeek-V3
language model under `text_config`, a `vt_*` MoonViT `vision_config`, media_placeholder_token_id,
the K2-Thinking compressed-tensors quantization_config at the top level and in text_config); the
language model's tensors are stored as `language_model.model.*` / `language_model.lm_head.weight`
with INT4 routed experts (or bf16 / fp8 with --format); the vision tower and projector tensors
carry the real names and shapes of a small MoonViT (`checkpoint.kimi_k25.vision_shapes`), bf16,
seeded random (gpu_service.model.vision runs them; tests compare with transformers); the tokenizer is Kimi's tiktoken one with K2.5's media
tokens (`tiny_tokenizers` kind "kimi-k2.5"). `gpu_service.local.tiny.make_tiny` writes it: the
language model's weights come from `tiny.language_model_tensors`, the same path as `--arch
deepseek_v3`; this module holds the wrapper config and the vision tensors.
"""
from __future__ import annotations

import copy

import numpy as np

from checkpoint import kimi_k25

TINY_VISION = {  # real key names (vt_*), tiny sizes
    "model_type": "", "patch_size": 14, "init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 4,
    "pos_emb_type": "divided_fixed", "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool",
    "video_attn_type": "spatial_temporal", "vt_hidden_size": 32, "vt_intermediate_size": 64,
    "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2, "mm_projector_type": "patchmerger",
    "mm_hidden_size": 32, "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05,
}


def wrapper_config(text: dict, vision: dict | None = None) -> dict:
    """The config.json dict of a Kimi-K2.5 wrapper around the text config dict `text`."""
    vision = copy.deepcopy(vision or TINY_VISION)
    vision["text_hidden_size"] = int(text["hidden_size"])
    n = int(text["bos_token_id"])  # Kimi's specials sit after the ranks: media pad = [BOS] + 21
    out = {"architectures": [kimi_k25.ARCHITECTURE], "model_type": kimi_k25.MODEL_TYPE,
           "bos_token_id": n, "eos_token_id": text["eos_token_id"], "pad_token_id": text.get("pad_token_id", n + 255),
           "media_placeholder_token_id": n + 21, "use_unified_vision_chunk": True,
           "video_placeholder": "<|kimi_k25_video_placeholder|>", "tie_word_embeddings": False,
           "dtype": "bfloat16"}
    if "quantization_config" in text:
        out["quantization_config"] = copy.deepcopy(text["quantization_config"])
    out["text_config"] = text
    out["vision_config"] = vision
    return out


def vision_tensors(vision: dict, text_hidden: int, seed: int):
    """{stored name: bf16 torch tensor}: seeded random weights (LayerNorm weights near 1, biases small)."""
    import torch

    rng = np.random.default_rng(seed + 1000)
    out = {}
    for name, shape in kimi_k25.vision_shapes(vision, text_hidden).items():
        a = rng.standard_normal(shape).astype(np.float32) * 0.05
        if "norm" in name and name.endswith(".weight"):
            a += 1.0
        out[name] = torch.from_numpy(a).to(torch.bfloat16)
    return out
