"""recompute_config -> what each block recomputes, set once at build time (MindFormers 1.8.0 key names)."""
import pytest

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.errors import ConfigError
from conftest import TINY
from references import LossOf


def build(**recompute):
    config = GPTLocalConfig(**dict(TINY, num_hidden_layers=4),
                            parallel_config={"pipeline_stage": 2, "micro_batch_num": 2, "recompute": recompute})
    return GPTLocalForCausalLM(config).model.layers


def test_select_recompute_list_and_comm_recompute():
    layers = build(recompute=[1, 0], select_recompute=["attention.softmax", r"mlp\.activation"],
                   select_comm_recompute=True, mp_comm_recompute=False)
    assert [b.recompute_mode for b in layers] == ["full", "selective", "selective", "selective"]
    assert layers[0]._has_config_recompute and not layers[1]._has_config_recompute
    assert layers[1].attention.plain.softmax.attrs.get("recompute") is True
    assert layers[1].mlp.activation._has_config_recompute
    assert layers[1].attention.plain.attention_dropout._has_config_recompute is False  # not listed
    for block in layers[1:]:  # comm recompute marks the LayerNorm primitives of the layers not fully recomputed
        assert block.input_layernorm.layer_norm.attrs.get("recompute_comm_op") is True
        assert block.post_attention_layernorm.layer_norm.attrs.get("recompute_comm_op") is True
    # the fully recomputed layer got mp_comm_recompute=False through Cell.recompute
    assert layers[0].input_layernorm.layer_norm.attrs.get("recompute_comm_op") is False


def test_select_recompute_true_and_per_stage_dict():
    layers = build(select_recompute=True)
    assert [b.recompute_mode for b in layers] == ["selective"] * 4
    assert layers[0].attention.plain.attention_dropout._has_config_recompute
    layers = build(select_recompute={"attention.softmax": [1, 0]})  # first layer of stage 0 only
    assert [b.recompute_mode for b in layers] == ["selective", "none", "none", "none"]


def test_bad_recompute_settings_are_refused_by_name():
    with pytest.raises(ConfigError, match="attention.softmaxx"):
        build(select_recompute=["attention.softmaxx"])
    with pytest.raises(ConfigError, match="select_recompute_exclude"):
        build(select_recompute_exclude=["attention.softmax"])
    with pytest.raises(ConfigError, match="is a Cell"):
        build(select_comm_recompute=["mlp.activation"])


LLAMA = dict(position_embedding_type="rope", num_query_groups=2, hidden_act="swiglu", normalization="RMSNorm",
             add_bias_linear=False)


def test_llama_style_blocks_take_the_same_recompute_settings():
    config = GPTLocalConfig(**dict(TINY, num_hidden_layers=4), **LLAMA,
                            parallel_config={"pipeline_stage": 2, "micro_batch_num": 2,
                                             "recompute": {"recompute": [1, 0], "select_recompute": True,
                                                           "select_comm_recompute": True}})
    layers = GPTLocalForCausalLM(config).model.layers
    assert [b.recompute_mode for b in layers] == ["full", "selective", "selective", "selective"]
    assert layers[1].mlp.activation._has_config_recompute  # SwiGLU's silu
    assert layers[1].input_layernorm.weight_mul.attrs.get("recompute_comm_op") is True  # RMSNorm's output op


def test_full_recompute_of_rope_gqa_blocks_keeps_loss_and_gradients():
    """Graph mode: the rotary (cos, sin) tuple goes into recomputed blocks; gradients equal no recompute."""
    import numpy as np
    import mindspore as ms
    from mindspore import Tensor
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        results = []
        for recompute in (False, True):
            ms.set_seed(0)
            config = GPTLocalConfig(**dict(TINY, num_hidden_layers=2), **LLAMA,
                                    parallel_config={"recompute": {"recompute": recompute}})
            model = GPTLocalForCausalLM(config)
            model.set_train(True)
            ids = Tensor(np.random.default_rng(0).integers(0, TINY["vocab_size"], (2, 17)), ms.int32)
            weights = model.trainable_params()
            loss, grads = ms.value_and_grad(LossOf(model), None, weights)(ids)
            results.append((float(loss), {w.name: g.asnumpy() for w, g in zip(weights, grads)}))
        assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
        for name, grad in results[0][1].items():
            np.testing.assert_allclose(results[1][1][name], grad, atol=1e-6, err_msg=name)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
