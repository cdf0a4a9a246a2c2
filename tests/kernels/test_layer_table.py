"""A decoder layer's parameters written once (``kernels/abi/layer_table.py`` ``LAYER``): the native runner's struct, the
decode layer's and the training layer's tensors, the training layer's structs and the model's parameter table
(``model/params.py`` ``layer_shapes``) all come from it, and a part added to it (a per-head gate) reaches each."""
import os
import re

from mindformers_gptlocal.kernels.abi import build, codegen, layer_table, table
from mindformers_gptlocal.kernels.abi.layer_table import LAYER, Tensor
from mindformers_gptlocal.model.arch import Arch
from mindformers_gptlocal.model.params import layer_shapes

HEAD_GATE = Tensor("head_gate", "attention.head_gate", ("N",), "head_gate", ("Nh",))


def _names(kernel):
    return [t.name for t in table.KERNELS[kernel].tensors]


def test_every_kernel_takes_the_parts_in_the_tables_order():
    parameters = [name for name, _ in layer_table.train_layer_parameters()]
    forward, backward = _names("gptlocal_train_layer_fwd"), _names("gptlocal_train_layer_bwd")
    assert [n for n in forward if n in parameters] == parameters == list(table.TRAIN_LAYER_PARAMETERS)
    assert [n[1:] for n in backward if n[1:] in parameters and n.startswith("d")] == parameters
    assert [f for f, _ in table.TrainLayerParams.fields] == parameters
    assert [f for f, _ in table.TrainLayerGrads.fields] == ["d" + n for n in parameters] + ["dhidden"]
    fields = [f for f, _ in table.DecoderLayer.fields]
    owners = [next(p.name for p in LAYER if f == p.name or f.startswith(p.name + "_")) for f in fields[1:]]
    assert fields[0] == "scale" and list(dict.fromkeys(owners)) == [part.name for part in LAYER]
    assert layer_table.pointer_fields() == fields[1:]
    for symbol in ("gptlocal_decode_layer_fwd", "gptlocal_decode_layer_int8_fwd", "gptlocal_decode_layer_bf16w_fwd"):
        assert _names(symbol)[1:len(fields)] == fields[1:]  # the decode layer's tensors are DecoderLayer's fields


def test_the_cpp_takes_the_generated_structs():
    header = codegen.header()
    for name in ("DecoderLayer", "TrainLayerInputs", "TrainLayerParams", "TrainLayerGrads"):
        assert f"struct {name} {{" in header
    # the training layer's cores take the structs, not one pointer a tensor
    declaration = re.search(r"int gptlocal_core_train_layer_bwd\(([^)]*)\)", header).group(1)
    assert "const TrainLayerParams &" in declaration and "const TrainLayerGrads &" in declaration
    assert declaration.count(",") + 1 < 30
    for core in ("decode_layer_fwd", "decode_layer_int8_fwd", "decode_layer_bf16w_fwd"):
        assert f"int gptlocal_core_{core}(const float *hidden, const DecoderLayer &decoder_layer," in header
    kernels = build.CSRC
    decoder_h = open(os.path.join(kernels, "cpu_decoder.h"), encoding="utf-8").read()
    assert "using LayerWeights = ::DecoderLayer;" in decoder_h
    train = open(os.path.join(kernels, "cpu_train_layer.cc"), encoding="utf-8").read()
    assert "using Params = TrainLayerParams;" in train and "w.b[" not in train


def test_the_models_parameter_table_reads_it():
    arch = Arch(normalization="RMSNorm", gated_linear_unit=True, hidden_act="silu", add_bias_linear=False,
                num_query_groups=2, position_embedding_type="rope")
    shapes = layer_shapes({"hidden": 64, "inter": 96, "heads": 4, "groups": 2, "arch": arch})
    assert list(shapes) == ["input_layernorm.weight", "attention.linear_qkv.weight", "attention.linear_proj.weight",
                            "post_attention_layernorm.weight", "mlp.linear_fc1.weight", "mlp.linear_gate.weight",
                            "mlp.linear_fc2.weight"]
    assert shapes["attention.linear_qkv.weight"] == ((4 + 2 * 2) * 16, 64)


def test_a_new_part_reaches_every_generated_list():
    """A per-head gate after the projection: one line of the description gives its pointer in DecoderLayer, its
    tensor in the decode layer's inputs, the training layer's parameter and gradient."""
    layer = LAYER[:3] + (HEAD_GATE,) + LAYER[3:]
    assert "head_gate: f32*" in layer_table.decoder_layer_fields(layer).split(", ")
    assert "head_gate: f32[_]" in layer_table.decode_layer_parameters("f32", layer)
    assert ("head_gate", "Nh") in layer_table.train_layer_parameters(layer)
    assert "head_gate" not in layer_table.decoder_layer_fields()


def test_the_decode_layer_nulls_what_the_mask_names():
    """``drop_absent`` (cores.h, generated) nulls each DecoderLayer pointer whose bit ``pointer_mask`` sets, for
    whatever part: a new part's placeholder needs no option of its own."""
    header = codegen.header()
    fields = layer_table.pointer_fields()
    for i, field in enumerate(fields):
        assert f"if (absent & (1 << {i})) s.{field} = nullptr;" in header
    assert table.DecoderLayer.pointer_mask(["qkv_bias", fields[-1]]) == (1 << 4) | (1 << (len(fields) - 1))


def test_cells_pairs_each_part_with_the_blocks_cell():
    class Cell:
        pass
    block = Cell()
    block.input_layernorm, block.attention, block.mlp = Cell(), Cell(), Cell()
    block.attention.linear_qkv = "qkv"
    found = dict((part.name, cell) for part, cell in layer_table.cells(block))
    assert found["norm1"] is block.input_layernorm and found["qkv"] == "qkv" and found["gate"] is None
