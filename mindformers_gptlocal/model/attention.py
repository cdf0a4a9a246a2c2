"""ParallelAttention: GPT-2 causal self-attention with one fused QKV projection.

The fused QKV weight is laid out head-major, [heads, (q, k, v), head_dim] along
its output axis, so a column split over ``model_parallel`` hands every rank whole
heads of Q, K and V; the output projection is then row-parallel.
"""
import math

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor

from ..errors import ConfigError
from ..parallel.sharding import is_parallel_build
from .blockwise_attention import BlockwiseAttention
from .dropout import make_dropout
from .layers import Linear, residual_init_std, to_mstype

MASK_VALUE = -1.0e9


def causal_bias(seq_length):
    """Additive causal mask [1, 1, S, S]: 0 where a token may attend, MASK_VALUE above the diagonal."""
    upper = np.triu(np.ones((seq_length, seq_length), dtype=np.float32), k=1)
    return Tensor((upper * MASK_VALUE)[None, None], ms.float32)


class ParallelAttention(nn.Cell):
    """Causal multi-head self-attention of one layer.

    ``layer_number`` counts from 1; it matters only for GPT-2's optional
    ``scale_attn_by_inverse_layer_idx``. ``use_flash_attention`` selects Ascend's
    fused kernel; it is decided at build time, never inside ``construct``. Elsewhere
    ``model_config.attention_block_size`` > 0 selects ``BlockwiseAttention`` (query blocks, scores
    recomputed in the backward: no [B, N, S, S] tensor kept for the backward), also at build time.
    ``tp_size`` > 1 builds one tensor-parallel rank's part, Megatron-style: heads / tp_size
    local heads, and ``linear_proj`` returns its partial sum without the bias (the bias is
    added after the all-reduce). Used by the CPU proofs; a parallel build keeps tp_size 1
    and lets the ``shard`` strategies (``sharding.py``) split the full Cell.
    """

    def __init__(self, config, layer_number, use_flash_attention=False, tp_size=1, counter_dropout=False):
        super().__init__()
        if config.num_attention_heads % tp_size:
            raise ConfigError(f"model_config.num_attention_heads ({config.num_attention_heads}) is not divisible "
                              f"by parallel_config.model_parallel ({tp_size}); choose a model_parallel that "
                              f"divides the head count.")
        params_dtype = to_mstype(config.params_dtype)
        self.compute_dtype = to_mstype(config.compute_dtype)
        self.softmax_dtype = to_mstype(config.softmax_compute_dtype)
        self.num_heads = config.num_attention_heads // tp_size
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.hidden_size = self.num_heads * self.head_dim  # this rank's width of the context
        scale = 1.0 / math.sqrt(self.head_dim)
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_number)
        self.scale = scale
        self.linear_qkv = Linear(config.hidden_size, 3 * self.hidden_size, config.initializer_range,
                                 params_dtype, self.compute_dtype)
        self.linear_proj = Linear(self.hidden_size, config.hidden_size, residual_init_std(config),
                                  params_dtype, self.compute_dtype, skip_bias_add=tp_size > 1)
        self.attention_dropout = make_dropout(config.attention_dropout, 3 * (layer_number - 1) + 1, config,
                                              counter_dropout)
        self.use_flash_attention = use_flash_attention
        self.blockwise = None
        block_size = getattr(config, "attention_block_size", 0)
        if block_size and not use_flash_attention:
            if is_parallel_build():
                raise ConfigError("model_config.attention_block_size is for stand-alone and data-parallel "
                                  "builds (parallel.parallel_mode 0); under semi_auto/auto parallel set it to 0 "
                                  "(and use_flash_attention: True on Ascend).")
            if config.attention_dropout > 0 and not counter_dropout:
                raise ConfigError("model_config.attention_block_size needs the counter-based dropout masks "
                                  "(model/dropout.py) when model_config.attention_dropout > 0; set "
                                  "attention_dropout to 0 or attention_block_size to 0.")
            self.blockwise_dropout = config.attention_dropout > 0  # then a CounterDropout (checked above)
            self.blockwise = BlockwiseAttention(block_size, scale, self.softmax_dtype, self.compute_dtype,
                                                self.attention_dropout.scale if self.blockwise_dropout else 1.0)
            self.no_keep = Tensor(np.ones((1,), np.bool_))  # "no dropout" for BlockwiseAttention
        self.transpose = ops.Transpose()  # qkv [B, S, N, 3, D] -> [3, B, N, S, D]
        # [3, B, N, S, D] -> query, key, value. Unstack, not qkv[0], qkv[1], qkv[2]: on CPU the three
        # StridedSlices took 42 ms a layer for GPT-2 small at batch 2 x 256, Unstack 4 ms.
        self.split_qkv = ops.Unstack(axis=0)
        self.merge_heads = ops.Transpose()  # context [B, N, S, D] -> [B, S, N, D]
        self.scale_mul = ops.Mul()
        self.qk_matmul = ops.BatchMatMul(transpose_b=True)
        self.pv_matmul = ops.BatchMatMul()
        self.softmax = ops.Softmax(axis=-1)
        self.add_mask = ops.Add()
        self.cast = ops.Cast()
        self.scatter_update = ops.ScatterNdUpdate()
        if use_flash_attention:
            self.flash_attention = ops.operations.nn_ops.FlashAttentionScore(
                head_num=self.num_heads, keep_prob=1.0 - config.attention_dropout, scale_value=scale,
                input_layout="BNSD", sparse_mode=0)
            # Packed rows (actual_seq_len): the variable-length form, as MindFormers' mcore FlashAttention
            # runs it: tokens flattened to [B*S, N, D], cumulative document ends for q and kv, and
            # sparse_mode 3 (causal inside each document, with the compressed 2048 x 2048 mask).
            self.flash_attention_varlen = ops.operations.nn_ops.FlashAttentionScore(
                head_num=self.num_heads, keep_prob=1.0 - config.attention_dropout, scale_value=scale,
                input_layout="TND", sparse_mode=3)
            self.varlen_merge = ops.Transpose()  # [B, N, S, D] -> [B, S, N, D]

    def construct(self, hidden, attention_bias, key_cache=None, value_cache=None, write_index=None,
                  seq_ends=None, dropout_step=None):
        """hidden [B, S, H]; attention_bias additive [1 or B, 1, S, S] (uint8 keep/drop mask for flash).

        With a KV cache (``key_cache``/``value_cache``: this layer's [B, N, L, D] Parameters), the new
        keys and values are written in place at ``write_index`` [B, N, S, 3] = (batch, head, position),
        attention reads all L cached positions (``attention_bias`` is then [B, 1, S, L]), and the
        cache holds the present keys and values afterwards.
        ``seq_ends`` (flash attention only): the packed rows' document ends over the flattened batch
        ([B * docs], see ``GPTLocalModel.document_mask``); attention then never crosses a document.
        ``dropout_step``: picks the attention-dropout mask (``dropout.py``; flash attention drops inside
        its kernel, with the kernel's own random state).
        """
        batch, seq, _ = hidden.shape
        qkv = self.linear_qkv(hidden)
        qkv = ops.reshape(qkv, (batch, seq, self.num_heads, 3, self.head_dim))
        if key_cache is not None:
            return self.linear_proj(self._cached_attention(qkv, attention_bias, key_cache, value_cache,
                                                           write_index))
        qkv = self.transpose(qkv, (3, 0, 2, 1, 4))  # [3, B, N, S, D]
        query, key, value = self.split_qkv(qkv)
        if self.use_flash_attention and seq_ends is not None:
            return self.linear_proj(self._varlen_flash(query, key, value, attention_bias, seq_ends))
        if self.use_flash_attention:
            context = self.flash_attention(query, key, value, None, None, None, attention_bias, None)[3]
        elif self.blockwise is not None:
            context = self.blockwise(query, key, value, attention_bias, self._keep_mask(query, dropout_step))
        else:
            context = self._core_attention(query, key, value, attention_bias, dropout_step)
        context = self.merge_heads(context, (0, 2, 1, 3))
        context = ops.reshape(context, (batch, seq, self.hidden_size))
        return self.linear_proj(context)

    def _keep_mask(self, query, dropout_step):
        """The attention-dropout keep mask [B, N, S, S] the plain path would draw, or ``no_keep``."""
        if not self.blockwise_dropout or not self.attention_dropout.training or dropout_step is None:
            return self.no_keep
        batch, heads, seq, _ = query.shape
        return self.attention_dropout.keep_shape((batch, heads, seq, seq), dropout_step)

    def _varlen_flash(self, query, key, value, attention_mask, seq_ends):
        """Flash attention over packed rows (Ascend only, untested on CPU/GPU): [B, N, S, D] -> [B, S, H]."""
        batch, _, seq, _ = query.shape
        query, key, value = [ops.reshape(self.varlen_merge(x, (0, 2, 1, 3)), (batch * seq, self.num_heads,
                                                                               self.head_dim))
                             for x in (query, key, value)]
        context = self.flash_attention_varlen(query, key, value, None, None, None, attention_mask, None,
                                              seq_ends, seq_ends)[3]
        return ops.reshape(context, (batch, seq, self.hidden_size))

    def _cached_attention(self, qkv, attention_bias, key_cache, value_cache, write_index):
        """Write this step's K/V into the head-major caches [B, N, L, D] in place, then attend over
        every cached row; the caches are read as they are stored, with no per-step transpose."""
        batch, seq = qkv.shape[0], qkv.shape[1]
        qkv = self.transpose(qkv, (3, 0, 2, 1, 4))  # [3, B, N, S, D]
        query, new_key, new_value = self.split_qkv(qkv)
        key_cache = ops.depend(key_cache, self.scatter_update(key_cache, write_index, new_key))
        value_cache = ops.depend(value_cache, self.scatter_update(value_cache, write_index, new_value))
        if batch != key_cache.shape[0]:  # fewer rows than cache slots (serving): read the rows' own slots
            slots = write_index[:, 0, 0, 0]
            key_cache = ops.gather(key_cache, slots, 0)
            value_cache = ops.gather(value_cache, slots, 0)
        context = self._core_attention(query, key_cache, value_cache, attention_bias)
        context = self.merge_heads(context, (0, 2, 1, 3))
        return ops.reshape(context, (batch, seq, self.hidden_size))

    def _core_attention(self, query, key, value, attention_bias, dropout_step=None):
        scores = self.qk_matmul(query, key)
        scores = self.scale_mul(self.cast(scores, self.softmax_dtype), self.scale)
        scores = self.add_mask(scores, self.cast(attention_bias, self.softmax_dtype))
        probs = self.softmax(scores)
        probs = self.attention_dropout(self.cast(probs, self.compute_dtype), dropout_step)
        return self.pv_matmul(probs, value)
