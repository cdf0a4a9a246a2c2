"""The kernels' typed cores called directly (ctypes, ``aot.call_core``: typed pointers, the sizes, the options struct;
no MindSpore call around them) against float64 numpy references, on odd sizes (not multiples of a vector width or
of a column block), with several threads where the work is large enough to split; and the bf16 rounding every
bf16 GEMM takes (``common.h`` ``bf16_bits``, through ``gptlocal_to_bf16``) on exact ties, NaN, infinities and the
Python rounding's values. (Each kernel through MindSpore against the plain path: test_*_kernel.py.)"""
import ctypes
import math

import numpy as np
import pytest

from mindformers_gptlocal.kernels.abi import table
from mindformers_gptlocal.kernels.abi.aot import call_core
from mindformers_gptlocal.safetensors_io import to_bfloat16_bits

K = table.KERNELS
RNG = np.random.default_rng(7)


@pytest.fixture(scope="module")
def lib(library):
    return ctypes.CDLL(library)


def f32(*shape, scale=1.0):
    return (RNG.standard_normal(shape) * scale).astype(np.float32)


def run(lib, symbol, *arrays, options):
    assert call_core(lib, K[symbol], *arrays, options=options) == 0


def close(got, want, tol=1e-5):
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol * max(1.0, float(np.abs(want).max())))


def gelu(u, quick):
    return u / (1 + np.exp(-1.702 * u)) if quick else 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) *
                                                                          (u + 0.044715 * u ** 3)))


def bf16(a):
    """a rounded to bfloat16 (numpy: the Python rounding), as float64."""
    return (to_bfloat16_bits(a).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ------------------------------------------------------------------------------------------- bf16 rounding
def to_bf16(lib, values):
    x = np.ascontiguousarray(values, np.float32)
    out = np.zeros(x.shape, np.uint16)
    lib.gptlocal_to_bf16.restype = None
    lib.gptlocal_to_bf16(ctypes.c_void_p(x.ctypes.data), ctypes.c_int64(x.size), ctypes.c_void_p(out.ctypes.data))
    return out


def test_bf16_rounding_to_nearest_even_on_exact_ties(lib):
    bits = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # ties: down to even, up to even, negatives
                     0x3F808001, 0x3F807FFF,  # just above and below a tie
                     0x7F7FFFFF, 0x7F800000, 0xFF800000,  # the largest float rounds to inf; infinities stay
                     0x00000001, 0x80000000], np.uint32)  # a denormal rounds to 0, -0 stays
    want = [0x3F80, 0x3F82, 0xBF80, 0xBF82, 0x3F81, 0x3F80, 0x7F80, 0x7F80, 0xFF80, 0x0000, 0x8000]
    assert to_bf16(lib, bits.view(np.float32)).tolist() == want
    nans = np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF, 0x7FBFFFFF], np.uint32).view(np.float32)
    got = to_bf16(lib, nans)
    assert np.all(np.isnan((got.astype(np.uint32) << 16).view(np.float32)))  # NaN stays NaN (never inf)
    assert np.all(got & 0x0040)  # quiet


@pytest.mark.parametrize("count", [1, 7, 1001, 70000])  # the vector loop's tail; several blocks
def test_bf16_rounding_equals_the_python_rounding(lib, count):
    x = f32(count, scale=10.0)
    x[::97] = np.float32(1.0) + np.float32(2.0 ** -8) * (np.arange(len(x[::97])) % 4)  # ties among them
    np.testing.assert_array_equal(to_bf16(lib, x), to_bfloat16_bits(x))


# ------------------------------------------------------------------------------------------- norms, GeLU, SwiGLU
def layer_norm(x, gamma, beta, eps):
    x = x.astype(np.float64)
    mu = x.mean(-1, keepdims=True)
    rstd = 1 / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps)
    return (x - mu) * rstd * gamma + beta, mu[..., 0], rstd[..., 0]


