"""The fast gradient reductions give MindFormers' clipping and catch every NaN/Inf and norm overflow: the two-stage
ops and the CPU sum-of-squares kernel (``kernels/cells/train_step.py``) alike."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

from mindformers.core.clip_grad import ClipGradNorm
from mindformers_gptlocal.mf.wrapper import GPTLocalClipGradNorm
from mindformers_gptlocal.kernels.cells.train_step import square_sum_kernel
from mindformers_gptlocal.training.grad_checks import isfinite_overflow, kernel_non_finite, non_finite

# the grads below: odd sizes, and one large enough (300 x 160) for the kernel to split over two threads
SHAPES = ((300, 160), (64,), (3, 5, 7))


def _grads(scale):
    rng = np.random.default_rng(0)
    return tuple(Tensor((rng.standard_normal(shape) * scale).astype(np.float32)) for shape in SHAPES)


@pytest.mark.parametrize("kernel", [False, True], ids=["two-stage", "kernel"])
def test_clip_equals_mindformers_clip_grad_norm(kernel):
    ms.set_context(mode=0, device_target="CPU")
    for scale in (1e-3, 10.0):  # below and above max_norm
        grads = _grads(scale)
        clip = GPTLocalClipGradNorm(max_norm=1.0, sum_of_squares=square_sum_kernel() if kernel else None)
        ours, ours_norm = clip(grads)
        theirs, their_norm = ClipGradNorm(max_norm=1.0)(grads)
        np.testing.assert_allclose(ours_norm.asnumpy(), their_norm.asnumpy(), rtol=1e-6)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6, atol=1e-9)
    assert float(np.linalg.norm(np.concatenate([g.ravel() for g in (a.asnumpy() for a in ours)]))) < 1.0 + 1e-5


class _Flags(nn.Cell):
    def __init__(self, kernel=None):
        super().__init__()
        self.hyper_map = ops.HyperMap()
        self.kernel = kernel

    def construct(self, grads):
        if self.kernel is None:
            return self.hyper_map(non_finite, grads)
        return self.hyper_map(ops.partial(kernel_non_finite, self.kernel), grads)


@pytest.mark.parametrize("kernel", [False, True], ids=["two-stage", "kernel"])
def test_non_finite_flags_nan_and_inf_anywhere(kernel):
    ms.set_context(mode=0, device_target="CPU")
    flags = _Flags(square_sum_kernel() if kernel else None)
    assert [f.asnumpy().item() for f in flags(_grads(1.0))] == [0.0, 0.0, 0.0]
    for bad in (np.nan, np.inf, -np.inf):
        for which, index in ((0, (299, 159)), (0, (7, 3)), (1, (0,)), (2, (1, 4, 0))):
            grads = [g.asnumpy().copy() for g in _grads(1.0)]
            grads[which][index] = bad
            got = [f.asnumpy().item() for f in flags(tuple(Tensor(g) for g in grads))]
            assert got == [float(i == which) for i in range(3)], (bad, which, got)
    # one call (one compile) for three gradients, each flagged alone:
    huge = Tensor(np.full((4, 4), 1e20, np.float32))  # finite, but its squared norm overflows fp32
    half = Tensor(np.full((1000, 64), 60000.0, np.float16))  # the fp16 sum would overflow; fp32 does not
    summed = Tensor(np.full((300, 160), 2e17, np.float32))  # each square finite, their float32 total not
    assert [f.asnumpy().item() for f in flags((huge, half, summed))] == [1.0, 0.0, 1.0]


def test_the_overflow_check_reads_the_gradients_but_on_ascend():
    assert isfinite_overflow("CPU") and isfinite_overflow("GPU") and not isfinite_overflow("Ascend")
