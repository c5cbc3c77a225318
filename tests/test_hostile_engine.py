"""Hostile requests against the engine: none may stop it, each fails alone, and it keeps serving.

One in-process serving stack (tiny checkpoint, experts in-process, prefix cache on, API key set)
on 127.0.0.1. Each probe asserts the request refused (400 naming the field, gRPC
INVALID_ARGUMENT) or failed alone, that a greedy request afterwards returns the tokens it
returned before the probe, and that /live answered under 200 ms throughout. The defences behind
validation are probed too, by letting a bad value past it (`_past_validation`): the scheduler
must then fail that one request and go on. The watchdog test kills the engine thread of a
server in a subprocess and expects the process to exit non-zero.
"""
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import grpc
import httpx
import pytest

KEY = "sk-hostile"
MODEL = "tiny-hostile"
H = {"authorization": f"Bearer {KEY}"}
GREEDY = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 8, "temperature": 0, "ignore_eos": True,
          "return_token_ids": True}
LIVE_MS = 200


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=0)


def _runner(model_dir):
    """A float32 CPU runner over in-process experts, prefix cache on."""
    import torch

    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    _, backend, _ = load_shard(model_dir, None, None, "numpy")
    return ModelRunner(CheckpointReader(model_dir), LocalExperts(backend), device=torch.device("cpu"),
                       dtype=torch.float32, kv_tokens=4096, page_size=16)


@pytest.fixture(scope="module")
def stack(model_dir):
    from gpu_service.api.tokenizer import Tokenizer
    from gpu_service.entrypoints.serving import ServingStack

    st = ServingStack(_runner(model_dir), Tokenizer(model_dir), MODEL, port=0, grpc_port=0, api_key=KEY,
                      max_batch=32, chunk_tokens=64, max_waiting=64)
    st.start()
    yield st
    st.stop()


def _post(st, body, path="/v1/completions", timeout=60):
    """POST `body` as JSON with ASCII escapes (so a lone surrogate travels as "\\ud800", as a hostile client sends it)."""
    return httpx.post(st.http_url + path, content=json.dumps(body), timeout=timeout,
                      headers={**H, "content-type": "application/json"})


def _greedy(st) -> list[int]:
    r = _post(st, GREEDY)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


@pytest.fixture(scope="module")
def baseline(stack):
    return _greedy(stack)


@contextlib.contextmanager
def _live_watch(st):
    """Poll /live every 20 ms meanwhile; on exit assert every answer was 200 within LIVE_MS."""
    worst, bad, stop = [0.0], [], threading.Event()

    def poll():
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                t0 = time.perf_counter()
                code = c.get(st.http_url + "/live").status_code
                worst[0] = max(worst[0], (time.perf_counter() - t0) * 1e3)
                if code != 200:
                    bad.append(code)
                time.sleep(0.02)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    try:
        yield
    finally:
        stop.set()
        th.join(10)
    assert not bad, f"/live answered {bad}"
    assert worst[0] < LIVE_MS, f"/live took {worst[0]:.0f} ms"


def _after(st, baseline):
    """The engine still serves: the same greedy tokens as before the probe."""
    assert st.engine.alive
    assert _greedy(st) == baseline


def _refused(r, param: str):
    assert r.status_code == 400, (r.status_code, r.text[:300])
    err = r.json()["error"]
    assert err["param"] == param, err
    return err["message"]


def _past_validation(monkeypatch, **params_overrides):
    """Let SamplingParams values the engine's check refuses through it, as a bug in validation would:
    the engine must still fail only that request."""
    from gpu_service.runtime import engine as engine_mod
    from gpu_service.runtime import requests as requests_mod

    orig = requests_mod.check_request
    monkeypatch.setattr(requests_mod, "_lone_surrogate", lambda s: None)
    monkeypatch.setattr(engine_mod, "check_request",
                        lambda eng, ids, p, *a: orig(eng, ids, dataclasses.replace(p, **params_overrides), *a))


def _raw_params(**values):
    """SamplingParams holding values its own checks refuse (set after construction)."""
    from gpu_service.runtime.sampling import SamplingParams

    p = SamplingParams(temperature=1.0, seed=1)
    for k, v in values.items():
        object.__setattr__(p, k, v)
    return p


