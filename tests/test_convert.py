"""`moesplit convert` and shards served from its packed per-shard files.

Tiny checkpoints (gpu_service.local.tiny.make_tiny bf16, fp8, int4; moe_intermediate_size 64 so that
two INT4 slices are group-aligned) are converted into 2 shards by either split; shards served from
the packed files must answer exactly like shards loaded from the original checkpoint in the same
weight format (bit-exact, all formats: bf16 copies bits, fp8 -> bf16 rounds like the bf16
kernels do, int8/int4 quantise exactly as the kernels do, INT4 checkpoints are copied as stored).
"""
from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest

from checkpoint.config import load_config
from checkpoint.reader import CheckpointReader
from cpu_expert_service import convert as C
from cpu_expert_service import packed as P
from cpu_expert_service.backend import available_backends
from cpu_expert_service.server import create_server, load_shard
from gpu_service.experts.client import ExpertsClient
from gpu_service.local.stack import expert_ranges

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BACKEND = available_backends()[0]  # the kernels when built, else numpy
TINY = {"moe_intermediate_size": 64}
N = 2


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    root = tmp_path_factory.mktemp("ckpt")
    return {f: make_tiny(str(root / f), f, seed=3, overrides=TINY) for f in ("bf16", "fp8", "int4")}


def _inputs(cfg, T=7, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.permutation(cfg.n_routed_experts)[: cfg.num_experts_per_tok] for _ in range(T)])
    w = rng.random((T, cfg.num_experts_per_tok)).astype(np.float32)
    return x, ids.astype(np.int64), w


def _serve(servers_kwargs, cfg):
    servers, addrs = [], []
    for kw in servers_kwargs:
        s, port = create_server(host="127.0.0.1", port=0, backend=BACKEND, max_workers=4, **kw)
        servers.append(s)
        addrs.append(f"127.0.0.1:{port}")
    return servers, ExpertsClient(addrs, cfg, timeout_s=20.0, transport="grpc").connect()


def _original_shards(model, cfg, split, weight_format):
    if split == "experts":
        return [dict(model_dir=model, experts=list(range(a, b + 1)), weight_format=weight_format)
                for a, b in expert_ranges(cfg.n_routed_experts, N)]
    return [dict(model_dir=model, slice_spec=(i, N), weight_format=weight_format) for i in range(N)]


# (checkpoint, --format, the format the packed files hold)
CASES = [("bf16", "auto", "bf16"), ("fp8", "auto", "bf16"), ("int4", "auto", "int4"),
         ("bf16", "int8", "int8"), ("fp8", "int4", "int4")]


@pytest.mark.parametrize("split", P.SPLITS)
@pytest.mark.parametrize("src,fmt,held", CASES, ids=[f"{s}-to-{h}" for s, _, h in CASES])
def test_packed_shards_match_checkpoint_shards(ckpts, tmp_path, src, fmt, held, split):
    model = ckpts[src]
    cfg = load_config(model)
    out = str(tmp_path / "packed")
    s = C.convert(model, out, N, split=split, fmt=fmt, quiet=True)
    assert (s["format"], s["written"], s["skipped"]) == (held, N * len(cfg.moe_layers), 0)
    m = P.read_manifest(out)
    assert m["fingerprint"] == cfg.fingerprint() and m["format"] == held and m["split"] == split
    # real tensor names, readable by CheckpointReader without an index; only this shard's experts
    r = CheckpointReader(os.path.join(out, m["shards"][1]["dir"]), config=cfg)
    L = cfg.moe_layers[0]
    e = m["shards"][1]["experts"][0]
    assert r.format_of(f"model.layers.{L}.mlp.experts.{e}.down_proj.weight") == held
    i0, i1 = m["shards"][1]["intermediate"]
    assert r.shape_of(f"model.layers.{L}.mlp.experts.{e}.down_proj.weight") == (cfg.hidden_size, i1 - i0)
    assert len(r.names()) == 3 * len(m["shards"][1]["experts"]) * len(cfg.moe_layers)

    packed_srv, packed = _serve([dict(packed=out, shard_index=i, model_dir=model) for i in range(N)], cfg)
    orig_srv, orig = _serve(_original_shards(model, cfg, split, held), cfg)
    try:
        assert [d.info.weight_format for d in packed.shards] == [held] * N
        for layer in cfg.moe_layers:
            x, ids, w = _inputs(cfg, seed=layer)
            a, b = packed.forward(layer, x, ids, w), orig.forward(layer, x, ids, w)
            assert np.abs(a).max() > 0
            np.testing.assert_array_equal(a, b)  # bit-exact
    finally:
        packed.close()
        orig.close()
        for srv in packed_srv + orig_srv:
            srv.stop(None)


