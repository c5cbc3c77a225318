"""`moesplit convert`: a Hugging Face checkpoint's routed experts -> packed per-shard layer files.

    moesplit convert --model DIR --out OUTDIR --shards N [--split intermediate|experts]
                     [--format auto|bf16|int8|int4] [--workers N] [--quiet]

Writes OUTDIR/shard-{i}-of-{N}/layer-{L:03d}.safetensors for every shard and MoE layer, plus
OUTDIR/config.json and OUTDIR/moesplit-packed.json (layout: cpu_expert_service.packed), for
`moesplit expert-server --packed OUTDIR --shard-index i`. auto = int4 for an INT4 checkpoint
(copied bit-exactly, never re-quantised), mxfp4 for a DeepSeek-V4 MXFP4 checkpoint (copied as
stored, weight + e8m0 scale), else bf16; an FP8 or bf16 checkpoint is dequantised
and quantised to the chosen format (int8: the kernels' own per-channel quantisation, int4:
compressed-tensors group 32).

Streams layer by layer, expert by expert (each expert is read once for all shards; memory is a
few experts: --workers threads dequantise/quantise ahead, the main thread writes in order).
Resumable: layer files are written under a temporary name and renamed when complete; a re-run
skips complete files and rewrites missing, truncated or partial ones (one convert per OUTDIR at
a time). A progress line goes to stderr. numpy only (no torch).
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from checkpoint.names import PROJS, expert_weight
from cpu_expert_service import packed as P
from cpu_expert_service.arch import expert_weight_name

BAR = " ▏▎▍▌▋▊▉█"


class Progress:
    """`\\r[convert] layer 12/58  ███▌      41%  1.2 GB/s` on stderr (one line per layer when not a TTY)."""

    def __init__(self, total_bytes: int, n_layers: int, quiet: bool, stream=None):
        self.total, self.n_layers, self.quiet = max(1, total_bytes), n_layers, quiet
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.done = 0  # bytes written or found complete
        self.written = 0  # bytes written by this run
        self.t0 = time.perf_counter()
        self._last = 0.0

    def line(self, layer_i: int) -> str:
        frac = min(1.0, self.done / self.total)
        width = 20
        full, part = divmod(int(frac * width * 8), 8)
        bar = ("█" * full + (BAR[part] if full < width else "")).ljust(width)
        rate = self.written / max(1e-9, time.perf_counter() - self.t0) / 1e9
        return f"[convert] layer {layer_i}/{self.n_layers}  {bar}  {frac * 100:3.0f}%  {rate:.2f} GB/s"

    def update(self, layer_i: int, force: bool = False) -> None:
        if self.quiet:
            return
        now = time.perf_counter()
        if self.tty and (force or now - self._last > 0.1):
            self.stream.write("\r" + self.line(layer_i))
            self.stream.flush()
            self._last = now
        elif not self.tty and force:
            self.stream.write(self.line(layer_i) + "\n")
            self.stream.flush()

    def end(self) -> None:
        if self.tty and not self.quiet:
            self.stream.write("\n")


def convert(model_dir: str, out_dir: str, shards: int, split: str = "intermediate", fmt: str = "auto",
            quiet: bool = False, workers: int | None = None) -> dict:
    """Convert (or finish converting) `model_dir` into `out_dir`; `workers` threads dequantise and
    quantise experts (default: one per CPU; numpy releases the GIL). Returns a summary dict:
    format, files, written, skipped, bytes_written, seconds, gb_per_s."""
    from checkpoint.reader import CheckpointReader

    reader = CheckpointReader(model_dir, any_architecture=True)
    cfg = reader.config
    expert_weight = expert_weight_name(cfg)
    layers = list(cfg.moe_layers)
    if not layers:
        raise ValueError(f"{model_dir}: the model has no MoE layers; nothing to convert")
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    src = reader.format_of(expert_weight(layers[0], 0, "gate"))
    fmt = P.resolve_format(fmt, src)
    plan = P.plan_shards(cfg, shards, split)
    copy_int4 = src == "int4" and fmt == "int4"
    copy_bf16 = src == "bf16" and fmt == "bf16"  # stored bits, no float32 round trip
    if fmt == "mxfp4":  # copied as stored (resolve_format allows mxfp4 from MXFP4 only)
        P.check_int4_slices(plan, I, "MXFP4")
    if copy_int4:
        gs = cfg.quantization.group_size if cfg.quantization is not None else P.INT4_GROUP
        if gs != P.INT4_GROUP:
            raise ValueError(f"{model_dir}: INT4 group_size {gs}; the kernels read group {P.INT4_GROUP} only: "
                             "convert with --format bf16 or int8")
        P.check_int4_slices(plan, I)
    # headers only: every expert tensor is present, inside its file and of the right shape
    reader.verify([expert_weight(L, e, p) for L in layers for e in range(cfg.n_routed_experts) for p in PROJS])

    manifest = {"moesplit_packed": P.VERSION, "fingerprint": cfg.fingerprint(), "config": "config.json",
                "model": os.path.abspath(model_dir), "source_format": src, "format": fmt, "split": split,
                "shards": plan}
    os.makedirs(out_dir, exist_ok=True)
    mpath = os.path.join(out_dir, P.MANIFEST)
    if os.path.exists(mpath):
        old = P.read_manifest(out_dir)
        keys = ("fingerprint", "format", "split", "shards")
        if any(old.get(k) != manifest[k] for k in keys):
            was = ", ".join(f"{k}={old.get(k)!r}" for k in ("fingerprint", "format", "split"))
            raise ValueError(f"{out_dir} already holds another conversion ({was}, {len(old.get('shards', []))} "
                             f"shards); use another --out or delete it")
    shutil.copyfile(os.path.join(model_dir, "config.json"), os.path.join(out_dir, "config.json"))
    P.write_json(mpath, manifest)
    stale = 0
    for s in plan:
        sdir = os.path.join(out_dir, s["dir"])
        os.makedirs(sdir, exist_ok=True)
        for fn in os.listdir(sdir):
            if P.PARTIAL in fn:  # left by an interrupted run
                os.remove(os.path.join(sdir, fn))
                stale += 1

    jobs = {}  # (layer, shard index) -> (path, specs, meta)
    for L in layers:
        for s in plan:
            i0, i1 = s["intermediate"]
            meta = P.layer_metadata(fmt, s["index"], shards)
            jobs[L, s["index"]] = (os.path.join(out_dir, s["dir"], P.layer_filename(L)),
                                   P.tensor_specs(fmt, L, s["experts"], i1 - i0, H, expert_weight), meta)
    prog = Progress(sum(P.file_size(sp, m) for _, sp, m in jobs.values()), len(layers), quiet)
    written = skipped = 0
    workers = max(1, workers or len(os.sched_getaffinity(0)))
    pool = ThreadPoolExecutor(workers, thread_name_prefix="convert") if workers > 1 else None
    t0 = time.perf_counter()
    for li, L in enumerate(layers, 1):
        todo = []
        for s in plan:
            path, specs, meta = jobs[L, s["index"]]
            if P.layer_complete(path, specs):
                skipped += 1
                prog.done += os.path.getsize(path)
            else:
                todo.append((s, P.LayerWriter(path, specs, meta)))

        try:
            experts = sorted({e for s, _ in todo for e in s["experts"]})
            pending: deque = deque()
            for e in experts + [None] * (2 * workers):  # keep up to 2*workers experts in flight, write in order
                if e is not None:
                    job = (reader, L, e, [sh for sh, _ in todo], fmt, copy_int4, copy_bf16, expert_weight)
                    pending.append(pool.submit(_prepare, *job) if pool else _Done(_prepare(*job)))
                if not pending or (e is not None and len(pending) < 2 * workers):
                    continue
                for (_, wr), arrays in zip(todo, pending.popleft().result()):
                    for a in arrays:
                        nb = wr.write(a)
                        prog.written += nb
                        prog.done += nb
                prog.update(li)
            for s, wr in todo:
                wr.commit()
                prog.done += wr.bytes - wr.data_bytes  # headers
                written += 1
        except BaseException:
            for _, wr in todo:
                wr.abort()
            if pool:
                pool.shutdown(wait=True, cancel_futures=True)
            reader.close()
            raise
        reader.close()  # unmap: pages read so far stop counting towards RSS
        prog.update(li, force=True)
    prog.end()
    if pool:
        pool.shutdown()
    secs = time.perf_counter() - t0
    summary = dict(format=fmt, source_format=src, split=split, files=len(jobs), written=written, skipped=skipped,
                   stale_partials_removed=stale, bytes_written=prog.written, seconds=secs,
                   gb_per_s=prog.written / max(secs, 1e-9) / 1e9)
    return summary


def _prepare(reader, L: int, e: int, shards: list[dict], fmt: str, copy_int4: bool,
             copy_bf16: bool, expert_weight=expert_weight) -> list[list[np.ndarray]]:
    """Expert e of layer L as each shard stores it: per shard, its arrays in tensor_specs order
    ([] for a shard that does not hold e). Runs in the worker threads."""
    names = [expert_weight(L, e, p) for p in PROJS]
    copy_stored = copy_int4 or fmt == "mxfp4"
    if copy_stored:
        stored = [reader.get_stored(n).arrays for n in names]
        for n, a in zip(names, stored):  # INT4 scales / MXFP4 values (e8m0 255 is NaN) must decode finite
            _check_finite(reader, n, reader.get(n) if fmt == "mxfp4" else a["weight_scale"])
    else:  # gate [I, H], up [I, H], down [H, I]: f32 dequantised, or the stored bf16
        ws = [reader.get_stored(n).arrays["weight"] if copy_bf16 else reader.get(n) for n in names]
        for n, w in zip(names, ws):
            _check_finite(reader, n, w)
    out = []
    for s in shards:
        arrays: list[np.ndarray] = []
        if e in s["experts"]:
            i0, i1 = s["intermediate"]
            for k, (proj, n) in enumerate(zip(PROJS, names)):
                if copy_int4:
                    arrays += P.slice_int4(stored[k], proj, i0, i1)
                elif fmt == "mxfp4":
                    arrays += P.slice_mxfp4(stored[k], proj, i0, i1)
                else:
                    arrays += P.encode(fmt, n, ws[k][:, i0:i1] if proj == "down" else ws[k][i0:i1])
        out.append(arrays)
    return out


class _Done:
    """A finished future (workers=1: no thread pool)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def _check_finite(reader, name: str, a: np.ndarray) -> None:
    from checkpoint.reader import CheckpointError

    if not np.isfinite(a).all():  # f32, or bf16 (ml_dtypes' isfinite: no float32 copy)
        raise CheckpointError(f"{reader.file_of(name)}: tensor {name!r} holds NaN/Inf values; the checkpoint "
                              "file is corrupt: re-download it")


