"""Grammar-engine costs on the tiny checkpoint's vocabulary (a benchmark, not a test).

    python bench/bench_grammar.py [--vocab-size V]

Prints JSON (also written to bench/results/grammar.json): compile time of a 30-property JSON schema (cache miss, vocabulary already built), and the
per-step overhead of structured output in the sampler (gpu_service.runtime.logits.choose_tokens)
at batch 1 and 16: the same rows greedy, with and without a grammar matcher per row (mask fill +
apply + the matcher's advance).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from gpu_service.runtime.grammar import check_json_schema, GrammarCompiler, GrammarSpec  # noqa: E402
from gpu_service.runtime.logits import choose_tokens  # noqa: E402
from gpu_service.runtime.sampling import SamplingParams  # noqa: E402
from gpu_service.runtime.vocab import HFVocabulary  # noqa: E402


class _Row:
    def __init__(self, matcher):
        self.params, self.gen, self.tokens, self.prompt_len = SamplingParams(), None, [1], 1
        self.matcher, self.banned_early = matcher, ()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    from gpu_service.local.tiny import make_tiny

    d = make_tiny(os.path.join(tempfile.mkdtemp(), "tiny"), "bf16", seed=0)
    vocab = HFVocabulary(open(os.path.join(d, "tokenizer.json")).read(), args.vocab_size, (1,))
    vocab.lltokenizer()
    props = {f"p{i}": [{"type": "integer"}, {"type": "string", "maxLength": 16}, {"enum": ["a", "b", "c"]},
                       {"type": "array", "items": {"type": "number"}, "maxItems": 4}, {"type": "boolean"}][i % 5]
             for i in range(30)}
    schema = {"type": "object", "properties": props, "required": sorted(props), "additionalProperties": False}
    comp = GrammarCompiler(vocab)
    check_json_schema({"type": "object"})  # imports jsonschema
    t0 = time.perf_counter()
    check_json_schema(schema)  # part of the compile below
    t1 = time.perf_counter()
    spec = GrammarSpec.json_schema(schema)
    g = comp.compile(spec).result()
    t2 = time.perf_counter()
    comp.compile(spec).result()
    t3 = time.perf_counter()
    out = {"vocab_size": args.vocab_size, "steps": args.steps, "torch_threads": torch.get_num_threads(),
           "compile_30_properties": {"metaschema_check_ms": round(1e3 * (t1 - t0), 2),
                                     "compile_ms_incl_check": round(1e3 * (t2 - t1), 2),
                                     "llguidance_compile_ms": round(1e3 * g.compile_s, 2),
                                     "cached_us": round(1e6 * (t3 - t2), 1)},
           "sampler": {}}
    for B in (1, 16):
        logits = torch.randn(B, args.vocab_size)
        plain = [_Row(None) for _ in range(B)]
        choose_tokens(logits, plain)
        t0 = time.perf_counter()
        for _ in range(args.steps):
            choose_tokens(logits, plain)
        base = (time.perf_counter() - t0) / args.steps
        total, n = 0.0, 0
        while n < args.steps:
            rows = [_Row(g.matcher()) for _ in range(B)]
            for _ in range(40):  # a JSON object of this schema is ~150 tokens on this vocabulary
                lg = torch.randn(B, args.vocab_size)
                t0 = time.perf_counter()
                picks = choose_tokens(lg, rows)
                for r, (tok, _) in zip(rows, picks):
                    r.matcher.accept(tok)
                total += time.perf_counter() - t0
                n += 1
        masked = total / n
        out["sampler"][f"batch_{B}"] = {"plain_us_per_step": round(1e6 * base, 1),
                                        "grammar_us_per_step": round(1e6 * masked, 1),
                                        "overhead_us_per_constrained_token": round(1e6 * (masked - base) / B, 1)}
    comp.close()
    res = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "results")
    os.makedirs(res, exist_ok=True)
    with open(os.path.join(res, "grammar.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
