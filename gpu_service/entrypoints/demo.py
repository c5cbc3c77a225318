"""`make demo`: a tiny FP8 checkpoint, `moesplit generate` with 2 shard processes over gRPC,
and a check of the tokens against the transformers reference on the dequantised weights."""
from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
MODEL = os.path.join(ROOT, "build", "demo-tiny-fp8")
PROMPT = "The experts live on the CPU and the attention lives on the GPU."


def main() -> int:
    from gpu_service.local.tiny import make_tiny

    if not os.path.exists(os.path.join(MODEL, "config.json")):
        make_tiny(MODEL, fmt="fp8", seed=0)
        print(f"wrote tiny FP8 checkpoint to {MODEL}")
    cmd = [sys.executable, "-m", "moesplit", "generate", "--model", MODEL, "--prompt", PROMPT,
           "--max-new-tokens", "32", "--shards", "2", "--json"]
    print("$", " ".join(cmd[2:]))
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return r.returncode
    out = json.loads(r.stdout.strip().splitlines()[-1])
    t = out["timings"]
    print(f"prompt : {PROMPT!r}")
    print(f"output : {out['text']!r}")
    print(f"tokens : {out['token_ids']}")
    print(f"speed  : prefill {t['prefill_tokens_per_s']} tok/s, decode {t['decode_tokens_per_s']} tok/s "
          f"(2 shard processes, split by experts, transport {'/'.join(sorted(set(out['transports'].values())))}, "
          f"{t['generated_tokens']} tokens)")

    import torch

    sys.path.insert(0, ROOT)
    from tests.hf_reference import load_reference

    hf = load_reference(MODEL)
    prompt = out["prompt_ids"]
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False)
    ref = g[0, len(prompt):].tolist()
    same = ref == out["token_ids"]
    print(f"reference (transformers DeepseekV3ForCausalLM on the dequantised weights): "
          f"{'tokens MATCH' if same else 'tokens DIFFER'}")
    if not same:
        print(f"reference tokens: {ref}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
