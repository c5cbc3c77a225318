"""A shard restarted at its address while the GPU side's experts client was idle is re-checked before use.

The client sees no failure then (the shared-memory / TCP data path and the gRPC stream are simply
re-opened), so each re-opened connection's shard process id (ShardInfo.instance_id, also in the Attach
answers and the Forward stream's metadata) is compared with the one checked; a new process is
described again and must pass a returning replica's checks (gpu_service.experts.rejoin): a changed
--act-bits or model fingerprint is refused naming it while the other replica serves the same bits, an
identical restart rejoins. Over shared memory, the TCP data path and the gRPC stream alone.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from checkpoint.config import load_config
from gpu_service.experts.client import ExpertsClient
from gpu_service.experts.errors import ExpertsClientError
from gpu_service.local.stack import start_shards
from test_act_bits import _routing  # the same random routing of T tokens

pytest.importorskip("cpu_expert_service.kernel_backend")
DIMS = dict(hidden_size=128, moe_intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
            num_hidden_layers=2, first_k_dense_replace=1, n_group=1, topk_group=1)
INT8_A8 = ("--weight-format", "int8", "--act-bits", "8")
TRANSPORTS = ("shm", "tcp", "grpc")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """Two tiny checkpoints of the same sizes but other configs (different model fingerprints)."""
    from gpu_service.local.tiny import make_tiny

    a = make_tiny(str(tmp_path_factory.mktemp("rejoin_a")), fmt="bf16", seed=3, overrides=dict(DIMS))
    b = make_tiny(str(tmp_path_factory.mktemp("rejoin_b")), fmt="bf16", seed=3,
                  overrides=dict(DIMS, moe_intermediate_size=64))
    assert load_config(a).fingerprint() != load_config(b).fingerprint()
    return a, b


def _restart_idle(client, shards, i: int, edit=None):
    """Kill process i and start it again (its command edited by `edit`) with no call in between: the
    client has seen no failure (the replica still counts as healthy). Returns the replica."""
    replica = next(r for r in client.replicas if r.address == shards.addresses[i])
    old = replica.instance
    assert old, "the shard gave no instance id"
    shards.kill(i)
    if edit is not None:
        edit(shards.cmds[i])
    shards.restart(i)
    time.sleep(0.3)  # let the client's readers see the old connections close
    assert replica.healthy and replica.refused is None  # idle: nothing told it about the restart
    return replica, old


def _set_flag(flag: str, value: str):
    def edit(cmd):
        cmd[cmd.index(flag) + 1] = value
    return edit


def _refused_while_other_serves(client, replica, layer, x, ids, w, before, timeout_s=30.0) -> str:
    """Forward until `replica` is refused: every answer must equal `before` (the other replica's bits)."""
    deadline = time.monotonic() + timeout_s
    while replica.refused is None and time.monotonic() < deadline:
        np.testing.assert_array_equal(client.forward(layer, x, ids, w), before)
    for _ in range(4):  # one usable replica left: still the same bits
        np.testing.assert_array_equal(client.forward(layer, x, ids, w), before)
    assert not replica.healthy
    return replica.refused or ""


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_idle_restart_with_other_act_bits_refused(ckpts, transport):
    """Two replicas at --act-bits 8, client idle, one restarted at --act-bits 16: the next calls get the
    other replica's bits and the restarted one is refused naming --act-bits."""
    cfg = load_config(ckpts[0])
    layer = cfg.moe_layers[0]
    x, ids, w = _routing(cfg, 5, 6)
    pair = start_shards(ckpts[0], 1, backend="kernels", extra_args=INT8_A8, replicas=2)
    try:
        with ExpertsClient(pair.addresses, cfg, timeout_s=30.0, transport=transport) as client:
            before = client.forward(layer, x, ids, w)
            np.testing.assert_array_equal(client.forward(layer, x, ids, w), before)  # both replicas
            replica, _ = _restart_idle(client, pair, 1, _set_flag("--act-bits", "16"))
            why = _refused_while_other_serves(client, replica, layer, x, ids, w, before)
            assert "--act-bits 16" in why and "--act-bits 8" in why and pair.addresses[1] in why, why
            assert replica.desc.info.act_bits == 8  # what it was checked with stays on record
            ok, status = client.health()
            assert ok and status[pair.addresses[1]].startswith("REFUSED: ") and "--act-bits 16" in status[pair.addresses[1]]
    finally:
        pair.stop()


@pytest.mark.parametrize("transport", ("shm", "tcp"))
def test_idle_restart_with_other_model_refused(ckpts, transport):
    """Same, the replica restarted on another checkpoint (another model fingerprint): refused naming it."""
    cfg = load_config(ckpts[0])
    layer = cfg.moe_layers[0]
    x, ids, w = _routing(cfg, 4, 7)
    pair = start_shards(ckpts[0], 1, backend="kernels", replicas=2)
    try:
        with ExpertsClient(pair.addresses, cfg, timeout_s=30.0, transport=transport) as client:
            before = client.forward(layer, x, ids, w)
            replica, _ = _restart_idle(client, pair, 0, _set_flag("--model", ckpts[1]))
            why = _refused_while_other_serves(client, replica, layer, x, ids, w, before)
            assert "fingerprint" in why and load_config(ckpts[1]).fingerprint() in why, why
            assert pair.addresses[0] in why
    finally:
        pair.stop()


def test_idle_restart_serving_other_experts_refused(ckpts):
    """Same, the replica restarted serving only some of the experts (over the gRPC stream): refused."""
    cfg = load_config(ckpts[0])
    layer = cfg.moe_layers[0]
    x, ids, w = _routing(cfg, 4, 10)
    pair = start_shards(ckpts[0], 1, backend="kernels", replicas=2)
    try:
        with ExpertsClient(pair.addresses, cfg, timeout_s=30.0, transport="grpc") as client:
            before = client.forward(layer, x, ids, w)
            replica, _ = _restart_idle(client, pair, 1, lambda cmd: cmd.extend(["--experts", "0-3"]))
            why = _refused_while_other_serves(client, replica, layer, x, ids, w, before)
            assert "came back serving different experts" in why and pair.addresses[1] in why, why
    finally:
        pair.stop()


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sole_replica_identical_restart_rejoins(ckpts, transport):
    """A sole replica restarted identically while idle: the next call is answered by the new process
    (re-checked, no GPU-service restart) with the same bits, and the fast path comes back."""
    cfg = load_config(ckpts[0])
    layer = cfg.moe_layers[0]
    x, ids, w = _routing(cfg, 3, 8)
    sole = start_shards(ckpts[0], 1, backend="kernels", extra_args=INT8_A8)
    try:
        with ExpertsClient(sole.addresses, cfg, timeout_s=30.0, transport=transport) as client:
            before = client.forward(layer, x, ids, w)
            replica, old = _restart_idle(client, sole, 0)
            np.testing.assert_array_equal(client.forward(layer, x, ids, w), before)
            assert replica.instance and replica.instance != old  # the new process, checked
            assert replica.healthy and replica.refused is None
            deadline = time.monotonic() + 30.0
            while client.fast.transport_of(replica.address) != transport and time.monotonic() < deadline:
                np.testing.assert_array_equal(client.forward(layer, x, ids, w), before)
                time.sleep(0.1)
            assert client.fast.transport_of(replica.address) == transport
            for _ in range(3):
                np.testing.assert_array_equal(client.forward(layer, x, ids, w), before)
    finally:
        sole.stop()


def test_sole_replica_restarted_with_other_act_bits_fails_naming_it(ckpts):
    """A sole replica restarted idle with another --act-bits: its calls fail with the error naming the flag."""
    cfg = load_config(ckpts[0])
    layer = cfg.moe_layers[0]
    x, ids, w = _routing(cfg, 2, 9)
    sole = start_shards(ckpts[0], 1, backend="kernels", extra_args=INT8_A8)
    try:
        with ExpertsClient(sole.addresses, cfg, timeout_s=30.0, transport="shm") as client:
            client.forward(layer, x, ids, w)
            replica, _ = _restart_idle(client, sole, 0, _set_flag("--act-bits", "16"))
            with pytest.raises(ExpertsClientError, match="--act-bits 16"):
                client.forward(layer, x, ids, w)
            assert replica.refused and "start it again with --act-bits 8" in replica.refused
            with pytest.raises(ExpertsClientError):
                client.forward(layer, x, ids, w)
    finally:
        sole.stop()


def test_idle_restart_with_other_weight_format_refused(ckpts):
    """Same, the replica restarted with another --weight-format (its kernel, ShardInfo.kernel, computes
    other bits): refused naming both kernels while the other replica serves the same bits."""
    cfg = load_config(ckpts[0])
    layer = cfg.moe_layers[0]
    x, ids, w = _routing(cfg, 4, 11)
    pair = start_shards(ckpts[0], 1, backend="kernels", extra_args=INT8_A8, replicas=2)
    try:
        with ExpertsClient(pair.addresses, cfg, timeout_s=30.0, transport="tcp") as client:
            before = client.forward(layer, x, ids, w)
            kernel = next(r for r in client.replicas if r.address == pair.addresses[1]).desc.info.kernel
            replica, _ = _restart_idle(client, pair, 1, _set_flag("--weight-format", "int4"))
            why = _refused_while_other_serves(client, replica, layer, x, ids, w, before)
            assert kernel in why and "int4" in why and "--weight-format" in why and pair.addresses[1] in why, why
    finally:
        pair.stop()


def test_replicas_computing_with_other_kernels_refused(ckpts):
    """Two replicas of one group whose ShardInfo.kernel differ (another weight format or ISA) are not
    equivalent: the second is refused at connect naming both kernels and MOESPLIT_KERNEL_ISA, and a
    replica returning with another kernel is refused naming the flags; equal kernels pass."""
    from gpu_service.experts.groups import _Group, _Replica, check_returning, ShardDesc
    from gpu_service.experts.errors import CoverageError
    from protos.moesplit.v1 import experts_pb2

    cfg = load_config(ckpts[0])

    def desc(address, kernel):
        info = experts_pb2.ShardInfo(layers=cfg.moe_layers, experts=range(cfg.n_routed_experts), slice_count=1,
                                     intermediate_stop=cfg.moe_intermediate_size, kernel=kernel, act_bits=16)
        return ShardDesc(address, info, np.arange(cfg.n_routed_experts), False)

    a, b = desc("h1:1", "kernel-avx512-int8"), desc("h2:1", "kernel-avx2-int8")
    group = _Group(a, cfg)
    first = _Replica(a.address)
    first.desc = a
    group.replicas.append(first)
    group.check_equivalent("h1:1", a.info)  # itself: nothing to compare
    group.check_equivalent("h3:1", desc("h3:1", "kernel-avx512-int8").info)  # same kernel: equivalent
    with pytest.raises(CoverageError, match="MOESPLIT_KERNEL_ISA") as e:
        group.check_equivalent("h2:1", b.info)
    assert "kernel-avx2-int8" in str(e.value) and "kernel-avx512-int8" in str(e.value) and "h1:1" in str(e.value)
    check_returning("h1:1", a.info, desc("h1:1", "kernel-avx512-int8").info)
    with pytest.raises(CoverageError, match="--weight-format"):
        check_returning("h1:1", a.info, desc("h1:1", "kernel-avx512-int4").info)
