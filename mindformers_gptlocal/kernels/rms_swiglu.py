"""``CPURMSNorm`` and ``CPUSwiGLU``: the Llama-style block's RMSNorm and silu(gate) * up (``cpu_rms_swiglu.cc``)
as Cells.

Each is two AOT ``ops.Custom`` primitives, the forward and the backward, the second attached as the first's
``bprop``, so they run inside the compiled GRAPH-mode model (and in PYNATIVE) and in training. ``rmsnorm_kernel``
and ``swiglu_kernel`` decide at build time whether the kernel can be used and return None otherwise: silently for
a dtype other than float32, after one warning line per process where the library cannot be built; the caller then
keeps its plain MindSpore ops (``model/layers.py`` RMSNorm, ``model/layers.py`` SiLU + Mul), the reference.
"""
import functools

from mindspore import nn, ops

from . import build
from .args import RMSNormArgs, SwiGLUArgs
from .aot import custom_op, float32_library, kernel_threads

_warn_once = functools.partial(build.warn_once, "CPU RMSNorm and SwiGLU kernels off, MindSpore's ops used instead")


class CPURMSNorm(nn.Cell):
    """``construct(x [..., H], weight [H])`` -> x * rsqrt(mean(x^2) + eps) * weight over the last axis, float32;
    the forward keeps the rows' rsqrt [...] for the backward."""

    def __init__(self, library_path, epsilon, threads=None):
        super().__init__()
        threads = kernel_threads() if threads is None else threads
        self.config = RMSNormArgs(epsilon, threads).tensor()
        self.backward = custom_op(library_path, "gptlocal_rmsnorm_bwd", lambda x, w, r, dy, c: (x, w),
                                lambda x, w, r, dy, c: (x, w))
        self.forward = custom_op(library_path, "gptlocal_rmsnorm_fwd", lambda x, w, c: (x, x[:-1]),
                               lambda x, w, c: (x, x), bprop=self._bprop)

    def _bprop(self, x, weight, config, out, dout):
        dx, dweight = self.backward(x, weight, out[1], dout[0], config)
        return dx, dweight, ops.zeros_like(config)

    def construct(self, x, weight):
        return self.forward(x, weight, self.config)[0]


class CPUSwiGLU(nn.Cell):
    """``construct(gate, up)`` (one shape, float32) -> silu(gate) * up, silu(g) = g * sigmoid(g); the backward
    recomputes the sigmoid from ``gate``: nothing else is kept."""

    def __init__(self, library_path, threads=None):
        super().__init__()
        threads = kernel_threads() if threads is None else threads
        self.config = SwiGLUArgs(threads).tensor()
        self.backward = custom_op(library_path, "gptlocal_swiglu_bwd", lambda g, u, dy, c: (g, g),
                                lambda g, u, dy, c: (g, g))
        self.forward = custom_op(library_path, "gptlocal_swiglu_fwd", lambda g, u, c: g, lambda g, u, c: g,
                               bprop=self._bprop)

    def _bprop(self, gate, up, config, out, dout):
        dgate, dup = self.backward(gate, up, dout, config)
        return dgate, dup, ops.zeros_like(config)

    def construct(self, gate, up):
        return self.forward(gate, up, self.config)


def rmsnorm_kernel(epsilon, dtype, **kwargs):
    """A ``CPURMSNorm`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPURMSNorm(path, epsilon, **kwargs)


def swiglu_kernel(dtype, **kwargs):
    """A ``CPUSwiGLU`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPUSwiGLU(path, **kwargs)
