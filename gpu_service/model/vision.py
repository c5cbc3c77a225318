"""Kimi-K2.5 / K2.6's MoonViT vision tower and its projector: image patches -> text-model embeddings.

One image at a time (attention never crosses images), on the checkpoint's own layout:
  patch_embed   14x14 conv as a linear over [3*14*14] patches + the learned 2-D position table,
                bicubic-resampled to the image's patch grid (as is when the grid is the table's)
  blocks        pre-LN (LayerNorm 1e-5): norm0 -> fused wqkv (q, k, v) -> 2-D RoPE on q and k
                -> attention over the image's patches -> wo; norm1 -> fc0 -> gelu(tanh) -> fc1
  final_layernorm
  merge         2x2 neighbouring patches -> one token (the 4 in row-major kernel order)
  mm_projector  LayerNorm per patch (pre_norm), the 4 concatenated -> proj.0 -> GELU -> proj.2

The 2-D RoPE rotates consecutive pairs of each head's dims (the checkpoint's interleaved order):
pair p turns by angle pos * theta^(-4(p//2)/head_dim) where pos is the patch's column for even
p and its row for odd p (MoonViT's Rope2DPosEmb; theta 10000). Video (frames, time table) is not
served: `VisionTower.embed` takes one image's patches.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

ROPE_THETA = 10000.0
LN_EPS = 1e-5


class VisionBlock(nn.Module):
    """One pre-LN encoder block; parameter names are the checkpoint's (`encoder.blocks.N.*`)."""

    def __init__(self, hidden: int, inter: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm0 = nn.LayerNorm(hidden, eps=LN_EPS)
        self.norm1 = nn.LayerNorm(hidden, eps=LN_EPS)
        self.wqkv = nn.Linear(hidden, 3 * hidden)
        self.wo = nn.Linear(hidden, hidden)
        self.mlp = nn.Module()
        self.mlp.fc0 = nn.Linear(hidden, inter)
        self.mlp.fc1 = nn.Linear(inter, hidden)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] (one image's patches); cos / sin [N, head_dim / 2] of the 2-D RoPE."""
        n, d = x.shape
        q, k, v = self.wqkv(self.norm0(x)).view(n, 3, self.heads, d // self.heads).unbind(1)
        q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        x = x + self.wo(o.transpose(0, 1).reshape(n, d))
        return x + self.mlp.fc1(F.gelu(self.mlp.fc0(self.norm1(x)), approximate="tanh"))


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, heads, hd] with consecutive pairs (a, b) turned by the angle of their pair:
    (a cos - b sin, a sin + b cos), in float32."""
    xf = x.float().unflatten(-1, (-1, 2))
    a, b = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.stack((a * c - b * s, a * s + b * c), -1).flatten(-2).to(x.dtype)


def rope_2d(grid_h: int, grid_w: int, head_dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [grid_h * grid_w, head_dim / 2] for the patches in row-major order (module docstring)."""
    rows = torch.arange(grid_h, device=device, dtype=torch.float32).repeat_interleave(grid_w)
    cols = torch.arange(grid_w, device=device, dtype=torch.float32).repeat(grid_h)
    freqs = ROPE_THETA ** (-torch.arange(0, head_dim, 4, device=device, dtype=torch.float32)[: head_dim // 4]
                           / head_dim)
    ang = torch.stack((cols[:, None] * freqs, rows[:, None] * freqs), -1).flatten(1)  # [N, hd/2]: w, h, w, h...
    return ang.cos(), ang.sin()


class VisionTower(nn.Module):
    """MoonViT + mm_projector (module docstring). `embed(patches, grid_h, grid_w)` -> [tokens, text_hidden]."""

    def __init__(self, vision_config: dict, text_hidden: int):
        super().__init__()
        vc = vision_config
        self.hidden = h = int(vc.get("vt_hidden_size", 1152))
        self.heads = int(vc.get("vt_num_attention_heads", 16))
        self.patch = p = int(vc.get("patch_size", 14))
        mk = [int(m) for m in vc.get("merge_kernel_size", [2, 2])]
        if mk != [2, 2]:
            raise ValueError(f"vision_config.merge_kernel_size {mk}: only MoonViT's 2x2 merge is implemented")
        self.merge = 2
        ph, pw = int(vc.get("init_pos_emb_height", 64)), int(vc.get("init_pos_emb_width", 64))
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(3, h, kernel_size=p, stride=p)
        self.patch_embed.pos_emb = nn.Module()
        self.patch_embed.pos_emb.weight = nn.Parameter(torch.zeros(ph, pw, h))
        self.encoder = nn.Module()
        self.encoder.blocks = nn.ModuleList(
            VisionBlock(h, int(vc.get("vt_intermediate_size", 4304)), self.heads)
            for _ in range(int(vc.get("vt_num_hidden_layers", 27))))
        self.encoder.final_layernorm = nn.LayerNorm(h, eps=LN_EPS)
        self.projector = Projector(h, 4, text_hidden, float(vc.get("projector_ln_eps", LN_EPS)))

    def positions(self, grid_h: int, grid_w: int) -> torch.Tensor:
        """[grid_h * grid_w, hidden]: the position table, bicubic-resampled to the grid (align_corners off)."""
        table = self.patch_embed.pos_emb.weight
        if tuple(table.shape[:2]) == (grid_h, grid_w):
            return table.flatten(0, 1)
        t = F.interpolate(table.float().permute(2, 0, 1)[None], size=(grid_h, grid_w), mode="bicubic",
                          align_corners=False)
        return t[0].permute(1, 2, 0).flatten(0, 1).to(table.dtype)

    @torch.inference_mode()
    def embed(self, patches: torch.Tensor, grid_h: int, grid_w: int) -> torch.Tensor:
        """patches [grid_h * grid_w, 3, P, P] (row-major, normalised) -> [grid_h/2 * grid_w/2, text_hidden]."""
        if patches.shape[0] != grid_h * grid_w or grid_h % 2 or grid_w % 2:
            raise ValueError(f"{patches.shape[0]} patches for a {grid_h}x{grid_w} grid (even sides expected)")
        proj = self.patch_embed.proj
        w = proj.weight
        x = F.linear(patches.to(w.device, w.dtype).flatten(1), w.flatten(1), proj.bias)
        x = x + self.positions(grid_h, grid_w)
        cos, sin = rope_2d(grid_h, grid_w, self.hidden // self.heads, x.device)
        for blk in self.encoder.blocks:
            x = blk(x, cos, sin)
        x = self.encoder.final_layernorm(x)
        m = self.merge  # [h, w, d] -> [h/2 * w/2, 4, d], kernel positions row-major
        x = x.view(grid_h // m, m, grid_w // m, m, -1).permute(0, 2, 1, 3, 4).reshape(-1, m * m, self.hidden)
        return self.projector(x)


class Projector(nn.Module):
    """`mm_projector`: pre_norm per patch, the merged patches concatenated, proj.0 -> GELU -> proj.2."""

    def __init__(self, hidden: int, merged: int, text_hidden: int, eps: float):
        super().__init__()
        self.pre_norm = nn.LayerNorm(hidden, eps=eps)
        self.proj = nn.Sequential(nn.Linear(hidden * merged, hidden * merged), nn.GELU(),
                                  nn.Linear(hidden * merged, text_hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [tokens, merged, hidden] -> [tokens, text_hidden]."""
        return self.proj(self.pre_norm(x).flatten(1))


def stored_name(param: str) -> str:
    """The checkpoint name of a VisionTower parameter (the projector lives under `mm_projector.`)."""
    if param.startswith("projector."):
        return "mm_" + param
    return "vision_tower." + param


def build_vision(vision_config: dict, text_hidden: int, get: Callable[[str], np.ndarray], device: torch.device,
                 dtype: torch.dtype) -> VisionTower:
    """The tower with every parameter from `get(stored name) -> float32 array` on `device` in `dtype`
    (LayerNorms in float32); a missing tensor raises through `get`, a wrong shape names the tensor."""
    with torch.device("meta"):
        tower = VisionTower(vision_config, text_hidden)
    for name, p in list(tower.named_parameters()):
        src = stored_name(name)
        t = torch.from_numpy(np.ascontiguousarray(get(src), dtype=np.float32))
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"tensor {src!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)} "
                             "from config.json's vision_config")
        mod_name, _, attr = name.rpartition(".")
        mod = tower.get_submodule(mod_name)
        keep32 = isinstance(mod, nn.LayerNorm)
        mod._parameters[attr] = nn.Parameter(t.to(device=device, dtype=torch.float32 if keep32 else dtype),
                                             requires_grad=False)
    for m in tower.modules():  # LayerNorms in float32: their inputs are cast to it
        if isinstance(m, nn.LayerNorm):
            m.forward = _float_ln(m)
    return tower.eval()


def _float_ln(ln: nn.LayerNorm):
    """A LayerNorm forward computed in float32 and returned in its input's dtype."""
    def fwd(x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x.float(), ln.normalized_shape, ln.weight, ln.bias, ln.eps).to(x.dtype)
    return fwd


def param_count(vision_config: dict, text_hidden: int) -> int:
    """Parameters of the tower and projector (what build_vision loads)."""
    with torch.device("meta"):
        return sum(p.numel() for p in VisionTower(vision_config, text_hidden).parameters())
