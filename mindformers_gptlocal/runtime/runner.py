"""The model runner: the compiled graphs that run a causal LM over its KV cache, and their compile cache; which runner a
model gets (``runner_for``: this compiled one, or the native one of ``native.py``).

What it reads of the model is its ``Description`` (``model/describe.py``; ``runtime/`` imports nothing of ``model/``),
made once per model when ``GPTLocalForCausalLM.kv_cache`` first asks (``runner_for``), and the model's own forward
(``CachedForward`` calls it).

A ``ModelRunner`` holds one ``model/kv_cache.py`` ``KVCache`` (``Description.new_cache``; storage: ``batch_size`` slots
x ``max_length`` rows) and the two Cells compiled over it:

* ``CachedForward``: the model's one forward pass (``GPTLocalModel.construct``) with the cache, next-token logits
  [B, V] of one chosen position per row. Its inputs are the token ids, positions, the rows' cache slots and which
  position's logits to return: a prompt's prefill ([B, W], W a width bucket: ``buckets.width_buckets``, powers of
  two from 16 up to the cache length), a one-token decode step ([B, 1]), the server's prefill chunks and refills.
  A prefill into empty rows runs as a ``fresh_prefill`` call where every layer has the fused CPU attention kernel
  (``Description.fresh_prefill``, the provider's ``fresh_prefill``; ``KVCacheFusedPrefill``: causal attention over
  the W prompt rows only); ``step`` is the plain path and the reference (attention over all L rows, rows past each
  position masked): the same logits.
  In a one-token step each GPT-2 layer runs as one CPU kernel node where the model built it
  (``GPTLocalBlock.decode_step``, ``kernels/cells/decode_layer.py``): nothing here changes for it.
* ``GreedySteps``: ``decode_steps`` greedy decode steps unrolled in ONE graph over the rows' slots (how many: the
  layers, ``buckets.greedy_steps``), the argmax on the device and only the [B, k] token ids coming
  back (``decode_greedy``, generate's greedy path).

Every call goes through the model's compile cache where it has one (``graph_cache.cached_call``) and runs compiled
whatever MindSpore's global mode (``compiled``: a PyNative caller's, MindSpore's default, runs the same graphs, so
``model.generate`` from a plain script decodes at graph speed with the same tokens). Compiled per (batch, cache
length): the cache length is rounded up to ``CACHE_BUCKET`` rows so nearby lengths share graphs, and
``RunnerPool`` keeps the runners of the ``kept`` most recently used shapes (``GPTLocalForCausalLM.kv_cache``).

Which runner: ``runner_kind``, once per model, from each built layer's facts (``Description.layer_facts``) and the
model's provider (op ``runner`` of ``cpu_kernels``, the kernels it built, ``layer_computes``): on CPU the native runner
(``native.py``: the forward as one C++ call a step, no graph) wherever its C++ layer computes the model's layers, else
these compiled graphs (``cpu_kernels: {runner: plain}`` or ``plain``: the reference; LoRA, adapters, prefix tuning;
other backends). ``RunnerPool.kind`` says which.
"""
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor

from .buckets import bucket_of, greedy_steps, width_buckets
from .graph_cache import cached_call

CACHE_BUCKET = 64
KEPT = 4  # runner shapes (batch, cache length) kept compiled at once per model


def compiled_call(lm, cell, *args):
    """``graph_cache.cached_call(lm, cell, *args)`` in GRAPH mode whatever MindSpore's global mode (a PyNative
    caller's mode is set back after the call): the runner's graphs always run compiled, the same graphs (so the same
    numbers) as from ``gptlocal generate``, which loads in GRAPH mode."""
    mode = ms.get_context("mode")
    if mode == ms.GRAPH_MODE:
        return cached_call(lm, cell, *args)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        return cached_call(lm, cell, *args)
    finally:
        ms.set_context(mode=mode)


