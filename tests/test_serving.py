"""Serving: continuous-batching engine, OpenAI HTTP API, gRPC Generate API, `moesplit serve`.

One stack per module: a tiny fp32 checkpoint, 2 CPU shard processes, engine + HTTP + gRPC on
127.0.0.1 with free ports. Engine-level checks (numerics, preemption, seeds, stop strings) use an
in-process expert backend instead, which is faster and lets them own their runner.
"""
import asyncio
import io
import os
import re
import signal
import subprocess
import sys
import time
import types

import httpx
import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
API_KEY = "sk-test-key"
MODEL = "tiny-serve"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("ckpt") / MODEL), "bf16", seed=0)


@pytest.fixture(scope="module")
def stack(model_dir):
    from gpu_service.local.stack import start_shards
    from gpu_service.entrypoints.serving import ServingStack, build_runner
    from local_stack import shard_health_fn

    shards = start_shards(model_dir, 2, split="experts", backend="auto")
    try:
        runner, client, tok = build_runner(model_dir, shards.addresses, "cpu", "float32", kv_tokens=4096,
                                           page_size=16)
        st = ServingStack(runner, tok, MODEL, port=0, grpc_port=0, api_key=API_KEY, max_batch=8,
                          chunk_tokens=48, health_fn=shard_health_fn(shards.addresses),
                          closers=[shards.stop, client.close])
    except BaseException:
        shards.stop()
        raise
    st.shard_addresses = shards.addresses
    st.start()
    yield st
    st.stop()


@pytest.fixture(scope="module")
def oai(stack):
    import openai

    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)


def _idle(engine, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = engine.stats()
        if s["running"] == 0 and s["waiting"] == 0 and engine.pool.pages_in_use == engine.pool.cached_pages:
            return s
        time.sleep(0.02)
    raise AssertionError(f"engine not idle: {engine.stats()}")


# ---- OpenAI API through the official client ------------------------------------------------------
def test_models_and_health(stack, oai):
    assert [m.id for m in oai.models.list().data] == [MODEL]
    r = httpx.get(stack.http_url + "/health")
    assert r.status_code == 200, r.text
    assert r.json()["status"] == "ok"
    assert set(r.json()["shards"].values()) == {"SERVING"}


def test_health_503_when_a_shard_is_down(stack):
    import socket

    from fastapi.testclient import TestClient

    from gpu_service.api.http_api import create_app
    from local_stack import shard_health_fn

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"127.0.0.1:{s.getsockname()[1]}"
    app = create_app(stack.engine, stack.tokenizer, MODEL, health_fn=shard_health_fn([stack.shard_addresses[0], dead]))
    r = TestClient(app).get("/health")
    assert r.status_code == 503 and r.json()["shards"][stack.shard_addresses[0]] == "SERVING"
    assert r.json()["shards"][dead].startswith("UNAVAILABLE")
    r = TestClient(app).get("/live")  # liveness is the engine loop only: a shard outage does not fail it
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_chat_completion(stack, oai):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello there"}],
                                    max_tokens=8, temperature=0)
    c = r.choices[0]
    assert r.object == "chat.completion" and r.model == MODEL
    assert c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    prompt_len = len(stack.tokenizer.encode_chat([{"role": "user", "content": "Hello there"}]))
    assert r.usage.prompt_tokens == prompt_len
    assert 1 <= r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == prompt_len + r.usage.completion_tokens

    # the same request streamed: same text, usage in the last chunk, then [DONE]
    chunks = list(oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], max_tokens=8, temperature=0,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == c.message.content
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == c.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == r.usage.completion_tokens