def _alone(st, bad_handle, baseline):
    """`bad_handle` failed with an error while a greedy request beside it completed."""
    from gpu_service.runtime.sampling import SamplingParams

    ok = st.engine.submit([5, 6, 7, 8], SamplingParams(), max_tokens=8, ignore_eos=True)
    ids, _, finish = ok.result(timeout=60)
    bad_handle.result(timeout=60)
    assert bad_handle.finish_reason == "error", bad_handle.finish_reason
    assert finish == "length" and ids == baseline
    return bad_handle.error


# ---- probe 1: values that cannot be sampled, cache keys that cannot be made ----------------------
def test_cache_salt_lone_surrogate(stack, baseline, monkeypatch):
    with _live_watch(stack):
        msg = _refused(_post(stack, {**GREEDY, "cache_salt": "\ud800"}), "cache_salt")
        assert "surrogate" in msg
        from gpu_service.runtime.requests import RequestError

        with pytest.raises(RequestError) as ei:  # the engine's own check, for callers other than HTTP
            stack.engine.submit([5, 6], max_tokens=2, cache_salt="x\udfff")
        assert ei.value.param == "cache_salt"
        _past_validation(monkeypatch)  # past the check: prefix_cache.root_key raises in _schedule
        h = stack.engine.submit([5, 6, 7, 8], max_tokens=4, cache_salt="\ud800")
        monkeypatch.undo()
        assert "UnicodeEncodeError" in _alone(stack, h, baseline)
        _after(stack, baseline)


def test_top_p_that_is_zero_in_float32(stack, baseline):
    with _live_watch(stack):
        msg = _refused(_post(stack, {**GREEDY, "temperature": 1.0, "top_p": 1e-300}), "top_p")
        assert "float32" in msg and "top_k" in msg
        # past validation: the most likely token is always kept, so it samples (no crash, no hang)
        h = stack.engine.submit([5, 6, 7, 8], _raw_params(top_p=1e-300), max_tokens=4, ignore_eos=True)
        assert h.result(timeout=60)[2] == "length"
        _after(stack, baseline)


def test_temperature_that_overflows_float32(stack, baseline):
    from gpu_service.api.grpc_client import GenerateClient

    with _live_watch(stack):
        for t in (1e-300, 1e-44, 1e-8):
            msg = _refused(_post(stack, {**GREEDY, "temperature": t}), "temperature")
            assert "use 0 for greedy" in msg
        with GenerateClient(stack.grpc_address, api_key=KEY) as gc, pytest.raises(grpc.RpcError) as ei:
            next(gc.generate(prompt_ids=[5, 6, 7], max_tokens=2, temperature=1e-44))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "temperature" in ei.value.details()
        h = stack.engine.submit([5, 6, 7, 8], _raw_params(temperature=1e-44), max_tokens=4, ignore_eos=True)
        assert "no token can be sampled" in _alone(stack, h, baseline)
        _after(stack, baseline)


def test_min_tokens_with_every_token_banned(stack, baseline, monkeypatch):
    V = stack.engine.cfg.vocab_size
    body = {**GREEDY, "min_tokens": 1, "stop_token_ids": list(range(V))}
    with _live_watch(stack):
        for temperature in (0, 1.0):
            msg = _refused(_post(stack, {**body, "temperature": temperature}), "stop_token_ids")
            assert "min_tokens" in msg
        from gpu_service.api.grpc_client import GenerateClient

        from protos.moesplit.v1 import generate_pb2

        req = generate_pb2.GenerateRequest(prompt_ids=[5, 6, 7], max_tokens=2, min_tokens=1,
                                           stop_token_ids=list(range(V)))
        with GenerateClient(stack.grpc_address, api_key=KEY) as gc, pytest.raises(grpc.RpcError) as ei:
            next(gc.stub.Generate(req, timeout=30, metadata=gc.metadata))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        _past_validation(monkeypatch, min_tokens=0)  # the sampler meets a row with no token left
        from gpu_service.runtime.sampling import SamplingParams

        for temperature in (0.0, 1.0):
            p = SamplingParams(temperature=temperature, min_tokens=1, stop_token_ids=tuple(range(V)))
            h = stack.engine.submit([5, 6, 7, 8], p, max_tokens=4)
            assert "no token can be sampled" in _alone(stack, h, baseline)
            assert h.error_param == "stop_token_ids"
        monkeypatch.undo()
        _after(stack, baseline)


