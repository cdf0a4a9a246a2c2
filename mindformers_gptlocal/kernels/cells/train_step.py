"""The train step's CPU kernels after the backward (``cpu_square_sum.cc``, ``cpu_adamw.cc``), as Cells:
``CPUSquareSum``, a gradient's sum of squares (the overflow check and the clip's global norm), and ``CPUAdamW``,
AdamW's in-place update of one float32 parameter.

``CPUSquareSum`` replaces ``training/grad_checks.py``'s Square + two-stage ReduceSum (the plain path: the same sum
to rounding; it writes no gradient-sized temporary). ``CPUAdamW`` takes MindSpore's ``AdamWeightDecay`` primitive's
inputs and computes its formula (the plain path and the reference: ``training/optim.py`` ``GPTLocalAdamW`` folds
AdamW's bias corrections into its lr, eps and decay either way), one pass over the parameter, its two moments and
its gradient; it writes the three Parameters in place (``side_effect_mem``) and returns a status token. Both run on
the library's worker threads. ``KernelProvider.square_sum`` / ``KernelProvider.adamw`` (``provider.py``) choose
them; the train step hands them to the clip, the overflow check and the optimizer (``mf/wrapper.py``).
"""
import functools

import mindspore as ms
from mindspore import ops

from ..abi import build
from ..abi.aot import KernelCell, float32_library
from ..abi.table import KERNELS

_warn_adamw = functools.partial(build.warn_once, "CPU AdamW kernel off, MindSpore's AdamWeightDecay used instead")
_warn_square_sum = functools.partial(build.warn_once, "CPU sum-of-squares kernel off, Square + ReduceSum used instead")


class CPUSquareSum(KernelCell):
    """``construct(x)`` -> the sum of float32 ``x``'s squares, float32 [1] (inf or nan where ``x`` holds one or
    the float32 total overflows)."""

    def __init__(self, library_path, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_square_sum_fwd"], threads=threads)

    def construct(self, x):
        return self.op(x, self.config)


class CPUAdamW(KernelCell):
    """``construct(param, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, decay, grad)``, ``AdamWeightDecay``'s
    arguments in its order (float32; the five scalars one element each): the three Parameters updated in place
    (the table's inout tensors: ``side_effect_mem``); returns a status token."""

    def __init__(self, library_path, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_adamw_fwd"], threads=threads)

    def construct(self, param, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, decay, grad):
        return self.op(param, exp_avg, exp_avg_sq, grad, ops.cast(lr, ms.float32), beta1, beta2,
                       ops.cast(eps, ms.float32), ops.cast(decay, ms.float32), self.config)


def square_sum_kernel(**kwargs):
    """A ``CPUSquareSum``, or None (Square + ReduceSum stay) after one warning line where the library cannot be
    built."""
    path = float32_library(ms.float32, _warn_square_sum)
    return None if path is None else CPUSquareSum(path, **kwargs)


def adamw_kernel(**kwargs):
    """A ``CPUAdamW``, or None (``AdamWeightDecay`` stays) after one warning line where the library cannot be
    built."""
    path = float32_library(ms.float32, _warn_adamw)
    return None if path is None else CPUAdamW(path, **kwargs)
