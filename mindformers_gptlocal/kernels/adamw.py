"""``CPUAdamW``: AdamW's in-place update of one float32 parameter through the CPU kernel ``cpu_adamw.cc``.

The same inputs and formula as MindSpore's ``AdamWeightDecay`` primitive (the plain path and the reference:
``training/optim.py`` ``GPTLocalAdamW`` folds AdamW's bias corrections into its lr, eps and decay either way), one
pass over the parameter, its two moments and its gradient on the library's worker threads. The op writes the three
Parameters in place (``side_effect_mem``) and returns a status token. ``KernelProvider.adamw`` (``provider.py``)
chooses it; the train step hands it to the optimizer (``mf/wrapper.py``).
"""
import functools

import mindspore as ms
from mindspore import nn, ops

from . import build
from .aot import custom_op, float32_library
from .args import AdamWArgs
from .attention import kernel_threads

SYMBOL = "gptlocal_adamw_fwd"
_warn_once = functools.partial(build.warn_once, "CPU AdamW kernel off, MindSpore's AdamWeightDecay used instead")


class CPUAdamW(nn.Cell):
    """``construct(param, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, decay, grad)``, ``AdamWeightDecay``'s
    arguments in its order (float32; the five scalars one element each): the three Parameters updated in place;
    returns a status token."""

    def __init__(self, library_path, threads=None):
        super().__init__()
        threads = kernel_threads() if threads is None else threads
        self.config = AdamWArgs(threads).tensor()
        self.op = custom_op(library_path, SYMBOL, lambda *shapes: [1], lambda *dtypes: ms.int32)
        self.op.add_prim_attr("side_effect_mem", True)  # writes the parameter and both moments

    def construct(self, param, exp_avg, exp_avg_sq, lr, beta1, beta2, eps, decay, grad):
        return self.op(param, exp_avg, exp_avg_sq, grad, ops.cast(lr, ms.float32), beta1, beta2,
                       ops.cast(eps, ms.float32), ops.cast(decay, ms.float32), self.config)


def adamw_kernel(**kwargs):
    """A ``CPUAdamW``, or None (``AdamWeightDecay`` stays) after one warning line where the library cannot be
    built."""
    path = float32_library(ms.float32, _warn_once)
    return None if path is None else CPUAdamW(path, **kwargs)
