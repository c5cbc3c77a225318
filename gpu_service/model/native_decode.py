"""The native decode step: a DeepSeek-V3 layer of an all-decode step on CPU float32 in C (issue 20).

On CPU the torch fused step (fast_decode.py) still costs ~110 torch ops per layer, each >= 3 µs of
dispatch: the fixed cost per MoE layer was ~900 µs on this 2-core VM. Here each layer is three
calls into `gpu_service.model._native_decode` (native_decode.c):

    attn    everything before the expert hand-off: norms, projections, RoPE, the new cache rows at
            their slots, attention over each sequence's own paged keys, o_proj, residual, router
    (expert hand-off: the shards start on h / ids / w, the generator yields)
    mlp     the shared expert (or the dense MLP) while the shards work
    add     residual + routed + shared

Every row is computed alone in one fixed order, so a sequence's result is bit-identical alone or
in any batch (no row padding needed) and on every replica of the same build. The values equal the
torch paths' up to float32 rounding (other summation orders; tests/test_native_decode.py).

V3.2: the lightning indexer's new key, query and head weights are computed in nd_attn too, and a
query with more than index_topk keys attends to its index_topk best (ties: the earlier position).

With remote shards on the same host whose shared-memory paths are idle, `remote_step` runs the whole
step, hand-offs included, in one C call (native_remote.c; gpu_service.experts.native_handoff claims
the paths and settles failures, after which the step runs again here in Python).

Used when: the step is all-decode on a CPU device, the compute dtype is float32, every linear of the layer is a plain float32 nn.Linear without bias, and either torch
runs one thread or the layer's weights are small (<= NATIVE_MAX_LAYER_BYTES): the C code runs on
one thread, so a large model on a many-core CPU keeps torch's threaded GEMMs. `ModelRunner`'s decode
path 'fused' (MOESPLIT_DECODE_PATH=fused) selects the torch fused step instead, for comparisons.
"""
from __future__ import annotations

import torch
from torch import nn

from gpu_service.model import paged_attention
from gpu_service.model.fast_decode import FastBlock

try:
    from gpu_service.model import _native_decode as _c
except ImportError:  # not built (`make build` / `pip install -e .` builds it): the torch fused path
    _c = None

NATIVE_MAX_LAYER_BYTES = 64 << 20


class HandoffFailed(Exception):
    """A C expert hand-off (gpu_service.runtime.native_calls) stopped: refused, broken, past its
    deadline or interrupted. DeepseekV3 re-runs the step with the Python hand-off."""

    def __init__(self, rc: int):
        super().__init__(f"native hand-off stopped ({rc})")
        self.rc = rc


def available() -> bool:
    return _c is not None


def _w(lin) -> torch.Tensor | None:
    """A plain float32 CPU nn.Linear's contiguous weight, else None."""
    if type(lin) is not nn.Linear or lin.bias is not None:
        return None
    w = lin.weight
    if w.dtype != torch.float32 or w.device.type != "cpu" or not w.is_contiguous():
        return None
    return w


def _norm_w(norm) -> torch.Tensor | None:
    w = norm.weight
    return w if w.dtype == torch.float32 and w.device.type == "cpu" and w.is_contiguous() else None


class NativeBlock:
    """One layer's C handle (weight pointers resolved once; the tensors stay owned by the model)."""

    def __init__(self, layer_c, keep: list, moe, has_mlp: bool, H: int, k: int):
        self.c, self.keep, self.moe, self.has_mlp, self.H, self.k = layer_c, keep, moe, has_mlp, H, k


