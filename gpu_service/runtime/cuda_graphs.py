"""CUDA graphs of the model's decode pieces, per batch-size bucket, owned by the runner.

`gpu_service.model.deepseek.Block.steps` runs each layer as pieces (pre, mid, shared, post) around
two eager parts: the attention core (variable key length) and the expert hand-off. For an
all-decode step up to the largest bucket the step gets a `GraphSet` (gpu_service.model.step), and
each piece of each layer is captured once per (device, micro-batch slot, bucket), lazily at the
first step of that bucket, then replayed; larger, prefill and mixed steps run eager.

Static buffers: an argument is copied into the set's static input unless it *is* a static buffer
already (the previous piece's output, the RoPE table, a weight view). Inputs and outputs are
shared by all layers of a set (one buffer per piece, argument and shape; a layer consumes them
before the next layer's piece runs), and the graphs' temporaries share one memory pool, as they
replay in capture order. The pools are an item of the memory plan (plan.bytes.graph_pool_bytes).

On CPU (tests) `mode="static"` runs the same plumbing with each piece called eagerly on the static
buffers: what the graphs would compute, bit for bit. A capture that fails never fails the request:
with `on_error="eager"` (mode "cuda"'s default) graphs are turned off for the process with a
warning naming the error (`Graphs.disabled`); mode "static" raises (tests must see bugs).

Capture safety: every capture (both modes) runs the segment under `CaptureCheck`, which refuses what
a CUDA graph cannot hold: a host sync (.item(), .tolist(), bool(), .cpu(), .numpy()), an output
shape that depends on values (nonzero, masked_select, unique, boolean-mask indexing, ...) and host
data turned into a tensor (torch.tensor: baked into the graph as it was at capture). On CPU the
static mode runs the same check, so a decode segment that would break capture fails a CPU test.
"""
from __future__ import annotations

import logging

import torch

from torch.overrides import TorchFunctionMode

from gpu_service.plan.bytes import GRAPH_BUCKETS

log = logging.getLogger("moesplit.cuda_graphs")

MODES = ("cuda", "static")


# what a captured segment must not call: host syncs, value-dependent output shapes, host data
_SYNCS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"}
_DATA_SHAPED = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount", "nonzero_static"}
_HOST_DATA = {"tensor", "as_tensor", "from_numpy"}


class CaptureUnsafe(RuntimeError):
    """A captured segment called something a CUDA graph cannot replay."""


def _is_mask(i) -> bool:
    if isinstance(i, torch.Tensor):
        return i.dtype == torch.bool
    return isinstance(i, (tuple, list)) and any(_is_mask(j) for j in i)


def _to_host(args, kwargs) -> bool:
    ds = [*args[1:], kwargs.get("device")]
    return any((isinstance(d, str) and d.startswith("cpu")) or (isinstance(d, torch.device) and d.type == "cpu")
               for d in ds) and args[0].device.type != "cpu"


class CaptureCheck(TorchFunctionMode):
    """Raises CaptureUnsafe at the first call in its scope that a CUDA graph cannot replay."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        why = None
        if name in _SYNCS:
            why = "a host sync"
        elif name in _DATA_SHAPED or (name == "where" and len(args) + len(kwargs) == 1):
            why = "an output shape that depends on values"
        elif name in _HOST_DATA:
            why = "host data copied in (the graph keeps the value seen at capture)"
        elif name in ("__getitem__", "__setitem__") and len(args) > 1 and _is_mask(args[1]):
            why = "boolean-mask indexing (an output shape that depends on values)"
        elif name == "to" and args and isinstance(args[0], torch.Tensor) and _to_host(args, kwargs):
            why = "a copy to the host (a host sync)"
        if why is not None:
            raise CaptureUnsafe(f"{self.what}: {name}() is {why}, which a CUDA graph cannot replay; "
                                "compute it outside the captured segment (before the step or in its eager parts)")
        return func(*args, **kwargs)


def _tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def _sig(t: torch.Tensor) -> tuple:
    return t.data_ptr(), tuple(t.shape), t.stride(), t.dtype


def _body(fn, outs: tuple):
    """fn's call that leaves its results in the static outputs `outs` (what a graph captures)."""

    def body(*xs):
        for b, o in zip(outs, _tuple(fn(*xs))):
            b.copy_(o)

    return body


