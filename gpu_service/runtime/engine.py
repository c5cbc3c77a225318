"""Continuous-batching engine: one scheduler thread drives `ModelRunner.step` for many requests.

Each step is one flat batch: a one-token decode chunk for every running request past its prompt,
then prefill chunks (running requests first, then newly admitted ones) within `chunk_tokens` in
all. KV lives in the runner's paged pool: admission reserves the whole prompt (+1) or the request
waits (first come, first served); a decode that finds no free page preempts the most recently
admitted request (pages freed, re-prefilled later from prompt + generated tokens); a request that
can never fit is refused at `submit` (`RequestError`), so nothing runs out of memory mid-step. With
the prefix cache (gpu_service.model.prefix_cache) admission first takes the longest cached prefix
of the prompt (per `cache_salt`).

One request never stops the engine: whatever raises for one request fails it alone with the reason
(`Output.param` names the field when the request caused it). When the scheduler thread ends,
`alive` is False and every request still queued is answered (the server's watchdog then exits).
Each request samples with its own generator, so a seeded request gives the same tokens whatever it
is batched with (greedy tokens identical alone or batched).

    engine = Engine(runner, tokenizer, max_batch=16, chunk_tokens=512).start()
    h = engine.submit(ids, SamplingParams(temperature=0.7, seed=1), max_tokens=64, stop=["\\n\\n"])
    for out in h:                 # Output(token_ids, text, finish_reason) as tokens come
        print(out.text, end="")
    # h.cancel() from any thread: freed at the next step boundary
"""
from __future__ import annotations

import collections
import itertools
import logging
import threading
import traceback

from gpu_service.model.kv import Chunk, PoolExhausted
from gpu_service.model.prefix_cache import check_pool
from gpu_service.runtime.grammar import compiler_for
from gpu_service.runtime.images import prompt_images
from gpu_service.runtime.logits import choose_tokens, grammar_reason, prompt_logprobs, RowFailed, TokenLogprob
from gpu_service.runtime.requests import (
    _Request, check_request, EngineStopped, MAX_N, Output, QueueFull, RequestError, RequestHandle,
)
from gpu_service.runtime.sampling import SamplingParams

log = logging.getLogger("moesplit.engine")


