"""The fast gradient reductions give MindFormers' clipping and catch every NaN/Inf and norm overflow."""
import numpy as np
import mindspore as ms
from mindspore import Tensor, nn, ops

from mindformers.core.clip_grad import ClipGradNorm
from mindformers_gptlocal.mf.wrapper import GPTLocalClipGradNorm
from mindformers_gptlocal.training.grad_checks import non_finite


def _grads(scale):
    rng = np.random.default_rng(0)
    return tuple(Tensor((rng.standard_normal(shape) * scale).astype(np.float32))
                 for shape in ((300, 64), (64,), (3, 5, 7)))


def test_clip_equals_mindformers_clip_grad_norm():
    ms.set_context(mode=0, device_target="CPU")
    for scale in (1e-3, 10.0):  # below and above max_norm
        grads = _grads(scale)
        ours, ours_norm = GPTLocalClipGradNorm(max_norm=1.0)(grads)
        theirs, their_norm = ClipGradNorm(max_norm=1.0)(grads)
        np.testing.assert_allclose(ours_norm.asnumpy(), their_norm.asnumpy(), rtol=1e-6)
        for a, b in zip(ours, theirs):
            np.testing.assert_allclose(a.asnumpy(), b.asnumpy(), rtol=1e-6, atol=1e-9)
    assert float(np.linalg.norm(np.concatenate([g.ravel() for g in (a.asnumpy() for a in ours)]))) < 1.0 + 1e-5


class _Flags(nn.Cell):
    def __init__(self):
        super().__init__()
        self.hyper_map = ops.HyperMap()

    def construct(self, grads):
        return self.hyper_map(non_finite, grads)


def test_non_finite_flags_nan_and_inf_anywhere():
    ms.set_context(mode=0, device_target="CPU")
    flags = _Flags()
    assert [float(f.asnumpy()) for f in flags(_grads(1.0))] == [0.0, 0.0, 0.0]
    for bad in (np.nan, np.inf, -np.inf):
        for which, index in ((0, (299, 63)), (1, (0,)), (2, (1, 4, 0))):
            grads = [g.asnumpy().copy() for g in _grads(1.0)]
            grads[which][index] = bad
            got = [float(f.asnumpy()) for f in flags(tuple(Tensor(g) for g in grads))]
            assert got == [float(i == which) for i in range(3)], (bad, which, got)
    huge = (Tensor(np.full((4, 4), 1e20, np.float32)),)  # finite, but its squared norm overflows fp32
    assert float(flags(huge)[0].asnumpy()) == 1.0
    half = (Tensor(np.full((1000, 64), 60000.0, np.float16)),)  # the fp16 sum would overflow; fp32 does not
    assert float(flags(half)[0].asnumpy()) == 0.0