def _streams(device: torch.device) -> tuple:
    """A (capture, side) stream pair made on `device` (under its device guard)."""
    with torch.cuda.device(device):
        return torch.cuda.Stream(device), torch.cuda.Stream(device)


class _Entry:
    __slots__ = ("inputs", "outputs", "graph", "fn")

    def __init__(self, inputs, outputs, graph, fn):
        self.inputs, self.outputs, self.graph, self.fn = inputs, outputs, graph, fn


class GraphSet:
    """The graphs of one (device, micro-batch slot, bucket): `rows` = the bucket (padded rows)."""

    def __init__(self, device: torch.device, rows: int, mode: str, owner: "Graphs | None" = None):
        self.device, self.rows, self.mode, self.owner = device, rows, mode, owner
        self.index = device.index if device.index is not None else 0
        self.pool = torch.cuda.graph_pool_handle() if mode == "cuda" else None
        self.entries: dict[tuple[int, str], _Entry] = {}
        self.static: set[tuple] = set()  # signatures of tensors used as they are (no copy)
        self.buffers: dict[tuple, torch.Tensor] = {}  # static inputs / outputs shared by the layers
        self._cs: torch.Tensor | None = None
        self._pair: tuple | None = None  # (capture, side) streams of a set without an owner
        self.replays = 0

    def persist(self, *ts: torch.Tensor) -> None:
        """Tensors that stay where they are between steps (weight views): passed without a copy."""
        for t in ts:
            self.static.add(_sig(t))

    def rope_table(self, cs: torch.Tensor) -> torch.Tensor:
        """The step's RoPE table in the set's static buffer (copied once per step, read by every layer)."""
        if self._cs is None or self._cs.shape != cs.shape:
            self._cs = cs.clone()
            self.static.add(_sig(self._cs))
        else:
            self._cs.copy_(cs)
        return self._cs

    def run(self, layer: int, name: str, fn, *args) -> tuple:
        """fn(*args) as a replay of its graph (captured at the first call); returns its outputs
        (the set's shared output buffers of `name`: valid until the next call of `name`)."""
        if self.owner is not None and self.owner.disabled is not None:
            return _tuple(fn(*args))  # graphs were turned off during this step: eager from here on
        e = self.entries.get((layer, name))
        if e is None:
            try:
                e = self._capture(name, fn, args)
            except Exception as err:  # noqa: BLE001 - any capture failure: eager, never a failed request
                if self.owner is None or self.owner.on_error != "eager":
                    raise
                self.owner.disable(f"capturing layer {layer}'s {name!r} segment at {self.rows} rows failed: "
                                   f"{type(err).__name__}: {err}")
                return _tuple(fn(*args))
            self.entries[(layer, name)] = e
            return e.outputs
        for s, a in zip(e.inputs, args):
            if s is not None and s.data_ptr() != a.data_ptr():
                s.copy_(a)
        self.replays += 1
        if e.graph is not None:
            if torch.cuda.current_device() == self.index:
                e.graph.replay()
            else:  # a layer on another GPU: its graph replays on that device's current stream
                with torch.cuda.device(self.index):
                    e.graph.replay()
        else:  # static mode: the same call on the same buffers
            e.fn(*e.inputs)
        return e.outputs

    def _shared(self, key: tuple, like: torch.Tensor) -> torch.Tensor:
        """A buffer shared by every layer's segment of one name (a layer's segment fills it and
        the layer reads it before the next layer's segment runs): bytes per set, not per layer."""
        key = key + (tuple(like.shape), like.dtype)
        b = self.buffers.get(key)
        if b is None:
            b = self.buffers[key] = torch.empty_like(like)
            self.static.add(_sig(b))
        return b

    def _capture(self, name: str, fn, args) -> _Entry:
        """Copy the arguments into static inputs, warm fn up on the device's side stream, then
        capture it on the device's capture stream under that device's guard (mode "cuda")."""
        inputs = []
        for j, a in enumerate(args):
            if a is None or _sig(a) in self.static:
                inputs.append(a)
            else:
                b = self._shared((name, "in", j), a)
                b.copy_(a)
                inputs.append(b)
        check = f"layer segment {name!r} at {self.rows} rows"
        if self.mode != "cuda":
            with CaptureCheck(check):
                outs = tuple(self._shared((name, "out", j), o) for j, o in enumerate(_tuple(fn(*inputs))))
                body = _body(fn, outs)
                body(*inputs)
            return _Entry(inputs, outs, None, body)
        if self.owner is not None:
            capture, side = self.owner.streams(self.device)
        else:
            capture, side = self._pair = self._pair or _streams(self.device)
        with torch.cuda.device(self.device):  # the capture stream's device is current (torch's default is cuda:0's)
            cur = torch.cuda.current_stream(self.device)
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                probe = _tuple(fn(*inputs))  # warm-up off the capture (lazy init, cuBLAS workspaces)
            cur.wait_stream(side)
            outs = tuple(self._shared((name, "out", j), o) for j, o in enumerate(probe))
            del probe
            body = _body(fn, outs)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=capture, capture_error_mode="thread_local"):
                with CaptureCheck(check):
                    body(*inputs)
            graph.replay()
        return _Entry(inputs, outs, graph, body)


