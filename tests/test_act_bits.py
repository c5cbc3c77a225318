"""`moesplit expert-server --act-bits 8|16`: the integer kernels' 8-bit activations, end to end.

A shard started with --act-bits 8 serves what KernelExperts(act_bits=8) computes in process and says
so in Describe; replicas of one group with different --act-bits are refused by the GPU side (a greedy
answer must not depend on the replica); --act-bits 8 with bf16 experts or the numpy backend is refused
naming the flag.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from checkpoint.config import load_config
from cpu_expert_service.backend import make_backend
from cpu_expert_service.shard_load import load_shard
from gpu_service.experts.client import ExpertsClient
from gpu_service.experts.errors import CoverageError, ExpertsClientError
from gpu_service.local.stack import start_shards

kb = pytest.importorskip("cpu_expert_service.kernel_backend")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIMS = dict(hidden_size=128, moe_intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
            num_hidden_layers=2, first_k_dense_replace=1, n_group=1, topk_group=1)
INT8_A8 = ("--weight-format", "int8", "--act-bits", "8")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("tiny_a8")), fmt="bf16", seed=3, overrides=dict(DIMS))


def _routing(cfg, T, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(cfg.n_routed_experts, cfg.num_experts_per_tok, replace=False) for _ in range(T)])
    w = rng.random((T, cfg.num_experts_per_tok)).astype(np.float32)
    return x, ids.astype(np.int64), w


def test_bad_combinations_refused_naming_the_flag(ckpt):
    with pytest.raises(ValueError, match="--act-bits 8 .*--backend kernels"):
        make_backend("numpy", weight_format="int8", act_bits=8)
    with pytest.raises(ValueError, match="--act-bits 8 applies to int8/int4/mxfp4.*bf16"):
        make_backend("kernels", weight_format="bf16", act_bits=8)
    with pytest.raises(ValueError, match="--act-bits 12"):
        make_backend("kernels", weight_format="int8", act_bits=12)
    with pytest.raises(ValueError, match="--act-bits 8 applies"):  # auto on a bf16 checkpoint holds bf16
        load_shard(ckpt, None, None, "kernels", "auto", act_bits=8)
    base = [sys.executable, "-m", "moesplit", "expert-server", "--model", ckpt, "--port", "0"]
    p = subprocess.run(base + ["--backend", "numpy", *INT8_A8], capture_output=True, text=True, cwd=ROOT,
                       timeout=120)
    assert p.returncode == 1 and "--act-bits 8" in p.stderr and "--backend kernels" in p.stderr, p.stderr
    p = subprocess.run(base + ["--act-bits", "12"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert p.returncode == 2 and "--act-bits" in p.stderr, p.stderr


def test_shard_with_act_bits_8_serves_kernel_outputs(ckpt):
    cfg = load_config(ckpt)
    _, ref8, info = load_shard(ckpt, None, None, "kernels", "int8", act_bits=8)
    _, ref16, _ = load_shard(ckpt, None, None, "kernels", "int8")
    assert info["act_bits"] == 8 and ref8.name.endswith("-a8")
    shards = start_shards(ckpt, 1, backend="kernels", extra_args=INT8_A8)
    try:
        with ExpertsClient(shards.addresses, cfg, timeout_s=30.0) as client:
            desc = client.shards[0].info
            assert desc.act_bits == 8 and desc.kernel == ref8.name
            for T, seed in ((1, 0), (7, 1), (40, 2)):
                x, ids, w = _routing(cfg, T, seed)
                layer = cfg.moe_layers[0]
                got = client.forward(layer, x, ids, w)
                want = ref8.forward(layer, x, ids, w)
                np.testing.assert_array_equal(got, want)
                if T > 1:  # the flag took effect: 16-bit activations compute something else
                    assert not np.array_equal(got, ref16.forward(layer, x, ids, w))
    finally:
        shards.stop()


def test_mixed_act_bits_replicas_refused(ckpt):
    cfg = load_config(ckpt)
    a8 = start_shards(ckpt, 1, backend="kernels", extra_args=INT8_A8)
    a16 = start_shards(ckpt, 1, backend="kernels", extra_args=("--weight-format", "int8"))
    try:
        with pytest.raises(CoverageError, match="--act-bits 16 but its replicas .* run --act-bits 8") as ei:
            ExpertsClient(a8.addresses + a16.addresses, cfg, timeout_s=30.0).connect()
        assert a16.addresses[0] in str(ei.value) and a8.addresses[0] in str(ei.value)
        with ExpertsClient(a8.addresses * 1, cfg, timeout_s=30.0) as client:  # one setting: served
            assert client.shards[0].info.act_bits == 8
    finally:
        a8.stop()
        a16.stop()


def _call_until(client, cond, layer, x, ids, w, timeout_s=60.0) -> bool:
    """Forward calls (failures allowed: a sole replica is down meanwhile) until cond() or the timeout."""
    import time

    deadline = time.monotonic() + timeout_s
    while not cond() and time.monotonic() < deadline:
        try:
            client.forward(layer, x, ids, w)
        except ExpertsClientError:
            pass
        time.sleep(0.05)
    return cond()


def _restart_with_act_bits(client, shards, i: int, bits: str, layer, x, ids, w):
    """Kill shard process i, call until the client has marked it down, start it again on its port with
    `--act-bits bits`, and call until the client's reconnect has refused it; returns why."""
    replica = next(r for r in client.replicas if r.address == shards.addresses[i])
    shards.kill(i)
    assert _call_until(client, lambda: not replica.healthy, layer, x, ids, w), "the kill was not noticed"
    cmd = shards.cmds[i]
    cmd[cmd.index("--act-bits") + 1] = bits
    shards.restart(i)
    _call_until(client, lambda: replica.refused is not None or replica.healthy, layer, x, ids, w)
    return replica.refused


