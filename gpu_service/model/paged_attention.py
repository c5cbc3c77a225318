"""Batched paged MLA attention: every decode sequence of a step in one call over the page table.

The plain path (`MLA.forward` in deepseek.py, kept as the reference) loops over the step's chunks
in Python: per chunk and layer it builds the chunk's slot indices, gathers its whole history
(`kv[slots]`) and runs its own einsums. Here the step's metadata is built once per step and device
(`StepView`, a list of the chunks that also carries `.paged`, a `PagedMeta`), and each MLA layer

- writes all new c_kv/k_pe (and V3.2 index keys) with one `index_copy_` at precomputed slots;
- attends for all one-token (decode) chunks at once, in the weight-absorbed form:
  on CUDA with FlashInfer's MLA paged kernel when `flashinfer` imports (reads c_kv/k_pe in place
  through the slot list, page size 1; V3.2's top-k selection passed as each query's slot list),
  else a batched torch path: one gather of the step's pages through the padded page table
  [B, P * page_size] and one set of bmm / softmax, padded key positions masked to -inf (so they
  contribute exact zeros: no padding enters the arithmetic of a sequence's real keys);
- runs prefill chunks (n > 1) through the reference expanded path (`MLA._attend`) per chunk.

DeepSeek-V3.2: the lightning indexer's scores for the decode queries are computed batched over
the same padded slots (`select_decode`), top-`index_topk` per query, as a keep-mask.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from gpu_service.model.kv import Chunk, KVPool
from gpu_service.model.qlinear import weight_of

try:  # optional: the `flashinfer` extra, installed only where CUDA is
    import flashinfer as _flashinfer  # type: ignore
except Exception:  # noqa: BLE001 - absent or broken: the torch path
    _flashinfer = None


FLASHINFER_MLA_DIMS = {(512, 64)}  # (kv_lora_rank, rope) FlashInfer's MLA kernels are built for (DeepSeek's)


@dataclass
class PagedMeta:
    """One micro-batch's attention metadata on one device, built once per step."""

    write_slots: torch.Tensor  # [T] long: the pool slot of every new token (chunks concatenated)
    dec_rows: torch.Tensor | None  # [Bd] rows of x that are decode tokens; None: every row is one
    key_slots: torch.Tensor | None  # [Bd, Smax] long: padded page table expanded to slots
    invalid: torch.Tensor | None  # [Bd, 1, Smax] bool: key position >= the sequence's length
    lengths: list[int]  # [Bd] keys each decode query sees (its position + 1)
    prefill: list[tuple[slice, torch.Tensor, int]]  # per chunk of n > 1: (rows, history slots, start)
    fi_indptr: torch.Tensor | None = None  # FlashInfer (CUDA): kv_indptr [Bd + 1] int32
    fi_indices: torch.Tensor | None = None  # FlashInfer: valid slots concatenated, int32
    fi_slot: int = 0  # which of the device's FlashInfer wrappers (one per live micro-batch)
    fi_planned: bool = False  # the wrapper holds this step's dense plan (V3: once per step)


class StepView(list):
    """The chunks of one micro-batch (a plain list of `Chunk` to every reader) plus `.paged`."""

    paged: PagedMeta


