"""The model's KV cache for decoding: one fixed-size key and value buffer per layer, and its indices.

``KVCache`` holds head-major Parameters [batch, kv heads, max_length, head_dim] per layer (kv heads:
``num_query_groups``, = num_attention_heads without grouped-query attention) (owned here,
not by the model's own parameter list, so they never reach a checkpoint) and runs the model's one
forward pass (``GPTLocalModel.construct``) with them: each ``GPTLocalBlock`` writes the step's keys
and values in place with ScatterNdUpdate. Prompts are right-padded to one length P; sequence b's
token at position p is written at cache row p, so every sequence keeps its own positions and
padding is overwritten by later tokens before anyone can attend to it. Two graphs are compiled
per (batch, P, max_length): prefill ([B, P] tokens) and decode ([B, 1] tokens). The cache length
is rounded up to ``CACHE_BUCKET`` rows so nearby lengths share one compiled graph.
"""
import numpy as np
import mindspore as ms
from mindspore import nn, Parameter, Tensor

from .attention import MASK_VALUE

CACHE_BUCKET = 64


def cache_length(needed, limit, bucket=CACHE_BUCKET):
    """Cache rows to allocate: ``needed`` rounded up to a bucket, capped at max_position_embeddings."""
    return min(limit, -(-needed // bucket) * bucket)


class KVCache(nn.Cell):
    """Prefill and one-token decode of ``causal_lm`` over explicit per-layer caches; returns next-token
    logits [B, V]. Get one with ``GPTLocalForCausalLM.kv_cache``, which keeps one per shape."""

    def __init__(self, causal_lm, batch_size, max_length):
        super().__init__()
        config = causal_lm.config
        self.lm = causal_lm
        self.batch_size = batch_size
        self.max_length = max_length
        self.num_heads = config.num_query_groups  # key/value heads: fewer than the query heads with GQA
        shape = (batch_size, self.num_heads, max_length, config.hidden_size // config.num_attention_heads)
        dtype = causal_lm.compute_dtype
        self.key_caches = ms.ParameterTuple(
            [Parameter(Tensor(np.zeros(shape), dtype), name=f"kv_cache.key.{i}", requires_grad=False)
             for i in range(config.num_hidden_layers)])
        self.value_caches = ms.ParameterTuple(
            [Parameter(Tensor(np.zeros(shape), dtype), name=f"kv_cache.value.{i}", requires_grad=False)
             for i in range(config.num_hidden_layers)])

    def construct(self, input_ids, position_ids, write_index, attention_bias, last_index):
        """input_ids/position_ids [B, S]; write_index [B, N, S, 3]; attention_bias [B, 1, S, L];
        last_index [B]: which of the S positions' logits to return."""
        hidden = self.lm.model(input_ids, position_ids, attention_bias, self.key_caches, self.value_caches,
                               write_index)
        return self.lm.last_logits(hidden, last_index)

    def step(self, ids, positions, last_index, slots=None):
        """One compiled call on host arrays: next-token logits [B, V] as numpy float32. ``slots``: the
        cache slot of each of the b <= batch_size rows (default row i = slot i); b < batch_size reads only
        those slots (a server decoding some of its slots, each batch size its own compiled graph)."""
        logits = self(Tensor(ids, ms.int32), Tensor(positions, ms.int32),
                      Tensor(write_index(positions, self.num_heads, slots), ms.int32),
                      Tensor(attention_bias(positions, self.max_length), ms.float32),
                      Tensor(np.asarray(last_index, np.int32), ms.int32))
        return logits.asnumpy()

    def prefill(self, prompts, pad_id=0):
        """Write the right-padded prompts into rows 0..P-1; logits after each prompt's last token."""
        ids, positions, lengths = prefill_inputs(prompts, self.batch_size, pad_id)
        return self.step(ids, positions, lengths - 1)

    def decode(self, tokens, positions):
        """Write one token per sequence at its own position; logits after it."""
        return self.step(np.asarray(tokens, np.int32)[:, None], np.asarray(positions, np.int32)[:, None],
                         np.zeros(self.batch_size))


def prefill_inputs(prompts, batch_size, pad_id):
    """Right-padded prompt block, its positions and each prompt's length."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max())
    ids = np.full((batch_size, width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    positions = np.tile(np.arange(width, dtype=np.int32), (batch_size, 1))
    return ids, positions, lengths


def write_index(positions, num_heads, slots=None):
    """(slot, head, position) triples [B, N, S, 3] for ScatterNdUpdate into [B, N, L, D] caches; slot = row
    unless ``slots`` says otherwise."""
    batch, seq = positions.shape
    rows = np.arange(batch, dtype=np.int32) if slots is None else np.asarray(slots, np.int32)
    b = np.broadcast_to(rows[:, None, None], (batch, num_heads, seq))
    n = np.broadcast_to(np.arange(num_heads, dtype=np.int32)[None, :, None], (batch, num_heads, seq))
    p = np.broadcast_to(positions[:, None, :], (batch, num_heads, seq))
    return np.stack([b, n, p], axis=-1).astype(np.int32)


def attention_bias(query_positions, max_length):
    """[B, 1, S, L]: a query at position p sees cache rows 0..p."""
    keys = np.arange(max_length, dtype=np.int32)[None, None, :]
    allowed = keys <= query_positions[:, :, None]
    return np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)[:, None]
