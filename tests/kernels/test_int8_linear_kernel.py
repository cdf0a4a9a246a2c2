"""An int8 model's Linear (kernels/cells/linear_int8.py, cpu_linear_int8.cc; model/quant_cells.py Int8MatMul): the kernel
against a numpy int64 reference of the same scheme (exact up to float32 rounding of the last multiply) and against
the plain MindSpore path (model/quant_cells.py, the reference on other backends), on odd shapes, with and without
bias, rows of zeros; the int8 result near the float product; the provider's choice."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal.kernels.cells import linear_int8
from mindformers_gptlocal.kernels.provider import KernelProvider
from mindformers_gptlocal.model.quant_cells import Int8MatMul, QuantLinear
from mindformers_gptlocal.model.quantization import dequantize_rows, quantize_rows
from references import int8_linear_reference


def _case(rows, inner, outer, seed, zero_rows=()):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    for row in zero_rows:
        x[row] = 0
    weight = (rng.standard_normal((outer, inner)) * 0.05).astype(np.float32)
    weight[outer // 2] = 0  # a zero output channel: scale 0
    bias = rng.standard_normal(outer).astype(np.float32)
    quantized, scale = quantize_rows(weight)
    return x, weight, quantized, scale, bias


@pytest.mark.parametrize("rows,inner,outer", [(1, 77, 109), (3, 77, 109), (17, 200, 37), (40, 129, 300)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_matches_the_numpy_scheme_and_the_plain_path(library, pynative_mode, rows, inner, outer, with_bias,
                                                            isa_tier):
    x, weight, quantized, scale, bias = _case(rows, inner, outer, rows * 1000 + inner,
                                              zero_rows=(rows - 1,) if rows > 1 else ())
    args = [Tensor(x), Tensor(quantized), Tensor(scale)] + ([Tensor(bias)] if with_bias else [])
    kernel = linear_int8.CPUInt8Linear(library, threads=2)
    got = kernel(*args).asnumpy()
    want = int8_linear_reference(x, quantized, scale, bias if with_bias else None)
    assert got.shape == (rows, outer) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    if rows > 1:  # the zero row: the bias alone
        np.testing.assert_array_equal(got[-1], bias if with_bias else np.zeros(outer, np.float32))
    assert np.all(got[:, outer // 2] == (bias[outer // 2] if with_bias else 0))
    plain = Int8MatMul(None)(*args).asnumpy()
    np.testing.assert_allclose(plain, want, rtol=1e-5, atol=1e-5 * max(1.0, float(np.abs(want).max())))
    # and the int8 product is near the float one (int8 error: a few per cent of the row's scale)
    exact = x.astype(np.float64) @ weight.astype(np.float64).T + (bias if with_bias else 0)
    spread = float(np.abs(exact).max())
    assert np.abs(got - exact).max() < 0.03 * spread


def test_a_large_inner_size_runs_exactly_in_int32(library, pynative_mode):
    """K = 3072 (fc2): sums beyond 2^24, where only an int32 product is exact; 2 threads on column blocks."""
    x, _, quantized, scale, bias = _case(5, 3072, 70, 3)
    got = linear_int8.CPUInt8Linear(library, threads=2)(Tensor(x), Tensor(quantized), Tensor(scale),
                                                       Tensor(bias)).asnumpy()
    np.testing.assert_allclose(got, int8_linear_reference(x, quantized, scale, bias), rtol=1e-6, atol=1e-6)


def test_quantize_rows_round_trip():
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((9, 31)).astype(np.float32)
    weight[4] = 0
    quantized, scale = quantize_rows(weight)
    assert quantized.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (9,)
    assert np.all(np.abs(quantized).max(axis=1)[[0, 1, 2, 3, 5, 6, 7, 8]] == 127) and scale[4] == 0
    assert np.abs(dequantize_rows(quantized, scale) - weight).max() <= scale.max() / 2 + 1e-7


@pytest.mark.parametrize("mode,kernel", [("auto", True), ("kernel", True), ("plain", False)])
def test_quant_linear_takes_the_kernel_from_the_provider(library, graph_mode, mode, kernel):
    """QuantLinear (the layer spec's Linear of an int8 model) on [B, S, in] in a compiled graph: the provider's
    kernel where ``cpu_kernels.int8_linear`` allows it, the plain ops with ``plain``; the same values either way."""
    layer = QuantLinear(77, 109, 0.02, ms.float32, ms.float32, kernels=KernelProvider({"int8_linear": mode}))
    assert (layer.product.kernel is not None) == kernel
    x, _, quantized, scale, bias = _case(6, 77, 109, 11)
    layer.weight.set_data(Tensor(quantized))
    layer.weight_scale.set_data(Tensor(scale))
    layer.bias.set_data(Tensor(bias))
    got = layer(Tensor(x.reshape(2, 3, 77))).asnumpy()
    np.testing.assert_allclose(got.reshape(6, 109), int8_linear_reference(x, quantized, scale, bias),
                               rtol=1e-5, atol=1e-5 * 4)
    assert KernelProvider({"int8_linear": mode}, device_target="Ascend").int8_linear(ms.float32) is None
