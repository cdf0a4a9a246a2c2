"""Linear's GEMM epilogues (cpu_linear.cc ``gptlocal_linear_gelu_fwd``/``_bwd``, ``gptlocal_linear_residual_fwd``;
kernels/cells/linear.py ``CPULinearEpilogue``) against the unfused kernels they replace, by value: gelu(x W^T + b) against
the GEMM kernel without the bias then the bias + GeLU kernel, r + x W^T + b against the GEMM kernel with the bias
then an Add, both held to float64 within float32's rounding (bounds from the computation, whatever order each ISA
sums in); the output and every gradient (dx, dW, db, d residual), float32 and bf16 (oneDNN's GEMM and its forced
emulation), both GeLU forms, odd shapes (one row, seven rows, N not a multiple of 16, K = 3) and the two-thread
path. The model's use of them (cpu_kernels.gemm_epilogue): tests/model/test_gemm_epilogue.py."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal.kernels.cells import linear, norm_gelu
from references import assert_within_rounding, bf16_spread, gamma, gelu_float64, gelu_second_float64, round_bf16

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


def _within(values, exact, bounds, names, side):
    """Each value within its absolute bound (float64) of the float64 reference."""
    for name, actual, precise, bound in zip(names, values, exact, bounds):
        assert actual.shape == precise.shape, name
        assert_within_rounding(actual, precise, bound / gamma(1), 1, sides=1, name=f"{name} {side} vs float64")


def _operands(x, w, precision):
    """The GEMMs' operands as float64: rounded to bfloat16 first for the bf16 GEMM and its emulation."""
    rounded = (round_bf16(a) for a in (x, w)) if precision == "bfloat16" else (x, w)
    return [a.astype(np.float64) for a in rounded]


def _gemm_backward(dz, dz_error, xr, wr, precision):
    """dx = dz w, dw = dz^T x from an operand dz known to within dz_error (float64 both), and their bounds: the error
    carried through each product plus gamma of the product's length over its sums of |terms|. bf16: dz is rounded
    to bfloat16 first, so the reference rounds the float64 dz too and the operand is known to bf16_spread."""
    if precision == "bfloat16":
        dz_error = bf16_spread(dz, dz_error)
        dz = round_bf16(dz.astype(np.float32)).astype(np.float64)
    rows, n = dz.shape
    adz, aw, ax = np.abs(dz) + dz_error, np.abs(wr), np.abs(xr)
    return ([dz @ wr, dz.T @ xr],
            [dz_error @ aw + gamma(n) * adz @ aw, dz_error.T @ ax + gamma(rows) * adz.T @ ax])


def _gelu_reference(x, w, b, g, form, precision):
    """y = gelu(x W^T + b) and the gradients of sum(y * g) (dx, dW, db) in float64 and their float32 bounds: u's
    sum of K + 1 terms within gamma_{K+1} of its |terms|, moved through gelu by |gelu'| and through gelu' by
    |gelu''|, plus the elementwise roundings (references.py gelu_float64); the GEMMs' as ``_gemm_backward``."""
    xr, wr = _operands(x, w, precision)
    u = xr @ wr.T + b
    u_error = gamma(x.shape[1] + 1) * (np.abs(xr) @ np.abs(wr).T + np.abs(b))
    y, slope, y_bound, slope_bound = gelu_float64(u, form)
    dz = g * slope
    dz_error = np.abs(g) * (gelu_second_float64(u, form) * u_error + gamma(1) * slope_bound)
    (dx, dw), (dx_bound, dw_bound) = _gemm_backward(dz, dz_error, xr, wr, precision)
    db, db_bound = dz.sum(0), dz_error.sum(0) + gamma(x.shape[0]) * np.abs(dz).sum(0)
    return [y, dx, dw, db], [np.abs(slope) * u_error + gamma(1) * y_bound, dx_bound, dw_bound, db_bound]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("form", ["tanh", "quick"])
