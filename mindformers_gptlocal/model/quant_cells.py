"""The Cells of an int8 model (``quantization.py``: the scheme and the format): ``QuantLinear`` (a Linear of int8
weights and per-channel scales; the layer spec picks it for every Linear path, ``layer_spec.py``), ``Int8MatMul``
(x [T, K] float32 times an int8 [N, K] table's transpose with its scales: the CPU kernel ``kernels/cells/linear_int8.py``
where the provider gives it, else the same scheme in MindSpore ops, the reference) and the token table's lookup
(``int8_lookup``). Inference only: an int8 model has no float weights to train (its Parameters do not require
gradients, and a run or a checkpoint load that tries is refused before, with one line).
"""
import numpy as np
import mindspore as ms
from mindspore import nn, ops, Parameter, Tensor

from .layers import LeavesBias


def int8_parameter(shape, name):
    """An int8 Parameter of zeros (the loader fills it)."""
    return Parameter(Tensor(np.zeros(shape, np.int8)), name=name, requires_grad=False)


def scale_parameter(rows, name):
    """Its float32 per-row scales (ones until loaded)."""
    return Parameter(Tensor(np.ones((rows,), np.float32)), name=name, requires_grad=False)


class Int8MatMul(nn.Cell):
    """``construct(x [T, K] float32, weight [N, K] int8, scale [N] float32, bias [N] or None)`` -> [T, N] float32:
    x quantized per row (scale max |x| / 127, round, clip to +-127), times the int8 weight, exact in int32 in the
    kernel (in float32 on the plain path: exact while the row sums stay below 2^24), then times both scales
    (+ bias). ``kernel``: the provider's ``int8_linear`` Cell, or None for the plain ops; the forward is picked
    here (``product``), never in ``construct``."""

    def __init__(self, kernel=None):
        super().__init__()
        self.kernel = kernel
        self.matmul = ops.MatMul(transpose_b=True)
        self.row_max = ops.ReduceMax(keep_dims=True)
        self.use_kernel = kernel is not None
        self.product = self._kernel_product if self.use_kernel else self._plain_product

    def construct(self, x, weight, scale, bias=None):
        return self.product(x, weight, scale, bias)

    def _kernel_product(self, x, weight, scale, bias):
        return self.kernel(x, weight, scale, bias)

    def _plain_product(self, x, weight, scale, bias):
        amax = self.row_max(ops.abs(x), -1)
        positive = amax > 0
        inverse = ops.select(positive, 127.0 / ops.select(positive, amax, ops.ones_like(amax)), ops.zeros_like(amax))
        quantized = ops.clip_by_value(ops.round(x * inverse), -127.0, 127.0)
        acc = self.matmul(quantized, ops.cast(weight, ms.float32))
        y = acc * ((amax / 127.0) * ops.reshape(scale, (1, -1)))
        if bias is not None:
            y = y + ops.reshape(bias, (1, -1))
        return y


def int8_matmul(kernels, compute_dtype=ms.float32):
    """An ``Int8MatMul`` with the provider's kernel where it gives one."""
    return Int8MatMul(kernels.int8_linear(compute_dtype))


class QuantLinear(LeavesBias, nn.Cell):
    """A Linear of an int8 model: ``weight`` int8 [out, in], ``weight_scale`` float32 [out], ``bias`` float32; built
    with ``Linear``'s arguments (``init_std``, ``params_dtype`` unused: the loader fills the weights), the same
    ``skip_bias_add`` contract (fc1 under the bias + GeLU kernel; setting it picks the product again).
    Activations are float32 in and out. ``kernels``: the model's ``KernelProvider`` (required)."""

    def __init__(self, in_features, out_features, init_std, params_dtype, compute_dtype, has_bias=True,
                 skip_bias_add=False, *, kernels):  # pylint: disable=unused-argument
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = int8_parameter((out_features, in_features), "weight")
        self.weight_scale = scale_parameter(out_features, "weight_scale")
        self.has_bias = has_bias
        if has_bias:
            self.bias = Parameter(Tensor(np.zeros((out_features,), np.float32)), name="bias", requires_grad=False)
        self.product = int8_matmul(kernels)
        self.skip_bias_add = skip_bias_add

    def _bind_bias(self):
        """The product with or without the bias (``LeavesBias``)."""
        self.rows_product = self._biased if self.adds_bias else self._bare

    def construct(self, x, dropout_step=None):  # pylint: disable=unused-argument
        shape = x.shape
        y = self.rows_product(ops.reshape(ops.cast(x, ms.float32), (-1, shape[-1])))
        return ops.reshape(y, shape[:-1] + (self.out_features,))

    def _biased(self, rows):
        return self.product(rows, self.weight, self.weight_scale, self.bias)

    def _bare(self, rows):
        return self.product(rows, self.weight, self.weight_scale)


def int8_lookup(gather, table, scale, input_ids):
    """Rows ``input_ids`` of an int8 table as float32: the int8 row times its scale."""
    rows = ops.cast(gather(table, input_ids, 0), ms.float32)
    return rows * ops.expand_dims(gather(scale, input_ids, 0), -1)