def build_meta(chunks: list[Chunk], pool: KVPool, device: torch.device) -> PagedMeta:
    """Slot indices and masks of a step, from the chunks' page lists (pages already reserved)."""
    ps = pool.page_size
    write, dec_rows, dec_pages, lengths, prefill = [], [], [], [], []
    t0 = 0
    for ch in chunks:
        pages = ch.seq.pages
        write.extend(pages[p // ps] * ps + p % ps for p in range(ch.start, ch.start + ch.n))
        if ch.n == 1:
            dec_rows.append(t0)
            dec_pages.append(pages[: -(-(ch.start + 1) // ps)])
            lengths.append(ch.start + 1)
        else:
            hist = [pages[p // ps] * ps + p % ps for p in range(ch.start + ch.n)]
            prefill.append((slice(t0, t0 + ch.n), torch.tensor(hist, dtype=torch.long).to(device), ch.start))
        t0 += ch.n
    meta = PagedMeta(torch.tensor(write, dtype=torch.long).to(device),
                     None if len(dec_rows) == t0 else torch.tensor(dec_rows, dtype=torch.long).to(device),
                     None, None, lengths, prefill)
    if dec_rows:
        P = max(max(len(p) for p in dec_pages), -(-MIN_KEYS // ps))  # at least MIN_KEYS columns
        table = torch.tensor([p + [0] * (P - len(p)) for p in dec_pages], dtype=torch.long)  # [Bd, P] padded
        slots = (table[:, :, None] * ps + torch.arange(ps)).view(len(dec_pages), P * ps)  # [Bd, Smax]
        invalid = torch.arange(P * ps)[None, None, :] >= torch.tensor(lengths)[:, None, None]  # [Bd, 1, Smax]
        slots = slots.masked_fill(invalid[:, 0], pool.null_slot)  # padded keys read the pool's zero row
        meta.key_slots, meta.invalid = slots.to(device), invalid.to(device)
        if device.type == "cuda" and _flashinfer is not None and (pool.cfg.kv_lora_rank, pool.cfg.qk_rope_head_dim) \
                in FLASHINFER_MLA_DIMS:
            flat = torch.cat([slots[i, :n] for i, n in enumerate(lengths)])
            meta.fi_indices = flat.to(device=device, dtype=torch.int32)
            meta.fi_slot = _FI_TURN[device] = (_FI_TURN.get(device, -1) + 1) % FI_SLOTS
            meta.fi_indptr = torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0).to(device=device,
                                                                                            dtype=torch.int32)
    return meta


def step_view(chunks: list[Chunk], pool: KVPool, device: torch.device) -> StepView:
    view = StepView(chunks)
    view.paged = build_meta(chunks, pool, device)
    return view


def mla_forward(mla, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                meta: PagedMeta, ik: torch.Tensor | None = None) -> torch.Tensor:
    """`MLA.forward` over a `PagedMeta`: the same projections, one KV write, batched decode attention."""
    T = x.shape[0]
    q_resid = None
    if mla.indexer is None:
        q = mla._q(x).view(T, mla.nh, mla.nope + mla.rdim)
    else:
        q_resid = mla.q_a_layernorm(mla.q_a_proj(x))  # [T, q_lora_rank]
        q = mla.q_b_proj(q_resid).view(T, mla.nh, mla.nope + mla.rdim)
        ik.index_copy_(0, meta.write_slots, mla.indexer.keys(x, cos, sin).to(ik.dtype))
    ckv = mla.kv_a_proj_with_mqa(x)  # [T, r + rope]
    # one RoPE for the queries' and the new key's rope parts (elementwise: the same values as two)
    pe = mla.rope.apply(torch.cat([q[..., mla.nope:], ckv[:, None, mla.r:]], dim=1), cos, sin)  # [T, nh + 1, rope]
    q_nope, q_pe, k_pe = q[..., : mla.nope], pe[:, : mla.nh], pe[:, mla.nh]  # [T,nh,nope], [T,nh,rope], [T,rope]
    kv.index_copy_(0, meta.write_slots, torch.cat([mla.kv_a_layernorm(ckv[:, : mla.r]), k_pe], dim=-1).to(kv.dtype))
    out = None if meta.dec_rows is None else x.new_empty(T, mla.nh * mla.vdim)
    wkv = weight_of(mla.kv_b_proj, x.dtype)  # dequantised once per call (issue 21's scratch), shared by every chunk
    for sl, hist, start in meta.prefill:  # the reference expanded path, per prefill chunk
        cache = kv[hist].to(x.dtype)
        keep = None
        if mla.indexer is not None:
            keep = mla.indexer.select(x[sl], q_resid[sl], cos[sl], sin[sl], ik[hist].to(x.dtype), start)
        out[sl] = mla._attend(q_nope[sl], q_pe[sl], cache, start, keep, wkv)
    if meta.key_slots is not None:
        rows = meta.dec_rows
        pick = (lambda t: t) if rows is None else (lambda t: t.index_select(0, rows))
        keep = None
        if mla.indexer is not None:
            keep = select_decode(mla.indexer, pick(x), pick(q_resid), pick(cos), pick(sin), ik, meta)
        o = decode_attention(mla, pick(q_nope), pick(q_pe), kv, meta, keep, wkv)
        if rows is None:
            out = o
        else:
            out.index_copy_(0, rows, o)
    return mla.o_proj(out)


def decode_attention(mla, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor, meta: PagedMeta,
                     keep: torch.Tensor | None = None, wkv: torch.Tensor | None = None) -> torch.Tensor:
    """Weight-absorbed attention of one query per decode sequence. q_nope [B, nh, nope], q_pe
    [B, nh, rope]; keep [B, Smax] bool (V3.2 selection) or None. Returns [B, nh * v_head_dim]."""
    B, r = q_nope.shape[0], mla.r
    if wkv is None:
        wkv = weight_of(mla.kv_b_proj, q_nope.dtype)
    wkv = wkv.view(mla.nh, mla.nope + mla.vdim, r)
    q_abs = torch.einsum("bhd,hdr->bhr", _min_rows(q_nope), wkv[:, : mla.nope])[:B]  # [B, nh, r]
    if meta.fi_indices is not None and kv.device.type == "cuda":
        o_lat = _flashinfer_decode(mla, q_abs, q_pe, kv, meta, keep)  # [B, nh, r]
    else:
        o_lat = torch_attend(torch.cat([q_abs, q_pe], dim=-1), kv, meta, keep, mla.scaling, r)  # [B, nh, r]
    o = torch.einsum("bhr,hvr->bhv", _min_rows(o_lat), wkv[:, mla.nope:])[:B]  # [B, nh, v]
    return o.reshape(B, -1)


def torch_attend(q: torch.Tensor, kv: torch.Tensor, meta: PagedMeta, keep: torch.Tensor | None,
                 scaling, r: int, out: torch.Tensor | None = None, ninf=float("-inf")) -> torch.Tensor:
    """The batched torch path: q [B, nh, r + rope] (absorbed query ++ q_pe) against the step's
    padded slots -> o_lat [B, nh, r] (into `out` when given). At most max(pool slots +
    B * MIN_KEYS, Smax) keys are gathered at once (row groups otherwise: the plan's decode
    workspace); a row's result does not depend on its group."""
    B, Smax = q.shape[0], meta.key_slots.shape[1]
    per = max(1, (kv.shape[0] + B * MIN_KEYS) // Smax)
    if out is None:
        out = q.new_empty(B, q.shape[1], r) if per < B else None
    for b0 in range(0, B, per):
        b1 = min(B, b0 + per)
        whole = b0 == 0 and b1 == B
        slots = meta.key_slots if whole else meta.key_slots[b0:b1]
        cache = kv.index_select(0, slots.reshape(-1)).view(b1 - b0, Smax, kv.shape[1])  # one gather
        if cache.dtype != q.dtype:
            cache = cache.to(q.dtype)
        # keys as the GEMM's rows (M = Smax, K and N fixed): a key's score does not depend on Smax
        scores = torch.bmm(cache, (q if whole else q[b0:b1]).transpose(1, 2)).transpose(1, 2)  # [b, nh, Smax]
        scores = scores.float().contiguous() if scores.dtype != torch.float32 else scores.contiguous()
        mask = meta.invalid if keep is None else ~keep[:, None, :]
        p = torch.softmax(scores.masked_fill_(mask if whole else mask[b0:b1], ninf).mul_(scaling), dim=-1)
        p = p if p.dtype == q.dtype else p.to(q.dtype)
        if out is None:
            return torch.bmm(p, cache[..., :r])
        torch.bmm(p, cache[..., :r], out=out[b0:b1])
    return out


MIN_ROWS = 4
# Padded key columns at least: below a vector's worth or so the CPU softmax takes a scalar path
# (another exp, another summation order) that a longer padded row in a batch would not take.
MIN_KEYS = 64


def _min_rows(t: torch.Tensor) -> torch.Tensor:
    """t padded with zero rows to at least MIN_ROWS: the CPU GEMM takes another code path (and
    another summation order) for 1-3 rows, so a sequence alone would differ in the last bits from
    the same sequence in a batch (tests/test_paged_attention.py checks bit-identity)."""
    if t.shape[0] >= MIN_ROWS or t.device.type != "cpu":
        return t
    return torch.cat([t, t.new_zeros((MIN_ROWS - t.shape[0],) + tuple(t.shape[1:]))])


def select_decode(indexer, x: torch.Tensor, q_resid: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  ik: torch.Tensor, meta: PagedMeta) -> torch.Tensor | None:
    """V3.2 lightning-indexer selection for the decode queries (one per sequence), batched over
    the padded slots: keep [B, Smax] bool (valid AND among the top-`index_topk`), or None when
    every sequence has at most index_topk keys (dense)."""
    if max(meta.lengths) <= indexer.topk:
        return None
    return select_decode_qw(indexer, *indexer.query(x, q_resid, cos, sin), ik, meta)


def select_decode_qw(indexer, q: torch.Tensor, w: torch.Tensor, ik: torch.Tensor, meta: PagedMeta) -> torch.Tensor | None:
    """select_decode from the indexer's roped queries q [B, nh, hd] and head weights w [B, nh]
    (already times nh^-0.5): what the fused decode step computes in its graph-captured segment.
    Like torch_attend, at most max(pool slots + B * MIN_KEYS, Smax) keys are gathered at once (row
    groups otherwise: the plan's decode workspace); a row's selection does not depend on its group."""
    if max(meta.lengths) <= indexer.topk:
        return None
    B, Smax = meta.key_slots.shape
    per = max(1, (ik.shape[0] + B * MIN_KEYS) // Smax)
    keep = torch.zeros_like(meta.invalid[:, 0])  # [B, Smax] bool
    for b0 in range(0, B, per):
        b1 = min(B, b0 + per)
        keys = ik.index_select(0, meta.key_slots[b0:b1].reshape(-1)).view(b1 - b0, Smax, ik.shape[1]).float()
        scores = torch.relu(torch.bmm(q[b0:b1].float(), keys.transpose(1, 2)) * indexer.softmax_scale)  # [b, nh, Smax]
        del keys
        index = torch.bmm(w[b0:b1, None, :], scores)[:, 0].masked_fill_(meta.invalid[b0:b1, 0], float("-inf"))
        del scores
        keep[b0:b1].scatter_(1, index.topk(min(indexer.topk, Smax), dim=-1).indices, True)
    return keep.logical_and_(~meta.invalid[:, 0])


# ---- CUDA: FlashInfer's MLA paged kernel (optional; not exercised on CPU-only machines) ----------
_FI_WRAPPERS: dict = {}  # (device, slot) -> wrapper; the float workspace is shared per device
_FI_WORKSPACE: dict = {}
_FI_TURN: dict = {}
FI_SLOTS = 2  # micro-batches alive in one step (ping-pong): each plans its own wrapper


def _flashinfer_decode(mla, q_abs, q_pe, kv, meta: PagedMeta, keep):
    """o_lat [B, nh, r] from FlashInfer's BatchMLAPagedAttentionWrapper, page size 1: kv_indices are
    the slots each query reads (V3.2: only its selected slots), c_kv / k_pe views of the pool."""
    dev = kv.device
    if keep is None:
        indptr, indices = meta.fi_indptr, meta.fi_indices
    else:
        indices = meta.key_slots[keep].to(torch.int32)  # each query's selected slots, rows in order
        indptr = torch.cat([keep.new_zeros(1, dtype=torch.int32),
                            keep.sum(1).cumsum(0).to(torch.int32)])
    wrapper = _FI_WRAPPERS.get((dev, meta.fi_slot))
    if wrapper is None:
        if dev not in _FI_WORKSPACE:
            _FI_WORKSPACE[dev] = torch.empty(128 * 1024 * 1024, dtype=torch.int8, device=dev)
        wrapper = _FI_WRAPPERS[(dev, meta.fi_slot)] = _flashinfer.mla.BatchMLAPagedAttentionWrapper(
            _FI_WORKSPACE[dev], backend="auto")
    if keep is not None or not meta.fi_planned:  # dense: one plan serves every layer of the step
        B = q_abs.shape[0]
        lens = (indptr[1:] - indptr[:-1]).to(torch.int32)
        wrapper.plan(torch.arange(B + 1, device=dev, dtype=torch.int32), indptr, indices, lens, mla.nh, mla.r,
                     mla.rdim, 1, False, mla.scaling, q_abs.dtype, kv.dtype)
        meta.fi_planned = keep is None
    ckv = kv[:, None, : mla.r]  # [slots, 1, r]: pages of one token, read in place
    kpe = kv[:, None, mla.r:]
    return wrapper.run(q_abs.contiguous(), q_pe.contiguous(), ckv, kpe)
