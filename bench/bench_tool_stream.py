"""Streaming cost of the chat output parsers per token, at the start and at the end of a long
tool call (a benchmark, not a test).

    python bench/bench_tool_stream.py [--chars 4000] [--token-chars 4] [--repeats 5]

A DeepSeek-V4 answer with thinking on (a little reasoning, `</think>`, a sentence, then a DSML
`tool_calls` block whose string argument fills the answer up to --chars characters) is fed
--token-chars characters at a time to the request's streamer (`open_stream`: the incremental
deepseek_v4 parsers; V3.2's are incremental too). The same answer in V3.1's syntax goes through
V3.1's parsers (ChatStream, which parses the whole text so far at each token) for comparison. Prints JSON (also written to
bench/results/tool_stream.json): µs per token over the first and the last 10% of the tokens
inside the call's argument and their ratio (the target for V4: within 2x), each window's median
token (one collector pause or another job's burst on a shared machine lands on single tokens
and would decide a mean), the median of --repeats runs.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from gpu_service.api.parsers import OutputParser, ReasoningParser, TOOL_PARSERS  # noqa: E402
from gpu_service.api.parsers.stream import open_stream  # noqa: E402
from cpu_expert_service.probes import cpu_description  # noqa: E402


def answer(chars: int, syntax: str) -> tuple[str, int, int]:
    """(a thinking answer of `chars` characters ending in one call with a long string argument, in
    `syntax` ("dsml_v4" or "v31"), where the argument starts, where it ends)."""
    think = "Let me think about where to look.</think>I will search the notes."
    if syntax == "dsml_v4":
        head = think + '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="search">\n<｜DSML｜parameter name="query" string="true">'
        tail = '</｜DSML｜parameter>\n<｜DSML｜parameter name="limit" string="false">10</｜DSML｜parameter>\n' \
            "</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
        body = ("notes about \"streams\" & <tags>\n" * (chars // 30 + 1))
    else:
        head = think + '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{"query": "'
        tail = '", "limit": 10}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
        body = "notes about streams and tags " * (chars // 30 + 1)
    body = body[:max(0, chars - len(head) - len(tail))]
    return head + body + tail, len(head), len(head) + len(body)


def run(parser: str, reasoning: str, text: str, token_chars: int) -> list[tuple[int, float]]:
    """(position, seconds) of each feed."""
    s = open_stream(OutputParser(ReasoningParser(reasoning, True), TOOL_PARSERS[parser]()))
    times = []
    for i in range(0, len(text), token_chars):
        t0 = time.perf_counter()
        s.feed(text[i:i + token_chars])
        times.append((i, time.perf_counter() - t0))
    s.finish()
    args = json.loads(s.message()["tool_calls"][0]["function"]["arguments"])
    assert args["limit"] == 10 and args["query"].startswith("notes about")
    return times


def measure(parser: str, reasoning: str, syntax: str, chars: int, token_chars: int, repeats: int) -> dict:
    """µs per token at the start and the end of the call's argument (medians)."""
    text, a, b = answer(chars, syntax)
    starts, ends = [], []
    for _ in range(repeats):
        inside = [t for i, t in run(parser, reasoning, text, token_chars) if a <= i < b - token_chars]
        k = max(1, len(inside) // 10)
        starts.append(statistics.median(inside[:k]) * 1e6)
        ends.append(statistics.median(inside[-k:]) * 1e6)
    start, end = statistics.median(starts), statistics.median(ends)
    return {"chars": len(text), "tokens": -(-len(text) // token_chars), "us_per_token_start": round(start, 2),
            "us_per_token_end": round(end, 2), "end_over_start": round(end / start, 2)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chars", type=int, default=4000)
    ap.add_argument("--token-chars", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    v4 = measure("deepseek_v4", "deepseek_v4", "dsml_v4", args.chars, args.token_chars, args.repeats)
    v31 = measure("deepseek_v31", "deepseek_v3", "v31", args.chars, args.token_chars, args.repeats)
    out = {"bench": "tool_stream", "cpu": cpu_description(), "token_chars": args.token_chars,
           "deepseek_v4_incremental": v4, "deepseek_v31_reparsing": v31,
           "target": "deepseek_v4 end_over_start <= 2", "met": v4["end_over_start"] <= 2}
    print(json.dumps(out, indent=1))
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "tool_stream.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
