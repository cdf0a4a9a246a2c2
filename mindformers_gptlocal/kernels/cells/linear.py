"""``CPULinearGEMM``: Linear's y = x W^T (+ b) (``cpu_linear.cc``, oneDNN's sgemm on column blocks) as a Cell.

AOT ``ops.Custom`` primitives: the forward without and with the bias (one node for x W^T + b: no BroadcastTo + Add
after it) and the backward (dx and dW; db is dy's column sum), attached as the forwards' ``bprop``, so they run
inside the compiled GRAPH-mode model (and in PYNATIVE) and in training.
``linear_gemm_kernel`` returns None where it cannot run: silently for a dtype other than float32, after one warning
line per process where the library cannot be built; ``model/layers.py`` Linear then keeps ``ops.MatMul``, the
reference.

``precision`` (``abi/precision.py`` ``PRECISIONS``): "float32", or "bfloat16" (``compute_dtype: bfloat16`` on CPU: every GEMM, forward
and both backward, bf16 x bf16 with float32 accumulation and output, oneDNN's ``dnnl_gemm_bf16bf16f32``; where
oneDNN has no fast bf16 GEMM for this CPU (below AVX-512: the library decides by the ISA oneDNN sees,
``cpu_linear.cc``) the kernel emulates it, the same rounding and float32 sums, and ``bf16_native`` says so in one
line per process); ``emulate=True`` forces the emulation (tests).

``bf16_weights=True`` (precision "bfloat16" only): the Cell takes the weight as a bfloat16 tensor, held so once (an
inference build of a bf16 model, ``KernelProvider.bf16_weights``), and runs ``gptlocal_linear_bf16w_fwd``: the same
forward numbers without converting the weight at every call; inference only (no bprop).
"""
import functools

import mindspore as ms
from mindspore import nn, ops

from ..abi import build
from ..abi.aot import float32_library, primitive
from ..abi.precision import precision_code
from .norm_gelu import gelu_form
from ..abi.table import KERNELS, LinearGeluOptions, LinearOptions

_warn_once = functools.partial(build.warn_once, "CPU Linear GEMM kernel off, MindSpore's MatMul used instead")
class CPULinearGEMM(nn.Cell):
    """``construct(x [T, K], w [N, K], b [N] or None)`` -> x w^T (+ b) [T, N], float32, as
    ``ops.MatMul(transpose_b=True)`` (then ``ops.Add``); with ``precision="bfloat16"`` as ``BF16MatMul`` (below)
    (x and w rounded to bfloat16; the gradients from dy rounded too); with ``bf16_weights`` w is bfloat16 and there
    is no backward."""

    def __init__(self, library_path, threads=None, precision="float32", emulate=False, bf16_weights=False):
        super().__init__()
        self.precision = precision
        if bf16_weights and precision != "bfloat16":
            raise ValueError("CPULinearGEMM bf16_weights takes precision 'bfloat16'")
        self.config = LinearOptions(threads, precision_code(library_path, precision, emulate)).tensor()
        self.bias_grad = ops.ReduceSum()
        if bf16_weights:  # one symbol without and with the bias: no bprop to key by it
            self.forward = primitive(library_path, KERNELS["gptlocal_linear_bf16w_fwd"])
            self.forward_bias = primitive(library_path, KERNELS["gptlocal_linear_bf16w_fwd"])
            return
        self.backward = primitive(library_path, KERNELS["gptlocal_linear_bwd"])
        self.forward = primitive(library_path, KERNELS["gptlocal_linear_fwd"], bprop=self._bprop)
        self.forward_bias = primitive(library_path, KERNELS["gptlocal_linear_fwd_bias"], bprop=self._bprop_bias)

    def _bprop(self, x, weight, config, out, dout):
        dx, dweight = self.backward(x, weight, dout, config)
        return dx, dweight, ops.zeros_like(config)

    def _bprop_bias(self, x, weight, bias, config, out, dout):
        dx, dweight = self.backward(x, weight, dout, config)
        return dx, dweight, self.bias_grad(dout, 0), ops.zeros_like(config)

    def construct(self, x, weight, bias=None):
        if bias is None:
            return self.forward(x, weight, self.config)
        return self.forward_bias(x, weight, bias, self.config)