def test_int4_copied_bit_exactly(ckpts, tmp_path):
    model = ckpts["int4"]
    out = str(tmp_path / "p")
    C.convert(model, out, N, split="intermediate", quiet=True)
    src = CheckpointReader(model)
    name = "model.layers.1.mlp.experts.5.down_proj.weight"
    a = src.get_stored(name).arrays
    for i in range(N):
        b = CheckpointReader(os.path.join(out, P.shard_dirname(i, N)), config=src.config).get_stored(name).arrays
        np.testing.assert_array_equal(b["weight_packed"], a["weight_packed"][:, i * 4:(i + 1) * 4])  # 32 cols / 8
        np.testing.assert_array_equal(b["weight_scale"].view(np.uint16), a["weight_scale"][:, i:i + 1].view(np.uint16))
        assert b["weight_shape"].tolist() == [src.config.hidden_size, 32]


def test_int4_misaligned_slices_refused(ckpts, tmp_path, capsys):
    args = SimpleNamespace(model=ckpts["int4"], out=str(tmp_path / "p"), shards=4, split="intermediate",
                           fmt="auto", quiet=True)
    assert C.run(args) == 1
    err = capsys.readouterr().err
    assert "does not align to the INT4 group of 32" in err and "[0:16)" in err
    assert not os.path.exists(os.path.join(args.out, "shard-0-of-4", "layer-001.safetensors"))


def test_resume_rewrites_only_missing_or_broken(ckpts, tmp_path, capsys):
    model = ckpts["fp8"]
    args = SimpleNamespace(model=model, out=str(tmp_path / "p"), shards=N, split="experts", fmt="int8", quiet=False)
    assert C.run(args) == 0
    err = capsys.readouterr().err
    assert "[convert] layer 2/2" in err and "100%" in err and "GB/s" in err
    assert "4 layer file(s) written, 0 already complete skipped" in err
    files = {(i, L): os.path.join(args.out, P.shard_dirname(i, N), P.layer_filename(L))
             for i in range(N) for L in (1, 2)}
    first = {k: open(p, "rb").read() for k, p in files.items()}
    stat = {k: os.stat(p) for k, p in files.items()}
    os.remove(files[0, 2])  # interrupted before this one
    with open(files[1, 1], "r+b") as f:  # torn tail
        f.truncate(len(first[1, 1]) - 100)
    with open(files[1, 1] + P.PARTIAL + "-999", "wb") as f:  # a dead run's temporary file
        f.write(b"junk")
    assert C.run(args) == 0
    err = capsys.readouterr().err
    assert "2 layer file(s) written, 2 already complete skipped" in err
    for k, p in files.items():
        assert open(p, "rb").read() == first[k]
        if k not in ((0, 2), (1, 1)):
            assert os.stat(p).st_mtime_ns == stat[k].st_mtime_ns  # untouched
    assert not [fn for fn in os.listdir(os.path.dirname(files[1, 1])) if P.PARTIAL in fn]
    # a third run has nothing to do
    assert C.run(args) == 0
    assert "0 layer file(s) written, 4 already complete skipped" in capsys.readouterr().err
    # another conversion into the same directory is refused
    args.fmt = "bf16"
    assert C.run(args) == 1
    assert "already holds another conversion" in capsys.readouterr().err


