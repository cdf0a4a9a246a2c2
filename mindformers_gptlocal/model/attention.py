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
from .layers import Linear, residual_init_std, to_mstype
from .prefix_cells import PrefixConcat, prefix_rows

MASK_VALUE = -1.0e9


_PLAIN_WARNED = set()


def _plain_for_prefix(what):
    """One warning per process: prefix tuning runs the plain attention path instead of ``what``."""
    if what not in _PLAIN_WARNED:
        _PLAIN_WARNED.add(what)
        import warnings
        warnings.warn(f"gptlocal: pet_config prefix tuning uses the plain matmul + softmax attention, not {what} "
                      f"(built for square masks; the prefix adds key rows in front).", stacklevel=3)


def inverse_frequencies(rotary_dim, base):
    """The rope's frequencies [rotary_dim / 2] float32: base ** -(2i / rotary_dim), as Hugging Face computes them."""
    exponent = np.arange(0, rotary_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(rotary_dim)
    return (np.float32(1.0) / (np.float32(base) ** exponent)).astype(np.float32)


def rope_tables(rotary_dim, base, length):
    """cos and sin float32 [length, rotary_dim] of positions 0..length-1: ``RotaryEmbedding``'s angles (each
    frequency twice) in numpy, the tables the native runner reads (``describe.py``)."""
    freqs = np.arange(length, dtype=np.int32).astype(np.float32)[:, None] * inverse_frequencies(rotary_dim, base)
    angles = np.concatenate((freqs, freqs), -1)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


class RotaryEmbedding(nn.Cell):
    """cos and sin [B, 1, S, rotary_dim] of the positions [B, S] (each row its own positions, so ragged
    batches and packed rows rotate by their own offsets), computed in float32 as Hugging Face does."""

    def __init__(self, rotary_dim, base):
        super().__init__()
        self.inv_freq = Tensor(inverse_frequencies(rotary_dim, base)[None, None, :], ms.float32)

    def construct(self, position_ids):
        freqs = ops.expand_dims(ops.cast(position_ids, ms.float32), -1) * self.inv_freq  # [B, S, rot/2]
        emb = ops.expand_dims(ops.concat((freqs, freqs), -1), 1)  # [B, 1, S, rot]
        return ops.cos(emb), ops.sin(emb)


class ParallelAttention(nn.Cell):
    """Causal multi-head self-attention of one layer: the fused QKV projection, the heads (rotary with rope),
    one attention core, the output projection.

    The core is chosen once here, from the model's ``KernelProvider`` (``kernels``, required) and the config, never
    inside ``construct``; each core takes query [B, N, S, D], key and value [B, G, L, D] and returns the context
    [B, S, N * D]:

    - ``MatmulSoftmaxAttention`` (``self.plain``): scores, softmax, dropout, context; always built: it is the
      reference, the path under tensor parallel (its primitives carry the ``shard`` strategies of
      ``parallel/sharding.py`` and the select_recompute marks) and the KV cache's read;
    - ``FusedCPUAttention``: the C++ kernel (``kernels/cells/attention.py``, no [B, N, S, S] buffer) where the provider
      gives it (CPU, one rank, float32, no prefix, dropout only with the counter masks);
    - ``BlockwiseCore``: ``model_config.attention_block_size`` > 0 (query blocks, scores recomputed in the backward);
    - ``FlashCore``: Ascend's FlashAttentionScore (``use_flash_attention``), its variable-length form for packed
      rows.

    ``self.core`` is the one the forward without a KV cache runs; with a KV cache (call arguments ``key_cache`` ...)
    ``self.cache`` writes the new keys and values in place and reads them (``KVCacheAttention``; a prefill into
    empty rows runs the fused kernel over the prompt where it is built, ``KVCacheFusedPrefill``). How the fused QKV
    output splits into heads (``split_heads``: one key/value head per query head, or groups) and whether rope turns
    them (``rotate``: not at all, every channel, the first ``rotary_dim``) are picked here too.
    ``layer_number`` counts from 1; it picks the dropout site and matters for GPT-2's optional
    ``scale_attn_by_inverse_layer_idx``. A parallel build lets the ``shard`` strategies split the full Cell; the
    CPU proofs of tensor parallel build one rank's part in the tests (tests/references.py ``rank_block``).
    """

    def __init__(self, config, layer_number, use_flash_attention=False, counter_dropout=False, layer_spec=None, *,
                 kernels):
        super().__init__()
        arch = config.arch
        linear = (layer_spec or {}).get  # the layer spec's Linear class per path (layer_spec.py), else Linear
        params_dtype = to_mstype(config.params_dtype)
        compute_dtype = to_mstype(config.compute_dtype)
        softmax_dtype = to_mstype(config.softmax_compute_dtype)
        self.num_heads = arch.num_attention_heads
        self.head_dim = arch.head_dim
        self.num_groups = arch.groups  # key/value heads
        self.group_size = arch.group_size  # query heads per key/value head
        self.rotary_dim = arch.rotary_dim  # 0: learned absolute positions, nothing to turn
        scale = 1.0 / math.sqrt(self.head_dim)
        if config.scale_attn_by_inverse_layer_idx:
            scale /= float(layer_number)
        self.linear_qkv = linear("attention.linear_qkv", Linear)(
            config.hidden_size, (self.num_heads + 2 * self.num_groups) * self.head_dim, config.initializer_range,
            params_dtype, compute_dtype, has_bias=arch.qkv_bias, kernels=kernels)
        self.linear_proj = linear("attention.linear_proj", Linear)(
            self.num_heads * self.head_dim, config.hidden_size, residual_init_std(config), params_dtype,
            compute_dtype, has_bias=arch.bias, kernels=kernels)
        self.transpose = ops.Transpose()  # qkv [B, S, N, 3, D] -> [3, B, N, S, D]
        # [3, B, N, S, D] -> query, key, value. Unstack, not qkv[0], qkv[1], qkv[2]: on CPU the three
        # StridedSlices took 42 ms a layer for GPT-2 small at batch 2 x 256, Unstack 4 ms.
        self.split_qkv = ops.Unstack(axis=0)
        self.cast = ops.Cast()
        # prefix tuning (model/prefix_cells.py): prefix rows in front of the keys; only the plain core takes them
        self.prefix_concat = PrefixConcat() if config.prefix_spec() is not None else None
        dropout = make_dropout(config.attention_dropout, dropout_site(layer_number, "attention_probs"), config,
                               counter_dropout)
        # kernels.composed_ops(): on CPU the mask broadcast to the scores' shape before the Add, as Linear's bias
        # (less peak memory than the broadcasting Add: 548 -> 403 MB a layer for GPT-2 small at 1 x 1024)
        self.plain = MatmulSoftmaxAttention(self.group_size, scale, softmax_dtype, compute_dtype, dropout,
                                            kernels.composed_ops())
        self.core = self._choose_core(config, use_flash_attention, counter_dropout, kernels, scale, dropout)
        write = kernels.kv_write()  # the KV-cache write: in place on CPU (kernels/cells/kv_write.py)
        if isinstance(self.core, FusedCPUAttention):
            self.cache = KVCacheFusedPrefill(self.plain, write, self.prefix_concat, self.core)
        else:
            self.cache = KVCacheAttention(self.plain, write, self.prefix_concat)
        self.split_heads = self._split_heads if self.group_size == 1 else self._split_groups
        if not self.rotary_dim:
            self.rotate = self._no_rotation
        else:
            self.rotate = self._rotate_all if self.rotary_dim == self.head_dim else self._rotate_part

    def fused_prefill(self):
        """True where a KV-cache prefill into empty rows (``fresh_prefill``) runs the fused CPU kernel
        (``KVCacheFusedPrefill``: the core is ``FusedCPUAttention``); fixed at build, never read in construct."""
        return isinstance(self.cache, KVCacheFusedPrefill)

    def _choose_core(self, config, use_flash_attention, counter_dropout, kernels, scale, dropout):
        """The core of the forward without a KV cache (see the class): flash on Ascend when asked for, else
        blockwise when ``attention_block_size`` > 0, else the fused CPU kernel where the provider gives it
        (``KernelProvider.fused_attention``), else the plain one. Prefix tuning keeps the plain core (the others are
        built for square masks)."""
        prefix = self.prefix_concat is not None
        if prefix and (use_flash_attention or config.attention_block_size):
            _plain_for_prefix("use_flash_attention / attention_block_size")
        elif use_flash_attention:
            return FlashCore(self.num_heads, self.group_size, scale, config.attention_dropout, self.plain.merge_heads)
        elif config.attention_block_size:
            if is_parallel_build():
                raise ConfigError("model_config.attention_block_size is for stand-alone and data-parallel "
                                  "builds (parallel.parallel_mode 0); under semi_auto/auto parallel set it to 0 "
                                  "(and use_flash_attention: True on Ascend).")
            if config.attention_dropout > 0 and not counter_dropout:
                raise ConfigError("model_config.attention_block_size needs the counter-based dropout masks "
                                  "(model/dropout.py) when model_config.attention_dropout > 0; set "
                                  "attention_dropout to 0 or attention_block_size to 0.")
            return BlockwiseCore(self.group_size, config.attention_block_size, scale, self.plain.softmax_dtype,
                                 self.plain.compute_dtype, dropout if config.attention_dropout > 0 else None)
        kernel = kernels.fused_attention(scale, self.plain.compute_dtype, self.plain.softmax_dtype,
                                         config.attention_dropout, dropout, counter_dropout, prefix)
        if kernel is None:  # prefix tuning, not float32, no compiler (one warning): the plain core
            return self.plain
        return FusedCPUAttention(kernel, dropout if config.attention_dropout > 0 else None)

    def construct(self, hidden, attention_bias, key_cache=None, value_cache=None, write_index=None,
                  seq_ends=None, dropout_step=None, rotary=None, prefix=None, fresh_prefill=False):
        """hidden [B, S, H]; attention_bias additive [1 or B, 1, S, S] (uint8 keep/drop mask for flash).
        ``prefix``: (keys, values) [G, P, D] of prefix tuning, read in front of the keys and values by every
        query (``prefix.prefix_rows``), with and without the KV cache.

        With a KV cache (``key_cache``/``value_cache``: this layer's [B, G, L, D] Parameters), the new keys and
        values are written in place at ``write_index`` [B, G, S, 3] = (batch, head, position), attention reads the
        cached positions (``attention_bias`` then [B, 1, S, L]) and the cache holds the present keys and values
        afterwards (``KVCacheAttention``). ``fresh_prefill`` (a build-time constant, the runner's prefill graph):
        the call writes positions 0..S-1 of every row and no cached row comes before them (``attention_bias`` then
        [1, 1, S, S]). ``seq_ends`` (flash attention only): the packed rows' document ends over the flattened batch
        ([B * docs], see ``GPTLocalModel.document_mask``); attention then never crosses a document.
        ``dropout_step``: picks the attention-dropout mask (``dropout.py``; flash attention drops inside its
        kernel, with the kernel's own random state) and LoRA's input dropout.
        ``rotary``: (cos, sin) [B, 1, S, rotary_dim] of the tokens' positions (``RotaryEmbedding``), with rope.
        """
        batch, seq, _ = hidden.shape
        qkv = self.linear_qkv(hidden, dropout_step)  # the step: LoRA's input dropout, if any
        qkv = ops.reshape(qkv, (batch, seq, self.num_groups, self.group_size + 2, self.head_dim))
        query, key, value = self._heads(qkv, rotary)
        if key_cache is not None:
            context = self.cache(query, key, value, attention_bias, key_cache, value_cache, write_index, prefix,
                                 fresh_prefill)
            return self.linear_proj(context)
        if prefix is not None:
            key, value, attention_bias = prefix_rows(key, value, attention_bias, prefix[0], prefix[1],
                                                     self.prefix_concat)
        context = self.core(query, key, value, attention_bias, dropout_step, seq_ends)
        return self.linear_proj(context, dropout_step)

    def _heads(self, qkv, rotary):
        """[B, S, G, group + 2, D] -> query [B, N, S, D], key and value [B, G, S, D], rotary applied."""
        query, key, value = self.split_heads(qkv)
        return self.rotate(query, rotary), self.rotate(key, rotary), value

    def _split_heads(self, qkv):
        """One key/value head per query head: [B, S, N, 3, D] -> [3, B, N, S, D] -> query, key, value."""
        return self.split_qkv(self.transpose(qkv, (3, 0, 2, 1, 4)))

    def _split_groups(self, qkv):
        """Grouped-query attention: each group's query heads, then its key and value head."""
        batch, seq = qkv.shape[0], qkv.shape[1]
        query, key, value = ops.split(qkv, [self.group_size, 1, 1], axis=3)
        query = ops.transpose(ops.reshape(query, (batch, seq, self.num_heads, self.head_dim)), (0, 2, 1, 3))
        key = ops.transpose(ops.reshape(key, (batch, seq, self.num_groups, self.head_dim)), (0, 2, 1, 3))
        value = ops.transpose(ops.reshape(value, (batch, seq, self.num_groups, self.head_dim)), (0, 2, 1, 3))
        return query, key, value

    def _no_rotation(self, x, rotary):  # pylint: disable=unused-argument
        return x

    def _rotate_all(self, x, rotary):
        """Rotary embedding on every channel of x [B, heads, S, D] (HF's rotate_half), rotary_dim = head_dim."""
        cos, sin = self.cast(rotary[0], x.dtype), self.cast(rotary[1], x.dtype)
        half = self.rotary_dim // 2
        rotated = ops.concat((-x[..., half:], x[..., :half]), -1)
        return x * cos + rotated * sin

    def _rotate_part(self, x, rotary):
        """Rotary embedding on the first rotary_dim channels of x [B, heads, S, D], the rest as they are."""
        return ops.concat((self._rotate_all(x[..., :self.rotary_dim], rotary), x[..., self.rotary_dim:]), -1)


def repeat_groups(x, group_size):
    """[B, G, L, D] -> [B, N, L, D]: each key/value head repeated over its group's ``group_size`` query heads."""
    if group_size == 1:
        return x
    batch, groups, length, dim = x.shape
    x = ops.broadcast_to(ops.expand_dims(x, 2), (batch, groups, group_size, length, dim))
    return ops.reshape(x, (batch, groups * group_size, length, dim))


class KeyValueHeads:
    """A core's key and value [B, G, L, D] as its product takes them (``key_value_heads``, bound at build): as they
    are where every query head has its own (``group_size`` 1), else each repeated over its group
    (``repeat_groups``)."""

    def _bind_key_value_heads(self, group_size):
        self.group_size = group_size
        self.key_value_heads = self._own_key_value_heads if group_size == 1 else self._repeated_key_value_heads

    def _own_key_value_heads(self, key, value):
        return key, value

    def _repeated_key_value_heads(self, key, value):
        return repeat_groups(key, self.group_size), repeat_groups(value, self.group_size)


class MatmulSoftmaxAttention(KeyValueHeads, nn.Cell):
    """The plain core: softmax(q k^T * scale + bias) v per head, the scores in ``softmax_dtype``, the dropout on
    the probabilities. query [B, N, S, D], key/value [B, G, L, D] -> context [B, S, N * D]."""

    def __init__(self, group_size, scale, softmax_dtype, compute_dtype, dropout, broadcast_mask):
        super().__init__()
        self._bind_key_value_heads(group_size)
        self.scale = scale
        self.softmax_dtype = softmax_dtype
        self.compute_dtype = compute_dtype
        self.broadcast_mask = broadcast_mask
        # the mask broadcast to the scores' shape before the Add (KernelProvider.composed_ops), or as it is
        self.add_bias = self._broadcast_and_add if broadcast_mask else self._add
        self.qk_matmul = ops.BatchMatMul(transpose_b=True)
        self.scale_mul = ops.Mul()
        self.add_mask = ops.Add()
        self.softmax = ops.Softmax(axis=-1)
        self.attention_dropout = dropout
        self.pv_matmul = ops.BatchMatMul()
        self.merge_heads = ops.Transpose()  # context [B, N, S, D] -> [B, S, N, D]
        self.cast = ops.Cast()

    # pylint: disable-next=unused-argument
    def construct(self, query, key, value, attention_bias, dropout_step=None, seq_ends=None):
        key, value = self.key_value_heads(key, value)
        scores = self.qk_matmul(query, key)
        scores = self.scale_mul(self.cast(scores, self.softmax_dtype), self.scale)
        bias = self.cast(attention_bias, self.softmax_dtype)
        probs = self.softmax(self.add_bias(scores, bias))
        probs = self.attention_dropout(self.cast(probs, self.compute_dtype), dropout_step)
        return merge_context(self.merge_heads, self.pv_matmul(probs, value))

    def _add(self, scores, bias):
        return self.add_mask(scores, bias)

    def _broadcast_and_add(self, scores, bias):
        return self.add_mask(scores, ops.broadcast_to(bias, scores.shape))


def merge_context(transpose, context):
    """[B, N, S, D] -> [B, S, N * D] through ``transpose`` (a primitive that may carry a shard strategy)."""
    batch, heads, seq, dim = context.shape
    return ops.reshape(transpose(context, (0, 2, 1, 3)), (batch, seq, heads * dim))


class FusedCPUAttention(nn.Cell):
    """The fused CPU kernel (``kernels/cells/attention.py`` ``CPUAttention``: forward and backward flash-style, no
    [B, N, S, S] buffer); it reads each key/value group's head itself. ``dropout``: the layer's ``CounterDropout``
    when attention dropout is on (the kernel draws its masks from the same tables), else None."""

    def __init__(self, kernel, dropout=None):
        super().__init__()
        self.kernel = kernel
        self.attention_dropout = dropout
        self.merge_heads = ops.Transpose()
        self.cast = ops.Cast()
        self.offsets = self._no_offsets if dropout is None else self._dropout_offsets

    # pylint: disable-next=unused-argument
    def construct(self, query, key, value, attention_bias, dropout_step=None, seq_ends=None):
        context = self.kernel(query, key, value, self.cast(attention_bias, ms.float32), self.offsets(dropout_step))
        return merge_context(self.merge_heads, context)

    def _no_offsets(self, dropout_step):  # pylint: disable=unused-argument
        return None

    def _dropout_offsets(self, dropout_step):
        """The counter dropout's table offsets of this step, or None (no dropout now: not training, no step)."""
        if not self.training or dropout_step is None:
            return None
        return self.attention_dropout.offsets(dropout_step)


class BlockwiseCore(KeyValueHeads, nn.Cell):
    """``BlockwiseAttention`` (``blockwise_attention.py``): query blocks of ``block_size``, no [B, N, S, S] tensor
    kept for the backward; the dropout keep mask [B, N, S, S] is the one the plain core would draw."""

    def __init__(self, group_size, block_size, scale, softmax_dtype, compute_dtype, dropout=None):
        super().__init__()
        self._bind_key_value_heads(group_size)
        self.blockwise = BlockwiseAttention(block_size, scale, softmax_dtype, compute_dtype,
                                            1.0 if dropout is None else dropout.scale)
        self.attention_dropout = dropout
        self.no_keep = Tensor(np.ones((1,), np.bool_))  # "no dropout" for BlockwiseAttention
        self.merge_heads = ops.Transpose()
        self.keep_mask = self._keep_all if dropout is None else self._dropout_keep

    # pylint: disable-next=unused-argument
    def construct(self, query, key, value, attention_bias, dropout_step=None, seq_ends=None):
        key, value = self.key_value_heads(key, value)
        context = self.blockwise(query, key, value, attention_bias, self.keep_mask(query, dropout_step))
        return merge_context(self.merge_heads, context)

    def _keep_all(self, query, dropout_step):  # pylint: disable=unused-argument
        return self.no_keep

    def _dropout_keep(self, query, dropout_step):
        if not self.training or dropout_step is None:
            return self.no_keep
        batch, heads, seq, _ = query.shape
        return self.attention_dropout.keep_shape((batch, heads, seq, seq), dropout_step)


class FlashCore(KeyValueHeads, nn.Cell):
    """Ascend's FlashAttentionScore (BNSD, the uint8 mask); with ``seq_ends`` (packed rows) the variable-length
    form, as MindFormers' mcore FlashAttention runs it: tokens flattened to [B*S, N, D], cumulative document ends
    for q and kv, sparse_mode 3 (causal inside each document, the compressed 2048 x 2048 mask). Ascend only,
    untested on CPU/GPU. Attention dropout happens inside the kernel, with the kernel's own random state."""

    def __init__(self, heads, group_size, scale, attention_dropout, merge_heads):
        super().__init__()
        self._bind_key_value_heads(group_size)
        self.flash_attention = ops.operations.nn_ops.FlashAttentionScore(
            head_num=heads, keep_prob=1.0 - attention_dropout, scale_value=scale, input_layout="BNSD", sparse_mode=0)
        self.flash_attention_varlen = ops.operations.nn_ops.FlashAttentionScore(
            head_num=heads, keep_prob=1.0 - attention_dropout, scale_value=scale, input_layout="TND", sparse_mode=3)
        self.varlen_merge = ops.Transpose()  # [B, N, S, D] -> [B, S, N, D]
        self.merge_heads = merge_heads  # the plain core's, with its shard strategy

    # pylint: disable-next=unused-argument
    def construct(self, query, key, value, attention_bias, dropout_step=None, seq_ends=None):
        key, value = self.key_value_heads(key, value)
        if seq_ends is None:
            context = self.flash_attention(query, key, value, None, None, None, attention_bias, None)[3]
            return merge_context(self.merge_heads, context)
        batch, heads, seq, dim = query.shape
        query, key, value = [ops.reshape(self.varlen_merge(x, (0, 2, 1, 3)), (batch * seq, heads, dim))
                             for x in (query, key, value)]
        context = self.flash_attention_varlen(query, key, value, None, None, None, attention_bias, None,
                                              seq_ends, seq_ends)[3]
        return ops.reshape(context, (batch, seq, heads * dim))


class KVCacheAttention(nn.Cell):
    """Attention with a KV cache: this step's keys and values written in place into the head-major caches
    [B, G, L, D] at ``write_index`` (``KernelProvider.kv_write``: ScatterNdUpdate's inputs, O(new tokens) on
    CPU), then the plain core over every cached row; the caches are read as stored, with no per-step transpose."""

    def __init__(self, plain, write, prefix_concat=None):
        super().__init__()
        self.plain = plain
        self.scatter_update = write
        self.prefix_concat = prefix_concat

    def construct(self, query, key, value, attention_bias, key_cache, value_cache, write_index, prefix=None,
                  fresh_prefill=False):  # pylint: disable=unused-argument
        return self.read_cached(query, key, value, attention_bias, key_cache, value_cache, write_index, prefix)

    def read_cached(self, query, key, value, attention_bias, key_cache, value_cache, write_index, prefix):
        """Write, then attend over all L cached rows (rows not yet written are masked by ``attention_bias``)."""
        key_cache = ops.depend(key_cache, self.scatter_update(key_cache, write_index, key))
        value_cache = ops.depend(value_cache, self.scatter_update(value_cache, write_index, value))
        if query.shape[0] != key_cache.shape[0]:  # fewer rows than cache slots (serving): read the rows' own slots
            slots = write_index[:, 0, 0, 0]
            key_cache = ops.gather(key_cache, slots, 0)
            value_cache = ops.gather(value_cache, slots, 0)
        if prefix is not None:
            key_cache, value_cache, attention_bias = prefix_rows(key_cache, value_cache, attention_bias, *prefix,
                                                                 self.prefix_concat)
        return self.plain(query, key_cache, value_cache, attention_bias)


class KVCacheFusedPrefill(KVCacheAttention):
    """``KVCacheAttention`` where the fused CPU kernel is built: a prefill into empty rows (``fresh_prefill``,
    positions 0..S-1) runs the kernel's causal attention over the S new keys and values, which are also written
    into the caches; the plain read over all L rows with rows S..L-1 masked gives the same values."""

    def __init__(self, plain, write, prefix_concat, fused):
        super().__init__(plain, write, prefix_concat)
        self.fused = fused

    def construct(self, query, key, value, attention_bias, key_cache, value_cache, write_index, prefix=None,
                  fresh_prefill=False):
        if not fresh_prefill:
            return self.read_cached(query, key, value, attention_bias, key_cache, value_cache, write_index, prefix)
        wrote_key = self.scatter_update(key_cache, write_index, key)
        wrote_value = self.scatter_update(value_cache, write_index, value)
        context = self.fused(query, key, value, attention_bias)
        return ops.depend(ops.depend(context, wrote_key), wrote_value)
