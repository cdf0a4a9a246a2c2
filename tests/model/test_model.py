"""The model itself: structure, shapes, dtypes, loss, initialisation, placement, weights I/O."""
import math

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.model import GPTLocalBlock, ParallelAttention, ParallelFeedForward
from mindformers_gptlocal.parallel.layout import layers_per_stage, recompute_layers, stage_of_layers
from mindformers_gptlocal.errors import ConfigError, CheckpointError
from conftest import TINY


def ids(batch, seq, vocab=TINY["vocab_size"], seed=0):
    return Tensor(np.random.default_rng(seed).integers(0, vocab, (batch, seq)), ms.int32)


def test_layer_sliced_structure(tiny_config):
    model = GPTLocalForCausalLM(tiny_config)
    layers = model.model.layers
    assert len(layers) == tiny_config.num_hidden_layers
    for block in layers:
        assert isinstance(block, GPTLocalBlock)
        assert isinstance(block.attention, ParallelAttention)
        assert isinstance(block.mlp, ParallelFeedForward)
    names = {p.name for p in model.get_parameters()}
    # biases on every linear, learned positions, no separate head (tied to the token embedding)
    for linear in ("attention.linear_qkv", "attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2"):
        assert f"model.layers.0.{linear}.bias" in names
    assert "model.embedding.position_embeddings" in names
    assert not any("head" in n or "output_layer" in n for n in names)


def test_eval_logits_shape_dtype_and_tied_head(tiny_config):
    model = GPTLocalForCausalLM(tiny_config)
    model.set_train(False)
    logits = model(ids(2, 16))
    assert logits.shape == (2, 16, TINY["vocab_size"]) and logits.dtype == ms.float32
    hidden = model.model(ids(2, 16), Tensor(np.tile(np.arange(16), (2, 1)), ms.int32))
    manual = hidden.asnumpy() @ model.model.embedding.word_embeddings.asnumpy().T
    np.testing.assert_allclose(logits.asnumpy(), manual, atol=1e-4)


def test_graph_mode_matches_pynative(tiny_config):
    model = GPTLocalForCausalLM(tiny_config)
    model.set_train(False)
    batch = ids(2, 32)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    eager = model(batch).asnumpy()
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        graph = model(batch).asnumpy()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    np.testing.assert_allclose(graph, eager, atol=1e-5)


@pytest.mark.parametrize("plain", [False, True])
def test_causality(tiny_config, plain):
    """Changing a later token never changes earlier logits: with the CPU attention kernel (causal by itself) and
    on the plain matmul + softmax path (GPU/Ascend's), which relies on the model's causal mask alone."""
    if plain:
        tiny_config.cpu_kernels = "plain"
    model = GPTLocalForCausalLM(tiny_config)
    attention = model.model.layers[0].attention
    assert attention.core is attention.plain or not plain
    model.set_train(False)
    a = ids(1, 16).asnumpy()
    b = a.copy()
    b[0, 10:] = (b[0, 10:] + 7) % TINY["vocab_size"]
    la, lb = model(Tensor(a)).asnumpy(), model(Tensor(b)).asnumpy()
    np.testing.assert_allclose(la[0, :10], lb[0, :10], atol=1e-5)
    assert np.abs(la[0, 10:] - lb[0, 10:]).max() > 1e-3


def test_training_loss_matches_numpy_cross_entropy_and_honours_loss_mask(tiny_config):
    model = GPTLocalForCausalLM(tiny_config)
    tokens = ids(2, 17).asnumpy()
    inputs, labels = tokens[:, :-1], tokens[:, 1:]
    mask = np.ones_like(labels)
    mask[:, :8] = 0
    model.set_train(False)
    logits = model(Tensor(inputs)).asnumpy().reshape(-1, TINY["vocab_size"]).astype(np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(1, keepdims=True)).sum(1, keepdims=True)) - logits.max(1, keepdims=True)
    nll = -logp[np.arange(labels.size), labels.ravel()]
    model.set_train(True)
    full, *extra = model(Tensor(inputs), Tensor(labels), Tensor(np.ones_like(mask)))  # mtp, aux (1.9: + indexer)
    masked = model(Tensor(inputs), Tensor(labels), Tensor(mask))[0]
    assert len(extra) == model.train_outputs - 1 and all(float(loss) == 0.0 for loss in extra)
    assert math.isclose(float(full), nll.mean(), rel_tol=1e-5)
    assert math.isclose(float(masked), nll[mask.ravel() == 1].mean(), rel_tol=1e-5)
    shifted = model(Tensor(tokens))[0]  # no labels: input_ids carry seq+1 tokens
    assert math.isclose(float(shifted), float(full), rel_tol=1e-6)


def test_gpt2_initialisation(tiny_config):
    config = GPTLocalConfig(**dict(TINY, hidden_size=256, num_hidden_layers=8, num_attention_heads=4))
    model = GPTLocalForCausalLM(config)
    params = {p.name: p.asnumpy() for p in model.get_parameters()}
    assert abs(params["model.layers.0.attention.linear_qkv.weight"].std() - 0.02) < 0.002
    residual = 0.02 / math.sqrt(2 * 8)
    assert abs(params["model.layers.3.mlp.linear_fc2.weight"].std() - residual) < 0.1 * residual
    assert abs(params["model.layers.3.attention.linear_proj.weight"].std() - residual) < 0.1 * residual
    assert np.all(params["model.layers.0.attention.linear_qkv.bias"] == 0)
    assert np.all(params["model.final_layernorm.weight"] == 1)