def test_completion_and_stream(stack, oai):
    r = oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                               extra_body={"ignore_eos": True})
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 12
    chunks = list(oai.completions.create(model=MODEL, prompt="The quick brown fox", max_tokens=12, temperature=0,
                                         stream=True, stream_options={"include_usage": True},
                                         extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == r.choices[0].text
    assert chunks[-1].usage.total_tokens == r.usage.total_tokens
    # raw SSE framing ends with [DONE]
    with httpx.stream("POST", stack.http_url + "/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"model": MODEL, "prompt": "abc", "max_tokens": 3, "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln]
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_concurrent_greedy_equals_alone(stack, oai):
    import openai

    tok = stack.tokenizer
    prompts = [tok.encode("word " * (3 + 9 * i)) for i in range(8)]  # 4..67 tokens: several prefill chunks
    max_tokens = [5 + 4 * i for i in range(8)]

    def body(i):
        return dict(model=MODEL, prompt=prompts[i], max_tokens=max_tokens[i], temperature=0,
                    extra_body={"ignore_eos": True, "return_token_ids": True})

    alone = [oai.completions.create(**body(i)).choices[0] for i in range(8)]

    async def together():
        aoai = openai.AsyncOpenAI(base_url=stack.http_url + "/v1", api_key=API_KEY, max_retries=0, timeout=60)
        rs = await asyncio.gather(*(aoai.completions.create(**body(i)) for i in range(8)))
        await aoai.close()
        return [r.choices[0] for r in rs]

    batched = asyncio.run(together())
    for i, (a, b) in enumerate(zip(alone, batched)):
        assert len(a.token_ids) == max_tokens[i]
        assert a.token_ids == b.token_ids, f"request {i}: batched tokens differ from alone"
        assert a.text == b.text
    assert stack.engine.counters["peak_running"] >= 4  # they really ran batched
    _idle(stack.engine)


def test_bad_requests(stack):
    url, auth = stack.http_url, {"Authorization": f"Bearer {API_KEY}"}
    ctx = stack.engine.max_request_tokens
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        (chat, {"model": MODEL}, 400, "messages"),
        (chat, {"model": MODEL, "messages": []}, 400, "messages"),
        (chat, {"model": MODEL, "messages": msgs, "max_tokens": -1}, 400, "max_tokens"),
        (chat, {"model": MODEL, "messages": msgs, "max_tokens": 10**9}, 400, "max_tokens"),
        (chat, {"model": MODEL, "messages": msgs, "max_tokens": "ten"}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": [5] * (ctx + 10), "max_tokens": 1}, 400, None),
        (chat, {"model": "gpt-4", "messages": msgs}, 404, "model"),
        (chat, {"model": MODEL, "messages": msgs, "temperature": -1}, 400, "temperature"),
    ]
    for path, body, status, param in cases:
        r = httpx.post(url + path, json=body, headers=auth)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"], r.text
        if param:
            assert err["param"] == param, (body, err)
    r = httpx.post(url + chat, json={"model": MODEL, "messages": msgs}, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(url + "/v1/models").status_code == 401
    r = httpx.post(url + chat, content=b'{"model": "x", "messages": [', headers={**auth, "content-type": "application/json"})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(url + "/v1/nope", json={}, headers=auth)
    assert r.status_code == 404 and "error" in r.json()
    # the server stays up and serves the next request
    r = httpx.post(url + chat, json={"model": MODEL, "messages": msgs, "max_tokens": 2}, headers=auth)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    _idle(stack.engine)


def test_disconnect_frees_kv_pages(stack):
    eng = stack.engine
    cancelled0 = eng.counters["cancelled"]
    body = {"model": MODEL, "prompt": "tell me a long story", "max_tokens": 800, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", stack.http_url + "/v1/completions", json=body,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as resp:
            assert resp.status_code == 200
            it = resp.iter_lines()
            got = [next(it) for _ in range(6)]
            assert any(ln.startswith("data: {") for ln in got)
            assert eng.pool.pages_in_use > 0  # the request holds its pages while streaming
        # leaving the block closes the connection mid-stream
    s = _idle(eng)
    assert s["cancelled"] == cancelled0 + 1
    assert s["pool_pages_in_use"] == s["pool_pages_cached"]  # only prefix-cached pages remain


# ---- gRPC ------------------------------------------------------------------------------------------
def test_grpc_matches_http(stack, oai):
    import grpc

    from gpu_service.api.grpc_client import GenerateClient

    ids = stack.tokenizer.encode("Once upon a time")
    with GenerateClient(stack.grpc_address, api_key=API_KEY) as gc:
        resps = list(gc.generate(prompt_ids=ids, max_tokens=10, temperature=0, ignore_eos=True))
        merged = next(gc.generate(prompt_ids=ids, max_tokens=10, temperature=0, ignore_eos=True, stream=False))
        chat_g = next(gc.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, stream=False))
        with pytest.raises(grpc.RpcError) as ei:
            next(gc.generate(prompt_ids=ids, max_tokens=10**6))
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert len(resps) > 1  # streamed, not one blob
    g_ids = [t for r in resps for t in r.token_ids]
    g_text = "".join(r.text for r in resps)
    assert resps[-1].finish_reason == "length" and resps[-1].usage.completion_tokens == 10
    assert all(not r.finish_reason for r in resps[:-1])
    assert list(merged.token_ids) == g_ids and merged.text == g_text
    h = oai.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0,
                               extra_body={"ignore_eos": True, "return_token_ids": True}).choices[0]
    assert h.token_ids == g_ids and h.text == g_text
    hc = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                     temperature=0)
    assert hc.choices[0].message.content == chat_g.text
    assert hc.usage.completion_tokens == chat_g.usage.completion_tokens
    _idle(stack.engine)


def test_chat_cli_keeps_conversation(stack):
    from gpu_service.entrypoints.chat import chat_loop
    from gpu_service.api.grpc_client import GenerateClient

    seen = []

    class Spy(GenerateClient):
        def generate(self, **kw):
            seen.append([dict(m) for m in kw["messages"]])
            return super().generate(**kw)

    args = types.SimpleNamespace(system="be brief", max_tokens=4, temperature=0.0, top_p=None, top_k=0, seed=None)
    out = io.StringIO()
    with Spy(stack.grpc_address, api_key=API_KEY) as c:
        assert chat_loop(c, args, stdin=io.StringIO("hello\nand again\n/exit\n"), stdout=out) == 0
    assert [len(s) for s in seen] == [2, 4]  # system + user; then + assistant + user
    assert seen[1][2]["role"] == "assistant" and seen[1][3] == {"role": "user", "content": "and again"}
    assert out.getvalue().count("\n") >= 2


# ---- engine-level (in-process experts) ----------------------------------------------------------
@pytest.fixture(scope="module")
def local_runner_factory(model_dir):
    from checkpoint.reader import CheckpointReader
    from cpu_expert_service.server import load_shard
    from gpu_service.experts.handoff import LocalExperts
    from gpu_service.runtime.runner import ModelRunner

    _, backend, _ = load_shard(model_dir, None, None, "auto")

    def make(kv_tokens=2048, page_size=16):
        return ModelRunner(CheckpointReader(model_dir), LocalExperts(backend), device=torch.device("cpu"),
                           dtype=torch.float32, kv_tokens=kv_tokens, page_size=page_size)

    return make


def test_batched_step_numerics(local_runner_factory):
    """A chunk's logits do not depend on what else is in the batch (beyond float reassociation)."""
    from gpu_service.model.kv import Chunk

    r = local_runner_factory()
    a_ids, b_ids = list(range(10, 40)), list(range(100, 117))
    a = r.new_seq()
    alone = r.step(a_ids, [Chunk(a, 0, len(a_ids))])
    alone_dec = r.step([7], [Chunk(a, a.length, 1)])
    a.free()
    a, b, c = r.new_seq(), r.new_seq(), r.new_seq()
    r.step(b_ids, [Chunk(b, 0, len(b_ids))])
    # a's prefill split in two chunks, batched with b's decode and c's prefill
    r.step(a_ids[:13] + [5] + list(range(3, 9)), [Chunk(a, 0, 13), Chunk(b, b.length, 1), Chunk(c, 0, 6)])
    both = r.step(a_ids[13:] + [6], [Chunk(a, 13, len(a_ids) - 13), Chunk(b, b.length, 1)])
    torch.testing.assert_close(both[0], alone[0], atol=1e-4, rtol=1e-4)
    dec = r.step([8, 7, 9], [Chunk(b, b.length, 1), Chunk(a, a.length, 1), Chunk(c, c.length, 1)])
    torch.testing.assert_close(dec[1], alone_dec[0], atol=1e-4, rtol=1e-4)
    for s in (a, b, c):
        s.free()
    assert r.pool.pages_in_use == 0


def test_engine_preemption_seeds_and_stop(local_runner_factory, model_dir):
    from gpu_service.runtime.engine import Engine, RequestError
    from gpu_service.runtime.sampling import SamplingParams
    from gpu_service.api.tokenizer import Tokenizer

    tok = Tokenizer(model_dir)
    prompts = [tok.encode("alpha beta " * (1 + i)) for i in range(4)]
    assert max(map(len, prompts)) + 40 <= 96
    big = Engine(local_runner_factory(), tok, max_batch=8, chunk_tokens=32).start()
    small = Engine(local_runner_factory(kv_tokens=96, page_size=16), tok, max_batch=8, chunk_tokens=32).start()
    try:
        greedy = [big.submit(p, max_tokens=40, ignore_eos=True).result()[0] for p in prompts]
        # pool of 6 pages: 4 requests that each need up to 4 pages -> queueing + preemption
        hs = [small.submit(p, max_tokens=40, ignore_eos=True) for p in prompts]
        assert [h.result(60)[0] for h in hs] == greedy
        assert small.counters["preempted"] > 0 and small.pool.pages_in_use == small.pool.cached_pages
        with pytest.raises(RequestError, match="KV pool"):
            small.submit(prompts[0], max_tokens=96)

        # seeded sampling: same tokens alone or batched with others
        sp = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234)
        alone = big.submit(prompts[1], sp, max_tokens=20, ignore_eos=True).result()[0]
        others = [big.submit(p, SamplingParams(temperature=1.0), max_tokens=20) for p in prompts]
        again = big.submit(prompts[1], sp, max_tokens=20, ignore_eos=True)
        assert again.result()[0] == alone
        for h in others:
            h.result()

        # stop strings: cut before the stop string, finish "stop"
        ids, text, fin = big.submit(prompts[2], max_tokens=30, ignore_eos=True).result()
        assert fin == "length"
        stop = text[6:9]
        cut = text.find(stop)
        ids2, text2, fin2 = big.submit(prompts[2], max_tokens=30, ignore_eos=True, stop=[stop, "\x00never"]).result()
        assert fin2 == "stop" and text2 == text[:cut] and ids2 == ids[:len(ids2)]

        # cancel a queued and a running request: pages come back
        h1 = big.submit(prompts[3], max_tokens=500, ignore_eos=True)
        next(iter(h1))
        h1.cancel()
        assert h1.result(10)[2] == "cancelled"
        _idle(big)
    finally:
        big.stop()
        small.stop()


