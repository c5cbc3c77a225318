"""Test helper: the Hugging Face transformers reference model of a checkpoint, in fp32.

`load_reference(model_dir)` builds `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM` from
config.json and loads the checkpoint's weights **dequantised** by `CheckpointReader.get` (FP8 and
INT4 become the exact float values our services compute with), fusing the per-expert on-disk
tensors into transformers 5's `mlp.experts.gate_up_proj` [E, 2I, H] (gate rows, then up) and
`down_proj` [E, H, I]. The state dict must be covered exactly: no missing, no unexpected keys.

`load_reference_pretrained(model_dir)` is the independent path for BF16 checkpoints:
transformers' own `from_pretrained` (its own safetensors reader and expert fusing).
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch

from checkpoint import names as N
from checkpoint.reader import CheckpointReader


def reference_state_dict(reader: CheckpointReader) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (dequantised, float32) under transformers 5 parameter names."""
    cfg = reader.config
    out: dict[str, torch.Tensor] = {}
    for name in reader.names():
        if N.is_routed_expert(name):
            continue
        out[name] = torch.from_numpy(reader.get(name))
    for layer in cfg.moe_layers:
        E = cfg.n_routed_experts
        gate_up = np.stack(
            [np.concatenate([reader.get(N.expert_weight(layer, e, "gate")),
                             reader.get(N.expert_weight(layer, e, "up"))], axis=0) for e in range(E)]
        )  # [E, 2I, H]
        down = np.stack([reader.get(N.expert_weight(layer, e, "down")) for e in range(E)])  # [E, H, I]
        p = N.layer_prefix(layer) + "mlp.experts."
        out[p + "gate_up_proj"] = torch.from_numpy(gate_up)
        out[p + "down_proj"] = torch.from_numpy(down)
    return out


def _hf_config(model_dir: str):
    from gpu_service.local.tiny import _hf_config as to_hf

    with open(os.path.join(model_dir, "config.json")) as f:
        return to_hf(json.load(f))


def load_reference(model_dir: str):
    """fp32 eval-mode transformers model with the checkpoint's dequantised weights."""
    import transformers

    reader = CheckpointReader(model_dir)
    hf_cfg = _hf_config(model_dir)
    cls = transformers.DeepseekV32ForCausalLM if reader.config.is_v32 else transformers.DeepseekV3ForCausalLM
    model = cls(hf_cfg).float()
    sd = reference_state_dict(reader)
    want = set(model.state_dict())
    missing, unexpected = sorted(want - set(sd)), sorted(set(sd) - want)
    if missing or unexpected:
        raise AssertionError(f"reference state dict mismatch: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.load_state_dict(sd, strict=True)
    return model.eval()


def load_reference_pretrained(model_dir: str):
    """BF16 checkpoints only: transformers' from_pretrained in fp32, asserting full coverage."""
    import transformers

    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, output_loading_info=True
    )
    bad = {k: v for k, v in info.items() if v}
    if bad:
        raise AssertionError(f"from_pretrained({model_dir}) did not cover the model: {bad}")
    return model.eval()


def load_reference_kimi_k25(model_dir: str):
    """fp32 eval-mode transformers `Kimi_K25ForConditionalGeneration` of a Kimi-K2.5-layout
    checkpoint: its language model and lm_head hold the checkpoint's dequantised weights (read
    through the reader's `language_model.` mapping; full coverage asserted); the vision tower and
    projector keep transformers' initialisation (text-only inputs never run them)."""
    import transformers

    from gpu_service.local.tiny import _hf_config as to_hf

    with open(os.path.join(model_dir, "config.json")) as f:
        d = json.load(f)
    v = d["vision_config"]  # the real `vt_*` keys -> transformers' names
    vision = transformers.Kimi_K25VisionConfig(
        patch_size=v["patch_size"], pos_emb_height=v["init_pos_emb_height"], pos_emb_width=v["init_pos_emb_width"],
        pos_emb_time=v["init_pos_emb_time"], hidden_size=v["vt_hidden_size"],
        intermediate_size=v["vt_intermediate_size"], num_attention_heads=v["vt_num_attention_heads"],
        num_hidden_layers=v["vt_num_hidden_layers"], merge_kernel_size=list(v["merge_kernel_size"]))
    cfg = transformers.Kimi_K25Config(text_config=to_hf(d["text_config"]), vision_config=vision,
                                      projection_hidden_size=v["mm_hidden_size"], tie_word_embeddings=False,
                                      image_token_id=d["media_placeholder_token_id"])
    model = transformers.Kimi_K25ForConditionalGeneration(cfg).float()
    sd = reference_state_dict(CheckpointReader(model_dir))
    lm = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
    extra = sorted(k for k in sd if not k.startswith("model.") and k != "lm_head.weight")
    if extra:
        raise AssertionError(f"reference: checkpoint tensors outside the language model: {extra[:8]}")
    model.model.language_model.load_state_dict(lm, strict=True)
    model.lm_head.load_state_dict({"weight": sd["lm_head.weight"]}, strict=True)
    return model.eval()