@pytest.mark.parametrize("rows,width,threads", [(1, 5, 1), (131, 97, 2), (131, 257, 3)])
def test_layernorm_cores(lib, rows, width, threads):
    x, gamma, beta, dy = f32(rows, width), f32(width), f32(width), f32(rows, width)
    y, mean, rstd = np.zeros_like(x), np.zeros(rows, np.float32), np.zeros(rows, np.float32)
    options = table.LayerNormOptions(1e-5, threads)
    run(lib, "gptlocal_layernorm_fwd", x, gamma, beta, y, mean, rstd, options=options)
    want, want_mean, want_rstd = layer_norm(x, gamma, beta, 1e-5)
    close(y, want), close(mean, want_mean), close(rstd, want_rstd)
    dx, dgamma, dbeta = np.zeros_like(x), np.zeros(width, np.float32), np.zeros(width, np.float32)
    run(lib, "gptlocal_layernorm_bwd", x, gamma, mean, rstd, dy, dx, dgamma, dbeta, options=options)
    xhat = (x - want_mean[:, None]) * want_rstd[:, None]
    g = dy.astype(np.float64) * gamma
    want_dx = want_rstd[:, None] * (g - g.mean(-1, keepdims=True) - xhat * (g * xhat).mean(-1, keepdims=True))
    close(dx, want_dx, 1e-4), close(dgamma, (dy * xhat).sum(0), 1e-4), close(dbeta, dy.astype(np.float64).sum(0))


@pytest.mark.parametrize("rows,width,threads", [(1, 5, 1), (131, 257, 3)])
def test_rmsnorm_cores(lib, rows, width, threads):
    x, weight, dy = f32(rows, width), f32(width), f32(rows, width)
    y, rstd = np.zeros_like(x), np.zeros(rows, np.float32)
    options = table.RMSNormOptions(1e-6, threads)
    run(lib, "gptlocal_rmsnorm_fwd", x, weight, y, rstd, options=options)
    want_rstd = 1 / np.sqrt((x.astype(np.float64) ** 2).mean(-1) + 1e-6)
    close(y, x * want_rstd[:, None] * weight), close(rstd, want_rstd)
    dx, dweight = np.zeros_like(x), np.zeros(width, np.float32)
    run(lib, "gptlocal_rmsnorm_bwd", x, weight, rstd, dy, dx, dweight, options=options)
    xhat = x * want_rstd[:, None]
    g = dy.astype(np.float64) * weight
    close(dx, want_rstd[:, None] * (g - xhat * (g * xhat).mean(-1, keepdims=True)), 1e-4)
    close(dweight, (dy * xhat).sum(0), 1e-4)


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("rows,width,threads", [(3, 37, 1), (129, 300, 3)])
def test_bias_gelu_cores(lib, rows, width, threads, quick):
    x, bias, dy = f32(rows, width, scale=2.0), f32(width), f32(rows, width)
    y = np.zeros_like(x)
    options = table.BiasGeluOptions(int(quick), threads)
    run(lib, "gptlocal_bias_gelu_fwd", x, bias, y, options=options)
    u = x.astype(np.float64) + bias
    close(y, gelu(u, quick))
    dx, dbias = np.zeros_like(x), np.zeros(width, np.float32)
    run(lib, "gptlocal_bias_gelu_bwd", x, bias, dy, dx, dbias, options=options)
    step = 1e-6  # the derivative by central differences in float64
    want = dy * (gelu(u + step, quick) - gelu(u - step, quick)) / (2 * step)
    close(dx, want, 1e-4), close(dbias, want.sum(0), 1e-4)


@pytest.mark.parametrize("shape,threads", [((5, 7), 1), ((3, 11111), 3)])
def test_swiglu_cores(lib, shape, threads):
    gate, up, dy = f32(*shape, scale=3.0), f32(*shape), f32(*shape)
    y = np.zeros_like(gate)
    run(lib, "gptlocal_swiglu_fwd", gate, up, y, options=table.ThreadOptions(threads))
    g = gate.astype(np.float64)
    s = 1 / (1 + np.exp(-g))
    close(y, g * s * up)
    dgate, dup = np.zeros_like(gate), np.zeros_like(gate)
    run(lib, "gptlocal_swiglu_bwd", gate, up, dy, dgate, dup, options=table.ThreadOptions(threads))
    close(dup, dy * g * s), close(dgate, dy * up * (s + g * s * (1 - s)))


