"""DeepSeek-V4 attention of one layer: low-rank queries (wq_a, q_norm, wq_b, a weightless per-head
norm), one shared key = value head (wkv, kv_norm), interleaved RoPE on the last qk_rope_head_dim
dims, a sliding window over the recent tokens, per-head sinks, the layer's compressed entries (HCA:
every complete one; CSA: the indexer's picks), the output's rope dims rotated back at the query
position and the grouped low-rank output projection (wo_a per head group, then wo_b). A CSA query
attends its window keys and its own picked entries (gathered, not a mask over every entry).

`AttnState` is one sequence's cache of this layer: the last window - 1 keys and the compressors'
states; a chunk of any length continues it (one-shot prefill, chunked prefill and decode alike).
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_service.attention.sink_torch import compressed_bias, picks_bias, sink_attention, window_bias
from gpu_service.model.layers import RMSNorm, Rope
from gpu_service.model.qlinear import weight_of
from gpu_service.model.v4.blocks import ATTN_BLOCK
from gpu_service.model.v4.compressor import Compressor, CompressorState, Indexer
from gpu_service.model.v4.pieces import grouped_out, rms_unit, rope_tail


class AttnState:
    """One sequence's cache of one layer: window keys [<= window - 1, D] and their positions'
    start, plus the compressor / indexer states (module docstring)."""

    __slots__ = ("keys", "length", "comp", "index")

    def __init__(self, comp_store=None, index_store=None):
        self.keys = None
        self.length = 0  # tokens fed so far (the next chunk's first position)
        self.comp, self.index = CompressorState(comp_store), CompressorState(index_store)

    def snapshot(self) -> dict:
        """The bounded part (window keys, length, both compressors' pending rows and counts) as
        clones; the entries stay in their stores. `restore` puts it back."""
        def grab(c: CompressorState) -> dict:
            return {k: _clone(getattr(c, k)) for k in CompressorState.BOUNDED}
        return {"keys": _clone(self.keys), "length": self.length, "comp": grab(self.comp), "index": grab(self.index)}

    def restore(self, snap: dict) -> None:
        """Continue from a `snapshot` (the stores must hold its entries already)."""
        self.keys, self.length = _clone(snap["keys"]), snap["length"]
        for name in ("comp", "index"):
            for k, v in snap[name].items():
                setattr(getattr(self, name), k, _clone(v))


def _rows(t, a: int, b: int):
    """Rows a:b of every tensor in a (nested) tuple of row-wise projections; None stays None."""
    if t is None:
        return None
    return tuple(_rows(x, a, b) for x in t) if isinstance(t, tuple) else t[a:b]


def _clone(v):
    """A tensor's copy (other values as they are)."""
    return v.clone() if isinstance(v, torch.Tensor) else v


class Attention(nn.Module):
    """One layer's attention (module docstring); `ratio` 0 (window only), 4 (CSA) or more (HCA)."""

    def __init__(self, cfg, ratio: int, ropes: dict[str, Rope]):
        super().__init__()
        H, D, eps = cfg.num_attention_heads, cfg.head_dim, cfg.rms_norm_eps
        self.H, self.D, self.eps, self.ratio = H, D, eps, ratio
        self.window, self.groups = cfg.sliding_window, cfg.o_groups
        self.rope = ropes["compress" if ratio else "main"]
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, D, bias=False)
        self.kv_norm = RMSNorm(D, eps)
        self.wo_a = nn.Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.compressor = Compressor(cfg.hidden_size, D, ratio, ratio == 4, eps, ropes["compress"]) if ratio else None
        self.indexer = Indexer(cfg, ratio, ropes["compress"]) if ratio == 4 else None

    def prepare(self) -> None:
        """At load: the norms' constants."""
        for m in (self.q_norm, self.kv_norm) + ((self.compressor.norm,) if self.compressor else ()) + \
                ((self.indexer.compressor.norm,) if self.indexer else ()):
            m.prepare()

    def forward(self, x: torch.Tensor, pos: torch.Tensor, st: AttnState) -> torch.Tensor:
        """x [n, hidden] (the normed collapsed streams) of the tokens at positions pos [n] that
        follow what `st` holds -> [n, hidden]; `st` now holds them too."""
        return self.forward_batch(x, [(0, x.shape[0], pos)], [st])

    def forward_batch(self, x: torch.Tensor, segs: list[tuple[int, int, torch.Tensor]],
                      states: list[AttnState]) -> torch.Tensor:
        """`forward` of several sequences' chunks in one batch of rows x [T, hidden]: rows a:b at
        positions pos continue states[j] (segs[j] = (a, b, pos)). The row-wise projections, RoPE and
        the output projection run over all rows; the window, compressors and attention per sequence."""
        T, dt = x.shape[0], x.dtype
        pos = segs[0][2] if len(segs) == 1 else torch.cat([p for _, _, p in segs])
        cos, sin = self.rope.cos_sin(pos, torch.float32)
        cos, sin = cos.to(dt), sin.to(dt)
        qr = self.q_norm.norm(self.wq_a(x))  # [T, q_lora]
        q = rope_tail(rms_unit(self.wq_b(qr).view(T, self.H, self.D), self.eps), cos, sin)  # [T, H, D]
        kv = rope_tail(self.kv_norm.norm(self.wkv(x)), cos, sin)  # [T, D]
        cp = self.compressor.projections(x) if self.compressor is not None else None
        ip = self.indexer.projections(x, qr) if self.indexer is not None else None
        o = [self._attend(x[a:b], qr[a:b], q[a:b], kv[a:b], p, st, _rows(cp, a, b), _rows(ip, a, b))
             for (a, b, p), st in zip(segs, states)]
        o = rope_tail(o[0] if len(o) == 1 else torch.cat(o), cos, -sin)
        return self.wo_b(grouped_out(o.reshape(T, -1), weight_of(self.wo_a, dt), self.groups))

    def _attend(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor,
                st: AttnState, cp=None, ip=None) -> torch.Tensor:
        """One sequence's chunk: its window keys and compressed entries (`st` extended by the chunk;
        cp / ip: the compressor's / indexer's projections of its rows) -> the attention output
        [n, H, D] (before the inverse RoPE). HCA reads every entry of its layer (masked to the complete
        ones); CSA gathers each query's picks; ATTN_BLOCK queries at a time."""
        n, dt = x.shape[0], x.dtype
        keys = kv if st.keys is None else torch.cat([st.keys, kv])
        k_pos = torch.arange(st.length + n - keys.shape[0], st.length + n, device=x.device)
        bias = window_bias(pos, k_pos, self.window, dt)  # [n, S]
        # a copy: a view would keep the whole chunk's (or batch's) keys alive in the state
        st.keys, st.length = keys[-(self.window - 1):].clone() if self.window > 1 else keys[:0], st.length + n
        picks = None
        if self.compressor is not None:
            count = self.compressor.extend(x, st.comp, cp)
            if self.indexer is None:  # HCA: every complete entry of the layer
                keys = torch.cat([keys, st.comp.store.read(count, kv)])
                bias = torch.cat([bias, compressed_bias(pos, count, self.ratio, dt)], dim=-1)
            else:  # CSA: each query's own picks
                picks = self.indexer.pick(x, qr, pos, st.index, ip)  # [n, k], -1: none
        out, B = [], ATTN_BLOCK
        for a in range(0, n, B):
            own = own_bias = None
            if picks is not None:
                own = st.comp.store.gather(picks[a:a + B].clamp(min=0), kv)  # [b, k, D]
                own_bias = picks_bias(picks[a:a + B], dt)
            out.append(sink_attention(q[a:a + B], keys, bias[a:a + B], self.attn_sink, self.D ** -0.5, own, own_bias))
            del own
        return out[0] if len(out) == 1 else torch.cat(out)  # [n, H, D]
