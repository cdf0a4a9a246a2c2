"""The serving engine: one worker thread owns the model and its KV cache and runs continuous batching.

The cache (``model/kv_cache.py``) has ``max_batch_size`` slots of ``max_model_len`` rows. Every scheduler
iteration is ONE compiled call:

* a prefill ([b, W] tokens, the default, ``prefill_tokens`` > 0) while some slot's prompt is not yet written:
  up to b of those slots (first come, first served) write the next W columns of their prompts (W a
  prompt-width bucket, b x W <= ``prefill_tokens``, b a batch bucket below max_batch_size) into their own
  rows; the decoding slots wait for that call. A prompt longer than the widest such W is written in chunks
  (each chunk attends to the rows before it, as a decode step does); a row's logits are sampled once its
  prompt is complete. Pad rows repeat the first row (the same values into the same rows). So a prompt's
  shape never involves the busy slots, and no [max_batch_size, W] graph is compiled (16 x 32 tokens of
  GPT-2 small: ~300 MB of compiled graph and pool, docs/performance.md "Serving");
* else a decode step ([B, 1] tokens): each busy slot places its last sampled token at its own position; or
* with ``prefill_tokens`` 0 (or no batch bucket below max_batch_size), a refill step ([B, W] tokens) when
  requests wait and slots are free: the new prompts are written into their slots' rows 0..n-1 (right padding
  writes rows that later tokens overwrite before anyone attends to them), and in the SAME call every busy slot
  places its last sampled token at its position c (column 0; columns j > 0 write the same token at rows c+j,
  capped at the last row: rows beyond c are overwritten by that slot's own later decode steps before they are
  read). So running requests never pause when others join, at the price of a refill graph per batch bucket.

This works because ``KVCache.step`` takes per-row positions and writes each row's keys/values only at
(slot, position) -- a slot's rows are never touched by another slot's prompt. A call covers the smallest
batch bucket b that holds its rows: with b < max_batch_size the rows name their slots
(``KVCache.step(..., slots=)``; a decode's pad rows use distinct idle slots) and attention reads only those slots.
Compiled shapes: the prefill (or refill) shapes x the batch buckets' decode width 1, one cache length
(max_model_len); ``warm_up`` compiles those of up to ``warmup_tokens`` (batch x width, default
WARM_RUN_TOKENS) before the server reports ready, and larger refill shapes compile on first use (each
compiled graph holds memory, see docs/performance.md "Serving"); after each compile the heap it freed goes
back to the system (``host_memory.release_freed_heap``).
One cache length because a sequence stays in its slot for its whole life (other lengths would mean copying caches between shapes).

Greedy chunks (as ``model.generate``'s ``decode_greedy``): when no request waits, no one joins, every busy
request is greedy (temperature 0) and the batch bucket has at most ``CHUNK_ROWS`` rows (1: a lone request,
where a call's fixed cost weighs most), a decode iteration is instead ONE ``serve/steps.py`` ``SlotGreedySteps``
call of k = ``KVCache.decode_steps`` steps (8 for a 4-layer model, 2 for GPT-2's 12), the argmax on the device
and only [b, k] token ids copied back; the picks are then taken one by one exactly as single steps' picks would
be, and a request's picks after it finished (EOS, a stop string, max_tokens) are discarded. A chunk runs only
while each busy request still needs at least k / 2 tokens, so it wastes at most half its steps; a request that
arrives during a chunk waits for it (k steps). Opt-in, ``GPTLOCAL_SERVE_GREEDY_STEPS=1``: on the busy
machine of 2026-12-01 a chunk of the 16-slot x 256-row cache cost 0.75-1.0x the time of its k single steps
(docs/performance.md "Serving"), so the default stays one step per iteration (the reference path).

Sampling per request reuses ``generation/sampling.next_tokens`` with the request's own options and its
own ``numpy.random.default_rng(seed)``, so a seeded request draws exactly what ``model.generate`` with
that seed draws for the same prompt.
"""
import collections
import itertools
import logging
import os
import threading
import time

import numpy as np

from ..host_memory import release_freed_heap
from ..model.buckets import bucket_of, buckets, width_buckets
from ..model.graph_cache import attach, cached_call
from ..generation.sampling import next_tokens

