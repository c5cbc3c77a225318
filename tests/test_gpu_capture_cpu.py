"""CUDA-graph capture plumbing checked on the CPU: torch.cuda's stream, device, graph and
synchronize calls are replaced by recorders, so the order and placement of what
`gpu_service.runtime.cuda_graphs` asks CUDA for is visible without a GPU.

What a GPU run cannot show cheaply, these show by construction: one capture and one side stream per
device for the life of the `Graphs` (not one per capture), every capture and replay under its own
device's guard with that device's capture stream, and `disable()` synchronising every device used.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from gpu_service.runtime import cuda_graphs


class FakeCuda:
    """Records what cuda_graphs asks of torch.cuda; `current` is the fake current device index."""

    def __init__(self):
        self.current = 0
        self.streams: list[tuple[int, int]] = []  # (stream's device, current device when made)
        self.captures: list[tuple[int, object]] = []  # (current device, capture stream) at capture
        self.replays: list[int] = []  # current device at each replay
        self.synced: list[int] = []
        self.defaults: dict[int, "FakeStream"] = {}

    def install(self, mp):
        fake = self

        class FakeStream:
            def __init__(self, device=None):
                self.device = torch.device(device).index if device is not None else fake.current
                fake.streams.append((self.device, fake.current))

            def wait_stream(self, other):
                assert other.device == self.device, "a stream waits on a stream of its own device"

        class FakeGraph:
            def replay(self):
                fake.replays.append(fake.current)

        @contextlib.contextmanager
        def device(d):
            prev, fake.current = fake.current, torch.device(d).index if not isinstance(d, int) else d
            try:
                yield
            finally:
                fake.current = prev

        @contextlib.contextmanager
        def graph(g, pool=None, stream=None, capture_error_mode="global"):
            fake.captures.append((fake.current, stream))
            yield

        def current_stream(d=None):
            i = torch.device(d).index if d is not None else fake.current
            if i not in fake.defaults:
                s = FakeStream.__new__(FakeStream)
                s.device = i
                fake.defaults[i] = s
            return fake.defaults[i]

        self.Stream = FakeStream
        mp.setattr(torch.cuda, "is_available", lambda: True)
        mp.setattr(torch.cuda, "graph_pool_handle", lambda: object())
        mp.setattr(torch.cuda, "Stream", FakeStream)
        mp.setattr(torch.cuda, "CUDAGraph", FakeGraph)
        mp.setattr(torch.cuda, "device", device)
        mp.setattr(torch.cuda, "graph", graph)
        mp.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
        mp.setattr(torch.cuda, "current_stream", current_stream)
        mp.setattr(torch.cuda, "current_device", lambda: fake.current)
        mp.setattr(torch.cuda, "synchronize", lambda d=None: fake.synced.append(
            torch.device(d).index if d is not None else fake.current))
        return self


@pytest.fixture
def fake(monkeypatch):
    return FakeCuda().install(monkeypatch)


def _segment(x, w):
    return x @ w, x + 1


def test_one_capture_and_one_side_stream_per_device_for_every_capture(fake):
    g = cuda_graphs.Graphs(buckets=(1, 2, 4, 8), mode="cuda")
    devs = [torch.device("cuda", 0), torch.device("cuda", 1)]
    w = torch.randn(8, 8)
    for dev in devs:
        for B in (1, 2, 3, 5, 8):
            s = g.get(dev, slot=B % 2, B=B)
            s.persist(w)
            for layer in range(3):
                for name in ("pre", "post"):
                    s.run(layer, name, _segment, torch.randn(s.rows, 8), w)  # capture
                    s.run(layer, name, _segment, torch.randn(s.rows, 8), w)  # replay
    assert g.captured() == 2 * 5 * 3 * 2  # devices x sets (5 distinct (slot, bucket)) x layers x segments
    assert len(fake.streams) == 4, f"streams made: {fake.streams} (want a capture + a side stream per device)"
    assert sorted(d for d, _ in fake.streams) == [0, 0, 1, 1]
    assert all(d == cur for d, cur in fake.streams), "each device's streams are made under its own guard"
    for cur, stream in fake.captures:
        assert stream is g.streams(torch.device("cuda", cur))[0], "captured on its device's capture stream"
    assert {c for c, _ in fake.captures} == {0, 1}
    # each capture replays once right after it; every later call replays too
    assert sum(1 for r in fake.replays if r == 1) == sum(1 for c, _ in fake.captures if c == 1) * 2
    assert fake.current == 0, "the current device is restored after a capture or replay on another GPU"


def test_capture_on_the_second_gpu_is_under_its_guard(fake):
    g = cuda_graphs.Graphs(buckets=(4,), mode="cuda")
    s = g.get(torch.device("cuda", 1), 0, 3)
    s.run(0, "mid", _segment, torch.randn(4, 8), torch.randn(8, 8))
    assert fake.captures == [(1, g.streams(torch.device("cuda", 1))[0])]
    s.run(0, "mid", _segment, torch.randn(4, 8), torch.randn(8, 8))
    assert fake.replays == [1, 1]


def test_disable_synchronises_every_device_used(fake):
    g = cuda_graphs.Graphs(buckets=(2,), mode="cuda")
    for i in (0, 1):
        g.get(torch.device("cuda", i), 0, 2).run(0, "pre", _segment, torch.randn(2, 8), torch.randn(8, 8))
    g.disable("test")
    assert sorted(fake.synced) == [0, 1]
    assert g.get(torch.device("cuda", 0), 0, 2) is None


def _item(x, w):
    return x * x.sum().item(), w


def _mask(x, w):
    return x[x > 0].sum() + w.sum(), w


def _nonzero(x, w):
    return torch.nonzero(x).float().sum() + x, w


def _host(x, w):
    return x + torch.tensor([1.0]), w


def _tolist(x, w):
    return x + len([v for v in x.sum(1).tolist() if v > 0]), w


@pytest.mark.parametrize("seg,what", [(_item, "item"), (_mask, "__getitem__"), (_nonzero, "nonzero"),
                                      (_host, "tensor"), (_tolist, "tolist")])
def test_static_capture_refuses_what_a_graph_cannot_replay(seg, what):
    """mode "static" (CPU tests) captures under the same check as CUDA: a host sync, a value-shaped
    output or host data inside a segment fails the capture, naming the call."""
    g = cuda_graphs.Graphs(buckets=(4,), mode="static")
    s = g.get(torch.device("cpu"), 0, 4)
    with pytest.raises(cuda_graphs.CaptureUnsafe, match=rf"'seg' at 4 rows: {what}\(\)"):
        s.run(0, "seg", seg, torch.randn(4, 8), torch.randn(8, 8))
    ok = g.get(torch.device("cpu"), 0, 4)
    out = ok.run(0, "fine", _segment, torch.ones(4, 8), torch.eye(8))  # matmul, add: capturable
    assert torch.equal(out[0], torch.ones(4, 8)) and torch.equal(out[1], torch.full((4, 8), 2.0))


def test_cuda_capture_of_a_syncing_segment_turns_graphs_off_naming_it(fake, caplog):
    """On CUDA the check runs inside torch.cuda.graph: the capture fails before CUDA's own (opaque)
    capture error, graphs go off with a warning naming .item(), the request gets eager results."""
    g = cuda_graphs.Graphs(buckets=(4,), mode="cuda")
    s = g.get(torch.device("cuda", 0), 0, 4)
    x, w = torch.randn(4, 8), torch.randn(8, 8)
    with caplog.at_level("WARNING", logger="moesplit.cuda_graphs"):
        out = s.run(0, "seg", _item, x, w)
    assert torch.equal(out[0], _item(x, w)[0])
    assert g.disabled and "item()" in g.disabled and "host sync" in g.disabled
    assert fake.replays == []


def test_model_decode_segments_run_under_the_capture_check(monkeypatch):
    """Every decode segment the model captures is checked: V3 and V3.2 (indexer) tiny models decode
    with static graphs, and the check saw each captured segment's torch calls."""
    from tests.test_decode import _setup, ARCHS, greedy_decode, PROMPTS

    seen: list[str] = []
    orig = cuda_graphs.CaptureCheck.__torch_function__

    def spy(self, func, types, args=(), kwargs=None):
        seen.append(self.what)
        return orig(self, func, types, args, kwargs)

    monkeypatch.setattr(cuda_graphs.CaptureCheck, "__torch_function__", spy)
    for arch in ARCHS:
        cfg, model, experts, _ = _setup(arch)
        graphs = cuda_graphs.Graphs(mode="static", min_rows=model.row_block(torch.device("cpu")))
        greedy_decode(model, cfg, experts, PROMPTS[:3], 3, graphs=graphs)
        names = {n for s in graphs.sets.values() for _, n in s.entries}
        assert {"pre", "mid"} <= names, names
        for n in names:
            assert any(f"'{n}'" in w for w in seen), f"segment {n} captured without the check"
