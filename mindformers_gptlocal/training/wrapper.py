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

from mindformers.tools.register import MindFormerRegister, MindFormerModuleType
from mindformers.wrapper.wrapper import MFTrainOneStepCell, MFPipelineWithLossScaleCell

from ..model.cpu_kernels import replace_slow_cpu_kernels
from .grad_checks import non_finite, GPTLocalClipGradNorm


class IsFiniteOverflowMixin:
    """Overflow = some gradient is not finite; used on CPU and GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_isfinite_check = ms.get_context("device_target") != "Ascend"
        if getattr(self, "use_clip_grad", False) and replace_slow_cpu_kernels():
            self.clip_grad_norm = GPTLocalClipGradNorm(max_norm=float(self.clip_grad_norm.clip_norm.asnumpy()[0]))

    def get_overflow_status(self, status, compute_output):
        if not self.use_isfinite_check:
            return super().get_overflow_status(status, compute_output)
        return self._get_distributed_overflow_status_on_infnan_mode(non_finite, compute_output)


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalTrainOneStepCell(IsFiniteOverflowMixin, MFTrainOneStepCell):
    """``MFTrainOneStepCell`` that also runs on CPU (set ``runner_wrapper.type: GPTLocalTrainOneStepCell``)."""


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalPipelineWithLossScaleCell(IsFiniteOverflowMixin, MFPipelineWithLossScaleCell):
    """``MFPipelineWithLossScaleCell`` with the backend-neutral overflow check, for pipeline parallel."""
