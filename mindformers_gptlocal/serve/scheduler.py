"""The server's scheduler: which tokens of which requests the next compiled call runs (vLLM v1's split: this
module decides, ``serve/engine.py`` runs the call on the runtime's ``ModelRunner``, then hands the logits back).

The runner's cache has ``max_batch_size`` slots of ``max_model_len`` rows; a request keeps its slot for its whole
life. ``Scheduler.schedule`` admits waiting requests into free slots and returns ONE ``ScheduledCall``:

* a prefill ([b, W] tokens, the default, ``prefill_tokens`` > 0) while some slot's prompt is not yet written:
  up to b of those slots (first come, first served) write the next W columns of their prompts (W a
  prompt-width bucket, b x W <= ``prefill_tokens``, b a batch bucket below max_batch_size) into their own
  rows; the decoding slots wait for that call. A prompt longer than the widest such W is written in chunks
  (each chunk attends to the rows before it, as a decode step does); a row's logits are sampled once its
  prompt is complete. Pad rows repeat the first row (the same values into the same rows). So a prompt's
  shape never involves the busy slots, and no [max_batch_size, W] graph is compiled (each compiled graph holds
  memory: ``python benchmarks/run.py memory --part serve`` shows it phase by phase);
* else a decode step ([B, 1] tokens): each busy slot places its last sampled token at its own position; or
* with ``prefill_tokens`` 0 (or no batch bucket below max_batch_size), a refill step ([B, W] tokens) when
  requests wait and slots are free: the new prompts are written into their slots' rows 0..n-1 (right padding
  writes rows that later tokens overwrite before anyone attends to them), and in the SAME call every busy slot
  places its last sampled token at its position c (column 0; columns j > 0 write the same token at rows c+j,
  capped at the last row: rows beyond c are overwritten by that slot's own later decode steps before they are
  read). So running requests never pause when others join, at the price of a refill graph per batch bucket.

This works because the runner's ``step`` takes per-row positions and writes each row's keys/values only at
(slot, position) -- a slot's rows are never touched by another slot's prompt. A call covers the smallest batch
bucket b that holds its rows: with b < max_batch_size the rows name their slots (a decode's pad rows use distinct
idle slots) and attention reads only those slots.

``Scheduler.update`` takes the call's logits: cursors advance, each row whose prompt is complete samples its
next token (``generation/sampling.next_tokens`` with the request's own options and its own
``numpy.random.default_rng(seed)``, so a seeded request draws exactly what ``model.generate`` with that seed
draws), and its text goes out through the runtime's ``Detokenizer`` (stop strings, hold-back). It ends by
``generation/stopping.StopRule``, the rule ``model.generate`` stops by: EOS, a stop string, its max_tokens (or the
cache's last row).
"""
import collections
import itertools
import threading
import time

import numpy as np

from ..generation.defaults import SERVE as SERVE_DEFAULTS
from ..generation.sampling import next_tokens, sampling_options
from ..generation.stopping import LENGTH, StopRule
from ..runtime.buckets import bucket_of, buckets
from ..runtime.detokenizer import Detokenizer

BATCH_FACTOR = 16  # default batch buckets 1, 16, 256, ... ending at max_batch_size: each bucket is a decode graph
# (each holds memory: docs/performance.md "Serve's lean defaults") and a burst of clients fills the largest one anyway


class QueueFull(Exception):
    """More requests wait for a slot than --max-queue allows."""


