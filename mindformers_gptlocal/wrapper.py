"""Train-one-step wrappers whose overflow check runs on every backend.

MindFormers' ``MFTrainOneStepCell`` and ``MFPipelineWithLossScaleCell`` read
overflow from Ascend/GPU float-status kernels that CPU lacks ("Unsupported op
[NPUGetFloatStatusV2] on CPU"). These subclasses keep everything else (gradient
clipping, static or dynamic loss scale, skipping the update on overflow, grad
accumulation and pipeline micro-batches) and, off Ascend, decide overflow with
an ``isfinite`` reduction over the gradients (and their squared norms), all-reduced across
data-parallel ranks. An overflowing step is skipped: weights and optimizer state stay as they were.
"""
import mindspore as ms
from mindspore import ops
import mindspore.common.dtype as mstype

from mindformers.tools.register import MindFormerRegister, MindFormerModuleType
from mindformers.wrapper.wrapper import MFTrainOneStepCell, MFPipelineWithLossScaleCell

_non_finite = ops.MultitypeFuncGraph("_non_finite")


@_non_finite.register("Tensor")
def _count_non_finite(grad):
    """1.0 when the gradient holds a NaN or Inf, or is so large that its squared norm overflows fp32, else 0.0.

    The second case matters with ``use_clip_grad``: an infinite global norm makes the clip factor 0, and the
    optimizer would then take a step on zeroed gradients instead of skipping the batch."""
    grad = ops.cast(grad, mstype.float32)
    all_finite = ops.logical_and(ops.ReduceAll()(ops.IsFinite()(grad)), ops.IsFinite()(ops.ReduceSum()(grad * grad)))
    return 1.0 - ops.cast(all_finite, mstype.float32)


class IsFiniteOverflowMixin:
    """Overflow = some gradient is not finite; used on CPU and GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_isfinite_check = ms.get_context("device_target") != "Ascend"

    def get_overflow_status(self, status, compute_output):
        if not self.use_isfinite_check:
            return super().get_overflow_status(status, compute_output)
        return self._get_distributed_overflow_status_on_infnan_mode(_non_finite, compute_output)


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalTrainOneStepCell(IsFiniteOverflowMixin, MFTrainOneStepCell):
    """``MFTrainOneStepCell`` that also runs on CPU (set ``runner_wrapper.type: GPTLocalTrainOneStepCell``)."""


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalPipelineWithLossScaleCell(IsFiniteOverflowMixin, MFPipelineWithLossScaleCell):
    """``MFPipelineWithLossScaleCell`` with the backend-neutral overflow check, for pipeline parallel."""
