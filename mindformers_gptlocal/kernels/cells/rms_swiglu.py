"""``CPURMSNorm`` and ``CPUSwiGLU``: the Llama-style block's RMSNorm and silu(gate) * up (``cpu_rmsnorm.cc``,
``cpu_swiglu.cc``; ``table.py``) as Cells.

Each is the forward's AOT ``ops.Custom`` with the backward's attached as its ``bprop`` (``aot.primitive``), so they run
inside the compiled GRAPH-mode model (and in PYNATIVE) and in training. ``rmsnorm_kernel`` and ``swiglu_kernel``
decide at build time whether the kernel can be used and return None otherwise: silently for a dtype other than
float32, after one warning line per process where the library cannot be built; the caller then keeps its plain
MindSpore ops (``model/layers.py`` RMSNorm, ``model/layers.py`` SiLU + Mul), the reference.
"""
import functools

from ..abi import build
from ..abi.aot import KernelCell, float32_library
from ..abi.table import KERNELS

_warn_once = functools.partial(build.warn_once, "CPU RMSNorm and SwiGLU kernels off, MindSpore's ops used instead")


class CPURMSNorm(KernelCell):
    """``construct(x [..., H], weight [H])`` -> x * rsqrt(mean(x^2) + eps) * weight over the last axis, float32;
    the forward keeps the rows' rsqrt [...] for the backward."""

    def __init__(self, library_path, epsilon, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_rmsnorm_fwd"], epsilon=epsilon, threads=threads)

    def construct(self, x, weight):
        return self.op(x, weight, self.config)[0]


class CPUSwiGLU(KernelCell):
    """``construct(gate, up)`` (one shape, float32) -> silu(gate) * up, silu(g) = g * sigmoid(g); the backward
    recomputes the sigmoid from ``gate``: nothing else is kept."""

    def __init__(self, library_path, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_swiglu_fwd"], threads=threads)

    def construct(self, gate, up):
        return self.op(gate, up, self.config)


def rmsnorm_kernel(epsilon, dtype, **kwargs):
    """A ``CPURMSNorm`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPURMSNorm(path, epsilon, **kwargs)


def swiglu_kernel(dtype, **kwargs):
    """A ``CPUSwiGLU`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPUSwiGLU(path, **kwargs)
