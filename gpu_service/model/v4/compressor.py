"""DeepSeek-V4's KV compressors and the lightning indexer.

A compressor pools every `ratio` source tokens into one entry: kv = wkv(x), score = wgate(x) + ape
[slot in window], a per-channel softmax of the scores over the pooled slots weighs the kv, then
`norm` and RoPE (the compressed base) at position w * ratio. With `overlap` (CSA, ratio 4) each token
projects to 2 * d channels: entry w pools the first d of window w-1's tokens and the last d of
window w's (2 * ratio slots); without it (HCA) one window, d channels.

The compressors run over a sequence chunk by chunk with a `CompressorState` per sequence (tokens
of an unfinished window, the previous window's first half for the overlap, the count of entries so
far), so one-shot prefill, chunked prefill and decode run the same code and give the same entries.
The entries themselves live in the state's `store`: `TensorEntries` (one tensor grown by doubling, the
model alone) or the engine's paged pool (gpu_service.model.v4.paged.PagedEntries); both `write` the
new entries at their index, `read` the first W back and `gather` given ones (a CSA query's picks).

`Indexer` (CSA layers): its own overlapping compressor at `index_head_dim`, queries
wq_b(q_lora) as index_n_heads heads with RoPE, score(t, s) = sum_h weights_proj(x)_h n_h^-1/2
d^-1/2 relu(q_h . k_s); each query keeps its top `index_topk` complete entries. It scores
INDEX_BLOCK queries at a time, so the float32 scores alive are [block, heads, W], not [n, heads, W].
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_service.attention.sink_torch import complete_entries
from gpu_service.model.layers import RMSNorm, Rope
from gpu_service.model.v4.blocks import DECODE_INDEX_BLOCK, INDEX_BLOCK
from gpu_service.model.v4.pieces import rope_tail


class TensorEntries:
    """A sequence's entries of one compressor in one tensor [capacity, d], its capacity doubled when
    full (not copied at every chunk)."""

    __slots__ = ("t", "n")

    def __init__(self):
        self.t, self.n = None, 0

    def write(self, first: int, new: torch.Tensor) -> None:
        """Entries first .. first + len(new) (first = those held so far)."""
        end = first + new.shape[0]
        if self.t is None or end > self.t.shape[0]:
            grown = new.new_empty((max(end, 2 * (self.t.shape[0] if self.t is not None else 0)), new.shape[1]))
            if self.n:
                grown[:self.n] = self.t[:self.n]
            self.t = grown
        self.t[first:end] = new
        self.n = end

    def read(self, count: int, like: torch.Tensor) -> torch.Tensor:
        """The first `count` entries [count, d] (like: a tensor of the entries' dtype and device)."""
        return self.t[:count] if self.t is not None else like.new_zeros((0, like.shape[-1]))

    def gather(self, idx: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Entries at indices idx (any shape, each < those held) -> [*idx.shape, d]."""
        if self.t is None:
            return like.new_zeros((*idx.shape, like.shape[-1]))
        return self.t[idx]


class CompressorState:
    """One sequence's compressor progress (module docstring); `store` holds its entries. The pending
    rows live in fixed [ratio, c * d] buffers (the first `pending` rows valid), so the batched decode
    stacks every sequence's state without padding it."""

    __slots__ = ("buf_kv", "buf_gate", "prev_kv", "prev_gate", "store", "count", "pending")
    BOUNDED = ("buf_kv", "buf_gate", "prev_kv", "prev_gate", "count", "pending")  # all but the entries

    def __init__(self, store=None):
        self.buf_kv = self.buf_gate = None  # [ratio, c * d]: tokens of the window not yet complete (None: none yet)
        self.prev_kv = self.prev_gate = None  # [ratio, d]: overlap half of the last complete window
        self.store = store if store is not None else TensorEntries()  # entries [W, d]
        self.count = 0  # W
        self.pending = 0  # rows of buf_kv / buf_gate in use (tokens fed mod ratio)


class Compressor(nn.Module):
    """wkv, wgate [c * d, hidden], ape [ratio, c * d] (float32), norm [d]; c = 2 with overlap."""

    def __init__(self, hidden: int, d: int, ratio: int, overlap: bool, eps: float, rope: Rope):
        super().__init__()
        c = 2 if overlap else 1
        self.d, self.ratio, self.overlap, self.rope = d, ratio, overlap, rope
        self.wkv = nn.Linear(hidden, c * d, bias=False)
        self.wgate = nn.Linear(hidden, c * d, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, c * d))
        self.norm = RMSNorm(d, eps)

    def _slots(self, kv: torch.Tensor, gate: torch.Tensor, st: CompressorState) -> tuple[torch.Tensor, torch.Tensor]:
        """kv, gate [n_w, ratio, 2d] -> the overlapped slots [n_w, 2 * ratio, d]; the first window's
        first half from the previous chunk (else weight 0); keeps this chunk's last first half."""
        n_w, m, d = kv.shape[0], self.ratio, self.d
        new_kv = kv.new_zeros((n_w, 2 * m, d))
        new_gate = gate.new_full((n_w, 2 * m, d), float("-inf"))
        new_kv[:, m:], new_gate[:, m:] = kv[..., d:], gate[..., d:]
        if n_w > 1:
            new_kv[1:, :m], new_gate[1:, :m] = kv[:-1, :, :d], gate[:-1, :, :d]
        if st.prev_kv is not None:
            new_kv[0, :m], new_gate[0, :m] = st.prev_kv, st.prev_gate
        st.prev_kv, st.prev_gate = kv[-1, :, :d].clone(), gate[-1, :, :d].clone()
        return new_kv, new_gate

    def projections(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The row-wise projections (kv, score before ape) of hidden states x [T, hidden]."""
        return self.wkv(x), self.wgate(x)

    def pool(self, kv: torch.Tensor, gate: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Complete windows' slots kv [n, slots, d], gate [n, slots, d] (ape added) -> their entries [n, d]:
        the per-channel softmax over the slots weighs kv, then `norm` and RoPE (cos, sin float32 [n, r/2]
        at each entry's position w * ratio)."""
        pooled = self.norm.norm((kv * gate.softmax(dim=1, dtype=torch.float32).to(kv.dtype)).sum(dim=1))  # [n, d]
        return rope_tail(pooled, cos.to(pooled.dtype), sin.to(pooled.dtype))

    def extend(self, x: torch.Tensor, st: CompressorState, proj=None) -> int:
        """Feed the chunk's hidden states x [n, hidden] (the tokens after those already fed; `proj`:
        their `projections` when already computed over a batch's rows); returns W, the entries so far
        (complete windows), which `st.store` holds."""
        kv, gate = proj if proj is not None else self.projections(x)
        if st.pending:
            kv, gate = torch.cat([st.buf_kv[:st.pending], kv]), torch.cat([st.buf_gate[:st.pending], gate])
        usable = kv.shape[0] // self.ratio * self.ratio
        st.pending = kv.shape[0] - usable
        st.buf_kv, st.buf_gate = _buffer(kv[usable:], self.ratio), _buffer(gate[usable:], self.ratio)
        if usable == 0:
            return st.count
        n_w, first = usable // self.ratio, st.count * self.ratio
        kv = kv[:usable].view(n_w, self.ratio, -1)
        gate = gate[:usable].view(n_w, self.ratio, -1) + self.ape
        if self.overlap:
            kv, gate = self._slots(kv, gate, st)
        pos = torch.arange(n_w, device=x.device) * self.ratio + first
        cos, sin = self.rope.cos_sin(pos, torch.float32)
        st.store.write(st.count, self.pool(kv, gate, cos, sin))
        st.count += n_w
        return st.count

    def decode(self, kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               state: tuple) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """One token per row (the batched decode, static shapes): kv, gate [B, c * d] (its `projections`)
        at positions pos [B], state = (buf_kv, buf_gate [B, ratio, c * d], prev_kv, prev_gate [B, ratio, d]
        or None without overlap) stacked -> (entry [B, d]: the window's entry, meaningful where it
        completes; complete [B] bool; the new state). cos, sin: RoPE at the entry's position
        (pos // ratio) * ratio. Every row pools its window (the ones not complete are not written)."""
        buf_kv, buf_gate, prev_kv, prev_gate = state
        m, d = self.ratio, self.d
        slot = ((pos % m)[:, None] == torch.arange(m, device=pos.device))[..., None]  # [B, m, 1]
        buf_kv = torch.where(slot, kv[:, None], buf_kv)
        buf_gate = torch.where(slot, gate[:, None], buf_gate)
        gate_a = buf_gate + self.ape  # [B, m, c * d]
        complete = (pos + 1) % m == 0
        if self.overlap:
            slots_kv, slots_gate = torch.cat([prev_kv, buf_kv[..., d:]], 1), torch.cat([prev_gate, gate_a[..., d:]], 1)
            done = complete[:, None, None]
            prev_kv = torch.where(done, buf_kv[..., :d], prev_kv)
            prev_gate = torch.where(done, gate_a[..., :d], prev_gate)
        else:
            slots_kv, slots_gate = buf_kv, gate_a
        return self.pool(slots_kv, slots_gate, cos, sin), complete, (buf_kv, buf_gate, prev_kv, prev_gate)


def _buffer(rows: torch.Tensor, ratio: int) -> torch.Tensor:
    """A fixed [ratio, width] pending buffer holding `rows` first (the rest zeros)."""
    buf = rows.new_zeros((ratio, rows.shape[1]))
    buf[:rows.shape[0]] = rows
    return buf


def write_entries(src: torch.Tensor, write: torch.Tensor, entry: torch.Tensor, read: torch.Tensor | None = None,
                  like: torch.Tensor | None = None) -> torch.Tensor | None:
    """The batched decode's entries: each row's new entry into src at its row `write` [B] (a row no
    sequence reads unmasked where the window is not complete), then (with `read`) rows read [B, E] of
    src gathered -> [B, E, d] in like's dtype (padded columns read a row the caller masks off)."""
    src.index_copy_(0, write, entry.to(src.dtype))
    if read is None:
        return None
    return src.index_select(0, read.reshape(-1)).view(*read.shape, src.shape[1]).to(like.dtype)


class Indexer(nn.Module):
    """The lightning indexer of a CSA layer (module docstring). Names: `wq_b`, `weights_proj`,
    `compressor.*` (the checkpoint's `attn.indexer.*`)."""

    def __init__(self, cfg, ratio: int, rope: Rope):
        super().__init__()
        self.heads, self.d, self.topk, self.ratio, self.rope = cfg.index_n_heads, cfg.index_head_dim, \
            cfg.index_topk, ratio, rope
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.heads * self.d, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.d, ratio, True, cfg.rms_norm_eps, rope)

    def projections(self, x: torch.Tensor, qr: torch.Tensor) -> tuple:
        """The row-wise projections of rows x [T, hidden], qr [T, q_lora]: (its compressor's, the
        queries before RoPE, the head weights)."""
        return self.compressor.projections(x), self.wq_b(qr), self.weights_proj(x)

    def score(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, ready: torch.Tensor) \
            -> tuple[torch.Tensor, torch.Tensor]:
        """A block of queries: q [b, h, d] (after RoPE), w [b, h] float32 (head weights, n_h^-1/2
        applied), keys [d, W] float32 (every entry so far, transposed, shared by the queries) or
        [b, W, d] float32 (each query's own, padded: the batched decode, keys as the GEMM's rows), ready
        [b] (complete entries per query) -> (scores [b, W] float32, -inf for entries not complete at the
        query; ready)."""
        if keys.dim() == 2:
            scores = torch.matmul(q.float(), keys).relu_().mul_(self.d ** -0.5)  # [b, h, W]: the one big tensor
            scores = scores.mul_(w.unsqueeze(-1)).sum(dim=1)  # [b, W]
        else:
            scores = torch.bmm(keys, q.float().transpose(1, 2)).relu_().mul_(self.d ** -0.5)  # [b, W, h]
            scores = scores.mul_(w.unsqueeze(1)).sum(dim=2)  # [b, W]
        cols = torch.arange(scores.shape[1], device=q.device)
        return scores.masked_fill_(cols[None, :] >= ready[:, None], float("-inf")), ready

    @staticmethod
    def top(scores: torch.Tensor, ready: torch.Tensor, k: int) -> torch.Tensor:
        """A block's picks [b, k] from its `score`s: the top k entries, -1 for those not complete."""
        picks = scores.topk(k, dim=-1).indices
        return torch.where(picks >= ready[:, None], torch.full_like(picks, -1), picks)

    def pick(self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, st: CompressorState,
             proj=None, block: int = INDEX_BLOCK) -> torch.Tensor:
        """x [n, hidden], qr [n, q_lora] (the query's normed low-rank), pos [n] (`proj`: their
        `projections` when already computed) -> picks [n, k]: each query's top entries by `score`
        among the complete ones, -1 where fewer are complete. The indexer's keys now hold the chunk's
        complete windows too. Queries are scored `block` at a time (each query's math is the same)."""
        comp, qb, wp = proj if proj is not None else self.projections(x, qr)
        W = self.compressor.extend(x, st, comp)
        n = x.shape[0]
        if W == 0:
            return torch.empty((n, 0), dtype=torch.long, device=x.device)
        keys = st.store.read(W, qb).t().float()  # [d, W]
        cos, sin = self.rope.cos_sin(pos, torch.float32)
        q = rope_tail(qb.view(-1, self.heads, self.d), cos.to(x.dtype), sin.to(x.dtype))  # [n, h, d]
        w = wp.float() * self.heads ** -0.5  # [n, h]
        ready, k = complete_entries(pos, self.ratio), min(self.topk, W)
        out = []
        for a in range(0, n, block):
            scores, r = self.score(q[a:a + block], w[a:a + block], keys, ready[a:a + block])
            out.append(self.top(scores, r, k))
            del scores
        return out[0] if len(out) == 1 else torch.cat(out)

    def decode_pick(self, proj: tuple, pos: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, state: tuple,
                    entries: tuple, block: int = DECODE_INDEX_BLOCK) -> tuple[torch.Tensor, tuple]:
        """The batched decode's picks (static shapes): proj = this indexer's `projections` of the B
        rows, pos [B], cos / sin (model dtype, the query's RoPE at pos), state = its compressor's stacked
        state (`Compressor.decode`), entries = (src, write [B], read [B, E], cos_e, sin_e): its keys'
        tensor, the rows of each row's new key and of its keys 0..E-1, the RoPE at the new key's
        position -> (picks [B, min(topk, E)], -1: none; the new state). Rows `block` at a time."""
        (ckv, cgate), qb, wp = proj
        src, write, read, cos_e, sin_e = entries
        key, _, state = self.compressor.decode(ckv, cgate, pos, cos_e, sin_e, state)
        write_entries(src, write, key)
        q = rope_tail(qb.view(-1, self.heads, self.d), cos, sin)  # [B, h, d]
        w = wp.float() * self.heads ** -0.5
        ready, k = complete_entries(pos, self.ratio), min(self.topk, read.shape[1])
        out = []
        for a in range(0, pos.shape[0], block):
            rows = read[a:a + block]
            keys = src.index_select(0, rows.reshape(-1)).view(*rows.shape, -1).to(qb.dtype).float()  # [b, E, d]
            scores, r = self.score(q[a:a + block], w[a:a + block], keys, ready[a:a + block])
            del keys
            out.append(self.top(scores, r, k))
            del scores
        return (out[0] if len(out) == 1 else torch.cat(out)), state
