"""Kimi-K2.5 images through the engine: greedy tokens equal transformers' Kimi_K25ForConditionalGeneration
(fp32) on the tiny checkpoint for one image and for two images of different sizes, 32 new tokens, 2 shard
processes on the default backend, chunked prefill whose chunks start and end inside images; the image
embedding cache and the prefix cache hit for the same image again; two different images with the same
text share no image pages."""
import io
import time

import numpy as np
import pytest
import torch

from gpu_service.model.image_inputs import load_image

N_NEW = 32


def png(h: int, w: int, seed: int) -> bytes:
    """A smooth random PNG (a few gradients: not noise, so the image matters less than the text)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w]
    a = np.stack([(np.sin(x / rng.uniform(3, 20) + rng.uniform(0, 6)) * 120 + 128 +
                   y * rng.uniform(-1, 1)) for _ in range(3)], -1)
    buf = io.BytesIO()
    Image.fromarray(np.clip(a, 0, 255).astype(np.uint8)).save(buf, "PNG")
    return buf.getvalue()


IMG_A, IMG_B, IMG_C = png(60, 90, 1), png(200, 130, 2), png(60, 90, 3)  # A and C: same size, different pixels


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from gpu_service.local.tiny import make_tiny

    return make_tiny(str(tmp_path_factory.mktemp("k25i") / "k25"), arch="kimi_k25", seed=4)


def prompt(cfg, images) -> list[int]:
    """Text ids around `<|media_begin|> <pad>*n <|media_end|>` per image (ids of the tiny tokenizer)."""
    pad = cfg.multimodal["media_placeholder_token_id"]
    ids = [5 + i * 7 % 300 for i in range(11)]
    for k, img in enumerate(images):
        ids += [pad - 3] + [pad] * img.tokens + [pad - 1] + [70 + k, 9 + k, 150 + k]
    return ids


@pytest.fixture(scope="module")
def hf(tiny):
    from tests.hf_reference import load_reference_kimi_k25

    m = load_reference_kimi_k25(tiny)
    m.generation_config.eos_token_id = None
    return m


def reference(hf, ids, images) -> list[int]:
    """transformers' greedy continuation (fp32) of `ids` with the images' pixel values."""
    pv = torch.cat([img.patches for img in images])
    grid = torch.tensor([[1, img.grid_h, img.grid_w] for img in images])
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), pixel_values=pv, image_grid_thw=grid, max_new_tokens=N_NEW,
                          do_sample=False)
    ref = out[0, len(ids):].tolist()
    # transformers embeds a *generated* placeholder id as token 0 (its multimodal mask covers every
    # position), the engine as itself: a continuation holding it cannot be compared (the prompts avoid it)
    assert hf.config.image_token_id not in ref
    return ref


@pytest.fixture(scope="module")
def stack(tiny):
    """2 shard processes on the default backend, a float32 CPU runner, prefill chunks of 7 tokens,
    KV pages of 16, the HTTP API on a free port (images as data: URLs only)."""
    from gpu_service.entrypoints.serving import build_runner, ServingStack
    from gpu_service.local.stack import start_shards

    shards = start_shards(tiny, 2, split="experts", backend="auto")
    try:
        runner, client, tok = build_runner(tiny, shards.addresses, "cpu", "float32", kv_tokens=2048, page_size=16)
        st = ServingStack(runner, tok, "k25", port=0, grpc_port=0, max_batch=4, chunk_tokens=7,
                          closers=[shards.stop, client.close])
    except BaseException:
        shards.stop()
        raise
    st.engine.check_pool = True  # the KV pool's invariants after every step
    st.start()
    try:
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def engine(stack):
    return stack.engine


def run(engine, ids, images):
    """Greedy tokens and the handle (cached_tokens) of one request."""
    from gpu_service.runtime.sampling import SamplingParams

    h = engine.submit(ids, SamplingParams(temperature=0.0), max_tokens=N_NEW, ignore_eos=True, images=images)
    toks, _, finish = h.result(timeout=600)
    assert finish == "length", h.error
    return toks, h


def test_one_image_equals_transformers_and_hits_the_caches(stack, hf):
    engine = stack.engine
    a = load_image(IMG_A)
    ids = prompt(engine.cfg, [a])
    ref = reference(hf, ids, [a])
    got, h1 = run(engine, ids, [load_image(IMG_A)])
    assert len(ref) == N_NEW and got == ref
    s0 = engine.stats()
    again, h2 = run(engine, ids, [load_image(IMG_A)])  # a new ImageInput of the same bytes
    s1 = engine.stats()
    assert again == ref
    assert s1["image_hits"] == s0["image_hits"] + 1 and s1["image_misses"] == s0["image_misses"]
    assert h2.cached_tokens >= 16 * ((len(ids) - 1) // 16) > h1.cached_tokens  # every full page of the prompt
    import httpx

    prom = httpx.get(f"http://127.0.0.1:{stack.port}/metrics").text
    assert f'moesplit_image_embedding_cache_total{{result="hit"}} {float(s1["image_hits"])}' in prom
    assert f"moesplit_prefix_cache_hits_total{{tier=\"gpu\"}} {float(s1['prefix_hits_gpu'])}" in prom
    assert s1["prefix_hits_gpu"] >= s0["prefix_hits_gpu"] + h2.cached_tokens
    print(f"one image ({a.tokens} tokens, prompt {len(ids)}): {got[:8]}...; second request cached "
          f"{h2.cached_tokens} tokens, image cache {s1['image_hits']} hits / {s1['image_misses']} misses")


def test_two_images_of_different_sizes_equal_transformers(engine, hf):
    a, b = load_image(IMG_A), load_image(IMG_B)
    assert (a.grid_h, a.grid_w) != (b.grid_h, b.grid_w)
    ids = prompt(engine.cfg, [a, b])
    ref = reference(hf, ids, [a, b])
    got, _ = run(engine, ids, [a, b])
    assert got == ref


def test_different_images_same_text_share_no_image_pages(engine, hf):
    a, c = load_image(IMG_A), load_image(IMG_C)
    assert a.tokens == c.tokens and a.digest != c.digest
    ids = prompt(engine.cfg, [c])
    assert ids == prompt(engine.cfg, [a])  # the same token ids: only the image differs
    run(engine, ids, [a])  # A's pages are cached
    got, h = run(engine, ids, [c])
    assert got == reference(hf, ids, [c])
    first_image_row = ids.index(engine.cfg.multimodal["media_placeholder_token_id"])
    assert h.cached_tokens <= first_image_row  # only pages before the image are shared


def test_placeholder_count_mismatch_is_refused(engine):
    from gpu_service.runtime.requests import RequestError

    a = load_image(IMG_A)
    ids = prompt(engine.cfg, [a])
    with pytest.raises(RequestError, match="placeholder"):
        engine.submit(ids[:-6] + ids[-4:], max_tokens=2, images=[a])  # two placeholders short
    with pytest.raises(RequestError, match="placeholder"):
        engine.submit(ids, max_tokens=2, images=[a, a])


# ---- the OpenAI API ------------------------------------------------------------------------------
def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64

    return f"data:{mime};base64," + base64.b64encode(data).decode()


def image_part(url: str, **extra) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def test_openai_client_sends_an_image_and_gets_transformers_tokens(stack, hf):
    """The chat path: the template's marker expanded to the image's tokens, then the engine: the
    completion's ids are transformers' greedy continuation of the same ids and pixels."""
    import openai

    from gpu_service.api.chat_request import ChatSettings, chat_plan
    from gpu_service.api.guard import ServerLimits

    msgs = [{"role": "user", "content": [{"type": "text", "text": "Describe it."},
                                         image_part(data_url(IMG_B))]}]
    plan = chat_plan({"messages": msgs}, stack.tokenizer, ChatSettings(), images=ServerLimits().image_policy())
    (img,) = plan.images
    pad = stack.engine.cfg.multimodal["media_placeholder_token_id"]
    assert plan.ids.count(pad) == img.tokens == load_image(IMG_B).tokens
    c = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.port}/v1", api_key="x")
    r = c.chat.completions.create(model="k25", messages=msgs, max_tokens=N_NEW, temperature=0,
                                  extra_body={"return_token_ids": True, "ignore_eos": True})
    got = r.choices[0].model_extra["token_ids"]
    assert r.usage.prompt_tokens == len(plan.ids) and r.usage.completion_tokens == N_NEW
    assert got == reference(hf, plan.ids, [img])


def _post(stack, body, timeout=30):
    import httpx

    return httpx.post(f"http://127.0.0.1:{stack.port}/v1/chat/completions", json=body, timeout=timeout)


def _msgs(*parts):
    return {"messages": [{"role": "user", "content": [{"type": "text", "text": "look"}, *parts]}], "max_tokens": 2}


@pytest.mark.parametrize("part,status,needle", [
    (image_part("http://example.com/cat.png"), 400, "--allow-image-urls"),
    (image_part(data_url(b"\x89PNG\r\n\x1a\n garbage")), 400, "not a readable image"),
    (image_part(data_url(b"AAAA", "text/plain")), 400, "data:image/"),
    (image_part("data:image/png;base64,@@@@"), 400, "not valid base64"),
    (image_part(data_url(IMG_A), detail="high"), 400, "detail"),
    (image_part(data_url(IMG_A), mystery=1), 400, "unknown field"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, 400, "video"),
])
def test_refused_image_parts_name_the_problem(stack, part, status, needle):
    r = _post(stack, _msgs(part))
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["param"].startswith("messages[0].content[1]")


def test_too_many_images_and_bytes_and_pixels(stack):
    from PIL import Image

    r = _post(stack, _msgs(*[image_part(data_url(IMG_A))] * 9))
    assert r.status_code == 400 and "--max-images" in r.json()["error"]["message"]
    buf = io.BytesIO()
    Image.new("L", (9000, 9000)).save(buf, "PNG")  # 81 Mpixel in a small file
    r = _post(stack, _msgs(image_part(data_url(buf.getvalue()))))
    assert r.status_code == 413 and "--max-image-pixels" in r.json()["error"]["message"]
    r = _post(stack, _msgs(image_part(data_url(b"\0" * (11 << 20)))))  # under the body cap if it were raised...
    assert r.status_code == 413  # ...here the 8 MiB body cap answers first, naming --max-body-bytes
    assert "--max-body-bytes" in r.json()["error"]["message"]


def test_a_20mb_image_is_refused_fast_with_health_responsive(stack):
    import threading

    import httpx

    import json

    body = json.dumps(_msgs(image_part(data_url(np.random.default_rng(0).bytes(20 << 20))))).encode()
    health = []

    def probe():
        for _ in range(20):
            t = time.perf_counter()
            h = httpx.get(f"http://127.0.0.1:{stack.port}/health", timeout=5)
            health.append((h.status_code, time.perf_counter() - t))
            time.sleep(0.01)

    th = threading.Thread(target=probe)
    th.start()
    t0 = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{stack.port}/v1/chat/completions", content=body,
                   headers={"Content-Type": "application/json"}, timeout=30)
    took = time.perf_counter() - t0
    th.join()
    print(f"20 MB image: {r.status_code} in {took * 1000:.0f} ms; /health worst {max(s for _, s in health) * 1000:.0f} ms")
    assert r.status_code == 413 and took < 0.5
    assert all(code == 200 for code, _ in health) and max(s for _, s in health) < 0.5


def test_image_urls_fetched_with_the_flag_within_limits(tmp_path):
    """--allow-image-urls: fetched from a local HTTP server; over the byte limit a 413; a server that
    never answers: refused after the fetch timeout."""
    import http.server
    import socket
    import threading

    from gpu_service.api.errors import APIError
    from gpu_service.api.image_parts import ImagePolicy, image_of_part
    from gpu_service.model.image_inputs import ImageLimits

    (tmp_path / "a.png").write_bytes(IMG_A)
    (tmp_path / "big.png").write_bytes(IMG_B)
    handler = lambda *a, **k: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path), **k)  # noqa: E731
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(1)  # accepts, never answers
    try:
        base = f"http://127.0.0.1:{srv.server_address[1]}"
        pol = ImagePolicy(ImageLimits(max_bytes=len(IMG_A) + 10), allow_urls=True, fetch_timeout_s=0.5)
        img = image_of_part(image_part(base + "/a.png"), "m", pol)
        assert img.digest == load_image(IMG_A).digest and img.tokens == load_image(IMG_A).tokens
        with pytest.raises(APIError) as e:
            image_of_part(image_part(base + "/big.png"), "m", pol)
        assert e.value.status == 413 and "--max-image-bytes" in e.value.message
        t0 = time.perf_counter()
        with pytest.raises(APIError) as e:
            image_of_part(image_part(f"http://127.0.0.1:{silent.getsockname()[1]}/x.png"), "m", pol)
        assert e.value.status == 400 and time.perf_counter() - t0 < 3
        with pytest.raises(APIError, match="--allow-image-urls"):
            image_of_part(image_part(base + "/a.png"), "m", ImagePolicy())
    finally:
        srv.shutdown()
        silent.close()


def test_grpc_generate_carries_images(stack, hf):
    """gRPC Generate: a message's parts (text + image bytes with their mime type) give the tokens of
    the same conversation over HTTP (transformers' greedy continuation)."""
    import grpc

    from gpu_service.api.chat_request import ChatSettings, chat_plan
    from gpu_service.api.guard import ServerLimits
    from protos.moesplit.v1 import generate_pb2 as G, generate_pb2_grpc as GG

    text = "What is in this picture?"
    plan = chat_plan({"messages": [{"role": "user", "content": [{"type": "text", "text": text},
                                                                image_part(data_url(IMG_A))]}]},
                     stack.tokenizer, ChatSettings(), images=ServerLimits().image_policy())
    stub = GG.GenerateServiceStub(grpc.insecure_channel(f"127.0.0.1:{stack.grpc_port}"))
    msg = G.ChatMessage(role="user", parts=[G.ContentPart(text=text),
                                            G.ContentPart(image=G.Image(data=IMG_A, mime_type="image/png"))])
    req = G.GenerateRequest(messages=[msg], max_tokens=N_NEW, temperature=0.0, ignore_eos=True)
    got, usage = [], None
    for r in stub.Generate(req, timeout=600):
        got += list(r.token_ids)
        usage = r.usage if r.finish_reason else usage
    assert usage.prompt_tokens == len(plan.ids) and got == reference(hf, plan.ids, plan.images)
    bad = G.GenerateRequest(messages=[G.ChatMessage(role="user", content="x", parts=msg.parts)], max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(bad, timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not both" in e.value.details()
    corrupt = G.ChatMessage(role="user", parts=[G.ContentPart(image=G.Image(data=b"nope", mime_type="image/png"))])
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Generate(G.GenerateRequest(messages=[corrupt], max_tokens=2), timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "not a readable image" in e.value.details()


def test_requests_with_images_batched_together(engine, hf):
    """Three requests in flight at once (one image, two images, text only): their prefill chunks share
    steps, so image rows sit at offsets past other requests' rows; each gets its own greedy tokens."""
    from gpu_service.runtime.sampling import SamplingParams

    a, b = load_image(IMG_A), load_image(IMG_B)
    cases = [([a], prompt(engine.cfg, [a])[:-1] + [77]), ([b, a], prompt(engine.cfg, [b, a])), ([], [5, 6, 7, 8, 9])]
    hs = [engine.submit(ids, SamplingParams(temperature=0.0), max_tokens=N_NEW, ignore_eos=True, images=imgs or None)
          for imgs, ids in cases]
    for (imgs, ids), h in zip(cases, hs):
        toks, _, _ = h.result(timeout=600)
        if imgs:
            assert toks == reference(hf, ids, imgs)
        else:
            with torch.no_grad():
                ref = hf.generate(torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False)[0, len(ids):].tolist()
            assert toks == ref
    assert engine.counters["peak_running"] >= 2


def test_vision_param_count_matches_the_module():
    """The plan's count (checkpoint.kimi_k25, from the weight table) == the tower's parameters."""
    import json
    import os

    from checkpoint import kimi_k25
    from gpu_service.model.vision import param_count

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, "gpu_service", "plan", "presets", "kimi-k2.5.json")) as f:
        d = json.load(f)
    vc, h = d["vision_config"], d["text_config"]["hidden_size"]
    assert param_count(vc, h) == kimi_k25.vision_param_count(vc, h) == 471_143_920


def test_n_choices_fork_a_prompt_with_an_image(engine, hf):
    """OpenAI's n: the choices share the first one's prompt KV (image rows included) and each gives
    the greedy tokens."""
    from gpu_service.runtime.sampling import SamplingParams

    a = load_image(IMG_A)
    ids = prompt(engine.cfg, [a])[:-1] + [91]
    hs = engine.submit_n(ids, [SamplingParams(temperature=0.0)] * 2, max_tokens=N_NEW, ignore_eos=True, images=[a])
    ref = reference(hf, ids, [a])
    assert [h.result(timeout=600)[0] for h in hs] == [ref, ref]


def test_preempted_requests_with_images_recompute_them(tiny, hf):
    """A KV pool too small for three image requests at once: the newest are preempted (pages freed)
    and prefilled again later, image rows included, with the same greedy tokens."""
    from gpu_service.entrypoints.serving import build_runner
    from gpu_service.local.stack import start_shards
    from gpu_service.runtime.engine import Engine
    from gpu_service.runtime.sampling import SamplingParams

    shards = start_shards(tiny, 2, split="experts", backend="auto")
    try:
        runner, client, tok = build_runner(tiny, shards.addresses, "cpu", "float32", kv_tokens=128, page_size=16,
                                           prefix_cache=False)
        eng = Engine(runner, tok, max_batch=3, chunk_tokens=64, check_pool=True).start()
        try:
            imgs = [load_image(IMG_A), load_image(IMG_C), load_image(IMG_A)]
            cases = [([img], prompt(eng.cfg, [img])[:-1] + [100 + k]) for k, img in enumerate(imgs)]
            hs = [eng.submit(ids, SamplingParams(temperature=0.0), max_tokens=N_NEW, ignore_eos=True, images=im)
                  for im, ids in cases]
            for (im, ids), h in zip(cases, hs):
                assert h.result(timeout=600)[0] == reference(hf, ids, im)
            assert eng.counters["preempted"] >= 1
        finally:
            eng.stop()
            client.close()
    finally:
        shards.stop()


def test_a_20mb_data_url_is_refused_before_decoding():
    """With a body cap that lets it through, the image cap answers from the data URL's length."""
    from gpu_service.api.errors import APIError
    from gpu_service.api.image_parts import ImagePolicy, image_of_part

    url = data_url(np.random.default_rng(1).bytes(20 << 20))
    t0 = time.perf_counter()
    with pytest.raises(APIError) as e:
        image_of_part(image_part(url), "messages[0].content[0]", ImagePolicy())
    assert e.value.status == 413 and "--max-image-bytes" in e.value.message and time.perf_counter() - t0 < 0.05