class CPULinearEpilogue(nn.Cell):
    """The GEMM kernel with what follows it in the MLP fused into each column block (``cpu_kernels.gemm_epilogue``;
    ``model/gpt.py`` ``EpilogueFeedForward``): ``gelu(x, w, b)`` -> gelu(x w^T + b), the GeLU ``form`` "tanh" or
    "quick" of the bias + GeLU kernel, and ``residual(x, w, b, r)`` -> r + x w^T + b; ``precision`` and ``emulate``
    as ``CPULinearGEMM``'s, whose numbers they give (the bias + GeLU and the Add after it), forward and backward."""

    def __init__(self, library_path, form, threads=None, precision="float32", emulate=False):
        super().__init__()
        code = precision_code(library_path, precision, emulate)
        self.config = LinearOptions(threads, code).tensor()
        self.gelu_config = LinearGeluOptions(threads, code, gelu_form(form)).tensor()
        self.backward = primitive(library_path, KERNELS["gptlocal_linear_bwd"])
        self.gelu_forward = primitive(library_path, KERNELS["gptlocal_linear_gelu_fwd"])  # its bprop: the table's
        self.residual_forward = primitive(library_path, KERNELS["gptlocal_linear_residual_fwd"],
                                          bprop=self._bprop_residual)
        self.bias_grad = ops.ReduceSum()

    def _bprop_residual(self, x, weight, bias, residual, config, out, dout):
        dx, dweight = self.backward(x, weight, dout, config)
        return dx, dweight, self.bias_grad(dout, 0), dout, ops.zeros_like(config)

    def gelu(self, x, weight, bias):
        """x [T, K], w [N, K], b [N] -> gelu(x w^T + b) [T, N]."""
        return self.gelu_forward(x, weight, bias, self.gelu_config)[0]

    def residual(self, x, weight, bias, residual):
        """x [T, K], w [N, K], b [N], residual [T, N] -> residual + x w^T + b."""
        return self.residual_forward(x, weight, bias, residual, self.config)

    def construct(self, x, weight, bias):
        return self.gelu(x, weight, bias)


def linear_gemm_kernel(dtype, **kwargs):
    """A ``CPULinearGEMM`` or None (after one warning) where it cannot run; ``dtype``: the graph's (float32),
    ``kwargs``: the Cell's (``precision``, ``threads``, ``bf16_weights``)."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPULinearGEMM(path, **kwargs)


def linear_epilogue_kernel(form, dtype, **kwargs):
    """A ``CPULinearEpilogue`` for the GeLU ``form`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPULinearEpilogue(path, form, **kwargs)


def round_bf16(x):
    """x (float32) rounded to the nearest bfloat16, kept float32: a Cast there and back."""
    return ops.cast(ops.cast(x, ms.bfloat16), ms.float32)


class BF16MatMul(nn.Cell):
    """x W^T on a float32 graph with bfloat16 GEMM numerics (``KernelProvider.gemm_dtype`` bfloat16 where the GEMM
    kernel is not used: ``cpu_kernels: plain`` or ``{linear: plain}``; ``KernelProvider.plain_matmul``): x and W
    rounded to bfloat16, float32 MatMul; its backward rounds dy as well, dx = r(dy) r(W), dW = r(dy)^T r(x), as the
    kernel's bf16 GEMMs compute them (``kernels/cells/linear.py``, tested against this by value). Autodiff of the casts
    alone would round dx and dW after an unrounded dy instead."""

    def __init__(self):
        super().__init__()
        self.matmul = ops.MatMul(transpose_b=True)
        self.dx_matmul = ops.MatMul()
        self.dw_matmul = ops.MatMul(transpose_a=True)

    def construct(self, x, weight):
        return self.matmul(round_bf16(x), round_bf16(weight))

    def bprop(self, x, weight, out, dout):
        dy = round_bf16(dout)
        return self.dx_matmul(dy, round_bf16(weight)), self.dw_matmul(dy, round_bf16(x))
