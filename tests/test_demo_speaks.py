"""`make demo`'s model speaks: the briefly trained tiny model's greedy reply to the demo's chat turn,
rendered through the checkpoint's DeepSeek-V3 chat format, is words of its training text (not bytes
of noise). The checkpoint is the demo's own (build/, trained on first use by the recipe in
gpu_service.entrypoints.demo, ~40 s on a loaded 2-vCPU box; reused when its recipe stamp matches)."""
import re

import torch

from gpu_service.api.tokenizer import load_tokenizer
from gpu_service.entrypoints import demo
from tests.hf_reference import load_reference


def test_demo_reply_is_words():
    model, _ = demo.ensure_model()
    tok = load_tokenizer(model)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": demo.QUESTION}]), add_bos=False)
    hf = load_reference(model)
    with torch.no_grad():
        g = hf.generate(torch.tensor([ids]), max_new_tokens=demo.MAX_NEW_TOKENS, do_sample=False)
    reply = tok.decode(g[0, len(ids):].tolist())
    letters = sum(c.isascii() and (c.isalpha() or c == " ") for c in reply)
    assert letters >= 0.8 * len(reply), f"mostly not letters and spaces: {reply!r}"
    words = re.findall(r"[A-Za-z]+", reply)
    known = set(re.findall(r"[A-Za-z]+", " ".join(m["content"] for t in demo.chat_turns() for m in t)))
    assert len(words) >= 6, f"too few words: {reply!r}"
    assert sum(w in known for w in words) >= 0.9 * len(words), f"words not from the training text: {reply!r}"
    print(f"reply: {reply!r}")


def test_chat_turns_cover_the_demo_question():
    """The demo asks one of the questions it was trained on, in the same words."""
    questions = [t[0]["content"] for t in demo.chat_turns()]
    assert demo.QUESTION in questions
    assert all(len(t[1]["content"]) <= demo.REPLY_CHARS + 1 for t in demo.chat_turns())
