"""Shards as the client sees them: Describe answers, the coverage check, replicas and shard groups.

Addresses with identical coverage (layers, experts, intermediate slice) are replicas of one shard
group; `check_coverage` requires every (MoE layer, expert, slice) exactly once over the groups.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import grpc
import numpy as np

from checkpoint.config import ModelConfig
from checkpoint.names import compact_ranges
from gpu_service.experts.errors import CoverageError
from gpu_service.experts.stream import _ShardStream
from protos.moesplit.v1 import experts_pb2


@dataclass
class ShardDesc:
    address: str
    info: experts_pb2.ShardInfo
    experts: np.ndarray  # sorted int64 ids held
    all_experts: bool  # holds every routed expert (slice shards): gets every row


# ---- coverage ---------------------------------------------------------------------------------
def _describe_cells(cells: list[tuple[int, int, int, int]], intermediate: int) -> list[str]:
    """[(layer, expert, i0, i1)] -> ['experts 8-15 in layers 1-2', 'intermediate [0:64) of expert 3 in layer 1']."""
    by_range: dict[tuple[int, int], dict[int, set[int]]] = {}
    for layer, e, i0, i1 in cells:
        by_range.setdefault((i0, i1), {}).setdefault(layer, set()).add(e)
    out = []
    for (i0, i1), layers in sorted(by_range.items()):
        groups: dict[tuple[int, ...], list[int]] = {}
        for layer, es in layers.items():
            groups.setdefault(tuple(sorted(es)), []).append(layer)
        for es, ls in sorted(groups.items(), key=lambda kv: min(kv[1])):
            what = f"expert{'s' if len(es) > 1 else ''} {compact_ranges(es)}"
            if (i0, i1) != (0, intermediate):
                what = f"intermediate [{i0}:{i1}) of {what}"
            out.append(f"{what} in layer{'s' if len(ls) > 1 else ''} {compact_ranges(ls)}")
    return out


def check_coverage(cfg: ModelConfig, shards: list[ShardDesc]) -> None:
    """Every MoE layer x expert x intermediate position served exactly once, else CoverageError."""
    I = cfg.moe_intermediate_size
    # (layer, expert) -> [(i0, i1, address)]
    held: dict[tuple[int, int], list[tuple[int, int, str]]] = {}
    for s in shards:
        i0, i1 = int(s.info.intermediate_start), int(s.info.intermediate_stop)
        for layer in s.info.layers:
            for e in s.info.experts:
                held.setdefault((int(layer), int(e)), []).append((i0, i1, s.address))
    missing: list[tuple[int, int, int, int]] = []
    doubled: list[tuple[int, int, int, int, list[str]]] = []
    for layer in cfg.moe_layers:
        for e in range(cfg.n_routed_experts):
            pieces = held.get((layer, e), [])
            bounds = sorted({0, I, *(p for a, b, _ in pieces for p in (a, b) if 0 <= p <= I)})
            for a, b in zip(bounds[:-1], bounds[1:]):
                owners = [addr for i0, i1, addr in pieces if i0 <= a and b <= i1]
                if not owners:
                    missing.append((layer, e, a, b))
                elif len(owners) > 1:
                    doubled.append((layer, e, a, b, owners))
    extra = sorted({(int(l), s.address) for s in shards for l in s.info.layers if not cfg.is_moe_layer(int(l))})
    if not missing and not doubled and not extra:
        return
    lines = []
    if missing:
        lines.append("missing " + "; ".join(_describe_cells(missing, I)))
    if doubled:
        by_owners: dict[tuple[str, ...], list] = {}
        for layer, e, a, b, owners in doubled:
            by_owners.setdefault(tuple(owners), []).append((layer, e, a, b))
        for owners, cells in by_owners.items():
            lines.append(f"doubled {'; '.join(_describe_cells(cells, I))} (served by {', '.join(owners)})")
    if extra:
        lines.append("shards serve non-MoE layers: " + ", ".join(f"{a} layer {l}" for l, a in extra))
    raise CoverageError(
        "expert shards do not cover every (MoE layer, expert, intermediate slice) exactly once: "
        + " | ".join(lines)
        + ". Fix the --experts / --slice of the shards.",
        missing,
        doubled,
    )


# ---- replicas and groups -----------------------------------------------------------------------
class _Replica:
    """One shard address: its channel, stream, health and reconnect backoff."""

    def __init__(self, address: str):
        self.address = address
        self.channel: grpc.Channel | None = None
        self.stream: _ShardStream | None = None
        self.desc: ShardDesc | None = None  # None until a Describe answered
        self.group: "_Group | None" = None
        self.healthy = False
        self.backoff_s = 0.0
        self.next_try = 0.0  # monotonic time of the next reconnect attempt
        self.probing = False
        self.last_error = "not connected yet"
        self.refused: str | None = None  # answered, but serves something we cannot use
        self.instance = ""  # ShardInfo.instance_id of the process checked (gpu_service.experts.rejoin)


def _coverage_key(info: experts_pb2.ShardInfo) -> tuple:
    return (tuple(sorted(int(l) for l in info.layers)), tuple(sorted(int(e) for e in info.experts)),
            int(info.intermediate_start), int(info.intermediate_stop))


ISA_FIX = "MOESPLIT_KERNEL_ISA=<isa> picks one the hosts share"


def act_bits_of(info: experts_pb2.ShardInfo) -> int:
    """The shard's --act-bits (16 or 8); 0 from a shard that predates the field means 16."""
    return int(info.act_bits) or 16


