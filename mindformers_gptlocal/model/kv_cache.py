"""The model's KV cache for decoding: storage plus the address of its in-place write (litgpt's ``KVCache``).

``KVCache`` holds head-major Parameters [batch, kv heads, max_length, head_dim] per layer (kv heads:
``num_query_groups``, = num_attention_heads without grouped-query attention), owned here, not by the model's own
parameter list, so they never reach a checkpoint. The model's forward (``GPTLocalModel.construct``) is handed
them: each ``GPTLocalBlock`` writes the step's keys and values in place (``kv_write.py``: on CPU a kernel that
copies only the new rows, O(new tokens); elsewhere ScatterNdUpdate) at ``write_index``, and attention reads the
cache as stored, masked by ``attention_bias`` (a layer's one-token decode step does both inside its one kernel node,
``kernels/cells/decode_layer.py``, at the same addresses, reading rows 0..position). Sequence b's token at position
p is written at row p of its slot, so every sequence keeps its own positions and right padding is overwritten by
later tokens before anyone can attend to it. Both are built inside the graph from the call's positions and slots.

What runs the model over a cache (the compiled prefill, decode and greedy graphs, their compile cache) is the
inference runtime's ``runtime/runner.py``; ``GPTLocalForCausalLM.kv_cache(batch, length)`` hands out its runners
(on CPU the native runner instead, ``runtime/native.py``: the same layout in numpy arrays, no graph).
"""
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor
from mindspore.common.initializer import Zero

from .attention import MASK_VALUE

class KVCache(nn.Cell):
    """Per-layer key and value buffers of ``batch_size`` slots x ``max_length`` rows for ``config``'s model, in
    ``dtype``; ``write_index`` and ``attention_bias``: where a call's keys/values go and which rows it sees."""

    def __init__(self, config, batch_size, max_length, dtype):
        super().__init__(auto_prefix=False)  # the Parameters keep their own names
        arch = config.arch
        self.batch_size = batch_size
        self.max_length = max_length
        self.num_groups = arch.groups  # key/value heads (num_query_groups): fewer than the query heads with GQA
        shape = (batch_size, self.num_groups, max_length, arch.head_dim)
        self.key_caches = ms.ParameterTuple(
            [Parameter(zeros(shape, dtype), name=f"kv_cache.key.{i}", requires_grad=False)
             for i in range(config.num_hidden_layers)])
        self.value_caches = ms.ParameterTuple(
            [Parameter(zeros(shape, dtype), name=f"kv_cache.value.{i}", requires_grad=False)
             for i in range(config.num_hidden_layers)])
        self.head_index = Tensor(np.arange(self.num_groups, dtype=np.int32).reshape(1, -1, 1, 1))
        self.key_rows = Tensor(np.arange(max_length, dtype=np.int32).reshape(1, 1, -1))

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


def zeros(shape, dtype):
    """A zero Tensor whose bytes come from the allocator untouched (a Zero initializer): on CPU the pages of rows
    never written stay unmapped, so a cache costs RSS for the rows its sequences reach, not for its full size
    (reads of unwritten rows see zeros without mapping memory). ``Tensor(np.zeros(shape), dtype)`` writes every
    byte (a float64 array converted)."""
    return Tensor(shape=shape, dtype=dtype, init=Zero())
