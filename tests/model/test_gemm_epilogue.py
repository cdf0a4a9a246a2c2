"""The MLP's GEMM epilogues in a model (``cpu_kernels.gemm_epilogue``; ``model/gpt.py`` ``EpilogueFeedForward``,
``kernels/cells/linear.py`` ``CPULinearEpilogue``): which builds run them (``kernel``, with the linear and bias_gelu
kernels; ``auto`` and ``plain`` give the unfused MLP), and a tiny model's compiled training step (GRAPH mode: the
AdamW steps' losses and every first-step gradient) and inference logits with them equal to ``gemm_epilogue:
plain``'s (float32: each path's error against the float64 model of the same weights of the plain path's size), float32
and bf16 GEMMs, tanh and quick GeLU; graphs below the GEMM kernel's
rows run the unfused MLP exactly."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from conftest import TINY
from references import (LossOf, assert_error_of_plain_size, assert_errors_of_one_size, copy_weights,
                        float64_weights, gpt_float64_logits, gpt_float64_steps, train_steps)

SEQ = 16


def _pair(cpu_kernels, **changes):
    """(epilogue model, plain-epilogue model) of the same weights (non-zero biases), ``cpu_kernels`` besides."""
    values = dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ, **changes)
    fused = GPTLocalForCausalLM(GPTLocalConfig(**values, cpu_kernels=dict(cpu_kernels, gemm_epilogue="kernel")))
    plain = GPTLocalForCausalLM(GPTLocalConfig(**values, cpu_kernels=dict(cpu_kernels, gemm_epilogue="plain")))
    rng = np.random.default_rng(5)
    for _, param in fused.parameters_and_names():
        param.set_data(Tensor(param.asnumpy() + (0.1 * rng.standard_normal(param.shape)).astype(np.float32)))
    copy_weights(fused, plain)
    for model, fused_mlp in ((fused, True), (plain, False)):
        for layer in model.model.layers:
            assert type(layer.mlp).__name__ == ("EpilogueFeedForward" if fused_mlp else "BiasGeLUFeedForward")
            assert getattr(layer, "mlp_residual", False) is fused_mlp
    return fused, plain


def _batch(batch=2, seed=0):
    ids = Tensor(np.random.default_rng(seed).integers(1, TINY["vocab_size"], (batch, SEQ + 1)).astype(np.int32))
    return ids[:, :-1], ids[:, 1:]


def _first_step(model):
    """``train_steps(model, [_batch()], steps=1)`` without the optimizer after the step (nothing reads its update):
    the compiled training step's [loss] and gradients by parameter name."""
    model.set_train(True)
    weights = model.trainable_params()
    loss, grads = ms.jit(ms.value_and_grad(LossOf(model), None, weights=weights))(*_batch())
    return [float(loss.asnumpy())], {p.name: g.asnumpy() for p, g in zip(weights, grads)}


# bf16 GEMMs: one step. After an optimizer step the two runs' weights differ in float32's last bits, and a weight
# on either side of a bf16 rounding boundary then differs by 2^-9 of itself: later losses part by ~1e-4 either way.
CASES = [
    (dict(linear="kernel"), dict(), 3),
    (dict(linear="kernel"), dict(hidden_act="quick_gelu"), 3),
    (dict(), dict(compute_dtype="bfloat16"), 1),
]


