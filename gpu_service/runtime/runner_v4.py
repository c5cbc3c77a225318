"""The DeepSeek-V4 runner: what the engine drives (`cfg`, `pool`, `new_seq`, `step`, `will_fork`,
`copy_prefix`, `prefix_cache`, `generate`) over `gpu_service.model.v4` and the paged pool of
`gpu_service.model.v4.paged`.

Built from a reader over a V4 checkpoint (reader.config a V4Config) and an ExpertsFn: the shards
(`RemoteExperts`, the V3 client path: the wire carries hidden [T, D], global expert ids [T, top_k]
and the router's final weights) or in-process experts. A step runs the engine's chunks through
`DeepseekV4.forward_batch`, each chunk continuing its sequence's paged cache; a chunk that ends on a
page boundary keeps the sequence's bounded state for the prefix cache; a prompt whose `n` choices
the engine forks keeps it at the fork point (its last prompt token), and the choices start from a
copy of the sequence there (`copy_prefix`).

With a placement (`gpu_service.model.placement.Placement.from_plan`) it executes the memory plan:
the pool holds the plan's KV tokens, each layer and its pool tensors on the layer's device (the
hidden streams hop between devices at the split), the embeddings on the CPU or the first device,
norm / hc_head / head on the last, the attention weights as the plan chose ("checkpoint": the FP8
linears as stored, `Fp8Linear`; "bf16": dequantised to the compute dtype). The plan's hot
experts are held as stored (MXFP4 checkpoints: `Mxfp4Linear`; FP8-expert ones: `Fp8Linear`) and
computed on their layer's device. An all-decode step runs every sequence's attention at once
(gpu_service.model.v4.decode) and, on CUDA, each layer's decode pieces as CUDA graphs per batch bucket
(`set_cuda_graphs`, as ModelRunner: the expert hand-off between them eager). Not built for V4 (refused
by name): hot experts of an unquantised checkpoint, re-quantised attention weights (fp8 / int8 of a
plan), the prefix cache's host tier, MTP (not loaded).
"""
from __future__ import annotations

import logging
import os
import time

import torch

from gpu_service.model.kv import Chunk
from gpu_service.model.v4.load import model_from_reader
from gpu_service.model.v4.paged import default_page_size, V4Pool, V4PrefixCache, V4Seq
from gpu_service.plan.bytes_v4 import V4_HOT_FORMATS
from gpu_service.runtime.runner import ModelRunner

log = logging.getLogger("moesplit.runner")
SNAPSHOT_EVERY = 2048  # tokens between the prompt boundaries whose snapshots stay cached (V4Runner snapshot_every)