def test_refused_packed_dirs(ckpts, tmp_path):
    out = str(tmp_path / "p")
    C.convert(ckpts["bf16"], out, N, split="experts", quiet=True)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(os.path.join(ckpts["bf16"], "config.json"), other / "config.json")
    text = (other / "config.json").read_text().replace('"routed_scaling_factor": 2.5', '"routed_scaling_factor": 1.5')
    (other / "config.json").write_text(text)
    with pytest.raises(P.PackedError, match="converted from another model"):
        P.load_packed(out, 0, "numpy", model_dir=str(other))
    with pytest.raises(P.PackedError, match="out of range.*holds 2 shards"):
        P.load_packed(out, 2, "numpy")
    os.remove(os.path.join(out, "shard-1-of-2", "layer-002.safetensors"))
    with pytest.raises(P.PackedError, match="layer-002.safetensors.*re-run `moesplit convert`"):
        P.load_packed(out, 1, "numpy")
    # the CLI says so and never reports ready
    r = subprocess.run([sys.executable, "-m", "cpu_expert_service.server", "--packed", out, "--shard-index", "0",
                        "--model", str(other), "--backend", "numpy"], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "converted from another model" in r.stderr and "READY" not in r.stdout


@pytest.mark.skipif("kernels" not in available_backends(), reason="Cython kernels not built")
def test_weight_format_int8_on_bf16_checkpoint(ckpts):
    model = ckpts["bf16"]
    cfg = load_config(model)
    _, ref, _ = load_shard(model, None, None, "numpy", weight_format="int8")  # numpy on the dequantised int8
    assert ref.weight_format == "int8"
    srv, client = _serve([dict(model_dir=model, weight_format="int8")], cfg)
    try:
        d = client.shards[0].info
        assert d.kernel.endswith("-int8") and d.weight_format == "bf16"  # held int8, read from bf16
        for layer in cfg.moe_layers:
            x, ids, w = _inputs(cfg, T=16, seed=10 + layer)
            a, b = client.forward(layer, x, ids, w), ref.forward(layer, x, ids, w)
            assert np.linalg.norm(a - b) <= 1e-2 * np.linalg.norm(b)
    finally:
        client.close()
        srv[0].stop(None)


def test_progress_line():
    buf = io.StringIO()
    p = C.Progress(1000, 4, quiet=False, stream=buf)
    p.done = 410
    assert p.line(2).startswith("[convert] layer 2/4  ████████▏") and "41%" in p.line(2)


def test_cli_convert_then_start_shards_from_packed(ckpts, tmp_path, capsys):
    from moesplit.cli import main
    from gpu_service.local.stack import start_shards

    model = ckpts["bf16"]
    cfg = load_config(model)
    out = str(tmp_path / "p")
    assert main(["convert", "--model", model, "--out", out, "--shards", "2", "--format", "int4", "--quiet"]) == 0
    assert "4 layer file(s) written" in capsys.readouterr().err
    orig_srv, orig = _serve(_original_shards(model, cfg, "intermediate", "int4"), cfg)
    try:
        with start_shards(model, N, backend=BACKEND, packed=out) as shards:
            with ExpertsClient(shards.addresses, cfg, timeout_s=20.0, transport="grpc") as client:
                assert [(d.info.slice_index, d.info.slice_count, d.info.weight_format) for d in client.shards] == \
                    [(0, 2, "int4"), (1, 2, "int4")]
                for layer in cfg.moe_layers:
                    x, ids, w = _inputs(cfg, seed=layer)
                    np.testing.assert_array_equal(client.forward(layer, x, ids, w), orig.forward(layer, x, ids, w))
    finally:
        orig.close()
        for s in orig_srv:
            s.stop(None)


def test_int8_scales_survive_the_kernels_requantisation():
    """Packed int8 reaches the INT8 kernels as q * scale; they re-derive scale = fl(amax / 127) with
    amax = fl(127 * scale). That gives back `scale` for every scale of the form fl(a / 127), which is
    what quant_int8_channel (and so convert) writes; hence packed int8 serves bit-exactly."""
    rng = np.random.default_rng(7)
    a = (rng.uniform(1, 2, 200_000) * 2.0 ** rng.integers(-40, 40, 200_000)).astype(np.float32)
    s = a / np.float32(127)
    np.testing.assert_array_equal((s * np.float32(127)) / np.float32(127), s)


def test_worker_threads_write_identical_files(ckpts, tmp_path):
    outs = []
    for workers in (1, 3):
        out = str(tmp_path / f"w{workers}")
        C.convert(ckpts["fp8"], out, N, split="intermediate", fmt="int8", quiet=True, workers=workers)
        outs.append(out)
    for i in range(N):
        for L in (1, 2):
            rel = os.path.join(P.shard_dirname(i, N), P.layer_filename(L))
            assert open(os.path.join(outs[0], rel), "rb").read() == open(os.path.join(outs[1], rel), "rb").read()
