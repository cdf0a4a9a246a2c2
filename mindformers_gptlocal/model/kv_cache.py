"""The model's KV cache for decoding: one fixed-size key and value buffer per layer, and its indices.

``KVCache`` holds head-major Parameters [batch, kv heads, max_length, head_dim] per layer (kv heads:
``num_query_groups``, = num_attention_heads without grouped-query attention) (owned here,
not by the model's own parameter list, so they never reach a checkpoint) and runs the model's one
forward pass (``GPTLocalModel.construct``) with them: each ``GPTLocalBlock`` writes the step's keys
and values in place (``kv_write.py``: on CPU a kernel that copies only the new rows, O(new tokens); elsewhere
ScatterNdUpdate, which on CPU copies the whole cache per write) and attention reads the cache as stored. Prompts are right-padded to a width bucket W
(``width_buckets``: powers of two from 16, ending at the cache length); sequence b's token at
position p is written at cache row p, so every sequence keeps its own positions and padding is
overwritten by later tokens before anyone can attend to it. The per-row write indices and the
attention mask are built inside the graph from the positions (and the rows' cache slots), so a
call's inputs are the token ids, positions, slots and which position's logits to return.

A prefill writes rows 0..W-1 of empty caches, so on CPU its attention is the fused kernel's causal attention over
the W prompt rows (``construct(..., fresh_prefill=True)``), not the plain ops over all L cached rows (``step``, the reference).

Compiled per (batch, max_length): one prefill graph per width bucket, the one-token decode graph
(sampling, repetition penalty) and ``GreedySteps``: ``decode_steps`` greedy steps in ONE call, the
argmax on the device, only token ids coming back (``decode_greedy``). The cache length is rounded
up to ``CACHE_BUCKET`` rows so nearby lengths share one compiled graph.
"""
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common.initializer import Zero

from .buckets import bucket_of, width_buckets
from .attention import MASK_VALUE
from .graph_cache import cached_call

CACHE_BUCKET = 64
STEPS_BUDGET = 32  # decode_steps x layers unrolled in one GreedySteps graph, at most 8 steps