def check_returning(address: str, before: experts_pb2.ShardInfo, now: experts_pb2.ShardInfo) -> None:
    """A replica that reconnects must serve what it served when the client connected: the same experts
    (else it matches no group) and the same --act-bits (else its group's answers would change with a
    restart: the mixed-replica rule over time, a sole replica included), computing with the same kernel
    (ShardInfo.kernel: backend, ISA, weight format). CoverageError naming the fix."""
    if _coverage_key(now) != _coverage_key(before):
        raise CoverageError(f"expert shard {address} came back serving different experts", [], [])
    if act_bits_of(now) != act_bits_of(before):
        raise CoverageError(
            f"expert shard {address} came back running --act-bits {act_bits_of(now)}, but ran --act-bits "
            f"{act_bits_of(before)} when this GPU service connected; a greedy answer must not change with a "
            f"restart: start it again with --act-bits {act_bits_of(before)} (or restart the GPU service to take "
            "the new setting)", [], [])
    if now.kernel != before.kernel:
        raise CoverageError(
            f"expert shard {address} came back computing with {now.kernel!r}, but computed with {before.kernel!r} "
            "when this GPU service connected; a greedy answer must not change with a restart: start it again "
            f"with the same --backend / --weight-format (and the same ISA: {ISA_FIX}), or restart the GPU service "
            "to take the new setting", [], [])


class _Group:
    """Replicas serving the same (layers, experts, intermediate slice); any one answers a call."""

    def __init__(self, desc: ShardDesc, cfg: ModelConfig):
        self.desc = desc
        self.key = _coverage_key(desc.info)
        self.replicas: list[_Replica] = []
        self.rr = 0  # round-robin position: advanced by each call that is sent (pick, advance)
        self.lock = threading.Lock()
        what = f"experts {compact_ranges(desc.experts)}"
        I = cfg.moe_intermediate_size
        if (desc.info.intermediate_start, desc.info.intermediate_stop) != (0, I):
            what += f" intermediate [{desc.info.intermediate_start}:{desc.info.intermediate_stop})"
        self.name = what

    def pick(self, tried: list, peek: bool = False) -> "_Replica | None":
        """A healthy replica not in tried, round-robin; `peek`: the one a call would get, the turn not
        taken (a caller that then sends it takes the turn with advance())."""
        if len(self.replicas) == 1 and not tried:
            r = self.replicas[0]
            return r if r.healthy else None
        with self.lock:
            live = [r for r in self.replicas if r.healthy and r not in tried]
            if not live:
                return None
            r = live[self.rr % len(live)]
            if not peek:
                self.rr += 1
            return r

    def check_equivalent(self, address: str, info: experts_pb2.ShardInfo) -> None:
        """Replicas of one group must compute the same numbers (a greedy answer must not depend on which
        replica served a call): a replica whose --act-bits or kernel (ShardInfo.kernel: backend, ISA,
        weight format) differs from the group's other replicas' is refused (CoverageError naming the fix)."""
        have = act_bits_of(info)
        others = [o for o in self.replicas if o.address != address and o.desc is not None]
        bad = [o.address for o in others if act_bits_of(o.desc.info) != have]
        if bad:
            want = act_bits_of(next(o for o in others if o.address in bad).desc.info)
            raise CoverageError(
                f"expert shard {address} runs --act-bits {have} but its replicas {', '.join(bad)} of {self.label()} "
                f"run --act-bits {want}; replicas of a group must compute the same outputs: start every replica "
                "of the group with the same --act-bits", [], [])
        bad = [o for o in others if o.desc.info.kernel != info.kernel]
        if bad:
            raise CoverageError(
                f"expert shard {address} computes with {info.kernel!r} but its replicas "
                f"{', '.join(o.address for o in bad)} of {self.label()} compute with {bad[0].desc.info.kernel!r} "
                "(backend, ISA, weight format); replicas of a group must compute the same bits: start every replica "
                f"of the group with the same --backend / --weight-format and the same ISA ({ISA_FIX})", [], [])

    def advance(self) -> None:
        """Take the round-robin turn (after a peeked pick was sent)."""
        with self.lock:
            self.rr += 1

    @property
    def addresses(self) -> str:
        return ",".join(r.address for r in self.replicas)

    def label(self) -> str:
        return f"shard group {self.name} ({self.addresses})"