def test_unforeseen_error_in_sampling_fails_one_request(stack, baseline, monkeypatch):
    """A bug in the sampler for one row (raised from inside torch) fails that request only."""
    from gpu_service.runtime import logits as logits_mod

    orig = logits_mod.sample

    def sample(x, p, gen):
        if p.seed == 666:
            raise RuntimeError("boom in the sampler")
        return orig(x, p, gen)

    monkeypatch.setattr(logits_mod, "sample", sample)
    with _live_watch(stack):
        h = stack.engine.submit([5, 6, 7, 8], _raw_params(seed=666), max_tokens=4)
        assert "boom in the sampler" in _alone(stack, h, baseline)
        monkeypatch.undo()
        _after(stack, baseline)


# ---- probe 3 / 6: n choices as one unit --------------------------------------------------------------
def test_n16_at_default_temperature_50_of_50(stack, baseline):
    body = {"model": MODEL, "prompt": [5, 6, 7, 8, 9], "max_tokens": 3, "n": 16, "ignore_eos": True}
    done, t0 = [], time.monotonic()

    def one(_):
        r = _post(stack, body, timeout=60)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 16 and all(c["finish_reason"] == "length" for c in choices)
        done.append(1)

    with _live_watch(stack):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(4) as ex:
            list(ex.map(one, range(50)))
        dt = time.monotonic() - t0
        print(f"\nn=16 x 50 requests: {len(done)} complete in {dt:.1f} s")
        assert len(done) == 50 and dt < 240
        st = stack.engine.stats()
        assert st["running"] == 0 and st["waiting"] == 0, st
        _after(stack, baseline)


def test_n_choices_count_against_the_queue(model_dir):
    from gpu_service.runtime.engine import Engine, QueueFull, RequestError
    from gpu_service.runtime.sampling import SamplingParams

    eng = Engine(_runner(model_dir), None, max_batch=4, max_waiting=20)  # not started: requests stay queued
    ps = [SamplingParams(temperature=1.0, seed=i) for i in range(16)]
    hs = eng.submit_n([5, 6, 7], ps, max_tokens=2)
    assert len(hs) == 16 and eng.stats()["waiting"] == 16
    with pytest.raises(QueueFull):
        eng.submit_n([5, 6, 7], ps[:8], max_tokens=2)  # 16 + 8 > 20: none of the 8 queued
    assert eng.stats()["waiting"] == 16
    with pytest.raises(RequestError) as ei:
        eng.submit_n([5, 6, 7], ps * 2, max_tokens=2)  # 32 choices can never fit in 20
    assert ei.value.param == "n"
    eng.stop()
    assert all(h.finish_reason == "cancelled" for h in hs)


def test_many_prompts_times_n_refused_before_queueing(stack, baseline):
    body = {"model": MODEL, "prompt": [[5, 6, 7]] * 64, "max_tokens": 2, "n": 16}
    with _live_watch(stack):
        msg = _refused(_post(stack, body), "n")
        assert "--max-waiting" in msg
        assert stack.engine.stats()["waiting"] == 0
        _after(stack, baseline)


def test_cancel_frees_every_choice(stack, baseline):
    from gpu_service.runtime.sampling import SamplingParams

    eng = stack.engine
    with _live_watch(stack):
        for wait_first in (True, False):  # cancelled mid-generation, and before the fork
            hs = eng.submit_n([5, 6, 7, 8, 9, 10], [SamplingParams(temperature=1.0, seed=i) for i in range(16)],
                              max_tokens=400, ignore_eos=True)
            if wait_first:
                hs[0].get(timeout=60)
            for h in hs:
                h.cancel()
            for h in hs:
                h.result(timeout=30)
            assert all(h.finish_reason in ("cancelled", "length") for h in hs)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st = eng.stats()
                if st["running"] == 0 and st["waiting"] == 0 and st["pool_usage"] == 0:
                    break
                time.sleep(0.05)
            assert st["running"] == 0 and st["waiting"] == 0 and st["pool_usage"] == 0, st
        _after(stack, baseline)