# ---- `moesplit serve` end to end --------------------------------------------------------------
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _launch(args: list[str]) -> tuple[subprocess.Popen, str, str]:
    """Start `moesplit ARGS` on free ports; wait for its 'serving' line -> (proc, http url, grpc address)."""
    cmd = [sys.executable, "-m", "moesplit", *args, "--port", "0", "--grpc-port", "0", "--kv-tokens", "512",
           "--dtype", "float32", "--device", "cpu", "--log-level", "WARNING"]
    p = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    lines = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        line = p.stderr.readline()
        if not line and p.poll() is not None:
            break
        lines.append(line)
        m = re.search(r"OpenAI API (http://\S+)/v1, gRPC (\S+)", line)
        if m:
            return p, m.group(1), m.group(2)
    p.kill()
    p.wait()
    raise AssertionError("server did not start:\n" + "".join(lines))


def test_serve_cli_starts_and_stops_cleanly(model_dir):
    p, url, _ = _launch(["serve", "--model", model_dir, "--shards", "2", "--served-model-name", "cli-model"])
    try:
        shard_pids = _children(p.pid)
        assert len(shard_pids) == 2
        assert httpx.get(url + "/health").status_code == 200
        r = httpx.post(url + "/v1/completions", json={"model": "cli-model", "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200, r.text
        p.send_signal(signal.SIGTERM)
        assert p.wait(30) == 0
        for pid in shard_pids:  # the shard processes are gone (reaped by serve)
            assert not os.path.exists(f"/proc/{pid}")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_gpu_server_cli_over_running_shards(stack, model_dir):
    from gpu_service.api.grpc_client import GenerateClient

    p, url, grpc_addr = _launch(["gpu-server", "--model", model_dir,
                                 "--shards-addresses", ",".join(stack.shard_addresses)])
    try:
        assert httpx.get(url + "/health").json()["status"] == "ok"
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL  # the directory's basename
        with GenerateClient(grpc_addr) as gc:
            r = next(gc.generate(prompt="hi", max_tokens=3, stream=False))
        assert r.usage.completion_tokens >= 1
        p.send_signal(signal.SIGINT)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