# ------------------------------------------------------------------------------------------- GEMMs
GEMMS = [(1, 77, 109, 1), (33, 130, 300, 2), (7, 5, 3, 3)]  # 33 x 300 x 130 runs on two column blocks


@pytest.mark.parametrize("precision", [0, 2])  # float32; bf16 operands (the emulation: the same on every CPU)
@pytest.mark.parametrize("rows,inner,outer,threads", GEMMS)
def test_linear_cores(lib, rows, inner, outer, threads, precision):
    x, w, b, dy, residual = f32(rows, inner), f32(outer, inner), f32(outer), f32(rows, outer), f32(rows, outer)
    options = table.LinearOptions(threads, precision)
    r = bf16 if precision else (lambda a: a.astype(np.float64))
    xr, wr, dyr = r(x), r(w), r(dy)
    for bias in (None, b):
        y = np.full((rows, outer), np.nan, np.float32)
        run(lib, "gptlocal_linear_fwd", x, w, bias, y, options=options)
        close(y, xr @ wr.T + (0 if bias is None else bias))
    y = np.zeros((rows, outer), np.float32)
    run(lib, "gptlocal_linear_residual_fwd", x, w, b, residual, y, options=options)
    close(y, residual + xr @ wr.T + b)
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    run(lib, "gptlocal_linear_bwd", x, w, dy, dx, dw, options=options)
    close(dx, dyr @ wr), close(dw, dyr.T @ xr)
    if precision:  # the weight held as bf16 bits: the same numbers
        y = np.zeros((rows, outer), np.float32)
        run(lib, "gptlocal_linear_bf16w_fwd", x, to_bfloat16_bits(w), b, y, options=options)
        close(y, xr @ wr.T + b)


@pytest.mark.parametrize("quick", [False, True])
@pytest.mark.parametrize("rows,inner,outer,threads", GEMMS)
def test_linear_gelu_cores(lib, rows, inner, outer, threads, quick):
    x, w, b, dy = f32(rows, inner), f32(outer, inner, scale=0.3), f32(outer), f32(rows, outer)
    options = table.LinearGeluOptions(threads, 0, int(quick))
    y, h = np.zeros((rows, outer), np.float32), np.zeros((rows, outer), np.float32)
    run(lib, "gptlocal_linear_gelu_fwd", x, w, b, y, h, options=options)
    want_h = x.astype(np.float64) @ w.T + b
    close(h, want_h), close(y, gelu(want_h, quick))
    dx, dw, db, scratch = np.zeros_like(x), np.zeros_like(w), np.zeros(outer, np.float32), np.zeros_like(h)
    run(lib, "gptlocal_linear_gelu_bwd", x, w, h, dy, dx, dw, db, scratch, options=options)
    step = 1e-6
    dh = dy * (gelu(h.astype(np.float64) + step, quick) - gelu(h.astype(np.float64) - step, quick)) / (2 * step)
    close(db, dh.sum(0), 1e-4), close(dx, dh @ w, 1e-4), close(dw, dh.T @ x, 1e-4)


def int8_scheme(x, q, scale, b):
    """The int8 Linear's numbers (cpu_linear_int8.cc): x quantized per row (max |x| -> 127, ties to even), the exact
    int product (int64 here), then acc * (x_scale * scale) + b in float32, as the core rounds them."""
    amax = np.abs(x).max(1, keepdims=True).astype(np.float32)
    xq = np.where(amax > 0, np.rint(x * (np.float32(127) / np.where(amax > 0, amax, 1))), 0)
    acc = xq.astype(np.int64) @ q.T.astype(np.int64)
    return acc.astype(np.float32) * ((amax / np.float32(127)).astype(np.float32) * scale) + b


@pytest.mark.parametrize("rows,inner,outer,threads", GEMMS + [(9, 2100, 70, 2), (6, 3072, 37, 1)])
def test_int8_linear_core(lib, rows, inner, outer, threads):
    """x quantized per row, the exact int product of full-range weights (-127 .. 127), scaled per row and channel,
    + b; a zero row gives b. K = 2100, 3072: row sums past 2^24, exact in int32 only."""
    x, b = f32(rows, inner), f32(outer)
    x[-1] = 0.0
    q = RNG.integers(-127, 128, (outer, inner)).astype(np.int8)
    scale = np.abs(f32(outer)) * 0.01
    y = np.zeros((rows, outer), np.float32)
    run(lib, "gptlocal_int8_linear_fwd", x, q, scale, b, y, options=table.ThreadOptions(threads))
    close(y, int8_scheme(x, q, scale, b), 1e-6)
    np.testing.assert_array_equal(y[-1], b)