@pytest.mark.parametrize("compute,params_dtype", [("float16", "float32"), ("float32", "float16")])
def test_dtypes_honoured(compute, params_dtype):
    config = GPTLocalConfig(**dict(TINY, compute_dtype=compute, params_dtype=params_dtype))
    model = GPTLocalForCausalLM(config)
    assert model.model.layers[0].attention.linear_qkv.weight.dtype == getattr(ms, params_dtype)
    model.set_train(False)
    logits = model(ids(1, 8))
    assert logits.dtype == ms.float32 and np.isfinite(logits.asnumpy()).all()


def test_stage_assignment_and_recompute_rules():
    assert stage_of_layers(8, 2) == [0] * 4 + [1] * 4
    assert layers_per_stage(10, 4) == [2, 3, 3, 2]
    assert layers_per_stage(64, 4, [-1, -1, 1, 1]) == [15, 15, 17, 17]
    with pytest.raises(ConfigError, match="offset"):
        layers_per_stage(8, 2, [1, 1])
    with pytest.raises(ConfigError, match="pipeline_stage"):
        layers_per_stage(2, 4)
    stages = stage_of_layers(6, 2)
    assert recompute_layers(True, stages) == [True] * 6
    assert recompute_layers([1, 2], stages) == [True, False, False, True, True, False]


def test_blocks_carry_stage_and_recompute_from_config():
    config = GPTLocalConfig(**dict(TINY, num_hidden_layers=4),
                            parallel_config={"pipeline_stage": 2, "micro_batch_num": 2,
                                             "recompute": {"recompute": [1, 0]}})
    model = GPTLocalForCausalLM(config)
    assert model.model.stage_ids == [0, 0, 1, 1]
    assert [block.pipeline_stage for block in model.model.layers] == [0, 0, 1, 1]
    assert [block.recompute_mode for block in model.model.layers] == ["full", "none", "none", "none"]
    assert model.model.layers[0]._has_config_recompute and not model.model.layers[1]._has_config_recompute
    assert model.model.final_layernorm.pipeline_stage == 1


def test_save_and_from_pretrained_round_trip(tiny_config, tmp_path):
    model = GPTLocalForCausalLM(tiny_config)
    model.save_pretrained(str(tmp_path / "m"))
    loaded = GPTLocalForCausalLM.from_pretrained(str(tmp_path / "m"))
    for a, b in zip(model.get_parameters(), loaded.get_parameters()):
        assert a.name == b.name
        np.testing.assert_array_equal(a.asnumpy(), b.asnumpy())
    model.set_train(False)
    loaded.set_train(False)
    np.testing.assert_array_equal(model(ids(1, 8)).asnumpy(), loaded(ids(1, 8)).asnumpy())


def test_loading_weights_of_another_size_is_refused(tiny_config, tmp_path):
    GPTLocalForCausalLM(GPTLocalConfig(**dict(TINY, hidden_size=32))).save_pretrained(str(tmp_path / "small"))
    with pytest.raises(CheckpointError, match="shape"):
        GPTLocalForCausalLM(tiny_config).load_weights(str(tmp_path / "small"))
    with pytest.raises(CheckpointError, match="does not exist"):
        GPTLocalForCausalLM(tiny_config).load_weights(str(tmp_path / "nowhere"))
    (tmp_path / "bad.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        GPTLocalForCausalLM(tiny_config).load_weights(str(tmp_path / "bad.safetensors"))


def test_cpu_tanh_gelu_equals_the_gelu_kernel_forward_and_backward():
    """On CPU the tanh GeLU is composed from sigmoid (8x faster there), with its own backward in
    training and inline otherwise; both are the GeLU kernel's function and derivative, in graph and
    PyNative mode."""
    from mindspore import ops
    from mindformers_gptlocal.kernels.provider import KernelProvider
    from mindformers_gptlocal.model.layers import Activation
    x = ms.Tensor(np.random.default_rng(0).standard_normal((4, 8, 96)).astype(np.float32) * 4)
    sens = ms.Tensor(np.random.default_rng(1).standard_normal((4, 8, 96)).astype(np.float32))
    kernel = ops.GeLU()

    def reference_gelu(t):
        return kernel(t)

    mode = ms.get_context("mode")
    try:
        for run_mode in (ms.GRAPH_MODE, ms.PYNATIVE_MODE):
            ms.set_context(mode=run_mode)
            for training in (True, False):
                activation = Activation("gelu_new", KernelProvider()).set_train(training)
                assert activation.composed_tanh_gelu  # this suite runs on CPU
                np.testing.assert_allclose(activation(x).asnumpy(), kernel(x).asnumpy(), rtol=0, atol=2e-6)
                ours = ops.GradOperation(sens_param=True)(activation)(x, sens).asnumpy()
                reference = ops.GradOperation(sens_param=True)(reference_gelu)(x, sens).asnumpy()
                np.testing.assert_allclose(ours, reference, rtol=0, atol=1e-5)
    finally:
        ms.set_context(mode=mode)
