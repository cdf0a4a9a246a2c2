"""CachedDecoder: runs a GPTLocalForCausalLM with one fixed-size KV cache per layer.

The caches are head-major Parameters [batch, heads, max_length, head_dim] owned here (not by the model, so they
never reach a checkpoint) and passed to each GPTLocalBlock, which writes the step's keys and
values in place with ScatterNdUpdate. Prompts are right-padded to one length P; sequence b's
token at position p is written at cache row p, so every sequence keeps its own positions and
padding is overwritten by later tokens before anyone can attend to it. Two graphs are
compiled per (batch, P, max_length): prefill ([B, P] tokens) and decode ([B, 1] tokens).
"""
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor

from ..model.attention import MASK_VALUE


class CachedDecoder(nn.Cell):
    """Prefill and one-token decode over explicit per-layer KV caches; returns next-token logits [B, V]."""

    def __init__(self, causal_lm, batch_size, max_length):
        super().__init__()
        config = causal_lm.config
        self.lm = causal_lm
        self.batch_size = batch_size
        self.max_length = max_length
        self.num_layers = config.num_hidden_layers
        dtype = causal_lm.compute_dtype
        self.num_heads = config.num_attention_heads
        shape = (batch_size, self.num_heads, max_length, config.hidden_size // self.num_heads)
        self.key_caches = ms.ParameterTuple(
            [Parameter(Tensor(np.zeros(shape), dtype), name=f"kv_cache.key.{i}", requires_grad=False)
             for i in range(self.num_layers)])
        self.value_caches = ms.ParameterTuple(
            [Parameter(Tensor(np.zeros(shape), dtype), name=f"kv_cache.value.{i}", requires_grad=False)
             for i in range(self.num_layers)])
        self.gather_d = ops.GatherD()

    def construct(self, input_ids, position_ids, write_index, attention_bias, last_index):
        """input_ids/position_ids [B, S]; write_index [B, N, S, 3]; attention_bias [B, 1, S, L];
        last_index [B]: which of the S positions' logits to return."""
        model = self.lm.model
        hidden = model.embedding(input_ids, position_ids)
        for i in range(self.num_layers):
            hidden = model.layers[i](hidden, attention_bias, self.key_caches[i], self.value_caches[i], write_index)
        hidden = model.final_layernorm(hidden)
        batch, _, width = hidden.shape
        index = ops.broadcast_to(ops.reshape(last_index, (batch, 1, 1)), (batch, 1, width))
        last = self.gather_d(hidden, 1, index)  # [B, 1, H]
        return self.lm.logits(last)  # [B, V]


def prefill_inputs(prompts, batch_size, pad_id):
    """Right-padded prompt block and the tensors of the prefill step."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    width = int(lengths.max())
    ids = np.full((batch_size, width), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        ids[row, :len(prompt)] = prompt
    positions = np.tile(np.arange(width, dtype=np.int32), (batch_size, 1))
    return ids, positions, lengths


def write_index(positions, num_heads):
    """(batch, head, position) triples [B, N, S, 3] for ScatterNdUpdate into [B, N, L, D] caches."""
    batch, seq = positions.shape
    b = np.broadcast_to(np.arange(batch, dtype=np.int32)[:, None, None], (batch, num_heads, seq))
    n = np.broadcast_to(np.arange(num_heads, dtype=np.int32)[None, :, None], (batch, num_heads, seq))
    p = np.broadcast_to(positions[:, None, :], (batch, num_heads, seq))
    return np.stack([b, n, p], axis=-1).astype(np.int32)


def attention_bias(query_positions, max_length):
    """[B, 1, S, L]: a query at position p sees cache rows 0..p."""
    keys = np.arange(max_length, dtype=np.int32)[None, None, :]
    allowed = keys <= query_positions[:, :, None]
    return np.where(allowed, 0.0, MASK_VALUE).astype(np.float32)[:, None]


def run_step(decoder, ids, positions, last_index):
    """One compiled call: returns next-token logits [B, V] as numpy float32."""
    logits = decoder(Tensor(ids, ms.int32), Tensor(positions, ms.int32),
                     Tensor(write_index(positions, decoder.num_heads), ms.int32),
                     Tensor(attention_bias(positions, decoder.max_length), ms.float32),
                     Tensor(np.asarray(last_index, np.int32), ms.int32))
    return logits.asnumpy()