log = logging.getLogger("gptlocal.serve")
WARM_RUN_TOKENS = 512  # warm-up runs shapes up to this many tokens and only compiles bigger ones
PREFILL_TOKENS = 32  # --max-prefill-tokens: tokens per prefill call (0: refills as one call with the busy rows)
BATCH_FACTOR = 16  # default batch buckets 1, 16, 256, ... ending at max_batch_size: each bucket is a decode graph
# (GPT-2 small: 30-43 MB each) and a burst of clients fills the largest one anyway (docs/performance.md "Serving")
GREEDY_STEPS_ENV = "GPTLOCAL_SERVE_GREEDY_STEPS"  # "1": greedy chunks on (opt-in: no gain measured yet)
CHUNK_ROWS = 1  # greedy chunks are compiled for the batch buckets of up to this many rows (each graph: k steps
# unrolled, ~45 MB and ~5-40 s of compile for a 4-layer model; a wide batch gains least from fewer calls)


class QueueFull(Exception):
    """More requests wait for a slot than --max-queue allows."""


class EngineNotReady(Exception):
    """The model is still loading or warming up (or failed to)."""


class Request:
    """One generation: prompt token ids and options in; events out through ``emit`` (thread-safe callable).

    Events: ("token", text_delta, token_id) per generated token, then ("done", finish_reason, usage dict) or
    ("done", "length", usage, unsent_text_tail) when its ``deadline`` passed while it ran, or ("expired",)
    when the deadline passed while it waited for a slot. Set ``cancelled`` (any thread) to free its slot at
    the next step boundary; set ``deadline`` (``time.perf_counter()`` seconds, any thread) to end it there.
    """
    _ids = itertools.count(1)
    adapter = 0  # which --lora adapter generates it (its index in Engine.lora.names; 0: the base model)

    def __init__(self, prompt, max_tokens, emit, temperature=1.0, top_p=1.0, top_k=0, seed=None, stop=(), eos=()):
        self.id = next(self._ids)
        self.prompt = [int(t) for t in prompt]
        self.max_tokens = int(max_tokens)
        self.emit = emit
        self.options = {"do_sample": temperature > 0, "temperature": float(temperature) if temperature > 0 else 1.0,
                        "top_k": int(top_k), "top_p": float(top_p), "repetition_penalty": 1.0}
        self.rng = np.random.default_rng(seed)
        self.stop = [s for s in stop if s]
        self.eos = set(eos)
        self.tokens = []
        self.sent_text = ""
        self.cancelled = False
        self.arrived = time.perf_counter()
        self.deadline = None


class _Slot:
    __slots__ = ("request", "token", "cursor")

    def __init__(self):
        self.request, self.token, self.cursor = None, 0, 0


def batch_sizes(max_batch_size, given=None):
    """Batch sizes compiled: ``given`` or 1, 16, 256, ... (``BATCH_FACTOR``) always ending at max_batch_size."""
    return buckets(max_batch_size, 1, BATCH_FACTOR, given, minimum=1)


