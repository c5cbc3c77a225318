"""DeepSeek-V3 / V3.2 (and Kimi-K2, the same architecture) minus the routed experts: the one model
definition the runtime runs, prefill and decode, on CPU and CUDA.

Embeddings, RMSNorm, MLA attention over the paged compressed KV cache (gpu_service/model/mla.py;
the attention math itself is the backend's, gpu_service/attention), the dense MLP layers, the
router (sigmoid + correction bias, group-limited top-k), shared experts and lm_head. Routed
experts are never loaded here: each MoE layer hands its tokens to an `ExpertsFn`
(gpu_service/model/experts_api.py) and waits for its handle after the shared expert.

A forward pass takes a flat token batch made of per-sequence chunks (continuous batching). The
step is split into two micro-batches of whole sequences (ping-pong): while one micro-batch's
experts are on the shards the other computes its attention. Each layer runs as pieces:

    pre     input norm + MLA projections (`MLA.project`)
    (attention core, eager: `MLA.core`)
    mid     W_UV (all-decode), o_proj, residual, post-attention norm, router  ->  x, h, ids, w
    (expert hand-off, eager: the shards start on h / ids / w)
    shared  the shared expert or the dense MLP, while the shards work
    post    residual + routed + shared

`Step.run` runs a piece eagerly or as a replay of its CUDA graph, where the runner gave the step a
graph set (all-decode steps up to the largest bucket; gpu_service.runtime.cuda_graphs). Rows are
padded to the CPU's GEMM row block (gpu_service.model.rows) or to the graph bucket: a sequence's
result is bit-identical alone or batched; pad rows are zeros, never sent to the experts nor written.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from torch import nn

from checkpoint.config import ModelConfig
from gpu_service.attention import select_backend
from gpu_service.model.experts_api import ExpertsFn
from gpu_service.model.kv import Chunk, KVPool
from gpu_service.model.layers import MLP, RMSNorm, Rope, Router
from gpu_service.model.mla import MLA
from gpu_service.model import fp8_gemm
from gpu_service.model.qlinear import make_quantized, reserve_scratch, weight_of
from gpu_service.model.rows import pad_rows, padded, row_block
from gpu_service.model.step import make_step, Step


class MoE(nn.Module):
    """Router + shared experts; routed experts on the shards, except the optional hot experts
    (`experts`), computed here and sent to the shards with weight 0 so that they skip them."""

    def __init__(self, cfg: ModelConfig, layer: int, hot: list[int] = ()):
        super().__init__()
        self.layer = layer
        self.gate = Router(cfg)
        self.shared_experts = (MLP(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
                               if cfg.n_shared_experts else None)
        self.hot = list(hot)
        self.experts = nn.ModuleDict({str(e): MLP(cfg.hidden_size, cfg.moe_intermediate_size) for e in self.hot}) \
            if self.hot else None

    def _hot_ids(self, device: torch.device) -> torch.Tensor:
        hot = self.__dict__.get("_hot_t")
        if hot is None or hot.device != device:
            hot = self.__dict__["_hot_t"] = torch.tensor(self.hot, device=device)
        return hot

    def remote_weights(self, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The weights sent to the shards: 0 for the GPU-resident hot experts (the shards skip them)."""
        return w.masked_fill((ids[..., None] == self._hot_ids(ids.device)).any(-1), 0.0)

    def hot_output(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """sum over the hot experts this step selected of w * expert(x) on their rows. One
        host sync finds the hot experts present; the loop is bounded by min(#hot, T * k)."""
        out = torch.zeros_like(like)
        present = (ids[..., None] == self._hot_ids(ids.device)).any(1).any(0).nonzero().flatten().tolist()  # one sync
        for j in present:
            e = self.hot[j]
            rows, cols = torch.where(ids == e)
            y = self.experts[str(e)].run(x[rows]) * w[rows, cols, None].to(x.dtype)
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class Block(nn.Module):
    """One decoder layer: MLA, then the MoE (or, in the first dense layers, an MLP)."""

    def __init__(self, cfg: ModelConfig, layer: int, rope: Rope, hot: list[int] = ()):
        super().__init__()
        self.layer = layer
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MLA(cfg, rope)
        self.mlp = MoE(cfg, layer, hot) if cfg.is_moe_layer(layer) else MLP(cfg.hidden_size, cfg.intermediate_size)

    def prepare(self, dtype: torch.dtype) -> None:
        """At load: every piece's fused weights and constants (see the modules' `prepare`)."""
        self.input_layernorm.prepare()
        self.post_attention_layernorm.prepare()
        self.self_attn.prepare(dtype)
        self.moe = self.mlp if isinstance(self.mlp, MoE) else None
        if self.moe is not None:
            self.moe.gate.prepare()
            for m in [self.moe.shared_experts] + list(self.moe.experts.values() if self.moe.experts else []):
                if m is not None:
                    m.prepare()
        else:
            self.mlp.prepare()
        self.ffn = self.mlp if self.moe is None else self.moe.shared_experts  # the MLP run beside the experts

    # ---- pieces (pure functions of tensors: CUDA-graph capturable) ----------------------------
    def pre(self, x: torch.Tensor, cs: torch.Tensor, w_uk: torch.Tensor | None) -> tuple:
        return self.self_attn.project(self.input_layernorm.norm(x), cs, w_uk)

    def mid(self, x: torch.Tensor, o: torch.Tensor, w_uv: torch.Tensor | None) -> tuple:
        """o (o_lat [Tp, nh, r] with w_uv, else values [Tp, nh, v]) -> x after attention, h = the
        post-attention norm, (MoE) ids, w."""
        if w_uv is not None:
            o = torch.bmm(o.transpose(0, 1), w_uv).transpose(0, 1)  # [Tp, nh, v]
        x = self.self_attn.o(o.reshape(x.shape[0], -1)).add_(x)  # x + o (commutative)
        h = self.post_attention_layernorm.norm(x)
        if self.moe is None:
            return x, h
        return (x, h) + self.moe.gate.route(h)

    def shared(self, h: torch.Tensor) -> torch.Tensor:
        return self.ffn.run(h)

    @staticmethod
    def post(x: torch.Tensor, routed: torch.Tensor, shared: torch.Tensor | None) -> torch.Tensor:
        return x + routed if shared is None else (routed + shared).add_(x)  # x + (routed + shared)

    def steps(self, x: torch.Tensor, st: Step, kv: torch.Tensor, ik: torch.Tensor | None, experts: ExpertsFn):
        """Generator over padded rows x [Tp, H]: attention, then (MoE layers) send to the experts
        and yield once while they work, then finish. Returns the layer output (StopIteration.value)."""
        attn, i = self.self_attn, self.layer
        if st.decode:
            w_uk, w_uv = attn.wkv(static=st.graphs is not None)
            if st.graphs is not None:
                st.graphs.persist(w_uk, w_uv)
            qcat, new, *ix = st.run(i, "pre", self.pre, x, st.cs, w_uk)
            outs = st.run(i, "mid", self.mid, x, attn.core(qcat, new, ix, kv, ik, st, None), w_uv)
        else:
            wkv = weight_of(attn.kv_b_proj, x.dtype)  # dequantised once per call, shared by the chunks
            qcat, new, *ix = self.pre(x, st.cs, None)
            outs = self.mid(x, attn.core(qcat, new, ix, kv, ik, st, wkv), None)
        if self.moe is None:
            x1, h = outs
            return x1 + st.run(i, "shared", self.shared, h)[0]
        x1, h, ids, w = outs
        T = st.T
        hb, ib, wb = (h[:T], ids[:T], w[:T]) if st.Tp > T else (h, ids, w)
        moe = self.moe
        handle = experts(moe.layer, hb, ib, wb if moe.experts is None else moe.remote_weights(ib, wb))
        yield
        shared = st.run(i, "shared", self.shared, h)[0] if self.ffn is not None else None
        routed = handle.wait()
        if moe.experts is not None:
            routed = routed + moe.hot_output(hb, ib, wb, routed)
        return st.run(i, "post", self.post, x1, pad_rows(routed, st.Tp), shared)[0]


def _round_robin(gens: list) -> list:
    """Advance generators in turn until all finish: while one micro-batch's experts are on the
    shards, the next micro-batch computes its attention (ping-pong). Returns their values."""
    out, active = [None] * len(gens), list(range(len(gens)))
    while active:
        for j in list(active):
            try:
                next(gens[j])
            except StopIteration as e:
                out[j] = e.value
                active.remove(j)
    return out


def split_micro_batches(chunks: list[Chunk]) -> list[list[Chunk]]:
    """Two micro-batches of whole sequences with about half the tokens each (one if < 2 chunks)."""
    if len(chunks) < 2:
        return [chunks]
    total, acc = sum(c.n for c in chunks), 0
    for i, c in enumerate(chunks[:-1]):
        acc += c.n
        if acc * 2 >= total:
            return [chunks[: i + 1], chunks[i + 1:]]
    return [chunks[:-1], chunks[-1:]]


class DeepseekV3(nn.Module):
    """Everything but the routed experts. Parameter names equal the checkpoint's (minus experts)."""

    def __init__(self, cfg: ModelConfig, hot_experts: dict[int, list[int]] | None = None):
        super().__init__()
        self.cfg = cfg
        self.rope = Rope(cfg)
        hot_experts = hot_experts or {}
        self.ping_pong = True  # two micro-batches overlap attention with remote experts
        self.attention_backend = None  # None: "auto" (or MOESPLIT_ATTENTION); "torch" forces the torch backend
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.model.layers = nn.ModuleList(Block(cfg, i, self.rope, hot_experts.get(i, ()))
                                          for i in range(cfg.num_hidden_layers))
        self.model.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    @property
    def layer_devices(self) -> list[torch.device]:
        return [blk.input_layernorm.weight.device for blk in self.model.layers]

    def prepare(self, dtype: torch.dtype) -> None:
        """At load: each layer's pieces, the final norm, the attention backend, the CPU row block
        of each device (measured on the model's own linear shapes), the quantised linears'
        dequantisation scratch (sized now: CUDA graphs bake its address in) and the FP8 GEMMs."""
        for blk in self.model.layers:
            blk.prepare(dtype)
        reserve_scratch(self, dtype)
        fp8_gemm.enable(self, dtype)  # opt-in (MOESPLIT_FP8_GEMM=scaled_mm); checked per linear
        self.model.norm.prepare()
        self.dtype = dtype
        self._backends: dict = {}
        cfg = self.cfg
        shapes = [(cfg.hidden_size, n) for n in (cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.n_routed_experts)]
        shapes += [(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size)]
        self._shapes = [(min(k, 2048), min(n, 2048)) for k, n in shapes]

    def backend(self, device: torch.device):
        """The attention backend of `device`, chosen once (gpu_service.attention.select_backend)."""
        b = self._backends.get(device)
        if b is None:
            b = self._backends[device] = select_backend(device, self.cfg, self.attention_backend, self.dtype)
        return b

    def row_block(self, device: torch.device) -> int:
        return row_block(device, self.dtype, self._shapes)

    def _layers(self, x: torch.Tensor, positions: torch.Tensor, chunks: list[Chunk], pool: KVPool,
                experts: ExpertsFn, graphs, slot: int):
        """Generator over all layers for one micro-batch (`slot`); yields while its experts are remote."""
        steps: dict[torch.device, Step] = {}
        T = x.shape[0]
        for i, blk in enumerate(self.model.layers):
            dev = pool.kv[i].device
            st = steps.get(dev)
            if st is None:
                st = steps[dev] = make_step(chunks, pool, dev, self.backend(dev), self.rope, positions, x.dtype,
                                            self.row_block(dev), graphs, slot)
            x = x.to(dev)
            x = x[: st.Tp] if x.shape[0] > st.Tp else pad_rows(x, st.Tp)
            x = yield from blk.steps(x, st, pool.kv[i], pool.index_k[i] if pool.index_k is not None else None,
                                     experts)
        return x[:T]

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, chunks: list[Chunk], pool: KVPool, experts: ExpertsFn,
                all_logits: bool = False, graphs=None, embeds=None) -> torch.Tensor:
        """input_ids [T] (chunks concatenated) -> logits [len(chunks), V] of each chunk's last token
        ([T, V] with all_logits); writes the chunks' KV. graphs: the runner's cuda_graphs.Graphs or None;
        embeds: (rows, [tensors]) whose concatenation replaces the embeddings of those rows (images)."""
        emb_dev = self.model.embed_tokens.weight.device
        x = self.model.embed_tokens(input_ids.to(emb_dev))  # [T, H]
        if embeds is not None:
            rows, vals = embeds
            x[torch.tensor(rows, device=emb_dev)] = torch.cat(vals).to(device=emb_dev, dtype=x.dtype)
        all_decode = all(c.n == 1 for c in chunks)
        positions = (torch.tensor([c.start for c in chunks]) if all_decode  # decode: one op
                     else torch.cat([torch.arange(c.start, c.start + c.n) for c in chunks]))
        for c in chunks:
            c.seq.reserve(c.start + c.n)
        groups = split_micro_batches(chunks) if self.ping_pong else [chunks]
        bounds = torch.tensor([0] + [sum(c.n for c in g) for g in groups]).cumsum(0).tolist()
        gens = [self._layers(x[a:b], positions[a:b], g, pool, experts, graphs, slot)
                for slot, (g, a, b) in enumerate(zip(groups, bounds[:-1], bounds[1:]))]
        outs = _round_robin(gens)
        x = torch.cat(outs) if len(outs) > 1 else outs[0]
        for c in chunks:
            c.seq.length = max(c.seq.length, c.start + c.n)
        x = x.to(self.lm_head.weight.device)
        if not all_logits:
            last = torch.tensor([c.n for c in chunks]).cumsum(0) - 1
            x = x[last.to(x.device)]
        n = x.shape[0]
        x = pad_rows(x, padded(n, self.row_block(x.device)))  # batch-invariant GEMM rows
        return self.lm_head(self.model.norm.norm(x))[:n].float()


