"""Short decode/prefill benchmark of the GPU service on CUDA vs CPU (in-process experts), for
`make gpu-check`. Prints JSON and writes it to --out."""
import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.reader import CheckpointReader  # noqa: E402
from cpu_expert_service.server import load_shard  # noqa: E402
from gpu_service.runtime.runner import LocalExperts, ModelRunner  # noqa: E402
from gpu_service.local.tiny import make_tiny  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--tokens", type=int, default=32)
    args = ap.parse_args()
    d = make_tiny(tempfile.mkdtemp(prefix="bench-gpu-"), fmt="bf16", seed=0,
                  overrides={"hidden_size": 1024, "num_attention_heads": 8, "vocab_size": 8192})
    reader = CheckpointReader(d)
    _, backend, _ = load_shard(d, None, None, "numpy")
    experts = LocalExperts(backend)
    results = []
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    for dev in devices:
        for dtype in ([torch.float32, torch.bfloat16] if dev == "cuda" else [torch.float32]):
            r = ModelRunner(reader, experts, device=torch.device(dev), dtype=dtype, kv_tokens=1024)
            r.generate(list(range(1, 9)), 4)  # warm-up
            t0 = time.perf_counter()
            res = r.generate(list(range(1, 257)), args.tokens)
            results.append({"device": dev, "dtype": str(dtype).replace("torch.", ""), **res.timings,
                            "wall_s": round(time.perf_counter() - t0, 3)})
    out = {"bench": "gpu-service decode (tiny wide model, in-process numpy experts)", "results": results}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
