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
import re

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


def kimi_k25_vision_state_dict(reader: CheckpointReader, hf_config) -> dict[str, torch.Tensor]:
    """The checkpoint's `vision_tower.*` / `mm_projector.*` tensors (float32) under transformers'
    `Kimi_K25Model` names, converted as its conversion_mapping "kimi_k25" does: norm0/norm1 ->
    norm1/norm2, fc0/fc1 -> fc1/fc2, wo -> attn.proj, wqkv chunked into q/k/v with transformers' own
    PermuteForRope on q and k (interleaved pairs -> split halves)."""
    from transformers.core_model_loading import PermuteForRope

    permute = PermuteForRope(subconfig_key="vision_config", permute_layer_names=["q_proj", "k_proj"])
    renames = [(r"^vision_tower\.encoder\.blocks\.(\d+)\.norm0", r"vision_tower.layers.\1.norm1"),
               (r"^vision_tower\.encoder\.blocks\.(\d+)\.norm1", r"vision_tower.layers.\1.norm2"),
               (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0", r"vision_tower.layers.\1.mlp.fc1"),
               (r"^vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1", r"vision_tower.layers.\1.mlp.fc2"),
               (r"^vision_tower\.encoder\.blocks\.(\d+)\.wo", r"vision_tower.layers.\1.attn.proj"),
               (r"^vision_tower\.encoder\.final_layernorm", "vision_tower.final_layernorm"),
               (r"^vision_tower\.patch_embed\.pos_emb\.weight$", "vision_tower.patch_embed.pos_emb.position_embeddings"),
               (r"^mm_projector\.proj\.0", "mm_projector.in_proj"), (r"^mm_projector\.proj\.2", "mm_projector.out_proj")]
    out: dict[str, torch.Tensor] = {}
    for stored in sorted(reader.not_served):
        t = torch.from_numpy(np.asarray(reader.get_raw(stored), dtype=np.float32))
        m = re.match(r"^vision_tower\.encoder\.blocks\.(\d+)\.wqkv\.(weight|bias)$", stored)
        if m:
            for part, x in zip(("q_proj", "k_proj", "v_proj"), t.chunk(3, dim=0)):
                if part != "v_proj":
                    x = permute._permute_for_rope(x, hf_config)
                out[f"model.vision_tower.layers.{m.group(1)}.attn.{part}.{m.group(2)}"] = x.contiguous()
            continue
        name = stored
        for pat, rep in renames:
            name = re.sub(pat, rep, name)
        out["model." + name] = t
    return out


def load_reference_kimi_k25(model_dir: str):
    """fp32 eval-mode transformers `Kimi_K25ForConditionalGeneration` of a Kimi-K2.5-layout
    checkpoint: its language model and lm_head hold the checkpoint's dequantised weights (read
    through the reader's `language_model.` mapping), its vision tower and projector the
    checkpoint's (kimi_k25_vision_state_dict); full coverage asserted."""
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
    reader = CheckpointReader(model_dir)
    sd = reference_state_dict(reader)
    lm = {k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}
    extra = sorted(k for k in sd if not k.startswith("model.") and k != "lm_head.weight")
    if extra:
        raise AssertionError(f"reference: checkpoint tensors outside the language model: {extra[:8]}")
    model.model.language_model.load_state_dict(lm, strict=True)
    model.lm_head.load_state_dict({"weight": sd["lm_head.weight"]}, strict=True)
    vis = kimi_k25_vision_state_dict(reader, cfg)
    want = {k for k in model.state_dict() if k.startswith(("model.vision_tower.", "model.mm_projector."))}
    missing, unexpected = sorted(want - set(vis)), sorted(set(vis) - want)
    if missing or unexpected:
        raise AssertionError(f"reference vision state dict: missing {missing[:8]}, unexpected {unexpected[:8]}")
    model.load_state_dict(vis, strict=False)
    return model.eval()
