"""The LM head and its cross-entropy fused for CPU training (``cpu_head_loss.cc``), as a Cell: ``CPUHeadLoss``.

The plain path (``model/gpt.py``: the head's GEMM, LogSoftmax, GatherD and their gradients) keeps [tokens, vocab]
float32 tensors across the step; the kernel runs over chunks of rows and returns the loss with its gradients, which
its bprop (the table's ``gptlocal_head_loss_bwd``) scales by the loss's incoming gradient. The loss is the rows'
losses weighted by ``row_weight`` (the model's: 1 / the kept rows where a row counts, else 0), so it is the plain
path's mean over kept rows. ``KernelProvider.head_loss`` (``provider.py``) chooses it.
"""
import functools

import mindspore as ms
from mindspore import ops

from ..abi import build
from ..abi.aot import KernelCell, float32_library
from ..abi.table import KERNELS

_warn = functools.partial(build.warn_once, "CPU head + loss kernel off, the head's GEMM and LogSoftmax used instead")


class CPUHeadLoss(KernelCell):
    """``construct(x [T, H], weight [V, H], labels [T], row_weight [T])`` -> the loss, float32 [1]: sum over rows
    of row_weight (logsumexp(x w^T) - the label's logit). ``rows``: the rows of a chunk (0: the kernel's choice).
    Its gradient flows to x and the weight; labels and row_weight are constants of the step."""

    def __init__(self, library_path, rows=0, threads=None):
        super().__init__(library_path, KERNELS["gptlocal_head_loss_fwd"], rows=rows, threads=threads)

    def construct(self, x, weight, labels, row_weight):
        loss, _, _ = self.op(x, weight, ops.cast(labels, ms.int32), row_weight, self.config)
        return loss


def head_loss_kernel(**kwargs):
    """A ``CPUHeadLoss``, or None (the plain head and loss) after one warning line where the library cannot be
    built."""
    path = float32_library(ms.float32, _warn)
    return None if path is None else CPUHeadLoss(path, **kwargs)