class Request:
    """One generation: prompt token ids and options in; events out through ``emit`` (thread-safe callable).

    Events: ("token", text_delta, token_id) per generated token, then ("done", finish_reason, usage dict) or
    ("done", "length", usage, unsent_text_tail) when its ``deadline`` passed while it ran, or ("expired",)
    when the deadline passed while it waited for a slot. Set ``cancelled`` (any thread) to free its slot at
    the next step boundary; set ``deadline`` (``time.perf_counter()`` seconds, any thread) to end it there.
    """
    _ids = itertools.count(1)
    adapter = 0  # which --lora adapter generates it (its index in Engine.lora.names; 0: the base model)

    def __init__(self, prompt, max_tokens, emit, temperature=SERVE_DEFAULTS["temperature"],
                 top_p=SERVE_DEFAULTS["top_p"], top_k=SERVE_DEFAULTS["top_k"], seed=None, stop=(), eos=(),
                 repetition_penalty=SERVE_DEFAULTS["repetition_penalty"]):
        self.id = next(self._ids)
        self.prompt = [int(t) for t in prompt]
        self.max_tokens = int(max_tokens)
        self.emit = emit
        self.options = {**sampling_options(temperature, int(top_k), float(top_p)),
                        "repetition_penalty": float(repetition_penalty)}
        self.rng = np.random.default_rng(seed)
        self.stop = [s for s in stop if s]
        self.eos = set(eos)
        self.rule = None  # its StopRule, once admitted (its budget needs the cache's length)
        self.tokens = []
        self.text = None  # its Detokenizer, once admitted
        self.cancelled = False
        self.arrived = time.perf_counter()
        self.deadline = None


class _Slot:
    __slots__ = ("request", "token", "cursor")

    def __init__(self):
        self.request, self.token, self.cursor = None, 0, 0


class ScheduledCall:
    """One compiled call: ``kind`` (prefill, refill or decode), ``slots`` [batch] (the cache slot of each row, or
    None: rows 0..B-1 are slots 0..B-1), ``width`` (tokens per row) and ``writes``: per row (row, tokens, start,
    last): the tokens written from position ``start`` on (the rest of the row zeros; positions past the cache's
    last row clamp to it), ``last`` the column whose logits come back. ``adapters`` [batch]: each row's --lora
    adapter (pad rows: 0). ``update`` (for ``Scheduler.update``): the slots whose cursor moves and how."""

    def __init__(self, kind, batch, slots, width, writes, adapters, update):
        self.kind, self.batch, self.slots, self.width = kind, batch, slots, width
        self.writes, self.adapters, self.update = writes, adapters, update

    @property
    def shape(self):
        return self.batch, self.width


def batch_sizes(max_batch_size, given=None):
    """Batch sizes compiled: ``given`` or 1, 16, 256, ... (``BATCH_FACTOR``) always ending at max_batch_size."""
    return buckets(max_batch_size, 1, BATCH_FACTOR, given, minimum=1)


