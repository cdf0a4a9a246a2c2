"""``CPULayerNorm`` and ``CPUBiasGeLU``: the LayerNorm and bias + GeLU kernels (``cpu_norm_gelu.cc``) as Cells.

Each is two AOT ``ops.Custom`` primitives, the forward and the backward, the second attached as the first's
``bprop``, so they run inside the compiled GRAPH-mode model (and in PYNATIVE). ``layernorm_kernel(...)`` and
``bias_gelu_kernel(...)`` decide at build time whether the kernel can be used and return None otherwise: silently
for a dtype other than float32 (the model chose it), after one warning line per process where the library
cannot be built (no compiler...); the caller then keeps its plain MindSpore ops, which stay the reference.
"""
import functools

from mindspore import nn, ops

from . import build
from .args import BiasGeluArgs, LayerNormArgs
from .aot import custom_op, float32_library, kernel_threads

GELU_FORMS = {"tanh": 0, "quick": 1}
_warn_once = functools.partial(build.warn_once,
                               "CPU LayerNorm and bias + GeLU kernels off, MindSpore's ops used instead")


class CPULayerNorm(nn.Cell):
    """``construct(x [..., H], gamma [H], beta [H])`` -> LayerNorm over the last axis, float32; the same values
    as ``ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon)``'s first output."""

    def __init__(self, library_path, epsilon, threads=None):
        super().__init__()
        threads = kernel_threads() if threads is None else threads
        self.config = LayerNormArgs(epsilon, threads).tensor()
        self.backward = custom_op(library_path, "gptlocal_layernorm_bwd", lambda x, g, m, r, dy, c: (x, g, g),
                                lambda x, g, m, r, dy, c: (x, g, g))
        self.forward = custom_op(library_path, "gptlocal_layernorm_fwd", lambda x, g, b, c: (x, x[:-1], x[:-1]),
                               lambda x, g, b, c: (x, x, x), bprop=self._bprop)

    def _bprop(self, x, gamma, beta, config, out, dout):
        dx, dgamma, dbeta = self.backward(x, gamma, out[1], out[2], dout[0], config)
        return dx, dgamma, dbeta, ops.zeros_like(config)

    def construct(self, x, gamma, beta):
        return self.forward(x, gamma, beta, self.config)[0]


class CPUBiasGeLU(nn.Cell):
    """``construct(x [..., F], bias [F])`` -> gelu(x + bias), float32, ``form`` "tanh" (GPT-2's ``gelu_new``,
    the plain path's ``TanhGeLU``) or "quick" (``quick_gelu``, x * sigmoid(1.702 x), MindSpore's FastGeLU).
    The backward recomputes from ``x`` and ``bias``: nothing else is kept."""

    def __init__(self, library_path, form, threads=None):
        super().__init__()
        threads = kernel_threads() if threads is None else threads
        self.config = BiasGeluArgs(GELU_FORMS[form], threads).tensor()
        self.backward = custom_op(library_path, "gptlocal_bias_gelu_bwd", lambda x, b, dy, c: (x, b),
                                lambda x, b, dy, c: (x, b))
        self.forward = custom_op(library_path, "gptlocal_bias_gelu_fwd", lambda x, b, c: x, lambda x, b, c: x,
                               bprop=self._bprop)

    def _bprop(self, x, bias, config, out, dout):
        dx, dbias = self.backward(x, bias, dout, config)
        return dx, dbias, ops.zeros_like(config)

    def construct(self, x, bias):
        return self.forward(x, bias, self.config)


def layernorm_kernel(epsilon, dtype, **kwargs):
    """A ``CPULayerNorm`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPULayerNorm(path, epsilon, **kwargs)


def bias_gelu_kernel(form, dtype, **kwargs):
    """A ``CPUBiasGeLU`` for ``form`` ("tanh" or "quick") or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPUBiasGeLU(path, form, **kwargs)