# ---- CLI --------------------------------------------------------------------------------------
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory (config.json + *.safetensors)")
    p.add_argument("--out", required=True, help="output directory (created; re-running resumes)")
    p.add_argument("--shards", type=int, required=True, help="number of expert shards (processes) to pack for")
    p.add_argument("--split", choices=P.SPLITS, default="intermediate",
                   help="intermediate: a slice of every expert per shard (default); experts: a range of experts")
    p.add_argument("--format", dest="fmt", choices=("auto",) + P.FORMATS, default="auto",
                   help="weight format of the packed files: auto = int4 for an INT4 checkpoint, mxfp4 (as stored) "
                        "for a DeepSeek-V4 MXFP4 one, else bf16")
    p.add_argument("--workers", type=int, default=0,
                   help="threads that dequantise / quantise experts (default 0: one per CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress line")


def run(args: argparse.Namespace) -> int:
    from checkpoint.reader import CheckpointError

    try:
        s = convert(args.model, args.out, args.shards, split=args.split, fmt=args.fmt, quiet=args.quiet,
                    workers=getattr(args, "workers", 0))
    except (CheckpointError, KeyError, ValueError, OSError) as e:
        print(f"moesplit convert: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nmoesplit convert: interrupted; re-run the same command to resume (complete layer files are kept)",
              file=sys.stderr)
        return 130
    print(f"moesplit convert: {s['written']} layer file(s) written, {s['skipped']} already complete skipped "
          f"({s['format']} from {s['source_format']}, split {s['split']}, {args.shards} shard(s)); "
          f"{s['bytes_written'] / 1e6:.1f} MB in {s['seconds']:.2f}s ({s['gb_per_s']:.2f} GB/s) -> {args.out}",
          file=sys.stderr)
    print(f"serve with: moesplit expert-server --packed {args.out} --shard-index I  (I in 0..{args.shards - 1})")
    return 0