def build_block(blk) -> NativeBlock | None:
    """The layer's NativeBlock, or None where a weight is not a plain float32 CPU tensor."""
    mla = blk.self_attn
    cfg = mla.cfg
    if _c is None or (cfg.is_v32 and not cfg.q_lora_rank):
        return None
    ql = cfg.q_lora_rank or 0
    lin = {"w_q": _w(mla.q_a_proj if ql else mla.q_proj), "w_kva": _w(mla.kv_a_proj_with_mqa),
           "w_qb": _w(mla.q_b_proj) if ql else None, "w_kvb": _w(mla.kv_b_proj), "w_o": _w(mla.o_proj)}
    norms = {"in_norm": blk.input_layernorm, "kv_norm": mla.kv_a_layernorm, "post_norm": blk.post_attention_layernorm}
    if ql:
        norms["q_norm"] = mla.q_a_layernorm
    nw = {k: _norm_w(v) for k, v in norms.items()}
    if any(v is None for k, v in lin.items() if k != "w_qb" or ql) or any(v is None for v in nw.values()):
        return None
    moe = blk.mlp if hasattr(blk.mlp, "gate") else None
    mlp = moe.shared_experts if moe is not None else blk.mlp
    ptrs = {k: v.data_ptr() if v is not None else 0 for k, v in {**lin, **nw}.items()}
    ptrs.setdefault("q_norm", 0)
    keep = [v for v in list(lin.values()) + list(nw.values()) if v is not None]
    dims = {"H": cfg.hidden_size, "nh": mla.nh, "nope": mla.nope, "rd": mla.rdim, "r": mla.r, "vd": mla.vdim,
            "qlr": ql, "interleave": int(bool(mla.rope.interleave)), "scaling": float(mla.scaling),
            "eps_in": blk.input_layernorm.eps, "eps_kv": mla.kv_a_layernorm.eps,
            "eps_q": mla.q_a_layernorm.eps if ql else 0.0, "eps_post": blk.post_attention_layernorm.eps,
            "E": 0, "k": 0, "n_group": 1, "topk_group": 1, "norm_topk": 0, "route_scale": 1.0, "inter": 0}
    ptrs.update(w_router=0, router_bias=0, w_gate=0, w_up=0, w_down=0)
    if moe is not None:
        g = moe.gate
        rw, rb = g.weight, g.e_score_correction_bias
        if rw.dtype != torch.float32 or rb.dtype != torch.float32 or not rw.is_contiguous() or rw.device.type != "cpu":
            return None
        E = cfg.n_routed_experts
        if cfg.n_group > 1 and (E % cfg.n_group or E // cfg.n_group < 2):
            return None
        dims.update(E=E, k=cfg.num_experts_per_tok, n_group=max(1, cfg.n_group), topk_group=cfg.topk_group,
                    norm_topk=int(bool(cfg.norm_topk_prob)), route_scale=float(cfg.routed_scaling_factor))
        ptrs.update(w_router=rw.data_ptr(), router_bias=rb.data_ptr())
        keep += [rw, rb]
    if mlp is not None:
        gw, uw, dw = _w(mlp.gate_proj), _w(mlp.up_proj), _w(mlp.down_proj)
        if gw is None or uw is None or dw is None:
            return None
        dims["inter"] = gw.shape[0]
        ptrs.update(w_gate=gw.data_ptr(), w_up=uw.data_ptr(), w_down=dw.data_ptr())
        keep += [gw, uw, dw]
    ix = mla.indexer
    if ix is not None:  # DeepSeek-V3.2's lightning indexer
        iq, ikw, iw = _w(ix.wq_b), _w(ix.wk), _w(ix.weights_proj)
        kn_w, kn_b = _norm_w(ix.k_norm), ix.k_norm.bias
        if iq is None or ikw is None or iw is None or kn_w is None or kn_b is None or kn_b.dtype != torch.float32:
            return None
        dims.update(ih=ix.nh, ihd=ix.hd, itopk=ix.topk, ieps=float(ix.k_norm.eps), iscale=float(ix.softmax_scale),
                    iwscale=float(ix.nh ** -0.5))
        ptrs.update(w_iq=iq.data_ptr(), w_ik=ikw.data_ptr(), w_iw=iw.data_ptr(), ik_norm_w=kn_w.data_ptr(),
                    ik_norm_b=kn_b.data_ptr())
        keep += [iq, ikw, iw, kn_w, kn_b]
    if sum(t.numel() * 4 for t in keep) > NATIVE_MAX_LAYER_BYTES and torch.get_num_threads() > 1:
        return None  # one C thread against torch's threaded GEMMs on a large layer: keep torch
    return NativeBlock(_c.Layer(dims, ptrs, keep), keep, moe, mlp is not None, cfg.hidden_size,
                       cfg.num_experts_per_tok if moe is not None else 0)


class _Cache(dict):
    """The model's NativeBlocks; a deep copy of the model (e.g. moved to CUDA in tests) starts empty."""

    def __deepcopy__(self, memo):
        return _Cache()


def native_blocks(model) -> list[NativeBlock] | None:
    """Every layer's NativeBlock (built once; rebuilt when the first or last layer's weights moved
    or torch's thread count crossed 1), or None when any layer cannot run natively."""
    cache = model.__dict__.get("_native_blocks")
    if cache is None:
        cache = model.__dict__["_native_blocks"] = _Cache()
    layers = model.model.layers
    key = (len(layers), FastBlock.fingerprint(layers[0]), FastBlock.fingerprint(layers[-1]), torch.get_num_threads() > 1)
    if cache.get("key") != key:
        blocks = [build_block(b) for b in layers]
        cache["key"], cache["blocks"] = key, None if any(b is None for b in blocks) else blocks
    return cache["blocks"]


def eligible(model, meta, dev: torch.device, dtype: torch.dtype) -> list[NativeBlock] | None:
    """The layers' NativeBlocks for an all-decode step on CPU float32 whose every layer runs
    natively, else None."""
    if (_c is None or not getattr(model, "native_decode", True) or dev.type != "cpu" or dtype != torch.float32
            or not _all_decode(meta)):
        return None
    return native_blocks(model)


def _all_decode(meta) -> bool:
    return meta is not None and meta.dec_rows is None and not meta.prefill and meta.key_slots is not None


class NativeStep:
    """One step's metadata for the C layers: slots, lengths, the RoPE rows, scratch."""

    def __init__(self, blocks: list[NativeBlock], meta, cos: torch.Tensor, sin: torch.Tensor, B: int):
        self.B, self.blocks = B, blocks  # no row padding: rows are computed alone
        ks = meta.key_slots.contiguous()
        self.lengths = torch.tensor(meta.lengths, dtype=torch.int64)
        if ks.dtype != torch.int64 or ks.shape[0] != B or int(self.lengths.max()) > ks.shape[1]:
            raise ValueError(f"native decode: key_slots {tuple(ks.shape)} {ks.dtype} for {B} rows, "
                             f"lengths up to {int(self.lengths.max())}")
        self.ws = meta.write_slots.contiguous()
        self.ks, self.cos, self.sin = ks, cos.float().contiguous(), sin.float().contiguous()
        self.scratch = torch.empty(max(b.c.scratch_floats(B, ks.shape[1]) for b in blocks), dtype=torch.float32)
        self.c = _c.Step(B, ks.shape[1], self.ws.data_ptr(), ks.data_ptr(), self.lengths.data_ptr(),
                         self.cos.data_ptr(), self.sin.data_ptr(), self.scratch.data_ptr())
        self.sp = self.scratch.data_ptr()


def _add(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """x + a (+ b) as the torch paths sum it: (a + b) + x."""
    ok = all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.shape == x.shape
             for t in ((x, a) if b is None else (x, a, b)))
    if not ok:
        return x + a if b is None else (a + b).add_(x)
    out = torch.empty_like(x)
    _c.add(x.numel(), x.data_ptr(), a.data_ptr(), 0 if b is None else b.data_ptr(), out.data_ptr())
    return out


def block_steps(nb: NativeBlock, x: torch.Tensor, st: NativeStep, kv: torch.Tensor, experts,
                ik: torch.Tensor | None = None):
    """Generator like Block.steps over x [B, H] float32: yields once while the experts work
    (ik: the layer's V3.2 index-key cache)."""
    if not x.is_contiguous():
        x = x.contiguous()
    for t in (kv,) if ik is None else (kv, ik):
        if t.dtype != torch.float32 or not t.is_contiguous():
            raise ValueError(f"native decode: a cache is {t.dtype}, expected a contiguous float32 cache")
    ikp = 0 if ik is None else ik.data_ptr()
    B, H = st.B, nb.H
    x1, h = torch.empty(B, H), torch.empty(B, H)
    if nb.moe is None:  # dense layer
        nb.c.attn(st.c, kv.data_ptr(), ikp, x.data_ptr(), x1.data_ptr(), h.data_ptr(), 0, 0)
        m = torch.empty(B, H)
        nb.c.mlp(B, h.data_ptr(), m.data_ptr(), st.sp)
        return _add(x1, m, None)
    ids, w = torch.empty(B, nb.k, dtype=torch.int64), torch.empty(B, nb.k)
    nb.c.attn(st.c, kv.data_ptr(), ikp, x.data_ptr(), x1.data_ptr(), h.data_ptr(), ids.data_ptr(), w.data_ptr())
    moe = nb.moe
    wait = experts(moe.layer, h, ids, w if moe.experts is None else moe.remote_weights(ids, w))
    yield
    shared = None
    if nb.has_mlp:
        shared = torch.empty(B, H)
        nb.c.mlp(B, h.data_ptr(), shared.data_ptr(), st.sp)
    routed = wait()
    if moe.experts is not None:
        routed = routed + moe.hot_output(h, ids, w, routed)
    return _add(x1, routed, shared)


RUN_OK = 0


def remote_step(model, groups: list, bounds: list[int], x: torch.Tensor, positions: torch.Tensor, pool,
                experts, all_decode: bool) -> torch.Tensor | None:
    """The whole all-decode step in C with its expert hand-offs (native_remote.c): x [T, H] float32
    embeddings -> the last layer's hidden states, or None where it cannot run (the caller takes the
    Python path) or stopped early (settled by Handoff.finish; the caller re-runs the step, see
    gpu_service.experts.native_handoff). groups: the micro-batches' chunks, bounds their row offsets;
    all_decode: every chunk is one token."""
    claim = getattr(experts, "claim_native_step", None)
    if (not all_decode or claim is None or _c is None or not getattr(model, "native_decode", True)
            or not getattr(model, "native_remote", True) or x.device.type != "cpu"
            or x.dtype != torch.float32 or not model.batched_attention):
        return None
    cfg = model.cfg
    H, k = cfg.hidden_size, cfg.num_experts_per_tok
    rows = [b - a for a, b in zip(bounds[:-1], bounds[1:])]
    if any(t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous()
           for t in (*pool.kv, *(pool.index_k or ()))):
        return None
    blocks = native_blocks(model)  # (cached per model)
    if blocks is None or any(nb.moe is not None and nb.moe.experts is not None for nb in blocks):
        return None  # e.g. FP8 attention weights; GPU-resident hot experts (the Python path adds them)
    ho = claim(rows, k, _c.has_f16())
    if ho is None:
        return None
    rc, run = -1, None
    try:
        steps = []
        for g, a, b in zip(groups, bounds[:-1], bounds[1:]):
            meta = paged_attention.build_meta(g, pool, x.device)
            if not _all_decode(meta):
                return None
            steps.append(NativeStep(blocks, meta, *model.rope.cos_sin(positions[a:b], x.dtype), b - a))
        xs = [x[a:b].contiguous().clone() for a, b in zip(bounds[:-1], bounds[1:])]
        bufs = [torch.empty(_c.buf_bytes(n, H, k), dtype=torch.uint8) for n in rows]
        ik = [0] * len(blocks) if pool.index_k is None else [t.data_ptr() for t in pool.index_k]
        run = _c.RemoteRun([nb.c for nb in blocks], [nb.moe.layer if nb.moe is not None else -1 for nb in blocks],
                           [t.data_ptr() for t in pool.kv], ik, H, k, [s.c for s in steps],
                           [t.data_ptr() for t in xs], [t.data_ptr() for t in bufs], ho.paths, ho.timeout_s,
                           ho.spin_s, ho.seq0)
        rc = run.run()
    finally:
        if run is None:
            ho.release()
        else:
            ho.finish(rc, run.fail_path, run.fail_msg, run.calls(), run.path_calls())
    if rc != RUN_OK:
        return None
    return torch.cat(xs) if len(xs) > 1 else xs[0]