@pytest.mark.parametrize("inner", [64, 3072])
def test_int8_linear_core_at_the_extremes(lib, inner):
    """x and w at +-127 everywhere (oneDNN's s8 GEMM without VNNI gives 8160 for 64 * 127 * 127): the exact sums,
    +-inner * 127 * 127, scaled as the scheme says, bit for bit."""
    x = np.ones((3, inner), np.float32)
    x[1] = -2.0  # quantized to -127 (its scale 2 / 127)
    x[2, ::2] = -1.0  # alternating signs: the sums cancel to 0
    q = np.full((5, inner), 127, np.int8)
    q[1] = -127
    scale, b = np.array([0.5, 0.25, 1.0, 2.0, 0.125], np.float32), np.zeros(5, np.float32)
    y = np.zeros((3, 5), np.float32)
    run(lib, "gptlocal_int8_linear_fwd", x, q, scale, b, y, options=table.ThreadOptions(2))
    want = int8_scheme(x, q, scale, b)
    assert want[0, 0] == np.float32(inner * 127 * 127 / 127 * 0.5)
    np.testing.assert_array_equal(y, want)


INT8_METHODS = {"dot_loop": 1, "onednn": 2}


def int8_matmul(lib, x, w, method, threads=2):
    acc = np.zeros((x.shape[0], w.shape[0]), np.int32)
    run(lib, "gptlocal_int8_matmul_fwd", x, w, acc, options=table.Int8Options(threads, method))
    return acc


@pytest.mark.parametrize("low", [-128, -127], ids=["full_range", "scheme_range"])
@pytest.mark.parametrize("rows,inner,outer,threads", GEMMS + [(1, 3072, 770, 2), (6, 1031, 67, 2), (70, 33, 129, 3)])
def test_int8_matmul_core_dot_loop_is_exact(lib, rows, inner, outer, threads, low):
    """Method 1 (the decoder's int8 GEMM, cpu_decoder.h int8_sums): xq w^T equal to the int64 product for any int8
    operands (-128 too: the plain loops) and for the scheme's [-127, 127] (AVX2's tiles where the CPU has them), on
    row counts that are and are not multiples of its four-row tiles and inner sizes not multiples of its 32-byte
    steps; the CPU's choice (method 0) gives the same."""
    x = RNG.integers(low, 128, (rows, inner)).astype(np.int8)
    w = RNG.integers(low, 128, (outer, inner)).astype(np.int8)
    want = x.astype(np.int64) @ w.T.astype(np.int64)
    np.testing.assert_array_equal(int8_matmul(lib, x, w, 1, threads), want)
    np.testing.assert_array_equal(int8_matmul(lib, x, w, 0, threads), want)


def test_int8_matmul_core_methods_and_the_cpu_rule(lib):
    """Method 0 runs oneDNN's s8s8s32 exactly where oneDNN has VNNI (gptlocal_int8_gemm_exact of its ISA), else the
    dot loop; oneDNN's is exact at the extremes there, and where the rule says no it is not (the reason for the
    rule: its int16 pair sums saturate); a method out of range fails the call."""
    lib.gptlocal_int8_gemm_exact.argtypes = [ctypes.c_int]
    exact = bool(lib.gptlocal_int8_gemm_exact(lib.gptlocal_cpu_isa()))
    lib.gptlocal_int8_method.argtypes = [ctypes.c_int]
    assert lib.gptlocal_int8_method(0) == (INT8_METHODS["onednn"] if exact else INT8_METHODS["dot_loop"])
    assert [lib.gptlocal_int8_method(m) for m in (1, 2)] == [1, 2]
    x, w = np.full((2, 64), 127, np.int8), np.full((3, 64), 127, np.int8)
    x[1] = -127
    want = x.astype(np.int64) @ w.T.astype(np.int64)
    assert np.array_equal(int8_matmul(lib, x, w, INT8_METHODS["onednn"]), want) == exact
    if exact:  # random full-range operands too
        x, w = (RNG.integers(-127, 128, shape).astype(np.int8) for shape in ((33, 300), (130, 300)))
        np.testing.assert_array_equal(int8_matmul(lib, x, w, 2), x.astype(np.int64) @ w.T.astype(np.int64))
    acc = np.zeros((2, 3), np.int32)
    assert call_core(lib, K["gptlocal_int8_matmul_fwd"], x[:2, :64].copy(), w[:3, :64].copy(), acc,
                     options=table.Int8Options(1, 3)) != 0


