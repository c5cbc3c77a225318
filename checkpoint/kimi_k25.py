"""Kimi-K2.5 / K2.6 checkpoints (`KimiK25ForConditionalGeneration`): the nested config and the prefixes.

The language model is Kimi-K2's (DeepSeek-V3 architecture, INT4 compressed-tensors experts as in
K2-Thinking), but config.json nests it under `text_config` (with a MoonViT `vision_config` beside
it) and the weights are stored as `language_model.model.*` / `language_model.lm_head.weight`, with
the vision tower under `vision_tower.*` and its projector under `mm_projector.*`.

`unwrap(d)` turns such a config.json dict into the text model's dict (top-level quantization,
eos/bos and tie_word_embeddings carried over where the text config lacks them) plus the
vision-side data; `logical_name(stored)` maps a stored name to the text model's logical name, or
None for a vision tensor (the reader lists those apart, in `.not_served`, for the vision tower). `vision_shapes` lists the
vision tower's and projector's tensors (real names, from the stored Kimi-K2.5 weight table) so the
plan can count their bytes and make-tiny can write them. numpy-free, import-free.
"""
from __future__ import annotations

ARCHITECTURE = "KimiK25ForConditionalGeneration"
MODEL_TYPE = "kimi_k25"
LANGUAGE_PREFIX = "language_model."
VISION_PREFIXES = ("vision_tower.", "mm_projector.")
# The image geometry of Kimi_K25ImageProcessor (its defaults), read by the preprocessing
# (gpu_service.model.image_inputs) and by the plan (which must not import torch)
PATCH = 14  # patch side in pixels
MERGE = 2  # the projector merges 2 x 2 patches into one token
MAX_PATCHES = 16384  # patches of an image after its resize, before padding to the merge
MAX_SIDE_PATCHES = 512  # patches along one side
NOT_SERVED = "vision tower / projector: not part of the text model (gpu_service.model.vision loads them)"
# top-level fields a text_config may lack (K2.6's text_config has no eos/bos)
_CARRIED = ("quantization_config", "eos_token_id", "bos_token_id", "pad_token_id", "tie_word_embeddings")
# the image placeholder tokens of the chat format (transformers' Kimi_K25Config defaults)
MEDIA_TOKENS = {"<|media_begin|>": 163602, "<|media_content|>": 163603, "<|media_end|>": 163604,
                "<|media_pad|>": 163605}


def is_kimi_k25(d: dict) -> bool:
    """Whether a config.json dict is a Kimi-K2.5 / K2.6 multimodal wrapper."""
    archs = d.get("architectures") or []
    return d.get("model_type") == MODEL_TYPE or (bool(archs) and archs[0] == ARCHITECTURE)


def unwrap(d: dict, source: str = "config.json") -> tuple[dict, dict]:
    """(text model config dict, {"vision_config", "media_placeholder_token_id", ...} kept as data).

    Raises ValueError naming the missing field when `text_config` is absent."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        raise ValueError(f"{source}: a {ARCHITECTURE} config without a `text_config` object; the language model's "
                         "DeepSeek-V3 fields live there in the published checkpoints: re-download config.json")
    text = dict(text)
    for k in _CARRIED:
        if k in d and k not in text:
            text[k] = d[k]
    if "eos_token_id" in d:  # the wrapper's eos ends generation (K2.6: <|im_end|>)
        text["eos_token_id"] = d["eos_token_id"]
    if text.get("model_type") == "kimi_k2":  # as transformers' Kimi_K25Config remaps it
        text["model_type"] = "deepseek_v3"
    text.setdefault("architectures", ["DeepseekV3ForCausalLM"])
    vision = {"vision_config": dict(d.get("vision_config") or {}),
              "media_placeholder_token_id": d.get("media_placeholder_token_id", MEDIA_TOKENS["<|media_pad|>"])}
    return text, vision


def logical_name(stored: str) -> str | None:
    """`language_model.model.X` -> `model.X`, `language_model.lm_head.weight` -> `lm_head.weight`;
    None for `vision_tower.*` / `mm_projector.*`; other names unchanged."""
    if stored.startswith(LANGUAGE_PREFIX):
        return stored[len(LANGUAGE_PREFIX):]
    if stored.startswith(VISION_PREFIXES):
        return None
    return stored


def stored_name(logical: str) -> str:
    """The stored name of a text model tensor (inverse of `logical_name`)."""
    return LANGUAGE_PREFIX + logical


def vision_shapes(vision_config: dict, text_hidden: int) -> dict[str, tuple[int, ...]]:
    """{stored name: shape} of the vision tower and projector (the real checkpoint's names:
    329 tower + 6 projector tensors for 27 layers), from the real `vt_*` config keys."""
    h = int(vision_config.get("vt_hidden_size", 1152))
    inter = int(vision_config.get("vt_intermediate_size", 4304))
    layers = int(vision_config.get("vt_num_hidden_layers", 27))
    p = int(vision_config.get("patch_size", 14))
    ph, pw = int(vision_config.get("init_pos_emb_height", 64)), int(vision_config.get("init_pos_emb_width", 64))
    mk = vision_config.get("merge_kernel_size", [2, 2])
    merged = h * int(mk[0]) * int(mk[1])
    out: dict[str, tuple[int, ...]] = {
        "vision_tower.patch_embed.proj.weight": (h, 3, p, p), "vision_tower.patch_embed.proj.bias": (h,),
        "vision_tower.patch_embed.pos_emb.weight": (ph, pw, h),
    }
    for i in range(layers):
        b = f"vision_tower.encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            out[b + norm + ".weight"] = (h,)
            out[b + norm + ".bias"] = (h,)
        for name, shape in (("wqkv", (3 * h, h)), ("wo", (h, h)), ("mlp.fc0", (inter, h)), ("mlp.fc1", (h, inter))):
            out[b + name + ".weight"] = shape
            out[b + name + ".bias"] = (shape[0],)
    out["vision_tower.encoder.final_layernorm.weight"] = (h,)
    out["vision_tower.encoder.final_layernorm.bias"] = (h,)
    out.update({"mm_projector.pre_norm.weight": (h,), "mm_projector.pre_norm.bias": (h,),
                "mm_projector.proj.0.weight": (merged, merged), "mm_projector.proj.0.bias": (merged,),
                "mm_projector.proj.2.weight": (text_hidden, merged), "mm_projector.proj.2.bias": (text_hidden,)})
    return out


def vision_param_count(vision_config: dict, text_hidden: int) -> int:
    """Parameters of the vision tower + projector (bf16 on disk: 2 bytes each)."""
    total = 0
    for shape in vision_shapes(vision_config, text_hidden).values():
        n = 1
        for s in shape:
            n *= s
        total += n
    return total
