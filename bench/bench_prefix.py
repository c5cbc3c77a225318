"""`make bench-prefix`: an agent-like trace through the engine with the prefix cache off, on the
GPU tier only, and with a GPU pool too small for the trace so the host tier serves it.

Two agent sessions on the tiny model take turns (as two users of one server would): each starts
from a ~2K-token system prompt with tool schemas, and each of its 8 turns resends the whole
conversation plus a user message, the model's answer of the previous turn, a tool call and its
result. Per turn: prefill tokens computed (the engine's `prefill_tokens`, what the CPU experts
receive beyond decodes), cached tokens, TTFT. Writes JSON (and a PNG plot with matplotlib).

    python bench/bench_prefix.py [--out bench/results/prefix.json] [--device cuda]
"""
import argparse
import json
import os
import random
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from checkpoint.reader import CheckpointReader  # noqa: E402
from cpu_expert_service.server import load_shard  # noqa: E402
from gpu_service.local.tiny import make_tiny  # noqa: E402
from gpu_service.model.host_kv import page_bytes  # noqa: E402
from gpu_service.model.prefix_cache import make_prefix_cache  # noqa: E402
from gpu_service.runtime.engine import Engine  # noqa: E402
from gpu_service.experts.handoff import LocalExperts  # noqa: E402
from gpu_service.runtime.runner import ModelRunner  # noqa: E402

TURNS, SESSIONS, MAX_TOKENS, PAGE = 8, 2, 32, 64


def tool_schemas(tok, n_tokens: int, seed: int) -> list[int]:
    """A system prompt: instructions + JSON tool schemas, about n_tokens tokens."""
    rnd = random.Random(seed)
    text = "You are an agent. Use the tools below; answer with a tool call when needed.\n"
    i = 0
    while len(tok.encode(text)) < n_tokens:
        text += json.dumps({"type": "function", "function": {
            "name": f"tool_{seed}_{i}", "description": f"Does task {i} on a {rnd.choice(['file', 'url', 'table'])}",
            "parameters": {"type": "object", "properties": {f"arg{j}": {"type": rnd.choice(["string", "integer"])}
                                                            for j in range(3)}, "required": ["arg0"]}}}) + "\n"
        i += 1
    return tok.encode(text)[:n_tokens]


def turn_tokens(tok, session: int, turn: int) -> tuple[list[int], list[int]]:
    """(user message, tool call + result) of one turn."""
    user = tok.encode(f"\nuser: step {turn} of session {session}: look up item {turn * 7 + session} "
                      "and summarise.", add_bos=False)
    call = tok.encode(f"\ncall: tool_{session}_{turn}({{\"arg0\": \"item-{turn}\"}})\nresult: " +
                      " ".join(f"row{turn}.{j}={j * turn % 97}" for j in range(24)), add_bos=False)
    return user, call


