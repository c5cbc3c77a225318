"""The small pieces of the DeepSeek-V4 layers, each one implementation: the two RoPEs (plain for
window-only layers, YaRN on another base for compressed layers; built by layers.Rope), interleaved
RoPE on a vector's trailing dims, the weightless RMS norm, the mHC hyper-connection weights and
their use, the grouped low-rank output projection and the clamped SwiGLU.

The config read here (and everywhere in the V4 model) is checkpoint.config_v4.V4Config, whose
fields carry the original key names (`qk_rope_head_dim`, `compress_ratios` per decoder layer,
`compress_rope_theta`, `rope_scaling` {"type": "yarn", ...}, `hc_mult`, ...) whichever spelling
config.json used.
"""
from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F

from gpu_service.model.layers import Rope


def v4_ropes(cfg) -> dict[str, Rope]:
    """{"main": window-only layers (rope_theta, no scaling), "compress": compressed layers, their
    compressors and indexers (compress_rope_theta + rope_scaling's YaRN frequencies, cos / sin
    not scaled: attention_factor 1)}."""
    main = SimpleNamespace(qk_rope_head_dim=cfg.qk_rope_head_dim, rope_theta=cfg.rope_theta,
                           rope_interleave=True, rope_scaling=None)
    rs = getattr(cfg, "rope_scaling", None)
    comp = SimpleNamespace(qk_rope_head_dim=cfg.qk_rope_head_dim, rope_theta=cfg.compress_rope_theta,
                           rope_interleave=True, rope_scaling=None if rs is None else {**rs, "attention_factor": 1.0})
    return {"main": Rope(main), "compress": Rope(comp)}


def rope_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with its last 2 * cos.shape[-1] dims rotated in interleaved pairs at the rows'
    positions (cos, sin [T, r/2]); the leading dims unchanged. (cos, -sin) rotates back."""
    c = cos.repeat_interleave(2, dim=-1)
    s = sin.repeat_interleave(2, dim=-1)
    while c.dim() < x.dim():
        c, s = c.unsqueeze(-2), s.unsqueeze(-2)
    r = c.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    swapped = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * c + swapped.float() * s).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def elementwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn (an elementwise transcendental: sigmoid, softplus) of x with every element on the same code
    path. On CPU, torch's elementwise kernels run vectors of 2 x 16 floats and a short tail
    scalar, whose exp can differ in the last bit; padding the flat tensor to a multiple of 64 elements
    keeps every element vectorised, so a row's value does not depend on how many rows are batched."""
    if x.device.type != "cpu":
        return fn(x)
    n = x.numel()
    flat = x.reshape(-1)
    if n % 64:
        flat = torch.cat([flat, flat.new_zeros(64 - n % 64)])
    return fn(flat)[:n].view(x.shape)


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) over the last dim (an RMS norm without weight), in x's dtype."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_pre(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg) \
        -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """mHC before a sublayer. X [T, n, D] streams -> (collapsed [T, D], post [T, n], comb [T, n, n]).
    m = fn . rms(flat X); pre = sigmoid(m_pre s0 + b) + eps; post = 2 sigmoid(m_post s1 + b);
    comb = row-softmax(m_comb s2 + b) + eps, Sinkhorn-normalised (columns, then rows and columns)."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    m = F.linear(rms_unit(X.flatten(1).float(), cfg.rms_norm_eps), fn.float())  # [T, (2 + n) n]
    pre_w, post_w, comb_w = m.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    s_pre, s_post, s_comb = scale.float().unbind(0)
    pre = elementwise(torch.sigmoid, pre_w * s_pre + pre_b) + eps
    post = 2 * elementwise(torch.sigmoid, post_w * s_post + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * s_comb + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)
    return collapsed, post, comb


def hc_post(X: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """mHC after a sublayer: stream k gets post_k * y + sum_j comb[j, k] X_j. X [T, n, D], y [T, D]."""
    dt = X.dtype
    return post.to(dt).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(dt).transpose(-1, -2), X)


def hc_head(X: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, cfg) -> torch.Tensor:
    """The final reduction of the streams before the norm: sum_j (sigmoid(m_j s + b_j) + eps) X_j."""
    m = F.linear(rms_unit(X.flatten(1).float(), cfg.rms_norm_eps), fn.float())  # [T, n]
    pre = elementwise(torch.sigmoid, m * scale.float() + base.float()) + cfg.hc_eps
    return (pre.unsqueeze(-1) * X).sum(dim=1).to(X.dtype)


def grouped_out(o: torch.Tensor, wo_a: torch.Tensor, groups: int) -> torch.Tensor:
    """o [T, H * D] in `groups` contiguous head groups, each times its own rows of wo_a
    [groups * R, H * D / groups] -> [T, groups * R]."""
    T, gin = o.shape[0], o.shape[1] // groups
    w = wo_a.view(groups, -1, gin).transpose(1, 2)  # [G, in, R]
    y = torch.bmm(o.reshape(T, groups, gin).transpose(0, 1), w)  # [G, T, R]
    return y.transpose(0, 1).reshape(T, -1)


def swiglu_limited(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(min(gate, limit)) * clamp(up, -limit, limit) (V4's experts, routed and shared); plain
    silu(gate) * up without a limit."""
    if limit:
        gate = gate.clamp(max=limit)
        up = up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up
