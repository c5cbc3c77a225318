"""DeepSeek-V4's MoE minus the routed experts: the gate (sqrtsoftplus scores; the first
`num_hash_layers` choose experts by the token id through `tid2eid`, the rest by the top scores plus
the correction bias; weights are the chosen scores normalised, times routed_scaling_factor) and the
shared expert with the clamped SwiGLU. Routed experts go through the `ExpertsFn`.

Hot experts (a memory plan's `--gpu-experts`) are held here as stored: `Mxfp4Linear` (MXFP4
checkpoints) or `Fp8Linear` (block FP8 e4m3 + ue8m0 scales, Pro-style base releases), and run through the V3 MoE's hot path (`remote_weights`: weight 0 to the shards, which skip them;
`hot_output`: their weighted sum here), with the clamped SwiGLU of `SharedExpert`.

`ReferenceExperts` computes the routed experts in process from float weights, with the same clamp
(`swiglu_limited`): the rule the CPU expert shards apply for V4.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gpu_service.model.deepseek import MoE as MoEV3
from gpu_service.model.experts_api import ExpertsFn, Ready
from gpu_service.model.rows import pad_rows, padded, row_block
from gpu_service.model.v4.pieces import elementwise, swiglu_limited


class Gate(nn.Module):
    """`weight` [E, hidden] and, by layer kind, `tid2eid` [vocab, k] (hash) or `bias` [E]."""

    def __init__(self, cfg, hashed: bool):
        super().__init__()
        if cfg.scoring_func != "sqrtsoftplus":
            raise ValueError(f"scoring_func {cfg.scoring_func!r}: DeepSeek-V4 scores with 'sqrtsoftplus'")
        self.k, self.scale, self.hashed = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.k, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def route(self, h: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids [T, k], weights [T, k] float32) of h [T, hidden] and the tokens' ids [T]."""
        scores = elementwise(F.softplus, F.linear(h.float(), self.weight.float())).sqrt()  # [T, E]
        if self.hashed:
            ids = self.tid2eid[tokens].long()
        else:
            ids = torch.topk(scores + self.bias.float(), self.k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scale


class SharedExpert(nn.Module):
    """w2(swiglu_limited(w1 x, w3 x)); checkpoint names w1 (gate), w3 (up), w2 (down)."""

    def __init__(self, hidden: int, inter: int, limit: float | None):
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.w2(swiglu_limited(self.w1(x), self.w3(x), self.limit))

    run = forward  # the V3 MoE's hot_output calls expert.run(x)


class MoE(nn.Module):
    """gate + shared_experts (the checkpoint's `ffn.*`); routed experts via the ExpertsFn."""

    _hot_ids, remote_weights, hot_output = MoEV3._hot_ids, MoEV3.remote_weights, MoEV3.hot_output  # one hot path

    def __init__(self, cfg, layer: int, hot=()):
        super().__init__()
        self.layer = layer
        self.gate = Gate(cfg, layer < cfg.num_hash_layers)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts,
                                           cfg.swiglu_limit) if cfg.n_shared_experts else None
        self.hot = list(hot)  # routed experts computed here (checkpoint names ffn.experts.E.w1/w2/w3)
        self.experts = nn.ModuleDict({str(e): SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size,
                                                           cfg.swiglu_limit) for e in self.hot}) if self.hot else None

    def forward(self, h: torch.Tensor, tokens: torch.Tensor, experts: ExpertsFn, T: int | None = None) -> torch.Tensor:
        """h [R, hidden] (post-attention normed), tokens [R] -> routed + shared [R, hidden]; the
        shared expert (and the hot experts) run while the routed experts are in flight. Only the first
        T rows go to the experts (the rest are padding: routed 0)."""
        T = h.shape[0] if T is None else T
        ids, w = self.gate.route(h, tokens)
        handle = self.send(h[:T], ids[:T], w[:T], experts)
        shared = self.shared_experts(h) if self.shared_experts is not None else None
        return self.combine(self.routed(handle, h[:T], ids[:T], w[:T], h.shape[0]), shared, own=self.experts is not None)

    def send(self, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, experts: ExpertsFn):
        """The routed experts' call on rows h with the router's ids, w (hot experts sent with weight 0)."""
        return experts(self.layer, h, ids, w if self.experts is None else self.remote_weights(ids, w))

    def routed(self, handle, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
        """The routed output of `send`'s rows (+ the hot experts', computed before waiting), zero-padded
        to `rows`."""
        hot = self.hot_output(h, ids, w, h) if self.experts is not None else None
        routed = handle.wait()
        if hot is not None:  # summed into the hot experts' own buffer: no [T, hidden] sum beside it
            routed = hot.add_(routed)
        return pad_rows(routed, rows)

    @staticmethod
    def combine(routed: torch.Tensor, shared: torch.Tensor | None, own: bool = False) -> torch.Tensor:
        """routed + shared (the MoE's output); `own`: routed is this call's own buffer, summed in place."""
        if own and shared is not None:
            return routed.add_(shared)
        return routed if shared is None else routed + shared


class ReferenceExperts:
    """An in-process ExpertsFn over float weights `get(name)` of `layers.N.ffn.experts.K.w{1,2,3}.weight`:
    sum_k w[t,k] * w2(swiglu_limited(w1 h, w3 h)) of expert ids[t,k], per expert as the reference."""

    def __init__(self, get, n_experts: int, limit: float | None):
        self.get, self.E, self.limit = get, n_experts, limit
        self._w: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def _weights(self, layer: int, e: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(w1 ++ w3 [2I, hidden], w2 [hidden, I]) of one expert in float32 on `device`, read once."""
        key = (layer, e)
        if key not in self._w:
            p = f"layers.{layer}.ffn.experts.{e}."
            w1, w3, w2 = (torch.as_tensor(self.get(p + f"{n}.weight")).float() for n in ("w1", "w3", "w2"))
            self._w[key] = (torch.cat([w1, w3]).to(device), w2.to(device))
        return self._w[key]

    def __call__(self, layer: int, h: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> Ready:
        """The ExpertsFn call: the routed output [T, hidden], already there."""
        out = torch.zeros_like(h)
        for e in ids.unique().tolist():
            rows, cols = torch.where(ids == e)
            gate_up, down = self._weights(layer, e, h.device)
            n = rows.shape[0]
            x = pad_rows(h[rows], padded(n, self._block(h, gate_up, down)))  # a row's result: not its batch's
            g, u = F.linear(x, gate_up.to(h.dtype)).chunk(2, dim=-1)
            y = F.linear(swiglu_limited(g, u, self.limit), down.to(h.dtype))[:n] * w[rows, cols, None].to(h.dtype)
            out.index_add_(0, rows, y)
        return Ready(out)

    @staticmethod
    def _block(h: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> int:
        """The GEMM row block of these shapes (gpu_service.model.rows)."""
        return row_block(h.device, h.dtype, ((gate_up.shape[1], gate_up.shape[0]), (down.shape[1], down.shape[0])))
