"""The decode-layer kernel (``kernels/cells/decode_layer.py``, ``cpu_decode_layer.cc`` over ``cpu_decoder.cc``'s layer
function) called on its own against a numpy float64 reference of the layer: odd shapes (hidden 40, 5 heads of 8; GQA
6 heads in 2 groups), GPT-2's layout with both GeLU forms and a Llama-style one (RMSNorm, SwiGLU, rope on 4 of each
head's 8 channels, biases on QKV only, NeoX's parallel residual), ragged positions, rows naming cache slots out of
order, a bias that also masks a key inside the valid range; the caches written in place at exactly the addressed rows,
every other row untouched; an address outside the cache fails the call with nothing written. (Inside the model against
the plain decode graph: tests/generation/test_decode_layer.py.)"""
import math

import numpy as np
import pytest
from mindspore import Parameter, Tensor

from mindformers_gptlocal.kernels.cells.decode_layer import CPUDecodeLayer

EPS = 1e-5
# layout -> (heads, groups, hidden, the Cell's keywords)
LAYOUTS = {"mha-odd": (5, 5, 40, dict(form="tanh")), "gqa-quick": (6, 2, 48, dict(form="quick")),
           "llama-rope": (6, 2, 48, dict(form="swiglu", norm="RMSNorm", rotary_dim=4, parallel_residual=True,
                                         qkv_bias=True, bias=False))}
PLACEHOLDER = np.zeros(1, np.float32)


def _layer(rng, hidden, heads, groups, inter, options):
    """The layer's 19 Parameter arguments (placeholders where the layout has none): norm1 (w, b), qkv, proj (w, scale,
    b), norm2 (w, b), fc1, gate, fc2 (w, scale, b)."""
    dim = hidden // heads
    width = (heads + 2 * groups) * dim

    def tensor(*shape, scale=0.3):
        return rng.standard_normal(shape).astype(np.float32) * scale

    layer_norm = options.get("norm", "LayerNorm") == "LayerNorm"
    bias, qkv_bias = options.get("bias", True), options.get("qkv_bias", True)

    def linear(out, inp, present=True, biased=bias):
        if not present:
            return [np.zeros((1, 1), np.float32), PLACEHOLDER, PLACEHOLDER]
        return [tensor(out, inp), PLACEHOLDER, tensor(out, scale=0.5) if biased else PLACEHOLDER]

    def norm():
        return [tensor(hidden, scale=0.5) + 1.0, tensor(hidden, scale=0.5) if layer_norm else PLACEHOLDER]

    gated = options["form"] == "swiglu"
    return (norm() + linear(width, hidden, biased=qkv_bias) + linear(hidden, heads * dim) + norm() +
            linear(inter, hidden) + linear(inter, hidden, gated) + linear(hidden, inter))


def _norm(x, weight, bias, layer_norm):
    if not layer_norm:
        return x / np.sqrt((x ** 2).mean(-1, keepdims=True) + EPS) * weight
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + EPS) * weight + bias


def _act(u, form):
    if form == "quick":
        return u / (1 + np.exp(-1.702 * u))
    return 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))


def _rotate(x, cos, sin, rotary):
    """rotate_half on the first ``rotary`` channels of x [..., D]."""
    half = rotary // 2
    rot = x.copy()
    a, b = x[..., :half], x[..., half:rotary]
    rot[..., :half] = a * cos[..., :half] - b * sin[..., :half]
    rot[..., half:rotary] = b * cos[..., half:rotary] + a * sin[..., half:rotary]
    return rot