def run(cfg_name: str, model_dir: str, backend, tok, kv_tokens: int, cache: bool, host_bytes: int, device: str):
    reader = CheckpointReader(model_dir)
    runner = ModelRunner(reader, LocalExperts(backend), device=torch.device(device), dtype=torch.float32,
                         kv_tokens=kv_tokens, page_size=PAGE, prefix_cache=cache)
    if cache and host_bytes:
        runner.prefix_cache = make_prefix_cache(runner.pool, host_bytes)
    eng = Engine(runner, None, max_batch=4, chunk_tokens=512).start()
    try:
        eng.submit(list(range(8, 40)), max_tokens=2).result(120)  # warm-up
        prompts = {s: tool_schemas(tok, 2048, s) for s in range(SESSIONS)}
        answers = {s: [] for s in range(SESSIONS)}
        rows = []
        for t in range(TURNS):
            for s in range(SESSIONS):
                user, call = turn_tokens(tok, s, t)
                prompts[s] = prompts[s] + answers[s] + user + call
                c0 = eng.counters["prefill_tokens_computed"]
                t0 = time.perf_counter()
                h = eng.submit(prompts[s], max_tokens=MAX_TOKENS, ignore_eos=True)
                first = h.get(300)
                ttft = time.perf_counter() - t0
                ids, _, _ = h.result(300)
                answers[s] = first.token_ids + ids
                rows.append({"turn": t + 1, "session": s, "prompt_tokens": len(prompts[s]),
                             "cached_tokens": h.cached_tokens, "prefill_tokens": eng.counters["prefill_tokens_computed"] - c0,
                             "ttft_s": round(ttft, 4), "e2e_s": round(time.perf_counter() - t0, 4)})
        st = eng.stats()
        pc = {k[len("prefix_"):]: v for k, v in st.items() if k.startswith("prefix_")}
        bw = {}
        for d in ("in", "out"):
            if pc.get(f"copy_{d}_s"):
                bw[f"copy_{d}_GBps"] = round(pc[f"copy_{d}_bytes"] / pc[f"copy_{d}_s"] / 1e9, 3)
        return {"config": cfg_name, "kv_tokens": kv_tokens, "host_kv_bytes": host_bytes, "turns": rows,
                "prefill_tokens_total": sum(r["prefill_tokens"] for r in rows),
                "prompt_tokens_total": sum(r["prompt_tokens"] for r in rows), "prefix_cache": pc, **bw}
    finally:
        eng.stop()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "prefix.json"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto", help="expert backend of the in-process experts (auto|numpy)")
    args = ap.parse_args()
    from gpu_service.api.tokenizer import Tokenizer

    d = make_tiny(tempfile.mkdtemp(prefix="bench-prefix-"), "bf16", seed=0,
                  overrides={"max_position_embeddings": 16384})
    tok = Tokenizer(d)
    _, backend, _ = load_shard(d, None, None, args.backend)
    probe = ModelRunner(CheckpointReader(d), LocalExperts(backend), device=torch.device(args.device),
                        dtype=torch.float32, kv_tokens=PAGE, page_size=PAGE, prefix_cache=False)
    host = 4096 * page_bytes(probe.pool)  # 4096 pages: the whole trace many times over
    results = [run("off", d, backend, tok, 16384, False, 0, args.device),
               run("gpu", d, backend, tok, 16384, True, 0, args.device),
               # one session's last turn (~4.6K tokens) fits, both sessions' histories do not
               run("gpu+host", d, backend, tok, 6144, True, host, args.device)]
    out = {"bench": "prefix cache, agent-like trace (tiny model, in-process experts)", "device": args.device,
           "backend": args.backend, "sessions": SESSIONS, "turns": TURNS, "page_size": PAGE, "results": results}
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    for r in results:
        last = [x for x in r["turns"] if x["turn"] == TURNS]
        print(f"{r['config']:>9}: prefill {r['prefill_tokens_total']:>6} of {r['prompt_tokens_total']} prompt tokens; "
              f"turn-{TURNS} TTFT {', '.join(str(x['ttft_s']) for x in last)} s; "
              f"hits gpu {r['prefix_cache'].get('hits_gpu', 0)} host {r['prefix_cache'].get('hits_host', 0)}"
              + (f"; host copies in {r.get('copy_in_GBps')} GB/s, out {r.get('copy_out_GBps')} GB/s"
                 if r.get("copy_in_GBps") else ""))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for r in results:
            rows = [x for x in r["turns"] if x["session"] == 0]
            axes[0].plot([x["turn"] for x in rows], [x["prefill_tokens"] for x in rows], marker="o", label=r["config"])
            axes[1].plot([x["turn"] for x in rows], [x["ttft_s"] for x in rows], marker="o", label=r["config"])
        axes[0].set(xlabel="turn", ylabel="prefill tokens computed", title="prefill work (session 0)")
        axes[1].set(xlabel="turn", ylabel="TTFT (s)", title="time to first token (session 0)")
        for a in axes:
            a.legend()
        fig.tight_layout()
        fig.savefig(os.path.splitext(args.out)[0] + ".png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
