"""`make demo`: a tiny FP8 model that speaks. Trained once (~150 AdamW steps on chat turns about
Python's statements, cached under build/), then one chat turn rendered through the checkpoint's
DeepSeek-V3 chat format, `moesplit generate` on it with 2 shard processes over the real stack, and a
check of the tokens against the transformers reference on the dequantised weights."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
MODEL = os.path.join(ROOT, "build", "demo-tiny-chat-fp8")
QUESTION = 'What is the "for" statement?'
MAX_NEW_TOKENS = 32
# the chat turns it learns: one per statement topic of Python's language reference
TOPICS = ("assert", "break", "class", "continue", "del", "for", "function", "global", "if", "import",
          "nonlocal", "pass", "raise", "return", "try", "while", "with", "yield")
REPLY_CHARS = 160
RECIPE = {"fmt": "fp8", "seed": 0, "tokenizer": "deepseek-v3", "steps": 150, "lr": 6e-3, "threads": 1,
          "topics": list(TOPICS), "reply_chars": REPLY_CHARS, "routing": "dense-4x4"}
STAMP = "demo-recipe.json"


def chat_turns() -> list[list[dict]]:
    """(question, answer) chat turns: 'What is the "for" statement?' -> the first prose sentences of
    that topic in `pydoc_data.topics` (fixed for an interpreter), cut at a word near REPLY_CHARS."""
    import pydoc_data.topics

    turns = []
    for key in TOPICS:
        lines = pydoc_data.topics.topics[key].split("\n")
        title = lines[0].strip()
        prose = " ".join(" ".join(line.split()) for line in lines[2:]
                         if line.strip() and not line.startswith("   ") and re.search("[a-z]", line))
        answer = prose[:REPLY_CHARS].rsplit(" ", 1)[0] + "."
        turns.append([{"role": "user", "content": f"What is {title[0].lower() + title[1:]}?"},
                      {"role": "assistant", "content": answer}])
    return turns


def training_text(model_dir: str) -> str:
    """Every chat turn rendered through the checkpoint's own chat format (special tokens included)."""
    from gpu_service.api.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    return "".join(tok.apply_chat_template(t, add_generation_prompt=False) for t in chat_turns())


def ensure_model(model_dir: str = MODEL) -> tuple[str, float | None]:
    """The trained demo checkpoint: loaded when `model_dir` holds one made by this RECIPE, else trained
    (DENSE_ROUTING: 4 layers, 4 experts all used) and stamped; returns (dir, training seconds or None)."""
    from gpu_service.local.tiny_train import DENSE_ROUTING, train_tiny

    stamp = os.path.join(model_dir, STAMP)
    if os.path.exists(stamp):
        with open(stamp) as f:
            if json.load(f) == RECIPE:
                return model_dir, None
    print(f"training the demo model ({RECIPE['steps']} steps on {len(TOPICS)} chat turns; once, then cached) ...",
          flush=True)
    r = train_tiny(model_dir, fmt=RECIPE["fmt"], seed=RECIPE["seed"], overrides=DENSE_ROUTING,
                   tokenizer=RECIPE["tokenizer"], steps=RECIPE["steps"], lr=RECIPE["lr"],
                   threads=RECIPE["threads"], text=training_text, log_every=50)
    with open(stamp, "w") as f:
        json.dump(RECIPE, f, indent=1)
    return model_dir, r["seconds"]


def _strip_eos(ids: list[int], eos: set[int]) -> list[int]:
    return ids[:-1] if ids and ids[-1] in eos else ids


def main() -> int:
    t_start = time.perf_counter()
    model, trained_s = ensure_model()
    print(f"model  : {model} ({'trained in %.0f s' % trained_s if trained_s is not None else 'cached'})")
    from gpu_service.api.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    messages = [{"role": "user", "content": QUESTION}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True)
    ids = tok.encode(rendered, add_bos=False)
    print(f"chat   : {messages}")
    print(f"format : DeepSeek-V3 chat template -> {rendered!r} ({len(ids)} tokens)")
    cmd = [sys.executable, "-m", "moesplit", "generate", "--model", model, "--prompt-ids", ",".join(map(str, ids)),
           "--max-new-tokens", str(MAX_NEW_TOKENS), "--shards", "2", "--json"]
    print("$", " ".join(cmd[2:]))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return r.returncode
    out = json.loads(r.stdout.strip().splitlines()[-1])
    t = out["timings"]
    print(f"user   : {QUESTION}")
    print(f"reply  : {tok.decode(out['token_ids'])}")
    print(f"speed  : prefill {t['prefill_tokens_per_s']} tok/s, decode {t['decode_tokens_per_s']} tok/s "
          f"(2 shard processes, split by experts, transport {'/'.join(sorted(set(out['transports'].values())))}, "
          f"{t['generated_tokens']} tokens, finish={out['finish_reason']})")

    import torch

    sys.path.insert(0, ROOT)
    from tests.hf_reference import load_reference

    hf = load_reference(model)
    with torch.no_grad():
        g = hf.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW_TOKENS, do_sample=False)
    with open(os.path.join(model, "config.json")) as f:
        eos = json.load(f)["eos_token_id"]
    eos = set(eos if isinstance(eos, list) else [eos])
    ref = _strip_eos(g[0, len(ids):].tolist(), eos)
    same = ref == _strip_eos(out["token_ids"], eos)
    print(f"reference (transformers DeepseekV3ForCausalLM on the dequantised weights): "
          f"{'tokens MATCH' if same else 'tokens DIFFER'}")
    if not same:
        print(f"reference tokens: {ref}\nmoesplit tokens : {out['token_ids']}")
    print(f"demo took {time.perf_counter() - t_start:.0f} s")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
