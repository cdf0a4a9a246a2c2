"""Train-one-step wrappers whose overflow check runs on every backend.

MindFormers' ``MFTrainOneStepCell`` and ``MFPipelineWithLossScaleCell`` read
overflow from Ascend/GPU float-status kernels that CPU lacks ("Unsupported op
[NPUGetFloatStatusV2] on CPU"). These subclasses keep everything else (gradient
clipping, static or dynamic loss scale, skipping the update on overflow, grad
accumulation and pipeline micro-batches) and, off Ascend, decide overflow with
an ``isfinite`` reduction over the gradients (and their squared norms), all-reduced across
data-parallel ranks. An overflowing step is skipped: weights and optimizer state stay as they were.
"""
import sys

import mindspore as ms
from mindspore.ops import functional as F

from ..host_memory import release_freed_heap
from ..kernels.provider import provider_of
from ..training.grad_checks import non_finite, square_sum
from .symbols import (ClipGradNorm, MFTrainOneStepCell, MFPipelineWithLossScaleCell, MindFormerRegister,
                      MindFormerModuleType, apply_global_norm)


class GPTLocalClipGradNorm(ClipGradNorm):
    """MindFormers' ClipGradNorm (same norm, same clipping) with the fast square sums."""

    def construct(self, x):
        global_norm = F.sqrt(F.addn(self.hyper_map(square_sum, x)))
        cond = self.greater_equal(global_norm, self.clip_norm)
        global_norm_clip = F.select(cond, global_norm, self.clip_norm)
        clip_x = self.hyper_map(F.partial(apply_global_norm, self.clip_norm, global_norm_clip), x)
        return clip_x, global_norm


class TrimAfterCompileMixin:
    """After the step's first graph compile, the heap the compile freed goes back to the system
    (``host_memory.release_freed_heap``), so the first step's memory does not grow on top of it."""

    def compile(self, *args, **kwargs):
        compiled = super().compile(*args, **kwargs)
        if not getattr(self, "_heap_released", False):
            self._heap_released = True
            release_freed_heap()
        return compiled


class IsFiniteOverflowMixin:
    """Overflow = some gradient is not finite; used on CPU and GPU. Also hands the model's kernel provider to the
    clip (the fast square sums) and to a ``GPTLocalAdamW`` (its AdamW kernel)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_isfinite_check = ms.get_context("device_target") != "Ascend"
        provider = provider_of(self.network)
        if getattr(self, "use_clip_grad", False) and provider.composed_ops():
            self.clip_grad_norm = GPTLocalClipGradNorm(max_norm=float(self.clip_grad_norm.clip_norm.asnumpy()[0]))
        if hasattr(self.optimizer, "use_kernels"):  # GPTLocalAdamW: the model's AdamW kernel where it has one
            self.optimizer.use_kernels(provider)

    def get_overflow_status(self, status, compute_output):
        if not self.use_isfinite_check:
            return super().get_overflow_status(status, compute_output)
        return self._get_distributed_overflow_status_on_infnan_mode(non_finite, compute_output)


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalTrainOneStepCell(TrimAfterCompileMixin, IsFiniteOverflowMixin, MFTrainOneStepCell):
    """``MFTrainOneStepCell`` that also runs on CPU (set ``runner_wrapper.type: GPTLocalTrainOneStepCell``): its
    step is MindFormers' own, with the overflow check and clip Cell of ``IsFiniteOverflowMixin``.
    ``lean_step`` (a removed path that measured no faster and no smaller than this step) is accepted with one line."""

    def __init__(self, *args, lean_step=None, **kwargs):
        super().__init__(*args, **kwargs)
        if lean_step is not None:
            sys.stderr.write("gpt_local: runner_wrapper.lean_step is no longer read (the train step is MindFormers' "
                             "own; the lean one measured no faster); remove it from the YAML.\n")


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalPipelineWithLossScaleCell(TrimAfterCompileMixin, IsFiniteOverflowMixin,
                                        MFPipelineWithLossScaleCell):
    """``MFPipelineWithLossScaleCell`` with the backend-neutral overflow check, for pipeline parallel."""