class Engine:
    """Loads the model in its own thread, warms every compiled shape up, then serves ``submit``-ted requests."""

    def __init__(self, model_dir, max_batch_size=8, max_queue=64, max_model_len=None, device_target="CPU",
                 prompt_buckets=None, tokenizer=None, batch_buckets=None, adapters=None, warmup_tokens=None,
                 prefill_tokens=None, compile_cache="off"):
        self.model_dir = model_dir
        self.compile_cache = compile_cache  # --compile-cache: model/graph_cache.py attach, in _load
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.requested_len = max_model_len
        self.device_target = device_target
        self.prompt_buckets = prompt_buckets
        self.warmup_tokens = WARM_RUN_TOKENS if warmup_tokens is None else warmup_tokens
        self.lazy = set()  # (batch, width) refill shapes left to compile on first use
        self.prefill_tokens = PREFILL_TOKENS if prefill_tokens is None else prefill_tokens
        self.prefill_batches = []  # batch buckets of a prefill call ([]: refills with the busy rows), set by _load
        self.prefill_widths = []
        self.batches = batch_sizes(max_batch_size, batch_buckets)
        self.tokenizer = tokenizer
        self.adapters = adapters or []  # [(name, {Linear path: (A, B)}, alpha / r)]: serve/adapters.py
        self.adapter_names = [name for name, _, _ in self.adapters]  # Request.adapter k is adapter_names[k - 1]
        self.lora = None  # model/lora.py MultiLoRA once loaded with adapters
        self.ready = threading.Event()
        self.failed = None
        self.config = None
        self.max_model_len = None
        self.widths = []
        self.warmup_seconds = None
        self.stats = collections.Counter()
        self._pending = collections.deque()
        self._cond = threading.Condition()
        self._slots = [_Slot() for _ in range(max_batch_size)]
        self._stopping = False
        self.chunked = os.environ.get(GREEDY_STEPS_ENV, "0") == "1"
        self._greedy = {}  # batch bucket -> SlotGreedySteps
        self.chunk_rows = CHUNK_ROWS
        self._thread = threading.Thread(target=self._run, name="gptlocal-engine", daemon=True)

    # --- public, any thread -------------------------------------------------------------------------
    def start(self):
        self._thread.start()

    def stop(self, timeout=10):
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def submit(self, request):
        if not self.ready.is_set():
            raise EngineNotReady(self.failed or "the model is loading")
        with self._cond:
            if len(self._pending) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFull(f"{len(self._pending)} requests already wait for a slot (--max-queue "
                                f"{self.max_queue})")
            self._pending.append(request)
            self.stats["accepted"] += 1
            self._cond.notify()

    def snapshot(self):
        with self._cond:
            return {"active": sum(s.request is not None for s in self._slots), "queued": len(self._pending),
                    **{k: self.stats[k] for k in ("accepted", "rejected", "completed", "cancelled", "expired",
                                                  "steps", "greedy_chunks", "mixed_adapter_steps")}}

    # --- worker thread ------------------------------------------------------------------------------
    def _run(self):
        try:
            self._load()
            self.warm_up()
        except Exception as err:  # reported by /health and every request; the thread ends
            self.failed = f"{type(err).__name__}: {err}"
            log.exception("gptlocal serve: loading failed")
            return
        self.ready.set()
        while True:
            with self._cond:
                while not self._stopping and not self._pending and not any(s.request for s in self._slots):
                    self._cond.wait(0.5)
                if self._stopping:
                    return
            self.step()

    def _load(self):
        import mindspore as ms
        from ..model.gpt import GPTLocalForCausalLM
        ms.set_context(mode=ms.GRAPH_MODE, device_target=self.device_target)
        start = time.perf_counter()
        spec = None
        if self.adapters:  # MultiLoRALinears built with the model, on its own base weights
            from ..model.lora import MultiLoRASpec
            spec = MultiLoRASpec(self.adapters, self.max_batch_size)
        self.model = GPTLocalForCausalLM.from_pretrained(self.model_dir, layer_spec=spec,
                                                         max_batch_size=self.max_batch_size)
        self.model.set_train(False)
        attach(self.model, self.compile_cache, self.model_dir)
        if spec is not None:
            self.lora = spec.handle
            self.adapters = spec = None  # the numpy copies: the stacked Parameters hold them now
            log.info("gptlocal serve: %d LoRA adapters on the base; a step mixes requests of different adapters "
                     "(the base GEMM once, each row's low-rank update by its adapter index)", len(self.lora.names) - 1)
        self.config = self.model.config
        limit = self.model.token_positions  # max_position_embeddings less a prefix-tuning prefix
        self.max_model_len = min(self.requested_len or limit, limit)
        self.cache = self.model.kv_cache(self.max_batch_size, self.max_model_len)
        self.max_model_len = self.cache.max_length
        self.widths = width_buckets(self.max_model_len, given=self.prompt_buckets)
        if self.prefill_tokens:  # a prefill call needs a bucket below max_batch_size (else: refills, as before)
            self.prefill_batches = [b for b in self.batches if b < self.max_batch_size]
        if self.prefill_batches:
            self.prefill_widths = [w for w in self.widths if w <= self.prefill_tokens] or self.widths[:1]
        log.info("gptlocal serve: loaded %s in %.1f s (vocab %d, context %d)", self.model_dir,
                 time.perf_counter() - start, self.config.vocab_size, self.max_model_len)

    def warm_up(self):
        """Compile the shapes a request can meet: per batch bucket, one refill graph per prompt width, the
        decode graph and the greedy chunk. Shapes of up to WARM_RUN_TOKENS tokens also run once (writes land
        in idle slots); larger ones up to ``warmup_tokens`` are compiled only (running a 16 x 1024 prefill of
        GPT-2 small takes minutes on a CPU); refill shapes beyond ``warmup_tokens`` are left to their first use
        (``self.lazy``): a compile there pauses every running request once."""
        from ..model.kv_cache import step_inputs
        start = time.perf_counter()
        cache = self.cache
        for batch in self.batches:
            slots = None if batch == self.max_batch_size else list(range(batch))
            for width in self.prompt_widths(batch) + [1]:
                ids = np.zeros((batch, width), np.int32)
                positions = np.tile(np.arange(width, dtype=np.int32), (batch, 1))
                last = np.zeros(batch, np.int32)
                if width > 1 and batch * width > self.warmup_tokens:
                    self.lazy.add((batch, width))
                    continue
                if batch * width <= WARM_RUN_TOKENS:
                    cache.step(ids, positions, last, slots)
                else:
                    cache.compile(*step_inputs(ids, positions, last, slots))
                release_freed_heap()  # what the compile freed, before the next one grows on top of it
            if self.chunked and batch <= self.chunk_rows:
                self._greedy_chunk(np.zeros((batch, 1), np.int32), np.zeros((batch, 1), np.int32), range(batch))
        self.warmup_seconds = time.perf_counter() - start
        log.info("gptlocal serve: buckets batch_sizes=%s cache_length=%d prompt_widths=%s decode_width=1 "
                 "prefill=%s greedy_chunk=%s; warm-up (%d compiled shapes; %d larger shapes compile on first use, "
                 "--warmup-tokens %d) %.1f s", self.batches, self.max_model_len, self.widths,
                 f"{self.prefill_batches} x {self.prefill_widths}, <= {self.prefill_tokens} tokens a call"
                 if self.prefill_batches else "off (refills)",
                 self.cache.decode_steps if self.chunked else "off",
                 sum(len(self.prompt_widths(b)) + 1 for b in self.batches) + len(self._greedy) - len(self.lazy),
                 len(self.lazy), self.warmup_tokens, self.warmup_seconds)

    def prompt_widths(self, batch):
        """The prompt widths compiled at batch bucket ``batch``: every width bucket for refills; for prefills
        (``prefill_tokens``) the widths of at most prefill_tokens with batch x width <= prefill_tokens (batch 1:
        every prefill width), none at max_batch_size."""
        if not self.prefill_batches:
            return list(self.widths)
        if batch not in self.prefill_batches:
            return []
        return [w for w in self.prefill_widths if batch == 1 or batch * w <= self.prefill_tokens]

    def _greedy_chunk(self, ids, positions, rows):
        """k greedy steps of the rows (in cache slots ``rows``) in one compiled call: picks [b, k]."""
        from mindspore import Tensor
        batch = ids.shape[0]
        if batch not in self._greedy:
            from .steps import SlotGreedySteps
            self._greedy[batch] = SlotGreedySteps(self.cache, self.cache.decode_steps)
        return cached_call(self.model, self._greedy[batch], Tensor(ids), Tensor(positions),
                           Tensor(np.asarray(rows, np.int32))).asnumpy()

    def _chunk_fits(self, busy, batch):
        """Whether this decode iteration may be a greedy chunk (module docstring): chunks on, a batch bucket of
        up to ``chunk_rows`` rows, nobody waiting, every busy request greedy and needing at least half a chunk
        more tokens."""
        if not self.chunked or batch > self.chunk_rows or self._pending:
            return False
        half = (self.cache.decode_steps + 1) // 2
        for i in busy:
            request = self._slots[i].request
            if request.options["do_sample"] or request.cancelled or request.max_tokens - len(request.tokens) < half:
                return False
        return self.cache.decode_steps > 1

    def _expire(self):
        """End the requests whose ``deadline`` passed: a running one finishes "length" with what it has (the
        text held back for a possible stop string or a half character goes out with it), a waiting one
        gets ("expired",)."""
        now = time.perf_counter()
        with self._cond:
            for slot in self._slots:
                request = slot.request
                if request is None or request.cancelled or request.deadline is None or now < request.deadline:
                    continue
                text = self._text(request.tokens)
                tail = text[len(request.sent_text):] if text.startswith(request.sent_text) else ""
                usage = {"prompt_tokens": len(request.prompt), "completion_tokens": len(request.tokens),
                         "total_tokens": len(request.prompt) + len(request.tokens)}
                request.emit(("done", "length", usage, tail))
                self.stats["completed"] += 1
                self.stats["expired"] += 1
                self.stats["completion_tokens"] += len(request.tokens)
                slot.request = None
            if any(r.deadline is not None and now >= r.deadline for r in self._pending):
                waiting = collections.deque()
                for request in self._pending:
                    if request.deadline is not None and now >= request.deadline and not request.cancelled:
                        request.emit(("expired",))
                        self.stats["expired"] += 1
                    else:
                        waiting.append(request)
                self._pending = waiting

    def _admit(self):
        """Move waiting requests into free slots; drop cancelled and expired ones."""
        self._expire()
        admitted = []
        with self._cond:
            for index, slot in enumerate(self._slots):
                if slot.request is not None and slot.request.cancelled:
                    self.stats["cancelled"] += 1
                    slot.request = None
                if slot.request is None:
                    while self._pending and self._pending[0].cancelled:
                        self._pending.popleft()
                        self.stats["cancelled"] += 1
                    if self._pending:
                        slot.request = self._pending.popleft()
                        slot.cursor = 0  # prompt tokens written so far (a prefill may take several calls)
                        admitted.append(index)
        return admitted

    def step(self):
        """One scheduler iteration = one compiled call (see the module docstring) over the smallest batch
        bucket that holds every busy slot."""
        admitted = self._admit()
        if self.prefill_batches:
            filling = [i for i, s in enumerate(self._slots)
                       if s.request is not None and s.cursor < len(s.request.prompt)]
            if filling:
                return self._prefill(filling)
            admitted = []  # every admitted prompt was written by earlier prefill calls
        busy = [i for i, s in enumerate(self._slots) if s.request is not None and i not in admitted]
        used = sorted(busy + admitted)
        if not used:  # every request was cancelled or expired
            return
        batch = next(b for b in self.batches if b >= len(used))
        if batch == self.max_batch_size:
            rows = list(range(batch))
        else:  # pad rows go to distinct idle slots, whose rows are rewritten by their next prefill
            idle = [i for i, s in enumerate(self._slots) if s.request is None]
            rows = sorted(used + idle[:batch - len(used)])
        row_of = {slot: r for r, slot in enumerate(rows)}
        last_row = self.max_model_len - 1
        last = np.zeros(batch, np.int32)
        if admitted:
            width = bucket_of(max(len(self._slots[i].request.prompt) for i in admitted), self.widths)
            ids = np.zeros((batch, width), np.int32)
            positions = np.tile(np.arange(width, dtype=np.int32), (batch, 1))
            for i in admitted:
                prompt = self._slots[i].request.prompt
                ids[row_of[i], :len(prompt)] = prompt
                last[row_of[i]] = len(prompt) - 1
            for i in busy:
                slot = self._slots[i]
                ids[row_of[i]] = slot.token
                positions[row_of[i]] = np.minimum(slot.cursor + np.arange(width), last_row)
        else:
            ids = np.zeros((batch, 1), np.int32)
            positions = np.zeros((batch, 1), np.int32)
            for i in busy:
                ids[row_of[i], 0] = self._slots[i].token
                positions[row_of[i], 0] = self._slots[i].cursor
        if self.lora is not None:
            self._select_adapters(rows)
        compiling = admitted and (batch, ids.shape[1]) in self.lazy
        if compiling:
            self.lazy.discard((batch, ids.shape[1]))
            log.info("gptlocal serve: compiling the %d x %d refill shape on its first use (--warmup-tokens %d)",
                     batch, ids.shape[1], self.warmup_tokens)
        if not admitted and self._chunk_fits(busy, batch):
            picks = self._greedy_chunk(ids, positions, rows)
            self.stats["steps"] += 1
            self.stats["greedy_chunks"] += 1
            for column in range(picks.shape[1]):
                for i in busy:
                    if self._slots[i].request is not None:  # not finished by an earlier pick of this chunk
                        self._slots[i].cursor += 1
                        self._take(i, int(picks[row_of[i], column]))
            return
        logits = self.cache.step(ids, positions, last, None if batch == self.max_batch_size else rows)
        if compiling:
            release_freed_heap()
        self.stats["steps"] += 1
        for i in busy:
            self._slots[i].cursor += 1
        for i in admitted:
            self._slots[i].cursor = len(self._slots[i].request.prompt)
        for i in busy + admitted:
            self._advance(i, logits[row_of[i]:row_of[i] + 1])

    def _prefill(self, filling):
        """One prefill call (module docstring): the next chunk of the prompts of up to b of the ``filling`` slots
        (earliest arrival first); rows whose prompt is then complete get their first token."""
        order = sorted(filling, key=lambda i: self._slots[i].request.arrived)
        left = {i: len(self._slots[i].request.prompt) - self._slots[i].cursor for i in order}
        width = bucket_of(min(max(left.values()), self.prefill_widths[-1]), self.prefill_widths)
        fits = [b for b in self.prefill_batches if b == 1 or b * width <= self.prefill_tokens]
        chosen = order[:fits[-1]]
        batch = next(b for b in fits if b >= len(chosen))
        rows = chosen + chosen[:1] * (batch - len(chosen))  # pad rows: the first row again, same writes
        last_row = self.max_model_len - 1
        ids = np.zeros((batch, width), np.int32)
        positions = np.zeros((batch, width), np.int32)
        last = np.zeros(batch, np.int32)
        for r, i in enumerate(rows):
            slot = self._slots[i]
            part = slot.request.prompt[slot.cursor:slot.cursor + width]
            ids[r, :len(part)] = part
            positions[r] = np.minimum(slot.cursor + np.arange(width), last_row)
            last[r] = len(part) - 1
        if self.lora is not None:
            self._select_adapters(rows)
        compiling = (batch, width) in self.lazy
        if compiling:
            self.lazy.discard((batch, width))
            log.info("gptlocal serve: compiling the %d x %d prefill shape on its first use (--warmup-tokens %d)",
                     batch, width, self.warmup_tokens)
        logits = self.cache.step(ids, positions, last, rows)
        if compiling:
            release_freed_heap()
        self.stats["steps"] += 1
        self.stats["prefill_calls"] += 1
        for r, i in enumerate(chosen):
            slot = self._slots[i]
            slot.cursor += min(left[i], width)
            if slot.cursor == len(slot.request.prompt):
                self._advance(i, logits[r:r + 1])

    def _select_adapters(self, rows):
        """Each row's --lora adapter index for the next call (pad rows: the base)."""
        picked = [self._slots[i].request.adapter if self._slots[i].request is not None else 0 for i in rows]
        self.lora.select(picked)
        if len({picked[r] for r, i in enumerate(rows) if self._slots[i].request is not None}) > 1:
            self.stats["mixed_adapter_steps"] += 1

    def _advance(self, index, logits):
        request = self._slots[index].request
        if request.cancelled:
            return
        self._take(index, int(next_tokens(logits, [request.prompt + request.tokens], request.options, request.rng)[0]))

    def _take(self, index, token):
        """The slot's request gets ``token``: emit it, and end the request at EOS, a stop string or its limit."""
        slot = self._slots[index]
        request = slot.request
        if request.cancelled:
            return
        request.tokens.append(token)
        slot.token = token
        finish = None
        if token in request.eos:
            finish = "stop"
            text = self._text(request.tokens[:-1])
        else:
            text = self._text(request.tokens)
            cut = min((p for p in (text.find(s) for s in request.stop) if p >= 0), default=-1)
            if cut >= 0:
                text, finish = text[:cut], "stop"
            elif len(request.tokens) >= request.max_tokens or slot.cursor + 1 >= self.max_model_len:
                finish = "length"
        safe = text if finish else self._settled(text, request.stop)
        delta = ""
        if safe.startswith(request.sent_text):
            delta, request.sent_text = safe[len(request.sent_text):], safe
        request.emit(("token", delta, token))
        if finish:
            usage = {"prompt_tokens": len(request.prompt), "completion_tokens": len(request.tokens),
                     "total_tokens": len(request.prompt) + len(request.tokens)}
            request.emit(("done", finish, usage))
            with self._cond:
                self.stats["completed"] += 1
                self.stats["completion_tokens"] += len(request.tokens)
                slot.request = None

    def _text(self, tokens):
        return self.tokenizer.decode(tokens) if self.tokenizer is not None else ""

    @staticmethod
    def _settled(text, stops):
        """What can be sent now: no half-decoded character at the end, no tail that may start a stop string."""
        text = text.rstrip("\ufffd")
        hold = 0
        for stop in stops:
            for k in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:k]):
                    hold = max(hold, k)
                    break
        return text[:len(text) - hold] if hold else text
