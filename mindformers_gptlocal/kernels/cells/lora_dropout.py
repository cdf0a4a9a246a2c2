"""``CPULoRADropout``: LoRA's input dropout (``lora_dropout``) through the CPU kernel ``lora_dropout.cc``, as a Cell.

The forward's AOT ``ops.Custom`` with the backward's attached as its ``bprop`` (``aot.primitive``, ``table.py``). The
mask is gpt_local's counter dropout's (``model/dropout.py`` ``CounterDropout``, the plain path and the reference): the
kernel reads the Cell's two bit tables at the offsets ``CounterDropout.offsets(step)`` of this LoRA Linear's site
(``dropout.lora_dropout_site``) and the model's forward counter ``dropout_step``, so its values are the plain
path's bit for bit and a run resumed from a training checkpoint (which holds the counter) draws the uninterrupted
run's masks. The backward gets the same inputs and draws the mask again: nothing of the input's size is kept (the
plain path tiles both tables to the input's size; MindSpore's ``Dropout`` keeps a float mask), and a recomputed
forward draws the same mask.

``lora_dropout_kernel(dropout, dtype)`` returns the Cell for a ``CounterDropout``, or None where the plain Cell
must stay: a dtype other than float32, p = 0 (the plain path is then the identity) or no library (one warning line
per process). Whether it is asked for at all (CPU, ``model_config.cpu_kernels``) is the model's ``KernelProvider``'s
decision (``provider.py``).
"""
import functools

import mindspore as ms

from ..abi import build
from ..abi.aot import KernelCell, float32_library
from ..abi.table import KERNELS

_warn_once = functools.partial(build.warn_once, "CPU LoRA dropout kernel off, gpt_local's counter dropout used instead")


class CPULoRADropout(KernelCell):
    """``construct(x, step)`` -> the counter dropout ``counter`` (a ``CounterDropout``, 0 < p < 1) of float32 ``x``
    at ``step`` (int32 scalar) in training; ``x`` otherwise, or when ``step`` is None (as ``CounterDropout``)."""

    def __init__(self, library_path, counter, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_lora_dropout_fwd"], scale=counter.scale,
                         mode=2 if counter.keep_when_differ else 1, threads=threads)
        self.counter = counter  # the plain Cell: its tables, site and offsets (not called in construct)
        self.p = counter.p

    def construct(self, x, step=None):
        if not self.training or step is None:
            return x
        return self.op(x, self.counter.bits1, self.counter.bits2, self.counter.offsets(step), self.config)


def lora_dropout_kernel(dropout, dtype, **kwargs):
    """A ``CPULoRADropout`` for the plain Cell ``dropout`` (a ``CounterDropout``: anything with its ``p``,
    ``offsets`` and tables; MindSpore's Dropout, under parallel builds, stays) where it applies (module
    docstring), else None."""
    if not hasattr(dropout, "offsets") or not 0.0 < dropout.p < 1.0 or dtype != ms.float32:
        return None
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPULoRADropout(path, dropout, **kwargs)
