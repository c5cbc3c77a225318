"""DeepSeek-V4 attention of one layer: low-rank queries (wq_a, q_norm, wq_b, a weightless per-head
norm), one shared key = value head (wkv, kv_norm), interleaved RoPE on the last qk_rope_head_dim
dims, a sliding window over the recent tokens, per-head sinks, the layer's compressed entries (HCA:
every complete one; CSA: the indexer's picks), the output's rope dims rotated back at the query
position and the grouped low-rank output projection (wo_a per head group, then wo_b). A CSA query
attends its window keys and its own picked entries (gathered, not a mask over every entry).

`AttnState` is one sequence's cache of this layer: the last window - 1 keys (a fixed [window - 1, D],
zero rows before the sequence's first token) and the compressors' states; a chunk of any length
continues it (one-shot prefill, chunked prefill).

Decode (one new token per sequence) runs every decoding sequence of a step at once (`decode_core`,
static shapes): their states stacked [B, ...], each row's window keys [B, window, D] (masked before
position 0), its compressed entries gathered from the entries' tensor through an index [B, E] padded
to the step's entry bucket (HCA: every complete one; CSA: the indexer's top-k over its own padded
keys, then the picks gathered), the new entries written at their rows, one sink attention over
[B, window + E or k] keys. `decode` adds the row-wise projections: a pure function of tensors (what a
CUDA graph captures); the model's single-sequence path decodes through it with B = 1.
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_service.attention.sink_torch import compressed_bias, picks_bias, sink_attention, window_bias
from gpu_service.model.layers import RMSNorm, Rope
from gpu_service.model.qlinear import weight_of
from gpu_service.model.v4.blocks import ATTN_BLOCK
from gpu_service.model.v4.compressor import Compressor, CompressorState, Indexer, write_entries
from gpu_service.model.v4.pieces import grouped_out, rms_unit, rope_tail


class AttnState:
    """One sequence's cache of one layer: window keys [window - 1, D] (None before the first chunk)
    and the tokens fed, plus the compressor / indexer states (module docstring)."""

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


def _pick(t, rows: torch.Tensor):
    """Rows `rows` of every tensor in a (nested) tuple of row-wise projections; None stays None."""
    if t is None:
        return None
    return tuple(_pick(x, rows) for x in t) if isinstance(t, tuple) else t[rows]


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
        self.rope, self.ropes = ropes["compress" if ratio else "main"], ropes
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

    def row_projections(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple:
        """The row-wise projections of rows x [T, hidden] at RoPE cos, sin [T, r/2] (model dtype): (qr
        [T, q_lora], q [T, H, D], kv [T, D], the compressor's and the indexer's projections or None)."""
        T = x.shape[0]
        qr = self.q_norm.norm(self.wq_a(x))  # [T, q_lora]
        q = rope_tail(rms_unit(self.wq_b(qr).view(T, self.H, self.D), self.eps), cos, sin)  # [T, H, D]
        kv = rope_tail(self.kv_norm.norm(self.wkv(x)), cos, sin)  # [T, D]
        cp = self.compressor.projections(x) if self.compressor is not None else None
        ip = self.indexer.projections(x, qr) if self.indexer is not None else None
        return qr, q, kv, cp, ip

    def out(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The attention output o [T, H, D]: its rope dims rotated back, the grouped output projection."""
        o = rope_tail(o, cos, -sin)
        return self.wo_b(grouped_out(o.reshape(o.shape[0], -1), weight_of(self.wo_a, o.dtype), self.groups))

    def forward_batch(self, x: torch.Tensor, segs: list[tuple[int, int, torch.Tensor]],
                      states: list[AttnState], dec=None) -> torch.Tensor:
        """`forward` of several sequences' chunks in one batch of rows x [T, hidden]: rows a:b at
        positions pos continue states[j] (segs[j] = (a, b, pos)); rows in no segment (padding) give 0.
        The row-wise projections, RoPE and the output projection run over all rows; the window,
        compressors and attention per chunk, except the decode rows `dec` names (a
        gpu_service.model.v4.decode.DecodeBatch: one token each), which run at once (`decode_core`)."""
        T, dt = x.shape[0], x.dtype
        pos = torch.zeros(T, dtype=torch.long, device=x.device)
        for a, b, p in segs:
            pos[a:b] = p
        cos, sin = self.rope.cos_sin(pos, torch.float32)
        cos, sin = cos.to(dt), sin.to(dt)
        qr, q, kv, cp, ip = self.row_projections(x, cos, sin)
        o = q.new_zeros(q.shape)
        skip = set(dec.segs) if dec is not None else set()
        for j, ((a, b, p), st) in enumerate(zip(segs, states)):
            if j not in skip:
                self._attend(x[a:b], qr[a:b], q[a:b], kv[a:b], p, st, o[a:b], _rows(cp, a, b), _rows(ip, a, b))
        if dec is not None:
            r = dec.rows
            o_d, *new = self.decode_core(q[r], kv[r], _pick(cp, r), _pick(ip, r), dec.pos, cos[r], sin[r],
                                         *dec.inputs(self))
            o[r] = o_d
            dec.update(self, new)
        return self.out(o, cos, sin)

    def decode(self, x: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *state) -> tuple:
        """The batched decode of B sequences' new tokens x [B, hidden] at positions pos [B] (cos, sin:
        RoPE there, model dtype; `state`: `decode_core`'s stacked inputs) -> (output [B, hidden], the
        new stacked state). Static shapes, no host sync: CUDA-graph capturable."""
        qr, q, kv, cp, ip = self.row_projections(x, cos, sin)
        o, *new = self.decode_core(q, kv, cp, ip, pos, cos, sin, *state)
        return (self.out(o, cos, sin), *new)

    def decode_core(self, q: torch.Tensor, kv: torch.Tensor, cp, ip, pos: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, keys: torch.Tensor, cstate, centries, istate, ientries) -> tuple:
        """One token per row, B rows (module docstring): q [B, H, D], kv [B, D] (after RoPE), cp / ip the
        compressor's / indexer's projections of the rows, pos [B]; keys [B, window - 1, D] the stacked
        window keys; cstate / istate the compressors' stacked states (`Compressor.decode`); centries /
        ientries (src, write [B], read [B, E], cos_e, sin_e): the entries' tensor, each row's new entry's
        row and its entries' rows (padded: they read a row masked off), the RoPE at the new entry's
        position -> (o [B, H, D] before the inverse RoPE, new keys, new cstate, new istate)."""
        B, dt, W = q.shape[0], q.dtype, self.window
        keys = torch.cat([keys, kv[:, None]], 1)  # [B, W, D]: the window, oldest first
        bias = window_bias(pos, pos[:, None] + torch.arange(1 - W, 1, device=pos.device), W, dt)  # [B, W]
        new_keys = keys[:, 1:]
        if self.compressor is not None:
            src, write, read, cos_e, sin_e = centries
            entry, _, cstate = self.compressor.decode(*cp, pos, cos_e, sin_e, cstate)
            if self.indexer is None:  # HCA: every complete entry (E padded, masked)
                entries = write_entries(src, write, entry, read, kv)  # [B, E, D]
                keys = torch.cat([keys, entries], 1)
                bias = torch.cat([bias, compressed_bias(pos, read.shape[1], self.ratio, dt)], -1)
            else:  # CSA: each row's picks, gathered
                write_entries(src, write, entry)
                picks, istate = self.indexer.decode_pick(ip, pos, cos, sin, istate, ientries)
                own = src.index_select(0, read.gather(1, picks.clamp(min=0)).reshape(-1))
                keys = torch.cat([keys, own.view(B, picks.shape[1], -1).to(dt)], 1)
                bias = torch.cat([bias, picks_bias(picks, dt)], -1)
        out = [sink_attention(q[a:a + ATTN_BLOCK], keys[a:a + ATTN_BLOCK], bias[a:a + ATTN_BLOCK], self.attn_sink,
                              self.D ** -0.5) for a in range(0, B, ATTN_BLOCK)]
        return (out[0] if len(out) == 1 else torch.cat(out)), new_keys, cstate, istate

    def _attend(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, pos: torch.Tensor,
                st: AttnState, dest: torch.Tensor, cp=None, ip=None) -> None:
        """One sequence's chunk: its window keys and compressed entries (`st` extended by the chunk;
        cp / ip: the compressor's / indexer's projections of its rows) -> the attention output
        [n, H, D] (before the inverse RoPE) written into `dest`. HCA reads every entry of its layer
        (masked to the complete ones); CSA gathers each query's picks; ATTN_BLOCK queries at a time."""
        n, dt, W1 = x.shape[0], x.dtype, self.window - 1
        keys = torch.cat([st.keys if st.keys is not None else kv.new_zeros((W1, kv.shape[1])), kv])
        k_pos = torch.arange(st.length - W1, st.length + n, device=x.device)
        bias = window_bias(pos, k_pos, self.window, dt)  # [n, S]
        # a copy: a view would keep the whole chunk's (or batch's) keys alive in the state
        st.keys, st.length = keys[keys.shape[0] - W1:].clone(), st.length + n
        picks = None
        if self.compressor is not None:
            count = self.compressor.extend(x, st.comp, cp)
            if self.indexer is None:  # HCA: every complete entry of the layer
                keys = torch.cat([keys, st.comp.store.read(count, kv)])
                bias = torch.cat([bias, compressed_bias(pos, count, self.ratio, dt)], dim=-1)
            else:  # CSA: each query's own picks
                picks = self.indexer.pick(x, qr, pos, st.index, ip)  # [n, k], -1: none
        B = ATTN_BLOCK
        for a in range(0, n, B):
            own = own_bias = None
            if picks is not None:
                own = st.comp.store.gather(picks[a:a + B].clamp(min=0), kv)  # [b, k, D]
                own_bias = picks_bias(picks[a:a + B], dt)
            sink_attention(q[a:a + B], keys, bias[a:a + B], self.attn_sink, self.D ** -0.5, own, own_bias,
                           out=dest[a:a + B])
            del own
