"""One description of a decoder layer's parameters, written once: ``LAYER``, its parts in the order every kernel
takes them (the two norms and the five Linears), each with the sub-Cell of ``model/gpt.py`` ``GPTLocalBlock`` that
owns it, its shapes (the kernels' size names: H hidden, Q the fused QKV's rows (N + 2 G) D, ND the query heads' width,
I the MLP's inner width) and when the layer has it (a bias: ``bias`` or ``qkv_bias``; a norm's shift: LayerNorm only;
SwiGLU's gate: ``gated``).

What is generated from it (``table.py``; the C++ through ``codegen.py`` into ``cores.h``):

- ``DecoderLayer`` (the native runner's struct, ``cpu_decoder.h``'s ``LayerWeights``): the attention scale, then each
  norm's weight and bias, each Linear's weight, int8 scales and bias (null where the layer has none);
- the decode layer's tensors (``decode_layer_inputs``): the same order and names, each Linear as weight, scales,
  bias (its cores take them as one ``DecoderLayer``; ``pointer_fields``), and the mask of those handed a placeholder
  (``DecoderLayer.pointer_mask``, the model's ``layer_facts``) that the node nulls (``drop_absent`` in ``cores.h``);
- the training layer's parameters (``TRAIN_LAYER_PARAMETERS``, its inputs) and gradients (its backward's outputs),
  and the C++ structs its cores take them in (``TrainLayerParams``, ``TrainLayerGrads``);
- ``cells(block)``: (part, the block's sub-Cell) in this order, what the model and the runners iterate;
  ``parameter_slots``: (part, sub-Cell path, attribute) of each tensor the kernels take, what ``model/gpt.py``'s
  kernel paths hand them (``DECODE_WEIGHTS``, ``TRAIN_WEIGHTS``) and ``model/describe.py`` names for the native
  runner.

The Cells take the parameters in this order (``decode_layer.py``, ``train_layer.py``: ``*parameters``; the training
layer's stand-ins built from ``train_layer_parameters``), as ``model/gpt.py``'s kernel paths hand them
(``DECODE_WEIGHTS``, ``TRAIN_WEIGHTS``).

A new parameter of every layer (say a per-head gate on attention's output: ``Tensor("head_gate",
"attention.head_gate", ("N",), "head_gate", ("Nh",))``) is a part here (``tests/kernels/test_layer_table.py`` shows
where it lands); its C++ use in the cores (``cpu_decoder.cc`` ``layer_forward``, ``cpu_train_layer.cc``: a new size
name such as ``Nh`` is one more argument of the training cores) and the Cell that owns it (``model/attention.py`` /
``model/gpt.py``, and its layout flag in ``model/fields.py``) are the other places.
"""
import collections

# A norm: weight [H] and, LayerNorm only, its shift [H] (the training layer binds the shift's length to Hn: a
# one-element stand-in under RMSNorm).
Norm = collections.namedtuple("Norm", "name cell when", defaults=(None,))  # when: every layer has both
# A Linear: weight [out, inp], an int8 model's float32 scales [out], bias [out] where ``bias`` (a layout flag: "bias",
# "qkv_bias") is on; ``when``: the layout flag the Linear needs ("gated": SwiGLU's gate), None: every layer; the
# training layer's size names of its weight's rows and bias's length where they may be a stand-in's (``train_out``,
# ``train_bias``).
Linear = collections.namedtuple("Linear", "name cell out inp bias when train_out train_bias")
# Any other float32 parameter: a Parameter ``cell`` (a dotted path from the block) of shape ``dims`` (size names);
# ``when``: the layout flag it needs (None: every layer); ``train_dims``: the training layer's size names of it (a
# stand-in's where ``when`` may be off).
Tensor = collections.namedtuple("Tensor", "name cell dims when train_dims")

LAYER = (
    Norm("norm1", "input_layernorm"),
    Linear("qkv", "attention.linear_qkv", "Q", "H", "qkv_bias", None, "Q", "Qb"),
    Linear("proj", "attention.linear_proj", "H", "ND", "bias", None, "H", "Hb"),
    Norm("norm2", "post_attention_layernorm"),
    Linear("fc1", "mlp.linear_fc1", "I", "H", "bias", None, "I", "Ib"),
    Linear("gate", "mlp.linear_gate", "I", "H", "bias", "gated", "Ig", "Igb"),
    Linear("fc2", "mlp.linear_fc2", "H", "I", "bias", None, "H", "Hb"),
)
LINEARS = tuple(part for part in LAYER if isinstance(part, Linear))
NORMS = tuple(part for part in LAYER if isinstance(part, Norm))