# ------------------------------------------------------------------------------------------- the train step's
@pytest.mark.parametrize("count,threads", [(1, 1), (4097, 1), (300001, 3)])
def test_square_sum_and_adamw_cores(lib, count, threads):
    x = f32(count)
    total = np.zeros(1, np.float32)
    run(lib, "gptlocal_square_sum_fwd", x, total, options=table.ThreadOptions(threads))
    close(total, [(x.astype(np.float64) ** 2).sum()])
    w, m, v, g = f32(count), f32(count), np.abs(f32(count)), f32(count)
    lr, beta1, beta2, eps, decay = (np.array([value], np.float32) for value in (1e-2, 0.9, 0.999, 1e-8, 0.1))
    want_m = m + (g - m) * (1 - 0.9)
    want_v = v + (g.astype(np.float64) ** 2 - v) * (1 - 0.999)
    want_w = w - 1e-2 * (want_m / (np.sqrt(want_v) + 1e-8) + 0.1 * w)
    run(lib, "gptlocal_adamw_fwd", w, m, v, g, lr, beta1, beta2, eps, decay, options=table.ThreadOptions(threads))
    close(m, want_m), close(v, want_v), close(w, want_w, 1e-4)


def test_lora_dropout_core(lib):
    x = f32(3, 1111)
    t1, t2 = (RNG.integers(0, 2, n).astype(np.float32) for n in (997, 1009))
    offsets = np.array([5, 1000], np.int32)
    index = np.arange(x.size)
    differ = t1[(index + 5) % 997] != t2[(index + 1000) % 1009]
    for mode, keep in ((1, ~differ), (2, differ)):
        y = np.zeros_like(x)
        run(lib, "gptlocal_lora_dropout_fwd", x, t1, t2, offsets, y, options=table.LoRADropoutOptions(1.25, mode, 2))
        close(y, x * (keep.reshape(x.shape) * 1.25))
    bad = np.array([997, 0], np.int32)  # an offset past its table: the call fails, nothing read past it
    assert call_core(lib, K["gptlocal_lora_dropout_fwd"], x, t1, t2, bad, np.zeros_like(x),
                     options=table.LoRADropoutOptions(1.25, 1, 1)) != 0