def cache_length(needed, limit, bucket=CACHE_BUCKET):
    """Cache rows to allocate: ``needed`` rounded up to a bucket, capped at max_position_embeddings."""
    return min(limit, -(-needed // bucket) * bucket)


def decode_steps(num_layers):
    """Greedy steps per compiled call: more for shallow models, where a step is mostly call overhead."""
    return max(1, min(8, STEPS_BUDGET // max(int(num_layers), 1)))


class KVCachePool:
    """The KVCaches of one model, one per (batch size, cache length), the ``kept`` most recently used: each
    shape compiles once and stays compiled while it is in use (``GPTLocalForCausalLM.kv_cache``)."""

    def __init__(self, causal_lm, kept):
        self.causal_lm = causal_lm
        self.kept = kept
        self.caches = {}  # (batch, length) -> KVCache, least recently used first

    def get(self, batch_size, needed_length):
        """The KVCache for ``batch_size`` sequences of up to ``needed_length`` tokens (``cache_length``)."""
        key = (batch_size, cache_length(needed_length, self.causal_lm.token_positions))  # less a prefix's rows
        if key not in self.caches:
            while len(self.caches) >= self.kept:  # the least recently used goes
                self.caches.pop(next(iter(self.caches)))
            self.caches[key] = KVCache(self.causal_lm, *key)
        self.caches[key] = self.caches.pop(key)  # now the most recently used
        return self.caches[key]

    def __len__(self):
        return len(self.caches)


class KVCache(nn.Cell):
    """Prefill and one-token decode of ``causal_lm`` over explicit per-layer caches; returns next-token
    logits [B, V]. Get one with ``GPTLocalForCausalLM.kv_cache``, which keeps one per shape (``KVCachePool``)."""

    def __init__(self, causal_lm, batch_size, max_length):
        # auto_prefix=False: holding the model as ``self.lm`` must not rename its Parameters to ``lm.*`` (with
        # the default, a model that had generated could no longer load or save its own checkpoint names)
        super().__init__(auto_prefix=False)
        config = causal_lm.config
        self.lm = causal_lm
        self.batch_size = batch_size
        self.max_length = max_length
        arch = config.arch
        self.num_groups = arch.groups  # key/value heads (num_query_groups): fewer than the query heads with GQA
        self.widths = width_buckets(max_length)
        self.decode_steps = decode_steps(arch.num_hidden_layers)
        shape = (batch_size, self.num_groups, max_length, arch.head_dim)
        dtype = causal_lm.compute_dtype
        self.key_caches = ms.ParameterTuple(
            [Parameter(zeros(shape, dtype), name=f"kv_cache.key.{i}", requires_grad=False)
             for i in range(config.num_hidden_layers)])
        self.value_caches = ms.ParameterTuple(
            [Parameter(zeros(shape, dtype), name=f"kv_cache.value.{i}", requires_grad=False)
             for i in range(config.num_hidden_layers)])
        self.head_index = Tensor(np.arange(self.num_groups, dtype=np.int32).reshape(1, -1, 1, 1))
        self.key_rows = Tensor(np.arange(max_length, dtype=np.int32).reshape(1, 1, -1))
        self._greedy = {}
        # the prefill runs the fused CPU attention kernel over the prompt where every layer has it (not with prefix
        # tuning, whose prefix rows come before the prompt): model/attention.py ParallelAttention._fresh_prefill
        self.fresh_kernel = causal_lm.model.prefix_encoder is None and all(
            getattr(layer.attention, "cpu_attention", None) is not None for layer in causal_lm.model.layers)

    def construct(self, input_ids, position_ids, slots, last_index, fresh_prefill=False):
        """input_ids/position_ids [B, S]; slots [B]: the cache slot of each row; last_index [B]: which of
        the S positions' logits to return. The write indices and the mask are built here, from the positions.
        ``fresh_prefill`` (a constant: its own compiled graph): the call writes positions 0..S-1 of empty rows, so
        attention is causal attention over the S new keys (the model's [1, 1, S, S] mask; the fused CPU kernel in
        ``ParallelAttention._fresh_prefill``), not over all L rows; the same logits as without it."""
        bias = None if fresh_prefill else self.attention_bias(position_ids)  # None: the model's causal mask
        hidden = self.lm.model(input_ids, position_ids, bias, key_caches=self.key_caches,
                               value_caches=self.value_caches, write_index=self.write_index(position_ids, slots),
                               fresh_prefill=fresh_prefill)
        return self.lm.last_logits(hidden, last_index)

    def write_index(self, positions, slots):
        """(slot, key/value head, position) triples [B, G, S, 3]: ScatterNdUpdate's index into the [B, G, L, D]
        caches (G: num_query_groups)."""
        batch, seq = positions.shape
        shape = (batch, self.num_groups, seq, 1)
        rows = ops.broadcast_to(ops.reshape(slots, (batch, 1, 1, 1)), shape)
        heads = ops.broadcast_to(self.head_index, shape)
        rows_at = ops.broadcast_to(ops.reshape(positions, (batch, 1, seq, 1)), shape)
        return ops.concat((rows, heads, rows_at), -1)

    def attention_bias(self, positions):
        """[B, 1, S, L] additive mask: a query at position p sees cache rows 0..p."""
        hidden_rows = ops.greater(self.key_rows, ops.expand_dims(positions, 2))  # [B, S, L]
        return ops.expand_dims(ops.cast(hidden_rows, ms.float32) * MASK_VALUE, 1)

    def step(self, ids, positions, last_index, slots=None):
        """One compiled call on host arrays: next-token logits [B, V] as numpy float32. ``slots``: the
        cache slot of each of the b <= batch_size rows (default row i = slot i); b < batch_size reads only
        those slots (a server decoding some of its slots, each batch size its own compiled graph)."""
        return cached_call(self.lm, self, *step_inputs(ids, positions, last_index, slots)).asnumpy()

    def prefill(self, prompts, pad_id=0):
        """Write the right-padded prompts into rows 0..W-1 (W: the prompt width's bucket); logits after each
        prompt's last token. Where ``fresh_kernel`` holds, as a ``fresh_prefill`` call (the fused CPU attention
        over the W prompt rows only); else through ``step``, the plain path and the reference (attention over all
        L rows, rows W..L-1 masked), which gives the same logits."""
        width = bucket_of(max(len(p) for p in prompts), self.widths)
        ids, positions, lengths = prefill_inputs(prompts, self.batch_size, pad_id, width)
        last = lengths - 1  # the logits after each prompt's last token, not after the padding
        if not self.fresh_kernel:
            return self.step(ids, positions, last)
        return cached_call(self.lm, self, *step_inputs(ids, positions, last), True).asnumpy()

    def decode(self, tokens, positions):
        """Write one token per sequence at its own position; logits after it."""
        return self.step(np.asarray(tokens, np.int32)[:, None], np.asarray(positions, np.int32)[:, None],
                         np.zeros(self.batch_size))

    def decode_greedy(self, tokens, positions, with_logits=False):
        """``decode_steps`` greedy steps in one compiled call: token t_0 [B] is written at ``positions``, each
        next token is the argmax after the previous one, written at the next position. Returns the picked
        tokens [B, decode_steps] (and, with ``with_logits``, the logits [B, decode_steps, V] they came from).
        Positions past the cache's last row are clamped to it: such steps are ones the caller discards."""
        key = bool(with_logits)
        if key not in self._greedy:
            self._greedy[key] = GreedySteps(self, self.decode_steps, key)
        out = cached_call(self.lm, self._greedy[key], Tensor(np.asarray(tokens, np.int32)[:, None]),
                          Tensor(np.asarray(positions, np.int32)[:, None]))
        if with_logits:
            return out[0].asnumpy(), out[1].asnumpy()
        return out.asnumpy()


class GreedySteps(nn.Cell):
    """``steps`` greedy decode steps of a KVCache unrolled in one graph (a fixed count, no control flow on
    values): one call, one [B, steps] copy back, instead of ``steps`` calls each returning [B, V] logits."""

    def __init__(self, cache, steps, with_logits=False):
        super().__init__(auto_prefix=False)  # as KVCache's: the model's Parameters keep their own names
        self.cache = cache
        self.steps = steps
        self.with_logits = with_logits
        self.slots = Tensor(np.arange(cache.batch_size, dtype=np.int32))
        self.last_index = Tensor(np.zeros(cache.batch_size, np.int32))
        self.last_row = cache.max_length - 1
        self.argmax = ops.Argmax(axis=-1, output_type=ms.int32)

    def construct(self, tokens, positions):
        """tokens, positions [B, 1] -> picked tokens [B, steps] (+ their logits [B, steps, V])."""
        picked = ()
        logits_seen = ()
        for _ in range(self.steps):
            logits = self.cache(tokens, ops.minimum(positions, self.last_row), self.slots, self.last_index)
            tokens = ops.expand_dims(self.argmax(logits), 1)
            positions = positions + 1
            picked = picked + (tokens,)
            logits_seen = logits_seen + (ops.expand_dims(logits, 1),)
        if self.with_logits:
            return ops.concat(picked, 1), ops.concat(logits_seen, 1)
        return ops.concat(picked, 1)


def zeros(shape, dtype):
    """A zero Tensor whose bytes come from the allocator untouched (a Zero initializer): on CPU the pages of rows
    never written stay unmapped, so a cache costs RSS for the rows its sequences reach, not for its full size
    (reads of unwritten rows see zeros without mapping memory). ``Tensor(np.zeros(shape), dtype)`` writes every
    byte (a float64 array converted)."""
    return Tensor(shape=shape, dtype=dtype, init=Zero())


def step_inputs(ids, positions, last_index, slots=None):
    """The four Tensors of one KVCache call from host arrays (slots default to rows 0..b-1)."""
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
