"""``CPULoRADropout``: LoRA's input dropout (``lora_dropout``) through the CPU kernel ``lora_dropout.cc``, as a Cell.

Two AOT ``ops.Custom`` primitives, the forward and the backward (attached as the forward's ``bprop``). The mask is a
counter-based hash of (seed, site, call, element) drawn again by the backward from the two numbers the forward
returns, so nothing of the input's size is kept for it (MindSpore's ``Dropout`` keeps a float mask). Each Cell is
one site; sites are numbered in the order the Cells are built. Like MindSpore's ``Dropout`` (the reference path),
the masks are not saved with a checkpoint: a resumed run draws other ones. The forward is marked not to be
recomputed (a recomputed forward would count a new call and draw another mask). Checked by hand in a GRAPH-mode
Cell under ``Cell.recompute()``: the loss rebuilt from the backward's mask equals the forward's loss; the same check
passes without the mark, so MindSpore 2.7.2 on CPU may not recompute it either way (no CI test claims more).

``lora_dropout_kernel(p, dtype)`` returns the Cell, or None where the plain ``nn.Dropout`` must stay: not CPU,
``GPTLOCAL_PLAIN_KERNELS=1``, ``GPTLOCAL_LORA_DROPOUT_KERNEL=0``, a dtype other than float32, p = 0 (the plain
path is then the identity) or no library (one warning line per process).
"""
import functools
import itertools
import os

import numpy as np
from mindspore import Tensor, nn, ops
import mindspore as ms

from . import build
from .aot import custom_op, float32_library
from .attention import kernel_threads

_SITES = itertools.count()
_warn_once = functools.partial(build.warn_once, "CPU LoRA dropout kernel off, MindSpore's Dropout used instead")


class CPULoRADropout(nn.Cell):
    """``construct(x)`` -> inverted dropout of float32 ``x`` with probability ``p`` in training, ``x`` otherwise."""

    def __init__(self, library_path, p, seed=0, threads=None):
        super().__init__()
        self.p = float(p)
        threads = kernel_threads() if threads is None else threads
        self.config = Tensor(np.array([self.p, next(_SITES) % 65536, seed, threads], np.float32))
        self.backward = custom_op(library_path, "gptlocal_lora_dropout_bwd", lambda dy, k, c: dy, lambda dy, k, c: dy)
        self.forward = custom_op(library_path, "gptlocal_lora_dropout_fwd", lambda x, c: (x, [2]),
                               lambda x, c: (x, ms.float32), bprop=self._bprop)
        self.forward.recompute(False)  # the backward's mask is the forward's, also in a recomputed block

    def _bprop(self, x, config, out, dout):
        return self.backward(dout[0], out[1], config), ops.zeros_like(config)

    def construct(self, x):
        if not self.training:
            return x
        return self.forward(x, self.config)[0]


def lora_dropout_kernel(p, dtype, **kwargs):
    """A ``CPULoRADropout`` where it applies (module docstring), else None."""
    if (not 0.0 < float(p) < 1.0 or dtype != ms.float32 or ms.get_context("device_target") != "CPU"
            or os.environ.get("GPTLOCAL_PLAIN_KERNELS", "0") not in ("", "0")
            or os.environ.get("GPTLOCAL_LORA_DROPOUT_KERNEL", "1") == "0"):
        return None
    path = float32_library(dtype, _warn_once)
    return None if path is None else CPULoRADropout(path, p, **kwargs)
