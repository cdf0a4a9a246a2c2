"""The serving engine: one worker thread owns the model and runs continuous batching.

Each iteration is ONE compiled call: the scheduler (``serve/scheduler.py``) says which tokens of which requests
it runs (a ``ScheduledCall``), the engine builds the call's arrays and runs it on the model's ``ModelRunner``
(``runtime/runner.py``: the KV cache and its compiled graphs), and the scheduler takes the logits (sampling,
detokenizing, finishing requests). The model comes from the runtime's one loader (``model/loader.py``).

Compiled shapes: the prefill (or refill) shapes x the batch buckets' decode width 1, one cache length
(max_model_len: a sequence stays in its slot for its whole life, other lengths would mean copying caches between
shapes); ``warm_up`` compiles those of up to ``warmup_tokens`` (batch x width, default WARM_RUN_TOKENS) before the
server reports ready, and larger ones compile on first use (each compiled graph holds memory: docs/performance.md
"Serve's lean defaults", `python benchmarks/run.py memory --part serve`); after each compile the heap it freed goes back to the system
(``host_memory.release_freed_heap``).
"""
import logging
import threading
import time

import numpy as np

from ..host_memory import release_freed_heap
from ..runtime.buckets import width_buckets
from .scheduler import Scheduler, batch_sizes

STEP_PHASES = ("schedule", "model", "update")  # Engine.phase_seconds, /metrics gptlocal_engine_step_seconds

log = logging.getLogger("gptlocal.serve")
WARM_RUN_TOKENS = 512  # warm-up runs shapes up to this many tokens and only compiles bigger ones
PREFILL_TOKENS = 32  # --max-prefill-tokens: tokens per prefill call (0: refills as one call with the busy rows)


class EngineNotReady(Exception):
    """The model is still loading or warming up (or failed to)."""