@pytest.mark.parametrize("precision,emulate", CASES)
def test_gelu_epilogue_matches_gemm_then_bias_gelu(library, pynative_mode, shape, form, precision, emulate):
    """y, dx, dW, db of the fused node and of the GEMM kernel's x W^T then the bias + GeLU kernel's, each within
    float32's rounding of float64 (``_gelu_reference``): the two sum in different orders (the bias goes in before
    the GEMM's sum, db sums by columns instead of row chunks; oneDNN's order per ISA), so each is held to the exact
    value, neither to the other's rounding."""
    x, w, b, _, g = _data(shape)
    gemm = linear.CPULinearGEMM(library, threads=2, precision=precision, emulate=emulate)
    bias_gelu = norm_gelu.CPUBiasGeLU(library, form, threads=2)
    want = _values(lambda x, w, b: bias_gelu(gemm(x, w), b), (x, w, b), g)
    fused = linear.CPULinearEpilogue(library, form, threads=2, precision=precision, emulate=emulate)
    got = _values(fused.gelu, (x, w, b), g)
    exact, bounds = _gelu_reference(x, w, b, g, form, precision)
    _within(got, exact, bounds, ("y", "dx", "dw", "db"), "fused")
    _within(want, exact, bounds, ("y", "dx", "dw", "db"), "unfused")


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("precision,emulate", CASES)
def test_residual_epilogue_matches_gemm_then_add(library, pynative_mode, shape, precision, emulate):
    """r + x W^T + b and dx, dW, db, d residual of the fused node and of the GEMM kernel with the bias then r + its
    output, each within float32's rounding of float64 (y: a sum of K + 2 terms; dx, dW: the GEMMs on dy, rounded
    to bfloat16 for the bf16 GEMM; db: T terms); d residual is dy itself."""
    x, w, b, r, g = _data(shape)
    gemm = linear.CPULinearGEMM(library, threads=2, precision=precision, emulate=emulate)
    want = _values(lambda x, w, b, r: r + gemm(x, w, b), (x, w, b, r), g)
    fused = linear.CPULinearEpilogue(library, "tanh", threads=2, precision=precision, emulate=emulate)
    got = _values(fused.residual, (x, w, b, r), g)
    xr, wr = _operands(x, w, precision)
    g64 = g.astype(np.float64)
    (dx, dw), (dx_bound, dw_bound) = _gemm_backward(g64, np.zeros_like(g64), xr, wr, precision)
    exact = [r + xr @ wr.T + b, dx, dw, g64.sum(0)]
    bounds = [gamma(x.shape[1] + 2) * (np.abs(xr) @ np.abs(wr).T + np.abs(b) + np.abs(r)), dx_bound, dw_bound,
              gamma(x.shape[0]) * np.abs(g64).sum(0)]
    names = ("y", "dx", "dw", "db")
    _within(got[:4], exact, bounds, names, "fused")
    _within(want[:4], exact, bounds, names, "unfused")
    np.testing.assert_array_equal(got[4], g)  # d residual is dy itself
    np.testing.assert_array_equal(want[4], g)


def test_bf16_epilogue_rounds_like_the_bf16_gemm(library, pynative_mode):
    """The bf16 epilogue is not float32's: its output differs from the float32 epilogue's (the operands are rounded)
    while matching the unfused bf16 path (above) - so the precision reaches the fused GEMMs."""
    x, w, b, _, g = _data(SHAPES[2])
    bf16 = _values(linear.CPULinearEpilogue(library, "tanh", threads=2, precision="bfloat16").gelu, (x, w, b), g)
    fp32 = _values(linear.CPULinearEpilogue(library, "tanh", threads=2).gelu, (x, w, b), g)
    for name, low, full in zip(("y", "dx", "dw"), bf16, fp32):
        assert np.abs(low - full).max() > 1e-4, name
    np.testing.assert_allclose(bf16[0], fp32[0], atol=0.1)
