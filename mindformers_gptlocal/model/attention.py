"""ParallelAttention: causal self-attention (GPT-2's; GQA and rope by ``config.arch``) with one fused QKV projection.

The fused QKV weight is laid out head-major, [heads, (q, k, v), head_dim] along
its output axis, so a column split over ``model_parallel`` hands every rank whole
heads of Q, K and V; the output projection is then row-parallel.

Grouped-query attention (``num_query_groups`` < heads) keeps one fused weight, group-major:
[groups, (the group's heads/groups query heads, k, v), head_dim] (for one head per group that is
the layout above), so the same column split hands every rank whole groups. Keys and values have
``num_query_groups`` heads (the KV cache stores that many); each is repeated over its group's query
heads just before the attention product. Rotary embeddings (``position_embedding_type: rope``) turn
the first ``rotary_dim`` channels of every query and key head, Hugging Face's rotate_half form
(Llama, NeoX), from the per-row positions the model hands in (``RotaryEmbedding``).
"""
import math

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Tensor

from ..errors import ConfigError
from ..parallel.sharding import is_parallel_build
from .blockwise_attention import BlockwiseAttention
from .dropout import dropout_site, make_dropout
from .layers import Linear, kernel_provider, residual_init_std, to_mstype
from ..peft.prefix_cells import PrefixConcat, prefix_rows

MASK_VALUE = -1.0e9


_PLAIN_WARNED = set()


def _plain_for_prefix(what):
    """One warning per process: prefix tuning runs the plain attention path instead of ``what``."""
    if what not in _PLAIN_WARNED:
        _PLAIN_WARNED.add(what)
        import warnings
        warnings.warn(f"gpt_local: pet_config prefix tuning uses the plain matmul + softmax attention, not {what} "
                      f"(built for square masks; the prefix adds key rows in front).", stacklevel=3)


class RotaryEmbedding(nn.Cell):
    """cos and sin [B, 1, S, rotary_dim] of the positions [B, S] (each row its own positions, so ragged
    batches and packed rows rotate by their own offsets), computed in float32 as Hugging Face does."""

    def __init__(self, rotary_dim, base):
        super().__init__()
        exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
        inv_freq = (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)
        self.inv_freq = Tensor(inv_freq[None, None, :], ms.float32)

    def construct(self, position_ids):
        freqs = ops.expand_dims(ops.cast(position_ids, ms.float32), -1) * self.inv_freq  # [B, S, rot/2]
        emb = ops.expand_dims(ops.concat((freqs, freqs), -1), 1)  # [B, 1, S, rot]
        return ops.cos(emb), ops.sin(emb)


