"""``CPULayerNorm`` and ``CPUBiasGeLU``: the LayerNorm and bias + GeLU kernels (``cpu_layernorm.cc``,
``cpu_bias_gelu.cc``; ``table.py``) as Cells.

Each is the forward's AOT ``ops.Custom`` with the backward's attached as its ``bprop`` (``aot.primitive``), so they run
inside the compiled GRAPH-mode model (and in PYNATIVE). ``layernorm_kernel(...)`` and ``bias_gelu_kernel(...)``
decide at build time whether the kernel can be used and return None otherwise: silently for a dtype other than
float32 (the model chose it), after one warning line per process where the library cannot be built (no
compiler...); the caller then keeps its plain MindSpore ops, which stay the reference.
"""
import functools

from ..abi import build
from ..abi.aot import KernelCell, float32_library
from ..abi.codes import MlpForm, name_of
from ..abi.table import KERNELS

GELU_FORMS = (MlpForm.TANH, MlpForm.QUICK)  # the bias + GeLU kernels' forms
_warn_once = functools.partial(build.warn_once,
                               "CPU LayerNorm and bias + GeLU kernels off, MindSpore's ops used instead")


class CPULayerNorm(KernelCell):
    """``construct(x [..., H], gamma [H], beta [H])`` -> LayerNorm over the last axis, float32; the same values
    as ``ops.LayerNorm(begin_norm_axis=-1, begin_params_axis=-1, epsilon)``'s first output."""

    def __init__(self, library_path, epsilon, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_layernorm_fwd"], epsilon=epsilon, threads=threads)

    def construct(self, x, gamma, beta):
        return self.op(x, gamma, beta, self.config)[0]


class CPUBiasGeLU(KernelCell):
    """``construct(x [..., F], bias [F])`` -> gelu(x + bias), float32, ``form`` "tanh" (GPT-2's ``gelu_new``,
    the plain path's ``TanhGeLU``) or "quick" (``quick_gelu``, x * sigmoid(1.702 x), MindSpore's FastGeLU).
    The backward recomputes from ``x`` and ``bias``: nothing else is kept."""

    def __init__(self, library_path, form, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_bias_gelu_fwd"], form=gelu_form(form), threads=threads)

    def construct(self, x, bias):
        return self.op(x, bias, self.config)


def gelu_form(name):
    """The ``MlpForm`` of a GeLU form's name ("tanh" or "quick"; a ValueError for another)."""
    form = name_of(MlpForm, name)
    if form not in GELU_FORMS:
        raise ValueError(f"{name!r}: the bias + GeLU kernels compute {', '.join(f.name.lower() for f in GELU_FORMS)}")
    return form


def layernorm_kernel(epsilon, dtype, **kwargs):
    """A ``CPULayerNorm`` or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPULayerNorm(path, epsilon, **kwargs)


def bias_gelu_kernel(form, dtype, **kwargs):
    """A ``CPUBiasGeLU`` for ``form`` ("tanh" or "quick") or None (after one warning) where it cannot run."""
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPUBiasGeLU(path, form, **kwargs)