class Graphs:
    """The model's graph sets, by (device, micro-batch slot, bucket)."""

    def __init__(self, buckets: tuple[int, ...] = GRAPH_BUCKETS, mode: str = "cuda", min_rows: int = 1,
                 on_error: str | None = None):
        if mode not in MODES:
            raise ValueError(f"CUDA-graph mode {mode!r}: expected one of {MODES}")
        self.on_error = on_error or ("eager" if mode == "cuda" else "raise")
        if self.on_error not in ("eager", "raise"):
            raise ValueError(f"on_error {on_error!r}: expected 'eager' or 'raise'")
        self.disabled: str | None = None  # why graphs were turned off at run time (None: on)
        if mode == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("CUDA graphs need a CUDA device: run with --no-cuda-graphs (or mode='static' in tests)")
        self.buckets = tuple(sorted(b for b in buckets if b >= min_rows)) or (min_rows,)
        self.mode = mode
        self.sets: dict[tuple, GraphSet] = {}
        # one capture and one side stream per device, made at its first capture and kept: each new
        # (cuBLAS handle, stream) pair costs a workspace that is never freed (32 MiB on Hopper)
        self._streams: dict[torch.device, tuple] = {}
        self.eager_steps = 0  # all-decode steps above the largest bucket

    def streams(self, device: torch.device) -> tuple:
        """The (capture, side) streams of `device`, made once."""
        pair = self._streams.get(device)
        if pair is None:
            pair = self._streams[device] = _streams(device)
        return pair

    def devices(self) -> list[torch.device]:
        """Every device graphs were captured (or tried) on."""
        return sorted({*self._streams, *(s.device for s in self.sets.values())}, key=str)

    def disable(self, why: str) -> None:
        """Turn graphs off for the rest of the process (every later step eager), with a warning;
        every device that captured is synchronised before its graphs and pools are dropped."""
        if self.disabled is None:
            self.disabled = why
            log.warning("CUDA graphs off, decode runs eager: %s (start with --no-cuda-graphs to skip the attempt)", why)
            if self.mode == "cuda":
                for dev in self.devices():
                    torch.cuda.synchronize(dev)
        self.sets.clear()  # the captured graphs and their pools go

    def bucket(self, B: int) -> int | None:
        """The smallest bucket holding B rows (None above the largest)."""
        return next((b for b in self.buckets if b >= B), None)

    def get(self, device: torch.device, slot: int, B: int) -> GraphSet | None:
        """The set for B rows on `device` (its rows: the bucket), None above the largest bucket
        or on a device the mode does not apply to (eager there)."""
        if (device.type == "cuda") != (self.mode == "cuda") or self.disabled is not None:
            return None
        b = self.bucket(B)
        if b is None:
            self.eager_steps += 1
            return None
        key = (device, slot, b)
        s = self.sets.get(key)
        if s is None:
            s = self.sets[key] = GraphSet(device, b, self.mode, self)
        return s

    def captured(self) -> int:
        """Segments captured so far, over every set."""
        return sum(len(s.entries) for s in self.sets.values())