class ParallelAttention(nn.Cell):
    """Causal multi-head self-attention of one layer.

    ``layer_number`` counts from 1; it picks the dropout site and matters for GPT-2's optional
    ``scale_attn_by_inverse_layer_idx``. ``use_flash_attention`` selects Ascend's
    fused kernel; it is decided at build time, never inside ``construct``. Elsewhere
    ``model_config.attention_block_size`` > 0 selects ``BlockwiseAttention`` (query blocks, scores
    recomputed in the backward: no [B, N, S, S] tensor kept for the backward), also at build time.
    On CPU with neither, the fused C++ kernel (``kernels/attention.py`` ``CPUAttention``: forward and backward
    flash-style, no [B, N, S, S] buffer at all) replaces the plain matmul + softmax path where the model's
    ``KernelProvider`` (``kernels``) gives it (``_cpu_attention_kernel``). On the KV-cache path a prefill into empty
    rows runs that kernel over the prompt (``_fresh_prefill``); other cached calls keep the plain
    ``_core_attention`` over all L rows.
    A parallel build lets the ``shard`` strategies (``sharding.py``) split the full Cell; the CPU proofs of
    tensor parallel build one rank's part in the tests (tests/references.py ``rank_block``).
    """

    def __init__(self, config, layer_number, use_flash_attention=False, counter_dropout=False, layer_spec=None,
                 kernels=None):
        super().__init__()
        kernels = kernels or kernel_provider(config)
        arch = config.arch
        linear = (layer_spec or {}).get  # the layer spec's Linear class per path (layer_spec.py), else Linear
        # prefix tuning (model/prefix.py): prefix rows in front of the keys; the plain matmul + softmax path takes
        # them, the fused kernels (CPU kernel, blockwise, Ascend flash) are built for square masks: not used then
        self.prefix = config.prefix_spec() is not None
        if self.prefix:  # its Concats, sharded over the key/value groups (parallel/sharding.py block_rules)
            self.prefix_concat = PrefixConcat()
        if self.prefix and (use_flash_attention or config.attention_block_size):
            _plain_for_prefix("use_flash_attention / attention_block_size")
            use_flash_attention = False
        params_dtype = to_mstype(config.params_dtype)
        self.compute_dtype = to_mstype(config.compute_dtype)
        self.softmax_dtype = to_mstype(config.softmax_compute_dtype)
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        self.hidden_size = self.num_heads * self.head_dim  # the context's width
        self.num_groups = arch.groups  # key/value heads
        self.group_size = arch.group_size  # query heads per key/value head
        self.rotary_dim = arch.rotary_dim  # 0: learned absolute positions, nothing to turn
        scale = 1.0 / math.sqrt(self.head_dim)
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_number)
        self.scale = scale
        self.linear_qkv = linear("attention.linear_qkv", Linear)(
            config.hidden_size, (self.num_heads + 2 * self.num_groups) * self.head_dim, config.initializer_range,
            params_dtype, self.compute_dtype, has_bias=arch.qkv_bias, kernels=kernels)
        self.linear_proj = linear("attention.linear_proj", Linear)(
            self.hidden_size, config.hidden_size, residual_init_std(config), params_dtype, self.compute_dtype,
            has_bias=arch.bias, kernels=kernels)
        self.attention_dropout = make_dropout(config.attention_dropout, dropout_site(layer_number, "attention_probs"),
                                              config, counter_dropout)
        self.use_flash_attention = use_flash_attention
        self.blockwise = None
        block_size = config.attention_block_size
        if block_size and not use_flash_attention and not self.prefix:
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
        self.cpu_attention = self._cpu_attention_kernel(config, counter_dropout, kernels)
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
        # CPU: the mask broadcast to the scores' shape before the Add, as Linear's bias (less peak memory than
        # the broadcasting Add: 548 -> 403 MB a layer for GPT-2 small's training step at 1 x 1024)
        self.broadcast_mask = kernels.composed_ops()
        self.cast = ops.Cast()
        self.scatter_update = kernels.kv_write()  # the KV-cache write: in place on CPU (kernels/kv_write.py)
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

    def _cpu_attention_kernel(self, config, counter_dropout, kernels):
        """The fused CPU kernel (``kernels/attention.py``) in place of the plain matmul + softmax path, or None.

        Where ``kernels`` gives it (CPU, stand-alone and data-parallel builds, ``cpu_kernels`` not ``plain``), unless
        ``attention_block_size`` > 0 (BlockwiseAttention asked for by name), attention dropout without the
        counter masks, or the kernel cannot run (not float32, no compiler: one warning, then the plain path)."""
        if self.use_flash_attention or self.blockwise is not None or not kernels.uses("attention"):
            return None
        if self.prefix:
            _plain_for_prefix("the fused CPU attention kernel (kernels/attention.py)")
            return None
        if not 0.0 <= config.attention_dropout < 1.0:
            return None
        dropout = config.attention_dropout > 0
        if dropout and not counter_dropout:
            return None
        dtype = self.compute_dtype if self.softmax_dtype == ms.float32 else self.softmax_dtype
        return kernels.attention(self.scale, dtype, self.attention_dropout if dropout else None)

    def construct(self, hidden, attention_bias, key_cache=None, value_cache=None, write_index=None,
                  seq_ends=None, dropout_step=None, rotary=None, prefix=None, fresh_prefill=False):
        """hidden [B, S, H]; attention_bias additive [1 or B, 1, S, S] (uint8 keep/drop mask for flash).
        ``prefix``: (keys, values) [G, P, D] of prefix tuning, read in front of the keys and values by every
        query (``prefix.prefix_rows``), with and without the KV cache.

        With a KV cache (``key_cache``/``value_cache``: this layer's [B, N, L, D] Parameters), the new
        keys and values are written in place at ``write_index`` [B, N, S, 3] = (batch, head, position)
        (``KernelProvider.kv_write``: ScatterNdUpdate's inputs and values, O(new tokens) on CPU),
        attention reads all L cached positions (``attention_bias`` is then [B, 1, S, L]), and the
        cache holds the present keys and values afterwards.
        ``fresh_prefill`` (a build-time constant, ``KVCache.prefill``'s graph): the call writes positions 0..S-1 of
        every row and no cached row comes before them, so attention is the plain causal attention over the S new
        keys (``attention_bias`` then [1, 1, S, S]); with the fused CPU kernel it runs there, not over all L rows.
        ``seq_ends`` (flash attention only): the packed rows' document ends over the flattened batch
        ([B * docs], see ``GPTLocalModel.document_mask``); attention then never crosses a document.
        ``dropout_step``: picks the attention-dropout mask (``dropout.py``; flash attention drops inside
        its kernel, with the kernel's own random state).
        ``rotary``: (cos, sin) [B, 1, S, rotary_dim] of the tokens' positions (``RotaryEmbedding``), with rope.
        """
        batch, seq, _ = hidden.shape
        qkv = self.linear_qkv(hidden, dropout_step)  # the step: LoRA's input dropout, if any
        qkv = ops.reshape(qkv, (batch, seq, self.num_groups, self.group_size + 2, self.head_dim))
        if key_cache is not None:
            if fresh_prefill and self.cpu_attention is not None and prefix is None:
                return self.linear_proj(self._fresh_prefill(qkv, attention_bias, key_cache, value_cache,
                                                            write_index, rotary))
            return self.linear_proj(self._cached_attention(qkv, attention_bias, key_cache, value_cache,
                                                           write_index, rotary, prefix))
        query, key, value = self._heads(qkv, rotary)
        if prefix is not None:
            key, value, attention_bias = prefix_rows(key, value, attention_bias, prefix[0], prefix[1],
                                                     self.prefix_concat)
        if self.cpu_attention is not None:  # key/value stay [B, G, S, D]: the kernel reads each group's head
            context = self.cpu_attention(query, key, value, self.cast(attention_bias, ms.float32),
                                         self._dropout_offsets(dropout_step))
            context = self.merge_heads(context, (0, 2, 1, 3))
            return self.linear_proj(ops.reshape(context, (batch, seq, self.hidden_size)), dropout_step)
        key, value = self._repeat_groups(key), self._repeat_groups(value)
        if self.use_flash_attention and seq_ends is not None:
            return self.linear_proj(self._varlen_flash(query, key, value, attention_bias, seq_ends), dropout_step)
        if self.use_flash_attention:
            context = self.flash_attention(query, key, value, None, None, None, attention_bias, None)[3]
        elif self.blockwise is not None:
            context = self.blockwise(query, key, value, attention_bias, self._keep_mask(query, dropout_step))
        else:
            context = self._core_attention(query, key, value, attention_bias, dropout_step)
        context = self.merge_heads(context, (0, 2, 1, 3))
        context = ops.reshape(context, (batch, seq, self.hidden_size))
        return self.linear_proj(context, dropout_step)

    def _dropout_offsets(self, dropout_step):
        """The counter dropout's table offsets of this step for the CPU kernel, or None (no dropout now)."""
        if not self.cpu_attention.has_dropout or not self.attention_dropout.training or dropout_step is None:
            return None
        return self.attention_dropout.offsets(dropout_step)

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

    def _heads(self, qkv, rotary):
        """[B, S, G, group + 2, D] -> query [B, N, S, D], key and value [B, G, S, D], rotary applied."""
        if self.group_size == 1:
            qkv = self.transpose(qkv, (3, 0, 2, 1, 4))  # [3, B, N, S, D]
            query, key, value = self.split_qkv(qkv)
        else:
            batch, seq = qkv.shape[0], qkv.shape[1]
            query, key, value = ops.split(qkv, [self.group_size, 1, 1], axis=3)
            query = ops.transpose(ops.reshape(query, (batch, seq, self.num_heads, self.head_dim)), (0, 2, 1, 3))
            key = ops.transpose(ops.reshape(key, (batch, seq, self.num_groups, self.head_dim)), (0, 2, 1, 3))
            value = ops.transpose(ops.reshape(value, (batch, seq, self.num_groups, self.head_dim)), (0, 2, 1, 3))
        if self.rotary_dim:
            query, key = self._rotate(query, rotary), self._rotate(key, rotary)
        return query, key, value

    def _rotate(self, x, rotary):
        """Rotary embedding on the first rotary_dim channels of x [B, heads, S, D] (HF's rotate_half)."""
        cos, sin = self.cast(rotary[0], x.dtype), self.cast(rotary[1], x.dtype)
        half = self.rotary_dim // 2
        turned = x if self.rotary_dim == self.head_dim else x[..., :self.rotary_dim]
        rotated = ops.concat((-turned[..., half:], turned[..., :half]), -1)
        turned = turned * cos + rotated * sin
        if self.rotary_dim == self.head_dim:
            return turned
        return ops.concat((turned, x[..., self.rotary_dim:]), -1)

    def _repeat_groups(self, x):
        """[B, G, L, D] -> [B, N, L, D]: each key/value head repeated over its group's query heads."""
        if self.group_size == 1:
            return x
        batch, _, length, dim = x.shape
        x = ops.broadcast_to(ops.expand_dims(x, 2), (batch, self.num_groups, self.group_size, length, dim))
        return ops.reshape(x, (batch, self.num_heads, length, dim))

    def _fresh_prefill(self, qkv, attention_bias, key_cache, value_cache, write_index, rotary=None):
        """A prefill with no cached row before it (positions 0..S-1): the fused kernel's causal attention over the S
        new keys/values ([B, G, S, D], GQA read in the kernel), which are also written into the caches; the plain
        path (``_cached_attention``) attends over all L rows with rows S..L-1 masked: the same values."""
        batch, seq = qkv.shape[0], qkv.shape[1]
        query, new_key, new_value = self._heads(qkv, rotary)
        wrote_key = self.scatter_update(key_cache, write_index, new_key)
        wrote_value = self.scatter_update(value_cache, write_index, new_value)
        context = self.cpu_attention(query, new_key, new_value, self.cast(attention_bias, ms.float32))
        context = ops.depend(ops.depend(context, wrote_key), wrote_value)
        context = self.merge_heads(context, (0, 2, 1, 3))
        return ops.reshape(context, (batch, seq, self.hidden_size))

    def _cached_attention(self, qkv, attention_bias, key_cache, value_cache, write_index, rotary=None, prefix=None):
        """Write this step's K/V into the head-major caches [B, G, L, D] in place (G = num_query_groups),
        then attend over every cached row; the caches are read as they are stored, with no per-step transpose."""
        batch, seq = qkv.shape[0], qkv.shape[1]
        query, new_key, new_value = self._heads(qkv, rotary)
        key_cache = ops.depend(key_cache, self.scatter_update(key_cache, write_index, new_key))
        value_cache = ops.depend(value_cache, self.scatter_update(value_cache, write_index, new_value))
        if batch != key_cache.shape[0]:  # fewer rows than cache slots (serving): read the rows' own slots
            slots = write_index[:, 0, 0, 0]
            key_cache = ops.gather(key_cache, slots, 0)
            value_cache = ops.gather(value_cache, slots, 0)
        if prefix is not None:
            key_cache, value_cache, attention_bias = prefix_rows(key_cache, value_cache, attention_bias, *prefix,
                                                                 self.prefix_concat)
        key_cache, value_cache = self._repeat_groups(key_cache), self._repeat_groups(value_cache)
        context = self._core_attention(query, key_cache, value_cache, attention_bias)
        context = self.merge_heads(context, (0, 2, 1, 3))
        return ops.reshape(context, (batch, seq, self.hidden_size))

    def _core_attention(self, query, key, value, attention_bias, dropout_step=None):
        scores = self.qk_matmul(query, key)
        scores = self.scale_mul(self.cast(scores, self.softmax_dtype), self.scale)
        bias = self.cast(attention_bias, self.softmax_dtype)
        scores = self.add_mask(scores, ops.broadcast_to(bias, scores.shape) if self.broadcast_mask else bias)
        probs = self.softmax(scores)
        probs = self.attention_dropout(self.cast(probs, self.compute_dtype), dropout_step)
        return self.pv_matmul(probs, value)
