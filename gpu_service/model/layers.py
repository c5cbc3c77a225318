"""The small pieces of the DeepSeek layers: RMSNorm, YaRN RoPE, linears called without the module
call, the gated MLP and the router. Each is one implementation; what pays on a decode step (fused
weights, a cheaper norm on CPU float32, 0-d constants) is decided once at load (`prepare`).

Every torch op costs a few µs of dispatch, so the decode step's fixed cost is its op count: the
pieces avoid nn.Module.__call__, Python scalar operands (wrapped per call) and einsum.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from checkpoint.config import ModelConfig


def plain(lin) -> bool:
    """A bias-free nn.Linear (not a quantised one): its weight can be used as a matrix."""
    return type(lin) is nn.Linear and lin.bias is None


class Lin:
    """A linear called without nn.Module.__call__: x @ W.t() for a plain one, else its forward."""

    __slots__ = ("wt", "fwd")

    def __init__(self, lin: nn.Module | None, weight: torch.Tensor | None = None):
        if weight is None and plain(lin):
            weight = lin.weight
        self.wt = None if weight is None else weight.t()
        self.fwd = None if weight is not None else lin.forward

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(x, self.wt) if self.wt is not None else self.fwd(x)


def concat_rows(*lins: nn.Linear) -> None:
    """At load: make the linears' weights adjacent row blocks of one tensor (their concatenation),
    so that one matmul computes all their outputs; each module keeps a view (no extra bytes)."""
    ws = [lin.weight for lin in lins]
    if len({(w.dtype, w.device, w.shape[1]) for w in ws}) != 1 or any(w.device.type == "meta" for w in ws):
        return
    if fused_view(ws) is not None:
        return
    big = torch.cat([w.detach() for w in ws])
    r0 = 0
    for lin, w in zip(lins, ws):
        lin.weight = nn.Parameter(big[r0:r0 + w.shape[0]], requires_grad=False)
        r0 += w.shape[0]


def fused_view(ws: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum(out), in] view over weights that are adjacent row blocks of one storage, else None."""
    w0 = ws[0]
    off = w0.storage_offset()
    for w in ws:
        if (w.untyped_storage().data_ptr() != w0.untyped_storage().data_ptr() or not w.is_contiguous()
                or w.storage_offset() != off or w.shape[1] != w0.shape[1]):
            return None
        off += w.numel()
    return w0.as_strided((sum(w.shape[0] for w in ws), w0.shape[1]), (w0.shape[1], 1), w0.storage_offset())