def build_model(cfg: ModelConfig, get: Callable[[str], "object"], dtype: torch.dtype,
                device_of: Callable[[str], torch.device],
                linear_format: Callable[[str], str | None] = lambda name: None,
                get_stored: Callable[[str], "object"] | None = None,
                hot_experts: dict[int, list[int]] | None = None) -> tuple[DeepseekV3, set[str]]:
    """Build the model on the meta device and fill every parameter from `get(name) -> float32 ndarray`
    on `device_of(name)` (a missing tensor raises through `get`; routers stay float32).
    `linear_format(name)` may hold a linear quantised; an FP8 / INT4 checkpoint's own arrays
    (`get_stored`) are kept as stored. Returns the model and the checkpoint names loaded."""
    with torch.device("meta"):
        model = DeepseekV3(cfg, hot_experts)
    loaded: set[str] = set()
    for name, p in list(model.named_parameters()):
        src = name  # our parameter names are the checkpoint's
        if src == "lm_head.weight" and cfg.tie_word_embeddings:
            src = "model.embed_tokens.weight"
        mod_name, _, attr = name.rpartition(".")
        mod = model.get_submodule(mod_name)
        dev = device_of(name)
        fmt = linear_format(name) if isinstance(mod, nn.Linear) and attr == "weight" else None
        if fmt is not None:
            stored = get_stored(src) if get_stored is not None else None
            if fmt == "int4" and stored is not None and stored.format == "int4":
                a = stored.arrays
                q = make_quantized(None, "int4", dev, stored=(
                    torch.from_numpy(np.ascontiguousarray(a["weight_packed"])),
                    torch.from_numpy(np.ascontiguousarray(a["weight_scale"]).view(np.int16)).view(torch.bfloat16),
                    tuple(stored.shape)))
            elif fmt == "fp8" and stored is not None and stored.format == "fp8":
                pair = (torch.from_numpy(stored.arrays["weight"].view(np.uint8).copy()).view(torch.float8_e4m3fn),
                        torch.from_numpy(np.array(stored.arrays["weight_scale_inv"], dtype=np.float32)))
                if tuple(pair[0].shape) != tuple(p.shape):
                    raise ValueError(f"tensor {src!r} has shape {tuple(pair[0].shape)}, expected {tuple(p.shape)}")
                qc = cfg.quantization
                q = make_quantized(None, "fp8", dev, stored=pair,
                                   fp8_block=tuple(qc.block_size) if qc is not None and qc.method == "fp8" else (128, 128))
            else:
                w = torch.from_numpy(get(src))
                if tuple(w.shape) != tuple(p.shape):
                    raise ValueError(f"tensor {src!r} has shape {tuple(w.shape)}, expected {tuple(p.shape)}")
                q = make_quantized(w, fmt, dev)
            parent_name, _, child = mod_name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, q)
            loaded.add(src)
            continue
        t = torch.from_numpy(get(src))
        if tuple(t.shape) != tuple(p.shape):
            raise ValueError(f"tensor {src!r} has shape {tuple(t.shape)}, expected {tuple(p.shape)} from config.json")
        keep32 = ".mlp.gate." in name or ".indexer.weights_proj." in name  # float32 as in the reference
        mod._parameters[attr] = nn.Parameter(
            t.to(device=dev, dtype=torch.float32 if keep32 else dtype), requires_grad=False)
        loaded.add(src)
    model.prepare(dtype)  # fused weights, resolved linears and norms, the CPU row block
    return model.eval(), loaded