class Engine:
    """Continuous batching over a `ModelRunner`. `submit` refuses, before any work, more than
    `max_waiting` queued requests (QueueFull), more than MAX_STOP stop strings of MAX_STOP_CHARS
    characters, and the caps of gpu_service.runtime.requests (check_request)."""

    MAX_STOP = 16
    MAX_STOP_CHARS = 256

    def __init__(self, runner, tokenizer=None, max_batch: int = 16, chunk_tokens: int = 512,
                 eos_token_ids: tuple[int, ...] | None = None, max_context: int | None = None,
                 max_waiting: int = 256, max_new_tokens: int = 8192, check_pool: bool = False):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        if chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
        self.runner = runner
        self.tokenizer = tokenizer
        self.cfg = runner.cfg
        self.max_batch = max_batch
        self.chunk_tokens = chunk_tokens
        self.eos = frozenset(self.cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.max_context = int(max_context or self.cfg.max_position_embeddings)
        if max_waiting < 1 or max_new_tokens < 1:
            raise ValueError(f"max_waiting and max_new_tokens must be >= 1, got {max_waiting}, {max_new_tokens}")
        self.max_waiting = int(max_waiting)
        self.max_new_tokens = int(max_new_tokens)
        self.pool = runner.pool
        self.prefix = getattr(runner, "prefix_cache", None)  # PrefixCache or None (--no-prefix-cache)
        self.check_pool = check_pool  # test mode: assert the pool's invariants after every step
        self.pool_tokens = self.pool.usable_pages * self.pool.page_size
        self._inbox: collections.deque[_Request] = collections.deque()
        self._lock = threading.Lock()
        self._wake_ev = threading.Event()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count(1)
        self.waiting: collections.deque[_Request] = collections.deque()
        self.running: list[_Request] = []
        self.counters = dict(peak_running=0, requests=0, finished=0, cancelled=0, errors=0, preempted=0, steps=0,
                             prompt_tokens=0, generated_tokens=0, step_tokens=0, prefill_tokens_computed=0,
                             structured_requests=0, cached_tokens=0)
        self.last_error: str | None = None
        self.grammars = compiler_for(tokenizer, self.cfg)  # GrammarCompiler (structured outputs) or None
        self.observer = None  # metrics hooks (gpu_service.metrics.EngineObserver): submit/admit/token/finish/preempt

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> "Engine":
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="moesplit-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the scheduler after the current step; unfinished requests end with "cancelled"."""
        self._stopping = True
        self._wake_ev.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self._abort_all("cancelled", None)
        if self.grammars is not None:
            self.grammars.close()

    @property
    def alive(self) -> bool:
        """Liveness: the scheduler thread runs (also while it drains on stop). False once it is gone."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def serving(self) -> bool:
        """Readiness: the scheduler runs and takes new requests."""
        return self.alive and not self._stopping

    # ---- submit -------------------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """Largest prompt + max_tokens a request may ask for."""
        return min(self.max_context, self.pool_tokens)

    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None, max_tokens: int | None = None,
               stop: list[str] | tuple[str, ...] = (), ignore_eos: bool = False, grammar=None,
               prompt_logprobs: int | None = None, cache_salt: str | None = None, images=None) -> RequestHandle:
        """Queue a request (`max_tokens=None`: up to `max_new_tokens`). `grammar`: a CompiledGrammar
        the output must match (compiled off this thread); `prompt_logprobs=k`: the prompt's logprobs
        in the first Output (then `max_tokens=0` scores the prompt only); `images`: ImageInputs, one
        per run of image placeholder tokens in the prompt (gpu_service.runtime.images). RequestError /
        QueueFull / EngineStopped when it cannot be queued."""
        return self._enqueue([self._make(prompt_ids, params, max_tokens, stop, ignore_eos, grammar,
                                         prompt_logprobs, cache_salt, images)])[0]

    def submit_n(self, prompt_ids: list[int], params: list[SamplingParams], **kw) -> list[RequestHandle]:
        """len(params) requests on one prompt (OpenAI's `n`), queued and admitted as one unit. The
        first prefills the prompt; the others copy its KV pages but for the last prompt token (a
        choice that cannot fork then is prefilled on its own: same tokens, more work). A runner that
        keeps a sequence's state only where told (V4) is told the fork point first (`will_fork`)."""
        if len(params) > MAX_N:
            raise RequestError(f"n={len(params)} choices; at most {MAX_N} (MAX_N) per request: lower n", "n")
        if len(params) > self.max_waiting:
            raise RequestError(f"n={len(params)} choices, but this server queues at most {self.max_waiting} "
                               f"requests (--max-waiting); lower n", "n")
        reqs = [self._make(prompt_ids, p, **kw) for p in params]
        reqs[0].followers = reqs[1:]  # linked before the engine can see the first: forked once, all of them
        will_fork = getattr(self.runner, "will_fork", None)  # a runner keeping state only where told (V4)
        if will_fork is not None and len(reqs) > 1:
            will_fork(reqs[0].seq, reqs[0].prompt_len - 1)
        return self._enqueue(reqs[:1], choices=len(reqs))

    def _make(self, prompt_ids: list[int], params: SamplingParams | None, max_tokens: int | None = None,
              stop=(), ignore_eos: bool = False, grammar=None, prompt_logprobs: int | None = None,
              cache_salt: str | None = None, images=None) -> _Request:
        """A validated request record (not queued yet); RequestError naming the field otherwise."""
        if self._thread is not None and not self._thread.is_alive() and self.last_error is not None:
            raise EngineStopped(f"the engine has stopped ({self.last_error}); the server is restarting")
        if self._stopping:
            raise EngineStopped("the engine is shutting down")
        stop = tuple(stop or ())
        if len(stop) > self.MAX_STOP or any(isinstance(s, str) and len(s) > self.MAX_STOP_CHARS for s in stop):
            raise RequestError(f"at most {self.MAX_STOP} stop strings of at most {self.MAX_STOP_CHARS} characters "
                               f"each, got {len(stop)} (longest {max((len(s) for s in stop if isinstance(s, str)), default=0)})",
                               "stop")
        prompt_ids = [int(t) for t in prompt_ids]
        n = len(prompt_ids)
        max_tokens = check_request(self, prompt_ids, params or SamplingParams(), max_tokens, stop, prompt_logprobs,
                                   cache_salt)
        params = params or SamplingParams()
        if grammar is not None and getattr(grammar, "vocab_key", None) is None:
            raise RequestError("grammar must be a CompiledGrammar (GrammarCompiler.compile(spec).result())",
                               "response_format")
        mm = prompt_images(self.runner, prompt_ids, images) if images else None
        handle = RequestHandle(f"req-{next(self._ids)}", n, max_tokens, self._wake_ev.set)
        return _Request(
            handle, n, prompt_ids, params, params.generator(), max_tokens, stop, ignore_eos, self.runner.new_seq(),
            grammar.matcher() if grammar is not None else None, tuple(sorted(self.eos | set(params.stop_token_ids))),
            prompt_logprobs, salt=cache_salt or None, images=mm)

    def _queued(self) -> int:
        """Requests waiting for admission, every choice of an `n` unit counted."""
        return sum(1 + len(r.followers) for r in list(self._inbox) + list(self.waiting))  # list(deque): atomic

    def _enqueue(self, reqs: list[_Request], choices: int | None = None) -> list[RequestHandle]:
        """Queue `reqs` (with their followers: `choices` requests in all) or none of them (QueueFull)."""
        choices = choices or len(reqs)
        all_reqs = [x for r in reqs for x in [r, *r.followers]]
        with self._lock:
            if self._queued() + choices > self.max_waiting:
                for r in all_reqs:
                    r.seq.free()
                raise QueueFull(f"{self.max_waiting} requests are waiting already (--max-waiting); retry shortly")
            for r in all_reqs:
                self.counters["requests"] += 1
                self.counters["structured_requests"] += r.matcher is not None
                self.counters["prompt_tokens"] += r.prompt_len
                if self.observer is not None:
                    self.observer.submit(r.handle)
            self._inbox.extend(reqs)
        self._wake_ev.set()
        return [r.handle for r in all_reqs]

    def _fork(self, r: _Request) -> None:
        """r's prompt KV is complete: start its followers from a copy of it (see submit_n)."""
        followers, r.followers = r.followers, []
        n = r.prompt_len - 1
        for f in followers:
            if f.handle.cancelled:
                self._finish(f, "cancelled")
                continue
            try:
                if len(self.running) >= self.max_batch or n < 1:
                    raise PoolExhausted("batch full")
                if self.prefix is not None:  # share r's full pages (committed by now), copy the rest
                    self.prefix.attach(f.seq, f.cache_tokens(), f.salt)
                f.seq.reserve(r.prompt_len + 1)
            except PoolExhausted:
                f.seq.free()
                self.waiting.appendleft(f)  # prefilled on its own
                continue
            self.runner.copy_prefix(r.seq, f.seq, n, start=f.seq.length)
            f.prompt_lps = list(r.prompt_lps)
            self.running.append(f)
            if self.observer is not None:
                self.observer.admit(f.handle)

    # ---- stats --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Snapshot for metrics: requests running/waiting, pool pages, counters."""
        p = self.pool
        return {
            "running": len(self.running),
            "waiting": self._queued(),
            "pool_pages_total": p.usable_pages,
            "pool_pages_in_use": p.pages_in_use,
            "pool_page_size": p.page_size,
            # held by requests; unreferenced prefix-cache pages are reclaimable, so they count as free here
            "pool_usage": (p.pages_in_use - p.cached_pages) / p.usable_pages,
            "max_batch": self.max_batch,
            "chunk_tokens": self.chunk_tokens,
            "pool_pages_cached": p.cached_pages,
            **self.counters,
            **({"prefix_" + k: v for k, v in self.prefix.stats.items()} if self.prefix is not None else {}),
            **({"image_" + k: v for k, v in images.stats.items()} if (images := getattr(self.runner, "images", None))
               else {}),
        }

    # ---- scheduler ----------------------------------------------------------------------------
    def _loop(self) -> None:
        """The scheduler thread: an error outside the per-request guards fails the running requests
        and the loop goes on; a BaseException ends it, answering every request still here."""
        try:
            while not self._stopping:
                try:
                    self._iterate()
                except Exception as e:  # noqa: BLE001 - a bug outside the per-request guards: keep serving
                    msg = f"internal error in the scheduler: {type(e).__name__}: {e}"
                    log.error("%s\n%s", msg, traceback.format_exc())
                    self.last_error = msg
                    for r in list(self.running):
                        self._fail(r, msg)
        except BaseException as e:
            self.last_error = f"the scheduler thread died: {type(e).__name__}: {e}"
            log.critical("%s", self.last_error)
            self._abort_all("error", self.last_error)
            raise

    def _iterate(self) -> None:
        """One pass: take new requests, reap cancelled ones, run a step (or sleep until woken)."""
        self._wake_ev.clear()
        with self._lock:
            while self._inbox:
                self.waiting.append(self._inbox.popleft())
        self._reap_cancelled()
        batch = self._schedule()
        if not batch:
            self._wake_ev.wait()
            return
        self._run(batch)
        if self.check_pool:
            try:
                check_pool(self.pool, self.prefix, [r.seq for r in self.running + list(self.waiting)])
            except AssertionError as e:  # test mode: fail every request loudly, stop serving
                self.last_error = f"KV pool invariant broken: {e}"
                log.error("%s", self.last_error)
                self._stopping = True
                self._abort_all("error", self.last_error)

    def _fail(self, r: _Request, error: str, param: str | None = None) -> None:
        """End request `r` alone with `error` (`param`: its field that caused it), pages freed."""
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)
        if r.handle.finish_reason is None:
            self._finish(r, "error", error, param=param)
        else:
            r.seq.free()

    def _guarded(self, r: _Request, what: str, fn, *args):
        """fn(*args) for request `r`: True, or False when it raised (`r` failed alone, logged)."""
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - one request's failure stays its own
            msg = f"{what} failed for this request: {type(e).__name__}: {e}"
            log.error("%s %s\n%s", r.handle.id, msg, traceback.format_exc())
            self._fail(r, msg, getattr(e, "param", None) if isinstance(e, RequestError) else None)
            return False

    def _reap_cancelled(self) -> None:
        """End the cancelled requests, running or waiting."""
        for q in (self.running, self.waiting):
            for r in [r for r in q if r.handle.cancelled]:
                q.remove(r)
                self._finish(r, "cancelled")

    def _preempt(self, r: _Request) -> None:
        """Free a running request's pages and put it back at the head of the queue (recompute)."""
        r.seq.free()
        self.waiting.appendleft(r)
        self.counters["preempted"] += 1
        if self.observer is not None:
            self.observer.preempt(r.handle)
        log.info("preempted %s (%d tokens) to free KV pages", r.handle.id, len(r.tokens))

    def _schedule(self) -> list[tuple[_Request, int, int]]:
        """Pick this step's chunks as (request, start, n); reserves their KV pages."""
        # 1. every decode needs one more slot; preempt the newest requests if the pool is full
        i = 0
        while i < len(self.running):
            r = self.running[i]
            if r.remaining == 1:
                while True:
                    try:
                        r.seq.reserve(r.seq.length + 1)
                        break
                    except PoolExhausted:
                        victim = self.running.pop()
                        self._preempt(victim)
                        if victim is r:
                            break
                    except Exception as e:  # noqa: BLE001 - this request alone
                        self._fail(r, f"scheduling failed: {type(e).__name__}: {e}")
                        i -= 1
                        break
            i += 1
        batch = [(r, r.seq.length, 1) for r in self.running if r.remaining == 1]
        budget = self.chunk_tokens - len(batch)
        # 2. continue the prefills of running requests (pages already reserved at admission)
        for r in self.running:
            if r.remaining > 1 and budget > 0:
                n = min(r.remaining, budget)
                batch.append((r, r.seq.length, n))
                budget -= n
        # 3. admit new requests while the budget, the batch size and the pool allow
        while self.waiting and budget > 0 and len(self.running) < self.max_batch:
            r = self.waiting[0]
            if self.running and len(self.running) + 1 + len(r.followers) > self.max_batch:
                break  # an n unit is admitted with room for all its choices (FIFO: no overtaking)
            try:
                # (a request that reports prompt logprobs computes its whole prompt)
                hit = self.prefix.attach(r.seq, r.cache_tokens(), r.salt) if self.prefix is not None \
                    and r.prompt_lp is None else (0, 0)
                r.seq.reserve(len(r.tokens) + 1)
            except PoolExhausted:
                r.seq.free()  # the prefix it took stays cached
                break  # wait until a request finishes (FIFO: no overtaking)
            except Exception as e:  # noqa: BLE001 - e.g. a cache key it cannot make: this request alone
                log.error("%s: admission failed\n%s", r.handle.id, traceback.format_exc())
                self._fail(r, f"admission failed: {type(e).__name__}: {e}")
                continue
            self.waiting.popleft()
            if self.prefix is not None and not r.looked_up:  # counted once (not again after a preemption)
                r.looked_up = True
                r.handle.cached_tokens = r.seq.length
                self.counters["cached_tokens"] += r.seq.length
                self.prefix.note_query(r.prompt_len, *hit)
            self.running.append(r)
            if self.observer is not None:
                self.observer.admit(r.handle)
            n = min(r.remaining, budget)
            batch.append((r, r.seq.length, n))
            budget -= n
        return batch

    def _run(self, batch: list[tuple[_Request, int, int]]) -> None:
        batch = [b for b in batch if self._images_ready(b[0], b[1])]  # a failed image fails its request alone
        if not batch:
            return
        ids: list[int] = []
        chunks: list[Chunk] = []
        rows, vals = [], []  # image embeddings replacing placeholder rows
        for r, start, n in batch:
            if r.images is not None and start < r.prompt_len:
                rr, vv = r.images.chunk_rows(start, n)
                rows += [len(ids) + j for j in rr]
                vals += vv
            ids += r.tokens[start:start + n]
            chunks.append(Chunk(r.seq, start, n))
            if start < r.prompt_len:
                self.counters["prefill_tokens_computed"] += min(n, r.prompt_len - start)
        every = any(r.prompt_lp is not None and start < r.prompt_len for r, start, _ in batch)
        try:
            # [len(chunks), V] ([len(ids), V] with every); image rows passed only when there are any
            logits = self.runner.step(ids, chunks, all_logits=every, **({"embeds": (rows, vals)} if rows else {}))
        except Exception as e:  # noqa: BLE001 - fail this batch's requests, keep serving
            unavailable = bool(getattr(e, "unavailable", False))  # e.g. ShardError: no replica of a shard left
            msg = f"model step failed: {type(e).__name__}: {e}"
            if unavailable:
                log.error("%s", msg)
            else:
                log.error("%s\n%s", msg, traceback.format_exc())
            self.last_error = msg
            for r, _, _ in batch:
                if r in self.running:
                    self.running.remove(r)
                self._finish(r, "error", msg, unavailable)
            return
        self.counters["steps"] += 1
        self.counters["peak_running"] = max(self.counters["peak_running"], len(self.running))
        self.counters["step_tokens"] += len(ids)
        if self.prefix is not None:
            for r, _, _ in batch:
                self._guarded(r, "prefix-cache commit", self.prefix.commit, r.seq, r.cache_tokens())  # pages this step filled
        if every:  # rows of every token: keep the prompt logprobs asked for, then the chunks' last rows
            ends = list(itertools.accumulate(n for _, _, n in batch))
            for (r, start, n), end in zip(batch, ends):
                if r.prompt_lp is not None and start < r.prompt_len:
                    self._guarded(r, "prompt logprobs", self._prompt_lps, r, logits, start, n, end)
            logits = logits[[e - 1 for e in ends]]
        rows = [j for j, (r, start, n) in enumerate(batch) if start + n >= len(r.tokens)]  # the rest: mid-prompt
        for j in rows:
            r = batch[j][0]
            if r.followers and len(r.out) == 0 and r.handle.finish_reason is None:
                self._guarded(r, "forking the n choices", self._fork, r)
        rows = [j for j in rows if batch[j][0].handle.finish_reason is None]  # not failed above
        picks = self._choose(logits if len(rows) == len(batch) else logits[rows], [batch[j][0] for j in rows])
        for j, pick in zip(rows, picks):
            r = batch[j][0]
            if isinstance(pick, RowFailed):
                self._fail(r, pick.error, pick.param)
                continue
            tok, lp = pick
            if r.max_tokens == 0:  # scoring the prompt only (echo with max_tokens 0)
                self._guarded(r, "output", self._emit, r, None, None)
                continue
            r.tokens.append(tok)
            self.counters["generated_tokens"] += 1
            if self.observer is not None:
                self.observer.token(r.handle)
            self._guarded(r, "output", self._emit, r, tok, lp)

    def _images_ready(self, r: _Request, start: int) -> bool:
        """A prefill chunk of a request with images: its embeddings computed (once); False if that failed."""
        if r.images is None or r.images.embeds is not None or start >= r.prompt_len:
            return True
        return self._guarded(r, "image embedding", self.runner.images.fill, r.images)

    def _prompt_lps(self, r: _Request, logits, start: int, n: int, end: int) -> None:
        """Add the prompt logprobs of chunk [start, start + n) of `r` (rows end - n .. end of `logits`)."""
        upto = min(start + n, r.prompt_len) - 1  # row t predicts token t + 1
        if upto > start:
            r.prompt_lps += prompt_logprobs(logits[end - n:end - n + upto - start], r.tokens[start + 1:upto + 1],
                                            r.prompt_lp)

    def _choose(self, logits, rows: list[_Request]) -> list:
        """choose_tokens over the sampling rows; should it raise, each row again alone, so only the
        rows that fail by themselves fail."""
        try:
            return choose_tokens(logits, rows)
        except Exception:  # noqa: BLE001 - isolate the row that raises
            log.error("sampling the batch failed; sampling row by row\n%s", traceback.format_exc())
        out = []
        for i, r in enumerate(rows):
            try:
                out += choose_tokens(logits[i:i + 1], [r])
            except Exception as e:  # noqa: BLE001
                out.append(RowFailed(f"sampling failed: {type(e).__name__}: {e}"))
        return out

    # ---- outputs ------------------------------------------------------------------------------
    def _detok(self, r: _Request, out: list[int]) -> str:
        """New text of the generated ids (incremental decoding: only complete characters)."""
        prefix = self.tokenizer.decode(out[r.prefix_offset:r.read_offset])
        new = self.tokenizer.decode(out[r.prefix_offset:])
        if len(new) > len(prefix) and not new.endswith("\ufffd"):
            r.prefix_offset, r.read_offset = r.read_offset, len(out)
            return new[len(prefix):]
        return ""

    def _emit(self, r: _Request, tok: int | None, lp: TokenLogprob | None = None) -> None:
        finish, error, hide, param = None, None, False, None
        if tok is None:
            finish = "length"
        elif r.matcher is not None and not r.matcher.accept(tok):
            finish, error, param = "error", f"grammar: token {tok} rejected: {grammar_reason(r.matcher.error)}", \
                "response_format"
        elif tok in self.eos and not r.ignore_eos:
            finish = "stop"
        elif tok in r.params.stop_token_ids:
            finish, hide = "stop", True  # like EOS: its text is not part of the output
        elif r.matcher is not None and r.matcher.stopped:
            finish = "stop"  # the grammar is complete and cannot continue
        elif len(r.out) >= r.max_tokens:
            finish = "length"
        text = ""
        out = r.out[:-1] if hide else r.out
        if self.tokenizer is not None:
            before = len(r.text)
            r.text += self._detok(r, out)
            if finish is not None and r.read_offset < len(out):  # flush an incomplete tail
                tail = self.tokenizer.decode(out[r.prefix_offset:])
                r.text += tail[len(self.tokenizer.decode(out[r.prefix_offset:r.read_offset])):]
            if r.stop:
                longest = max(len(s) for s in r.stop)
                lo = max(0, before - longest + 1)
                hits = [i for i in (r.text.find(s, lo) for s in r.stop) if i >= 0]
                if hits:
                    r.text = r.text[:min(hits)]
                    finish = "stop"
                hold = 0 if finish is not None else longest - 1  # a stop string may be starting
            else:
                hold = 0
            end = max(r.sent_chars, len(r.text) - hold)
            text, r.sent_chars = r.text[r.sent_chars:end], end
        ids = [] if tok is None else [tok]
        lps = [lp] if lp is not None else None
        plp = None
        if r.prompt_lp is not None:  # once: a preempted request's recompute does not report them again
            plp, r.prompt_lps, r.prompt_lp = r.prompt_lps, [], None
        if finish is None:
            r.handle._push(Output(ids, text, logprobs=lps, prompt_logprobs=plp))
            return
        self.running.remove(r)
        r.seq.free()
        self.counters["finished" if finish != "error" else "errors"] += 1
        r.handle._push(Output(ids, text, finish, error, logprobs=lps, prompt_logprobs=plp, param=param))
        if self.observer is not None:
            self.observer.finish(r.handle, finish)

    def _finish(self, r: _Request, reason: str, error: str | None = None, unavailable: bool = False,
                param: str | None = None) -> None:
        """End a request without a new token (cancelled, error, shutdown) and free its pages."""
        followers, r.followers = r.followers, []  # not forked yet: end them too, or queue them on their own
        for f in reversed(followers):
            self._finish(f, reason, error) if self._stopping else self.waiting.appendleft(f)
        r.seq.free()
        self.counters["cancelled" if reason == "cancelled" else "errors"] += 1
        r.handle._push(Output([], "", reason, error, unavailable, param=param))
        if self.observer is not None:
            self.observer.finish(r.handle, reason)

    def _abort_all(self, reason: str, error: str | None) -> None:
        """End every request (queued ones and their not-forked choices too) with `reason`."""
        self._stopping = True  # no new requests; followers end with their first choice
        with self._lock:
            self.waiting.extend(self._inbox)
            self._inbox.clear()
        for r in self.running + list(self.waiting):
            if r.handle.finish_reason is None:
                self._finish(r, reason, error)
        self.running.clear()
        self.waiting.clear()
