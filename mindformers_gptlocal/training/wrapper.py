"""Train-one-step wrappers whose overflow check runs on every backend.

MindFormers' ``MFTrainOneStepCell`` and ``MFPipelineWithLossScaleCell`` read
overflow from Ascend/GPU float-status kernels that CPU lacks ("Unsupported op
[NPUGetFloatStatusV2] on CPU"). These subclasses keep everything else (gradient
clipping, static or dynamic loss scale, skipping the update on overflow, grad
accumulation and pipeline micro-batches) and, off Ascend, decide overflow with
an ``isfinite`` reduction over the gradients (and their squared norms), all-reduced across
data-parallel ranks. An overflowing step is skipped: weights and optimizer state stay as they were.

``GPTLocalTrainOneStepCell`` also takes a lean path, chosen at build time, for the common CPU/GPU
configuration (a static loss scale of 1.0, gradient clipping, no local-norm/dump/grouped-LR extras). It
computes the same numbers as the general path with fewer gradient-sized buffers (`lean_step`):
- no unscale multiply (``grad * 1/1.0`` copied every gradient and changes no bit);
- one sum of squares per gradient, shared by the overflow check and the clip norm (two passes before);
- the clip factor goes to ``GPTLocalAdamW``, which scales each gradient right before its fused kernel,
  instead of a clipped copy of every gradient held until the optimizer runs.
"""
import mindspore as ms
import mindspore.common.dtype as mstype
from mindspore import ops, Tensor
from mindspore.ops import functional as F

from mindformers.tools.register import MindFormerRegister, MindFormerModuleType
from mindformers.wrapper.wrapper import MFTrainOneStepCell, MFPipelineWithLossScaleCell

from ..host_memory import release_freed_heap
from ..mf.compat import lean_step_allowed
from ..kernels.provider import provider_of
from .grad_checks import non_finite, square_sum, clip_coefficient, GPTLocalClipGradNorm


_scaled = ops.MultitypeFuncGraph("gptlocal_scaled")


@_scaled.register("Tensor", "Tensor")
def _scale_one(coefficient, grad):
    """``grad`` times the clip coefficient, as MindFormers' ``apply_global_norm`` computes it."""
    return F.cast(F.cast(grad, mstype.float32) * coefficient, F.dtype(grad))


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
    """Overflow = some gradient is not finite; used on CPU and GPU."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.use_isfinite_check = ms.get_context("device_target") != "Ascend"
        if getattr(self, "use_clip_grad", False) and provider_of(self.network).composed_ops():
            self.clip_grad_norm = GPTLocalClipGradNorm(max_norm=float(self.clip_grad_norm.clip_norm.asnumpy()[0]))

    def get_overflow_status(self, status, compute_output):
        if not self.use_isfinite_check:
            return super().get_overflow_status(status, compute_output)
        return self._get_distributed_overflow_status_on_infnan_mode(non_finite, compute_output)


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalTrainOneStepCell(TrimAfterCompileMixin, IsFiniteOverflowMixin, MFTrainOneStepCell):
    """``MFTrainOneStepCell`` that also runs on CPU (set ``runner_wrapper.type: GPTLocalTrainOneStepCell``),
    with the lean path of the module docstring where its configuration allows (``lean_step: False`` in
    ``runner_wrapper`` forces MindFormers' general step)."""

    def __init__(self, *args, lean_step=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.lean_step = bool(lean_step) and self._lean_step_applies()
        self.fold_clip = self.lean_step and getattr(self.optimizer, "takes_grad_coefficient", False)

    def _lean_step_applies(self):
        """The lean path computes what ``MFTrainOneStepCell.construct`` does only in this configuration, and only on
        the MindFormers whose ``construct`` flags it was reviewed against (``mindformers_compat`` "lean train
        step": a flag it does not know turns it off, with a warning naming it)."""
        scale = self.scale_sense
        static_one = (self.loss_scaling_manager is None and isinstance(scale, Tensor)
                      and float(scale.asnumpy().reshape(-1)[0]) == 1.0)
        return bool(static_one and self.use_isfinite_check and self.use_clip_grad and not self.use_legacy
                    and not self.calculate_per_token_loss and not self.local_norm and not self.if_dump
                    and not self.dump_device_local_norm and not self.print_separate_loss
                    and not self.use_grouped_lr and not self.optimizer.is_group_lr and not self.use_graceful_exit
                    and not self.use_skip_data_by_global_norm and lean_step_allowed())

    def set_sense_scale(self, sens):
        if self.lean_step and float(Tensor(sens).asnumpy().reshape(-1)[0]) != 1.0:
            raise ValueError("GPTLocalTrainOneStepCell was built for a static loss scale of 1.0 (its lean step "
                             "skips the unscale); build it with the scale you want (runner_wrapper.scale_sense).")
        return super().set_sense_scale(sens)

    def construct(self, *inputs):
        if not self.lean_step:
            return super().construct(*inputs)
        loss, grads, _ = self.grads_for_mcore(self.scale_sense, *inputs)
        grads = self.grad_reducer(grads)
        squares = F.addn(self.hyper_map(square_sum, grads))  # one pass: overflow check and clip norm
        flag = 1.0 - F.cast(ops.isfinite(squares), mstype.float32).reshape(())
        if self.is_distributed:
            flag = self.allreduce(flag)
        overflow = self.less_equal(self.base, flag)
        global_norm = F.sqrt(squares)
        coefficient = clip_coefficient(self.clip_grad_norm.clip_norm, global_norm)
        learning_rate = self.learning_rate
        if self.optimizer.dynamic_lr:
            learning_rate = self.learning_rate(self.optimizer.global_step).reshape(())
        if not overflow:
            if self.fold_clip:
                loss = F.depend(loss, self.optimizer(grads, coefficient))
            else:
                loss = F.depend(loss, self.optimizer(self.hyper_map(F.partial(_scaled, coefficient), grads)))
        return loss, overflow, self.scale_sense, learning_rate, global_norm


@MindFormerRegister.register(MindFormerModuleType.WRAPPER)
class GPTLocalPipelineWithLossScaleCell(TrimAfterCompileMixin, IsFiniteOverflowMixin,
                                        MFPipelineWithLossScaleCell):
    """``MFPipelineWithLossScaleCell`` with the backend-neutral overflow check, for pipeline parallel."""
