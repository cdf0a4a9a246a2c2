"""The rotary embedding kernel (``cpu_rope.cc``, its table entry ``gptlocal_rope_fwd`` / ``_bwd``; the table's Cell,
``aot.KernelCell``) against the plain path, ``ParallelAttention.rotate`` (model/attention.py, Hugging Face's
rotate_half on the first ``rotary_dim`` channels) with ``RotaryEmbedding``'s cos and sin of ragged positions, by value,
forward and the gradient, in PYNATIVE and GRAPH mode: odd head sizes, partial and full rotation, cos and sin of one
row or of each row, several threads; its cores directly against numpy; what it refuses."""
import ctypes

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from mindformers_gptlocal import GPTLocalConfig
from mindformers_gptlocal.kernels.abi import table
from mindformers_gptlocal.kernels.abi.aot import KernelCell, call_core
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model.attention import ParallelAttention, RotaryEmbedding
from conftest import TINY

ROPE = table.KERNELS["gptlocal_rope_fwd"]
# (batch, heads, seq, head_dim, rotary_percent, cos rows, threads): partial and full rotation on odd head sizes; one
# row's positions for the whole batch; 2 x 4 x 100 x 64 elements, enough for two threads
CASES = {"partial": (2, 3, 7, 10, 0.4, 2, 1), "full": (2, 3, 7, 10, 1.0, 2, 1), "shared": (3, 2, 5, 8, 0.25, 1, 1),
         "threads": (2, 4, 100, 64, 0.5, 2, 2)}


def plain_rope(heads, dim, percent):
    """The model's own rotation (``ParallelAttention.rotate``) and its ``RotaryEmbedding``."""
    config = GPTLocalConfig(**dict(TINY, hidden_size=heads * dim, num_attention_heads=heads,
                                   position_embedding_type="rope", rotary_percent=percent, cpu_kernels="plain"))
    attention = ParallelAttention(config, 1, kernels=KernelProvider.from_config(config))
    return attention, RotaryEmbedding(attention.rotary_dim, config.rotary_base)


class Weighted(nn.Cell):
    """sum(rope(x) * w): one scalar whose gradient in x is the backward's."""

    def __init__(self, rotate, weight):
        super().__init__()
        self.rotate = rotate
        self.weight = weight

    def construct(self, x, cos, sin):
        return (self.rotate(x, cos, sin) * self.weight).sum()


class PlainRotate(nn.Cell):
    def __init__(self, attention):
        super().__init__()
        self.attention = attention

    def construct(self, x, cos, sin):
        return self.attention.rotate(x, (cos, sin))


@pytest.mark.parametrize("mode", [ms.PYNATIVE_MODE, ms.GRAPH_MODE], ids=["pynative", "graph"])
@pytest.mark.parametrize("case", CASES)
def test_kernel_equals_the_plain_rotation(library, case, mode):
    batch, heads, seq, dim, percent, rows, threads = CASES[case]
    before = ms.get_context("mode")
    ms.set_context(mode=mode)
    try:
        rng = np.random.default_rng(seq + dim)
        attention, embedding = plain_rope(heads, dim, percent)
        positions = np.stack([np.arange(seq) + 3 * row for row in range(rows)])  # ragged: each row its offset
        cos, sin = embedding(Tensor(positions.astype(np.int32)))
        x = Tensor(rng.standard_normal((batch, heads, seq, dim)).astype(np.float32))
        weight = Tensor(rng.standard_normal((batch, heads, seq, dim)).astype(np.float32))
        kernel = KernelCell(library, ROPE, threads=threads)
        plain = PlainRotate(attention)
        np.testing.assert_allclose(kernel(x, cos, sin).asnumpy(), plain(x, cos, sin).asnumpy(), rtol=1e-6, atol=1e-6)
        got = ms.value_and_grad(Weighted(kernel, weight), 0)(x, cos, sin)
        want = ms.value_and_grad(Weighted(plain, weight), 0)(x, cos, sin)
        np.testing.assert_allclose(got[0].asnumpy(), want[0].asnumpy(), rtol=1e-5)
        np.testing.assert_allclose(got[1].asnumpy(), want[1].asnumpy(), rtol=1e-6, atol=1e-6)
        if attention.rotary_dim < dim:  # the channels past rotary_dim pass through, forward and back
            np.testing.assert_array_equal(kernel(x, cos, sin).asnumpy()[..., attention.rotary_dim:],
                                          x.asnumpy()[..., attention.rotary_dim:])
    finally:
        ms.set_context(mode=before)


def numpy_rope(x, cos, sin, backward=False):
    half, rotary = cos.shape[-1] // 2, cos.shape[-1]
    x, cos, sin = (a.astype(np.float64) for a in (x, cos, sin))
    a, b = x[..., :half], x[..., half:rotary]
    if backward:
        turned = (a * cos[..., :half] + b * sin[..., half:], b * cos[..., half:] - a * sin[..., :half])
    else:
        turned = (a * cos[..., :half] - b * sin[..., :half], b * cos[..., half:] + a * sin[..., half:])
    return np.concatenate(turned + (x[..., rotary:],), -1)


@pytest.mark.parametrize("backward", [False, True])
def test_cores_equal_numpy(library, backward):
    """The cores called directly, cos and sin of arbitrary values (not only a rotation's): each formula term."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 5, 9)).astype(np.float32)
    cos, sin = (rng.standard_normal((2, 1, 5, 6)).astype(np.float32) for _ in range(2))
    y = np.full_like(x, np.nan)
    symbol = "gptlocal_rope_bwd" if backward else "gptlocal_rope_fwd"
    status = call_core(ctypes.CDLL(library), table.KERNELS[symbol], x, cos, sin, y, options=table.ThreadOptions(1))
    assert status == 0
    np.testing.assert_allclose(y, numpy_rope(x, cos, sin, backward), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rotary,rows", [(5, 1), (12, 1), (0, 1), (6, 3)], ids=["odd", "wider", "none", "rows"])
def test_what_it_refuses(library, rotary, rows):
    """An odd rotary width, one wider than the head, none, cos of another batch: the call fails."""
    lib = ctypes.CDLL(library)
    x, y = np.ones((2, 3, 5, 10), np.float32), np.zeros((2, 3, 5, 10), np.float32)
    cos = np.ones((rows, 1, 5, rotary), np.float32)
    assert call_core(lib, ROPE, x, cos, cos, y, options=table.ThreadOptions(1)) != 0
