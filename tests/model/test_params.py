"""The parameter table (model/params.py) is the model: names, shapes and stages equal what a built model
holds, for several layouts; and every consumer (conversion, checkpoint check, split, memory estimate)
reads it."""
import numpy as np
import pytest

from mindformers_gptlocal import GPTLocalConfig, GPTLocalForCausalLM
from mindformers_gptlocal.checkpoint.hf_gpt2 import expected_local_shapes, local_to_hf_name
from mindformers_gptlocal.model.params import layer_of, parameter_table
from mindformers_gptlocal.parallel.layout import Layout
from mindformers_gptlocal.parallel.sharding import model_rules, param_layouts
from mindformers_gptlocal.plan import memory as mem
from conftest import TINY

LAYOUTS = {
    "one device": {},
    "dp2 mp2, seq parallel": {"data_parallel": 2, "model_parallel": 2, "use_seq_parallel": True},
    "pp2 offset [1, -1], vocab split": {"pipeline_stage": 2, "micro_batch_num": 2, "offset": [1, -1],
                                       "model_parallel": 2, "vocab_emb_dp": False},
    "pp3 mcore names": {"pipeline_model_parallel_size": 3, "micro_batch_num": 3, "tensor_model_parallel_size": 2},
}


def _config(parallel):
    return GPTLocalConfig(**dict(TINY, num_hidden_layers=4, intermediate_size=96), parallel_config=parallel)


def _stage_of(model, name):
    """The pipeline stage the built model gives the Cell owning parameter ``name``."""
    layer = layer_of(name)
    if layer is not None:
        return model.model.layers[layer].pipeline_stage
    if name.startswith("model.embedding."):
        return model.model.embedding.pipeline_stage
    return model.model.final_layernorm.pipeline_stage


