"""The host side of DeepSeek-V4's batched decode: what one step's decoding sequences need on one
device, built before the layers run (so the layers' decode is static-shaped, no host sync: CUDA
graphs capture it; gpu_service.model.v4.attention `decode_core`).

`DecodeBatch` holds the B decoding sequences' positions padded to `rows` (the CPU's GEMM row block or
the CUDA-graph bucket; pad rows sit at position 0 with zero state and write nothing anyone reads),
the RoPE tables at those positions, per layer the sequences' stacked bounded state (`inputs`) and,
after the layer, the new state back into each sequence's `AttnState` (`update`: views of the step's
stacked tensors, no per-sequence copy).

Compressed entries: per compression ratio r, each row reads entries 0 .. E-1 of its layer through an
index [rows, E] (`read`) and writes its new entry at `write`. E is the step's entry bucket
(`entry_bucket`): a power of two at least the entries the longest sequence sees, at least MIN_KEYS
(and index_topk on CSA layers, so a CSA step always takes top-k of k = index_topk), at most what the
pool holds for one sequence. In the engine's paged pool (`PagedEntries`) the index is the pool rows of
the sequences' pages (every layer of one ratio shares it) and padded columns and not-complete windows
point at the pool tensor's last row (never read unmasked); for the model's own per-sequence tensors
(`TensorEntries`: tests, `greedy`) the step reads a concatenation of the sequences' entries and
writes the completed ones back.
"""
from __future__ import annotations

import torch

from gpu_service.attention.meta import MIN_KEYS
from gpu_service.model.v4.paged import PagedEntries

CSA = 4


def entry_bucket(n: int, floor: int, cap: int | None) -> int:
    """The entry columns of a decode step: the smallest power of two >= max(n, floor), at most cap
    (never below n)."""
    e = 1 << (max(n, floor, 1) - 1).bit_length()
    return max(n, min(e, cap)) if cap is not None else e


