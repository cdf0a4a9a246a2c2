"""The one table of gpt_local's parameters: name -> shape, layout over ``mp``, pipeline stages.

Everything that names or sizes a weight reads it from here: HF conversion (``checkpoint/hf_gpt2.py``),
the checkpoint check before a load (``model/weights.py``), per-rank split/merge
(``checkpoint/distributed.py``) and the memory estimate (``plan/memory.py``). The names are the
attribute paths of the Cells in ``gpt.py``; ``tests/model/test_params.py`` checks the table against a
built model's ``parameters_and_names()``. Layouts come from the sharding rules
(``parallel/sharding.py``), stages from the ``Layout``.

Pure Python (no MindSpore): ``gptlocal plan`` and ``gptlocal convert`` use it without importing it.
"""
from collections import namedtuple

from ..kernels.abi.layer_table import LAYER, Norm, Tensor
from ..parallel.layout import Layout, config_value
from ..parallel.sharding import layout_of, model_rules, param_layouts, split_axis
from .arch import Arch
from ..peft import read as read_pet


WORD_EMBEDDINGS = "model.embedding.word_embeddings"
OUTPUT_LAYER = "output_layer.weight"  # the untied head (untie_embeddings_and_output_weights)
POSITION_EMBEDDINGS = "model.embedding.position_embeddings"
LAYER_PREFIX = "model.layers."
# training state held as a Parameter but not a weight (saved in training checkpoints, never in model files):
# the forward counter of counter-based dropout (model/dropout.py)
DROPOUT_STEP = "dropout_step"
# a tied head's bfloat16 copy of the token table in an inference build of a bf16 model (model/gpt.py
# ``GPTLocalForCausalLM.head_table``): made from the table at build and at load, never saved or read from a file
HEAD_TABLE = "head_table"


def is_weight(name):
    """True for the parameters of the table; False for training state such as ``dropout_step`` and for what is
    made from the weights (``head_table``)."""
    return name not in (DROPOUT_STEP, HEAD_TABLE)


class ParamSpec(namedtuple("ParamSpec", "shape layout stages")):
    """shape: full shape; layout: per axis 'dp'/'mp'/1 (sharding rules); stages: pipeline stages that
    hold it (the tied token table: the first and the last)."""

    @property
    def split_axis(self):
        return split_axis(self.layout)

    def rank_size(self, mp):
        """Elements one tensor-parallel rank holds."""
        size = 1
        for length in self.shape:
            size *= length
        return size // mp if self.split_axis is not None else size


def dims(config):
    """The sizes the table needs: vocab, hidden, layers, heads, inter, positions, and ``arch`` (the model's
    ``Arch``, which holds them all; the dict is the planner's working form)."""
    arch = Arch.of(config)
    return dict(vocab=arch.vocab_size, hidden=arch.hidden_size, layers=arch.num_hidden_layers,
                heads=arch.num_attention_heads, inter=arch.inter, positions=arch.max_position_embeddings, arch=arch)


def qkv_width(d):
    """Rows of the fused QKV weight: heads query heads + 2 * num_query_groups key/value heads."""
    arch = d.get("arch") or Arch()
    groups = arch.groups or d["heads"]
    return (d["heads"] + 2 * groups) * (d["hidden"] // d["heads"])


def layer_shapes(d):
    """One block's parameters, names relative to the block, in the block's attribute order: the parts of
    ``kernels/abi/layer_table.py`` ``LAYER`` this layout has (a norm's shift under LayerNorm, a bias where ``arch`` has
    it, SwiGLU's gate where gated)."""
    h, i = d["hidden"], d["inter"]
    arch = d.get("arch") or Arch()
    sizes = {"H": h, "Q": qkv_width(d), "ND": h, "I": i, "N": d.get("heads"), "G": d.get("groups")}
    shapes = {}
    for part in LAYER:
        if part.when and not getattr(arch, part.when):
            continue
        if isinstance(part, Tensor):
            shapes[part.cell] = tuple(sizes[name] for name in part.dims)
            continue
        if isinstance(part, Norm):
            shapes[f"{part.cell}.weight"] = (h,)
            if not arch.rmsnorm:
                shapes[f"{part.cell}.bias"] = (h,)
            continue
        shapes[f"{part.cell}.weight"] = (sizes[part.out], sizes[part.inp])
        if getattr(arch, part.bias):
            shapes[f"{part.cell}.bias"] = (sizes[part.out],)
    return shapes


def table_of_dims(d, layout=None, pet=None):
    """name -> ParamSpec for sizes ``d`` (see ``dims``) under ``layout`` (default: one device); ``pet``: the PEFT
    method's settings (a ``peft`` PetSpec: LoRA, adapters, prefix) whose tensors are in the table too
    (``pet.param_shapes``): a tensor under ``model.layers.{i}.`` on layer i's stage, any other (the prefix) on
    every stage (each layer reads its rows); laid out by the method's sharding rules, replicated where none reads
    it."""
    layout = layout or Layout()
    arch = d.get("arch") or Arch()
    layouts = param_layouts(model_rules(layout, d["layers"], arch, pet))
    stage_ids = layout.stage_of_layers(d["layers"])
    last = max(stage_ids)
    shapes = {WORD_EMBEDDINGS: ((d["vocab"], d["hidden"]), [0] if arch.untied else sorted({0, last}))}
    if not arch.rope:
        shapes[POSITION_EMBEDDINGS] = ((d["positions"], d["hidden"]), [0])
    for index in range(d["layers"]):
        for name, shape in layer_shapes(d).items():
            shapes[f"{LAYER_PREFIX}{index}.{name}"] = (shape, [stage_ids[index]])
    if pet is not None:
        base = {name: shape for name, (shape, _) in shapes.items()}
        for name, shape in pet.param_shapes(d, base).items():
            layer = layer_of(name)
            shapes[name] = (shape, sorted(set(stage_ids)) if layer is None else [stage_ids[layer]])
            layouts.setdefault(name, (1,) * len(shape))
    shapes["model.final_layernorm.weight"] = ((d["hidden"],), [last])
    if not arch.rmsnorm:
        shapes["model.final_layernorm.bias"] = ((d["hidden"],), [last])
    if arch.untied:
        shapes[OUTPUT_LAYER] = ((d["vocab"], d["hidden"]), [last])
    return {name: ParamSpec(shape, layouts[name], stages) for name, (shape, stages) in shapes.items()}


def parameter_table(config, layout=None):
    """name -> ParamSpec of the model ``config`` describes (GPTLocalConfig or model_config dict);
    ``layout`` defaults to the config's own (``config.layout``, or ``Layout.of_model_config``). A
    GPTLocalConfig's PEFT settings are its own (read once); a dict's pet_config is read here."""
    d = dims(config)
    if hasattr(config, "pet_spec"):
        pet = config.pet_spec()
    else:
        pet = read_pet(config_value(config, "pet_config", None), d["layers"])
    return table_of_dims(d, layout_of(config) if layout is None else layout, pet)


def layer_of(name):
    """The layer index of a parameter name, or None for the embedding and final norm."""
    if not name.startswith(LAYER_PREFIX):
        return None
    return int(name[len(LAYER_PREFIX):].split(".", 1)[0])