@pytest.mark.parametrize("parallel", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_table_equals_the_built_model(parallel):
    config = _config(parallel)
    model = GPTLocalForCausalLM(config)
    table = parameter_table(config)
    built = {name: tuple(param.shape) for name, param in model.parameters_and_names()}
    assert {name: spec.shape for name, spec in table.items()} == built
    assert set(param_layouts(model_rules(config))) == set(table)
    last = max(model.model.stage_ids)
    for name, spec in table.items():
        if name == "model.embedding.word_embeddings":
            assert spec.stages == sorted({0, last})  # the tied head reads it on the last stage
        else:
            assert spec.stages == [_stage_of(model, name)], name


def test_layout_reads_offsets_and_aliases_once():
    layout = _config(LAYOUTS["pp2 offset [1, -1], vocab split"]).layout
    assert (layout.pp, layout.mp, layout.vocab_emb_dp) == (2, 2, False)
    assert layout.stage_of_layers(4) == [0, 0, 0, 1]
    assert _config(LAYOUTS["pp3 mcore names"]).layout.summary() == dict(dp=1, mp=2, pp=3, micro=3,
                                                                         seq_parallel=False, vocab_emb_dp=True)
    # model_config.offset wins over parallel_config.offset, as MindFormers reads it
    yaml = {"model": {"model_config": {"offset": [0, 1]}}, "parallel_config": {"pipeline_stage": 2, "offset": [1, 0]}}
    assert Layout.of_run_yaml(yaml).offset == (0, 1)


def test_split_axes_follow_the_rules():
    table = parameter_table(_config(LAYOUTS["pp2 offset [1, -1], vocab split"]))
    assert table["model.layers.0.attention.linear_qkv.weight"].split_axis == 0     # column parallel
    assert table["model.layers.0.attention.linear_proj.weight"].split_axis == 1    # row parallel
    assert table["model.layers.0.attention.linear_proj.bias"].split_axis is None   # added after the all-reduce
    assert table["model.layers.0.mlp.linear_fc1.bias"].split_axis == 0
    assert table["model.embedding.word_embeddings"].split_axis == 0                # vocab_emb_dp False
    assert table["model.embedding.position_embeddings"].split_axis is None


def test_consumers_read_the_table():
    config = _config({})
    table = parameter_table(config)
    local = dict(TINY, num_hidden_layers=4, intermediate_size=96)
    assert expected_local_shapes(local) == {name: spec.shape for name, spec in table.items()}
    assert all(local_to_hf_name(name) for name in table)  # the HF weight map covers every parameter
    s = mem.shape_of(local)
    mp2 = parameter_table(config, Layout(mp=2))
    per_layer = sum(spec.rank_size(2) for name, spec in mp2.items() if layer_of(name) == 0)
    assert mem.layer_params(s, 2) == per_layer
    full = sum(int(np.prod(spec.shape)) for spec in table.values())
    assert sum(mem.stage_params(s, [4])[0].values()) == full


# the Llama-style and NeoX-style layer options (GQA, SwiGLU, RMSNorm, no biases, rope, untied head, parallel
# residual): the same table, the same checks
ARCHS = {
    "llama": dict(position_embedding_type="rope", num_query_groups=2, hidden_act="swiglu", normalization="RMSNorm",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True),
    "qwen2-tied": dict(position_embedding_type="rope", num_query_groups=2, hidden_act="swiglu",
                       normalization="RMSNorm", add_bias_linear=False, add_qkv_bias=True),
    "neox": dict(position_embedding_type="rope", rotary_percent=0.25, use_parallel_residual=True,
                 tie_word_embeddings=False),
}


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("parallel", [LAYOUTS["one device"], LAYOUTS["pp2 offset [1, -1], vocab split"]],
                         ids=["one device", "pp2 mp2 vocab split"])
def test_table_equals_the_built_model_for_every_architecture(arch, parallel):
    from mindformers_gptlocal.model.params import OUTPUT_LAYER
    config = GPTLocalConfig(**dict(TINY, num_hidden_layers=4, intermediate_size=96), **ARCHS[arch],
                            parallel_config=parallel)
    model = GPTLocalForCausalLM(config)
    table = parameter_table(config)
    built = {name: tuple(param.shape) for name, param in model.parameters_and_names()}
    assert {name: spec.shape for name, spec in table.items()} == built
    assert set(param_layouts(model_rules(config, arch=config.arch))) == set(table)
    last = max(model.model.stage_ids)
    untied = config.untie_embeddings_and_output_weights
    for name, spec in table.items():
        if name == OUTPUT_LAYER:
            assert spec.stages == [last] == [model.output_layer.pipeline_stage]
        elif name == "model.embedding.word_embeddings":
            assert spec.stages == ([0] if untied else sorted({0, last}))
        else:
            assert spec.stages == [_stage_of(model, name)], name
    assert "model.embedding.position_embeddings" not in table  # rope: no learned positions
    if arch != "neox":  # GQA: q 4 heads + k, v 2 groups each, of 16 channels
        assert table["model.layers.0.attention.linear_qkv.weight"].shape == ((4 + 2 * 2) * 16, 64)
        assert ("model.layers.0.attention.linear_qkv.bias" in table) == (arch == "qwen2-tied")
        assert table["model.layers.0.mlp.linear_gate.weight"].split_axis == 0  # column parallel like fc1
    # the planner counts what the table holds
    s = mem.shape_of(dict(TINY, num_hidden_layers=4, intermediate_size=96, **ARCHS[arch]))
    full = sum(int(np.prod(spec.shape)) for spec in parameter_table(config, Layout()).values())
    assert sum(mem.stage_params(s, [4])[0].values()) == full


def test_kv_cache_arithmetic_shrinks_by_the_group_size():
    llama_1b = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_query_groups=8,
                    seq_length=2048, compute_dtype="bfloat16", **{k: v for k, v in ARCHS["llama"].items()
                                                                  if k != "num_query_groups"})
    gqa = mem.kv_cache_bytes(mem.shape_of(llama_1b), 1, 2048)
    mha = mem.kv_cache_bytes(mem.shape_of(dict(llama_1b, num_query_groups=32)), 1, 2048)
    assert gqa == 2 * 16 * 8 * 2048 * 64 * 2 == 64 * 2 ** 20  # 64 MiB per 2048-token sequence
    assert mha == 4 * gqa


def test_lora_on_the_gated_mlp_and_grouped_qkv():
    """LoRA adapters on linear_gate (SwiGLU) and the group-major QKV: table == built model, B split like W."""
    pet = dict(pet_type="lora", lora_rank=4, lora_alpha=8, target_modules=".*linear_gate|.*linear_qkv",
               freeze_include=["*"], freeze_exclude=["*lora*"])
    config = GPTLocalConfig(**dict(TINY, intermediate_size=96), **ARCHS["llama"], pet_config=pet)
    model = GPTLocalForCausalLM(config)
    table = parameter_table(config, Layout(mp=2))
    built = {name: tuple(param.shape) for name, param in model.parameters_and_names() if name != "dropout_step"}
    assert {name: spec.shape for name, spec in table.items()} == built
    assert table["model.layers.1.mlp.linear_gate.lora_b"].shape == (96, 4)
    assert table["model.layers.1.mlp.linear_gate.lora_b"].split_axis == 0
    assert table["model.layers.0.attention.linear_qkv.lora_b"].shape == ((4 + 2 * 2) * 16, 4)
    trainable = {p.name for p in model.trainable_params()}
    assert trainable == {n for n in table if n.endswith(("lora_a", "lora_b"))}