class Scheduler:
    """The waiting queue and the cache slots; ``schedule`` picks the next call, ``update`` takes its logits.
    ``decode(tokens) -> str``: the tokenizer's (texts are empty without one). Thread-safe where it must be:
    ``add`` and ``snapshot`` come from request threads, the rest from the engine's worker."""

    def __init__(self, max_batch_size, max_queue, batches, decode=None):
        self.max_batch_size = max_batch_size
        self.max_queue = max_queue
        self.batches = batches
        self.decode = decode or (lambda tokens: "")
        self.max_model_len = None  # set with the shapes, once the model is loaded (``configure``)
        self.widths, self.prefill_batches, self.prefill_widths, self.prefill_tokens = [], [], [], 0
        self.stats = collections.Counter()
        self.cond = threading.Condition()
        self.pending = collections.deque()
        self.slots = [_Slot() for _ in range(max_batch_size)]

    def configure(self, max_model_len, widths, prefill_tokens):
        """The shapes calls may take: the cache length, the prompt width buckets and (``prefill_tokens`` > 0 and a
        batch bucket below max_batch_size) the prefill calls' batches and widths."""
        self.max_model_len, self.widths, self.prefill_tokens = max_model_len, widths, prefill_tokens
        if prefill_tokens:  # a prefill call needs a bucket below max_batch_size (else: refills)
            self.prefill_batches = [b for b in self.batches if b < self.max_batch_size]
        if self.prefill_batches:
            self.prefill_widths = [w for w in widths if w <= prefill_tokens] or widths[:1]

    def prompt_widths(self, batch):
        """The prompt widths a call at batch bucket ``batch`` may take: every width bucket for refills; for
        prefills (``prefill_tokens``) the widths of at most prefill_tokens with batch x width <= prefill_tokens
        (batch 1: every prefill width), none at max_batch_size."""
        if not self.prefill_batches:
            return list(self.widths)
        if batch not in self.prefill_batches:
            return []
        return [w for w in self.prefill_widths if batch == 1 or batch * w <= self.prefill_tokens]

    # --- any thread ---------------------------------------------------------------------------------
    def add(self, request):
        with self.cond:
            if len(self.pending) >= self.max_queue:
                self.stats["rejected"] += 1
                raise QueueFull(f"{len(self.pending)} requests already wait for a slot (--max-queue "
                                f"{self.max_queue})")
            self.pending.append(request)
            self.stats["accepted"] += 1
            self.cond.notify()

    def snapshot(self):
        with self.cond:
            return {"active": sum(s.request is not None for s in self.slots), "queued": len(self.pending),
                    **{k: self.stats[k] for k in ("accepted", "rejected", "completed", "cancelled", "expired",
                                                  "steps", "mixed_adapter_steps")}}

    def has_work(self):
        return bool(self.pending) or any(s.request for s in self.slots)

    # --- the worker ---------------------------------------------------------------------------------
    def schedule(self):
        """The next call (module docstring) over the smallest batch bucket that holds its rows, or None (every
        request was cancelled or expired)."""
        admitted = self._admit()
        if self.prefill_batches:
            filling = [i for i, s in enumerate(self.slots)
                       if s.request is not None and s.cursor < len(s.request.prompt)]
            if filling:
                return self._prefill(filling)
            admitted = []  # every admitted prompt was written by earlier prefill calls
        busy = [i for i, s in enumerate(self.slots) if s.request is not None and i not in admitted]
        used = sorted(busy + admitted)
        if not used:
            return None
        batch = next(b for b in self.batches if b >= len(used))
        if batch == self.max_batch_size:
            rows = list(range(batch))
        else:  # pad rows go to distinct idle slots, whose rows are rewritten by their next prefill
            idle = [i for i, s in enumerate(self.slots) if s.request is None]
            rows = sorted(used + idle[:batch - len(used)])
        row_of = {slot: r for r, slot in enumerate(rows)}
        if admitted:  # a refill: the new prompts, and each busy slot's token repeated from its position on
            width = bucket_of(max(len(self.slots[i].request.prompt) for i in admitted), self.widths)
            writes = [(r, [], 0, 0) for r in range(batch)]
            for i in admitted:
                prompt = self.slots[i].request.prompt
                writes[row_of[i]] = (row_of[i], prompt, 0, len(prompt) - 1)
            for i in busy:
                writes[row_of[i]] = (row_of[i], [self.slots[i].token] * width, self.slots[i].cursor, 0)
        else:
            width = 1
            writes = [(row_of[i], [self.slots[i].token], self.slots[i].cursor, 0) for i in busy]
        update = [(i, row_of[i], "step") for i in busy] + [(i, row_of[i], "prompt") for i in admitted]
        return ScheduledCall("refill" if admitted else "decode", batch,
                             None if batch == self.max_batch_size else rows, width, writes, self._adapters(rows),
                             update)

    def _prefill(self, filling):
        """A prefill call (module docstring): the next chunk of the prompts of up to b of the ``filling`` slots
        (earliest arrival first)."""
        order = sorted(filling, key=lambda i: self.slots[i].request.arrived)
        left = {i: len(self.slots[i].request.prompt) - self.slots[i].cursor for i in order}
        width = bucket_of(min(max(left.values()), self.prefill_widths[-1]), self.prefill_widths)
        fits = [b for b in self.prefill_batches if b == 1 or b * width <= self.prefill_tokens]
        chosen = order[:fits[-1]]
        batch = next(b for b in fits if b >= len(chosen))
        rows = chosen + chosen[:1] * (batch - len(chosen))  # pad rows: the first row again, same writes
        writes = []
        for r, i in enumerate(rows):
            slot = self.slots[i]
            part = slot.request.prompt[slot.cursor:slot.cursor + width]
            writes.append((r, part, slot.cursor, len(part) - 1))
        update = [(i, r, ("chunk", min(left[i], width))) for r, i in enumerate(chosen)]
        return ScheduledCall("prefill", batch, rows, width, writes, self._adapters(rows), update)

    def _adapters(self, rows):
        """Each row's --lora adapter index (pad rows of an idle slot: the base)."""
        picked = [self.slots[i].request.adapter if self.slots[i].request is not None else 0 for i in rows]
        if len({picked[r] for r, i in enumerate(rows) if self.slots[i].request is not None}) > 1:
            self.stats["mixed_adapter_steps"] += 1
        return picked

    def update(self, call, logits):
        """The call's logits [batch, V]: cursors advance; each row whose prompt is now complete samples its next
        token (``_take``)."""
        self.stats["steps"] += 1
        if call.kind == "prefill":
            self.stats["prefill_calls"] += 1
        moved = []
        for index, row, how in call.update:
            slot = self.slots[index]
            if how == "step":
                slot.cursor += 1
            elif how == "prompt":
                slot.cursor = len(slot.request.prompt)
            else:
                slot.cursor += how[1]
            moved.append((index, row))
        for index, row in moved:
            slot = self.slots[index]
            if slot.request is not None and slot.cursor == len(slot.request.prompt) + len(slot.request.tokens):
                self._advance(index, logits[row:row + 1])

    def _advance(self, index, logits):
        request = self.slots[index].request
        if request.cancelled:
            return
        self._take(index, int(next_tokens(logits, [request.prompt + request.tokens], request.options, request.rng)[0]))

    def _take(self, index, token):
        """The slot's request gets ``token``: emit it, and end the request by its ``StopRule`` (EOS, a stop string in
        its text, its budget)."""
        slot = self.slots[index]
        request = slot.request
        request.tokens.append(token)
        slot.token = token
        if request.rule.is_eos(token):  # the reply is the text before it, all of it sent now
            delta = request.text.update(request.tokens[:-1], final=True)
        else:
            delta = request.text.update(request.tokens)
        finish = request.rule.finish(token, len(request.tokens), request.text.stopped)
        if finish == LENGTH:
            delta += request.text.rest()
        request.emit(("token", delta, token))
        if finish:
            request.emit(("done", finish, self._usage(request)))
            with self.cond:
                self.stats["completed"] += 1
                self.stats["completion_tokens"] += len(request.tokens)
                slot.request = None

    @staticmethod
    def _usage(request):
        return {"prompt_tokens": len(request.prompt), "completion_tokens": len(request.tokens),
                "total_tokens": len(request.prompt) + len(request.tokens)}

    def _expire(self):
        """End the requests whose ``deadline`` passed: a running one finishes "length" with what it has (the
        text held back for a possible stop string or a half character goes out with it), a waiting one
        gets ("expired",)."""
        now = time.perf_counter()
        with self.cond:
            for slot in self.slots:
                request = slot.request
                if request is None or request.cancelled or request.deadline is None or now < request.deadline:
                    continue
                request.emit(("done", "length", self._usage(request), request.text.update(request.tokens, final=True)))
                self.stats["completed"] += 1
                self.stats["expired"] += 1
                self.stats["completion_tokens"] += len(request.tokens)
                slot.request = None
            if any(r.deadline is not None and now >= r.deadline for r in self.pending):
                waiting = collections.deque()
                for request in self.pending:
                    if request.deadline is not None and now >= request.deadline and not request.cancelled:
                        request.emit(("expired",))
                        self.stats["expired"] += 1
                    else:
                        waiting.append(request)
                self.pending = waiting

    def _admit(self):
        """Move waiting requests into free slots; drop cancelled and expired ones."""
        self._expire()
        admitted = []
        with self.cond:
            for index, slot in enumerate(self.slots):
                if slot.request is not None and slot.request.cancelled:
                    self.stats["cancelled"] += 1
                    slot.request = None
                if slot.request is None:
                    while self.pending and self.pending[0].cancelled:
                        self.pending.popleft()
                        self.stats["cancelled"] += 1
                    if self.pending:
                        slot.request = request = self.pending.popleft()
                        request.text = Detokenizer(self.decode, request.stop)
                        request.rule = StopRule(request.eos, min(request.max_tokens,
                                                                 self.max_model_len - len(request.prompt)))
                        slot.cursor = 0  # prompt tokens written so far (a prefill may take several calls)
                        admitted.append(index)
        return admitted