class RMSNorm(nn.Module):
    """x * rsqrt(mean(x^2) + eps) * w. On CPU float32 computed as x * rsqrt(||x||^2 + H eps) *
    (w sqrt(H)) (vector_norm and four elementwise ops cost less than torch's fused rms_norm there;
    the same value up to rounding); elsewhere torch's fused rms_norm in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.composed = False

    def prepare(self) -> None:
        """At load: the composed form's constants where it applies."""
        w = self.weight
        self.composed = w.device.type == "cpu" and w.dtype == torch.float32
        if self.composed:
            self.ws = w.detach() * math.sqrt(w.shape[0])  # [H]: a copy of a norm weight (H floats)
            self.heps = torch.tensor(w.shape[0] * self.eps, dtype=torch.float32)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The normalised x (the module's forward without the module call)."""
        if self.composed and x.dtype == torch.float32:
            n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            return (x * n.mul_(n).add_(self.heps).rsqrt_()).mul_(self.ws)
        return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class Rope:
    """YaRN rotary embedding for the qk_rope_head_dim part (DeepSeek interleaved pairs, or the
    half-split layout with rope_interleave false). Applied through a per-step table (`table`)
    and a column gather (`index`): x_e c + x_o (-s) == x_e c - x_o s in IEEE arithmetic."""

    def __init__(self, cfg: ModelConfig):
        dim, base = cfg.qk_rope_head_dim, cfg.rope_theta
        self.dim, self.interleave = dim, cfg.rope_interleave
        pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
        rs = cfg.rope_scaling
        self.attention_factor = 1.0
        self.softmax_mscale = 1.0
        if rs is None:
            inv_freq = 1.0 / pos_freqs
        else:
            factor = float(rs["factor"])
            orig = rs["original_max_position_embeddings"]
            beta_fast, beta_slow = rs.get("beta_fast") or 32, rs.get("beta_slow") or 1
            mscale, mscale_all = rs.get("mscale"), rs.get("mscale_all_dim")
            if rs.get("attention_factor") is not None:
                self.attention_factor = float(rs["attention_factor"])
            elif mscale and mscale_all:
                self.attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
            else:
                self.attention_factor = yarn_mscale(factor)

            def corr_dim(rot: float) -> float:
                return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(base))

            low, high = corr_dim(beta_fast), corr_dim(beta_slow)
            if rs.get("truncate", True):
                low, high = math.floor(low), math.ceil(high)
            low, high = max(low, 0), min(high, dim - 1)
            if low == high:
                high += 0.001
            ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
            extrap = 1 - ramp
            inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
            if mscale_all:
                self.softmax_mscale = yarn_mscale(factor, mscale_all) ** 2
        self.inv_freq = inv_freq  # [dim/2]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, dim/2]
        return (freqs.cos() * self.attention_factor).to(dtype), (freqs.sin() * self.attention_factor).to(dtype)

    @staticmethod
    def table(cos: torch.Tensor, sin: torch.Tensor, rows: int) -> torch.Tensor:
        """[rows, 2 * dim] = [c, c, -s, s] per row, zero-padded to `rows` (built once per step)."""
        cs = torch.cat([cos, cos, -sin, sin], dim=-1)
        if rows > cs.shape[0]:
            cs = torch.cat([cs, cs.new_zeros(rows - cs.shape[0], cs.shape[1])])
        return cs

    def index(self, offset: int, device) -> torch.Tensor:
        """Columns [evens, odds, odds, evens] of a rope part starting at `offset`: times the table
        and halves added, they give the half-split rotated output."""
        d, h = self.dim, self.dim // 2
        ev = torch.arange(0, d, 2) if self.interleave else torch.arange(h)
        od = torch.arange(1, d, 2) if self.interleave else torch.arange(h, d)
        return (torch.cat([ev, od, od, ev]) + offset).to(device)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate ++ up in one matmul once fused at load."""

    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def prepare(self) -> None:
        """At load: gate ++ up as one weight where both are plain linears of one dtype and device."""
        if plain(self.gate_proj) and plain(self.up_proj):
            concat_rows(self.gate_proj, self.up_proj)
        gu = fused_view([self.gate_proj.weight, self.up_proj.weight]) \
            if plain(self.gate_proj) and plain(self.up_proj) else None
        self.inter = self.gate_proj.weight.shape[0] if gu is not None else None
        self.gu = Lin(None, gu) if gu is not None else None
        self.ops = (Lin(self.gate_proj), Lin(self.up_proj), Lin(self.down_proj))

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP without module calls (after `prepare`)."""
        gate, up, down = self.ops
        if self.gu is not None:
            gu = self.gu(x)
            return down(F.silu(gu[:, : self.inter]) * gu[:, self.inter:])
        return down(F.silu(gate(x)) * up(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)


class Router(nn.Module):
    """Sigmoid scores; selection with e_score_correction_bias and group-limited top-k (top-2 sum
    per group); weights from the unbiased scores, normalised, times routed_scaling_factor."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def prepare(self) -> None:
        """At load: the float32 weight as a matrix and the 0-d constants of `route`."""
        dev = self.weight.device
        self.wt = self.weight.float().t()
        self.bias = self.e_score_correction_bias.float()
        self.ninf = torch.tensor(float("-inf"), dtype=torch.float32, device=dev)
        self.eps20 = torch.tensor(1e-20, dtype=torch.float32, device=dev)
        self.scale = torch.tensor(self.cfg.routed_scaling_factor, dtype=torch.float32, device=dev)

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k], weights [T, k] float32) of h [T, H]."""
        cfg, E = self.cfg, self.cfg.n_routed_experts
        scores = torch.mm(h if h.dtype == torch.float32 else h.float(), self.wt).sigmoid()  # [T, E]
        choice = scores + self.bias
        if cfg.n_group > 1:
            cg = choice.view(-1, cfg.n_group, E // cfg.n_group)
            gidx = cg.topk(2, dim=-1)[0].sum(-1).topk(cfg.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
            drop = torch.ones(cg.shape[:2] + (1,), dtype=torch.bool, device=h.device).scatter_(1, gidx[..., None], False)
            choice = torch.where(drop, self.ninf, cg).view(-1, E)
        ids = choice.topk(cfg.num_experts_per_tok, dim=-1, sorted=False)[1]
        w = scores.gather(1, ids)
        if cfg.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True).add_(self.eps20)
        return ids, (w.mul_(self.scale) if cfg.routed_scaling_factor != 1.0 else w)
