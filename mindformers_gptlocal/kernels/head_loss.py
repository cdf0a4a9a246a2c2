"""``CPUHeadLoss``: the fused output head + cross-entropy of training (``head_loss.cc``) as a MindSpore Cell.

One AOT ``ops.Custom`` computes the masked mean token cross-entropy of ``hidden @ weight^T`` and, in the same
call, its gradients for d_loss = 1 (the loss is linear in its gradient: the ``bprop`` scales them by the
incoming d_loss), row chunk by row chunk and vocab block by vocab block: no [N, V] logits, log-softmax or
gradient buffer. ``head_loss_kernel(...)`` decides at build time whether it can be used and returns None
otherwise (one warning line saying why); the model then keeps its plain head and loss.
"""
import functools

import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from . import build
from .attention import kernel_threads

VOCAB_BLOCK = 1024
CHUNK_BUDGET_BYTES = 32 << 20  # the [chunk rows, V] logits scratch
warn_once = functools.partial(build.warn_once, "CPU head + loss kernel off, plain logits and LogSoftmax used instead")


def chunk_rows(vocab_size, budget=CHUNK_BUDGET_BYTES):
    """Rows per chunk: as many as fit ``budget`` bytes of [rows, vocab] fp32 logits, 16 to 1024, a multiple of 8."""
    rows = budget // (4 * max(1, vocab_size))
    return int(min(1024, max(16, rows // 8 * 8)))


def vocab_block(vocab_size, threads):
    """Vocab columns per task: VOCAB_BLOCK, smaller for small vocabularies so every thread gets blocks."""
    per_task = -(-vocab_size // (4 * max(1, threads)))
    return int(max(64, min(VOCAB_BLOCK, -(-per_task // 16) * 16)))


def _shape(hidden, weight, *rest):
    return ([1], hidden, weight)


def _type(hidden, weight, *rest):
    return (hidden, hidden, weight)


class CPUHeadLoss(nn.Cell):
    """``construct(hidden [N, H], weight [V, H], labels int32 [N], keep float32 [N])`` -> the loss, a float32
    scalar: ``sum(nll * keep) / max(sum(keep), 1)`` with ``nll`` each row's cross-entropy of
    ``hidden @ weight^T`` against its label (the plain path's ``lm_loss``). Rows with keep 0 may hold any label."""

    def __init__(self, library_path, vocab_size, threads=None, rows=None, block=None):
        super().__init__()
        threads = kernel_threads() if threads is None else threads
        rows = chunk_rows(vocab_size) if rows is None else rows
        block = vocab_block(vocab_size, threads) if block is None else block
        self.fused = ops.Custom(f"{library_path}:gptlocal_head_loss", _shape, _type, "aot", bprop=self._bprop)
        self.fused.add_prim_attr("primitive_target", "CPU")
        self.config = Tensor(np.array([threads, rows, block], np.float32))

    def _bprop(self, hidden, weight, labels, weights, config, out, dout):
        scale = ops.reshape(dout[0], ())
        return (out[1] * scale, out[2] * scale, ops.zeros_like(labels), ops.zeros_like(weights),
                ops.zeros_like(config))

    def construct(self, hidden, weight, labels, keep):
        weights = keep / ops.maximum(ops.reduce_sum(keep), 1.0)
        safe = ops.cast(ops.maximum(labels, 0), ms.int32)
        return ops.reshape(self.fused(hidden, weight, safe, weights, self.config)[0], ())


def head_loss_kernel(vocab_size, dtype, **kwargs):
    """A ``CPUHeadLoss``, or None (after one warning) where it cannot run: a dtype other than float32, or no
    library (no compiler, a failed build)."""
    if dtype != ms.float32:
        warn_once(f"it computes in float32 only, this model computes in {dtype} "
                  "(set model_config.compute_dtype to float32 to use it)")
        return None
    path, reason = build.library()
    if path is None:
        warn_once(reason)
        return None
    try:
        return CPUHeadLoss(path, vocab_size, **kwargs)
    except (TypeError, ValueError, RuntimeError) as error:
        warn_once(f"MindSpore refused the kernel library {path} ({error})")
        return None