class DecodeBatch:
    """One step's decoding sequences on one device (module docstring)."""

    def __init__(self, states: list[list], positions: list[int], rows: int, device: torch.device,
                 dtype: torch.dtype, ropes: dict, row_index: list[int] | None = None, segs: list[int] | None = None):
        """states[j]: sequence j's AttnState per layer; positions[j]: its new token's position; rows:
        the padded row count (>= B); ropes: the model's (gpu_service.model.v4.pieces.v4_ropes);
        row_index / segs (a mixed step): the decode tokens' rows in the step and their chunks' indices."""
        self.states, self.B, self.Bp, self.device, self.dtype = states, len(positions), rows, device, dtype
        self.positions = positions
        self.pos = torch.tensor(positions + [0] * (rows - len(positions)), dtype=torch.long).to(device)
        self.rope = {}
        for name, rope in ropes.items():
            cos, sin = rope.cos_sin(self.pos, torch.float32)
            self.rope[name] = (cos.to(dtype), sin.to(dtype))
        self._compress = ropes["compress"]
        self.rows = torch.tensor(row_index, dtype=torch.long).to(device) if row_index is not None else None
        self.segs = segs or []
        self._entries: dict = {}  # ratio -> (read, write) pool rows (the paged pool)
        self._rope_e: dict = {}  # ratio -> (cos, sin) float32 at each new entry's position
        self._finish: list = []  # write-backs of TensorEntries after the layer

    def rope_of(self, attn) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) at the rows' positions for `attn`'s RoPE (model dtype)."""
        return self.rope["compress" if attn.ratio else "main"]

    def inputs(self, attn, layer: int | None = None) -> tuple:
        """`decode_core`'s stacked state of `attn`'s layer: (keys, cstate, centries, istate, ientries)."""
        i = self._layer(attn) if layer is None else layer
        sts = [s[i] for s in self.states]
        D, W1 = attn.D, attn.window - 1
        keys = self._stack([st.keys for st in sts], (W1, D), 0.0)
        cstate = centries = istate = ientries = None
        if attn.compressor is not None:
            cstate = self._comp_state([st.comp for st in sts], attn.compressor)
            floor = max(MIN_KEYS, attn.indexer.topk if attn.indexer is not None else 0)
            centries = self._rows([st.comp for st in sts], attn.ratio, floor, attn.compressor.d)
            if attn.indexer is not None:
                istate = self._comp_state([st.index for st in sts], attn.indexer.compressor)
                ientries = self._rows([st.index for st in sts], attn.ratio, floor, attn.indexer.compressor.d)
        return keys, cstate, centries, istate, ientries

    def update(self, attn, new, layer: int | None = None) -> None:
        """The layer's new stacked state (keys, cstate, istate) into each sequence's AttnState (views of
        the stacked rows), the tokens counted; entries of TensorEntries stores written back."""
        i = self._layer(attn) if layer is None else layer
        keys, cstate, istate = new
        for j, s in enumerate(self.states):
            st = s[i]
            st.keys, st.length = keys[j], st.length + 1
            for c, new_c in ((st.comp, cstate), (st.index, istate)):
                if new_c is not None:
                    self._advance(c, [t[j] if t is not None else None for t in new_c], attn.ratio, self.positions[j])
        for f in self._finish:
            f()
        self._finish = []

    def _layer(self, attn) -> int:
        """The layer index of `attn` (set by the model on each Attention)."""
        return attn.layer

    @staticmethod
    def _advance(c, new: list, ratio: int, pos: int) -> None:
        """A compressor state after one token at `pos`: its buffers, the rows pending, its entries."""
        c.buf_kv, c.buf_gate, c.prev_kv, c.prev_gate = new
        c.pending = (c.pending + 1) % ratio
        if (pos + 1) % ratio == 0:
            c.count += 1

    def _stack(self, ts: list, shape: tuple, fill: float, dtype: torch.dtype | None = None) -> torch.Tensor:
        """[rows, *shape]: each sequence's tensor (None: `fill`), pad rows zero."""
        dtype = dtype or self.dtype
        default = None
        out = []
        for t in ts:
            if t is None:
                if default is None:
                    default = torch.full(shape, fill, dtype=dtype, device=self.device)
                t = default
            out.append(t)
        if self.Bp > len(out):
            out.extend([torch.zeros(shape, dtype=dtype, device=self.device)] * (self.Bp - len(out)))
        return torch.stack(out)

    def _comp_state(self, cs: list, comp) -> tuple:
        """A compressor's stacked state (buf_kv, buf_gate, prev_kv, prev_gate); prev None without overlap."""
        m, width, d = comp.ratio, comp.wkv.out_features, comp.d
        buf_kv = self._stack([c.buf_kv for c in cs], (m, width), 0.0)
        buf_gate = self._stack([c.buf_gate for c in cs], (m, width), 0.0)
        if not comp.overlap:
            return buf_kv, buf_gate, None, None
        gate_dt = torch.promote_types(self.dtype, comp.ape.dtype)  # the gate after ape
        return (buf_kv, buf_gate, self._stack([c.prev_kv for c in cs], (m, d), 0.0),
                self._stack([c.prev_gate for c in cs], (m, d), float("-inf"), gate_dt))

    def _rows(self, cs: list, ratio: int, floor: int, width: int) -> tuple:
        """(src, write [rows], read [rows, E], cos_e, sin_e) of one compressor's entries (module docstring)."""
        stores = [c.store for c in cs]
        seen = [(p + 1) // ratio for p in self.positions]  # entries each row sees after this step
        done = [(p + 1) % ratio == 0 for p in self.positions]
        first = [p // ratio for p in self.positions]  # the index of the entry this token's window makes
        if ratio not in self._rope_e:
            pos_e = torch.tensor([f * ratio for f in first] + [0] * (self.Bp - self.B))
            self._rope_e[ratio] = self._compress.cos_sin(pos_e.to(self.device), torch.float32)
        if all(isinstance(s, PagedEntries) for s in stores) and len({id(s.t) for s in stores}) == 1:
            src = stores[0].t
            if ratio not in self._entries:  # every layer of this ratio: the same pages, the same rows
                self._entries[ratio] = self._paged_rows(stores, seen, done, first, floor, src.shape[0] - 1)
            read, write = self._entries[ratio]
        else:
            src, read, write = self._tensor_rows(stores, seen, done, first, floor, width)
        return (src, write, read) + self._rope_e[ratio]

    def _paged_rows(self, stores: list, seen: list, done: list, first: list, floor: int, null: int) -> tuple:
        """(read, write) pool rows of the sequences' pages; padding and not-complete windows: row `null`."""
        per = stores[0].per_page
        E = entry_bucket(max(seen, default=0), floor, null)
        read = torch.full((self.Bp, E), null, dtype=torch.long)
        write = torch.full((self.Bp,), null, dtype=torch.long)
        for j, s in enumerate(stores):
            pages = torch.tensor(s.seq.pages, dtype=torch.long)
            w = torch.arange(seen[j])
            read[j, :seen[j]] = pages[w // per] * per + w % per
            if done[j]:
                write[j] = pages[first[j] // per] * per + first[j] % per
        return read.to(self.device), write.to(self.device)

    def _tensor_rows(self, stores: list, seen: list, done: list, first: list, floor: int, width: int) -> tuple:
        """The model's own per-sequence tensors: one concatenation of every sequence's entries (plus a
        spare row each for its new entry and a last row read by padding); completed entries written
        back into each store after the layer (`update`)."""
        E = entry_bucket(max(seen, default=0), floor, None)
        chunks, offs, n = [], [], 0
        for s, k in zip(stores, first):
            offs.append(n)
            if s.t is not None and k:
                chunks.append(s.t[:k].to(self.dtype))
            chunks.append(torch.zeros((1, width), dtype=self.dtype, device=self.device))
            n += k + 1
        src = torch.cat(chunks + [torch.zeros((1, width), dtype=self.dtype, device=self.device)])
        null = src.shape[0] - 1
        read = torch.full((self.Bp, E), null, dtype=torch.long)
        write = torch.full((self.Bp,), null, dtype=torch.long)
        for j, s in enumerate(stores):
            read[j, :seen[j]] = offs[j] + torch.arange(seen[j])
            write[j] = offs[j] + first[j]
            if done[j]:
                self._finish.append(lambda s=s, r=offs[j] + first[j], k=first[j]: s.write(k, src[r:r + 1]))
        return src, read.to(self.device), write.to(self.device)
