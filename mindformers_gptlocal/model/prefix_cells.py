"""The Cells of prefix tuning / P-Tuning v2 (``pet_config.pet_type: prefixtuning | ptuning2``; settings, shapes,
freeze and sharding rules: ``prefix.py``): trainable per-layer key/value rows that every attention layer reads in
front of the sequence's own keys and values.

``PrefixEncoder`` is peft's ``PrefixEncoder`` (peft/tuners/prefix_tuning/model.py) in MindSpore: a table
``embedding`` [tokens, layers*2*kv_width] (kv_width = num_query_groups * head_dim, so grouped-query models get
one prefix per key/value group, as peft's), or with the reparameterisation MLP (``prefix_projection`` /
``mid_dim``) ``embedding`` [tokens, kv_width] -> Linear -> tanh -> Linear to layers*2*kv_width. Its output is
split as peft's ``get_prompt`` splits it: row 2i is layer i's keys, 2i+1 its values, each [G, tokens, D].

How the model uses them (as peft does for GPT-2/Llama, measured against peft 0.17):
- ``ParallelAttention`` puts the prefix rows in front of the keys and values (the uncached path and the KV
  cache's read alike; the cache itself holds only the real tokens) and every query sees them (a zero bias
  column block in front of the mask); no rotary embedding turns the prefix keys.
- the real tokens' positions start at ``tokens`` (peft passes the prefix as past_key_values, so transformers
  numbers the tokens after it): ``GPTLocalModel`` adds ``tokens`` to the position ids.
- the base model is frozen (``PrefixSpec.is_frozen``), only ``model.prefix_encoder.*`` trains.
"""
import math

import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter
from mindspore.common.initializer import initializer, HeUniform, Normal, Uniform

from ..peft.prefix import PREFIX_NAME, prefix_shapes


class PrefixEncoder(nn.Cell):
    """The prefix keys and values of every layer: ``construct(dropout_step)`` -> tuple of 2 * layers Tensors
    [G, P, D] (layer i: keys at 2i, values at 2i + 1), in ``dtype``. ``dropout``: the dropout Cell of
    ``spec.dropout`` (``dropout.make_dropout`` at ``dropout_site(part="prefix")``: counter-based, so a resumed
    run draws the uninterrupted run's masks; ``dropout_step`` picks them), or None."""

    def __init__(self, spec, num_layers, groups, head_dim, dtype=ms.float32, params_dtype=ms.float32, dropout=None):
        super().__init__()
        self.spec = spec
        self.tokens = spec.tokens
        self.num_layers = num_layers
        self.groups = groups
        self.head_dim = head_dim
        self.dtype = dtype
        shapes = prefix_shapes(spec, num_layers, groups * head_dim)
        # peft's initialisation: nn.Embedding N(0, 1); nn.Linear kaiming_uniform(a=sqrt 5), bias U(+-1/sqrt(fan_in))
        self.embedding = Parameter(initializer(Normal(1.0), shapes["embedding"], params_dtype), name="embedding")
        self.projection = spec.projection
        if spec.projection:
            self.transform_in = _Dense(*shapes["transform_in.weight"], params_dtype)
            self.transform_out = _Dense(*shapes["transform_out.weight"], params_dtype)
            self.tanh = ops.Tanh()
        self.dropout = dropout if spec.dropout > 0 else None
        self.unstack = ops.Unstack(axis=0)
        self.transpose = ops.Transpose()
        self.cast = ops.Cast()  # the table's reader: its (replicated) layout in prefix.py prefix_rules
        # chosen here, not in construct: the reparameterisation MLP or the table as it is; the dropout or none
        self.project = self._projected if spec.projection else self._as_is
        self.drop = self._as_is if self.dropout is None else self._dropped

    def construct(self, dropout_step=None):
        table = self.project(self.cast(self.embedding, self.dtype))
        rows = ops.reshape(table, (self.tokens, self.num_layers * 2, self.groups, self.head_dim))
        rows = self.drop(rows, dropout_step)
        return self.unstack(self.transpose(rows, (1, 2, 0, 3)))  # 2L x [G, P, D]

    def _projected(self, table):
        return self.transform_out(self.tanh(self.transform_in(table, self.dtype)), self.dtype)

    def _dropped(self, rows, dropout_step):
        return self.dropout(rows, dropout_step)

    def _as_is(self, table, dropout_step=None):  # pylint: disable=unused-argument
        return table


class _Dense(nn.Cell):
    """x W^T + b with torch.nn.Linear's initialisation (weight [out, in])."""

    def __init__(self, out, inp, params_dtype):
        super().__init__()
        self.weight = Parameter(initializer(HeUniform(negative_slope=math.sqrt(5)), (out, inp), params_dtype),
                                name="weight")
        self.bias = Parameter(initializer(Uniform(1.0 / math.sqrt(inp)), (out,), params_dtype), name="bias")
        self.matmul = ops.MatMul(transpose_b=True)
        self.bias_add = ops.Add()

    def construct(self, x, dtype):
        return self.bias_add(self.matmul(x, ops.cast(self.weight, dtype)), ops.cast(self.bias, dtype))


class PrefixConcat(nn.Cell):
    """The three Concat primitives ``prefix_rows`` uses (``ParallelAttention.prefix_concat``), so that
    ``prefix.PREFIX_BLOCK_RULES`` can give them strategies: keys and values (dp, mp, 1, 1) over [B, G, P + K, D]
    (each rank its own key/value groups, the replicated prefix sliced to them), the mask whole."""

    def __init__(self):
        super().__init__()
        self.key = ops.Concat(axis=2)
        self.value = ops.Concat(axis=2)
        self.mask = ops.Concat(axis=3)


def prefix_rows(key, value, bias, prefix_key, prefix_value, concat=None):
    """key/value [B, G, K, D] -> [B, G, P + K, D] with the prefix rows [G, P, D] in front; the additive
    mask ``bias`` [b, 1, S, K] -> [b, 1, S, P + K], the prefix visible to every query. ``concat``: a
    ``PrefixConcat`` (its primitives carry the shard strategies), or None (functional concats)."""
    batch, groups, _, dim = key.shape
    tokens = prefix_key.shape[1]
    front = (batch, groups, tokens, dim)
    keys = (ops.broadcast_to(ops.expand_dims(ops.cast(prefix_key, key.dtype), 0), front), key)
    values = (ops.broadcast_to(ops.expand_dims(ops.cast(prefix_value, value.dtype), 0), front), value)
    seen = ops.zeros((bias.shape[0], bias.shape[1], bias.shape[2], tokens), bias.dtype)
    if concat is None:
        return ops.concat(keys, 2), ops.concat(values, 2), ops.concat((seen, bias), -1)
    return concat.key(keys), concat.value(values), concat.mask((seen, bias))


def prefix_table(model):
    """The prefix keys and values as numpy [layers*2, G, P, D] (the MLP applied): what an export writes."""
    encoder = model.model.prefix_encoder
    was = encoder.training
    encoder.set_train(False)
    rows = [r.asnumpy() for r in encoder()]
    encoder.set_train(was)
    return np.stack(rows)


__all__ = ["PrefixEncoder", "PrefixConcat", "prefix_rows", "prefix_table", "PREFIX_NAME"]