# ------------------------------------------------------------------------------------------- attention
@pytest.mark.parametrize("batch,heads,groups,seq,dim,block", [(2, 4, 4, 37, 24, 8), (1, 6, 2, 29, 13, 16)])
def test_attention_cores(lib, batch, heads, groups, seq, dim, block):
    q, k, v, dout = f32(batch, heads, seq, dim), f32(batch, groups, seq, dim), f32(batch, groups, seq, dim), \
        f32(batch, heads, seq, dim)
    bias = np.where(np.tril(np.ones((seq, seq))) > 0, 0.0, -1e9).astype(np.float32)[None, None]
    no_table, offsets = np.zeros(1, np.float32), np.zeros(2, np.int32)
    options = table.AttentionOptions(0.37, 1.0, 0, 2, block, block + 3)
    out, lse = np.zeros_like(q), np.zeros((batch, heads, seq), np.float32)
    run(lib, "gptlocal_attention_fwd", q, k, v, bias, no_table, no_table, offsets, out, lse, options=options)
    kk, vv = (np.repeat(a.astype(np.float64), heads // groups, axis=1) for a in (k, v))
    scores = 0.37 * q.astype(np.float64) @ kk.transpose(0, 1, 3, 2) + bias
    top = scores.max(-1, keepdims=True)
    p = np.exp(scores - top)
    close(lse, (top + np.log(p.sum(-1, keepdims=True)))[..., 0])
    p /= p.sum(-1, keepdims=True)
    close(out, p @ vv)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    run(lib, "gptlocal_attention_bwd", q, k, v, bias, no_table, no_table, offsets, out, lse, dout, dq, dk, dv,
        options=options)
    dp = dout.astype(np.float64) @ vv.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) * 0.37
    fold = lambda a: a.reshape(batch, groups, heads // groups, seq, dim).sum(2)  # noqa: E731
    close(dq, ds @ kk, 1e-4), close(dk, fold(ds.transpose(0, 1, 3, 2) @ q), 1e-4)
    close(dv, fold(p.transpose(0, 1, 3, 2) @ dout), 1e-4)
    bad = table.AttentionOptions(0.37, 1.0, 1, 1, block, block)  # dropout without its tables: refused
    assert call_core(lib, K["gptlocal_attention_fwd"], q, k, v, bias, no_table, no_table, offsets, out, lse,
                     options=bad) != 0


# ------------------------------------------------------------------------------------------- head + loss
def head_loss_reference(x, w, labels, weight):
    """float64: the weighted loss and its gradients with respect to x and w."""
    x, w = x.astype(np.float64), w.astype(np.float64)
    logits = x @ w.T
    top = logits.max(-1, keepdims=True)
    p = np.exp(logits - top)
    total = p.sum(-1, keepdims=True)
    p /= total
    rows = np.arange(len(x))
    safe = np.where(weight != 0, labels, 0)
    loss = float((weight * (top[:, 0] + np.log(total[:, 0]) - logits[rows, safe])).sum())
    g = p.copy()
    g[rows, safe] -= 1.0
    g *= weight[:, None]
    return loss, g @ w, g.T @ x


@pytest.mark.parametrize("rows,hidden,vocab,chunk,threads", [(37, 29, 1001, 8, 2), (5, 13, 67, 0, 1),
                                                             (19, 24, 4099, 19, 2)])
def test_head_loss_cores(lib, rows, hidden, vocab, chunk, threads):
    x, w = f32(rows, hidden), f32(vocab, hidden, scale=0.3)
    labels = RNG.integers(0, vocab, rows).astype(np.int32)
    weight = np.full(rows, 1.0 / rows, np.float32)
    weight[::4], labels[::4] = 0.0, -100  # ignored rows: their label is not read
    options = table.HeadLossOptions(threads, chunk)
    loss, gx, gw = np.zeros(1, np.float32), np.zeros_like(x), np.zeros_like(w)
    run(lib, "gptlocal_head_loss_fwd", x, w, labels, weight, loss, gx, gw, options=options)
    want_loss, want_gx, want_gw = head_loss_reference(x, w, labels, weight.astype(np.float64))
    close(loss, [want_loss]), close(gx, want_gx), close(gw, want_gw)
    dloss = np.array([1024.0], np.float32)  # a loss scale
    dx, dw = np.zeros_like(x), np.zeros_like(w)
    run(lib, "gptlocal_head_loss_bwd", gx, gw, dloss, dx, dw, options=options)
    np.testing.assert_array_equal(dx, gx * dloss[0]), np.testing.assert_array_equal(dw, gw * dloss[0])


def test_head_loss_core_refuses_a_counted_label_outside_the_vocabulary_with_nothing_written(lib):
    x, w = f32(6, 8), f32(11, 8)
    labels, weight = np.array([0, 3, 11, 2, -1, 5], np.int32), np.full(6, 0.5, np.float32)
    loss, gx, gw = np.full(1, 7.0, np.float32), np.full_like(x, 7.0), np.full_like(w, 7.0)
    for bad in (2, 4):  # 11 == vocab, -1
        weight[:] = 0.0
        weight[bad] = 0.5
        assert call_core(lib, K["gptlocal_head_loss_fwd"], x, w, labels, weight, loss, gx, gw,
                         options=table.HeadLossOptions(1, 0)) != 0
        assert (loss == 7.0).all() and (gx == 7.0).all() and (gw == 7.0).all()
