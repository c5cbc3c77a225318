"""The GPU service's model runner: loads the non-expert weights, owns the KV pool, runs steps.

`ModelRunner.generate` is the simple one-request loop used by `moesplit generate`; the serving
engine (continuous batching) drives `ModelRunner.step` directly with many sequences.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

import torch

from checkpoint.config import ModelConfig
from gpu_service.model.kv import Chunk, KVPool, SeqKV
from gpu_service.model.deepseek import build_model, DeepseekV3
from gpu_service.model.prefix_cache import make_prefix_cache
from gpu_service.model.placement import Placement
from gpu_service.runtime.images import vision_embeddings
from gpu_service.runtime.sampling import sample, SamplingParams


@dataclass
class GenerationResult:
    token_ids: list[int]
    finish_reason: str
    last_logits: torch.Tensor | None = None
    timings: dict = field(default_factory=dict)


def verify_gpu_weights(reader) -> int:
    """Headers of every non-routed-expert tensor the GPU service loads: present, inside its file, of
    the shape config.json implies (`CheckpointReader.verify`); CheckpointError naming file and tensor."""
    from checkpoint.names import expected_shapes

    if not hasattr(reader, "verify"):
        return 0
    return reader.verify(list(expected_shapes(reader.config, routed=False)))


class ModelRunner:
    def __init__(self, reader, experts, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 kv_tokens: int = 4096, page_size: int = 64, placement: Placement | None = None,
                 prefix_cache: bool = True, host_kv_bytes: int = 0, cuda_graphs: bool = True,
                 graph_buckets: tuple[int, ...] | None = None):
        self.cfg: ModelConfig = reader.config
        self.device = device or (placement.devices[0] if placement else
                                 torch.device("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.experts = experts
        self.placement = placement or Placement.single(self.cfg, self.device, kv_tokens)
        self.plan = self.placement.plan  # the memory plan executed, if any (metrics: planned vs actual)
        verify_gpu_weights(reader)  # a truncated / corrupt / mis-shaped file fails here, naming file and tensor
        t0 = time.perf_counter()
        self.model: DeepseekV3
        self.model, self.loaded = build_model(
            self.cfg, reader.get, self.dtype, self.placement.device_of,
            linear_format=self.placement.linear_format, get_stored=reader.get_stored,
            hot_experts=self.placement.hot_experts)
        self.load_s = time.perf_counter() - t0
        for blk in self.model.model.layers:  # the key block the plan's workspace assumes
            blk.self_attn.key_block = self.placement.key_block
        self.page_size = page_size
        self.pool = KVPool(self.cfg, -(-self.placement.kv_tokens // page_size), page_size, self.dtype,
                           self.placement.layer_devices)
        # prefix sharing (the engine looks prompts up and inserts pages); host_kv_bytes: its host tier
        self.prefix_cache = make_prefix_cache(self.pool, host_kv_bytes) if prefix_cache else None
        self.images = vision_embeddings(reader, self.device, self.dtype)  # Kimi-K2.5's vision tower, or None
        self.set_cuda_graphs(cuda_graphs and os.environ.get("MOESPLIT_CUDA_GRAPHS", "1") != "0", graph_buckets)

    @property
    def chunk_tokens(self) -> int:
        """The prefill chunk of `generate`: the plan's."""
        return self.placement.chunk_tokens

    def set_cuda_graphs(self, on: bool, buckets: tuple[int, ...] | None = None, mode: str = "cuda") -> None:
        """The decode pieces as CUDA graphs per batch-size bucket (gpu_service.runtime.cuda_graphs), CUDA
        only; mode="static" runs the same plumbing on CPU (tests)."""
        from gpu_service.plan.bytes import graph_buckets
        from gpu_service.runtime.cuda_graphs import Graphs

        if not on or (mode == "cuda" and self.device.type != "cuda"):
            self.graphs = None
            return
        if buckets is None:  # the buckets the plan counted: powers of two up to its max batch (at least 1..32)
            buckets = graph_buckets(self.plan.options.max_batch if self.plan is not None else 0)
        self.graphs = Graphs(buckets, mode, min_rows=self.model.row_block(self.device) if mode == "static" else 1)

    def new_seq(self) -> SeqKV:
        return SeqKV(self.pool)

    def copy_prefix(self, src: SeqKV, dst: SeqKV, n: int, start: int = 0) -> None:
        """Copy the KV of src's tokens [start, n) into dst (pages reserved, [0, start) already there)."""
        s, d = src.slots(start, n, torch.device("cpu")), dst.slots(start, n, torch.device("cpu"))
        for t in self.pool.kv + (self.pool.index_k or []):
            t.index_copy_(0, d.to(t.device), t.index_select(0, s.to(t.device)))
        dst.length = n

    def step(self, input_ids: list[int], chunks: list[Chunk], all_logits: bool = False, embeds=None) -> torch.Tensor:
        """embeds: (rows, [tensors]) replacing the embeddings of those rows of input_ids (images), or None."""
        ids = torch.tensor(input_ids, dtype=torch.long)
        return self.model(ids, chunks, self.pool, self.experts, all_logits=all_logits, graphs=self.graphs,
                          embeds=embeds)

    def generate(self, prompt_ids: list[int], max_new_tokens: int, sampling: SamplingParams | None = None,
                 stop_ids: tuple[int, ...] = (), chunk_tokens: int | None = None) -> GenerationResult:
        if not prompt_ids:
            raise ValueError("empty prompt: give at least one token")
        if any(not 0 <= t < self.cfg.vocab_size for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        sampling = sampling or SamplingParams()
        chunk_tokens = chunk_tokens or self.chunk_tokens  # the plan's prefill chunk
        gen = sampling.generator()
        seq = self.new_seq()
        out: list[int] = []
        finish = "length"
        try:
            t0 = time.perf_counter()
            logits = None
            for s in range(0, len(prompt_ids), chunk_tokens):  # chunked prefill
                part = prompt_ids[s:s + chunk_tokens]
                logits = self.step(part, [Chunk(seq, s, len(part))])
            t_prefill = time.perf_counter() - t0
            t1 = time.perf_counter()
            for i in range(max_new_tokens):
                tok = sample(logits[0], sampling, gen)
                out.append(tok)
                if tok in stop_ids:
                    finish = "stop"
                    break
                if i + 1 == max_new_tokens:
                    break
                logits = self.step([tok], [Chunk(seq, seq.length, 1)])
            t_decode = time.perf_counter() - t1
        finally:
            seq.free()
        n_dec = max(len(out) - 1, 0)
        return GenerationResult(out, finish, logits[0].detach().cpu() if logits is not None else None, {
            "load_s": round(self.load_s, 4),
            "prefill_s": round(t_prefill, 4),
            "prefill_tokens_per_s": round(len(prompt_ids) / t_prefill, 2) if t_prefill else None,
            "decode_s": round(t_decode, 4),
            "decode_tokens_per_s": round(n_dec / t_decode, 2) if t_decode and n_dec else None,
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": len(out),
        })