@pytest.mark.parametrize("cpu_kernels,changes,steps", CASES, ids=["float32", "float32_quick", "bfloat16"])
def test_training_step_matches_the_unfused_mlp(library, graph_mode, cpu_kernels, changes, steps):
    """Compiled AdamW steps (3; bf16 GEMMs: the first step's loss and gradients alone), the epilogues against
    ``gemm_epilogue: plain``. float32: the losses (falling) and every first-step gradient against the float64 model's (torch, same weights, same AdamW) within 8x
    the plain path's error + 4 u of the value (``assert_error_of_plain_size``). bf16 GEMMs (whose float32 sums in
    another order flip bf16 roundings downstream: 1e-4 of the largest was not enough on AMX): losses within 1e-5, an
    error against the float32 model of the same weights within twice the plain path's either way, in norm."""
    ms.set_seed(0)
    fused, plain = _pair(cpu_kernels, **changes)
    bf16 = changes.get("compute_dtype") == "bfloat16"
    if bf16:  # the reference: the float32 model of the same weights, before the steps
        values = dict(TINY, max_position_embeddings=SEQ, seq_length=SEQ)
        fp32 = GPTLocalForCausalLM(GPTLocalConfig(**values, cpu_kernels=dict(cpu_kernels, gemm_epilogue="plain")))
        copy_weights(plain, fp32)
        fp32_grads = _first_step(fp32)[1]
    else:  # the reference: the float64 model of the same weights, its own AdamW steps
        exact_losses, exact_grads = gpt_float64_steps(float64_weights(plain), _batch(), plain.config, steps, 1e-2)
    if steps == 1:  # one step: no optimizer (its update would go unread)
        (losses, grads), (plain_losses, plain_grads) = _first_step(fused), _first_step(plain)
    else:
        losses, grads = train_steps(fused, [_batch()], steps=steps, learning_rate=1e-2)
        plain_losses, plain_grads = train_steps(plain, [_batch()], steps=steps, learning_rate=1e-2)
    assert sorted(grads) == sorted(plain_grads)
    longest = max(TINY["vocab_size"], 4 * TINY["hidden_size"], 2 * SEQ)  # the step's longest float32 sum
    for name in plain_grads:
        if bf16:
            assert assert_errors_of_one_size(grads[name], plain_grads[name], fp32_grads[name], name, longest) > 0
        else:
            assert_error_of_plain_size(grads[name], plain_grads[name], exact_grads[name], name)
    if bf16:
        np.testing.assert_allclose(losses, plain_losses, atol=1e-5, rtol=0)
    else:
        assert_error_of_plain_size(losses, plain_losses, exact_losses, "losses")
    assert steps == 1 or losses[-1] < losses[0]
    assert any("mlp.linear_fc1.bias" in name and np.abs(g).max() > 0 for name, g in grads.items())


def test_inference_graphs_fused_where_the_gemm_rule_runs_the_kernel(library, graph_mode):
    """float32 with ``linear: auto``: an inference graph of 32 rows (the GEMM kernel's, so the epilogues') has logits
    whose error against the float64 model's is within 8x the unfused MLP's + 4 u of the largest logit
    (``assert_error_of_plain_size``); one of 8 rows (MatMul's graph, the unfused MLP) the unfused MLP's exactly."""
    fused, plain = _pair({})
    for model in (fused, plain):
        model.set_train(False)
    for batch, exact in ((2, False), (1, True)):
        ids = _batch(batch)[0][:, : 8 if exact else SEQ]
        got, want = fused(ids).asnumpy(), plain(ids).asnumpy()
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            exact_logits = gpt_float64_logits(float64_weights(plain), ids, plain.config)
            assert_error_of_plain_size(got, want, exact_logits, "logits")


def test_which_builds_fuse(library):
    """The epilogues under ``gemm_epilogue: kernel`` only, with the linear and bias_gelu kernels; their residual
    needs nothing between the MLP and its Add (hidden_dropout 0); ``auto`` and ``plain`` (the op, or everything)
    build the unfused MLP."""
    def mlp_of(cpu_kernels=None, **values):
        kernels = cpu_kernels or {"gemm_epilogue": "kernel"}
        layer = GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, cpu_kernels=kernels, **values))).model.layers[0]
        return type(layer.mlp).__name__, layer.mlp_residual

    assert mlp_of() == ("EpilogueFeedForward", True)
    assert mlp_of(compute_dtype="bfloat16") == ("EpilogueFeedForward", True)
    assert mlp_of(hidden_dropout=0.1) == ("EpilogueFeedForward", False)
    assert mlp_of({"gemm_epilogue": "kernel", "bias_gelu": "plain"})[0] == "ParallelFeedForward"
    assert mlp_of({"gemm_epilogue": "kernel", "linear": "plain"}) == ("BiasGeLUFeedForward", False)
    assert mlp_of({"linear": "kernel"}) == ("BiasGeLUFeedForward", False)  # auto: off
    assert mlp_of({"gemm_epilogue": "plain"}) == ("BiasGeLUFeedForward", False)
    assert mlp_of("plain") == ("ParallelFeedForward", False)
    assert mlp_of(hidden_act="gelu")[0] == "ParallelFeedForward"  # the erf GeLU: no kernel form