def test_replica_restarted_with_other_act_bits_refused(ckpt):
    """A replica the client saw fail that comes back on its address with another --act-bits is refused on
    reconnect, naming the flag (the mixed-replica rule, over time): with a replica that did not change, the
    group keeps serving the same bits from it; a sole replica is refused too (its group's answers would
    change with the restart)."""
    cfg = load_config(ckpt)
    layer = cfg.moe_layers[0]
    x, ids, w = _routing(cfg, 5, 6)
    pair = start_shards(ckpt, 1, backend="kernels", extra_args=INT8_A8, replicas=2)
    try:
        with ExpertsClient(pair.addresses, cfg, timeout_s=30.0) as client:
            before = client.forward(layer, x, ids, w)
            why = _restart_with_act_bits(client, pair, 1, "16", layer, x, ids, w)
            assert why and "--act-bits 16" in why and "--act-bits 8" in why and pair.addresses[1] in why, why
            for _ in range(4):  # round robin has one usable replica left: the unchanged one, same bits
                np.testing.assert_array_equal(client.forward(layer, x, ids, w), before)
    finally:
        pair.stop()
    sole = start_shards(ckpt, 1, backend="kernels", extra_args=INT8_A8)
    try:
        with ExpertsClient(sole.addresses, cfg, timeout_s=30.0) as client:
            client.forward(layer, x, ids, w)
            why = _restart_with_act_bits(client, sole, 0, "16", layer, x, ids, w)
            assert why and "came back running --act-bits 16" in why and "start it again with --act-bits 8" in why, why
            with pytest.raises(ExpertsClientError):  # no usable replica of the group is left
                client.forward(layer, x, ids, w)
    finally:
        sole.stop()


def test_packed_shard_with_act_bits_8(ckpt, tmp_path):
    """--packed shards take --act-bits too: the packed int8 experts at act_bits 8 compute what the
    checkpoint's experts quantised at load do."""
    from cpu_expert_service.convert import convert
    from cpu_expert_service.packed import load_packed

    cfg = load_config(ckpt)
    out = str(tmp_path / "packed")
    convert(ckpt, out, 1, split="intermediate", fmt="int8", quiet=True)
    _, be, info = load_packed(out, 0, "kernels", "auto", act_bits=8)
    _, ref, _ = load_shard(ckpt, None, None, "kernels", "int8", act_bits=8)
    assert info["act_bits"] == 8 and be.name == ref.name
    x, ids, w = _routing(cfg, 9, 4)
    layer = cfg.moe_layers[0]
    np.testing.assert_array_equal(be.forward(layer, x, ids, w), ref.forward(layer, x, ids, w))
    with pytest.raises(ValueError, match="--act-bits 8 .*--backend kernels"):
        load_packed(out, 0, "numpy", "auto", act_bits=8)