class Engine:
    """Loads the model in its own thread, warms every compiled shape up, then serves ``submit``-ted requests."""

    def __init__(self, model_dir, max_batch_size=8, max_queue=64, max_model_len=None, device_target="CPU",
                 prompt_buckets=None, tokenizer=None, batch_buckets=None, adapters=None, warmup_tokens=None,
                 prefill_tokens=None, compile_cache="off", compile_cache_bounds=(None, None)):
        self.model_dir = model_dir
        # seconds the engine thread spent in each phase of its steps (read by /metrics): choosing the call and its
        # inputs, the model's call, taking its logits (sampling, detokenizing, sending)
        self.phase_seconds = dict.fromkeys(STEP_PHASES, 0.0)
        self.compile_cache = compile_cache  # --compile-cache: runtime/graph_cache.py attach, in _load
        self.compile_cache_bounds = compile_cache_bounds  # --compile-cache-days, --compile-cache-mb
        from ..runtime.graph_cache import bounds
        bounds(*compile_cache_bounds)  # a bad one: one line before the server starts
        self.max_batch_size = max_batch_size
        self.requested_len = max_model_len
        self.device_target = device_target
        self.prompt_buckets = prompt_buckets
        self.warmup_tokens = WARM_RUN_TOKENS if warmup_tokens is None else warmup_tokens
        self.lazy = set()  # (batch, width) shapes left to compile on first use
        self.prefill_tokens = PREFILL_TOKENS if prefill_tokens is None else prefill_tokens
        self.batches = batch_sizes(max_batch_size, batch_buckets)
        self.tokenizer = tokenizer
        self.adapters = adapters or []  # [(name, {Linear path: (A, B)}, alpha / r)]: serve/adapters.py
        self.adapter_names = [name for name, _, _ in self.adapters]  # Request.adapter k is adapter_names[k - 1]
        self.lora = None  # model/lora_cells.py MultiLoRA once loaded with adapters
        self.scheduler = Scheduler(max_batch_size, max_queue, self.batches,
                                   tokenizer.decode if tokenizer is not None else None)
        self.stats = self.scheduler.stats
        self.ready = threading.Event()
        self.failed = None
        self.config = None
        self.model = self.cache = None
        self.max_model_len = None
        self.warmup_seconds = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="gptlocal-engine", daemon=True)

    widths = property(lambda self: self.scheduler.widths)
    prefill_batches = property(lambda self: self.scheduler.prefill_batches)
    prefill_widths = property(lambda self: self.scheduler.prefill_widths)

    # --- public, any thread -------------------------------------------------------------------------
    def start(self):
        self._thread.start()

    def stop(self, timeout=10):
        with self.scheduler.cond:
            self._stopping = True
            self.scheduler.cond.notify_all()
        self._thread.join(timeout)

    def submit(self, request):
        if not self.ready.is_set():
            raise EngineNotReady(self.failed or "the model is loading")
        self.scheduler.add(request)

    def snapshot(self):
        return self.scheduler.snapshot()

    def prompt_widths(self, batch):
        return self.scheduler.prompt_widths(batch)

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
            with self.scheduler.cond:
                while not self._stopping and not self.scheduler.has_work():
                    self.scheduler.cond.wait(0.5)
                if self._stopping:
                    return
            self.step()

    def _load(self):
        from ..model.loader import load_model
        start = time.perf_counter()
        spec = None
        if self.adapters:  # MultiLoRALinears built with the model, on its own base weights
            from ..model.lora_cells import MultiLoRASpec
            spec = MultiLoRASpec(self.adapters, self.max_batch_size)
        days, max_mb = self.compile_cache_bounds
        self.model = load_model(self.model_dir, self.device_target, self.compile_cache, cache_days=days,
                                cache_mb=max_mb, layer_spec=spec, max_batch_size=self.max_batch_size)
        if spec is not None:
            self.lora = spec.handle
            self.adapters = spec = None  # the numpy copies: the stacked Parameters hold them now
            log.info("gptlocal serve: %d LoRA adapters on the base; a step mixes requests of different adapters "
                     "(the base GEMM once, each row's low-rank update by its adapter index)", len(self.lora.names) - 1)
        self.config = self.model.config
        limit = self.model.token_positions  # max_position_embeddings less a prefix-tuning prefix
        self.cache = self.model.kv_cache(self.max_batch_size, min(self.requested_len or limit, limit))  # the runner
        self.max_model_len = self.cache.max_length
        self.scheduler.configure(self.max_model_len, width_buckets(self.max_model_len, given=self.prompt_buckets),
                                 self.prefill_tokens)
        log.info("gptlocal serve: loaded %s in %.1f s (vocab %d, context %d)", self.model_dir,
                 time.perf_counter() - start, self.config.vocab_size, self.max_model_len)

    def warm_up(self):
        """Compile the shapes a request can meet: per batch bucket, one prefill (or refill) graph per prompt width
        and the decode graph. Shapes of up to WARM_RUN_TOKENS tokens also run once (writes land in idle slots);
        larger ones up to ``warmup_tokens`` are compiled only (running a 16 x 1024 prefill of GPT-2 small takes
        minutes on a CPU); shapes beyond ``warmup_tokens`` are left to their first use (``self.lazy``): a compile
        there pauses every running request once."""
        start = time.perf_counter()
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
                    self.cache.step(ids, positions, last, slots)
                else:
                    self.cache.compile(ids, positions, last, slots)
                release_freed_heap()  # what the compile freed, before the next one grows on top of it
        self.warmup_seconds = time.perf_counter() - start
        log.info("gptlocal serve: buckets batch_sizes=%s cache_length=%d prompt_widths=%s decode_width=1 "
                 "prefill=%s; warm-up (%d compiled shapes; %d larger shapes compile on first use, "
                 "--warmup-tokens %d) %.1f s", self.batches, self.max_model_len, self.widths,
                 f"{self.prefill_batches} x {self.prefill_widths}, <= {self.prefill_tokens} tokens a call"
                 if self.prefill_batches else "off (refills)",
                 sum(len(self.prompt_widths(b)) + 1 for b in self.batches) - len(self.lazy),
                 len(self.lazy), self.warmup_tokens, self.warmup_seconds)

    def step(self):
        """One iteration: the scheduler's next call, run, its logits handed back (each phase's time counted in
        ``phase_seconds``)."""
        start = time.perf_counter()
        call = self.scheduler.schedule()
        if call is None:  # every request was cancelled or expired
            return
        ids, positions, last = self.inputs(call)
        if self.lora is not None:
            self.lora.select(call.adapters)
        compiling = call.kind != "decode" and call.shape in self.lazy
        if compiling:
            self.lazy.discard(call.shape)
            log.info("gptlocal serve: compiling the %d x %d %s shape on its first use (--warmup-tokens %d)",
                     call.batch, call.width, call.kind, self.warmup_tokens)
        called = time.perf_counter()
        logits = self.cache.step(ids, positions, last, call.slots)
        if compiling:
            release_freed_heap()  # the heap its compile freed: part of the model call's cost
        returned = time.perf_counter()
        self.scheduler.update(call, logits)
        phases = self.phase_seconds
        phases["schedule"] += called - start
        phases["model"] += returned - called
        phases["update"] += time.perf_counter() - returned

    def inputs(self, call):
        """The call's token ids and positions [batch, width] and logits columns [batch] (rows without a write:
        zeros, position 0)."""
        ids = np.zeros((call.batch, call.width), np.int32)
        positions = np.zeros((call.batch, call.width), np.int32)
        last = np.zeros(call.batch, np.int32)
        columns = np.arange(call.width, dtype=np.int32)
        for row, tokens, start, column in call.writes:
            ids[row, :len(tokens)] = tokens
            positions[row] = np.minimum(start + columns, self.max_model_len - 1)
            last[row] = column
        return ids, positions, last
