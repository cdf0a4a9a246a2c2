"""``CPUAttention``: the fused causal attention kernel (``cpu_attention.cc``) as a MindSpore Cell.

Two AOT ``ops.Custom`` primitives, the forward (output and row logsumexp) and the backward (dQ, dK, dV), the
second attached as the first's ``bprop`` (``aot.primitive``, from ``table.py``): they run inside the compiled
GRAPH-mode model (and in PYNATIVE).
``attention_kernel(...)`` decides at build time whether it can be used and returns None otherwise, after one
warning line saying why and how to fix it; the caller then keeps its plain path.
"""
import functools

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from ..abi import build
from ..abi.aot import primitive
from ..abi.table import KERNELS, AttentionOptions

QUERY_BLOCK = 64
KEY_BLOCK = 256
warn_once = functools.partial(build.warn_once, "CPU attention kernel off, plain attention used instead")


class CPUAttention(nn.Cell):
    """``construct(query [B, N, S, D], key, value [B, G, S, D], bias [1 or B, 1, S, S], offsets)`` ->
    context [B, N, S, D], float32. ``offsets``: int32 [2], the counter dropout's table offsets of this step
    (``CounterDropout.offsets``), or None for no dropout. ``tables``: the dropout's two bit tables (float32)
    and ``keep_when_differ`` its rule, or None with no dropout: the kernel's mode with offsets is then the plain one
    (``config_dropout`` is ``config_plain``), chosen here, so ``construct`` branches on its argument alone."""

    def __init__(self, library_path, scale, tables=None, dropout_scale=1.0, keep_when_differ=False,
                 query_block=QUERY_BLOCK, key_block=KEY_BLOCK, threads=None):
        super().__init__()
        self.forward = primitive(library_path, KERNELS["gptlocal_attention_fwd"])  # its bprop: the table's

        def config(mode):
            return AttentionOptions(scale, dropout_scale, mode, threads, query_block, key_block).tensor()

        self.config_plain = config(0)
        self.has_dropout = tables is not None
        if self.has_dropout:
            self.bits1, self.bits2 = tables
            self.config_dropout = config(2 if keep_when_differ else 1)
        else:
            self.bits1 = self.bits2 = Tensor(np.zeros((1,), np.float32))
            self.config_dropout = self.config_plain  # mode 0 reads no offsets
        self.no_offsets = Tensor(np.zeros((2,), np.int32))

    def construct(self, query, key, value, bias, offsets=None):
        if offsets is None:
            return self.forward(query, key, value, bias, self.bits1, self.bits2, self.no_offsets, self.config_plain)[0]
        return self.forward(query, key, value, bias, self.bits1, self.bits2, offsets, self.config_dropout)[0]


def attention_kernel(scale, dtype, tables=None, dropout_scale=1.0, keep_when_differ=False, **kwargs):
    """A ``CPUAttention`` for one layer, or None (after one warning) where it cannot run: a dtype other than
    float32, or no library (no compiler, a failed build)."""
    if dtype != ms.float32:
        warn_once(f"it computes in float32 only, this model computes in {dtype} "
                  "(set model_config.compute_dtype and softmax_compute_dtype to float32 to use it)")
        return None
    path, reason = build.library()
    if path is None:
        warn_once(f"{reason}")
        return None
    try:
        return CPUAttention(path, scale, tables, dropout_scale, keep_when_differ, **kwargs)
    except (TypeError, ValueError, RuntimeError) as error:  # e.g. MS_CUSTOM_AOT_WHITE_LIST excludes the cache
        warn_once(f"MindSpore refused the kernel library {path} ({error})")
        return None
