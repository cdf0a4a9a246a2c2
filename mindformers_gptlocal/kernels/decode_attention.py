"""``CPUDecodeAttention``: the KV cache's one-query-row attention (``decode_attention.cc``) as a MindSpore Cell.

One AOT ``ops.Custom`` (inference only, no backward): query [B, N, 1, D] over the cache Parameters [B, G, L, D] as
stored (GQA read in the kernel, no repeat) with the plain path's additive mask [1 or B, 1, 1, L]; rows the mask
hides are not read, so a step reads each sequence's rows up to its position only. ``decode_attention_kernel``
returns None (after the attention kernel's one warning) where it cannot run; the caller keeps its plain path.
"""
import functools
import os

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from . import build
from .attention import kernel_threads

warn_once = functools.partial(build.warn_once, "CPU decode attention kernel off, plain decode attention used instead")


def _shape(q, *rest):
    return q


def _type(q, *rest):
    return q


class CPUDecodeAttention(nn.Cell):
    """``construct(query [B, N, 1, D], key, value [B, G, L, D], bias [1 or B, 1, 1, L])`` -> context [B, N, 1, D]."""

    def __init__(self, library_path, scale, threads=None):
        super().__init__()
        threads = kernel_threads() if threads is None else threads
        self.op = ops.Custom(f"{library_path}:gptlocal_decode_attention", _shape, _type, "aot")
        self.op.add_prim_attr("primitive_target", "CPU")
        self.config = Tensor(np.array([scale, threads], np.float32))

    def construct(self, query, key, value, bias):
        return self.op(query, key, value, bias, self.config)


ENV = "GPTLOCAL_DECODE_ATTENTION_KERNEL"


def enabled():
    """Opt-in (``GPTLOCAL_DECODE_ATTENTION_KERNEL=1``, read when the model is built): on the busy machine it was
    measured on, the kernel was not shown faster than the plain ops (docs/performance.md), so plain stays default."""
    return os.environ.get(ENV, "0") == "1"


def decode_attention_kernel(scale, dtype, **kwargs):
    """A ``CPUDecodeAttention`` for one layer, or None where it is not asked for (``enabled``) or cannot run (not
    float32, no library)."""
    if not enabled():
        return None
    if dtype != ms.float32:
        return None  # the training kernel's check has said why (attention_kernel), once
    path, reason = build.library()
    if path is None:
        warn_once(f"{reason}")
        return None
    try:
        return CPUDecodeAttention(path, scale, **kwargs)
    except (TypeError, ValueError, RuntimeError) as error:
        warn_once(f"MindSpore refused the kernel library {path} ({error})")
        return None
