"""Linear's GEMM epilogues (cpu_linear.cc ``gptlocal_linear_gelu_fwd``/``_bwd``, ``gptlocal_linear_residual_fwd``;
kernels/cells/linear.py ``CPULinearEpilogue``) against the unfused kernels they replace, by value: gelu(x W^T + b) against
the GEMM kernel without the bias then the bias + GeLU kernel, r + x W^T + b against the GEMM kernel with the bias
then an Add; the output and every gradient (dx, dW, db, d residual), float32 and bf16 (oneDNN's GEMM and its forced
emulation), both GeLU forms, odd shapes (one row, seven rows, N not a multiple of 16, K = 3) and the two-thread
path. The model's use of them (cpu_kernels.gemm_epilogue): tests/model/test_gemm_epilogue.py."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal.kernels.cells import linear, norm_gelu

# (T, K, N): one row; seven rows, K = 3; N = 50 and 109 not multiples of 16; 64 x 40 x 130 runs on two threads
# (common.h gemm_threads: from 2^18 multiply-adds)
SHAPES = [(1, 24, 20), (7, 3, 50), (33, 77, 109), (64, 40, 130)]
CASES = [("float32", False), ("bfloat16", False), ("bfloat16", True)]  # True: the bf16 GEMM's emulation (precision 2)


def _data(shape):
    rows, k, n = shape
    rng = np.random.default_rng(rows * 1000 + k)
    return [rng.standard_normal(s).astype(np.float32) for s in ((rows, k), (n, k), (n,), (rows, n), (rows, n))]


def _values(fn, args, weight):
    """fn(*args) and the gradients of sum(fn(*args) * weight) for every argument, as numpy."""
    tensors = tuple(Tensor(a) for a in args)
    grads = ms.grad(lambda *a: (fn(*a) * Tensor(weight)).sum(), tuple(range(len(tensors))))(*tensors)
    return [fn(*tensors).asnumpy()] + [g.asnumpy() for g in grads]


def _close(got, want, names, tolerance):
    for name, actual, expected in zip(names, got, want):
        assert actual.shape == expected.shape, name
        scale = max(1.0, float(np.abs(expected).max()))
        np.testing.assert_allclose(actual, expected, atol=tolerance * scale, rtol=0, err_msg=name)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", ["tanh", "quick"])
@pytest.mark.parametrize("precision,emulate", CASES)
def test_gelu_epilogue_matches_gemm_then_bias_gelu(library, pynative_mode, shape, form, precision, emulate):
    """y, dx, dW, db of the fused node equal the GEMM kernel's x W^T then the bias + GeLU kernel's (the order of
    float32 sums aside: the bias goes in before the GEMM's sum, db sums by columns instead of row chunks)."""
    x, w, b, _, g = _data(shape)
    gemm = linear.CPULinearGEMM(library, threads=2, precision=precision, emulate=emulate)
    bias_gelu = norm_gelu.CPUBiasGeLU(library, form, threads=2)
    want = _values(lambda x, w, b: bias_gelu(gemm(x, w), b), (x, w, b), g)
    fused = linear.CPULinearEpilogue(library, form, threads=2, precision=precision, emulate=emulate)
    got = _values(fused.gelu, (x, w, b), g)
    _close(got, want, ("y", "dx", "dw", "db"), 2e-6)
    assert np.abs(got[0] - want[0]).max() <= 1e-6 * max(1.0, float(np.abs(want[0]).max()))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision,emulate", CASES)
def test_residual_epilogue_matches_gemm_then_add(library, pynative_mode, shape, precision, emulate):
    """r + x W^T + b and dx, dW, db, d residual equal the GEMM kernel with the bias, then r + its output."""
    x, w, b, r, g = _data(shape)
    gemm = linear.CPULinearGEMM(library, threads=2, precision=precision, emulate=emulate)
    want = _values(lambda x, w, b, r: r + gemm(x, w, b), (x, w, b, r), g)
    fused = linear.CPULinearEpilogue(library, "tanh", threads=2, precision=precision, emulate=emulate)
    got = _values(fused.residual, (x, w, b, r), g)
    _close(got, want, ("y", "dx", "dw", "db", "dresidual"), 1e-6)
    np.testing.assert_array_equal(got[4], g)  # d residual is dy itself


def test_bf16_epilogue_rounds_like_the_bf16_gemm(library, pynative_mode):
    """The bf16 epilogue is not float32's: its output differs from the float32 epilogue's (the operands are rounded)
    while matching the unfused bf16 path (above) - so the precision reaches the fused GEMMs."""
    x, w, b, _, g = _data(SHAPES[2])
    bf16 = _values(linear.CPULinearEpilogue(library, "tanh", threads=2, precision="bfloat16").gelu, (x, w, b), g)
    fp32 = _values(linear.CPULinearEpilogue(library, "tanh", threads=2).gelu, (x, w, b), g)
    for name, low, full in zip(("y", "dx", "dw"), bf16, fp32):
        assert np.abs(low - full).max() > 1e-4, name
    np.testing.assert_allclose(bf16[0], fp32[0], atol=0.1)