class V4Runner:
    """The engine's runner for DeepSeek-V4 (module docstring); arguments as ModelRunner's."""

    generate = ModelRunner.generate  # the one-request loop over new_seq / step
    # the all-decode steps' layer pieces as CUDA graphs per batch bucket (and, V4's, per entry bucket)
    set_cuda_graphs = ModelRunner.set_cuda_graphs

    def __init__(self, reader, experts, device: torch.device | None = None, dtype: torch.dtype | None = None,
                 kv_tokens: int = 4096, page_size: int | None = None, placement=None, prefix_cache: bool = True,
                 host_kv_bytes: int = 0, cuda_graphs: bool = True, graph_buckets: tuple[int, ...] | None = None,
                 snapshot_every: int | None = None):
        if placement is not None:
            _check_placement(placement)
            kv_tokens = placement.kv_tokens
            device = device or placement.devices[0]
        if host_kv_bytes:
            raise ValueError("--host-kv-cache: DeepSeek-V4's prefix cache has no host tier (its boundary snapshots "
                             "stay on the device); pass --host-kv-cache 0")
        self.cfg = reader.config
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.experts = experts
        self.placement, self.plan = placement, getattr(placement, "plan", None)
        self.chunk_tokens = placement.chunk_tokens if placement else 2048  # ModelRunner.generate's default
        layer_devices = placement.layer_devices if placement else self.device
        t0 = time.perf_counter()
        self.model = model_from_reader(reader, self.dtype, placement.device_of if placement else self.device,
                                       fp8=placement is None or placement.attention_weights == "checkpoint",
                                       hot_experts=placement.hot_experts if placement else None)
        self.load_s = time.perf_counter() - t0
        self.page_size = page_size or default_page_size(self.cfg)  # None: whole compression blocks of every layer
        self.pool = V4Pool(self.cfg, -(-kv_tokens // self.page_size), self.page_size, self.dtype, layer_devices)
        # prompt boundaries kept for prefixes shared across prompts (a system prompt): every `snapshot_every`
        # tokens (None: the first multiple of the page size from SNAPSHOT_EVERY, at most one more pass per chunk)
        every = -(-SNAPSHOT_EVERY // self.page_size) * self.page_size if snapshot_every is None else snapshot_every
        if every < 0 or (snapshot_every is not None and not prefix_cache):
            raise ValueError(f"snapshot_every {snapshot_every}: >= 0 tokens (0: none), and only with the prefix "
                             "cache (--prefix-snapshot-every without --no-prefix-cache)")
        self.prefix_cache = V4PrefixCache(self.pool, every) if prefix_cache else None
        self.forked = 0  # choices forked from a sequence's state (copy_prefix), not prefilled again
        self.set_cuda_graphs(cuda_graphs and os.environ.get("MOESPLIT_CUDA_GRAPHS", "1") != "0", graph_buckets)

    def new_seq(self) -> V4Seq:
        """An empty sequence of the pool."""
        return V4Seq(self.pool)

    def will_fork(self, seq: V4Seq, n: int) -> None:
        """The engine will fork `seq`'s choices at `n` tokens (its last prompt token, `submit_n`): the
        step that crosses `n` splits there and keeps the bounded state (`V4Seq.fork_snap`)."""
        seq.fork_at = n

    def copy_prefix(self, src: V4Seq, dst: V4Seq, n: int, start: int = 0) -> None:
        """The engine's fork of `n` choices: `dst` becomes `src` at `n` tokens (`V4Seq.fork_into`: full
        pages shared by reference through the prefix cache or copied, the partial page copied, the
        bounded state cloned from `src`'s snapshot at `n`). Without one (`will_fork` not called),
        `dst` keeps what it has (`start` tokens: its prefix-cache pages and snapshot) and the engine
        prefills the rest of its prompt (same tokens, more work)."""
        if dst.length != start:
            raise RuntimeError(f"copy_prefix: destination holds {dst.length} tokens, expected {start}")
        if src.fork_snap is not None and src.fork_snap[0] == n:
            src.fork_into(dst, n, self.prefix_cache)
            self.forked += 1

    def step(self, input_ids: list[int], chunks: list[Chunk], all_logits: bool = False) -> torch.Tensor:
        """One engine step: chunk j feeds input_ids of its run to its sequence -> float32 logits
        [len(chunks), V] of each chunk's last token ([len(input_ids), V] with all_logits). A chunk
        runs in passes split where the sequence must keep its bounded state: with the prefix cache,
        at the last page boundary inside the chunk that ends its prompt (the next turn resumes from
        that snapshot) and at the prompt's multiples of `snapshot_every` (kept for other prompts
        sharing them); at a fork point (`will_fork`)."""
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pieces, a = [], 0
        for c in chunks:
            if c.start != c.seq.length:
                raise RuntimeError(f"a V4 chunk must continue its sequence: starts at {c.start}, the sequence "
                                   f"holds {c.seq.length} tokens")
            c.seq.reserve(c.start + c.n)  # a no-op under the engine (its admission reserved them)
            end = c.start + c.n
            boundary = end // self.page_size * self.page_size
            cuts = {c.seq.fork_at} if c.start < c.seq.fork_at < end else set()
            if self.prefix_cache is not None and end == c.seq.fed_to and c.start < boundary < end:
                cuts.add(boundary)
            every = self.prefix_cache.keep_every if self.prefix_cache is not None else 0
            if every:  # the prompt's boundaries kept for other prompts sharing them
                cuts.update(range((c.start // every + 1) * every, min(end - 1, c.seq.fed_to) + 1, every))
            if c.start == c.seq.fork_at:
                c.seq.take_fork_snapshot()  # resumed there from the prefix cache
            elif c.start > c.seq.fork_at:
                c.seq.fork_snap = None  # forked already (the fork follows the step that ended the prompt)
            bounds = [c.start, *sorted(cuts), end]
            pieces.append([ids[a + x - c.start:a + y - c.start] for x, y in zip(bounds, bounds[1:])])
            a += c.n
        out: list = [None] * len(chunks)
        for k in range(max(len(p) for p in pieces)):
            js = [j for j, p in enumerate(pieces) if len(p) > k]
            for j, o in zip(js, self._pass([(pieces[j][k], chunks[j].seq) for j in js], all_logits)):
                out[j] = torch.cat([out[j], o]) if all_logits and out[j] is not None else o
        return torch.cat(out) if all_logits else torch.stack(out)

    def _pass(self, batch: list[tuple[torch.Tensor, V4Seq]], all_logits: bool) -> list[torch.Tensor]:
        """forward_batch of (tokens, sequence) chunks; a sequence it leaves on a page boundary keeps
        its bounded state for the prefix cache."""
        out = self.model.forward_batch(batch, self.experts, all_logits, graphs=self.graphs)
        for _, seq in batch:
            if seq.cache_root is not None and seq.length % self.page_size == 0:  # looked up in the prefix cache
                seq.take_snapshot()  # (its step's commit places it; `generate` keeps none)
            if seq.length == seq.fork_at:
                seq.take_fork_snapshot()
        return out


def _check_placement(placement) -> None:
    """Refuse, by name, what of a memory plan the V4 model cannot execute."""
    if placement.hot_experts and placement.expert_format not in V4_HOT_FORMATS:
        raise ValueError(f"--gpu-experts with expert format {placement.expert_format}: DeepSeek-V4's runner keeps hot "
                         "experts only as the checkpoint stores them (MXFP4 or block FP8); plan with --gpu-experts 0 "
                         "for this checkpoint")
    if placement.attention_weights not in ("checkpoint", "bf16"):
        raise ValueError(f"--attention-weights {placement.attention_weights}: DeepSeek-V4's model runs its linears "
                         "as stored (checkpoint: block FP8) or dequantised (bf16), not re-quantised; pass "
                         "--attention-weights checkpoint or bf16")