def cells(block, layer=LAYER):
    """(part, the sub-Cell (a ``Tensor``: the Parameter) of ``block`` that holds it) for each part of ``layer`` (one
    the block has not, e.g. a GeLU MLP's gate: None)."""
    found = []
    for part in layer:
        cell = block
        for name in part.cell.split("."):
            cell = getattr(cell, name, None)
        found.append((part, cell))
    return found


def parameter_slots(layer=LAYER, scales=False):
    """(part, the path of the sub-Cell under the block that holds it, its attribute) of each tensor a layer kernel
    takes, in ``layer``'s order: a norm's ``weight``, ``bias``; a Linear's ``weight``, an int8 model's
    ``weight_scale`` (with ``scales``: the decode layer's), ``bias``; another tensor's Parameter (its ``cell``'s last
    name, on the Cell before it)."""
    found = []
    for part in layer:
        if isinstance(part, Tensor):
            owner, _, name = part.cell.rpartition(".")
            found.append((part, owner, name))
            continue
        names = ("weight", "bias") if isinstance(part, Norm) or not scales else ("weight", "weight_scale", "bias")
        found += [(part, part.cell, name) for name in names]
    return tuple(found)


def decoder_layer_fields(layer=LAYER):
    """``DecoderLayer``'s fields (``spec.Struct`` text): the attention scale, then the parts' pointers."""
    fields = ["scale: float"]
    for part in layer:
        if isinstance(part, Tensor):
            fields.append(f"{part.name}: f32*")
        elif isinstance(part, Norm):
            fields += [f"{part.name}_weight: f32*", f"{part.name}_bias: f32*"]
        else:
            fields += [f"{part.name}: void*", f"{part.name}_scale: f32*", f"{part.name}_bias: f32*"]
    return ", ".join(fields)


def pointer_fields(layer=LAYER):
    """``DecoderLayer``'s pointer fields, in order: the decode layer's parameter tensors' names (``parameter_slots``
    with scales gives the model's Parameter of each)."""
    return [field.split(":")[0] for field in decoder_layer_fields(layer).split(", ")[1:]]


def decode_layer_parameters(weight, layer=LAYER):
    """The decode layer's parameter tensors (``spec`` text) with Linear weights of dtype ``weight``: a norm's weight
    [H] and bias (a placeholder under RMSNorm), each Linear's weight, scales and bias (placeholders where the layer
    has none; an optional Linear's weight too), another tensor of its dims (any, where optional)."""
    tensors = []
    for part in layer:
        if isinstance(part, Tensor):
            tensors.append(f"{part.name}: f32[{', '.join('_' if part.when else d for d in part.dims)}]")
            continue
        if isinstance(part, Norm):
            tensors += [f"{part.name}_weight: f32[H]", f"{part.name}_bias: f32[_]"]
            continue
        dims = "_, _" if part.when else f"{part.out}, {part.inp}"
        tensors += [f"{part.name}: {weight}[{dims}]", f"{part.name}_scale: f32[_]", f"{part.name}_bias: f32[_]"]
    return ", ".join(tensors)


def train_layer_parameters(layer=LAYER):
    """((name, dims), ...) of the training layer's parameters, in ``layer``'s order: a norm's weight [H] and shift
    [Hn]; a Linear's weight [train_out, inp] and bias [train_bias] (an absent one a one-element stand-in); another
    tensor [train_dims]."""
    found = []
    for part in layer:
        if isinstance(part, Tensor):
            found.append((part.name, ", ".join(part.train_dims)))
        elif isinstance(part, Norm):
            found += [(f"{part.name}_w", "H"), (f"{part.name}_b", "Hn")]
        else:
            found += [(f"{part.name}_w", f"{part.train_out}, {part.inp}"), (f"{part.name}_b", part.train_bias)]
    return tuple(found)
