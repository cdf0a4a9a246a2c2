"""The decode-layer kernel (``kernels/decode_layer.py``, ``cpu_decode_layer.cc``) called on its own against a numpy
float64 reference of the layer: odd shapes (hidden 40, 5 heads of 8; GQA 6 heads in 2 groups), ragged positions,
rows naming cache slots out of order, a bias that also masks a key inside the valid range, both GeLU forms; the
caches written in place at exactly the addressed rows, every other row untouched; an address outside the cache fails
the call with nothing written. (Inside the model against the plain decode graph: tests/generation/
test_decode_layer.py.)"""
import math

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from mindformers_gptlocal.kernels.decode_layer import CPUDecodeLayer

EPS = 1e-5


def _layer(rng, hidden, heads, groups, inter):
    dim = hidden // heads
    width = (heads + 2 * groups) * dim
    shapes = [(hidden,), (hidden,), (width, hidden), (width,), (hidden, heads * dim), (hidden,), (hidden,), (hidden,),
              (inter, hidden), (inter,), (hidden, inter), (hidden,)]
    params = [rng.standard_normal(s).astype(np.float32) * (0.3 if len(s) == 2 else 0.5) for s in shapes]
    params[0] += 1.0
    params[6] += 1.0
    return params


def _norm(x, gamma, beta):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS) * gamma + beta


def _gelu(u, form):
    if form == "quick":
        return u / (1 + np.exp(-1.702 * u))
    return 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))


def reference(x, params, keys, values, index, bias, heads, scale, form):
    """float64: the new hidden [B, 1, H] and the caches after the write."""
    g1, b1, wqkv, bqkv, wp, bp, g2, b2, w1, bb1, w2, bb2 = [p.astype(np.float64) for p in params]
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    batch, _, hidden = x.shape
    groups, dim = keys.shape[1], keys.shape[3]
    group = heads // groups
    h = x[:, 0].astype(np.float64)
    qkv = (_norm(h, g1, b1) @ wqkv.T + bqkv).reshape(batch, groups, group + 2, dim)
    for b in range(batch):
        for g in range(groups):
            slot, _, pos = index[b, g, 0]
            keys[slot, g, pos], values[slot, g, pos] = qkv[b, g, group], qkv[b, g, group + 1]
    context = np.zeros((batch, heads * dim))
    for b in range(batch):
        for n in range(heads):
            g = n // group
            slot, _, pos = index[b, g, 0]
            scores = keys[slot, g, :pos + 1] @ qkv[b, g, n % group] * scale + bias[b, 0, 0, :pos + 1]
            p = np.exp(scores - scores.max())
            context[b, n * dim:(n + 1) * dim] = (p / p.sum()) @ values[slot, g, :pos + 1]
    mid = h + context @ wp.T + bp
    out = mid + _gelu(_norm(mid, g2, b2) @ w1.T + bb1, form) @ w2.T + bb2
    return out[:, None], keys, values


@pytest.mark.parametrize("heads,groups,form", [(5, 5, "tanh"), (6, 2, "quick")], ids=["mha-odd", "gqa-quick"])
def test_kernel_equals_the_reference_and_writes_only_its_rows(library, pynative_mode, heads, groups, form):
    rng = np.random.default_rng(heads)
    hidden = 40 if heads == 5 else 48
    slots, length, batch = 4, 13, 3
    dim, scale = hidden // heads, 1.0 / math.sqrt(hidden // heads)
    params = _layer(rng, hidden, heads, groups, 3 * hidden + 1)
    keys = rng.standard_normal((slots, groups, length, dim)).astype(np.float32)
    values = rng.standard_normal((slots, groups, length, dim)).astype(np.float32)
    x = rng.standard_normal((batch, 1, hidden)).astype(np.float32)
    positions, rows = np.array([12, 0, 5]), np.array([3, 1, 0])  # the cache's last row, its first, slots reordered
    index = np.stack(np.broadcast_arrays(rows[:, None], np.arange(groups)[None], positions[:, None]), -1)
    index = index[:, :, None].astype(np.int32)  # [B, G, 1, 3]
    bias = np.where(np.arange(length)[None] > positions[:, None], -1.0e9, 0.0).astype(np.float32)
    bias[2, 3] = -1.0e9  # a key inside row 2's range masked too
    bias = bias[:, None, None]
    want, want_keys, want_values = reference(x, params, keys, values, index, bias, heads, scale, form)
    key_cache = Parameter(Tensor(keys), name="key_cache", requires_grad=False)
    value_cache = Parameter(Tensor(values), name="value_cache", requires_grad=False)
    cell = CPUDecodeLayer(library, EPS, scale, form, threads=2)
    got = cell(Tensor(x), *[Tensor(p) for p in params], key_cache, value_cache, Tensor(index), Tensor(bias))
    np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(key_cache.asnumpy(), want_keys, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value_cache.asnumpy(), want_values, rtol=1e-5, atol=1e-5)
    untouched = np.ones(keys.shape, bool)
    untouched[rows[:, None], np.arange(groups)[None], positions[:, None]] = False
    np.testing.assert_array_equal(key_cache.asnumpy()[untouched], keys[untouched])
    np.testing.assert_array_equal(value_cache.asnumpy()[untouched], values[untouched])


def test_an_address_outside_the_cache_fails_the_call(library, pynative_mode):
    rng = np.random.default_rng(0)
    params = _layer(rng, 16, 2, 2, 20)
    keys = np.zeros((2, 2, 5, 8), np.float32)
    key_cache = Parameter(Tensor(keys), name="key_cache", requires_grad=False)
    value_cache = Parameter(Tensor(keys), name="value_cache", requires_grad=False)
    cell = CPUDecodeLayer(library, EPS, 0.25, threads=1)
    x = Tensor(rng.standard_normal((2, 1, 16)).astype(np.float32))
    bias = Tensor(np.zeros((2, 1, 1, 5), np.float32))
    for slot, position in ((2, 0), (0, 5)):  # a slot past the cache's, a position past its rows
        index = np.array([[[[0, 0, 1]], [[0, 1, 1]]], [[[slot, 0, position]], [[slot, 1, position]]]], np.int32)
        with pytest.raises(RuntimeError):
            cell(x, *[Tensor(p) for p in params], key_cache, value_cache, Tensor(index), bias).asnumpy()
        np.testing.assert_array_equal(key_cache.asnumpy(), keys)  # row 0's valid address not written either