def reference(x, params, keys, values, index, bias, cos, sin, heads, scale, options):
    """float64: the new hidden [B, 1, H] and the caches after the write."""
    (n1w, n1b, wqkv, _, bqkv, wp, _, bp, n2w, n2b, w1, _, b1, wg, _, bg, w2, _, b2) = [
        a.astype(np.float64) for a in params]
    layer_norm = options.get("norm", "LayerNorm") == "LayerNorm"
    bias_on, qkv_bias_on = options.get("bias", True), options.get("qkv_bias", True)
    rotary, form = options.get("rotary_dim", 0), options["form"]
    keys, values = keys.astype(np.float64), values.astype(np.float64)
    batch, _, hidden = x.shape
    groups, dim = keys.shape[1], keys.shape[3]
    group = heads // groups
    h = x[:, 0].astype(np.float64)
    qkv = _norm(h, n1w, n1b, layer_norm) @ wqkv.T + (bqkv if qkv_bias_on else 0)
    qkv = qkv.reshape(batch, groups, group + 2, dim)
    if rotary:
        qkv[:, :, :group + 1] = _rotate(qkv[:, :, :group + 1], cos[:, None, None, 0, 0], sin[:, None, None, 0, 0],
                                        rotary)
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
            e = np.exp(scores - scores.max())
            context[b, n * dim:(n + 1) * dim] = (e / e.sum()) @ values[slot, g, :pos + 1]
    mid = h + context @ wp.T + (bp if bias_on else 0)
    normed = _norm(h if options.get("parallel_residual") else mid, n2w, n2b, layer_norm)
    up = normed @ w1.T + (b1 if bias_on else 0)
    if form == "swiglu":
        gate = normed @ wg.T + (bg if bias_on else 0)
        inner = gate / (1 + np.exp(-gate)) * up
    else:
        inner = _act(up, form)
    out = mid + inner @ w2.T + (b2 if bias_on else 0)
    return out[:, None], keys, values


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_kernel_equals_the_reference_and_writes_only_its_rows(library, pynative_mode, layout, isa_tier):
    heads, groups, hidden, options = LAYOUTS[layout]
    rng = np.random.default_rng(heads + len(layout))
    slots, length, batch = 4, 13, 3
    dim, scale = hidden // heads, 1.0 / math.sqrt(hidden // heads)
    params = _layer(rng, hidden, heads, groups, 3 * hidden + 1, options)
    keys = rng.standard_normal((slots, groups, length, dim)).astype(np.float32)
    values = rng.standard_normal((slots, groups, length, dim)).astype(np.float32)
    x = rng.standard_normal((batch, 1, hidden)).astype(np.float32)
    positions, rows = np.array([12, 0, 5]), np.array([3, 1, 0])  # the cache's last row, its first, slots reordered
    index = np.stack(np.broadcast_arrays(rows[:, None], np.arange(groups)[None], positions[:, None]), -1)
    index = index[:, :, None].astype(np.int32)  # [B, G, 1, 3]
    bias = np.where(np.arange(length)[None] > positions[:, None], -1.0e9, 0.0).astype(np.float32)
    bias[2, 3] = -1.0e9  # a key inside row 2's range masked too
    bias = bias[:, None, None]
    rotary = options.get("rotary_dim", 0)
    angles = positions[:, None] * (1.0 / 10000 ** (np.arange(0, max(rotary, 2), 2) / max(rotary, 2)))[None]
    angles = np.concatenate((angles, angles), -1)[:, None, None].astype(np.float32)  # [B, 1, 1, R]
    cos, sin = (np.cos(angles), np.sin(angles)) if rotary else (np.zeros((1, 1, 1, 1), np.float32),) * 2
    want, want_keys, want_values = reference(x, params, keys, values, index, bias, cos, sin, heads, scale, options)
    key_cache = Parameter(Tensor(keys), name="key_cache", requires_grad=False)
    value_cache = Parameter(Tensor(values), name="value_cache", requires_grad=False)
    cell = CPUDecodeLayer(library, EPS, scale, threads=2, **options)
    got = cell(Tensor(x), *[Tensor(p) for p in params], key_cache, value_cache, Tensor(index), Tensor(bias),
               Tensor(cos), Tensor(sin))
    np.testing.assert_allclose(got.asnumpy(), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(key_cache.asnumpy(), want_keys, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value_cache.asnumpy(), want_values, rtol=1e-5, atol=1e-5)
    untouched = np.ones(keys.shape, bool)
    untouched[rows[:, None], np.arange(groups)[None], positions[:, None]] = False
    np.testing.assert_array_equal(key_cache.asnumpy()[untouched], keys[untouched])
    np.testing.assert_array_equal(value_cache.asnumpy()[untouched], values[untouched])


def test_an_address_outside_the_cache_fails_the_call(library, pynative_mode):
    rng = np.random.default_rng(0)
    params = _layer(rng, 16, 2, 2, 20, dict(form="tanh"))
    keys = np.zeros((2, 2, 5, 8), np.float32)
    key_cache = Parameter(Tensor(keys), name="key_cache", requires_grad=False)
    value_cache = Parameter(Tensor(keys), name="value_cache", requires_grad=False)
    cell = CPUDecodeLayer(library, EPS, 0.25, threads=1)
    x = Tensor(rng.standard_normal((2, 1, 16)).astype(np.float32))
    bias = Tensor(np.zeros((2, 1, 1, 5), np.float32))
    none = Tensor(np.zeros((1, 1, 1, 1), np.float32))
    for slot, position in ((2, 0), (0, 5)):  # a slot past the cache's, a position past its rows
        index = np.array([[[[0, 0, 1]], [[0, 1, 1]]], [[[slot, 0, position]], [[slot, 1, position]]]], np.int32)
        with pytest.raises(RuntimeError):
            cell(x, *[Tensor(p) for p in params], key_cache, value_cache, Tensor(index), bias, none, none).asnumpy()
        np.testing.assert_array_equal(key_cache.asnumpy(), keys)  # row 0's valid address not written either