def cache_length(needed, limit, bucket=CACHE_BUCKET):
    """Cache rows to allocate: ``needed`` rounded up to a bucket, capped at max_position_embeddings."""
    return min(limit, -(-needed // bucket) * bucket)


def runner_for(causal_lm, batch_size, needed_length, describe):
    """The model's runner (``ModelRunner``, or on CPU the native one: ``RunnerPool.kind``) for ``batch_size``
    sequences of up to ``needed_length`` tokens (its pool, made on first use with ``describe(causal_lm)``, the
    model's ``Description``; ``GPTLocalForCausalLM.kv_cache`` calls this)."""
    pool = causal_lm.__dict__.get("_kv_caches")
    if pool is None:
        pool = RunnerPool(causal_lm, describe(causal_lm), KEPT)
        causal_lm._kv_caches = pool  # pylint: disable=protected-access
    return pool.get(batch_size, needed_length)


def runner_kind(kernels, layers):
    """Which runner ``generate``, ``chat``, ``serve`` and eval's generation run: "native" (``native.py``: the forward
    as one C++ call a step, no graph) or "compiled" (the compiled prefill / decode / greedy graphs). ``kernels``: the
    model's ``KernelProvider``; ``layers``: each built layer's ``DecodeLayerFacts``. Native on CPU under ``runner:
    auto`` or ``kernel`` (``cpu_kernels``), one rank, float32 compute, every layer one the C++ layer computes
    (``KernelProvider.layer_computes``: LayerDrop is an identity there), its Linears holding the weights the provider
    builds (bfloat16 where ``bf16_weights``; float32 or int8 otherwise) and the library built; else compiled
    (``plain``: the reference; LoRA, adapters, prefix tuning, float16 models, other backends)."""
    if not kernels.uses("runner") or not layers:
        return "compiled"
    held = ("bfloat16",) if kernels.bf16_weights else ("float32", "int8")
    for facts in layers:
        if kernels.graph_dtype(facts.compute_dtype) != "float32" or not kernels.layer_computes(facts) or \
                facts.linears not in held:
            return "compiled"
    from ..kernels.abi import build  # pylint: disable=import-outside-toplevel
    return "native" if build.library()[0] is not None else "compiled"


class RunnerPool:
    """The runners of one model, one per (batch size, cache length), the ``kept`` most recently used: each shape
    compiles once and stays compiled while it is in use. ``kind``: "native" or "compiled" (``runner_kind``), chosen
    once here from the model's ``description``."""

    def __init__(self, causal_lm, description, kept):
        self.causal_lm = causal_lm
        self.description = description
        self.kept = kept
        self.caches = {}  # (batch, length) -> ModelRunner or NativeRunner, least recently used first
        self.kind = runner_kind(description.kernels, description.layer_facts)

    def get(self, batch_size, needed_length):
        """The runner for ``batch_size`` sequences of up to ``needed_length`` tokens (``cache_length``)."""
        key = (batch_size, cache_length(needed_length, self.causal_lm.token_positions))  # less a prefix's rows
        if key not in self.caches:
            while len(self.caches) >= self.kept:  # the least recently used goes
                self.caches.pop(next(iter(self.caches)))
            self.caches[key] = self._make(*key)
        self.caches[key] = self.caches.pop(key)  # now the most recently used
        return self.caches[key]

    def _make(self, batch_size, max_length):
        if self.kind == "native":
            from .native import NativeRunner  # pylint: disable=import-outside-toplevel
            return NativeRunner(self.description, batch_size, max_length)
        return ModelRunner(self.causal_lm, self.description, batch_size, max_length)

    def clear(self):
        self.caches.clear()

    def __len__(self):
        return len(self.caches)


class CachedForward(nn.Cell):
    """The model's forward over a ``KVCache``: token ids, positions [B, S], the rows' cache slots [B] and which
    of the S positions' logits to return [B] -> logits [B, V]."""

    def __init__(self, causal_lm, cache):
        # auto_prefix=False: holding the model as ``self.lm`` must not rename its Parameters to ``lm.*`` (with
        # the default, a model that had generated could no longer load or save its own checkpoint names)
        super().__init__(auto_prefix=False)
        self.lm = causal_lm
        self.cache = cache

    def construct(self, input_ids, position_ids, slots, last_index, fresh_prefill=False):
        """``fresh_prefill`` (a constant: its own compiled graph): the call writes positions 0..S-1 of empty rows,
        so attention is causal attention over the S new keys (the model's [1, 1, S, S] mask; the fused CPU kernel
        in ``KVCacheFusedPrefill``), not over all L rows; the same logits as without it."""
        bias = None if fresh_prefill else self.cache.attention_bias(position_ids)  # None: the model's causal mask
        hidden = self.lm.model(input_ids, position_ids, bias, key_caches=self.cache.key_caches,
                               value_caches=self.cache.value_caches,
                               write_index=self.cache.write_index(position_ids, slots), fresh_prefill=fresh_prefill)
        return self.lm.last_logits(hidden, last_index)


class GreedySteps(nn.Cell):
    """``steps`` greedy decode steps of a ``CachedForward`` unrolled in one graph (a fixed count, no control flow
    on values): tokens, positions [b, 1] and the rows' cache slots [b] -> picked tokens [b, steps] (+ their logits
    [b, steps, V] ``with_logits``, bound here: ``picks``). Positions past the cache's last row are clamped to it:
    such steps are ones the caller discards."""

    def __init__(self, forward, steps, with_logits=False):
        super().__init__(auto_prefix=False)  # as CachedForward's: the model's Parameters keep their own names
        self.step_cell = forward
        self.steps = steps
        self.with_logits = with_logits
        self.last_row = forward.cache.max_length - 1
        self.argmax = ops.Argmax(axis=-1, output_type=ms.int32)
        self.picks = self._tokens_and_logits if with_logits else self._tokens

    def construct(self, tokens, positions, slots):
        last_index = ops.zeros_like(slots)
        picked = ()
        logits_seen = ()
        for _ in range(self.steps):
            logits = self.step_cell(tokens, ops.minimum(positions, self.last_row), slots, last_index)
            tokens = ops.expand_dims(self.argmax(logits), 1)
            positions = positions + 1
            picked = picked + (tokens,)
            logits_seen = logits_seen + (ops.expand_dims(logits, 1),)
        return self.picks(picked, logits_seen)

    def _tokens(self, picked, logits_seen):  # pylint: disable=unused-argument
        return ops.concat(picked, 1)

    def _tokens_and_logits(self, picked, logits_seen):
        return ops.concat(picked, 1), ops.concat(logits_seen, 1)


class ModelRunner:
    """Prefill, one-token decode and greedy multi-step decode of ``causal_lm`` over a cache of ``batch_size``
    slots x ``max_length`` rows, on host arrays; logits come back as numpy float32 [B, V]."""

    def __init__(self, causal_lm, description, batch_size, max_length):
        self.lm = causal_lm
        self.cache = description.new_cache(batch_size, max_length)
        self.forward = CachedForward(causal_lm, self.cache)
        self.batch_size = batch_size
        self.max_length = max_length
        self.widths = width_buckets(max_length)
        self.decode_steps = greedy_steps(len(description.layers))  # how many steps a greedy graph unrolls
        self._greedy = {}  # with_logits -> GreedySteps
        # the prefill runs the fused CPU attention kernel over the prompt where the model built it in every layer
        # (the kernel provider's choice, kernels/provider.py; never with prefix tuning): Description.fresh_prefill;
        # the prefill's call is picked here
        self.fresh_kernel = description.fresh_prefill
        self._prefill_call = self._prefill_fresh_graph if self.fresh_kernel else self._prefill_step

    # the storage, for callers that read it
    key_caches = property(lambda self: self.cache.key_caches)
    value_caches = property(lambda self: self.cache.value_caches)
    num_groups = property(lambda self: self.cache.num_groups)
    compile_cache = property(lambda self: self.forward.compile_cache, doc="MindSpore's compiled forward graphs")

    def step(self, ids, positions, last_index, slots=None):
        """One compiled call on host arrays: next-token logits [B, V] as numpy float32. ``slots``: the cache slot
        of each of the b <= batch_size rows (default row i = slot i); b < batch_size reads only those slots (a
        server decoding some of its slots, each batch size its own compiled graph)."""
        return compiled_call(self.lm, self.forward, *step_inputs(ids, positions, last_index, slots)).asnumpy()

    def compile(self, ids, positions, last_index, slots=None):
        """Compile the ``step`` graph of these shapes without running it (in GRAPH mode, as ``compiled_call``)."""
        mode = ms.get_context("mode")
        ms.set_context(mode=ms.GRAPH_MODE)
        try:
            self.forward.compile(*step_inputs(ids, positions, last_index, slots))
        finally:
            ms.set_context(mode=mode)

    def prefill(self, prompts, pad_id=0):
        """Write the right-padded prompts into rows 0..W-1 (W: the prompt width's bucket); logits after each
        prompt's last token. Where ``fresh_kernel`` holds, as a ``fresh_prefill`` call (the fused CPU attention
        over the W prompt rows only); else through ``step``, the plain path and the reference (attention over all
        L rows, rows W..L-1 masked), which gives the same logits."""
        width = bucket_of(max(len(p) for p in prompts), self.widths)
        ids, positions, lengths = prefill_inputs(prompts, self.batch_size, pad_id, width)
        return self._prefill_call(ids, positions, lengths - 1)  # the logits after each prompt's last token

    def _prefill_step(self, ids, positions, last):
        return self.step(ids, positions, last)

    def _prefill_fresh_graph(self, ids, positions, last):
        return compiled_call(self.lm, self.forward, *step_inputs(ids, positions, last), True).asnumpy()

    def decode(self, tokens, positions):
        """Write one token per sequence at its own position; logits after it."""
        return self.step(np.asarray(tokens, np.int32)[:, None], np.asarray(positions, np.int32)[:, None],
                         np.zeros(self.batch_size))

    def decode_greedy(self, tokens, positions, with_logits=False):
        """``decode_steps`` greedy steps in one compiled call: token t_0 [B] is written at ``positions``, each
        next token is the argmax after the previous one, written at the next position. Returns the picked
        tokens [B, decode_steps] (and, with ``with_logits``, the logits [B, decode_steps, V] they came from)."""
        key = bool(with_logits)
        if key not in self._greedy:
            self._greedy[key] = GreedySteps(self.forward, self.decode_steps, key)
        tokens = np.asarray(tokens, np.int32)
        out = compiled_call(self.lm, self._greedy[key], Tensor(tokens[:, None]),
                          Tensor(np.asarray(positions, np.int32)[:, None]),
                          Tensor(np.arange(tokens.shape[0], dtype=np.int32)))
        if with_logits:
            return out[0].asnumpy(), out[1].asnumpy()
        return out.asnumpy()


def step_inputs(ids, positions, last_index, slots=None):
    """The four Tensors of one ``CachedForward`` call from host arrays (slots default to rows 0..b-1)."""
    ids = np.asarray(ids, np.int32)
    slots = np.arange(ids.shape[0], dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
    return (Tensor(ids, ms.int32), Tensor(np.asarray(positions, np.int32), ms.int32), Tensor(slots, ms.int32),
            Tensor(np.asarray(last_index, np.int32), ms.int32))


def prefill_inputs(prompts, batch_size, pad_id, width=None):
    """Right-padded prompt block (``width`` columns, default the longest prompt), its positions and each
    prompt's length."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max()) if width is None else width
    ids = np.full((batch_size, width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    positions = np.tile(np.arange(width, dtype=np.int32), (batch_size, 1))
    return ids, positions, lengths
