"""GPTLocalTrainOneStepCell on CPU: it trains, clips, and skips the update when gradients overflow."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from mindformers_gptlocal import GPTLocalForCausalLM, GPTLocalTrainOneStepCell
from mindformers_gptlocal.kernels.cells.train_step import CPUSquareSum
from mindformers_gptlocal.kernels.provider import OPS
from references import LossOf


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 512, (2, 33)).astype(np.int32)
    return (Tensor(tokens[:, :-1]), Tensor(tokens[:, 1:]), Tensor(np.ones((2, 32), np.int32)),
            Tensor(np.tile(np.arange(32, dtype=np.int32), (2, 1))))


def _step_cell(tiny_config, scale_sense, seed=0):
    ms.set_seed(seed)
    model = GPTLocalForCausalLM(tiny_config)
    optimizer = nn.AdamWeightDecay(model.trainable_params(), learning_rate=3e-3)
    cell = GPTLocalTrainOneStepCell(model, optimizer, use_clip_grad=True, max_grad_norm=1.0, scale_sense=scale_sense)
    cell.set_train(True)
    return model, cell


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_steps_update_weights_and_lower_loss(tiny_config, mcore_context, monkeypatch, seed):
    """Eight steps lower the loss and move the weights; the step cell hands the heap its graph compile freed back to
    the system after its first compile, and only then (host_memory.release_freed_heap; the steps after it run as
    before)."""
    import mindformers_gptlocal.mf.wrapper as wrapper
    calls = []
    monkeypatch.setattr(wrapper, "release_freed_heap", lambda: calls.append(1) or True)
    model, cell = _step_cell(tiny_config, 1.0, seed)
    before = model.model.layers[0].mlp.linear_fc1.weight.asnumpy().copy()
    losses = []
    for _ in range(8):
        loss, overflow, _, _, global_norm = cell(*_batch())
        losses.append(float(loss))
        assert not bool(overflow) and np.isfinite(float(global_norm))
    assert losses[-1] < losses[0] - 0.5, losses
    assert calls == [1]
    assert not np.array_equal(before, model.model.layers[0].mlp.linear_fc1.weight.asnumpy())


@pytest.mark.parametrize("square_sum", ["plain", "kernel"])
def test_overflow_skips_update_and_dynamic_scale_backs_off(tiny_config, mcore_context, square_sum):
    """The wrapper's skip-and-back-off logic, its overflow check on the two-stage ops and on the sum-of-squares
    kernel. The model is built on MindSpore's ops: at 2^127 whether the fp32 gradients overflow depends on the order
    of their sums, and the CPU LayerNorm/GeLU kernels' chunked sums can stay finite where the plain ones overflow
    (that the kernels pass an overflow on: test_norm_gelu_kernel)."""
    tiny_config.cpu_kernels = dict(dict.fromkeys(OPS, "plain"), square_sum=square_sum)
    manager = nn.DynamicLossScaleUpdateCell(loss_scale_value=2.0 ** 127, scale_factor=2, scale_window=2)
    model, cell = _step_cell(tiny_config, manager)
    assert isinstance(cell.sum_of_squares, CPUSquareSum) == (square_sum == "kernel")
    before = {p.name: p.asnumpy().copy() for p in model.trainable_params()}
    _, overflow, _, _, _ = cell(*_batch())  # loss x 2^127 overflows fp32 gradients
    assert bool(overflow)
    assert float(cell.scale_sense.asnumpy()) == 2.0 ** 126  # backed off by scale_factor
    for p in model.trainable_params():
        np.testing.assert_array_equal(before[p.name], p.asnumpy())  # update skipped
    scales = []
    for _ in range(20):
        _, overflow, _, _, _ = cell(*_batch())
        scales.append(float(cell.scale_sense.asnumpy()))
        if not bool(overflow):
            break
    assert not bool(overflow) and scales[-1] < 2.0 ** 127  # scale came down until steps went through


def test_clipping_uses_the_configured_max_grad_norm(tiny_config, mcore_context):
    """One step with plain SGD (lr 1) moves every weight by exactly the clipped gradient: the gradients of
    the same batch through GPTLocalClipGradNorm(max_norm), computed apart from the wrapper, at max_norm 0.3 and 5.0
    (one model, its gradients taken once; each step cell from the same starting weights)."""
    from mindformers_gptlocal.mf.wrapper import GPTLocalClipGradNorm
    ms.set_seed(0)
    model = GPTLocalForCausalLM(tiny_config)
    model.set_train(True)
    params = model.trainable_params()
    before = [p.asnumpy().copy() for p in params]
    batch = _batch()
    grads = ms.grad(LossOf(model), grad_position=None, weights=params)(*batch)
    for max_norm in (0.3, 5.0):
        for param, start in zip(params, before):
            param.set_data(Tensor(start))
        clipped, norm = GPTLocalClipGradNorm(max_norm=max_norm)(grads)
        assert 1.0 < float(norm) < 5.0  # so clipping at 0.3 clips, at 5.0 does not, and a fixed 1.0 would differ
        cell = GPTLocalTrainOneStepCell(model, nn.SGD(params, learning_rate=1.0), use_clip_grad=True,
                                        max_grad_norm=max_norm, scale_sense=1.0)
        cell.set_train(True)
        _, overflow, _, _, global_norm = cell(*batch)
        assert not bool(overflow)
        np.testing.assert_allclose(float(global_norm), float(norm), rtol=1e-5)
        for param, start, grad in zip(params, before, clipped):
            np.testing.assert_allclose(param.asnumpy(), start - grad.asnumpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=f"{param.name} at max_norm {max_norm}")
