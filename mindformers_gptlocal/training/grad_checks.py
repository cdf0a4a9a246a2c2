"""Gradient-wide reductions (finite check, global norm) written to be fast on CPU.

MindSpore 2.7.2's CPU kernels for ReduceSum / ReduceAll over all axes of a large tensor are
slow: on GPT-2's [50257, 768] embedding gradient the sum of squares takes 149 ms and
``ReduceAll(IsFinite(x))`` 105 ms, against 16 ms and 6 ms when the last axis is summed first and
then the rest (`python benchmarks/kernels.py reduce`, 2 cores). Both the overflow check and
gradient clipping reduce every gradient every step, so they use the two-stage form here, in fp32. On CPU the train
step computes both sums with one kernel instead (``kernel_non_finite`` / ``kernel_square_sum``: the model's
``cpu_kernels`` op ``square_sum``). The clip Cell built on them (``GPTLocalClipGradNorm``, a MindFormers
``ClipGradNorm``) is in ``mf/wrapper.py``.
"""
import mindspore.common.dtype as mstype
from mindspore import ops
from mindspore.ops import functional as F

_reduce_sum = ops.ReduceSum()
_is_finite = ops.IsFinite()


def isfinite_overflow(device_target):
    """True where the train step decides overflow from the gradients being finite (CPU and GPU); False on Ascend,
    whose float-status kernels MindFormers' own check reads."""
    return device_target != "Ascend"


def fp32(x):
    """``x`` in float32 (fp16 squares overflow above 256)."""
    if x.dtype != mstype.float32:
        return F.cast(x, mstype.float32)
    return x


def sum_all(x):
    """Sum of every element, last axis first (one fast pass)."""
    if len(x.shape) > 1:
        x = _reduce_sum(x, -1)
    return _reduce_sum(x)


non_finite = ops.MultitypeFuncGraph("gptlocal_non_finite")
square_sum = ops.MultitypeFuncGraph("gptlocal_square_sum")


def overflowed(sum_of_squares):
    """1.0 when a gradient's sum of squares is not finite, else 0.0: the gradient holds a NaN or Inf, or is so large
    that its squared norm overflows fp32.

    One test covers both. The second case matters with ``use_clip_grad``: an infinite global norm makes the clip
    factor 0, and the optimizer would step on zeroed gradients instead of skipping the batch."""
    return 1.0 - F.cast(_is_finite(sum_of_squares), mstype.float32)


@non_finite.register("Tensor")
def _non_finite(grad):
    """``overflowed`` of ``grad``'s two-stage sum of squares."""
    return overflowed(sum_all(F.square(fp32(grad))))


@square_sum.register("Tensor")
def _square_sum(grad):
    """Sum of squares as a [1] tensor, the shape MindFormers' ClipGradNorm adds up."""
    return ops.expand_dims(sum_all(F.square(fp32(grad))), 0)


# The same two through a sum-of-squares kernel given as their first argument (kernels/cells/train_step.py CPUSquareSum:
# one read-only pass, no squared copy of the gradient): ops.partial(kernel_square_sum, kernel)
kernel_non_finite = ops.MultitypeFuncGraph("gptlocal_kernel_non_finite")
kernel_square_sum = ops.MultitypeFuncGraph("gptlocal_kernel_square_sum")


@kernel_non_finite.register("Function", "Tensor")
def _kernel_non_finite(sum_of_squares, grad):
    """``non_finite`` with the kernel's sum ([1])."""
    return overflowed(sum_of_squares(fp32(grad)))


@kernel_square_sum.register("Function", "Tensor")
def _kernel_square_sum(sum_of_squares, grad):
    """``square_sum`` with the kernel's sum ([1])."""
    return sum_of_squares(fp32(grad))