# ---- probe 9: client errors that were 500s -------------------------------------------------------------
def test_lone_surrogates_are_400_naming_the_field(stack, baseline):
    cases = [("/v1/completions", {**GREEDY, "prompt": "a\ud800b"}, "prompt"),
             ("/v1/completions", {**GREEDY, "model": "\udc00"}, "model"),
             ("/v1/completions", {**GREEDY, "stop": ["x", "\ud83d"]}, "stop"),
             ("/v1/chat/completions", {"model": MODEL, "max_tokens": 2,
                                       "messages": [{"role": "user", "content": "hi \udfff"}]}, "messages"),
             ("/tokenize", {"prompt": "\ud800"}, "prompt"),
             ("/tokenize", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages")]
    with _live_watch(stack):
        for path, body, param in cases:
            msg = _refused(_post(stack, body, path), param)
            assert "surrogate" in msg, msg
        # a well-formed pair is a character, not an error
        r = _post(stack, {**GREEDY, "prompt": "smile \U0001F600"})
        assert r.status_code == 200, r.text
        _after(stack, baseline)


def test_regex_too_large_for_the_grammar_engine(stack, baseline):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 4, "structured_outputs": {"regex": "a{100000000}"}}
    with _live_watch(stack):
        for stream in (False, True):
            r = _post(stack, {**body, "stream": stream})
            if stream:
                assert r.status_code == 200
                err = next(json.loads(ln[6:]) for ln in r.text.splitlines()
                           if ln.startswith("data: {") and '"error"' in ln)["error"]
            else:
                assert r.status_code == 400, r.text[:300]
                err = r.json()["error"]
            assert err["param"] == "response_format", err
            msg = err["message"]
            assert "too large" in msg and "<state>" not in msg and "Parser" not in msg and "lexer_cost" not in msg
            assert len(msg) < 500, msg
        _after(stack, baseline)


# ---- watchdog ---------------------------------------------------------------------------------------------
_SERVER = textwrap.dedent('''
    import ctypes, sys, threading
    sys.path.insert(0, sys.argv[2])
    from tests.test_hostile_engine import _runner
    from gpu_service.api.tokenizer import Tokenizer
    from gpu_service.entrypoints.serving import ServingStack, serve_until_signal

    st = ServingStack(_runner(sys.argv[1]), Tokenizer(sys.argv[1]), "m", port=0, grpc_port=0).start()
    print(st.port, flush=True)

    def kill():  # on "kill": SystemExit raised inside the engine's scheduler thread
        sys.stdin.readline()
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(st.engine._thread.ident),
                                                   ctypes.py_object(SystemExit))
        print("killed", flush=True)

    threading.Thread(target=kill, daemon=True).start()
    sys.exit(serve_until_signal(st, "hostile-test"))
''')


def test_watchdog_exits_when_the_engine_thread_is_gone(model_dir, tmp_path):
    script = tmp_path / "server.py"
    script.write_text(_SERVER)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": repo + os.pathsep + os.environ.get("PYTHONPATH", "")}
    p = subprocess.Popen([sys.executable, str(script), model_dir, repo], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        port = int(p.stdout.readline())
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/live", timeout=5).status_code == 200
        assert httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2},
                          timeout=60).status_code == 200
        p.stdin.write("kill\n")
        p.stdin.flush()
        assert p.stdout.readline().strip() == "killed"
        try:  # wakes the scheduler, which then dies: answered (an error), never left hanging
            r = httpx.post(url + "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2}, timeout=10)
            assert r.status_code >= 500, r.text
        except httpx.TransportError:
            pass  # the process exited first
        rc = p.wait(timeout=20)
        err = p.stderr.read()
        assert rc == 1, err[-2000:]
        assert "scheduler thread is gone" in err and "SystemExit" in err, err[-2000:]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
